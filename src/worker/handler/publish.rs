//! Publishing a task's events, the "already done?" probe, dead letters, and
//! fitting a completion into one NATS message.

use std::time::Duration;

use async_nats::jetstream::{self};
use backon::Retryable;
use bytes::Bytes;
use tracing::{Instrument, debug, warn};

use crate::bus::PublishError;
use crate::protocol::{
    CompletionEvent, EventHeaders, EventKind, SYNC_SESSION_TOKEN, TaskRequest, TraceParent,
    session_token,
};

use super::TaskHandler;
use crate::worker::probe::ProbeError;

/// How often the "already done?" question is asked again: with waits of
/// 0.5, 1, 2, 4, 4 and 4 s, about 15 s in all, longer than a stream's leader
/// election usually takes.
const PROBE_RETRIES: usize = 6;

impl TaskHandler {
    /// Whether a completion for this task is already in the history.
    ///
    /// Asked again for about 15 s (0.5 s later, doubling up to 4 s) when
    /// the question fails or finds no stream (a stream electing a leader
    /// answers so, and elections take seconds): a redelivery often follows
    /// cluster trouble, when the question is likeliest to fail too, and an
    /// answer that never comes means running a task whose result may be
    /// stored already, a second time. The caller keeps the request alive
    /// meanwhile. A worker stopping (its grace over, `stop`) does not wait
    /// for the answer: the caller hands the request back.
    pub(super) async fn already_done(
        &self,
        request: &TaskRequest,
        stop: &tokio_util::sync::CancellationToken,
    ) -> bool {
        let subject = self.done_subject(request);
        // Asked by a probe publish: workers may not read the events stream.
        let ask = || crate::worker::probe::last_sequence_on(&self.bus, &subject);
        let asking = ask
            .retry(
                backon::ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(500))
                    .with_max_delay(Duration::from_secs(4))
                    .with_max_times(PROBE_RETRIES),
            )
            // "No stream" too: it is also what a stream between two
            // leaders answers (nobody listens on its subjects meanwhile).
            .notify(|error, delay| {
                debug!(%error, retry_in = ?delay, "Could not ask whether the completion is stored; asking again.");
            });
        let asked = tokio::select! {
            asked = asking => asked,
            () = stop.cancelled() => return false,
        };
        match asked {
            Ok(last) => last > 0,
            // Still no stream takes completions (an election that lasts,
            // or the events stream is gone: then none can be stored).
            Err(ProbeError::NoStream) => {
                warn!(
                    "Could not ask whether this task's completion is already stored: no stream answered (a leader election, or the events stream is gone); running it, which runs it a second time if it was."
                );
                false
            }
            Err(error) => {
                warn!(%error, "Could not ask whether this task's completion is already stored; running it, which runs it a second time if it was.");
                false
            }
        }
    }

    pub(super) fn done_subject(&self, request: &TaskRequest) -> String {
        let token = token_for(request.origin_session_id.as_deref());
        self.bus.subjects.event(
            &token,
            &request.delegation_id,
            request.task_index,
            EventKind::Done,
        )
    }

    /// Publishes an event and waits until JetStream has stored it.
    pub(super) async fn publish(
        &self,
        request: &TaskRequest,
        kind: EventKind,
        trace: TraceParent,
        body: &impl serde::Serialize,
    ) -> Result<(), PublishError> {
        let ack = self.send(request, kind, trace, body).await?.await?;
        crate::bus::confirm_stored(ack)?;
        Ok(())
    }

    /// Publishes a history-only event (started, progress) without waiting
    /// for JetStream's ack on the task's path: nothing depends on it being
    /// stored, and waiting would add a round trip to every task. The ack is
    /// awaited in the background, so a failure is still logged.
    ///
    /// Skipped while the client is disconnected: it would only queue in
    /// the client, and tasks reporting progress every second through a
    /// long outage would fill its queue, after which every send (the
    /// in-progress acks, the hand-backs at a stop) waits for the server.
    pub(super) async fn publish_history(
        &self,
        request: &TaskRequest,
        kind: EventKind,
        trace: TraceParent,
        body: &impl serde::Serialize,
    ) {
        if !crate::connect::is_connected(&self.bus.client) {
            debug!(
                kind = kind.as_str(),
                "NATS is unreachable; this history event is left out."
            );
            return;
        }
        match self.send(request, kind, trace, body).await {
            Ok(ack) => {
                tokio::spawn(
                    async move {
                        if let Err(error) = ack.await {
                            warn!(%error, kind = kind.as_str(), "History event was not stored.");
                        }
                    }
                    .in_current_span(),
                );
            }
            Err(error) => {
                // Only history is missing; the run itself can go on.
                warn!(%error, kind = kind.as_str(), "Could not publish a history event.");
            }
        }
    }

    /// Sends an event; the returned future resolves when JetStream stored it.
    pub(super) async fn send(
        &self,
        request: &TaskRequest,
        kind: EventKind,
        trace: TraceParent,
        body: &impl serde::Serialize,
    ) -> Result<async_nats::jetstream::context::PublishAckFuture, PublishError> {
        let token = token_for(request.origin_session_id.as_deref());
        let subject =
            self.bus
                .subjects
                .event(&token, &request.delegation_id, request.task_index, kind);
        let id = match kind {
            EventKind::Done => CompletionEvent::id_for(&request.delegation_id, request.task_index),
            EventKind::Submitted | EventKind::Started | EventKind::Progress => format!(
                "{}.{}.{}.{}",
                request.delegation_id,
                request.task_index,
                kind.as_str(),
                ulid::Ulid::new()
            ),
        };
        let headers = EventHeaders {
            id: &id,
            ce_type: kind.ce_type(),
            source: &self.source,
            origin_session: request.origin_session_id.as_deref(),
            delegation_id: &request.delegation_id,
            task_index: request.task_index,
            traceparent: trace,
        }
        .to_header_map();
        let payload = Bytes::from(serde_json::to_vec(body)?);
        Ok(self
            .bus
            .js
            .publish_with_headers(subject, headers, payload)
            .await?)
    }

    /// Copies the request, with the reason, to the dead-letter stream.
    pub(super) async fn dead_letter(
        &self,
        message: &jetstream::Message,
        reason: &str,
    ) -> Result<(), PublishError> {
        let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        let subject = self.bus.subjects.dead_letter_task(&self.config.pool);
        self.bus
            .dead_letter(subject, message, reason, &format!("dlq.task.{seq}"), "task")
            .await
    }
}

