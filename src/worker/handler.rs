//! Handling one task request, start to finish, as a function that returns an [`Outcome`].

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::WorkerConfig;
use super::executor::{ExecError, ExecOutput, Executor, TaskEnv};
use crate::bus::{Bus, PublishError};
use crate::outcome::Outcome;
use crate::protocol::{
    CompletionEvent, EventHeaders, EventKind, HEADER_DELEGATION_ID, HEADER_ORIGIN_SESSION,
    HEADER_TASK_INDEX, HEADER_TRACEPARENT, Limits, SYNC_SESSION_TOKEN, StartedEvent, Status,
    TaskRequest, TraceParent, bounded, header, session_token, validate_delegation_id,
    validate_session_id,
};

/// Everything needed to run one task; shared by all of a worker's tasks.
#[derive(Debug)]
pub struct TaskHandler {
    /// Where to publish events.
    bus: Bus,
    /// The events stream, to look for an existing completion on redelivery.
    events: jetstream::stream::Stream,
    /// What runs the tasks.
    executor: Executor,
    /// Limits and timings.
    config: WorkerConfig,
    /// Passed on to executors.
    env: TaskEnv,
    /// `ce-source` of this worker's events.
    source: String,
}

/// Why a request could not be used, with whatever identity could be salvaged
/// for its `error` completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The reason, for the `error` completion and the dead letter.
    pub reason: String,
    /// The delegation id from the body or headers, if valid.
    pub delegation_id: Option<String>,
    /// The task index from the body or headers.
    pub task_index: u32,
    /// The origin session from the body or headers, if valid.
    pub origin_session: Option<String>,
}

impl TaskHandler {
    /// A handler publishing through `bus`.
    pub fn new(
        bus: Bus,
        events: jetstream::stream::Stream,
        executor: Executor,
        config: WorkerConfig,
        env: TaskEnv,
    ) -> Self {
        let source = format!("wakebus/worker/{}", config.instance);
        Self {
            bus,
            events,
            executor,
            config,
            env,
            source,
        }
    }

    /// Handles one delivery of a request. `stop` is cancelled when the worker
    /// shuts down and its grace period is over: the run is then stopped and
    /// the request handed back.
    pub async fn handle(&self, message: &jetstream::Message, stop: &CancellationToken) -> Outcome {
        let attempt = message
            .info()
            .map(|info| info.delivered)
            .unwrap_or(1)
            .max(1) as u64;
        let headers = message.headers.as_ref();
        let request = match decode_request(&message.payload, headers, &self.config.limits) {
            Ok(request) => request,
            Err(rejected) => return self.reject(message, rejected).await,
        };
        let trace = header(headers, HEADER_TRACEPARENT)
            .and_then(TraceParent::parse)
            .unwrap_or_else(TraceParent::new_root);
        let span = info_span!(
            "task",
            delegation_id = %request.delegation_id,
            task_index = request.task_index,
            trace_id = %trace.trace_id_hex(),
            attempt,
        );
        self.run_request(message, request, trace.child(), attempt, stop)
            .instrument(span)
            .await
    }

    async fn run_request(
        &self,
        message: &jetstream::Message,
        request: TaskRequest,
        trace: TraceParent,
        attempt: u64,
        stop: &CancellationToken,
    ) -> Outcome {
        if attempt > 1 && self.already_done(&request).await {
            info!("Completion already published by an earlier attempt; acking the redelivery.");
            return Outcome::Ack;
        }
        if attempt > self.config.max_deliver {
            let reason = format!(
                "gave up after {} deliveries (the worker running it crashed or stalled each time)",
                attempt - 1
            );
            return self
                .give_up(message, &request, trace, "max_deliveries_exceeded", reason)
                .await;
        }

        let started = StartedEvent::for_request(&request, &self.config.instance, attempt);
        if let Err(error) = self
            .publish(&request, EventKind::Started, trace, &started)
            .await
        {
            // Only history is missing; the run itself can go on.
            warn!(%error, "Could not publish the started event.");
        }

        let begun = Instant::now();
        let timeout = request
            .timeout_seconds
            .map(Duration::from_secs)
            .or(self.config.default_timeout);
        let run_stop = stop.child_token();
        let timed_out = CancellationToken::new();
        let result = {
            let run = self.executor.run(&request, &self.env, &run_stop);
            tokio::pin!(run);
            let mut keepalive = tokio::time::interval(self.config.progress_interval());
            keepalive.tick().await;
            let deadline = async {
                match timeout {
                    Some(limit) => tokio::time::sleep(limit).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    result = &mut run => break result,
                    _ = keepalive.tick() => {
                        // Tell the server we are alive so AckWait does not
                        // hand the task to another worker.
                        if let Err(error) = message.ack_with(AckKind::Progress).await {
                            warn!(%error, "Could not send an in-progress ack.");
                        }
                    }
                    () = &mut deadline, if !timed_out.is_cancelled() => {
                        warn!(timeout = ?timeout, "Task timed out; stopping it.");
                        timed_out.cancel();
                        run_stop.cancel();
                    }
                }
            }
        };
        let duration = begun.elapsed();

        let output = match result {
            Ok(output) => output,
            Err(ExecError::Stopped { partial }) if timed_out.is_cancelled() => ExecOutput {
                status: Status::Timeout,
                summary: partial,
                error: Some(format!("timed out after {}s", duration.as_secs())),
                api_calls: 0,
                exit_reason: "timeout".to_owned(),
            },
            Err(ExecError::Stopped { .. }) => {
                info!("Worker is shutting down; handing the task back.");
                return Outcome::Nak(None);
            }
            Err(ExecError::Transient(reason)) if attempt < self.config.max_deliver => {
                let delay = self.config.retry_delay(attempt);
                warn!(%reason, retry_in = ?delay, "Executor failed transiently; will retry.");
                return Outcome::Nak(Some(delay));
            }
            Err(ExecError::Transient(reason)) => {
                let reason = format!("failed {attempt} times; last error: {reason}");
                return self
                    .give_up(message, &request, trace, "max_attempts_exceeded", reason)
                    .await;
            }
        };

        let mut done = CompletionEvent::for_request(&request, output.status, &output.exit_reason);
        done.summary = output.summary;
        done.error = output.error;
        done.api_calls = output.api_calls;
        done.duration_seconds = duration.as_secs_f64();
        fit_to_payload(&mut done, self.bus.max_payload());
        match self.publish(&request, EventKind::Done, trace, &done).await {
            Ok(()) => {
                info!(status = %done.status, duration_ms = duration.as_millis() as u64, "Task done.");
                Outcome::Ack
            }
            Err(error) => {
                warn!(%error, "Could not publish the completion; the task will be redelivered.");
                Outcome::Nak(Some(Duration::from_secs(1)))
            }
        }
    }

