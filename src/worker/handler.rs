//! Handling one task request, start to finish, as a function that returns an [`Outcome`].

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::WorkerConfig;
use super::cancel::{CancelRegistry, StopReason};
use super::executor::{ExecError, ExecOutput, Executor, Progress, TaskEnv};
use crate::bus::{Bus, PublishError};
use crate::ops::metrics as m;
use crate::outcome::Outcome;
use crate::protocol::{
    CompletionEvent, EventHeaders, EventKind, HEADER_DELEGATION_ID, HEADER_ORIGIN_SESSION,
    HEADER_TASK_INDEX, HEADER_TRACEPARENT, Limits, ProgressEvent, SYNC_SESSION_TOKEN, StartedEvent,
    Status, TaskRequest, TraceParent, bounded, header, session_token, validate_delegation_id,
    validate_session_id,
};

/// Everything needed to run one task; shared by all of a worker's tasks.
#[derive(Debug)]
pub(crate) struct TaskHandler {
    /// Where to publish events.
    bus: Bus,
    /// What runs the tasks.
    executor: Executor,
    /// Limits and timings.
    config: WorkerConfig,
    /// Passed on to executors.
    env: TaskEnv,
    /// `ce-source` of this worker's events.
    source: String,
    /// Cancel records and the runs they may stop.
    cancels: Arc<CancelRegistry>,
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
    /// The batch the task belongs to, as far as the body says, so that an
    /// unusable member still completes its batch.
    pub batch: Option<(u32, crate::protocol::WakeMode, bool)>,
}

impl TaskHandler {
    /// A handler publishing through `bus`.
    pub(crate) fn new(
        bus: Bus,
        executor: Executor,
        config: WorkerConfig,
        env: TaskEnv,
        cancels: Arc<CancelRegistry>,
    ) -> Self {
        let source = format!("wakebus/worker/{}", config.instance);
        Self {
            bus,
            executor,
            config,
            env,
            source,
            cancels,
        }
    }