/// Room left below the server's max payload for the headers (besides the
/// origin session id, which they repeat: see [`fit_to_payload`]) and JSON
/// overhead.
const PAYLOAD_MARGIN: usize = 16 * 1024;

/// Cuts `context`, `summary`, `error`, `goal` and, last, the copied
/// `parent_session_id` and `model` (nothing limits them in a request) so
/// the completion fits in one NATS message with its headers, which repeat
/// the origin session id (up to 16 KiB): a completion that cannot be
/// published would hold its task forever. The context goes first because
/// the wake's turn text does not show it.
pub(super) fn fit_to_payload(done: &mut CompletionEvent, max_payload: usize) {
    let header_room = PAYLOAD_MARGIN + done.origin_session_id.as_ref().map_or(0, String::len);
    let budget = max_payload.saturating_sub(header_room).max(1024);
    let size = |d: &CompletionEvent| serde_json::to_vec(d).map(|v| v.len()).unwrap_or(0);
    let mut excess = size(done).saturating_sub(budget);
    let CompletionEvent {
        context,
        summary,
        error,
        goal,
        parent_session_id,
        model,
        ..
    } = done;
    for text in [
        Some(context),
        summary.as_mut(),
        error.as_mut(),
        Some(goal),
        parent_session_id.as_mut(),
        model.as_mut(),
    ]
    .into_iter()
    .flatten()
    {
        if excess == 0 {
            break;
        }
        // A text no longer than the mark would only grow.
        if text.len() <= CUT_MARK.len() {
            continue;
        }
        // JSON escaping may make a byte of text cost up to 6 bytes of body,
        // so cutting a byte of text saves at least one byte of body.
        let keep = text.len().saturating_sub(excess + CUT_MARK.len() + 1);
        let mut cut = keep;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let before = size_of_json_string(text);
        text.truncate(cut);
        text.push_str(CUT_MARK);
        excess = (excess + size_of_json_string(text)).saturating_sub(before);
    }
}

