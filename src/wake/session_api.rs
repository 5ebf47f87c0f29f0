//! Posting a continuation turn: to the session API (Hermes's OpenAI-compatible
//! `POST /v1/chat/completions`), or to a generic endpoint as a signed
//! webhook ([`PostShape`]). Both go through the same ledger, locks and retries.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::webhook::{
    HEADER_WEBHOOK_ID, HEADER_WEBHOOK_SIGNATURE, HEADER_WEBHOOK_TIMESTAMP, WEBHOOK_EVENT_TYPE,
    WebhookBody, WebhookData, WebhookSecret, signature_header,
};
use crate::http_client::{is_retryable, retry_after};
use crate::protocol::CompletionEvent;

/// Where and how to post turns. Its `Debug` output leaves out the API key
/// and any password in the URL.
#[derive(Clone)]
pub struct SessionApiConfig {
    /// Base URL, e.g. `http://127.0.0.1:8642`; `/v1/chat/completions` is
    /// appended. With [`PostShape::Webhook`], the endpoint's full URL.
    pub base_url: String,
    /// Bearer token, if the API needs one.
    pub api_key: Option<String>,
    /// The `model` field of the request body.
    pub model: String,
    /// Limit for one request, connect to last byte.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for SessionApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionApiConfig")
            .field("base_url", &redacted_url(&self.base_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("model", &self.model)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

/// `url` without its user name, password, query and fragment, for logs:
/// webhook endpoints often carry their secret in the query (`?code=...`).
/// Text that is no http(s) URL is not shown, as it may be a secret in the
/// wrong place (an API key, `bob:s3cret@host/v1` with its scheme left out,
/// which reads as a URL of scheme `bob`), unless it is a `HOST:PORT[/PATH]`
/// with its scheme left out (`127.0.0.1:8642/v1`), shown so that the
/// mistake can be seen.
pub fn redacted_url(url: &str) -> String {
    let shown = is_host_and_port(url);
    match reqwest::Url::parse(url) {
        Ok(parsed) if !matches!(parsed.scheme(), "http" | "https") && shown => url.to_owned(),
        Ok(parsed) if !matches!(parsed.scheme(), "http" | "https") => {
            "<not an http(s) URL>".to_owned()
        }
        Ok(mut parsed)
            if !parsed.username().is_empty()
                || parsed.password().is_some()
                || parsed.query().is_some()
                || parsed.fragment().is_some() =>
        {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            if parsed.query().is_some() {
                parsed.set_query(Some("REDACTED"));
            }
            if parsed.fragment().is_some() {
                parsed.set_fragment(Some("REDACTED"));
            }
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) if shown => url.to_owned(),
        Err(_) => "<not a URL>".to_owned(),
    }
}

/// Whether `text` is `HOST:PORT` or `HOST:PORT/PATH`, a port of digits,
/// a host and path of letters, digits, `.`, `-` (and `/`, `_` in the path).
fn is_host_and_port(text: &str) -> bool {
    let (authority, path) = text.split_once('/').unwrap_or((text, ""));
    let Some((host, port)) = authority.split_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
    let port_ok = (1..=5).contains(&port.len()) && port.chars().all(|c| c.is_ascii_digit());
    let path_ok = path
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/'));
    host_ok && port_ok && path_ok && text.len() <= 200
}

/// How one post went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostResult {
    /// 2xx: the turn was taken.
    Delivered,
    /// Worth trying again (408, 429, 5xx, network errors); `after` is the
    /// server's `Retry-After`, if it sent one.
    Retry {
        /// What happened.
        reason: String,
        /// The server's requested delay.
        after: Option<Duration>,
    },
    /// A 4xx that will not change by retrying: dead-letter it.
    Rejected {
        /// The HTTP status.
        status: u16,
        /// The response body (truncated).
        body: String,
        /// The server's `Retry-After`, if it sent one: a 409 the wake
        /// waits out (`--conflict-patience`) is tried again after it.
        after: Option<Duration>,
    },
}

/// What a post looks like.
#[derive(Debug, Clone, Default)]
pub enum PostShape {
    /// Hermes: `POST <base>/v1/chat/completions` with the turn as a user
    /// message and the session in `X-Hermes-Session-Id`.
    #[default]
    Hermes,
    /// A generic endpoint: `POST <url>` with a JSON body describing the wake,
    /// signed per Standard Webhooks with each secret.
    Webhook {
        /// Signing secrets (several during a key rotation).
        secrets: Vec<WebhookSecret>,
    },
}

/// How the HTTP client may reach the endpoint.
#[derive(Debug, Clone, Default)]
pub struct HttpSecurity {
    /// Allow plain `http://` to hosts other than this machine.
    pub allow_insecure_http: bool,
    /// Allow plain `http://` to these hosts (names or addresses, compared
    /// without case), and to no other host but this machine's.
    pub insecure_http_hosts: Vec<String>,
    /// A CA certificate (PEM) to trust besides the system's, for an endpoint
    /// whose certificate a private CA signed.
    pub extra_ca: Option<std::path::PathBuf>,
}

/// One turn to post.
#[derive(Debug, Clone, Copy)]
pub struct Post<'a> {
    /// The session to continue.
    pub session: &'a str,
    /// The rendered turn.
    pub text: &'a str,
    /// `Idempotency-Key` (and `webhook-id`).
    pub idempotency_key: &'a str,
    /// Trace context, if the completion had one.
    pub traceparent: Option<&'a str>,
    /// `<delegation_id>.<task_index>` of every completion the turn reports
    /// (every task of a batch).
    pub reports: &'a [String],
    /// The completion events in hand.
    pub events: &'a [&'a CompletionEvent],
}

