//! Handling one task request, start to finish, as a function that returns an [`Outcome`].
//!
//! - this file: the handler and its decisions (run, refuse, give up, finish);
//! - [`execute`]: running the executor with its time limit and throttled
//!   progress events (the in-progress acks cover the whole handling, in
//!   [`TaskHandler::settle`]);
//! - [`publish`]: events on the bus, the "already done?" probe, dead letters,
//!   fitting a completion into one message;
//! - [`decode`]: decoding a request as it arrives, salvaging its identity
//!   when it is unusable.

mod decode;
mod execute;
mod publish;

pub use decode::{Rejected, decode_request};
pub(crate) use publish::token_for;
use publish::{fit_to_payload, half_size_limit};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use async_nats::jetstream::{self};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

use super::cancel::{CancelRegistry, Refusal, StopReason};
use super::claims::{Claim, Claims};
use super::executor::{ExecError, ExecOutput, Executor, TaskEnv};
use super::pause::TakingPause;
use super::{REFUSED_REDELIVERY_DELAY, WorkerConfig};
use crate::bus::{Bus, KeepAliveClock, KeepAliveEvery, PublishError};
use crate::cancel::CancelRecord;
use crate::ops::metrics as m;
use crate::outcome::{Outcome, keep_alive};
use crate::protocol::{
    CompletionEvent, EventKind, HEADER_TRACEPARENT, INVALID_ID_PREFIX, StartedEvent, Status,
    TaskRequest, TraceParent, header,
};

/// Everything needed to run one task; shared by all of a worker's tasks.
#[derive(Debug)]
pub(crate) struct TaskHandler {
    /// Where to publish events.
    bus: Bus,
    /// The requests stream's duplicate window: a request stored later than
    /// this after it was created may be a re-send JetStream did not drop
    /// ([`may_have_run_before`]).
    duplicate_window: Duration,
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
    /// The tasks being handled here, so a redelivery reaching this worker
    /// while the first delivery still runs is left to that run.
    claims: Claims,
    /// How often a task in hand gets an in-progress ack.
    keep_alive: KeepAliveEvery,
    /// Cancelled at the worker's shutdown signal. The grace period is for
    /// tasks already running: one still being checked then (the "already
    /// done?" question, its cancel records) is handed back instead of
    /// started, since a run cut short at the grace's end would run again
    /// elsewhere from the start.
    stopping: CancellationToken,
    /// Set when the executor refuses this worker: it takes no task then.
    pause: TakingPause,
}

impl TaskHandler {
    /// A handler publishing through `bus`.
    pub(crate) fn new(
        bus: Bus,
        duplicate_window: Duration,
        executor: Executor,
        config: WorkerConfig,
        env: TaskEnv,
        cancels: Arc<CancelRegistry>,
        keep_alive: KeepAliveEvery,
    ) -> Self {
        let source = format!("wakebus/worker/{}", config.instance);
        Self {
            bus,
            duplicate_window,
            executor,
            config,
            env,
            source,
            cancels,
            claims: Claims::default(),
            keep_alive,
            stopping: CancellationToken::new(),
            pause: TakingPause::default(),
        }
    }

    /// Until when the worker takes no task, while its executor's refusal
    /// pauses it ([`TakingPause`]).
    pub(crate) fn paused_until(&self) -> Option<tokio::time::Instant> {
        self.pause.until()
    }

    /// The executor refused this worker (`reason`): it takes no task for
    /// its `refused_pause`, so the pool's other workers run them.
    fn refused_here(&self, reason: &str) {
        let pause = self.config.refused_pause;
        if self.pause.begin(pause) {
            error!(%reason, ?pause, "The executor refuses this worker; handing its tasks back and taking none for a while, so that other workers run them. An operator must fix this worker's credentials.");
        }
    }

    /// Cancelled at the worker's shutdown signal (by the worker): tasks in
    /// hand but not started yet are then handed back.
    pub(crate) fn stopping(&self) -> &CancellationToken {
        &self.stopping
    }

    /// Handles one delivery of a request and sends its outcome to the server
    /// while the task is still claimed, so a redelivery arriving between the
    /// run's end and its ack is left alone too. `stop` is cancelled when the
    /// worker shuts down and its grace period is over: the run is then
    /// stopped and the request handed back (a task not started by the
    /// shutdown signal is handed back then: see `stopping`).
    pub(crate) async fn settle(&self, message: &jetstream::Message, stop: &CancellationToken) {
        // One keep-alive for the whole handling, on one clock: separate
        // ones per step (asking, holding, running, publishing) would each
        // wait a full period before their first, and the gaps between steps
        // would add up towards the AckWait.
        let ((outcome, claim), lapsed) = self
            .keeping_alive(message, self.handle(message, stop))
            .await;
        let outcome = match outcome {
            Outcome::Nak(_) | Outcome::HandBack | Outcome::HandBackAfter(_) if lapsed => {
                warn!(
                    ?outcome,
                    "The task's delivery may have lapsed (no keep-alive went out for most of the AckWait: NATS unreachable, or this worker stalled) and may be another worker's now; not handing it back, which would take it from that worker too. NATS delivers it again after the AckWait."
                );
                Outcome::Leave
            }
            outcome => outcome,
        };
        outcome.apply(message).await;
        // Given up only now that the ack (or NAK) is on its way.
        drop(claim);
    }

