//! Copying an unusable message to a dead-letter subject, with the reason,
//! in a form that always fits in one message.

use async_nats::HeaderMap;
use async_nats::jetstream;
use tracing::warn;

use super::{Bus, PublishError};
use crate::protocol::{HEADER_DEAD_LETTER_REASON, HEADER_MSG_ID, header_safe, is_server_directive};

impl Bus {
    /// Copies `message` to the dead-letter `subject` with `reason`, deduped
    /// by `msg_id`, and waits until JetStream has stored it, counting it in
    /// `wakebus_dead_letters_total{kind}`. A duplicate counts too: it may be
    /// the retry of a first copy whose ack was lost (never counted), so an
    /// alert on the counter never misses a dead letter; a message
    /// redelivered after its dead letter was stored may count twice.
    ///
    /// The copy keeps the original headers and body when they fit in one
    /// message, but for the headers the server acts on (`Nats-*`: a
    /// `Nats-Expected-Stream` that held for the original's stream would
    /// make the copy be refused forever). A message that was already near
    /// the server's max payload would not fit with the added headers, and a
    /// dead letter that can never be stored would make the original come
    /// back forever: then the body (and, if still too large, the original
    /// headers) are left out and the
    /// reason says so.
    pub async fn dead_letter(
        &self,
        subject: String,
        message: &jetstream::Message,
        reason: &str,
        msg_id: &str,
        kind: &'static str,
    ) -> Result<(), PublishError> {
        let mut limit = self.max_payload();
        loop {
            let (headers, payload) = dead_letter_parts(
                message.headers.as_ref(),
                &message.payload,
                reason,
                msg_id,
                limit,
            );
            let size = header_bytes(&headers) + payload.len();
            match self.publish_stored(subject.clone(), headers, payload).await {
                Ok(_) => break,
                // A dead-letter stream whose max message size is below the
                // server's max payload: a copy of half the size, down to
                // one without the original's body and headers.
                Err(error) if error.is_too_large() && size < limit => {
                    warn!(%error, size, "The dead-letter stream refused the copy for its size (its max message size is below the server's max payload); storing a smaller one.");
                    limit = size / 2;
                }
                Err(error) => return Err(error),
            }
        }
        crate::ops::metrics::dead_lettered(kind);
        Ok(())
    }
}

/// Room for what a dead letter adds besides the reason itself: the note
/// saying what was left out, the two header names, the framing.
const ADDED_BESIDES_REASON: usize = 256;

/// The bytes `headers` take on the wire: `Name: value\r\n` for each value.
fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum()
}

/// The headers and body of a dead letter that fits in `max_payload`.
pub(crate) fn dead_letter_parts(
    original: Option<&HeaderMap>,
    payload: &bytes::Bytes,
    reason: &str,
    msg_id: &str,
    max_payload: usize,
) -> (HeaderMap, bytes::Bytes) {
    // The reason header, note included, is at most this reason as sent
    // (cut at 1024 characters, up to 4 KiB of UTF-8) plus the note.
    let added = header_safe(reason).len() + msg_id.len() + ADDED_BESIDES_REASON;
    let budget = max_payload.saturating_sub(added);
    let original = original.map(|headers| {
        let mut kept = HeaderMap::new();
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            if is_server_directive(name) {
                continue;
            }
            for value in values {
                kept.append(name, value.as_str());
            }
        }
        kept
    });
    let original = original.as_ref();
    let header_bytes = original.map_or(0, header_bytes);
    // What was left out goes first: the reason is cut at 1024 characters.
    let (reason, mut headers, payload) = if header_bytes + payload.len() <= budget {
        (
            reason.to_owned(),
            original.cloned().unwrap_or_default(),
            payload.clone(),
        )
    } else if header_bytes <= budget {
        (
            format!(
                "(body of {} bytes left out: too large to store again) {reason}",
                payload.len()
            ),
            original.cloned().unwrap_or_default(),
            bytes::Bytes::new(),
        )
    } else {
        (
            format!(
                "(body of {} bytes and headers of {header_bytes} bytes left out: too large to store again) {reason}",
                payload.len()
            ),
            HeaderMap::new(),
            bytes::Bytes::new(),
        )
    };
    headers.insert(HEADER_DEAD_LETTER_REASON, header_safe(&reason).as_str());
    headers.insert(HEADER_MSG_ID, msg_id);
    (headers, payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_keeps_the_original_when_it_fits() {
        let mut original = HeaderMap::new();
        original.insert("Wakebus-Delegation-Id", "d1");
        original.insert("Nats-Msg-Id", "d1.0");
        original.insert("nats-expected-stream", "WAKEBUS_TASKS");
        original.insert("Nats-TTL", "1s");
        let body = bytes::Bytes::from_static(b"{}");
        let (headers, payload) =
            dead_letter_parts(Some(&original), &body, "bad\nthing", "dlq.1", 1 << 20);
        assert_eq!(payload, body);
        assert_eq!(headers.get("Wakebus-Delegation-Id").unwrap().as_str(), "d1");
        // What the server acts on held where the original was stored, not
        // necessarily in the dead-letter stream.
        assert!(headers.get("nats-expected-stream").is_none());
        assert!(headers.get("Nats-TTL").is_none());
        assert_eq!(
            headers.get(HEADER_DEAD_LETTER_REASON).unwrap().as_str(),
            "bad thing"
        );
        assert_eq!(headers.get(HEADER_MSG_ID).unwrap().as_str(), "dlq.1");
    }

    #[test]
    fn a_dead_letter_too_large_to_store_again_leaves_the_body_out_and_says_so() {
        let body = bytes::Bytes::from(vec![b'x'; 1 << 20]);
        let (headers, payload) = dead_letter_parts(None, &body, "too big", "dlq.2", 1 << 20);
        assert!(payload.is_empty());
        let reason = headers.get(HEADER_DEAD_LETTER_REASON).unwrap().as_str();
        assert!(
            reason.starts_with("(body of 1048576 bytes left out") && reason.ends_with("too big"),
            "{reason}"
        );

        let mut huge = HeaderMap::new();
        huge.insert("X-Big", "y".repeat(1 << 20).as_str());
        let (headers, _) = dead_letter_parts(Some(&huge), &body, "too big", "dlq.3", 1 << 20);
        assert!(headers.get("X-Big").is_none());
        assert_eq!(headers.get(HEADER_MSG_ID).unwrap().as_str(), "dlq.3");
    }

    #[test]
    fn a_long_reason_in_four_byte_characters_still_fits_and_keeps_its_note() {
        let max_payload = 1 << 20;
        let body = bytes::Bytes::from(vec![b'x'; max_payload - 4200]);
        let reason = "\u{1d11e}".repeat(3000);
        let (headers, payload) = dead_letter_parts(None, &body, &reason, "dlq.4", max_payload);
        let said = headers.get(HEADER_DEAD_LETTER_REASON).unwrap().as_str();
        assert!(said.starts_with("(body of "), "{}", &said[..64]);
        // "NATS/1.0\r\n" and the closing "\r\n".
        assert!(12 + header_bytes(&headers) + payload.len() <= max_payload);
    }
}
