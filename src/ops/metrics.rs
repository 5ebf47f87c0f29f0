//! Metric names and the Prometheus recorder.
//!
//! Services record through the `metrics` facade (`metrics::counter!` and
//! friends, one line at each place something happens); without an
//! installed recorder those calls do nothing. [`recorder`] installs the
//! Prometheus recorder once per process, and [`http`](super::http) serves
//! its rendering on `/metrics`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

use crate::protocol::Status;

/// Tasks a worker started running, by `pool` (every attempt counts).
pub const TASKS_STARTED: &str = "wakebus_tasks_started_total";
/// Tasks that ended with a completion, by `pool` and `status`.
pub const TASKS_COMPLETED: &str = "wakebus_tasks_completed_total";
/// Run time of tasks that ran, by `pool` and `status`.
pub const TASK_DURATION: &str = "wakebus_task_duration_seconds";
/// Transient executor failures handed back for a retry, by `pool`.
pub const TASK_RETRIES: &str = "wakebus_task_retries_total";
/// Completions JetStream did not take, published again by the worker
/// holding the result, by `pool`.
pub const COMPLETION_PUBLISH_RETRIES: &str = "wakebus_completion_publish_retries_total";
/// Dead letters of given-up tasks JetStream did not take, published again
/// by the worker holding the task, by `pool`.
pub const DEAD_LETTER_PUBLISH_RETRIES: &str = "wakebus_dead_letter_publish_retries_total";
/// Requests delivered again after an earlier delivery, by `pool`.
pub const TASK_REDELIVERIES: &str = "wakebus_task_redeliveries_total";
/// Deliveries of a request acknowledged without running it, because the
/// task's completion already existed (a redelivery whose earlier attempt
/// stored it, or a copy sent again after the duplicate window), by `pool`.
pub const TASKS_ALREADY_DONE: &str = "wakebus_tasks_already_done_total";
/// Tasks in hand, by `pool`: running, or held before they start (asking
/// whether they ran before, waiting for their cancel records).
pub const TASKS_IN_FLIGHT: &str = "wakebus_tasks_in_flight";
/// Messages dead-lettered, by `kind` (`task`, `wake`, `poison`, `origin`,
/// `unreadable`).
pub const DEAD_LETTERS: &str = "wakebus_dead_letters_total";
/// Wake posts to the session API, by `result` (`delivered`, `retry`,
/// `rejected`, `split`: a combined turn refused as too large).
pub const WAKE_POSTS: &str = "wakebus_wake_posts_total";
/// Rounds of writing a delivered turn's `delivered` ledger records that
/// JetStream did not store all of, so the wake writes them again (the turn
/// was already taken); none while the client is disconnected, as no write
/// is made then.
pub const WAKE_DELIVERY_RECORD_RETRIES: &str = "wakebus_wake_delivery_record_retries_total";
/// Attempts to take a session lock for a turn, by `result`: `taken` (it
/// was free and is now this instance's), `retaken` (the same, in one write
/// over this instance's own release marker), `kept` (still held from the
/// session's previous turn, `--lock-linger`), `busy` (another instance
/// holds it; the turn waits and tries again, each try counting), `adopted`
/// (held by a value this instance wrote whose answer or release was lost),
/// `error` (NATS failed). `taken` + `retaken` + `kept` + `adopted` counts
/// turns.
pub const WAKE_SESSION_LOCKS: &str = "wakebus_wake_session_locks_total";
/// Wake posts waiting for the session API's answer now.
pub const WAKE_POSTS_IN_FLIGHT: &str = "wakebus_wake_posts_in_flight";
/// Sessions the wake service is working on now: completions in hand, or
/// its lock kept for the session's next completion.
pub const WAKE_SESSIONS_ACTIVE: &str = "wakebus_wake_sessions_active";
/// Pull requests that ended in an error, by `consumer` (`tasks`,
/// `completions`): a 409 (consumer deleted, server shutdown, leadership
/// change), a 503 while the consumer has no leader, the wake's request gone
/// silent (missed heartbeats). Each is asked again after a backoff.
pub const PULLS_FAILED: &str = "wakebus_pulls_failed_total";
/// Messages the service's consumer has not yet delivered, by `stream` and `consumer`.
pub const CONSUMER_PENDING: &str = "wakebus_consumer_pending";
/// Messages delivered but not yet acknowledged, by `stream` and `consumer`.
pub const CONSUMER_ACK_PENDING: &str = "wakebus_consumer_ack_pending";
/// Messages delivered more than once and not yet acknowledged, by `stream` and `consumer`.
pub const CONSUMER_REDELIVERED: &str = "wakebus_consumer_redelivered";
/// 1 while the service's NATS client is connected, 0 otherwise, as of the
/// scrape. While it is 0 the `wakebus_consumer_*` gauges keep their last
/// value, and the counters do not move: alert on this, not on a flat line.
pub const NATS_CONNECTED: &str = "wakebus_nats_connected";
/// Times the service's NATS client lost its connection (and set out to
/// make another).
pub const NATS_DISCONNECTS: &str = "wakebus_nats_disconnects_total";