    /// Settles a delivery pulled after the shutdown signal: hands it back,
    /// unless it is a redelivery of a task still running here (whose running
    /// attempt settles it).
    pub(crate) async fn refuse(&self, message: &jetstream::Message) {
        let sequence = message.info().ok().map(|info| info.stream_sequence);
        let outcome = self.claims.after_stop(sequence);
        if outcome == Outcome::Leave {
            warn!(
                stream_sequence = sequence,
                "Task redelivered during shutdown while it still runs here; leaving it to the running attempt."
            );
        }
        outcome.apply(message).await;
    }

    /// Decides one delivery of a request; the claim it returns (if any) must
    /// be held until the outcome has been applied.
    async fn handle(
        &self,
        message: &jetstream::Message,
        stop: &CancellationToken,
    ) -> (Outcome, Option<Claim<'_>>) {
        let info = message.info().ok();
        let attempt = info.as_ref().map_or(1, |info| info.delivered).max(1) as u64;
        let sequence = info.as_ref().map(|info| info.stream_sequence);
        let stored_at = info.as_ref().map(|info| info.published);
        let _in_flight = m::InFlight::task(&self.config.pool);
        if attempt > 1 {
            m::task_redelivered(&self.config.pool);
        }
        let headers = message.headers.as_ref();
        let request = match decode_request(&message.payload, headers, &self.config.limits) {
            Ok(request) => request,
            Err(rejected) => return (self.reject(message, rejected, stop).await, None),
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
        let claim = match sequence.map(|sequence| self.claims.claim(sequence)) {
            Some(None) => {
                span.in_scope(|| {
                    warn!(
                        stream_sequence = sequence,
                        "Task redelivered while it still runs here (its in-progress acks were late: \
                         a stall or an overloaded machine); leaving it to the running attempt."
                    );
                });
                return (Outcome::Leave, None);
            }
            Some(Some(claim)) => Some(claim),
            None => None,
        };
        let outcome = self
            .run_request(message, request, next, attempt, stored_at, stop)
            .instrument(span)
            .await;
        (outcome, claim)
    }

    async fn run_request(
        &self,
        message: &jetstream::Message,
        request: TaskRequest,
        trace: TraceParent,
        attempt: u64,
        stored_at: Option<OffsetDateTime>,
        stop: &CancellationToken,
    ) -> Outcome {
        let late = may_have_run_before(
            attempt,
            request.created_at,
            stored_at,
            self.duplicate_window,
        );
        let stopping = &self.stopping;
        if late {
            if self.already_done(&request, stopping).await {
                info!(
                    "Completion already published by an earlier attempt or copy; acking this delivery."
                );
                m::task_already_done(&self.config.pool);
                return Outcome::Ack;
            }
            // The worker began to stop before the answer came: not known
            // to be undone, so neither refused, given up nor run here.
            if stopping.is_cancelled() {
                info!(
                    "The worker is stopping before it learned whether the task was done; handing it back."
                );
                return Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY);
            }
        }
        // A cancelled task ends as cancelled, whatever else would refuse
        // it: a silent cancel is not answered by a depth-limit error or a
        // give-up that wakes the session.
        let session_token = token_for(request.origin_session_id.as_deref());
        let stored_at = stored_at.unwrap_or_else(OffsetDateTime::now_utc);
        let mut checked_at = self.cancels.behind_count();
        if !self
            .cancels_known(&request.delegation_id, &session_token, stopping)
            .await
        {
            info!(
                "The worker is stopping; handing the task back before its cancel records could be read."
            );
            return Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY);
        }
        if let Some(record) =
            self.cancels
                .cancelled(&request.delegation_id, &session_token, stored_at)
        {
            return self
                .cancelled_before_start(&request, trace, &record, stop)
                .await;
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
            // Kept and published again until stored, as any completion.
            return self
                .finish(&request, trace, done, Ending::Refused, stop)
                .await;
        }
        if attempt > self.config.max_deliver {
            let reason = format!(
                "gave up after {} deliveries without a result (the workers running it crashed, stalled, stopped or failed transiently)",
                attempt - 1
            );
            return self
                .give_up(message, &request, trace, GIVEN_UP_DELIVERIES, reason, stop)
                .await;
        }

