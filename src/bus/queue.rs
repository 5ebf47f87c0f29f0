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

/// The task a stored request is of, as a worker takes it
/// ([`crate::worker::decode_request`]): a usable request's delegation id
/// and task index; for an unusable one, those a worker salvages from its
/// body and headers and writes its `error` completion under. `None` for a
/// forged copy (its origin header contradicts its body) or one whose index
/// cannot be read or is above 999: a worker writes those under an id of
/// its own, so they end no task of the delegation.
fn identity(message: &async_nats::jetstream::message::StreamMessage) -> Option<(String, u32)> {
    // Not the worker's size limits, which it alone knows: a request over
    // the defaults but within the worker's (or the reverse) is taken here
    // by its salvaged identity, which differs from a usable request's only
    // for a body without `task_index` but with a `Wakebus-Task-Index`
    // header, or with an origin header but no session in the body (which
    // `wakebus delegate` never sends).
    let limits = crate::protocol::Limits::default();
    match crate::worker::decode_request(&message.payload, Some(&message.headers), &limits) {
        Ok(request) => Some((request.delegation_id, request.task_index)),
        Err(rejected) if rejected.forged => None,
        Err(rejected) => {
            let index = rejected
                .task_index
                .filter(|index| *index < crate::protocol::MAX_TASK_COUNT)?;
            Some((rejected.delegation_id?, index))
        }
    }
}

/// The task index of a stored request of `delegation_id`, as a worker
/// takes it ([`identity`]).
fn task_of(
    message: &async_nats::jetstream::message::StreamMessage,
    delegation_id: &str,
) -> Option<u32> {
    identity(message)
        .filter(|(id, _)| id == delegation_id)
        .map(|(_, index)| index)
}

/// Just a request's delegation id, read without decoding the rest.
#[derive(serde::Deserialize)]
struct DelegationIdOnly<'a> {
    /// Borrowed where the JSON has no escapes, as ids never need.
    #[serde(borrow)]
    delegation_id: Option<std::borrow::Cow<'a, str>>,
}

/// Whether a stored request may be of `delegation_id`: its body or its
/// `Wakebus-Delegation-Id` header names it (a re-sent request may carry an
/// old header: PROTOCOL.md, 4.2), whatever else is wrong with it. For a
/// cancel, which had better find a request too many than miss one.
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
        use crate::protocol::{
            HEADER_DELEGATION_ID as ID, HEADER_ORIGIN_SESSION as ORIGIN, HEADER_TASK_INDEX as INDEX,
        };
        let usable =
            r#"{"version":1,"delegation_id":"d1","goal":"g","task_index":2,"task_count":3}"#;
        for (body, headers, expected) in [
            (usable, &[][..], Some(2)),
            // A usable body's identity is its own, whatever the headers say.
            (
                r#"{"version":1,"delegation_id":"d1","goal":"g"}"#,
                &[(INDEX, "3")],
                Some(0),
            ),
            (usable, &[(ID, "d2")], Some(2)),
            // Its body names another delegation: it runs as that one.
            (
                r#"{"delegation_id":"d2","task_index":2}"#,
                &[(ID, "d1")],
                None,
            ),
            // Unusable: the identity a worker salvages, body first.
            (r#"{"delegation_id":"d1","task_index":2}"#, &[], Some(2)),
            (r#"{"goal":""}"#, &[(ID, "d1"), (INDEX, "3")], Some(3)),
            (
                r#"{"delegation_id":"not valid!","task_index":4}"#,
                &[(ID, "d1")],
                Some(4),
            ),
            ("not json", &[(ID, "d1"), (INDEX, "1")], Some(1)),
            (
                r#"{"delegation_id":"d1","task_index":"x"}"#,
                &[(INDEX, "5")],
                Some(5),
            ),
            // Written by the worker under an id of its own: an index that
            // cannot be read or is above 999, or a forged copy.
            (r#"{"delegation_id":"d1","task_index":-1}"#, &[], None),
            (r#"{"delegation_id":"d1","task_index":1000}"#, &[], None),
            (
                r#"{"version":1,"delegation_id":"d1","goal":"g","origin_session_id":"s.a"}"#,
                &[(ORIGIN, "s.b")],
                None,
            ),
        ] {
            assert_eq!(
                task_of(&stored(body, headers), "d1"),
                expected,
                "{body} {headers:?}"
            );
        }
        // A cancel looks for more: its body or a header naming the
        // delegation counts, whatever else is wrong with it.
        let other_body = stored(r#"{"delegation_id":"d2"}"#, &[(ID, "d1")]);
        assert!(request_of(&other_body, "d1"));
        let unreadable_index = stored(r#"{"delegation_id":"d1","task_index":-1}"#, &[]);
        assert!(request_of(&unreadable_index, "d1"));
        assert!(!request_of(&stored(r#"{"delegation_id":"d2"}"#, &[]), "d1"));
    }
}
