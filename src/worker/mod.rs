//! Workers: take requests of one pool, run them, publish completions.
//!
//! All workers of a pool share one durable pull consumer, so adding workers
//! (on any machine) adds capacity. Each worker pulls only as many requests as
//! it has free slots, so nothing waits in a local buffer while its AckWait
//! runs out.

mod cancel;
mod claims;
pub mod executor;
mod handler;
mod pause;
pub mod probe;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use futures::{FutureExt as _, StreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use handler::TaskHandler;
pub(crate) use handler::token_for;
pub use handler::{Rejected, decode_request};

use crate::bus::{Bus, BusSettings, ProvisionError, PullRetry, ServiceConsumer};
use crate::ops::service::{Registration, register};
use crate::protocol::Limits;
use crate::quarantine::{ReconnectWatch, connects, sweep_after_reconnect, sweep_at_start};
use executor::{Executor, TaskEnv};

/// How long one pull request of a worker waits for tasks before it ends
/// (and the next one is sent).
const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// When a pull made before a reconnect has surely ended, counted from when
/// the worker notices the reconnect. The server forgets the pull of a
/// connection that closed and never ends it, and async-nats gives up on it
/// only 5 s after its expiry, the worker idle meanwhile; a pull still
/// queued in the client went out with the reconnect, expires 2 s later,
/// and what the server delivered for it has arrived a second after that.
const PULL_SURELY_ENDED: Duration = Duration::from_secs(PULL_EXPIRES.as_secs() + 1);

/// How often a worker waiting on a pull looks for a reconnect.
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// When a task pulled after the shutdown signal is delivered again: once
/// the pull it came in has surely ended, so that it goes to another
/// worker's pull instead of straight back into this one.
pub(crate) const REFUSED_REDELIVERY_DELAY: Duration =
    Duration::from_secs(PULL_EXPIRES.as_secs() + 1);

/// How a worker behaves.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The pool whose requests this worker takes.
    pub pool: String,
    /// How many tasks run at once.
    pub concurrency: usize,
    /// The consumer's AckWait: how soon a dead worker's task goes to another.
    pub ack_wait: Duration,
    /// Deliveries after which a task ends as `failed` and is dead-lettered.
    pub max_deliver: u64,
    /// Time limit for tasks whose request sets none (`None`: unlimited).
    pub default_timeout: Option<Duration>,
    /// First retry delay after a transient failure; doubles each attempt.
    pub retry_base: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// How long running tasks may finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// How long the worker takes no task once its executor refused it (an
    /// LLM endpoint rejecting its key), so the pool's other workers run
    /// them.
    pub refused_pause: Duration,
    /// How long a task runs before its `started` event is written. A task
    /// that ends sooner has none: its history is `submitted` then `done`
    /// (whose `ce-source` names the worker), and it costs one stored write
    /// fewer. Zero writes it as the run begins.
    pub started_after: Duration,
    /// This worker's name in events and logs.
    pub instance: String,
    /// Deepest subagent nesting this worker runs; deeper requests end in `error`.
    pub max_depth: u32,
    /// Largest request, goal and context accepted; larger ones end with an
    /// `error` completion.
    pub limits: Limits,
    /// Marked once the worker pulls tasks (its `/readyz` waits for it).
    pub started: crate::ops::Started,
}

impl WorkerConfig {
    /// Defaults for `pool`.
    pub fn new(pool: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            concurrency: 16,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            default_timeout: None,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(30),
            refused_pause: pause::REFUSED_PAUSE,
            started_after: DEFAULT_STARTED_AFTER,
            instance: default_instance_name("worker"),
            max_depth: crate::protocol::DEFAULT_MAX_DEPTH,
            limits: Limits::default(),
            started: crate::ops::Started::default(),
        }
    }

    /// The NAK delay after the `attempt`-th transient failure.
    pub(crate) fn retry_delay(&self, attempt: u64) -> Duration {
        let exp = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(20);
        self.retry_base.saturating_mul(1 << exp).min(self.retry_max)
    }
}

/// How long a task runs before its `started` event is written, by default:
/// real subagents run for seconds or minutes and show as running almost at
/// once; quick tasks skip a write they do not need.
pub const DEFAULT_STARTED_AFTER: Duration = Duration::from_secs(1);

/// A name for a service instance: `<kind>-<host>-<pid>`.
pub fn default_instance_name(kind: &str) -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "host".to_owned());
    format!("{kind}-{host}-{}", std::process::id())
}