        // The worker began to stop while the task was being checked (the
        // "already done?" question can take a while): not started within
        // the grace, where it could be cut short and run again elsewhere,
        // but handed back for another worker now.
        if stopping.is_cancelled() {
            info!("The worker is stopping; handing the task back instead of starting it.");
            return Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY);
        }

        // Register before looking for a cancel record: a cancel either is
        // recorded already or finds this run registered when it broadcasts.
        let run_stop = stop.child_token();
        let reason = Arc::new(OnceLock::new());
        let _registered = loop {
            let run = (run_stop.clone(), reason.clone());
            let registered = self.cancels.register(
                &request.delegation_id,
                &session_token,
                stored_at,
                run,
                checked_at,
            );
            match registered {
                Ok(guard) => break guard,
                Err(Refusal::Cancelled(record)) => {
                    return self
                        .cancelled_before_start(&request, trace, &record, stop)
                        .await;
                }
                // The watch was found behind since the check above (a
                // second cancel's broadcast came before its record): the
                // task's records are read again.
                Err(Refusal::Behind) => {
                    checked_at = self.cancels.behind_count();
                    let id = &request.delegation_id;
                    // Known at once when the watch is current again: the
                    // stop is looked at here too, or a task refused just
                    // before the signal would start within the grace.
                    if !self.cancels_known(id, &session_token, stopping).await
                        || stopping.is_cancelled()
                    {
                        return Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY);
                    }
                }
            }
        };

        let started = StartedEvent::for_request(&request, &self.config.instance, attempt);
        m::task_started(&self.config.pool);

        let begun = Instant::now();
        let result = self
            .execute(&request, &run_stop, &reason, trace, started)
            .await;
        let duration = begun.elapsed();
        let result = stopped_if_asked(result, reason.get(), run_stop.is_cancelled());
        let mut suppress_wake = false;
        let output = match (result, reason.get()) {
            (Ok(output), _) => output,
            (
                Err(ExecError::Stopped {
                    partial,
                    api_calls,
                    tokens,
                    truncated,
                }),
                Some(StopReason::Timeout),
            ) => ExecOutput {
                status: Status::Timeout,
                summary: partial,
                // The limit, not the run's length, which includes stopping it.
                error: Some(format!(
                    "timed out after {}s",
                    request
                        .timeout_seconds
                        .map(Duration::from_secs)
                        .or(self.config.default_timeout)
                        .unwrap_or(duration)
                        .as_secs()
                )),
                api_calls,
                tokens,
                truncated,
                exit_reason: "timeout".to_owned(),
            },
            (
                Err(ExecError::Stopped {
                    partial,
                    api_calls,
                    tokens,
                    truncated,
                }),
                Some(StopReason::Cancelled { silent }),
            ) => {
                suppress_wake = *silent;
                ExecOutput {
                    status: Status::Interrupted,
                    summary: partial,
                    error: Some("cancelled while running".to_owned()),
                    api_calls,
                    tokens,
                    truncated,
                    exit_reason: "cancelled".to_owned(),
                }
            }
            (Err(ExecError::Stopped { .. }), None) => {
                info!("Worker is shutting down; handing the task back.");
                return Outcome::HandBack;
            }
            (
                Err(ExecError::Transient {
                    reason,
                    retry_after,
                    this_worker,
                }),
                _,
            ) if attempt < self.config.max_deliver => {
                let delay = if this_worker {
                    // Not the task's failure: another worker runs it while
                    // this one takes none, once the pull it came in has
                    // ended (sooner, it could come straight back into it).
                    self.refused_here(&reason);
                    self.config
                        .retry_delay(attempt)
                        .max(REFUSED_REDELIVERY_DELAY)
                } else {
                    // Never sooner than the endpoint asked, up to a bound:
                    // a task waiting for its retry sees a cancel only when
                    // it comes back.
                    let asked = retry_after.unwrap_or_default().min(MAX_RETRY_AFTER);
                    let delay = self.config.retry_delay(attempt).max(asked);
                    warn!(%reason, retry_in = ?delay, "Executor failed transiently; will retry.");
                    delay
                };
                m::task_retried(&self.config.pool);
                return Outcome::Nak(Some(delay));
            }
            (
                Err(ExecError::Transient {
                    reason,
                    this_worker,
                    ..
                }),
                _,
            ) => {
                if this_worker {
                    self.refused_here(&reason);
                }
                // Deliveries, not failures: hand-backs and stalls use them too.
                let reason = format!(
                    "gave up on its last delivery ({attempt} of {}); last error: {reason}",
                    self.config.max_deliver
                );
                return self
                    .give_up(message, &request, trace, GIVEN_UP_ATTEMPTS, reason, stop)
                    .await;
            }
        };

        // A silent cancel that came once the program had finished (while
        // what it left behind still held its output) leaves its result as
        // it is, but the session asked not to hear of the task.
        suppress_wake |= matches!(reason.get(), Some(StopReason::Cancelled { silent: true }));
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
        info!(status = %done.status, duration_ms = duration.as_millis() as u64, "Task done.");
        self.finish(&request, trace, done, Ending::Ran(&reason), stop)
            .await
    }

    /// Publishes the completion, cut to fit in one message (every
    /// completion repeats the request's goal and context, so one near the
    /// max payload would never be stored); acks the request only once it
    /// is stored.
    ///
    /// The result is in hand, so a completion JetStream does not take (an
    /// outage, a leader election, a stream at its limits) is published
    /// again until it is stored, while [`Self::settle`]'s in-progress acks
    /// keep the request here: handing it back would run the task again.
    /// Only a worker that stops (its grace period over) hands it back.
    async fn finish(
        &self,
        request: &TaskRequest,
        trace: TraceParent,
        mut done: CompletionEvent,
        ending: Ending<'_>,
        stop: &CancellationToken,
    ) -> Outcome {
        let fitted_for = self.bus.max_payload();
        fit_to_payload(&mut done, fitted_for);
        let done = &done;
        // The most the events stream took: an operator may cap its max
        // message size below the server's max payload. Lowered at each
        // refusal for size, whose bytes would be refused on every try.
        let stream_limit = AtomicUsize::new(usize::MAX);
        // Fitted again after a reconnect to a server that takes less (cut
        // for the old one, it would be refused on every try), or below
        // the stream's limit. And a silent cancel that comes while the
        // completion is not stored yet (the stream refusing it) still
        // keeps the session from hearing of the task, unless a copy was
        // stored meanwhile.
        let publish = || {
            let now = self
                .bus
                .max_payload()
                .min(stream_limit.load(Ordering::Relaxed));
            let silenced = !done.suppress_wake && ending.silenced();
            let changed = (now < fitted_for || silenced).then(|| {
                let mut changed = done.clone();
                if now < fitted_for {
                    fit_to_payload(&mut changed, now);
                }
                changed.suppress_wake |= silenced;
                changed
            });
            let stream_limit = &stream_limit;
            async move {
                let done = changed.as_ref().unwrap_or(done);
                let published = self.publish(request, EventKind::Done, trace, done).await;
                if let Err(error) = &published
                    && error.is_too_large()
                {
                    // Lowered, and said, only while cutting makes it
                    // smaller: below about 1 KiB of text (ids and headers
                    // are never cut) it is refused on, and the retries'
                    // ERROR after a minute says so.
                    let smaller = half_size_limit(done).min(now);
                    if smaller < stream_limit.load(Ordering::Relaxed) {
                        warn!(%error, "The events stream refused the completion for its size (its max message size is below the server's max payload); cutting it to half.");
                        stream_limit.store(smaller, Ordering::Relaxed);
                    }
                }
                published
            }
        };
        let stored = self.until_stored(Record::Completion, publish, stop).await;
        match stored {
            Ok(()) => {
                let ran = matches!(ending, Ending::Ran(_))
                    .then(|| Duration::from_secs_f64(done.duration_seconds));
                m::task_completed(&self.config.pool, done.status, ran);
                Outcome::Ack
            }
            Err(error) if matches!(ending, Ending::GivenUp) => {
                warn!(%error, "Could not publish the failed completion and the worker is stopping; handing the task back, its next delivery will be given up again.");
                Outcome::HandBack
            }
            Err(error) if matches!(ending, Ending::Refused) => {
                warn!(%error, "Could not publish the refusal and the worker is stopping; handing the task back, its next delivery will be refused again.");
                Outcome::HandBack
            }
            Err(error) if matches!(ending, Ending::Cancelled) => {
                warn!(%error, "Could not publish the interrupted completion and the worker is stopping; handing the task back, its next delivery will end cancelled again.");
                Outcome::HandBack
            }
            Err(error) => {
                warn!(%error, "Could not publish the completion and the worker is stopping; handing the task back, it will run again.");
                Outcome::HandBack
            }
        }
    }

    /// Waits until the task's cancel records are known: the cancel watch is
    /// current, or they were read by key. A failed read is tried again, the
    /// task held (kept from other workers by [`Self::settle`]'s in-progress
    /// acks) rather than handed back: each hand-back would use up one of its
    /// deliveries. `false` if the worker's grace ends first.
    async fn cancels_known(
        &self,
        delegation_id: &str,
        session_token: &str,
        stop: &CancellationToken,
    ) -> bool {
        let mut pause = CANCEL_READ_RETRY_MIN;
        while !self.cancels.is_current() {
            // While the client reconnects a read would only be queued.
            if crate::connect::is_connected(&self.bus.client) {
                let read = self.cancels.read_directly(delegation_id, session_token);
                // The watch catching up meanwhile ends the wait too.
                let Err(error) = (tokio::select! {
                    read = read => read,
                    () = self.cancels.until_current() => Ok(()),
                    () = stop.cancelled() => return false,
                }) else {
                    return true;
                };
                if crate::connect::once_a_minute(&CANNOT_READ_CANCELS_SAID) {
                    warn!(%error, "Holding tasks: their cancel records cannot be read and the cancel watch is behind; each starts once either works (said at most once a minute).");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return false,
                () = tokio::time::sleep(pause) => {}
                () = self.cancels.until_current() => {}
            }
            pause = (pause * 2).min(CANCEL_READ_RETRY_MAX);
        }
        true
    }

    /// Runs `work` while in-progress acks, every keep-alive period, keep
    /// `message` from being delivered to another worker; says with its
    /// result whether the delivery may have lapsed meanwhile
    /// ([`KeepAliveClock::may_have_lapsed`]).
    async fn keeping_alive<T>(
        &self,
        message: &jetstream::Message,
        work: impl Future<Output = T>,
    ) -> (T, bool) {
        let mut clock = KeepAliveClock::new(self.keep_alive.clone());
        let keeping = async {
            loop {
                tokio::time::sleep_until(clock.look_at()).await;
                if clock.is_due() {
                    clock.went_out(keep_alive(message).await);
                }
            }
        };
        let done = tokio::select! {
            done = work => done,
            () = keeping => unreachable!("keeps the request alive until the work ends"),
        };
        (done, clock.may_have_lapsed())
    }

    /// Calls `publish` until JetStream stores what it publishes (the same
    /// dedupe id every time), with backoff; the last error once `stop` is
    /// cancelled. `record` says what it stores, for the log and metrics.
    /// While the client is disconnected it waits instead of publishing: a
    /// publish would only queue in the client, which does not drain its
    /// queue while it reconnects, and a full queue would hold every later
    /// send (the hand-back at shutdown included) until NATS returns.
    async fn until_stored<F, Fut>(
        &self,
        record: Record,
        mut publish: F,
        stop: &CancellationToken,
    ) -> Result<(), PublishError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), PublishError>>,
    {
        let mut backoff = crate::bus::until_stored_backoff();
        let client = self.bus.client.clone();
        let mut attempt = 1u32;
        let since = Instant::now();
        loop {
            let error = match publish().await {
                Ok(()) => return Ok(()),
                Err(error) => error,
            };
            if stop.is_cancelled() {
                return Err(error);
            }
            // A refusal that lasts (a permission taken away, a stream that
            // no longer takes the subject, a full store) holds this task,
            // and likely every other, until an operator acts.
            let lasting = since.elapsed() >= error_after(&error, self.duplicate_window);
            match record {
                Record::Completion => {
                    if lasting {
                        error!(%error, attempt, failing_for = ?since.elapsed(), "Could not publish the completion for a minute or more; keeping the result and trying again. Check the events stream and this worker's permissions.");
                    } else {
                        warn!(%error, attempt, "Could not publish the completion; keeping the result and trying again.");
                    }
                    m::completion_publish_retried(&self.config.pool);
                }
                Record::DeadLetter => {
                    if lasting {
                        error!(%error, attempt, failing_for = ?since.elapsed(), "Could not dead-letter the request for a minute or more; keeping it and trying again. Check the dead-letter stream and this worker's permissions.");
                    } else {
                        warn!(%error, attempt, "Could not dead-letter the request; keeping it and trying again.");
                    }
                    m::dead_letter_publish_retried(&self.config.pool);
                }
            }
            let waiting = async {
                loop {
                    let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                    tokio::time::sleep(delay).await;
                    if crate::connect::is_connected(&client) {
                        break;
                    }
                }
            };
            tokio::select! {
                () = waiting => {}
                () = stop.cancelled() => {}
            }
            attempt += 1;
        }
    }

    /// Ends a task for good: the request in the dead-letter stream and a
    /// `failed` completion (so the session still wakes), then the ack.
    ///
    /// Both are kept and tried again here until stored, as a completion
    /// is: handed back instead, the task would be delivered again and run
    /// again, or be given up again for another reason (more deliveries
    /// than `--max-deliver`), and that reason would reach the session.
    async fn give_up(
        &self,
        message: &jetstream::Message,
        request: &TaskRequest,
        trace: TraceParent,
        exit_reason: &str,
        reason: String,
        stop: &CancellationToken,
    ) -> Outcome {
        error!(%reason, "Giving up on task; dead-lettering the request.");
        let dead_letter = || self.dead_letter(message, &reason);
        let stored = self
            .until_stored(Record::DeadLetter, dead_letter, stop)
            .await;
        if let Err(error) = stored {
            warn!(%error, "Could not dead-letter the request and the worker is stopping; handing the task back.");
            return Outcome::HandBack;
        }
        let mut done = CompletionEvent::for_request(request, Status::Failed, exit_reason);
        done.error = Some(reason);
        self.finish(request, trace, done, Ending::GivenUp, stop)
            .await
    }

    /// A task cancelled before it started: an `interrupted` completion,
    /// which wakes the session unless the cancel was silent.
    async fn cancelled_before_start(
        &self,
        request: &TaskRequest,
        trace: TraceParent,
        record: &CancelRecord,
        stop: &CancellationToken,
    ) -> Outcome {
        info!(
            silent = record.silent,
            "Task was cancelled before it started; not running it."
        );
        let mut done = CompletionEvent::for_request(request, Status::Interrupted, "cancelled");
        done.error = Some("cancelled before it started".to_owned());
        done.suppress_wake = record.silent;
        self.finish(request, trace, done, Ending::Cancelled, stop)
            .await
    }

    /// A request that can never run: a dead letter with the reason, an
    /// `error` completion (woken when the session is known), then TERM.
    ///
    /// Each is kept and tried again here until stored, as a give-up's are:
    /// handled again from the start on a redelivery, the request would be
    /// dead-lettered again, and once the dead letters' duplicate window
    /// has passed (an events stream refusing writes for minutes) stored
    /// twice, and `replay tasks` would run it twice.
    async fn reject(
        &self,
        message: &jetstream::Message,
        rejected: Rejected,
        stop: &CancellationToken,
    ) -> Outcome {
        let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        let delegation_id = rejected
            .delegation_id
            .clone()
            .unwrap_or_else(|| format!("{INVALID_ID_PREFIX}{seq}"));
        warn!(
            delegation_id = %delegation_id,
            stream_sequence = seq,
            reason = %rejected.reason,
            "Rejecting an unusable request."
        );
        let dead_letter = || self.dead_letter(message, &rejected.reason);
        let stored = self
            .until_stored(Record::DeadLetter, dead_letter, stop)
            .await;
        if let Err(error) = stored {
            warn!(%error, "Could not dead-letter the request and the worker is stopping; handing it back.");
            return Outcome::HandBack;
        }
        let (stand_in, reason) = stand_in(delegation_id, seq, &rejected);
        let mut done = CompletionEvent::for_request(&stand_in, Status::Error, "invalid_request");
        done.error = Some(reason);
        let trace = header(message.headers.as_ref(), HEADER_TRACEPARENT)
            .and_then(TraceParent::parse)
            .unwrap_or_else(TraceParent::new_root)
            .child();
        let publish = || self.publish(&stand_in, EventKind::Done, trace, &done);
        let stored = self.until_stored(Record::Completion, publish, stop).await;
        if let Err(error) = stored {
            warn!(%error, "Could not publish the error completion and the worker is stopping; handing the request back.");
            return Outcome::HandBack;
        }
        m::task_completed(&self.config.pool, Status::Error, None);
        Outcome::Term(rejected.reason)
    }
}

