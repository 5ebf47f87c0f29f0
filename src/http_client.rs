//! What the HTTP clients (the session API's, the LLM executor's, the OTLP
//! exporter's) share: the TLS provider, the plain-http rule, bounded reads.

use std::sync::Once;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};

/// Installs `ring` as the process's rustls crypto provider (once).
///
/// NATS already brings `ring`; using it for HTTPS too avoids a second crypto
/// library in the build.
pub(crate) fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Fails only if another provider was installed first, which is fine.
        #[expect(
            deprecated,
            reason = "rustls 0.23.48 deprecates ring for lacking post-quantum key exchange; \
                      ring is the provider async-nats's TLS to NATS uses, and aws-lc-rs \
                      would add a C library to every build"
        )]
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// An error and its causes, one after the other (`connection refused`
/// rather than only `error sending request`).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Redirects followed for one request (reqwest's own default).
const MAX_REDIRECTS: usize = 10;

/// The redirect policy of a client that POSTs: only 307 and 308 keep the
/// method and the body; a client follows 301, 302 and 303 with a GET
/// without the body, whose answer would be taken for the POST's (a 2xx
/// for a delivered turn, a 404 or 405 for a refusal). Those come back as
/// themselves. A redirect followed goes where `allowed` lets it (it sends
/// the body again), at most [`MAX_REDIRECTS`] times.
pub(crate) fn body_keeping_redirects<E>(
    allowed: impl Fn(&reqwest::Url) -> Result<(), E> + Send + Sync + 'static,
) -> reqwest::redirect::Policy
where
    E: std::error::Error + Send + Sync + 'static,
{
    reqwest::redirect::Policy::custom(move |attempt| {
        let keeps_body = matches!(
            attempt.status(),
            reqwest::StatusCode::TEMPORARY_REDIRECT | reqwest::StatusCode::PERMANENT_REDIRECT
        );
        if !keeps_body {
            attempt.stop()
        } else if attempt.previous().len() > MAX_REDIRECTS {
            // `previous` starts with the URL called, which is not a
            // redirect (as in reqwest's own limit).
            attempt.error("too many redirects")
        } else if let Err(refused) = allowed(attempt.url()) {
            attempt.error(refused)
        } else {
            attempt.follow()
        }
    })
}

/// A host name or address without brackets, surrounding blanks or the
/// trailing dot of a fully qualified name.
pub(crate) fn bare_host(host: &str) -> &str {
    host.trim().trim_end_matches('.').trim_matches(['[', ']'])
}

/// Whether `host` (bare) is this machine: a loopback address or
/// `localhost`, which plain http may reach without crossing a network.
pub(crate) fn is_loopback(host: &str) -> bool {
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// Why an answer was not read whole.
pub(crate) enum Unread {
    /// It is longer than the limit; its start.
    TooLarge(Vec<u8>),
    /// Reading it failed (a timeout, a dropped connection).
    BrokeOff(reqwest::Error),
}

/// The body of `response`, if it is at most `limit` bytes: an endless or
/// huge answer (a misbehaving server or proxy) is cut there, never held
/// whole.
pub(crate) async fn read_at_most(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, Unread> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(Unread::BrokeOff)? {
        if body.len() + chunk.len() > limit {
            body.extend_from_slice(&chunk[..limit - body.len()]);
            return Err(Unread::TooLarge(body));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// 408, 429 and 5xx may succeed later; other statuses will not.
pub(crate) fn is_retryable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// The most a `Retry-After` is honoured for: an endpoint asking for more
/// is asked again after an hour.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// An answer's `Retry-After`, in seconds, at most [`MAX_RETRY_AFTER`]
/// (HTTP dates are rare from APIs and ignored).
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    #[test]
    fn only_timeouts_throttling_and_server_errors_are_retried() {
        for code in [408, 429, 500, 502, 503, 504] {
            assert!(is_retryable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [400, 401, 403, 404, 409, 422] {
            assert!(!is_retryable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }

    #[test]
    fn retry_after_seconds_are_honoured_and_capped() {
        let after = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(RETRY_AFTER, HeaderValue::from_static(value));
            retry_after(&headers)
        };
        assert_eq!(after("7"), Some(Duration::from_secs(7)));
        assert_eq!(after(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(after("99999"), Some(MAX_RETRY_AFTER));
        assert_eq!(after("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }
}
