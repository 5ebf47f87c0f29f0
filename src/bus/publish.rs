//! Publishing to JetStream until it confirms the message stored.

use async_nats::HeaderMap;
use async_nats::jetstream::publish::PublishAck;
use bytes::Bytes;

use super::{Bus, PublishError};

impl Bus {
    /// Publishes and waits until JetStream confirms the message stored
    /// (see [`confirm_stored`]).
    pub(crate) async fn publish_stored(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<PublishAck, PublishError> {
        let ack = self
            .js
            .publish_with_headers(subject, headers, payload)
            .await?
            .await?;
        confirm_stored(ack)
    }
}

/// The ack, if it confirms that the message is stored.
///
/// An ack flagged `duplicate` with sequence 0 does not: the first copy's
/// `Nats-Msg-Id` is staged, with no sequence yet. A clustered stream's
/// leader answers so to a retry that comes while the first copy is still
/// being stored, and that copy may then land; nats-server before 2.10.25
/// also answers so to every retry within the duplicate window of a first
/// publish dropped in a leader election, although nothing is stored
/// (nats-io/nats-server#6415). Taken as stored, a completion or a request
/// could be lost. Newer servers answer the second case with an error.
/// Either way the caller retries under the same id: the message is stored
/// once, at the latest once the window (2 minutes by default) has passed.
pub(crate) fn confirm_stored(ack: PublishAck) -> Result<PublishAck, PublishError> {
    if ack.duplicate && ack.sequence == 0 {
        return Err(PublishError::DuplicateOfUnstored { stream: ack.stream });
    }
    Ok(ack)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(sequence: u64, duplicate: bool) -> PublishAck {
        PublishAck {
            stream: "EVENTS".to_owned(),
            sequence,
            duplicate,
            ..PublishAck::default()
        }
    }

    #[test]
    fn a_duplicate_without_a_sequence_is_not_taken_as_stored() {
        assert!(matches!(
            confirm_stored(ack(0, true)),
            Err(PublishError::DuplicateOfUnstored { stream }) if stream == "EVENTS"
        ));
        // A real duplicate names the sequence the first copy is stored at.
        assert_eq!(confirm_stored(ack(42, true)).unwrap().sequence, 42);
        assert_eq!(confirm_stored(ack(7, false)).unwrap().sequence, 7);
    }
}