/// The request an unusable one's `error` completion is written for, and
/// the reason it gives: a completion the wake accepts, so that the session
/// learns its delegation went nowhere. A task of a usable batch completes
/// its batch. One whose batch is unusable (no count, a count not above its
/// index, or above the limit) wakes its session on its own, as the last of
/// an `independent` delegation just long enough to hold its index; one
/// whose index no batch can hold gets an id of its own (the reason names
/// the original), since task 0's completion id belongs to the real task 0,
/// and so does a forged copy (its origin header contradicting its body),
/// whose completion would otherwise take the real task's. So does one
/// without a usable delegation id: under an id of its own it can be no
/// member of its batch, and as one it would wait for siblings that never
/// come, and never wake its session.
fn stand_in(delegation_id: String, seq: u64, rejected: &Rejected) -> (TaskRequest, String) {
    let (fits, index) = match rejected.task_index {
        Some(index)
            if index < crate::protocol::MAX_TASK_COUNT
                && !rejected.forged
                && rejected.delegation_id.is_some() =>
        {
            (true, index)
        }
        _ => (false, 0),
    };
    let (id, reason) = if fits {
        (delegation_id, rejected.reason.clone())
    } else {
        let index = rejected
            .task_index
            .map_or_else(|| "unreadable".to_owned(), |index| index.to_string());
        let reason = match &rejected.delegation_id {
            Some(original) => format!(
                "delegation {original}, task_index {index}: {}",
                rejected.reason
            ),
            // The reason says what is wrong with the id.
            None => format!("task_index {index}: {}", rejected.reason),
        };
        (format!("{INVALID_ID_PREFIX}{seq}"), reason)
    };
    let mut stand_in = TaskRequest::new(id, String::new());
    stand_in
        .origin_session_id
        .clone_from(&rejected.origin_session);
    match rejected.batch.filter(|_| fits) {
        Some((count, mode, notify)) => {
            stand_in.task_index = index;
            stand_in.task_count = count;
            stand_in.wake_mode = mode;
            stand_in.notify_early_failure = notify;
        }
        None if fits && index > 0 => {
            stand_in.task_index = index;
            stand_in.task_count = index + 1;
            stand_in.wake_mode = crate::protocol::WakeMode::Independent;
        }
        None => {}
    }
    (stand_in, reason)
}