    /// Ends a task for good: a `failed` completion (so the session still
    /// wakes) and the request in the dead-letter stream.
    async fn give_up(
        &self,
        message: &jetstream::Message,
        request: &TaskRequest,
        trace: TraceParent,
        exit_reason: &str,
        reason: String,
    ) -> Outcome {
        error!(%reason, "Giving up on task; dead-lettering the request.");
        if let Err(error) = self.dead_letter(message, &reason).await {
            warn!(%error, "Could not dead-letter the request; will retry.");
            return Outcome::Nak(Some(Duration::from_secs(1)));
        }
        let mut done = CompletionEvent::for_request(request, Status::Failed, exit_reason);
        done.error = Some(reason);
        match self.publish(request, EventKind::Done, trace, &done).await {
            Ok(()) => Outcome::Ack,
            Err(error) => {
                warn!(%error, "Could not publish the failed completion; will retry.");
                Outcome::Nak(Some(Duration::from_secs(1)))
            }
        }
    }

    /// A request that can never run: an `error` completion (woken when the
    /// session is known), a dead letter with the reason, then TERM.
    async fn reject(&self, message: &jetstream::Message, rejected: Rejected) -> Outcome {
        let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        let delegation_id = rejected
            .delegation_id
            .unwrap_or_else(|| format!("invalid-{seq}"));
        warn!(
            delegation_id = %delegation_id,
            stream_sequence = seq,
            reason = %rejected.reason,
            "Rejecting an unusable request."
        );
        if let Err(error) = self.dead_letter(message, &rejected.reason).await {
            warn!(%error, "Could not dead-letter the request; will retry.");
            return Outcome::Nak(Some(Duration::from_secs(1)));
        }
        let stand_in = TaskRequest {
            version: crate::protocol::PROTOCOL_VERSION,
            delegation_id,
            task_index: rejected.task_index,
            origin_session_id: rejected.origin_session,
            goal: String::new(),
            context: String::new(),
            role: Default::default(),
            model: None,
            toolsets: Vec::new(),
            timeout_seconds: None,
            depth: 0,
            parent_session_id: None,
            created_at: None,
        };
        let mut done = CompletionEvent::for_request(&stand_in, Status::Error, "invalid_request");
        done.error = Some(rejected.reason.clone());
        let trace = header(message.headers.as_ref(), HEADER_TRACEPARENT)
            .and_then(TraceParent::parse)
            .unwrap_or_else(TraceParent::new_root)
            .child();
        if let Err(error) = self.publish(&stand_in, EventKind::Done, trace, &done).await {
            warn!(%error, "Could not publish the error completion; will retry.");
            return Outcome::Nak(Some(Duration::from_secs(1)));
        }
        Outcome::Term(rejected.reason)
    }

    /// Whether a completion for this task is already in the history.
    async fn already_done(&self, request: &TaskRequest) -> bool {
        let subject = self.done_subject(request);
        match self.events.get_last_raw_message_by_subject(&subject).await {
            Ok(_) => true,
            Err(error) => {
                debug!(%error, "No earlier completion found.");
                false
            }
        }
    }

    fn done_subject(&self, request: &TaskRequest) -> String {
        let token = token_for(request.origin_session_id.as_deref());
        self.bus.subjects.event(
            &token,
            &request.delegation_id,
            request.task_index,
            EventKind::Done,
        )
    }

