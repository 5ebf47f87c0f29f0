//! What to tell JetStream about one message, as a value.
//!
//! Handlers return an [`Outcome`]; the loops around them apply it. That keeps
//! every decision testable without a consumer loop.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use tracing::warn;

/// The disposition of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done with it: never deliver it again.
    Ack,
    /// Not done: deliver it again after the delay (at once if `None`).
    /// Like a hand-back, not sent while the client is disconnected (see
    /// [`Outcome::apply`]): the server delivers it again after its AckWait.
    Nak(Option<Duration>),
    /// Handed back as the service stops, to be delivered again at once
    /// elsewhere (a NAK). Not sent while the client is disconnected: it
    /// would only queue in a process about to exit (or wait for room in a
    /// full queue), and the server redelivers the message after its ack
    /// wait anyway.
    HandBack,
    /// Handed back like [`Outcome::HandBack`], but delivered again only
    /// after the delay: a delivery refused while this service's own pull
    /// may still be open, which a NAK for at once would send straight back
    /// into that pull, once per message it still asks for.
    HandBackAfter(Duration),
    /// Poison: never deliver it again. The reason has been recorded (a dead
    /// letter and, where possible, an `error` completion) before this is returned.
    Term(String),
    /// Not this delivery's to settle: an earlier delivery of the same
    /// message is still being handled here and will settle it. Nothing is
    /// sent.
    Leave,
}

impl Outcome {
    /// Deliver `message` again later, because a NATS request its handling
    /// needs failed (a dead letter or an `error` completion not stored, a
    /// record that could not be read): after 1 s,
    /// doubling with each delivery up to 32 s, so that a failure that lasts
    /// (a full dead-letter stream) is retried at a gentle pace instead of
    /// every second.
    pub fn retry_later(message: &jetstream::Message) -> Self {
        let delivered = message.info().map_or(1, |info| info.delivered);
        Self::Nak(Some(retry_delay(delivered)))
    }

    /// Sends the disposition to the server. A lost ack only means a
    /// redelivery, which every handler tolerates, so failures are logged.
    pub async fn apply(&self, message: &jetstream::Message) {
        let kind = match self {
            Self::Ack => AckKind::Ack,
            // A NAK queued while disconnected would reach the server after
            // the reconnect, maybe once the AckWait has run out and the
            // message gone to another consumer, whose delivery it would then
            // settle (the server checks the stream sequence, not whose
            // delivery it is): a task running elsewhere sent on to a third.
            // Unsent, the message is delivered again after the AckWait.
            Self::Nak(_) | Self::HandBack | Self::HandBackAfter(_)
                if !crate::connect::is_connected(&message.context.client()) =>
            {
                return;
            }
            Self::Nak(delay) => AckKind::Nak(*delay),
            Self::Term(_) => AckKind::Term,
            Self::HandBack => AckKind::Nak(None),
            Self::HandBackAfter(delay) => AckKind::Nak(Some(*delay)),
            Self::Leave => return,
        };
        if let Err(error) = message.ack_with(kind).await {
            warn!(%error, subject = %message.subject, "Could not send ack; the message will be redelivered.");
        }
    }
}

/// The wait before the next delivery of a message delivered `delivered`
/// times so far (see [`Outcome::retry_later`]).
fn retry_delay(delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1))
        .unwrap_or(0)
        .min(5);
    Duration::from_secs(1 << doublings)
}

/// Tells the server that `message` is still being worked on, unless the
/// client is disconnected: async-nats does not drain its command queue
/// while it reconnects, so during a long outage these periodic acks could
/// fill it, after which every later send (a hand-back at shutdown
/// included) would wait for the server to return.
/// Returns whether it was sent (or tried): a caller whose keep-alive was
/// skipped tries again after [`KEEP_ALIVE_RETRY`], so that the first one
/// after a reconnect goes out at once, not a whole period later, when an
/// outage shorter than the AckWait may already have used most of it.
pub async fn keep_alive(message: &jetstream::Message) -> bool {
    if !crate::connect::is_connected(&message.context.client()) {
        return false;
    }
    if let Err(error) = message.ack_with(AckKind::Progress).await {
        warn!(%error, subject = %message.subject, "Could not send an in-progress ack.");
    }
    true
}

/// How soon a keep-alive skipped while disconnected is tried again.
pub const KEEP_ALIVE_RETRY: Duration = Duration::from_millis(250);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_waits_a_second_then_doubles_up_to_32_seconds() {
        let waits: Vec<u64> = [0, 1, 2, 3, 6, 7, 1000]
            .into_iter()
            .map(|delivered| retry_delay(delivered).as_secs())
            .collect();
        assert_eq!(waits, [1, 1, 2, 4, 32, 32, 32]);
    }
}