/// Task duration buckets, in seconds: sub-second echoes to hour-long runs.
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder for this process (once; later calls
/// return the same handle).
pub fn recorder() -> Result<PrometheusHandle, BuildError> {
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(TASK_DURATION.to_owned()), DURATION_BUCKETS)?
        .install_recorder()?;
    describe();
    // At 0 from the start, so that `increase()` and `rate()` see the first
    // disconnect, dead letter or post: a series born at 1 has no earlier
    // sample to grow from, and an alert on it misses a rare event (a
    // given-up task, a forged completion) until it happens twice.
    metrics::counter!(NATS_DISCONNECTS).increment(0);
    for kind in DEAD_LETTER_KINDS {
        metrics::counter!(DEAD_LETTERS, "kind" => kind).increment(0);
    }
    for result in WAKE_POST_RESULTS {
        metrics::counter!(WAKE_POSTS, "result" => result).increment(0);
    }
    Ok(HANDLE.get_or_init(|| handle).clone())
}

fn describe() {
    describe_counter!(
        TASKS_STARTED,
        "Tasks a worker started running (every attempt counts)."
    );
    describe_counter!(TASKS_COMPLETED, "Tasks that ended with a completion event.");
    describe_histogram!(TASK_DURATION, Unit::Seconds, "Run time of tasks.");
    describe_counter!(
        TASK_RETRIES,
        "Transient executor failures handed back for a retry."
    );
    describe_counter!(
        COMPLETION_PUBLISH_RETRIES,
        "Completions JetStream did not take, published again by the worker holding the result."
    );
    describe_counter!(
        DEAD_LETTER_PUBLISH_RETRIES,
        "Dead letters of given-up tasks JetStream did not take, published again by the worker holding the task."
    );
    describe_counter!(
        TASK_REDELIVERIES,
        "Requests delivered again after an earlier delivery."
    );
    describe_counter!(
        TASKS_ALREADY_DONE,
        "Deliveries acknowledged without running, the task's completion already existing."
    );
    describe_gauge!(
        TASKS_IN_FLIGHT,
        "Tasks in hand: running, or held before they start."
    );
    describe_counter!(DEAD_LETTERS, "Messages dead-lettered.");
    describe_counter!(WAKE_POSTS, "Wake posts to the session API, by result.");
    describe_counter!(
        WAKE_DELIVERY_RECORD_RETRIES,
        "Rounds of a delivered turn's ledger records that were not all stored and are written again."
    );
    describe_counter!(
        PULLS_FAILED,
        "Pull requests that ended in an error and were asked again after a backoff."
    );
    describe_counter!(
        WAKE_SESSION_LOCKS,
        "Attempts to take a session lock for a turn: taken, retaken over this instance's own release, kept from the previous turn, busy elsewhere, adopted after a lost answer, error."
    );
    describe_gauge!(
        WAKE_POSTS_IN_FLIGHT,
        "Wake posts waiting for the session API's answer."
    );
    describe_gauge!(
        WAKE_SESSIONS_ACTIVE,
        "Sessions with completions in hand or a lock kept for their next one."
    );
    describe_gauge!(
        CONSUMER_PENDING,
        "Messages the consumer has not yet delivered."
    );
    describe_gauge!(
        CONSUMER_ACK_PENDING,
        "Messages delivered but not yet acknowledged."
    );
    describe_gauge!(
        CONSUMER_REDELIVERED,
        "Messages redelivered and not yet acknowledged."
    );
    describe_gauge!(
        NATS_CONNECTED,
        "1 while connected to NATS, 0 otherwise (the consumer gauges are then stale)."
    );
    describe_counter!(
        NATS_DISCONNECTS,
        "Times the NATS connection was lost (each followed by reconnect attempts)."
    );
}

/// The NATS client lost its connection.
pub fn nats_disconnected() {
    metrics::counter!(NATS_DISCONNECTS).increment(1);
}

/// The wake service started following a session (an actor and its router
/// entry).
pub fn wake_session_opened() {
    metrics::gauge!(WAKE_SESSIONS_ACTIVE).increment(1.0);
}

/// The wake service stopped following a session.
pub fn wake_session_closed() {
    metrics::gauge!(WAKE_SESSIONS_ACTIVE).decrement(1.0);
}

/// A task started running on a worker of `pool`.
pub fn task_started(pool: &str) {
    metrics::counter!(TASKS_STARTED, "pool" => pool.to_owned()).increment(1);
}

