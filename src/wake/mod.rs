//! The wake service: consumes completion events and posts one continuation
//! turn per completion (or per burst of them) to the originating session.
//!
//! Pieces: [`session_api`] posts, [`turn`] renders the text, [`ledger`] is the
//! idempotency record, [`lock`] the per-session exclusion, and `session` the
//! per-session actor that ties them together.

pub mod ledger;
pub mod lock;
mod origin;
mod session;
pub mod session_api;
mod stand_in;
pub mod turn;
pub mod webhook;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::bus::{Bus, BusSettings, KeepAliveEvery, ProvisionError, PullRetry, ServiceConsumer};
use crate::ops::service::{Registration, register};
use crate::outcome::Outcome;
use crate::protocol::{
    CompletionEvent, HEADER_ORIGIN_SESSION, HEADER_TRACEPARENT, MAX_TASK_COUNT, POISON_TOKEN,
    TraceParent, bounded, validate_delegation_id, validate_session_id,
};
use crate::quarantine::{ReconnectWatch, sweep_after_reconnect, sweep_at_start};
use ledger::WakeLedger;
use lock::SessionLocks;
use origin::OriginGate;
use session::{Pending, Router};
use session_api::{HttpSecurity, PostShape, SessionApi, SessionApiConfig, SessionApiError};

/// How the wake service behaves.
#[derive(Debug, Clone)]
pub struct WakeConfig {
    /// Where turns are posted.
    pub api: SessionApiConfig,
    /// Completions for one session arriving within this window are combined.
    pub coalesce_window: Duration,
    /// How long a session's lock is kept after its turn, waiting for the
    /// session's next completion: consecutive turns of a busy session then
    /// skip a lock release and a lock take (two KV writes each). Another
    /// wake instance wanting the session waits at most this long more.
    pub lock_linger: Duration,
    /// The consumer's AckWait.
    pub ack_wait: Duration,
    /// Most completions held unacknowledged at once (across all instances).
    pub max_in_flight: i64,
    /// First retry delay after a failed post (plus jitter, and at most half
    /// of `retry_max`); it doubles up to half of `retry_max`.
    pub retry_min: Duration,
    /// Longest retry delay, jitter included (a `Retry-After` may ask for
    /// longer).
    pub retry_max: Duration,
    /// How long 409 Conflict answers in a row are retried before the wake
    /// is dead-lettered. An API honouring `Idempotency-Key` answers 409
    /// while the turn under the key still runs, which is how a post given
    /// up after `request_timeout` looks while the agent's turn goes on; a
    /// refusal taken too early dead-letters a turn that is then delivered.
    pub conflict_patience: Duration,
    /// This instance's name, in lock values and logs.
    pub instance: String,
    /// Hermes chat completions, or a signed webhook.
    pub shape: PostShape,
    /// Plain-HTTP policy and extra CA for the HTTP client.
    pub http: HttpSecurity,
    /// Act on a completion only if the delegator's `submitted` record for
    /// its task exists and names the same origin session; otherwise
    /// dead-letter it. Off by default: publishers in other languages that
    /// write no records would have every wake refused.
    pub verify_origin: bool,
    /// Marked once the service takes completions (its `/readyz` waits
    /// for it).
    pub started: crate::ops::Started,
}

impl WakeConfig {
    /// Defaults for posting to `api`.
    pub fn new(api: SessionApiConfig) -> Self {
        Self {
            api,
            coalesce_window: Duration::from_millis(100),
            lock_linger: DEFAULT_LOCK_LINGER,
            ack_wait: Duration::from_secs(30),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(30),
            conflict_patience: DEFAULT_CONFLICT_PATIENCE,
            instance: crate::worker::default_instance_name("wake"),
            shape: PostShape::Hermes,
            http: HttpSecurity::default(),
            verify_origin: false,
            started: crate::ops::Started::default(),
        }
    }
}

/// How long a session lock is kept after a turn by default: longer than the
/// gap between a busy session's completions, short enough that another
/// instance taking over the session barely notices.
pub const DEFAULT_LOCK_LINGER: Duration = Duration::from_millis(250);

