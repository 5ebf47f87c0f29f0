//! Whether a delegation's request is still in the task queue (waiting, or
//! running and not yet acknowledged), read without a consumer.

use async_nats::jetstream::stream;

use super::Bus;

/// How many stored requests [`Bus::is_queued`] reads at most: with more in
/// the queue it assumes the answer is yes.
const QUEUE_SCAN_LIMIT: u64 = 10_000;

/// How long [`Bus::is_queued`] reads at most (one round trip a request, so
/// a slow or distant server could make the scan take minutes): then too it
/// assumes the answer is yes.
const QUEUE_SCAN_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

/// Just a request's delegation id, read without decoding the rest.
#[derive(serde::Deserialize)]
struct DelegationIdOnly<'a> {
    /// Borrowed where the JSON has no escapes, as ids never need.
    #[serde(borrow)]
    delegation_id: Option<std::borrow::Cow<'a, str>>,
}

/// Whether a stored request is of `delegation_id`: by its
/// `Wakebus-Delegation-Id` header, or by its body, whose id is the one a
/// worker runs it under (the header is optional for publishers, and a
/// re-sent request may carry an old one: PROTOCOL.md, 4.2).
fn request_of(
    message: &async_nats::jetstream::message::StreamMessage,
    delegation_id: &str,
) -> bool {
    message
        .headers
        .get(crate::protocol::HEADER_DELEGATION_ID)
        .is_some_and(|id| id.as_str() == delegation_id)
        || serde_json::from_slice::<DelegationIdOnly<'_>>(&message.payload)
            .is_ok_and(|body| body.delegation_id.as_deref() == Some(delegation_id))
}

impl Bus {
    /// Whether a request of `delegation_id` is in the task queue: waiting,
    /// or running and not yet acknowledged (work-queue retention removes a
    /// request only when it is acked). Also true when the queue is longer
    /// than the scan limit: callers use it to avoid a second copy, and
    /// better a skip too many than a task that runs twice.
    pub(crate) async fn is_queued(&self, delegation_id: &str) -> Result<bool, async_nats::Error> {
        Ok(self.find_queued(delegation_id).await?.unwrap_or(true))
    }

    /// Whether a request of `delegation_id` is in the task queue, or `None`
    /// when the queue is longer than the scan limit, or the scan takes
    /// longer than its budget, and it cannot tell.
    pub(crate) async fn find_queued(
        &self,
        delegation_id: &str,
    ) -> Result<Option<bool>, async_nats::Error> {
        let mut tasks = self.js.get_stream(self.subjects.tasks_stream()).await?;
        let state = tasks.info().await?.state.clone();
        // Counted in stored messages, not sequences: acked requests leave
        // gaps, which the walk below skips in one request each time.
        if state.messages > QUEUE_SCAN_LIMIT {
            return Ok(None);
        }
        let all = self.subjects.tasks_all();
        let mut from = state.first_sequence.max(1);
        let deadline = tokio::time::Instant::now() + QUEUE_SCAN_BUDGET;
        for _ in 0..state.messages {
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            let next = tasks
                .raw_message_builder()
                .sequence(from)
                .next_by_subject(&all)
                .send()
                .await;
            let message = match next {
                Ok(message) if message.sequence <= state.last_sequence => message,
                Ok(_) => break,
                Err(error) if error.kind() == stream::LastRawMessageErrorKind::NoMessageFound => {
                    break;
                }
                Err(error) => return Err(error.into()),
            };
            if request_of(&message, delegation_id) {
                return Ok(Some(true));
            }
            from = message.sequence + 1;
        }
        Ok(Some(false))
    }
}