/// A request of `pool` was delivered again.
pub fn task_redelivered(pool: &str) {
    metrics::counter!(TASK_REDELIVERIES, "pool" => pool.to_owned()).increment(1);
}

/// A delivery of a request of `pool` was acknowledged without running it:
/// the task's completion already existed.
pub fn task_already_done(pool: &str) {
    metrics::counter!(TASKS_ALREADY_DONE, "pool" => pool.to_owned()).increment(1);
}

/// A transient failure of a task of `pool` was handed back for a retry.
pub fn task_retried(pool: &str) {
    metrics::counter!(TASK_RETRIES, "pool" => pool.to_owned()).increment(1);
}

/// A completion of a task of `pool` was not stored and is published again.
pub fn completion_publish_retried(pool: &str) {
    metrics::counter!(COMPLETION_PUBLISH_RETRIES, "pool" => pool.to_owned()).increment(1);
}

/// The dead letter of a given-up task of `pool` was not stored and is
/// published again.
pub fn dead_letter_publish_retried(pool: &str) {
    metrics::counter!(DEAD_LETTER_PUBLISH_RETRIES, "pool" => pool.to_owned()).increment(1);
}

/// A task of `pool` ended with a completion of `status`, after running
/// `ran` if it ran (one cancelled, refused or given up before this delivery
/// ran it adds no run time of 0 s to the histogram).
pub fn task_completed(pool: &str, status: Status, ran: Option<Duration>) {
    let labels = [
        ("pool", pool.to_owned()),
        ("status", status.as_str().to_owned()),
    ];
    metrics::counter!(TASKS_COMPLETED, &labels).increment(1);
    if let Some(ran) = ran {
        metrics::histogram!(TASK_DURATION, &labels).record(ran.as_secs_f64());
    }
}

/// Every `kind` of [`DEAD_LETTERS`]: a task (`dlq.task`), a wake given up
/// (`dlq.wake`), a completion that cannot be used (`poison`), one refused by
/// origin verification (`origin`), a message whose headers cannot be read
/// (`unreadable`).
const DEAD_LETTER_KINDS: [&str; 5] = ["task", "wake", "poison", "origin", "unreadable"];

/// Every `result` of [`WAKE_POSTS`].
const WAKE_POST_RESULTS: [&str; 4] = ["delivered", "retry", "rejected", "split"];

/// A message was dead-lettered: `task`, `wake`, `poison`, `origin` (a
/// completion whose origin the wake could not verify) or `unreadable` (a
/// message no client can read, moved by a sweep).
pub fn dead_lettered(kind: &'static str) {
    metrics::counter!(DEAD_LETTERS, "kind" => kind).increment(1);
}

/// A wake post ended: `delivered`, `retry`, `rejected` or `split`.
pub fn wake_posted(result: &'static str) {
    metrics::counter!(WAKE_POSTS, "result" => result).increment(1);
}

/// A round of a delivered turn's ledger records was not all stored.
pub fn wake_delivery_record_retried() {
    metrics::counter!(WAKE_DELIVERY_RECORD_RETRIES).increment(1);
}

/// One attempt to take a session lock for a turn; `result` as
/// [`WAKE_SESSION_LOCKS`] says.
pub fn wake_session_lock(result: &'static str) {
    metrics::counter!(WAKE_SESSION_LOCKS, "result" => result).increment(1);
}

/// A pull request of `consumer` (`tasks`, `completions`) ended in an error.
pub fn pull_failed(consumer: &'static str) {
    metrics::counter!(PULLS_FAILED, "consumer" => consumer).increment(1);
}

/// Counts one unit of work in flight for as long as it lives: in a gauge
/// and, when given, in a counter the instance reports in its status.
#[derive(Debug)]
pub struct InFlight<'a> {
    /// The gauge.
    gauge: metrics::Gauge,
    /// The instance's own count.
    count: Option<&'a AtomicUsize>,
}

impl<'a> InFlight<'a> {
    /// A task of `pool` running.
    pub fn task(pool: &str) -> Self {
        Self::start(
            metrics::gauge!(TASKS_IN_FLIGHT, "pool" => pool.to_owned()),
            None,
        )
    }

    /// A wake post awaiting the session API's answer.
    pub fn wake_post(count: &'a AtomicUsize) -> Self {
        Self::start(metrics::gauge!(WAKE_POSTS_IN_FLIGHT), Some(count))
    }

    fn start(gauge: metrics::Gauge, count: Option<&'a AtomicUsize>) -> Self {
        gauge.increment(1.0);
        if let Some(count) = count {
            count.fetch_add(1, Ordering::Relaxed);
        }
        Self { gauge, count }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
        if let Some(count) = self.count {
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
