//! Asking a running service whether it is ready, from the outside: what a
//! container health check runs (`wakebus ready`), for images that carry no
//! HTTP client of their own.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use crate::http_client::Unread;

/// The most of an answer kept: `/readyz` says one line.
const MAX_ANSWER_BYTES: usize = 4096;

/// Why a service did not say it was ready.
#[derive(Debug, thiserror::Error)]
pub enum ReadyError {
    /// It answered, with something other than 2xx (503: not ready, and why).
    #[error("{url} answered {status}: {body}")]
    NotReady {
        /// The URL asked.
        url: String,
        /// Its status.
        status: u16,
        /// What it said (the reason, from `/readyz`).
        body: String,
    },
    /// Nothing answered in time: the service is not running, or runs
    /// without `--metrics-addr`, or on another address.
    #[error("cannot reach {url}: {reason}")]
    Unreachable {
        /// The URL asked.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

/// The `/readyz` URL of a service serving its endpoints on `addr`, as
/// given to it: an unspecified address (`0.0.0.0`, `::`) is asked on
/// loopback, where a health check running beside the service reaches it.
pub fn readyz_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/readyz", SocketAddr::new(ip, addr.port()))
}

/// Asks `url` (a service's `/readyz`) within `timeout`; `Ok` with what it
/// said when it answers 2xx.
pub async fn ask(url: &str, timeout: Duration) -> Result<String, ReadyError> {
    let unreachable = |reason: String| ReadyError::Unreachable {
        url: url.to_owned(),
        reason,
    };
    crate::http_client::install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|error| unreachable(error.to_string()))?;
    let answer = client
        .get(url)
        .send()
        .await
        .map_err(|error| unreachable(without_url(error)))?;
    let status = answer.status();
    // A line (`ready`, or `not ready: <reason>`); whatever else answers
    // there is cut, not held whole.
    let body = match crate::http_client::read_at_most(answer, MAX_ANSWER_BYTES).await {
        Ok(body) | Err(Unread::TooLarge(body)) => body,
        Err(Unread::BrokeOff(error)) => return Err(unreachable(without_url(error))),
    };
    let body = String::from_utf8_lossy(&body).trim().to_owned();
    if status.is_success() {
        Ok(body)
    } else {
        Err(ReadyError::NotReady {
            url: url.to_owned(),
            status: status.as_u16(),
            body,
        })
    }
}

/// A request error and its causes, without the URL it would repeat.
fn without_url(error: reqwest::Error) -> String {
    crate::http_client::error_chain(&error.without_url())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_address_is_asked_on_loopback() {
        let url = |addr: &str| readyz_url(addr.parse().unwrap());
        assert_eq!(url("0.0.0.0:9464"), "http://127.0.0.1:9464/readyz");
        assert_eq!(url("[::]:9464"), "http://[::1]:9464/readyz");
        assert_eq!(url("10.1.2.3:80"), "http://10.1.2.3:80/readyz");
    }
}