/// Header carrying the session to continue.
pub const SESSION_HEADER: &str = "X-Hermes-Session-Id";

/// A client for one session API.
#[derive(Debug, Clone)]
pub struct SessionApi {
    /// The HTTP client (keeps connections alive between posts).
    http: reqwest::Client,
    /// Full URL of the chat-completions endpoint (or the webhook), parsed
    /// once.
    url: reqwest::Url,
    /// `Bearer <key>`, prepared once.
    authorization: Option<HeaderValue>,
    /// The model name for request bodies.
    model: String,
    /// Hermes or signed webhook.
    shape: PostShape,
}

/// Why the client could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionApiError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The API key has characters a header cannot carry.
    #[error("the API key contains characters not allowed in an HTTP header")]
    BadApiKey,
    /// The URL cannot be parsed or is not http(s).
    #[error("{url:?} is not an http:// or https:// URL (give its scheme: http://HOST:PORT)")]
    BadUrl {
        /// The URL.
        url: String,
    },
    /// Plain HTTP to another machine, which would expose the turn, the API
    /// key and the signatures on the network.
    #[error(
        "{url:?} uses plain http:// to {host}, not this machine; use https://, or allow that host explicitly (--allow-insecure-http-host {host}; --allow-insecure-http allows any host)"
    )]
    InsecureUrl {
        /// The URL.
        url: String,
        /// Its host.
        host: String,
    },
    /// The extra CA certificate could not be read or parsed.
    #[error("cannot use {path} as a CA certificate: {reason}")]
    CaFile {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A Hermes base URL that already ends in the version, to which
    /// `/v1/chat/completions` would be appended.
    #[error(
        "the API URL {url:?} ends in /v1, and /v1/chat/completions is appended to it: give the server's base URL (without /v1)"
    )]
    VersionInBaseUrl {
        /// The URL as given (credentials hidden).
        url: String,
    },
    /// A Hermes base URL with a query or fragment, after which the path
    /// `/v1/chat/completions` cannot be appended.
    #[error(
        "the API URL {url:?} has a query or fragment, and /v1/chat/completions is appended to it: give the server's base URL"
    )]
    QueryInBaseUrl {
        /// The URL as given (credentials and query hidden).
        url: String,
    },
    /// A user name or password in the URL besides an API key: each becomes
    /// an `Authorization` header, and which one the server reads is
    /// anybody's guess.
    #[error(
        "the URL {url:?} holds a user name or password and an API key is given too: each would be sent as an Authorization header; give one of them"
    )]
    TwoCredentials {
        /// The URL as given (credentials hidden).
        url: String,
    },
    /// A webhook shape without a secret to sign with.
    #[error("a webhook needs at least one signing secret")]
    NoWebhookSecret,
}

