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
/// the rest (any JSON, as a worker salvages them: an unreadable value is
/// told from a missing one).
#[derive(serde::Deserialize)]
struct Identity {
    /// The delegation id the body gives.
    #[serde(default)]
    delegation_id: Option<serde_json::Value>,
    /// The task index the body gives.
    #[serde(default)]
    task_index: Option<serde_json::Value>,
}

/// The task index of a stored request of `delegation_id`, taken as a
/// worker takes it: the body's delegation id if valid, else the
/// `Wakebus-Delegation-Id` header's; the body's task index if readable,
/// else the `Wakebus-Task-Index` header's (0 when neither gives one).
/// `None` for a request of another delegation (one whose body names
/// another runs as that one, whatever its headers say), or whose index
/// cannot be read (the worker writes it under an id of its own).
fn task_of(
    message: &async_nats::jetstream::message::StreamMessage,
    delegation_id: &str,
) -> Option<u32> {
    let header = |name| message.headers.get(name).map(|value| value.as_str());
    let valid = |id: &&str| crate::protocol::validate_delegation_id(id).is_ok();
    let body = serde_json::from_slice::<Identity>(&message.payload).ok();
    let body_id = body
        .as_ref()
        .and_then(|body| body.delegation_id.as_ref()?.as_str())
        .filter(valid);
    let id = body_id.or_else(|| header(crate::protocol::HEADER_DELEGATION_ID).filter(valid))?;
    if id != delegation_id {
        return None;
    }
    let read = |value: Option<u64>| value.and_then(|value| u32::try_from(value).ok());
    let header_index = header(crate::protocol::HEADER_TASK_INDEX);
    match (body.and_then(|body| body.task_index), header_index) {
        (Some(body), header) => read(body.as_u64()).or_else(|| read(header?.parse().ok())),
        (None, Some(header)) => read(header.parse().ok()),
        (None, None) => Some(0),
    }
}

/// Whether a stored request may be of `delegation_id`: as a worker takes
/// it, or by its `Wakebus-Delegation-Id` header alone (a re-sent request
/// may carry an old one: PROTOCOL.md, 4.2). For a cancel, which had better
/// find a request too many than miss one.
fn request_of(
    message: &async_nats::jetstream::message::StreamMessage,
    delegation_id: &str,
) -> bool {
    task_of(message, delegation_id).is_some()
        || message
            .headers
            .get(crate::protocol::HEADER_DELEGATION_ID)
            .is_some_and(|id| id.as_str() == delegation_id)
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
        self.scan_queue(|message| request_of(message, delegation_id))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(
        body: &str,
        headers: &[(&str, &str)],
    ) -> async_nats::jetstream::message::StreamMessage {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, *value);
        }
        async_nats::jetstream::message::StreamMessage {
            subject: "wakebus.task.default".into(),
            sequence: 1,
            headers: map,
            payload: bytes::Bytes::copy_from_slice(body.as_bytes()),
            time: time::OffsetDateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_queued_request_is_of_the_task_a_worker_would_take_it_for() {
        use crate::protocol::{HEADER_DELEGATION_ID as ID, HEADER_TASK_INDEX as INDEX};
        for (body, headers, expected) in [
            (r#"{"delegation_id":"d1","task_index":2}"#, &[][..], Some(2)),
            (r#"{"delegation_id":"d1"}"#, &[], Some(0)),
            // Its body names another delegation: it runs as that one.
            (
                r#"{"delegation_id":"d2","task_index":2}"#,
                &[(ID, "d1")],
                None,
            ),
            // No usable id in the body: the headers' identity.
            (r#"{"goal":""}"#, &[(ID, "d1"), (INDEX, "3")], Some(3)),
            (
                r#"{"delegation_id":"not valid!","task_index":4}"#,
                &[(ID, "d1")],
                Some(4),
            ),
            ("not json", &[(ID, "d1"), (INDEX, "1")], Some(1)),
            // An index the body gives but that cannot be read: the
            // header's, or, without one, no task of the delegation.
            (
                r#"{"delegation_id":"d1","task_index":"x"}"#,
                &[(INDEX, "5")],
                Some(5),
            ),
            (r#"{"delegation_id":"d1","task_index":-1}"#, &[], None),
        ] {
            assert_eq!(
                task_of(&stored(body, headers), "d1"),
                expected,
                "{body} {headers:?}"
            );
        }
        // A cancel looks for more: a header naming the delegation counts.
        let other_body = stored(r#"{"delegation_id":"d2"}"#, &[(ID, "d1")]);
        assert!(request_of(&other_body, "d1"));
        assert!(!request_of(&stored(r#"{"delegation_id":"d2"}"#, &[]), "d1"));
    }
}