/// The first pause before a task reads its cancel records again.
const CANCEL_READ_RETRY_MIN: Duration = Duration::from_millis(250);

/// The longest pause before a task reads its cancel records again.
const CANCEL_READ_RETRY_MAX: Duration = Duration::from_secs(5);

/// When the worker last said that tasks wait for their cancel records.
static CANNOT_READ_CANCELS_SAID: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// How long storing a completion or dead letter may keep failing before
/// each new failure is logged at ERROR rather than WARN.
const STORE_FAILING_ERROR_AFTER: Duration = Duration::from_secs(60);

/// How long storing may keep failing with `error` before an operator
/// should hear of it: [`STORE_FAILING_ERROR_AFTER`], but a duplicate of a
/// copy never stored ends by itself once the duplicate window has passed
/// (`confirm_stored`), so that one only that much later.
fn error_after(error: &PublishError, duplicate_window: Duration) -> Duration {
    match error {
        PublishError::DuplicateOfUnstored { .. } => duplicate_window + STORE_FAILING_ERROR_AFTER,
        _ => STORE_FAILING_ERROR_AFTER,
    }
}

/// The longest an executor's `Retry-After` delays a task's retry: a
/// cancelled task waiting for it ends only when it comes back.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// A run that failed while it was being stopped (a timeout, a cancel, the
/// worker's own shutdown: `stopped`) ended because of the stop: a failure
/// then, as the program or the model call is cut off, is no reason to
/// retry, nor to give the task up on its last attempt (which would wake a
/// session its silent cancel keeps quiet, or one whose task a stopping
/// worker should hand back).
fn stopped_if_asked(
    result: Result<ExecOutput, ExecError>,
    reason: Option<&StopReason>,
    stopped: bool,
) -> Result<ExecOutput, ExecError> {
    match (result, reason) {
        (Err(ExecError::Transient { .. }), reason) if reason.is_some() || stopped => {
            Err(ExecError::Stopped {
                partial: None,
                api_calls: 0,
                tokens: None,
                truncated: false,
            })
        }
        (result, _) => result,
    }
}