impl SessionApi {
    /// Builds a client. Plain `http://` is refused unless it goes to this
    /// machine (loopback) or `security` allows it; `https://`
    /// certificates are always verified.
    pub fn new(
        config: &SessionApiConfig,
        shape: &PostShape,
        security: &HttpSecurity,
    ) -> Result<Self, SessionApiError> {
        check_url(&config.base_url, security)?;
        // Every post would go to /v1/v1/chat/completions, a 404: each wake
        // dead-lettered as refused.
        if matches!(shape, PostShape::Hermes)
            && config.base_url.trim_end_matches('/').ends_with("/v1")
        {
            return Err(SessionApiError::VersionInBaseUrl {
                url: redacted_url(&config.base_url),
            });
        }
        let parsed =
            reqwest::Url::parse(&config.base_url).map_err(|_| SessionApiError::BadUrl {
                url: redacted_url(&config.base_url),
            })?;
        if matches!(shape, PostShape::Hermes)
            && (parsed.query().is_some() || parsed.fragment().is_some())
        {
            return Err(SessionApiError::QueryInBaseUrl {
                url: redacted_url(&config.base_url),
            });
        }
        if config.api_key.is_some()
            && (!parsed.username().is_empty() || parsed.password().is_some())
        {
            return Err(SessionApiError::TwoCredentials {
                url: redacted_url(&config.base_url),
            });
        }
        if matches!(shape, PostShape::Webhook { secrets } if secrets.is_empty()) {
            return Err(SessionApiError::NoWebhookSecret);
        }
        crate::http_client::install_crypto_provider();
        let mut builder = reqwest::Client::builder();
        if let Some(path) = &security.extra_ca {
            let ca_error = |reason: String| SessionApiError::CaFile {
                path: path.clone(),
                reason,
            };
            let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
            // Parsed here: `Certificate::from_pem` defers it, and a file
            // with no certificate in it (a key, a DER file) would be taken
            // silently, then every post refused as untrusted.
            let cas =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| ca_error(e.to_string()))?;
            if cas.is_empty() {
                return Err(ca_error(
                    "no PEM certificate (-----BEGIN CERTIFICATE-----) in it".to_owned(),
                ));
            }
            builder = builder.tls_certs_merge(cas);
        }
        // A 301, 302 or 303 comes back as a rejection naming it; a
        // followed redirect must meet the same rule as the URL itself.
        let redirects = security.clone();
        let http = builder
            .redirect(crate::http_client::body_keeping_redirects(move |url| {
                check_url(url.as_str(), &redirects)
            }))
            .timeout(config.request_timeout)
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            .pool_idle_timeout(Duration::from_secs(90))
            .build()?;
        let authorization = match &config.api_key {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| SessionApiError::BadApiKey)?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let url = match shape {
            PostShape::Hermes => format!(
                "{}/v1/chat/completions",
                config.base_url.trim_end_matches('/')
            ),
            PostShape::Webhook { .. } => config.base_url.clone(),
        };
        let url = reqwest::Url::parse(&url).map_err(|_| SessionApiError::BadUrl {
            url: redacted_url(&url),
        })?;
        Ok(Self {
            http,
            url,
            authorization,
            model: config.model.clone(),
            shape: shape.clone(),
        })
    }

    /// Posts one turn.
    pub async fn post(&self, post: Post<'_>) -> PostResult {
        let request = match self.request(post) {
            Ok(request) => request,
            Err(reason) => {
                return PostResult::Rejected {
                    status: 0,
                    body: reason.to_owned(),
                    after: None,
                };
            }
        };
        let response = match request.send().await {
            Ok(response) => response,
            Err(error) => {
                // The error names the URL, query (a webhook's secret)
                // included; the service logged the redacted one at start.
                return PostResult::Retry {
                    reason: format!(
                        "request failed: {}",
                        crate::http_client::error_chain(&error.without_url())
                    ),
                    after: None,
                };
            }
        };
        let status = response.status();
        if status.is_success() {
            drain(response).await;
            return PostResult::Delivered;
        }
        let after = retry_after(response.headers());
        if is_retryable(status) {
            // Its answer is not used: the connection is closed unread,
            // rather than waiting for a slow body before the retry.
            return PostResult::Retry {
                reason: format!("session API answered {status}"),
                after,
            };
        }
        let body = error_body(response).await;
        PostResult::Rejected {
            status: status.as_u16(),
            body,
            after,
        }
    }
}

