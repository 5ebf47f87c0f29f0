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

/// Just a request's delegation id and task index, read without decoding
/// the rest.
#[derive(serde::Deserialize)]
struct DelegationIdOnly<'a> {
    /// Borrowed where the JSON has no escapes, as ids never need.
    #[serde(borrow)]
    delegation_id: Option<std::borrow::Cow<'a, str>>,
    /// Which task of the delegation it is (0 when left out).
    #[serde(default)]
    task_index: Option<u32>,
}

/// The task index of a stored request of `delegation_id`, if it is one:
/// by its body, whose id and index are those a worker runs it under, or
/// by its `Wakebus-Delegation-Id` and `Wakebus-Task-Index` headers (the
/// headers are optional for publishers, and a re-sent request may carry
/// old ones: PROTOCOL.md, 4.2).
fn task_of(
    message: &async_nats::jetstream::message::StreamMessage,
    delegation_id: &str,
) -> Option<u32> {
    let body = serde_json::from_slice::<DelegationIdOnly<'_>>(&message.payload).ok();
    if let Some(body) = &body
        && body.delegation_id.as_deref() == Some(delegation_id)
    {
        return Some(body.task_index.unwrap_or(0));
    }
    let header = |name| message.headers.get(name).map(|value| value.as_str());
    (header(crate::protocol::HEADER_DELEGATION_ID) == Some(delegation_id)).then(|| {
        header(crate::protocol::HEADER_TASK_INDEX)
            .and_then(|index| index.parse().ok())
            .unwrap_or(0)
    })
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
        self.scan_queue(|message| task_of(message, delegation_id).is_some())
            .await
    }

    /// The task indexes of `delegation_id`'s requests in the task queue
    /// (waiting, or running and not yet acknowledged), or `None` when it
    /// cannot tell, as [`Self::find_queued`].
    pub(crate) async fn queued_tasks(
        &self,
        delegation_id: &str,
    ) -> Result<Option<std::collections::BTreeSet<u32>>, async_nats::Error> {
        let mut queued = std::collections::BTreeSet::new();
        let read = self
            .scan_queue(|message| {
                queued.extend(task_of(message, delegation_id));
                false
            })
            .await?;
        Ok(read.map(|_| queued))
    }

    /// Reads the requests stored in the task queue, in order, until `found`
    /// says yes of one: `Some(true)` then, `Some(false)` when none was,
    /// `None` when the queue is longer than the scan limit, or the scan
    /// takes longer than its budget.
    async fn scan_queue(
        &self,
        mut found: impl FnMut(&async_nats::jetstream::message::StreamMessage) -> bool,
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
            if found(&message) {
                return Ok(Some(true));
            }
            from = message.sequence + 1;
        }
        Ok(Some(false))
    }
}