/// Whether a delivery may be of a request that already ran, so the history
/// is asked for its completion before it runs ([`TaskHandler::already_done`]):
/// a redelivery; or a request JetStream stored so long after it was created
/// (`stored_at - created_at` above half the `duplicate_window`) that it may
/// be a re-send the window no longer caught (half, because the publisher's
/// clock may run ahead of the server's); or one that does not say when it
/// was created. A first delivery of a fresh request skips the round trip.
fn may_have_run_before(
    attempt: u64,
    created_at: Option<OffsetDateTime>,
    stored_at: Option<OffsetDateTime>,
    duplicate_window: Duration,
) -> bool {
    if attempt > 1 {
        return true;
    }
    let (Some(created_at), Some(stored_at)) = (created_at, stored_at) else {
        return true;
    };
    stored_at - created_at > duplicate_window / 2
}

/// The exit reason of a task given up after `--max-deliver` deliveries
/// whose worker crashed, stalled or stopped without a result.
const GIVEN_UP_DELIVERIES: &str = "max_deliveries_exceeded";
/// The exit reason of a task given up after `--max-deliver` transient
/// failures.
const GIVEN_UP_ATTEMPTS: &str = "max_attempts_exceeded";

/// How a task ends whose completion `TaskHandler::finish` stores.
#[derive(Debug, Clone, Copy)]
enum Ending<'a> {
    /// It ran and has a result; why its run was stopped, if it was (a
    /// silent cancel may still come while the result is being stored).
    Ran(&'a OnceLock<StopReason>),
    /// It was given up (attempts or deliveries used up): a stop before
    /// the completion is stored hands it back to be given up again.
    GivenUp,
    /// It was cancelled before this delivery started it: a stop before
    /// the completion is stored hands it back to end cancelled again.
    Cancelled,
    /// It was refused before it ran (nested too deep): a stop before the
    /// completion is stored hands it back to be refused again.
    Refused,
}

