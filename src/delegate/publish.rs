//! Storing a delegation: its `submitted` records, then its requests, each
//! step pipelined, and what JetStream did not confirm published again.

use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use bytes::Bytes;

use super::{DelegateError, Delegator};
use crate::bus::PublishError;
use crate::protocol::{
    EventHeaders, EventKind, SubmittedRecord, TaskRequest, TooLarge, TraceParent,
};

/// The waits before publishing again what JetStream did not confirm.
const PUBLISH_RETRY_WAITS: [Duration; 2] = [Duration::from_millis(250), Duration::from_secs(1)];

impl Delegator {
    /// Checks the encoded request against the limits and the server's max payload.
    fn check_size(&self, len: usize, request: &TaskRequest) -> Result<(), TooLarge> {
        self.limits.check_body(len)?;
        // Headers count against max_payload too: ours take well under 1 KiB
        // plus the session id.
        let headers = 1024 + request.origin_session_id.as_ref().map_or(0, String::len);
        // Zero until the client has connected: the server then has the last word.
        let max_payload = self.bus.client.server_info().max_payload;
        if max_payload > 0 && len + headers > max_payload {
            return Err(TooLarge {
                what: "request with its headers (the NATS server's max_payload)",
                len: len + headers,
                max: max_payload,
            });
        }
        Ok(())
    }