impl SessionApi {
    /// The HTTP request for `post`, in this client's shape.
    fn request(&self, post: Post<'_>) -> Result<reqwest::RequestBuilder, &'static str> {
        let mut request = self
            .http
            .post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", post.idempotency_key);
        match &self.shape {
            PostShape::Hermes => {
                let session = HeaderValue::from_bytes(post.session.as_bytes())
                    .map_err(|_| "origin session id cannot be sent in an HTTP header")?;
                let body = HermesBody {
                    model: &self.model,
                    messages: [HermesMessage {
                        role: "user",
                        content: post.text,
                    }],
                    stream: false,
                };
                request = request.header(SESSION_HEADER, session).json(&body);
            }
            PostShape::Webhook { secrets } => {
                let now = OffsetDateTime::now_utc();
                // The event's time, not the attempt's: a re-sent post is
                // the same body, which a receiver comparing bodies under
                // one key (the IETF Idempotency-Key draft answers 422 to a
                // different one) must find. Freshness is the header's.
                let happened = post
                    .events
                    .iter()
                    .map(|event| event.completed_at)
                    .max()
                    .unwrap_or(now);
                let body = WebhookBody {
                    event_type: WEBHOOK_EVENT_TYPE,
                    timestamp: happened.format(&Rfc3339).unwrap_or_default(),
                    data: WebhookData {
                        session_id: post.session,
                        idempotency_key: post.idempotency_key,
                        text: post.text,
                        completions: post.reports,
                        events: post.events.to_vec(),
                    },
                };
                let body =
                    serde_json::to_vec(&body).map_err(|_| "cannot encode the webhook body")?;
                let timestamp = now.unix_timestamp();
                let signature = signature_header(secrets, post.idempotency_key, timestamp, &body);
                request = request
                    .header(HEADER_WEBHOOK_ID, post.idempotency_key)
                    .header(HEADER_WEBHOOK_TIMESTAMP, timestamp.to_string())
                    .header(HEADER_WEBHOOK_SIGNATURE, signature)
                    .body(body);
            }
        }
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        if let Some(tp) = post.traceparent {
            request = request.header("traceparent", tp);
        }
        Ok(request)
    }
}

/// The body of a Hermes post: the turn as the user's message. Serialized
/// from borrowed parts, so the turn's text is not copied.
#[derive(Serialize)]
struct HermesBody<'a> {
    /// The model the session API should answer with.
    model: &'a str,
    /// The turn.
    messages: [HermesMessage<'a>; 1],
    /// Always `false`: the answer is awaited whole.
    stream: bool,
}

/// One chat message.
#[derive(Serialize)]
struct HermesMessage<'a> {
    /// Always `user`: the wake speaks for the delegations.
    role: &'static str,
    /// The turn's text.
    content: &'a str,
}

