//! Running the executor: its time limit, the `started` event once the run
//! has lasted `started_after`, and progress events at most once per
//! interval.

use std::sync::OnceLock;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::protocol::{EventKind, ProgressEvent, StartedEvent, TaskRequest, TraceParent};
use crate::worker::cancel::StopReason;
use crate::worker::executor::{ExecError, ExecOutput, Progress};

use super::TaskHandler;

impl TaskHandler {
    /// Runs the executor, stopping it when its time limit passes (the
    /// in-progress acks are [`TaskHandler::settle`]'s, for the whole
    /// handling). `started` is written once the run has lasted
    /// `started_after` (at once if that is zero), and always before the
    /// first progress event.
    pub(super) async fn execute(
        &self,
        request: &TaskRequest,
        run_stop: &CancellationToken,
        reason: &OnceLock<StopReason>,
        trace: TraceParent,
        started: StartedEvent,
    ) -> Result<ExecOutput, ExecError> {
        let mut started = Some(started);
        if self.config.started_after.is_zero() {
            self.publish_started(request, trace, &mut started).await;
        }
        let started_due = tokio::time::sleep(self.config.started_after);
        tokio::pin!(started_due);
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
                        self.publish_started(request, trace, &mut started).await;
                        self.publish_progress(request, &mut reports, trace).await;
                    }
                    return result;
                }
                () = &mut started_due, if started.is_some() => {
                    self.publish_started(request, trace, &mut started).await;
                }
                Ok(()) = reports.changed() => {
                    unpublished = true;
                    if throttle.is_elapsed() {
                        self.publish_started(request, trace, &mut started).await;
                        self.publish_progress(request, &mut reports, trace).await;
                        unpublished = false;
                        throttle.as_mut().reset(tokio::time::Instant::now() + PROGRESS_INTERVAL);
                    }
                }
                () = &mut throttle, if unpublished => {
                    self.publish_started(request, trace, &mut started).await;
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

    /// Writes the `started` event, if not written yet (history only:
    /// failures are logged).
    async fn publish_started(
        &self,
        request: &TaskRequest,
        trace: TraceParent,
        started: &mut Option<StartedEvent>,
    ) {
        if let Some(event) = started.take() {
            self.publish_history(request, EventKind::Started, trace, &event)
                .await;
        }
    }

    /// Publishes the newest progress report (history only: failures are logged).
    pub(super) async fn publish_progress(
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
}

/// At most one progress event per task per interval.
pub(super) const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);
