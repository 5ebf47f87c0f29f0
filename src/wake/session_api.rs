//! Posting a continuation turn to the session API (Hermes's OpenAI-compatible
//! `POST /v1/chat/completions`).

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use serde_json::json;

/// Where and how to post turns.
#[derive(Debug, Clone)]
pub struct SessionApiConfig {
    /// Base URL, e.g. `http://127.0.0.1:8642`; `/v1/chat/completions` is appended.
    pub base_url: String,
    /// Bearer token, if the API needs one.
    pub api_key: Option<String>,
    /// The `model` field of the request body.
    pub model: String,
    /// Limit for one request, connect to last byte.
    pub request_timeout: Duration,
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
    },
}

/// Header carrying the session to continue.
pub const SESSION_HEADER: &str = "X-Hermes-Session-Id";

/// A client for one session API.
#[derive(Debug, Clone)]
pub struct SessionApi {
    /// The HTTP client (keeps connections alive between posts).
    http: reqwest::Client,
    /// Full URL of the chat-completions endpoint.
    url: String,
    /// `Bearer <key>`, prepared once.
    authorization: Option<HeaderValue>,
    /// The model name for request bodies.
    model: String,
}

/// Why the client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SessionApiError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The API key has characters a header cannot carry.
    #[error("the API key contains characters not allowed in an HTTP header")]
    BadApiKey,
}

impl SessionApi {
    /// Builds a client.
    pub fn new(config: &SessionApiConfig) -> Result<Self, SessionApiError> {
        crate::tls::install_crypto_provider();
        let http = reqwest::Client::builder()
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
        Ok(Self {
            http,
            url: format!(
                "{}/v1/chat/completions",
                config.base_url.trim_end_matches('/')
            ),
            authorization,
            model: config.model.clone(),
        })
    }

    /// Posts one turn to `session`.
    pub async fn post(
        &self,
        session: &str,
        text: &str,
        idempotency_key: &str,
        traceparent: Option<&str>,
    ) -> PostResult {
        let Ok(session_value) = HeaderValue::from_bytes(session.as_bytes()) else {
            return PostResult::Rejected {
                status: 0,
                body: "origin session id cannot be sent in an HTTP header".to_owned(),
            };
        };
        let body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "stream": false,
        });
        let mut request = self
            .http
            .post(&self.url)
            .header(CONTENT_TYPE, "application/json")
            .header(SESSION_HEADER, session_value)
            .header("Idempotency-Key", idempotency_key)
            .json(&body);
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        if let Some(tp) = traceparent {
            request = request.header("traceparent", tp);
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(error) => {
                return PostResult::Retry {
                    reason: format!("request failed: {}", error_chain(&error)),
                    after: None,
                };
            }
        };
        let status = response.status();
        if status.is_success() {
            return PostResult::Delivered;
        }
        let after = retry_after(response.headers().get(RETRY_AFTER));
        let mut body = response.text().await.unwrap_or_default();
        if body.len() > 2048 {
            let mut cut = 2048;
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            body.truncate(cut);
        }
        if is_retryable(status) {
            PostResult::Retry {
                reason: format!("session API answered {status}"),
                after,
            }
        } else {
            PostResult::Rejected {
                status: status.as_u16(),
                body,
            }
        }
    }
}

/// 408, 429 and 5xx may succeed later; other statuses will not.
fn is_retryable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// `Retry-After` in seconds (HTTP dates are rare from APIs and ignored).
fn retry_after(value: Option<&HeaderValue>) -> Option<Duration> {
    let seconds: u64 = value?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(seconds.min(3600)))
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
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
        assert_eq!(
            retry_after(Some(&HeaderValue::from_static("7"))),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            retry_after(Some(&HeaderValue::from_static("99999"))),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(retry_after(Some(&HeaderValue::from_static("soon"))), None);
        assert_eq!(retry_after(None), None);
    }
}