impl Ending<'_> {
    /// Whether the session asked not to hear of the task: a silent cancel
    /// of a run.
    fn silenced(self) -> bool {
        matches!(self, Self::Ran(reason) if matches!(reason.get(), Some(StopReason::Cancelled { silent: true })))
    }
}

/// What a worker stores for a task it holds, kept until stored.
#[derive(Debug, Clone, Copy)]
enum Record {
    /// The task's completion event.
    Completion,
    /// The request, dead-lettered when the task is given up.
    DeadLetter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duplicate_of_an_unstored_copy_is_an_error_only_once_the_duplicate_window_has_passed() {
        let window = Duration::from_secs(120);
        let unstored = PublishError::DuplicateOfUnstored {
            stream: "EVENTS".to_owned(),
        };
        assert_eq!(error_after(&unstored, window), Duration::from_secs(180));
        let encode = PublishError::Encode(serde_json::from_str::<u8>("x").unwrap_err());
        assert_eq!(error_after(&encode, window), STORE_FAILING_ERROR_AFTER);
    }

    #[test]
    fn a_run_failing_as_it_is_stopped_ends_as_stopped_not_as_a_failure_to_retry() {
        let failed = || Err(ExecError::transient("connection reset"));
        let cancelled = StopReason::Cancelled { silent: true };
        assert!(matches!(
            stopped_if_asked(failed(), Some(&cancelled), true),
            Err(ExecError::Stopped { partial: None, .. })
        ));
        assert!(matches!(
            stopped_if_asked(failed(), Some(&StopReason::Timeout), true),
            Err(ExecError::Stopped { .. })
        ));
        // The worker stopping: handed back, not retried or given up.
        assert!(matches!(
            stopped_if_asked(failed(), None, true),
            Err(ExecError::Stopped { .. })
        ));
        // Not asked to stop: a failure to retry.
        assert!(matches!(
            stopped_if_asked(failed(), None, false),
            Err(ExecError::Transient { .. })
        ));
    }