    /// Writes every task's `submitted` record and waits until JetStream has
    /// stored them, then publishes every request (but those `finished`
    /// marks as finished before) and waits for all acks (each step
    /// pipelined: one round trip per step, not per task).
    ///
    /// The records go first so that no completion can exist without one: a
    /// wake that verifies origins would refuse it.
    pub(super) async fn publish_all(
        &self,
        pool: &str,
        requests: &[TaskRequest],
        sent_before: &[bool],
        trace: TraceParent,
    ) -> Result<(), DelegateError> {
        let subject = self.bus.subjects.task(pool);
        let traceparent = trace.to_string();
        let mut records = Vec::with_capacity(requests.len());
        let mut pending = Vec::with_capacity(requests.len());
        // Which requests are sent (all but those an earlier send left
        // finished or still queued), by index.
        let mut sent = Vec::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            let token = crate::worker::token_for(request.origin_session_id.as_deref());
            let record = SubmittedRecord::for_request(request, pool, Some(traceparent.clone()));
            records.push((
                self.bus
                    .subjects
                    .submitted(&token, &request.delegation_id, request.task_index),
                Self::record_headers(request, trace),
                Bytes::from(serde_json::to_vec(&record).map_err(PublishError::from)?),
            ));
            let payload = Bytes::from(serde_json::to_vec(request).map_err(PublishError::from)?);
            self.check_size(payload.len(), request)?;
            if sent_before.get(index).copied().unwrap_or(false) {
                tracing::debug!(delegation_id = %request.delegation_id, task_index = request.task_index, "Task finished, or still queued, from an earlier send; not sending it again.");
                continue;
            }
            sent.push(index);
            pending.push((subject.clone(), Self::task_headers(request, trace), payload));
        }
        let stored = match self
            .publish_stored(records, |i| Self::record_headers(&requests[i], trace))
            .await
        {
            Ok(()) => {
                self.publish_stored(pending, |i| Self::task_headers(&requests[sent[i]], trace))
                    .await
            }
            failed => failed,
        };
        let Err((subject, error)) = stored else {
            return Ok(());
        };
        // "No responders" can also mean a stream between leaders; say to
        // run `init` only when no stream takes the subject at all.
        if error.kind() == PublishErrorKind::StreamNotFound
            && self
                .bus
                .js
                .stream_by_subject(&subject)
                .await
                .is_err_and(|e| {
                    e.kind() == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound
                })
        {
            return Err(DelegateError::NoStream { subject });
        }
        Err(DelegateError::NotStored {
            delegation_id: requests[0].delegation_id.clone(),
            source: PublishError::Publish(error),
        })
    }

    /// The headers of a task's `submitted` record. Built the same way on a
    /// retry, so the retry carries the same dedupe id.
    fn record_headers(request: &TaskRequest, trace: TraceParent) -> async_nats::HeaderMap {
        let id = SubmittedRecord::id_for(&request.delegation_id, request.task_index);
        Self::headers(&id, EventKind::Submitted.ce_type(), request, trace)
    }

    /// The headers of a task request; its dedupe id is
    /// `<delegation_id>.<task_index>`, the same on every attempt.
    fn task_headers(request: &TaskRequest, trace: TraceParent) -> async_nats::HeaderMap {
        let id = format!("{}.{}", request.delegation_id, request.task_index);
        Self::headers(&id, crate::protocol::CE_TYPE_REQUESTED, request, trace)
    }

    /// The headers of a delegator's publish.
    fn headers(
        id: &str,
        ce_type: &str,
        request: &TaskRequest,
        trace: TraceParent,
    ) -> async_nats::HeaderMap {
        EventHeaders {
            id,
            ce_type,
            source: "wakebus/delegate",
            origin_session: request.origin_session_id.as_deref(),
            delegation_id: &request.delegation_id,
            task_index: request.task_index,
            traceparent: trace,
        }
        .to_header_map()
    }

    /// Publishes every message, then waits for all acks (pipelined), and
    /// publishes again what was not confirmed: up to three attempts, 250 ms
    /// and then 1 s apart, so that a stream leader election (which refuses
    /// writes for about a second) does not fail the delegation. Returns the
    /// subject and error of the last failure.
    ///
    /// A lost ack is retried with the same id: JetStream drops duplicates.
    /// The first attempt gives each message's headers away (cloning a
    /// header map costs more than building it); a retry builds message
    /// `i`'s again with `headers_again(i)`.
    async fn publish_stored(
        &self,
        messages: Vec<(String, async_nats::HeaderMap, Bytes)>,
        headers_again: impl Fn(usize) -> async_nats::HeaderMap,
    ) -> Result<(), (String, async_nats::jetstream::context::PublishError)> {
        let mut unconfirmed: Vec<_> = messages.into_iter().enumerate().collect();
        let mut last_error = None;
        for (attempt, wait) in [Duration::ZERO]
            .iter()
            .chain(&PUBLISH_RETRY_WAITS)
            .enumerate()
        {
            if unconfirmed.is_empty() {
                return Ok(());
            }
            if !wait.is_zero() {
                tokio::time::sleep(*wait).await;
            }
            let mut acks = Vec::with_capacity(unconfirmed.len());
            for (i, (subject, headers, payload)) in &mut unconfirmed {
                let headers = match attempt {
                    0 => std::mem::take(headers),
                    _ => headers_again(*i),
                };
                let ack = self
                    .bus
                    .js
                    .publish_with_headers(subject.clone(), headers, payload.clone())
                    .await;
                acks.push(ack);
            }
            // Awaited together: each ack's timeout starts when it is
            // awaited, so awaiting them in turn would make a round that
            // gets no answers last the timeout once per message.
            let results = futures::future::join_all(acks.into_iter().map(|ack| async move {
                ack?.await.and_then(|ack| {
                    crate::bus::confirm_stored(ack).map(drop).map_err(|error| {
                        async_nats::jetstream::context::PublishError::with_source(
                            PublishErrorKind::Other,
                            error,
                        )
                    })
                })
            }))
            .await;
            let mut results = results.into_iter();
            unconfirmed.retain(|(_, (subject, ..))| match results.next() {
                Some(Err(error)) => {
                    last_error = Some((subject.clone(), error));
                    true
                }
                _ => false,
            });
        }
        if unconfirmed.is_empty() {
            Ok(())
        } else {
            Err(last_error.expect("an unconfirmed message has its error"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        HEADER_CE_ID, HEADER_DELEGATION_ID, HEADER_MSG_ID, HEADER_ORIGIN_SESSION,
        HEADER_TASK_INDEX, HEADER_TRACEPARENT,
    };

    /// `publish_stored` gives the first attempt's header maps away and
    /// builds them again for a retry: JetStream drops a retried message as
    /// a duplicate only if the rebuilt headers carry the same ids.
    #[test]
    fn a_retried_publish_carries_the_first_attempts_dedupe_id_and_trace() {
        let mut request = TaskRequest::new("01JDELEGATION", "goal");
        request.task_index = 2;
        request.origin_session_id = Some("s.retry".to_owned());
        let trace = TraceParent::new_root();
        type Build = fn(&TaskRequest, TraceParent) -> async_nats::HeaderMap;
        let builders: [(Build, String); 2] = [
            (
                Delegator::record_headers,
                SubmittedRecord::id_for("01JDELEGATION", 2),
            ),
            (Delegator::task_headers, "01JDELEGATION.2".to_owned()),
        ];
        for (build, id) in builders {
            let (first, again) = (build(&request, trace), build(&request, trace));
            let value = |map: &async_nats::HeaderMap, name: &str| {
                map.get(name).map(|v| v.as_str().to_owned())
            };
            assert_eq!(value(&first, HEADER_MSG_ID).as_deref(), Some(id.as_str()));
            for name in [
                HEADER_MSG_ID,
                HEADER_CE_ID,
                HEADER_TRACEPARENT,
                HEADER_ORIGIN_SESSION,
                HEADER_DELEGATION_ID,
                HEADER_TASK_INDEX,
            ] {
                assert!(value(&first, name).is_some(), "{name} is set");
                assert_eq!(value(&first, name), value(&again, name), "{name}");
            }
        }
    }
}