    /// Handles one delivery of a request. `stop` is cancelled when the worker
    /// shuts down and its grace period is over: the run is then stopped and
    /// the request handed back.
    pub(crate) async fn handle(
        &self,
        message: &jetstream::Message,
        stop: &CancellationToken,
    ) -> Outcome {
        let attempt = message
            .info()
            .map(|info| info.delivered)
            .unwrap_or(1)
            .max(1) as u64;
        let _in_flight = m::InFlight::task(&self.config.pool);
        if attempt > 1 {
            m::task_redelivered(&self.config.pool);
        }
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
        let next = crate::telemetry::hop(&span, Some(trace));
        self.run_request(message, request, next, attempt, stop)
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
        if request.depth > self.config.max_depth {
            let mut done = CompletionEvent::for_request(&request, Status::Error, "depth_limit");
            done.error = Some(format!(
                "Delegation depth limit reached: depth {} is above the maximum of {}",
                request.depth, self.config.max_depth
            ));
            warn!(
                depth = request.depth,
                max = self.config.max_depth,
                "Refusing a request nested too deep."
            );
            return match self.publish(&request, EventKind::Done, trace, &done).await {
                Ok(()) => Outcome::Ack,
                Err(error) => {
                    warn!(%error, "Could not publish the error completion; will retry.");
                    Outcome::Nak(Some(Duration::from_secs(1)))
                }
            };
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

        // Register before looking for a cancel record: a cancel either is
        // recorded already or finds this run registered when it broadcasts.
        let run_stop = stop.child_token();
        let reason = Arc::new(OnceLock::new());
        let stored_at = message
            .info()
            .map(|info| info.published)
            .unwrap_or_else(|_| OffsetDateTime::now_utc());
        let _registered = match self.cancels.register(
            &request.delegation_id,
            &token_for(request.origin_session_id.as_deref()),
            stored_at,
            run_stop.clone(),
            reason.clone(),
        ) {
            Ok(guard) => guard,
            Err(record) => {
                info!(
                    silent = record.silent,
                    "Task was cancelled before it started; not running it."
                );
                let mut done =
                    CompletionEvent::for_request(&request, Status::Interrupted, "cancelled");
                done.error = Some("cancelled before it started".to_owned());
                done.suppress_wake = record.silent;
                return self.finish(&request, trace, done).await;
            }
        };

        let started = StartedEvent::for_request(&request, &self.config.instance, attempt);
        self.publish_history(&request, EventKind::Started, trace, &started)
            .await;
        m::task_started(&self.config.pool);

        let begun = Instant::now();
        let result = self
            .execute(message, &request, &run_stop, &reason, trace)
            .await;
        let duration = begun.elapsed();
        let mut suppress_wake = false;
        let output = match (result, reason.get()) {
            (Ok(output), _) => output,
            (Err(ExecError::Stopped { partial }), Some(StopReason::Timeout)) => ExecOutput {
                status: Status::Timeout,
                summary: partial,
                error: Some(format!("timed out after {}s", duration.as_secs())),
                api_calls: 0,
                tokens: None,
                truncated: false,
                exit_reason: "timeout".to_owned(),
            },
            (Err(ExecError::Stopped { partial }), Some(StopReason::Cancelled { silent })) => {
                suppress_wake = *silent;
                ExecOutput {
                    status: Status::Interrupted,
                    summary: partial,
                    error: Some("cancelled while running".to_owned()),
                    api_calls: 0,
                    tokens: None,
                    truncated: false,
                    exit_reason: "cancelled".to_owned(),
                }
            }
            (Err(ExecError::Stopped { .. }), None) => {
                info!("Worker is shutting down; handing the task back.");
                return Outcome::Nak(None);
            }
            (Err(ExecError::Transient(reason)), _) if attempt < self.config.max_deliver => {
                let delay = self.config.retry_delay(attempt);
                warn!(%reason, retry_in = ?delay, "Executor failed transiently; will retry.");
                m::task_retried(&self.config.pool);
                return Outcome::Nak(Some(delay));
            }
            (Err(ExecError::Transient(reason)), _) => {
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
        if let Some((prompt, completion)) = output.tokens {
            done.prompt_tokens = Some(prompt);
            done.completion_tokens = Some(completion);
        }
        done.duration_seconds = duration.as_secs_f64();
        done.suppress_wake = suppress_wake;
        done.truncated = output.truncated;
        fit_to_payload(&mut done, self.bus.max_payload());
        info!(status = %done.status, duration_ms = duration.as_millis() as u64, "Task done.");
        self.finish(&request, trace, done).await
    }

    /// Runs the executor, sending in-progress acks while it runs and stopping
    /// it when its time limit passes.
    async fn execute(
        &self,
        message: &jetstream::Message,
        request: &TaskRequest,
        run_stop: &CancellationToken,
        reason: &OnceLock<StopReason>,
        trace: TraceParent,
    ) -> Result<ExecOutput, ExecError> {
        let timeout = request
            .timeout_seconds
            .map(Duration::from_secs)
            .or(self.config.default_timeout);
        let (progress, mut reports) = Progress::channel();
        let run = self.executor.run(request, &self.env, run_stop, &progress);
        tokio::pin!(run);
        // Progress is published at most once per interval, newest message first.
        let throttle = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(throttle);
        let mut unpublished = false;
        let mut keepalive = tokio::time::interval(self.config.progress_interval());
        keepalive.tick().await;
        let deadline = async {
            match timeout {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let mut deadline_passed = false;
        loop {
            tokio::select! {
                result = &mut run => {
                    // The last report before the end still makes the history.
                    if unpublished || reports.has_changed().unwrap_or(false) {
                        self.publish_progress(request, &mut reports, trace).await;
                    }
                    return result;
                }
                _ = keepalive.tick() => {
                    // Tell the server we are alive so AckWait does not hand
                    // the task to another worker.
                    if let Err(error) = message.ack_with(AckKind::Progress).await {
                        warn!(%error, "Could not send an in-progress ack.");
                    }
                }
                Ok(()) = reports.changed() => {
                    unpublished = true;
                    if throttle.is_elapsed() {
                        self.publish_progress(request, &mut reports, trace).await;
                        unpublished = false;
                        throttle.as_mut().reset(tokio::time::Instant::now() + PROGRESS_INTERVAL);
                    }
                }
                () = &mut throttle, if unpublished => {
                    self.publish_progress(request, &mut reports, trace).await;
                    unpublished = false;
                    throttle.as_mut().reset(tokio::time::Instant::now() + PROGRESS_INTERVAL);
                }
                () = &mut deadline, if !deadline_passed => {
                    deadline_passed = true;
                    if reason.set(StopReason::Timeout).is_ok() {
                        warn!(timeout = ?timeout, "Task timed out; stopping it.");
                        run_stop.cancel();
                    }
                }
            }
        }
    }

    /// Publishes the newest progress report (history only: failures are logged).
    async fn publish_progress(
        &self,
        request: &TaskRequest,
        reports: &mut tokio::sync::watch::Receiver<Option<String>>,
        trace: TraceParent,
    ) {
        let Some(message) = reports.borrow_and_update().clone() else {
            return;
        };
        let event = ProgressEvent::for_request(request, &self.config.instance, message);
        self.publish_history(request, EventKind::Progress, trace, &event)
            .await;
    }

    /// Publishes the completion; acks the request only once it is stored.
    async fn finish(
        &self,
        request: &TaskRequest,
        trace: TraceParent,
        done: CompletionEvent,
    ) -> Outcome {
        match self.publish(request, EventKind::Done, trace, &done).await {
            Ok(()) => {
                let ran = Duration::from_secs_f64(done.duration_seconds);
                m::task_completed(&self.config.pool, done.status, ran);
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
        m::dead_lettered("task");
        let mut done = CompletionEvent::for_request(request, Status::Failed, exit_reason);
        done.error = Some(reason);
        match self.publish(request, EventKind::Done, trace, &done).await {
            Ok(()) => {
                m::task_completed(&self.config.pool, Status::Failed, Duration::ZERO);
                Outcome::Ack
            }
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
        m::dead_lettered("task");
        let mut stand_in = TaskRequest::new(delegation_id, String::new());
        stand_in.task_index = rejected.task_index;
        stand_in.origin_session_id = rejected.origin_session;
        if let Some((count, mode, notify)) = rejected.batch {
            stand_in.task_count = count;
            stand_in.wake_mode = mode;
            stand_in.notify_early_failure = notify;
        }
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
        m::task_completed(&self.config.pool, Status::Error, Duration::ZERO);
        Outcome::Term(rejected.reason)
    }

    /// Whether a completion for this task is already in the history.
    async fn already_done(&self, request: &TaskRequest) -> bool {
        let subject = self.done_subject(request);
        // Asked by a probe publish: workers may not read the events stream.
        match super::probe::last_sequence_on(&self.bus, &subject).await {
            Ok(last) => last > 0,
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
        self.send(request, kind, trace, body).await?.await?;
        Ok(())
    }

    /// Publishes a history-only event (started, progress) without waiting
    /// for JetStream's ack on the task's path: nothing depends on it being
    /// stored, and waiting would add a round trip to every task. The ack is
    /// awaited in the background, so a failure is still logged.
    async fn publish_history(
        &self,
        request: &TaskRequest,
        kind: EventKind,
        trace: TraceParent,
        body: &impl serde::Serialize,
    ) {
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
    async fn send(
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

/// At most one progress event per task per interval.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

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
        let batch = loose
            .get("task_count")
            .and_then(serde_json::Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .filter(|count| *count > task_index)
            .map(|count| {
                let mode = loose
                    .get("wake_mode")
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_default();
                let notify = loose
                    .get("notify_early_failure")
                    .and_then(serde_json::Value::as_bool)
                    .unwrap_or(false);
                (count, mode, notify)
            });
        Rejected {
            reason: bounded(&err.to_string(), MAX_REASON_BYTES),
            delegation_id,
            task_index,
            origin_session,
            batch,
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