    /// Publishes an event and waits until JetStream has stored it.
    async fn publish(
        &self,
        request: &TaskRequest,
        kind: EventKind,
        trace: TraceParent,
        body: &impl serde::Serialize,
    ) -> Result<(), PublishError> {
        let token = token_for(request.origin_session_id.as_deref());
        let subject =
            self.bus
                .subjects
                .event(&token, &request.delegation_id, request.task_index, kind);
        let id = match kind {
            EventKind::Done => CompletionEvent::id_for(&request.delegation_id, request.task_index),
            EventKind::Started => format!(
                "{}.{}.started.{}",
                request.delegation_id,
                request.task_index,
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
        self.bus
            .js
            .publish_with_headers(subject, headers, payload)
            .await?
            .await?;
        Ok(())
    }

    /// Copies the request, with the reason, to the dead-letter stream.
    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        reason: &str,
    ) -> Result<(), PublishError> {
        let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        let subject = self.bus.subjects.dead_letter_task(&self.config.pool);
        self.bus
            .dead_letter(subject, message, reason, &format!("dlq.task.{seq}"))
            .await
    }
}

/// Room left for headers and JSON overhead below the server's max payload.
const PAYLOAD_MARGIN: usize = 16 * 1024;

/// Cuts `context`, `summary`, `error` and, last, `goal` so the completion
/// fits in one NATS message: a completion that cannot be published would make
/// the task run again, forever. The context goes first because the wake's
/// turn text does not show it.
fn fit_to_payload(done: &mut CompletionEvent, max_payload: usize) {
    let budget = max_payload.saturating_sub(PAYLOAD_MARGIN).max(1024);
    let size = |d: &CompletionEvent| serde_json::to_vec(d).map(|v| v.len()).unwrap_or(0);
    let mut excess = size(done).saturating_sub(budget);
    let CompletionEvent {
        context,
        summary,
        error,
        goal,
        ..
    } = done;
    for text in [Some(context), summary.as_mut(), error.as_mut(), Some(goal)]
        .into_iter()
        .flatten()
    {
        if excess == 0 {
            break;
        }
        if text.is_empty() {
            continue;
        }
        // JSON escaping may make a byte of text cost up to 6 bytes of body.
        let keep = text.len().saturating_sub(excess + 64);
        let mut cut = keep;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let before = size_of_json_string(text);
        text.truncate(cut);
        text.push_str("\n[truncated to fit the NATS max payload]");
        excess = excess.saturating_sub(before.saturating_sub(size_of_json_string(text)));
    }
}

fn size_of_json_string(text: &str) -> usize {
    serde_json::to_vec(text)
        .map(|v| v.len())
        .unwrap_or(text.len())
}

/// The subject token for an optional origin session.
pub(crate) fn token_for(session: Option<&str>) -> String {
    session.map_or_else(|| SYNC_SESSION_TOKEN.to_owned(), session_token)
}

/// Longest rejection reason kept: serde errors may quote the offending input.
const MAX_REASON_BYTES: usize = 1024;

/// Decodes a request as a worker does, salvaging its identity from body or
/// headers when it is unusable.
pub fn decode_request(
    payload: &[u8],
    headers: Option<&HeaderMap>,
    limits: &Limits,
) -> Result<TaskRequest, Rejected> {
    let origin_header = header(headers, HEADER_ORIGIN_SESSION);
    let result = TaskRequest::decode_within(payload, limits)
        .and_then(|request| request.check_origin_header(origin_header).map(|()| request));
    result.map_err(|err| {
        let loose: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
        let delegation_id = loose
            .get("delegation_id")
            .and_then(|v| v.as_str())
            .or_else(|| header(headers, HEADER_DELEGATION_ID))
            .filter(|id| validate_delegation_id(id).is_ok())
            .map(str::to_owned);
        let task_index = loose
            .get("task_index")
            .and_then(serde_json::Value::as_u64)
            .or_else(|| header(headers, HEADER_TASK_INDEX).and_then(|v| v.parse().ok()))
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0);
        // With a forged or mismatched origin, wake nobody: the body's claim
        // is exactly what cannot be trusted.
        let origin_session = match err {
            crate::protocol::DecodeError::OriginMismatch => None,
            _ => origin_header
                .or_else(|| loose.get("origin_session_id").and_then(|v| v.as_str()))
                .filter(|s| validate_session_id(s).is_ok())
                .map(str::to_owned),
        };
        Rejected {
            reason: bounded(&err.to_string(), MAX_REASON_BYTES),
            delegation_id,
            task_index,
            origin_session,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_small_completion_is_left_alone() {
        let request =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d","goal":"g"}"#).unwrap();
        let mut done = CompletionEvent::for_request(&request, Status::Completed, "completed");
        done.summary = Some("short".into());
        fit_to_payload(&mut done, 1024 * 1024);
        assert_eq!(done.summary.as_deref(), Some("short"));
    }
}