/// How the dead-letter reason of a wake given up after 409s for longer
/// than `--conflict-patience` begins: the turn under its key may have
/// been delivered, so `replay wakes --force` leaves it alone.
pub const CONFLICT_REFUSAL: &str = "session API answered 409 for longer than --conflict-patience";

/// How long 409 answers in a row are retried by default: longer than an
/// agent's turn with tool calls takes, so that one still running under the
/// key (this wake's own post, given up after `--request-timeout`) ends
/// before the conflict is taken as a refusal.
pub const DEFAULT_CONFLICT_PATIENCE: Duration = Duration::from_secs(600);

/// Completions held unacknowledged at once by default, across all wake
/// instances: enough to keep every session busy, small enough that a large
/// backlog stays in JetStream rather than in the wake service's memory
/// (which holds up to this many completions, each up to the max payload).
pub const DEFAULT_MAX_IN_FLIGHT: i64 = 1_000;

/// How often NATS confirms the completion consumer's pull request while no
/// completion arrives. Two missed in a row and the wake pulls again: a
/// pull request dies with its consumer's leader on a cluster node restart,
/// and completions would otherwise wait for it to expire.
const COMPLETION_HEARTBEAT: Duration = Duration::from_secs(2);

/// Why the wake service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// Streams, buckets or the consumer could not be set up.
    #[error(transparent)]
    Provision(#[from] ProvisionError),
    /// The session API client could not be built.
    #[error(transparent)]
    SessionApi(#[from] SessionApiError),
    /// The NATS client stopped working for good; the service stopped.
    #[error(transparent)]
    ConnectionLost(#[from] crate::connect::ConnectionLost),
}

/// What every session actor shares.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Posts turns.
    pub(crate) api: SessionApi,
    /// The idempotency record.
    pub(crate) ledger: WakeLedger,
    /// Per-session locks.
    pub(crate) locks: SessionLocks,
    /// For dead letters.
    pub(crate) bus: Bus,
    /// The history, where a batch's completions are collected.
    pub(crate) events: async_nats::jetstream::stream::Stream,
    /// Timings.
    pub(crate) config: WakeConfig,
    /// Posts awaiting the session API's answer, for status reports.
    pub(crate) posting: std::sync::atomic::AtomicUsize,
    /// How often held completions get an in-progress ack.
    pub(crate) keep_alive: KeepAliveEvery,
    /// Completions read whole for batch turns at once, across every
    /// session: what batch planning holds is bounded per service, not per
    /// session planning a batch.
    pub(crate) batch_reads: Arc<tokio::sync::Semaphore>,
    /// When a failed plan was last warned of, by any session: a cause
    /// they share (a lost permission, a deleted bucket) is warned of once
    /// a minute, not once per session.
    pub(crate) plan_warned: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// The same for a session-lock take that failed.
    pub(crate) lock_warned: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// Runs the wake service until `shutdown` completes; held completions are
/// then handed back for another instance.
pub async fn run(
    bus: Bus,
    settings: BusSettings,
    config: WakeConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WakeError> {
    let api = SessionApi::new(&config.api, &config.shape, &config.http)?;
    let (shutdown, lost) = crate::connect::stop_or_connection_loss(&bus.client, shutdown);
    tokio::pin!(shutdown);
    let (events_stream, poison) = (
        bus.subjects.events_stream(),
        bus.subjects.dead_letter_wake(POISON_TOKEN),
    );
    // Provisioning waits for NATS as long as it takes; a stop must not.
    let starting = async {
        let streams = bus.provision(&settings).await?;
        let provisioned = bus.provision_wake_state(&settings).await?;
        let consumer = bus
            .wake_consumer(config.ack_wait, config.max_in_flight)
            .await?;
        let wake = bus.subjects.wake_consumer();
        sweep_at_start(&bus, &events_stream, wake, &poison).await;
        Ok::<_, WakeError>((streams, provisioned, consumer))
    };
    let (streams, provisioned, consumer) = tokio::select! {
        started = starting => started?,
        () = &mut shutdown => {
            info!("Wake service stopped before it started.");
            return Ok(lost.check()?);
        }
    };
    info!(api = %session_api::redacted_url(&config.api.base_url), instance = %config.instance, verify_origin = config.verify_origin, "Wake service started.");
    config.started.mark();
    // Created again if it goes away while the wake runs.
    let wanted = ServiceConsumer::Wake {
        ack_wait: config.ack_wait,
        max_ack_pending: config.max_in_flight,
    };
    let (stop_keeping, keep_alive) = bus.keep_consumer(wanted, settings.consumer_check);
    let lock_ttl = lock_ttl(&settings, &provisioned.session_locks);
    let shared = Arc::new(Shared {
        api,
        ledger: WakeLedger::new(provisioned.wake_ledger),
        locks: SessionLocks::new(
            bus.js.clone(),
            provisioned.session_locks,
            &config.instance,
            lock_ttl,
        ),
        bus: bus.clone(),
        events: streams.events,
        config,
        posting: Default::default(),
        keep_alive,
        batch_reads: Arc::new(tokio::sync::Semaphore::new(session::batch_read_permits(
            bus.max_payload(),
        ))),
        plan_warned: std::sync::Mutex::new(None),
        lock_warned: std::sync::Mutex::new(None),
    });
    let registration = Registration::wake(bus.subjects.prefix(), &shared.config.instance);
    let reporting = shared.clone();
    let registered = register(&bus.client, registration, move || {
        reporting.posting.load(std::sync::atomic::Ordering::Relaxed)
    })
    .await;
    let tracker = TaskTracker::new();
    let stopping = CancellationToken::new();
    let router = Router::new(shared.clone(), tracker.clone(), stopping.clone());
    let gate = OriginGate::new(shared.config.verify_origin, shared.clone(), tracker.clone());

    let mut reconnects = ReconnectWatch::new(&bus.client);
    let mut sweep_check = tokio::time::interval(Duration::from_secs(2));
    let mut pulls = PullRetry::new("completions");

    'consume: loop {
        // Not while disconnected: see `connect::connected`.
        tokio::select! {
            () = &mut shutdown => break 'consume,
            () = crate::connect::connected(&bus.client) => {}
        }
        let mut messages = match consumer
            .stream()
            .max_messages_per_batch(crate::bus::pull_size(&consumer, 256))
            .heartbeat(COMPLETION_HEARTBEAT)
            .expires(Duration::from_secs(30))
            .messages()
            .await
        {
            Ok(messages) => messages,
            Err(error) => {
                let delay = pulls.failed(&error);
                tokio::select! {
                    () = &mut shutdown => break 'consume,
                    () = tokio::time::sleep(delay) => continue 'consume,
                }
            }
        };
        loop {
            let next = tokio::select! {
                () = &mut shutdown => break 'consume,
                next = messages.next() => next,
                _ = sweep_check.tick() => {
                    // An unreadable message drops the connection; find and remove it.
                    let wake = bus.subjects.wake_consumer();
                    sweep_after_reconnect(&mut reconnects, &bus, &events_stream, wake, &poison);
                    continue;
                }
            };
            match next {
                // Checked by reference, then moved: no clone of the message
                // (and its header map) per completion.
                Some(Ok(message)) => {
                    pulls.worked();
                    match admit(&message) {
                        Ok((event, session)) => {
                            gate.route(pending(message, event, session), &router);
                        }
                        Err(Admission::NothingToWake) => Outcome::Ack.apply(&message).await,
                        // In a task, as the origin checks are: a dead
                        // letter the DLQ is slow to take (no leader, a
                        // full store) must not hold up every session.
                        Err(Admission::Poison(reason)) => {
                            let shared = shared.clone();
                            tracker.spawn(async move {
                                dead_letter_poison(&shared, &message, reason).await;
                            });
                        }
                    }
                }
                // The pull request went silent (two heartbeats missed: it
                // died with the consumer's old leader when a cluster node
                // restarted, or NATS is unreachable) or was refused (503
                // while the consumer elects a leader). The stream itself
                // would only ask again once the request expires (35 s),
                // every wake held up meanwhile: ask again, once connected.
                // (A 409 Leadership Change or Server Shutdown ends a
                // request too, but the stream asks again by itself.)
                Some(Err(error)) => {
                    let delay = pulls.failed(&error);
                    tokio::select! {
                        () = &mut shutdown => break 'consume,
                        () = tokio::time::sleep(delay) => continue 'consume,
                    }
                }
                // The pull stream ended (its subscription closed): paced
                // like a failure, so that a stream ending again at once
                // cannot make a tight loop.
                None => {
                    let delay = pulls.failed(&"the pull stream ended");
                    tokio::select! {
                        () = &mut shutdown => break 'consume,
                        () = tokio::time::sleep(delay) => continue 'consume,
                    }
                }
            }
        }
    }

    // Stopping: a consumer deleted from now on stays deleted.
    drop(stop_keeping);
    info!("Wake service stopping; handing held completions back.");
    if !crate::connect::is_connected(&bus.client) {
        warn!(
            "NATS is unreachable: held completions are not handed back; they will be redelivered after their ack wait."
        );
    }
    stopping.cancel();
    tracker.close();
    // A post in flight may finish (and record and ack what it delivered);
    // nothing else an actor does while stopping should take long, but the
    // stop is bounded whatever happens to NATS meanwhile.
    // A post's worst case: its request timeout, a lock refresh that was
    // under way when the answer came, then the first write of its record.
    let patience = shared.config.api.request_timeout + 2 * crate::connect::STOP_TIMEOUT;
    if tokio::time::timeout(patience, tracker.wait())
        .await
        .is_err()
    {
        warn!(
            sessions = router.live_sessions(),
            timeout = ?patience,
            "Stopping without waiting longer for sessions still handing back; their completions will be redelivered after their ack wait."
        );
    } else {
        debug_assert_eq!(router.live_sessions(), 0, "every actor removed its entry");
    }
    if let Some(registered) = registered {
        registered.stop().await;
    }
    lost.check()?;
    crate::connect::flush_before_stop(&bus.client).await;
    info!("Wake service stopped.");
    Ok(())
}

/// Why a completion message is not routed to a session.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// No origin session (sync mode) or a silent cancel: nothing to wake; ack it.
    NothingToWake,
    /// Unusable: dead-letter with this reason and terminate.
    Poison(String),
}

/// Decides what to do with one completion message: the event and the
/// session it wakes, or why it is not routed.
fn admit(message: &jetstream::Message) -> Result<(CompletionEvent, String), Admission> {
    let origin = message
        .headers
        .as_ref()
        .and_then(|h| h.get(HEADER_ORIGIN_SESSION))
        .map(|v| v.as_str());
    check_completion(&message.payload, origin)
}

/// An admitted completion, ready for its session's actor.
fn pending(message: jetstream::Message, event: CompletionEvent, session: String) -> Pending {
    let traceparent = message
        .headers
        .as_ref()
        .and_then(|h| h.get(HEADER_TRACEPARENT))
        .and_then(|v| TraceParent::parse(v.as_str()))
        .map(|tp| tp.to_string());
    Pending {
        message,
        event,
        session,
        traceparent,
    }
}

/// How long a session lock lives: the lock bucket's max age, which is what
/// expires locks, whatever `--session-lock-ttl` says. They differ when it
/// was not given (the deployment's value stands), or when this wake could
/// not update the bucket (a user without the permission) or must not (a
/// shorter setting: only `init` shortens); refreshes timed by the setting
/// would then come after a shorter bucket had expired the lock.
fn lock_ttl(settings: &BusSettings, bucket: &async_nats::jetstream::kv::Store) -> Duration {
    let (setting, kept) = (
        settings.session_lock_ttl,
        bucket.stream.cached_info().config.max_age,
    );
    if kept.is_zero() {
        // Made by hand, or changed: only the bucket's age expires a lock.
        error!(bucket = %bucket.name, "The session-lock bucket keeps locks for ever (no max age): a lock whose wake instance died is never released, and its session is never woken again. Run `wakebus --session-lock-ttl 30s init` to set it.");
        return setting;
    }
    if kept == setting {
        return setting;
    }
    if settings.session_lock_ttl_change == crate::bus::AgeChange::Keep {
        return kept;
    }
    warn!(bucket = %bucket.name, bucket_ttl = ?kept, session_lock_ttl = ?setting, "The session-lock bucket expires locks after another time than --session-lock-ttl; timing the locks by the bucket's. Run `wakebus init --session-lock-ttl` with the deployment's value to change it.");
    kept
}

/// Decides, from a completion's body and its `Wakebus-Origin-Session`
/// header, which session it wakes. Returns the decoded event (with its
/// `event_id` filled in) and the session.
pub fn check_completion(
    payload: &[u8],
    origin_header: Option<&str>,
) -> Result<(CompletionEvent, String), Admission> {
    let mut event = CompletionEvent::decode(payload).map_err(|err| {
        Admission::Poison(bounded(&format!("completion is not valid: {err}"), 1024))
    })?;
    let session = match (event.origin_session_id.as_deref(), origin_header) {
        (None, None) => return Err(Admission::NothingToWake),
        (Some(body), Some(header)) if body == header => body.to_owned(),
        (Some(_), None) => {
            return Err(Admission::Poison(
                "completion has an origin session but no Wakebus-Origin-Session header".to_owned(),
            ));
        }
        _ => {
            return Err(Admission::Poison(
                "Wakebus-Origin-Session header does not match the completion's origin_session_id"
                    .to_owned(),
            ));
        }
    };
    validate_session_id(&session).map_err(|err| Admission::Poison(err.to_string()))?;
    if event.suppress_wake {
        return Err(Admission::NothingToWake);
    }
    validate_delegation_id(&event.delegation_id).map_err(|err| {
        Admission::Poison(format!("completion has an invalid delegation id: {err}"))
    })?;
    if event.task_count > MAX_TASK_COUNT {
        return Err(Admission::Poison(format!(
            "completion's task_count {} is above the limit of {MAX_TASK_COUNT}",
            event.task_count
        )));
    }
    if event.task_index >= event.task_count {
        return Err(Admission::Poison(format!(
            "completion's task_index {} is not below its task_count {}",
            event.task_index, event.task_count
        )));
    }
    // The event id names the completion everywhere (the Nats-Msg-Id, the
    // Idempotency-Key is derived from the same two fields): only the
    // documented value is accepted (or filled in when absent).
    let event_id = CompletionEvent::id_for(&event.delegation_id, event.task_index);
    if event.event_id.is_empty() {
        event.event_id = event_id;
    } else if event.event_id != event_id {
        return Err(Admission::Poison(format!(
            "completion's event_id is not {event_id:?}, as its delegation_id and task_index require"
        )));
    }
    Ok((event, session))
}

/// Dead-letters an unusable completion, then terminates it.
async fn dead_letter_poison(shared: &Shared, message: &jetstream::Message, reason: String) {
    warn!(subject = %message.subject, %reason, "Dead-lettering an unusable completion.");
    let subject = shared.bus.subjects.dead_letter_wake(POISON_TOKEN);
    dead_letter_then_term(&shared.bus, message, subject, reason, "poison").await;
}

/// Dead-letters a completion the wake will not post to `subject`, under
/// the dedupe id `dlq.wake.<kind>.<stream sequence>` (counted as `kind`),
/// then terminates it; one whose dead letter is not stored comes back
/// later (after 1 s, doubling up to 32 s).
pub(crate) async fn dead_letter_then_term(
    bus: &Bus,
    message: &jetstream::Message,
    subject: String,
    reason: String,
    kind: &'static str,
) {
    let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
    let msg_id = format!("dlq.wake.{kind}.{seq}");
    match bus
        .dead_letter(subject, message, &reason, &msg_id, kind)
        .await
    {
        Ok(()) => Outcome::Term(reason).apply(message).await,
        Err(error) => {
            warn!(%error, kind, "Could not dead-letter the completion; will retry.");
            Outcome::retry_later(message).apply(message).await;
        }
    }
}
