//! Signed webhook posts, per the Standard Webhooks specification
//! (<https://www.standardwebhooks.com>): `webhook-id`, `webhook-timestamp` and
//! `webhook-signature` headers, the signature being HMAC-SHA256 over
//! `<id>.<timestamp>.<body>` with a `whsec_` secret.
//!
//! During a key rotation the wake service holds several secrets and sends
//! one signature per secret, so a receiver that knows either the old or the
//! new secret accepts the post.

use std::fmt;
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;

use crate::protocol::CompletionEvent;

/// Header carrying the message id (the post's idempotency key).
pub const HEADER_WEBHOOK_ID: &str = "webhook-id";
/// Header carrying the send time, in whole seconds since the Unix epoch.
pub const HEADER_WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
/// Header carrying the space-separated `v1,<base64>` signatures.
pub const HEADER_WEBHOOK_SIGNATURE: &str = "webhook-signature";
/// The `type` of every webhook body wakebus sends.
pub const WEBHOOK_EVENT_TYPE: &str = "wakebus.wake";

const SECRET_PREFIX: &str = "whsec_";

/// A signing secret: the key bytes of a `whsec_<base64>` string.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret {
    /// The HMAC key.
    key: Vec<u8>,
}

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(<redacted>)")
    }
}

/// Why a secret string was refused. Never contains the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The string does not start with `whsec_`.
    #[error("a webhook secret must start with `whsec_` followed by base64")]
    MissingPrefix,
    /// The part after the prefix is not base64, or is empty.
    #[error("the part of the webhook secret after `whsec_` is not base64 of at least one byte")]
    NotBase64,
}

impl FromStr for WebhookSecret {
    type Err = SecretError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let encoded = text
            .trim()
            .strip_prefix(SECRET_PREFIX)
            .ok_or(SecretError::MissingPrefix)?;
        let key = BASE64.decode(encoded).map_err(|_| SecretError::NotBase64)?;
        if key.is_empty() {
            return Err(SecretError::NotBase64);
        }
        Ok(Self { key })
    }
}

impl WebhookSecret {
    /// A secret with these key bytes.
    pub fn from_bytes(key: impl Into<Vec<u8>>) -> Self {
        Self { key: key.into() }
    }

    /// `v1,<base64 of HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`.
    fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        // HMAC accepts keys of any length; this cannot fail.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
    }
}

/// The `webhook-signature` value: one signature per secret, space-separated.
pub fn signature_header(
    secrets: &[WebhookSecret],
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> String {
    secrets
        .iter()
        .map(|secret| secret.sign(id, timestamp, body))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The body of a webhook post.
#[derive(Debug, Serialize)]
pub(crate) struct WebhookBody<'a> {
    /// Always [`WEBHOOK_EVENT_TYPE`].
    #[serde(rename = "type")]
    pub(crate) event_type: &'static str,
    /// When the newest completion the post carries ended (its
    /// `completed_at`), RFC 3339: the same on every retry of the post (a
    /// combined post re-sent in doubt with fewer completions in hand, or a
    /// batch's, may carry other events, and then another time).
    pub(crate) timestamp: String,
    /// The wake itself.
    pub(crate) data: WebhookData<'a>,
}

/// What a webhook post reports.
#[derive(Debug, Serialize)]
pub(crate) struct WebhookData<'a> {
    /// The session to continue.
    pub(crate) session_id: &'a str,
    /// Same as the `webhook-id` header.
    pub(crate) idempotency_key: &'a str,
    /// The continuation turn, exactly as the Hermes shape would post it.
    pub(crate) text: &'a str,
    /// `<delegation_id>.<task_index>` of every completion the turn reports.
    pub(crate) completions: &'a [String],
    /// The completion events in hand (all of them, except when re-sending a
    /// combined post that ended in doubt: then those redelivered).
    pub(crate) events: Vec<&'a CompletionEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_need_the_prefix_and_base64_and_never_show_themselves() {
        let secret: WebhookSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".parse().unwrap();
        assert_eq!(format!("{secret:?}"), "WebhookSecret(<redacted>)");
        assert_eq!(
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".parse::<WebhookSecret>(),
            Err(SecretError::MissingPrefix)
        );
        assert_eq!(
            "whsec_not base64!".parse::<WebhookSecret>(),
            Err(SecretError::NotBase64)
        );
        assert_eq!(
            "whsec_".parse::<WebhookSecret>(),
            Err(SecretError::NotBase64)
        );
    }

    #[test]
    fn the_signature_matches_the_standard_webhooks_reference_example() {
        // The example of the Standard Webhooks reference libraries.
        let secret: WebhookSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".parse().unwrap();
        let signature = signature_header(
            &[secret],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn several_secrets_give_several_signatures() {
        let a = WebhookSecret::from_bytes(b"a".to_vec());
        let b = WebhookSecret::from_bytes(b"b".to_vec());
        let both = signature_header(&[a.clone(), b.clone()], "id", 1, b"{}");
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], signature_header(&[a], "id", 1, b"{}"));
        assert_eq!(parts[1], signature_header(&[b], "id", 1, b"{}"));
    }
}