/// Why a worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Streams or the consumer could not be set up.
    #[error(transparent)]
    Provision(#[from] ProvisionError),
    /// The cancel records could not be followed.
    #[error("cannot follow cancel records: {0}")]
    Cancels(async_nats::Error),
    /// The NATS client stopped working for good; the worker stopped.
    #[error(transparent)]
    ConnectionLost(#[from] crate::connect::ConnectionLost),
}

/// Runs a worker until `shutdown` completes, then stops taking work, lets
/// running tasks finish within the grace period and hands the rest back.
pub async fn run(
    bus: Bus,
    settings: BusSettings,
    executor: Executor,
    env: TaskEnv,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    let (shutdown, lost) = crate::connect::stop_or_connection_loss(&bus.client, shutdown);
    tokio::pin!(shutdown);
    let (tasks_stream, consumer_name, dead_letters) = (
        bus.subjects.tasks_stream(),
        bus.subjects.worker_consumer(&config.pool),
        bus.subjects.dead_letter_task(&config.pool),
    );
    let stop_following = CancellationToken::new();
    let _stop_following_on_exit = stop_following.clone().drop_guard();
    // Provisioning waits for NATS as long as it takes; a stop must not.
    let starting = async {
        let cancels_store = bus.provision_for_worker(&settings).await?;
        // Records are kept as long as the bucket keeps them, which is the
        // deployment's setting, not necessarily this worker's.
        let kept = cancels_store.stream.cached_info().config.max_age;
        let keep = if kept.is_zero() {
            settings.history_max_age
        } else {
            kept
        };
        let cancels = Arc::new(cancel::CancelRegistry::new(keep));
        let consumer = bus.worker_consumer(&config.pool, config.ack_wait).await?;
        sweep_at_start(&bus, &tasks_stream, &consumer_name, &dead_letters).await;
        let duplicate_window = duplicate_window(&bus, &tasks_stream, &settings).await;
        // The cancels known so far, before any task can start.
        let follow = || cancels.follow(&bus, cancels_store.clone(), stop_following.clone());
        follow
            .retry(crate::bus::setup_backoff())
            // A stop, not a loop of warnings, when an operator must act.
            .when(crate::bus::is_transient)
            .notify(|error, delay| {
                warn!(%error, retry_in = ?delay, "Cannot follow the cancel records yet; will retry.");
            })
            .await
            .map_err(WorkerError::Cancels)?;
        Ok::<_, WorkerError>((consumer, duplicate_window, cancels))
    };
    let (consumer, duplicate_window, cancels) = tokio::select! {
        started = starting => started?,
        () = &mut shutdown => {
            info!("Worker stopped before it started.");
            return Ok(lost.check()?);
        }
    };
    info!(pool = %config.pool, concurrency = config.concurrency, executor = executor.name(), instance = %config.instance, "Worker started.");
    config.started.mark();

    // Created again if it goes away while the worker runs.
    let wanted = ServiceConsumer::Worker {
        pool: config.pool.clone(),
        ack_wait: config.ack_wait,
    };
    let (stop_keeping, keep_alive) = bus.keep_consumer(wanted, settings.consumer_check);

    let concurrency = config.concurrency.max(1);
    let grace = config.shutdown_grace;
    let tracker = TaskTracker::new();
    let registration = Registration::worker(
        bus.subjects.prefix(),
        &config.instance,
        &config.pool,
        concurrency,
    );
    let running = tracker.clone();
    let registered = register(&bus.client, registration, move || running.len()).await;
    let stop_runs = CancellationToken::new();
    let handler = Arc::new(TaskHandler::new(
        bus.clone(),
        duplicate_window,
        executor,
        config,
        env,
        cancels,
        keep_alive,
    ));
    let stopping = handler.stopping().clone();
    let slots = Arc::new(Semaphore::new(concurrency));

    let mut reconnects = ReconnectWatch::new(&bus.client);
    let mut pulls = PullRetry::new("tasks");

    'pull: loop {
        // An unreadable message drops the connection; find and remove it.
        sweep_after_reconnect(
            &mut reconnects,
            &bus,
            &tasks_stream,
            &consumer_name,
            &dead_letters,
        );
        let first = tokio::select! {
            () = &mut shutdown => break 'pull,
            permit = slots.clone().acquire_owned() => permit.expect("semaphore is never closed"),
        };
        // Take every free slot, so one pull request fills them all (as
        // many as the consumer lets one pull ask for).
        let most = crate::bus::pull_size(&consumer, usize::MAX);
        let mut permits = first;
        while permits.num_permits() < most
            && let Ok(more) = slots.clone().try_acquire_owned()
        {
            permits.merge(more);
        }
        let wanted = permits.num_permits();
        // Not while the executor refuses this worker: the pool's other
        // workers run the tasks meanwhile (see `pause`).
        if let Some(until) = handler.paused_until() {
            tokio::select! {
                () = &mut shutdown => break 'pull,
                () = tokio::time::sleep_until(until) => {}
            }
        }
        // Not while disconnected: see `connect::connected`.
        tokio::select! {
            () = &mut shutdown => break 'pull,
            () = crate::connect::connected(&bus.client) => {}
        }
        let pulled_on = connects(&bus.client);
        let mut batch = match consumer
            .batch()
            .max_messages(wanted)
            .expires(PULL_EXPIRES)
            .messages()
            .await
        {
            Ok(batch) => batch,
            Err(error) => {
                let delay = pulls.failed(&error);
                tokio::select! {
                    () = &mut shutdown => break 'pull,
                    () = tokio::time::sleep(delay) => continue 'pull,
                }
            }
        };
        // Set when the batch ended with an error: how long to wait before
        // the next pull.
        let mut retry_after = None;
        // Armed once the client has reconnected since the pull was made.
        let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
        let surely_ended = tokio::time::sleep(PULL_SURELY_ENDED);
        tokio::pin!(surely_ended);
        let mut reconnected = false;
        loop {
            let next = tokio::select! {
                () = &mut shutdown, if !stopping.is_cancelled() => {
                    stopping.cancel();
                    continue;
                }
                next = batch.next() => next,
                _ = reconnect_check.tick(), if !reconnected => {
                    if connects(&bus.client) != pulled_on {
                        reconnected = true;
                        let at = tokio::time::Instant::now() + PULL_SURELY_ENDED;
                        surely_ended.as_mut().reset(at);
                    }
                    continue;
                }
                // Only what has arrived already (unconstrained: tokio's
                // task budget would make a long drain look empty), then
                // the next pull.
                () = &mut surely_ended, if reconnected => {
                    tokio::task::unconstrained(batch.next()).now_or_never().flatten()
                }
            };
            let Some(result) = next else { break };
            let message = match result {
                Ok(message) => message,
                Err(error) => {
                    retry_after = Some(pulls.failed(&error));
                    break;
                }
            };
            if stopping.is_cancelled() {
                // Pulled after the shutdown signal: give it straight back.
                handler.refuse(&message).await;
                continue;
            }
            let permit = permits.split(1).expect("one permit per message pulled");
            let handler = handler.clone();
            let stop = stop_runs.clone();
            tracker.spawn(async move {
                handler.settle(&message, &stop).await;
                drop(permit);
            });
        }
        if stopping.is_cancelled() {
            break 'pull;
        }
        // Slots the batch did not fill are free again.
        drop(permits);
        match retry_after {
            Some(delay) => tokio::select! {
                () = &mut shutdown => break 'pull,
                () = tokio::time::sleep(delay) => {}
            },
            // Delivered, or ended with nothing to deliver (by the server's
            // 408; when nothing answered at all, by async-nats's own
            // timeout or, after a reconnect, once it had surely ended: a
            // missing heartbeat would tell that apart, but batches here
            // have none, and that pull is simply made again).
            None => pulls.worked(),
        }
    }

    // Tasks in hand but not started yet are handed back (whichever wait
    // above saw the signal first).
    stopping.cancel();
    // Stopping: a consumer deleted from now on (retiring the pool, say)
    // stays deleted.
    drop(stop_keeping);
    // With the client gone, no result could be stored: nothing to wait for.
    let grace = if lost.happened() {
        Duration::ZERO
    } else {
        grace
    };
    info!(running = tracker.len(), grace = ?grace, "Worker stopping: no new tasks; waiting for running ones.");
    tracker.close();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        warn!(
            running = tracker.len(),
            "Grace period over; stopping running tasks and handing them back."
        );
        stop_runs.cancel();
        tracker.wait().await;
    }
    if let Some(registered) = registered {
        registered.stop().await;
    }
    lost.check()?;
    crate::connect::flush_before_stop(&bus.client).await;
    info!("Worker stopped.");
    Ok(())
}

/// The requests stream's duplicate window, as the server has it (an operator
/// may have changed it by hand); the configured one if it cannot be read.
async fn duplicate_window(bus: &Bus, tasks_stream: &str, settings: &BusSettings) -> Duration {
    match bus.js.get_stream(tasks_stream).await {
        Ok(stream) => stream.cached_info().config.duplicate_window,
        Err(error) => {
            warn!(%error, configured = ?settings.duplicate_window, "Could not read the requests stream's duplicate window; assuming the configured one.");
            settings.duplicate_window
        }
    }
}