/// The max payload at which [`fit_to_payload`] cuts `done` to about half
/// its size: for a stream that refused it as too large.
pub(super) fn half_size_limit(done: &CompletionEvent) -> usize {
    let body = serde_json::to_vec(done).map_or(0, |v| v.len());
    body / 2 + PAYLOAD_MARGIN + done.origin_session_id.as_ref().map_or(0, String::len)
}

/// Ends a text [`fit_to_payload`] cut.
const CUT_MARK: &str = "\n[truncated to fit the NATS max payload]";

fn size_of_json_string(text: &str) -> usize {
    serde_json::to_vec(text)
        .map(|v| v.len())
        .unwrap_or(text.len())
}

/// The subject token for an optional origin session.
pub(crate) fn token_for(session: Option<&str>) -> String {
    session.map_or_else(|| SYNC_SESSION_TOKEN.to_owned(), session_token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Status;

    #[test]
    fn a_huge_summary_is_cut_to_fit_the_max_payload() {
        let request =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d","goal":"g"}"#).unwrap();
        let mut done = CompletionEvent::for_request(&request, Status::Completed, "completed");
        done.summary = Some("é".repeat(600_000));
        fit_to_payload(&mut done, 1024 * 1024);
        let size = serde_json::to_vec(&done).unwrap().len();
        assert!(size <= 1024 * 1024 - PAYLOAD_MARGIN, "{size}");
        assert!(
            done.summary
                .unwrap()
                .ends_with("[truncated to fit the NATS max payload]")
        );
    }

    #[test]
    fn a_huge_context_and_goal_are_cut_too_so_the_completion_always_fits() {
        let request =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d","goal":"g"}"#).unwrap();
        let mut done = CompletionEvent::for_request(&request, Status::Error, "invalid_request");
        done.context = "\"".repeat(700_000);
        done.goal = "\u{1}".repeat(300_000);
        done.error = Some("e".repeat(10));
        fit_to_payload(&mut done, 1024 * 1024);
        let size = serde_json::to_vec(&done).unwrap().len();
        assert!(size <= 1024 * 1024 - PAYLOAD_MARGIN, "{size}");
        assert!(
            done.context
                .ends_with("[truncated to fit the NATS max payload]")
        );
    }

    #[test]
    fn a_huge_parent_session_or_model_is_cut_and_the_origin_header_is_made_room_for() {
        let origin = "s".repeat(16 * 1024);
        let body = serde_json::json!({
            "version": 1, "delegation_id": "d", "goal": "g", "origin_session_id": origin,
            "parent_session_id": "p".repeat(600_000), "model": "m".repeat(600_000),
        });
        let request = TaskRequest::decode(&serde_json::to_vec(&body).unwrap()).unwrap();
        let mut done = CompletionEvent::for_request(&request, Status::Interrupted, "cancelled");
        fit_to_payload(&mut done, 1024 * 1024);
        let size = serde_json::to_vec(&done).unwrap().len();
        // The body leaves room for the headers, the origin session among them.
        assert!(
            size <= 1024 * 1024 - PAYLOAD_MARGIN - origin.len(),
            "{size}"
        );
        assert_eq!(done.origin_session_id.as_deref(), Some(origin.as_str()));
        assert!(
            done.parent_session_id
                .unwrap()
                .ends_with("[truncated to fit the NATS max payload]")
        );
    }

    #[test]
    fn a_small_completion_is_left_alone() {
        let request =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d","goal":"g"}"#).unwrap();
        let mut done = CompletionEvent::for_request(&request, Status::Completed, "completed");
        done.summary = Some("short".into());
        fit_to_payload(&mut done, 1024 * 1024);
        assert_eq!(done.summary.as_deref(), Some("short"));
    }
}