    #[test]
    fn a_batch_member_without_a_usable_delegation_id_wakes_its_session_on_its_own() {
        let rejected = Rejected {
            reason: "invalid delegation_id".to_owned(),
            delegation_id: None,
            task_index: Some(1),
            origin_session: Some("s.a".to_owned()),
            batch: Some((3, crate::protocol::WakeMode::Batch, true)),
            forged: false,
        };
        let (request, reason) = stand_in("invalid-7".to_owned(), 7, &rejected);
        // Not task 1 of a batch of 3 under an id no sibling has.
        assert_eq!(
            (request.delegation_id.as_str(), request.task_index),
            ("invalid-7", 0)
        );
        assert_eq!(request.task_count, 1);
        assert_eq!(request.origin_session_id.as_deref(), Some("s.a"));
        assert_eq!(reason, "task_index 1: invalid delegation_id");
        // With its id, it stays a member of its batch.
        let with_id = Rejected {
            delegation_id: Some("d1".to_owned()),
            ..rejected
        };
        let (request, reason) = stand_in("d1".to_owned(), 7, &with_id);
        assert_eq!(
            (
                request.delegation_id.as_str(),
                request.task_index,
                request.task_count
            ),
            ("d1", 1, 3)
        );
        assert_eq!(reason, "invalid delegation_id");
    }

    #[test]
    fn only_a_redelivery_or_a_request_stored_late_or_undated_asks_the_history() {
        let window = Duration::from_secs(120);
        let created = OffsetDateTime::now_utc();
        let at = |seconds: i64| Some(created + time::Duration::seconds(seconds));
        // A first delivery stored soon after it was created: no question,
        // whatever the clocks say (the publisher's may be ahead).
        assert!(!may_have_run_before(1, Some(created), at(0), window));
        assert!(!may_have_run_before(1, Some(created), at(60), window));
        assert!(!may_have_run_before(1, Some(created), at(-30), window));
        // Stored later: maybe a re-send after the window.
        assert!(may_have_run_before(1, Some(created), at(61), window));
        assert!(may_have_run_before(1, Some(created), at(3600), window));
        // A redelivery, or nothing to compare.
        assert!(may_have_run_before(2, Some(created), at(0), window));
        assert!(may_have_run_before(1, None, at(0), window));
        assert!(may_have_run_before(1, Some(created), None, window));
    }
}