/// Reads the rest of a delivered post's answer (a chat completion, often
/// larger than what arrived with the headers), so that its connection can
/// carry the next post: hyper closes a connection whose answer was left
/// unread, and every wake would then open a new one (with a TLS handshake
/// over https). Bounded in size and time; the turn was accepted whatever
/// happens here.
async fn drain(mut response: reqwest::Response) {
    let reading = async {
        let mut read = 0;
        while let Ok(Some(chunk)) = response.chunk().await {
            read += chunk.len();
            if read > MAX_DRAINED_ANSWER {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_PATIENCE, reading).await;
}

/// Larger answers are left unread (their connection is closed).
const MAX_DRAINED_ANSWER: usize = 1024 * 1024;

/// The start of a refusal's or failure's answer, for the log and the dead
/// letter: at most [`MAX_ERROR_BODY`] bytes are read, within
/// [`DRAIN_PATIENCE`], however much a misbehaving server or proxy sends.
async fn error_body(response: reqwest::Response) -> String {
    use crate::http_client::{Unread, read_at_most};
    let read = tokio::time::timeout(DRAIN_PATIENCE, read_at_most(response, MAX_ERROR_BODY));
    let body = match read.await {
        Ok(Ok(body) | Err(Unread::TooLarge(body))) => body,
        Ok(Err(Unread::BrokeOff(_))) | Err(_) => Vec::new(),
    };
    let body = match std::str::from_utf8(&body) {
        Ok(text) => text,
        // Cut inside a character at the limit: the text before it.
        Err(error) if error.error_len().is_none() => {
            std::str::from_utf8(&body[..error.valid_up_to()]).unwrap_or_default()
        }
        // Not text: said so, not replaced byte by byte (which could grow it).
        Err(_) => return format!("({} bytes that are not UTF-8)", body.len()),
    };
    body.to_owned()
}

/// Most of an error answer kept.
const MAX_ERROR_BODY: usize = 2048;

/// How long a delivered post's answer may take to arrive in full before
/// its connection is given up instead.
const DRAIN_PATIENCE: Duration = Duration::from_secs(1);

/// Refuses URLs that are not http(s), and plain http to anything but
/// loopback and the hosts `security` allows.
fn check_url(url: &str, security: &HttpSecurity) -> Result<(), SessionApiError> {
    let bad = || SessionApiError::BadUrl {
        url: redacted_url(url),
    };
    let parsed = reqwest::Url::parse(url).map_err(|_| bad())?;
    let host = crate::http_client::bare_host(parsed.host_str().unwrap_or_default());
    let allowed = || {
        security.allow_insecure_http
            || crate::http_client::is_loopback(host)
            || security
                .insecure_http_hosts
                .iter()
                .any(|allowed| crate::http_client::bare_host(allowed).eq_ignore_ascii_case(host))
    };
    match parsed.scheme() {
        "https" => Ok(()),
        "http" if allowed() => Ok(()),
        "http" => Err(SessionApiError::InsecureUrl {
            url: redacted_url(url),
            host: host.to_owned(),
        }),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hermes_base_url_ending_in_the_version_is_refused_at_start() {
        let config = |base_url: &str| SessionApiConfig {
            base_url: base_url.to_owned(),
            api_key: None,
            model: "m".to_owned(),
            request_timeout: Duration::from_secs(1),
        };
        let security = HttpSecurity::default();
        for bad in ["http://127.0.0.1:8642/v1", "http://127.0.0.1:8642/gw/v1/"] {
            let error =
                SessionApi::new(&config(bad), &PostShape::Hermes, &security).expect_err(bad);
            assert!(
                matches!(error, SessionApiError::VersionInBaseUrl { .. }),
                "{error}"
            );
        }
        for good in ["http://127.0.0.1:8642", "http://127.0.0.1:8642/gw/"] {
            assert!(SessionApi::new(&config(good), &PostShape::Hermes, &security).is_ok());
        }
    }

    #[test]
    fn a_hermes_base_url_with_a_query_or_two_credentials_is_refused_at_start() {
        let config = |base_url: &str, api_key: Option<&str>| SessionApiConfig {
            base_url: base_url.to_owned(),
            api_key: api_key.map(str::to_owned),
            model: "m".to_owned(),
            request_timeout: Duration::from_secs(1),
        };
        let security = HttpSecurity::default();
        let hermes = |base_url, api_key| {
            SessionApi::new(&config(base_url, api_key), &PostShape::Hermes, &security)
        };
        for bad in [
            "http://127.0.0.1:8642/gw?tenant=a",
            "http://127.0.0.1:8642/#x",
        ] {
            let error = hermes(bad, None).expect_err(bad);
            assert!(
                matches!(error, SessionApiError::QueryInBaseUrl { .. }),
                "{error}"
            );
        }
        let error = hermes("http://bob:pw@127.0.0.1:8642", Some("key")).expect_err("two");
        assert!(
            matches!(error, SessionApiError::TwoCredentials { .. }),
            "{error}"
        );
        assert!(!error.to_string().contains("pw"), "{error}");
        assert!(hermes("http://bob:pw@127.0.0.1:8642", None).is_ok());
        // A webhook's URL is used as it is, query included.
        let webhook = PostShape::Webhook {
            secrets: vec![crate::wake::webhook::WebhookSecret::from_bytes(
                b"s".to_vec(),
            )],
        };
        assert!(
            SessionApi::new(
                &config("http://127.0.0.1:9/hook?code=c", None),
                &webhook,
                &security
            )
            .is_ok()
        );
    }

    #[test]
    fn a_url_is_logged_without_its_credentials_query_or_fragment() {
        assert_eq!(
            redacted_url("https://bob:pw@hooks.example/api/hook?code=hunter2#frag"),
            "https://hooks.example/api/hook?REDACTED#REDACTED"
        );
        assert_eq!(
            redacted_url("https://hooks.example/api/hook"),
            "https://hooks.example/api/hook"
        );
        assert_eq!(redacted_url("not a url"), "<not a URL>");
        assert_eq!(redacted_url("127.0.0.1:8642"), "127.0.0.1:8642");
        assert_eq!(redacted_url("hermes.local:8642/v1"), "hermes.local:8642/v1");
        // Secrets in the wrong place stay hidden.
        assert_eq!(redacted_url("1bob:s3cret@host"), "<not a URL>");
        assert_eq!(redacted_url("sk-proj-abc123"), "<not a URL>");
        assert_eq!(redacted_url("Bearer abc123"), "<not a URL>");
        assert_eq!(redacted_url("bob:s3cret"), "<not an http(s) URL>");
        assert_eq!(
            redacted_url("bob:s3cret@models.example/v1"),
            "<not an http(s) URL>"
        );
    }

    /// A failed post's reason, logged at every retry, does not name the
    /// URL: a webhook's secret in its query would be in every line.
    #[tokio::test]
    async fn a_failed_posts_reason_does_not_carry_the_urls_query() {
        // Port 1: nothing listens there (a port taken and let go could be
        // another test's server by the time it is called).
        let url = "http://127.0.0.1:1/hook?code=hunter2".to_owned();
        let api = SessionApi::new(
            &SessionApiConfig {
                base_url: url,
                api_key: None,
                model: "m".to_owned(),
                request_timeout: Duration::from_secs(2),
            },
            &PostShape::Webhook {
                secrets: vec![crate::wake::webhook::WebhookSecret::from_bytes(
                    b"s".to_vec(),
                )],
            },
            &HttpSecurity::default(),
        )
        .unwrap();
        let result = api
            .post(Post {
                session: "s",
                idempotency_key: "k",
                text: "t",
                traceparent: None,
                reports: &[],
                events: &[],
            })
            .await;
        let PostResult::Retry { reason, .. } = result else {
            panic!("{result:?}");
        };
        assert!(reason.starts_with("request failed"), "{reason}");
        assert!(!reason.contains("hunter2"), "{reason}");
    }

    /// A refusal whose answer never ends (a misbehaving server or proxy)
    /// is read only up to its first 2 KiB, and not for ever.
    #[tokio::test]
    async fn only_the_start_of_an_endless_refusal_is_read() {
        use axum::body::Body;
        use axum::response::IntoResponse;
        use reqwest::StatusCode;
        let endless = futures::stream::repeat_with(|| {
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(&[b'x'; 8192]))
        });
        let app = axum::Router::new().fallback(move || async move {
            (StatusCode::BAD_REQUEST, Body::from_stream(endless)).into_response()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let api = SessionApi::new(
            &SessionApiConfig {
                base_url: url,
                api_key: None,
                model: "m".to_owned(),
                request_timeout: Duration::from_secs(60),
            },
            &PostShape::Hermes,
            &HttpSecurity::default(),
        )
        .unwrap();
        let result = tokio::time::timeout(
            Duration::from_secs(20),
            api.post(Post {
                session: "s",
                text: "t",
                idempotency_key: "k",
                traceparent: None,
                reports: &[],
                events: &[],
            }),
        )
        .await
        .expect("the answer is not read to its (missing) end");
        match result {
            PostResult::Rejected { status, body, .. } => {
                assert_eq!(status, 400);
                assert_eq!(body.len(), MAX_ERROR_BODY);
            }
            other => panic!("{other:?}"),
        }
    }

    fn any_host() -> HttpSecurity {
        HttpSecurity {
            allow_insecure_http: true,
            ..HttpSecurity::default()
        }
    }

    #[test]
    fn plain_http_is_only_for_this_machine_unless_allowed() {
        let strict = HttpSecurity::default();
        for ok in [
            "https://hermes.example.com",
            "http://127.0.0.1:8642",
            "http://127.8.9.1/x",
            "http://[::1]:80",
            "http://localhost:8642",
        ] {
            assert!(check_url(ok, &strict).is_ok(), "{ok}");
        }
        for insecure in [
            "http://10.0.0.5:8642",
            "http://hermes.internal",
            "http://localhost.evil.com",
        ] {
            assert!(
                matches!(
                    check_url(insecure, &strict),
                    Err(SessionApiError::InsecureUrl { .. })
                ),
                "{insecure}"
            );
            assert!(check_url(insecure, &any_host()).is_ok(), "{insecure}");
        }
        for bad in ["ftp://host/x", "not a url", "file:///etc/passwd"] {
            assert!(
                matches!(
                    check_url(bad, &any_host()),
                    Err(SessionApiError::BadUrl { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn plain_http_to_an_allowed_host_is_accepted_and_to_any_other_refused_naming_its_host() {
        let docker_host = HttpSecurity {
            insecure_http_hosts: vec![" host.docker.internal.".into(), "[fd00::5]".into()],
            ..HttpSecurity::default()
        };
        for ok in [
            "http://host.docker.internal:8642",
            "http://HOST.Docker.Internal/v1",
            "http://host.docker.internal.:8642",
            "http://[fd00::5]:8642",
            "http://127.0.0.1:8642",
            "https://hermes.example.com",
        ] {
            assert!(check_url(ok, &docker_host).is_ok(), "{ok}");
        }
        for (refused, host) in [
            ("http://hermes.internal:8642", "hermes.internal"),
            (
                "http://host.docker.internal.evil.com",
                "host.docker.internal.evil.com",
            ),
            ("http://10.0.0.5", "10.0.0.5"),
        ] {
            let error = check_url(refused, &docker_host).expect_err(refused);
            assert!(
                error
                    .to_string()
                    .contains(&format!("--allow-insecure-http-host {host}")),
                "{error}"
            );
        }
    }

    #[test]
    fn debug_output_and_logged_urls_hide_secrets() {
        let config = SessionApiConfig {
            base_url: "https://user:hunter2@hermes.example.com/".to_owned(),
            api_key: Some("sk-secret".to_owned()),
            model: "m".to_owned(),
            request_timeout: Duration::from_secs(1),
        };
        let debug = format!("{config:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("sk-secret"),
            "{debug}"
        );
        assert!(!debug.contains("user"), "{debug}");
        assert_eq!(
            redacted_url("http://127.0.0.1:8642"),
            "http://127.0.0.1:8642"
        );
    }
}
