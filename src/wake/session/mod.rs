//! One actor per origin session with completions in hand: it combines them,
//! takes the session lock, posts one turn and acks.
//!
//! Within an instance the actor serializes a session's wakes; across
//! instances the KV lock does. While it waits (for the lock, for a retry), it
//! keeps every message it holds alive with in-progress acks, so nothing is
//! redelivered elsewhere meanwhile.
//!
//! - this file: routing completions to actors, the actor loop, the lock;
//! - [`actors`]: the table of live actors (and the sessions gauge);
//! - [`hold`]: what an actor has in hand, kept alive through every wait;
//! - [`plan`]: sorting held completions into turns, with the ledger;
//! - [`post`]: posting one turn, retrying, recording and acking it.

mod actors;
mod batch;
mod hold;
mod plan;
mod post;

pub(crate) use batch::{batch_read_permits, newest_before};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, error, info, info_span, warn};

use self::hold::Hold;
use super::Shared;
use super::ledger::WakeLedger;
use super::lock::{LockError, LockGuard, Taken};
use super::session_api::Post;
use crate::ops::metrics as m;
use crate::protocol::{CompletionEvent, session_token};

/// How soon a plan refused by a changed ledger entry is made again: at
/// once would do, but a writer that keeps changing an entry (an operator's
/// loop) must not make a busy loop of it.
const REPLAN_AFTER_CHANGE: Duration = Duration::from_millis(100);

/// The longest wait between two plans that failed, before jitter (which
/// adds up to as much again): the waits stay below the session lock's
/// default TTL (30 s), which is not refreshed while the actor waits.
const PLAN_RETRY_MAX: Duration = Duration::from_secs(8);

/// How often failed plans are warned of, across the service.
const PLAN_FAILURE_WARN_EVERY: Duration = Duration::from_secs(60);

/// Whether a failure that every session in hand may meet is warned of now:
/// once a minute across the service (`gate` is when it last was), the rest
/// at DEBUG.
fn warning_due(gate: &std::sync::Mutex<Option<Instant>>, now: Instant) -> bool {
    let mut warned = gate.lock().expect("warning gate");
    let due = warned.is_none_or(|at| now.duration_since(at) >= PLAN_FAILURE_WARN_EVERY);
    if due {
        *warned = Some(now);
    }
    due
}

/// A session's streak of plans that failed (the ledger or the history
/// could not be read or written): each is tried again after 1 s, doubling
/// up to [`PLAN_RETRY_MAX`], each wait plus up to as much again in jitter;
/// the failures are warned of once a minute across the service (the rest
/// at DEBUG). A failure that lasts (a permission taken away, a deleted
/// bucket), which every session in hand meets, then neither floods the
/// log nor keeps the ledger busy with a retry a second per session.
#[derive(Debug, Default)]
struct PlanFailures {
    /// The streak's waits; `None` while plans succeed.
    delays: Option<backon::ExponentialBackoff>,
    /// When this streak was last warned of.
    warned_at: Option<Instant>,
    /// Plans failed in the streak.
    count: u32,
}

impl PlanFailures {
    /// Counts a failed plan; returns the wait before the next. `warned`
    /// is when the service last warned of one.
    fn failed(
        &mut self,
        error: &plan::PlanError,
        warned: &std::sync::Mutex<Option<Instant>>,
    ) -> Duration {
        use backon::BackoffBuilder as _;
        self.count += 1;
        let now = Instant::now();
        if warning_due(warned, now) {
            self.warned_at = Some(now);
            warn!(%error, failures = self.count, "Could not plan the session's turns; will retry (further failures are logged at DEBUG for a minute).");
        } else {
            debug!(%error, failures = self.count, "Could not plan the session's turns; will retry.");
        }
        let delays = self.delays.get_or_insert_with(|| {
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_secs(1))
                .with_max_delay(PLAN_RETRY_MAX)
                .with_jitter()
                .without_max_times()
                .build()
        });
        delays.next().unwrap_or(PLAN_RETRY_MAX)
    }

    /// Ends the streak, if any, saying so if it was warned of.
    fn succeeded(&mut self) {
        if self.warned_at.is_some() {
            info!(
                failures = self.count,
                "The session's turns could be planned again."
            );
        }
        *self = Self::default();
    }
}

/// A completion waiting to be woken, with the message that carries it.
#[derive(Debug)]
pub(crate) struct Pending {
    /// The JetStream message, acked once the wake is delivered.
    pub(crate) message: jetstream::Message,
    /// The decoded completion.
    pub(crate) event: CompletionEvent,
    /// The origin session (already validated).
    pub(crate) session: String,
    /// The trace context the completion arrived with (the worker's hop).
    pub(crate) traceparent: Option<String>,
}

impl Pending {
    fn ledger_key(&self) -> String {
        WakeLedger::key(&self.event.delegation_id, self.event.task_index)
    }

    /// The completion's id, derived rather than trusted from the body: the
    /// `Idempotency-Key` of a single-completion turn (a new one for a
    /// forced replay copy).
    fn event_key(&self) -> String {
        let key = CompletionEvent::id_for(&self.event.delegation_id, self.event.task_index);
        self.forced_key(&key).unwrap_or(key)
    }

    /// `<base>.replay.<ULID>` if this is a `replay wakes --force` copy.
    fn forced_key(&self, base: &str) -> Option<String> {
        crate::replay::forced_idempotency_key(base, self.message.headers.as_ref())
    }

    /// The `Idempotency-Key` its wake carries unless forced: the
    /// completion's id.
    fn base_key(&self) -> String {
        CompletionEvent::id_for(&self.event.delegation_id, self.event.task_index)
    }
}

/// One continuation turn to post.
#[derive(Debug)]
struct Turn {
    /// The `Idempotency-Key`.
    key: String,
    /// The rendered text.
    text: String,
    /// Ledger keys of the completions it reports: one per completion,
    /// but a batch's consolidated turn (`<delegation>.batch`) and an early
    /// failure notice (`<delegation>.<task>.early`) have their own.
    covers: Vec<String>,
    /// `<delegation_id>.<task_index>` of every completion it reports, as a
    /// webhook's `completions` lists them, where they are not `covers`:
    /// every task of a batch, the failed task of an early notice.
    reports: Option<Vec<String>>,
    /// The covered entries whose delivery this turn records, each with its
    /// revision as this instance last read or wrote it: the `delivered`
    /// records are written only over these, so that one never lands over
    /// a newer write (a forced replay's). A re-sent combined turn leaves
    /// out the completions a forced replay has taken out of it.
    at: BTreeMap<String, u64>,
    /// Messages to ack once it is delivered.
    messages: Vec<Pending>,
    /// Trace context: the completion's until [`Turn::span`] makes the
    /// turn its own hop, then the post's.
    traceparent: Option<String>,
    /// Planned anew in this plan, never marked for a post before: no
    /// earlier post of it can have been taken.
    first_send: bool,
}

impl Turn {
    /// The completion events in hand, once each.
    fn events(&self) -> Vec<&CompletionEvent> {
        let mut events: Vec<&CompletionEvent> = Vec::new();
        for pending in &self.messages {
            if !events.iter().any(|e| e.event_id == pending.event.event_id) {
                events.push(&pending.event);
            }
        }
        events
    }

    /// `<delegation_id>.<task_index>` of every completion it reports.
    fn reports(&self) -> &[String] {
        self.reports.as_deref().unwrap_or(&self.covers)
    }

    /// The post for this turn.
    fn post<'a>(&'a self, session: &'a str, events: &'a [&'a CompletionEvent]) -> Post<'a> {
        Post {
            session,
            text: &self.text,
            idempotency_key: &self.key,
            traceparent: self.traceparent.as_deref(),
            reports: self.reports(),
            events,
        }
    }
    /// The span of a turn's logs: the delegations it reports and its trace.
    /// The turn becomes a hop of the trace: its span is a child of the
    /// completion's, and the post carries the turn's own `traceparent`.
    fn span(&mut self) -> tracing::Span {
        let mut ids: Vec<&str> = self
            .messages
            .iter()
            .map(|p| p.event.delegation_id.as_str())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let delegation_id = ids.join(",");
        let parent = self
            .traceparent
            .as_deref()
            .and_then(crate::protocol::TraceParent::parse);
        let trace_id = parent.map(|tp| tp.trace_id_hex()).unwrap_or_default();
        let span = info_span!("turn", %delegation_id, %trace_id, idempotency_key = %self.key);
        if parent.is_some() {
            self.traceparent = Some(crate::telemetry::hop(&span, parent).to_string());
        }
        span
    }
}

impl actors::Routed for Box<Pending> {
    fn session(&self) -> &str {
        &self.session
    }
}

/// An actor's incoming completions. Boxed: the channel allocates blocks of
/// 32 slots (and keeps a few for reuse while it lives), and with a
/// thousand sessions in hand at once, blocks of 824-byte `Pending`s held
/// tens of MiB; boxes make a block 256 bytes, for one small allocation per
/// completion.
pub(super) type Inbox = UnboundedReceiver<Box<Pending>>;

/// How posting one turn ended.
enum Posted {
    /// Delivered or dead-lettered; its messages are acked.
    Done,
    /// Delivered, but the service stopped before its ledger records were
    /// stored; nothing of it is handed back (a copy would be posted again).
    DoneThenShutdown,
    /// A NATS write failed; try the whole thing again shortly.
    Retry,
    /// Shutting down; hand its messages back.
    Shutdown,
}

/// How one round of [`Router::deliver`] ended.
enum Round {
    /// Everything held was posted (or settled).
    Done,
    /// Planning or a NATS write failed; what was held is held again, for
    /// the next round.
    Again,
    /// The service is stopping; what is held is to be handed back.
    Stopped,
}

/// Routes completions to their session's actor, starting actors on demand.
#[derive(Debug)]
pub(crate) struct Router {
    /// Inboxes of live actors, by raw session id.
    actors: actors::Actors<Box<Pending>>,
    /// What actors need.
    shared: Arc<Shared>,
    /// Tracks actors so shutdown can wait for them.
    tracker: TaskTracker,
    /// Cancelled on shutdown.
    shutdown: CancellationToken,
}

impl Router {
    pub(crate) fn new(
        shared: Arc<Shared>,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Self {
            actors: actors::Actors::new(),
            shared,
            tracker,
            shutdown,
        })
    }

    /// Hands `pending` to its session's actor, starting one if needed.
    pub(crate) fn route(self: &Arc<Self>, pending: Pending) {
        let Some((session, rx)) = self.actors.route(Box::new(pending)) else {
            return;
        };
        let router = self.clone();
        let span = info_span!("session", session_token = %session_token(&session));
        self.tracker
            .spawn(async move { router.actor(session, rx).await }.instrument(span));
    }

    /// Sessions with a live actor.
    pub(crate) fn live_sessions(&self) -> usize {
        self.actors.len()
    }

    async fn actor(self: Arc<Self>, session: String, rx: Inbox) {
        let config = &self.shared.config;
        let mut hold = Hold::new(rx, self.shared.keep_alive.clone());
        // The session lock, kept for `lock_linger` after a turn so that the
        // session's next completion does not pay for a release and a take.
        let mut lock: Option<LockGuard> = None;
        // The last round planned or posted nothing, and is tried again
        // under the lock it kept: not a new turn for the lock metric.
        let mut again = false;
        let mut failures = PlanFailures::default();
        loop {
            if hold.held.is_empty() && lock.is_none() {
                // Nothing in hand and no lock to keep: the actor ends (a
                // session's next completion starts a new one), so memory
                // follows the sessions being woken, not every session seen.
                match hold.rx.try_recv() {
                    Ok(p) => hold.held.push(*p),
                    Err(TryRecvError::Disconnected) => return,
                    Err(TryRecvError::Empty) if self.actors.retire(&session, &hold.rx) => return,
                    Err(TryRecvError::Empty) => continue,
                }
            } else if hold.held.is_empty() {
                let linger = config.lock_linger.min(self.shared.locks.refresh_interval());
                tokio::select! {
                    biased;
                    next = hold.rx.recv() => match next {
                        Some(p) => hold.held.push(*p),
                        None => return self.release(lock).await,
                    },
                    () = self.shutdown.cancelled() => {
                        self.release(lock.take()).await;
                        continue;
                    }
                    () = tokio::time::sleep(linger) => {
                        self.release(lock.take()).await;
                        continue;
                    }
                }
            }
            // Combine whatever arrives within the window (with no window,
            // whatever is already here: a zero-length timer would still
            // wait for the next tick of the timer wheel).
            if config.coalesce_window.is_zero() {
                if self.shutdown.is_cancelled() {
                    self.release(lock).await;
                    return self.hand_back(&session, hold).await;
                }
                while let Ok(p) = hold.rx.try_recv() {
                    hold.held.push(*p);
                }
            } else if !self.wait(&mut hold, config.coalesce_window).await {
                self.release(lock).await;
                return self.hand_back(&session, hold).await;
            }
            if !crate::connect::is_connected(&self.shared.bus.client) {
                // NATS is unreachable: the ledger cannot be read and lock
                // writes would only queue. Keep what is held (and any lock:
                // a post refreshes it first if due) and look again.
                if !self.wait(&mut hold, Duration::from_secs(1)).await {
                    self.release(lock).await;
                    return self.hand_back(&session, hold).await;
                }
                continue;
            }
            let mut guard = match lock.take() {
                Some(guard) => {
                    if !again {
                        m::wake_session_lock("kept");
                    }
                    guard
                }
                None => match self.acquire_lock(&mut hold).await {
                    Some(guard) => guard,
                    None => return self.hand_back(&session, hold).await,
                },
            };
            match self
                .deliver(&session, &mut hold, &mut guard, &mut failures)
                .await
            {
                Round::Done => again = false,
                Round::Again => again = true,
                Round::Stopped => {
                    self.release(Some(guard)).await;
                    return self.hand_back(&session, hold).await;
                }
            }
            // A lock whose refresh failed is never reused: the next turn
            // takes the lock anew.
            lock = (!guard.is_lost()).then_some(guard);
        }
    }

    /// Gives the session lock back, if held.
    async fn release(&self, lock: Option<LockGuard>) {
        if let Some(guard) = lock {
            self.shared.locks.release(guard).await;
        }
    }

    /// Waits for `delay` while keeping what `hold` has alive and collecting
    /// arrivals. Returns false if the service is shutting down.
    async fn wait(&self, hold: &mut Hold, delay: Duration) -> bool {
        hold.wait(Instant::now() + delay, &[], &self.shutdown).await
    }

    async fn acquire_lock(&self, hold: &mut Hold) -> Option<LockGuard> {
        let token = session_token(&hold.held[0].session);
        let mut delay = Duration::from_millis(20);
        // Takes that failed (not merely found the lock busy).
        let mut failures = 0u32;
        loop {
            let failed = match self.shared.locks.try_acquire(&token).await {
                Ok(Some(guard)) => {
                    m::wake_session_lock(match guard.taken() {
                        Taken::Anew => "taken",
                        Taken::OverOwnMarker => "retaken",
                        Taken::Adopted => {
                            info!(
                                "Took back a session lock this instance had written whose answer or release was lost."
                            );
                            "adopted"
                        }
                    });
                    return Some(guard);
                }
                Ok(None) => {
                    m::wake_session_lock("busy");
                    false
                }
                // Not tried: waiting for the connection.
                Err(LockError::Disconnected) => false,
                // A failure every session in hand may meet (the bucket
                // deleted, a permission taken away): warned of once a
                // minute across the service, and tried again more slowly
                // than a busy lock.
                Err(error) => {
                    m::wake_session_lock("error");
                    failures += 1;
                    if warning_due(&self.shared.lock_warned, Instant::now()) {
                        warn!(%error, failures, "Could not take the session lock; will retry (further failures are logged at DEBUG for a minute).");
                    } else {
                        debug!(%error, failures, "Could not take the session lock; will retry.");
                    }
                    true
                }
            };
            // A busy lock is looked at again from 20 ms, doubling up to a
            // second; a failed take after 1 s, doubling up to 8 s.
            delay = if failed {
                delay.clamp(Duration::from_secs(1), PLAN_RETRY_MAX)
            } else {
                delay.min(Duration::from_secs(1))
            };
            if !self.wait(hold, delay).await {
                return None;
            }
            delay *= 2;
        }
    }

    /// Delivers everything held. If shutdown interrupted it, `hold` keeps
    /// what is left to hand back.
    async fn deliver(
        &self,
        session: &str,
        hold: &mut Hold,
        guard: &mut LockGuard,
        failures: &mut PlanFailures,
    ) -> Round {
        // Under a lock kept alive: a large batch's plan over a slow link
        // can outlast it (and a round that only acks members, one kept
        // from an earlier round).
        // The plan's reads (a batch's members, over a slow link) can
        // outlast AckWait too: what it plans is kept alive meanwhile.
        let replies = hold::ack_subjects(&hold.held);
        let (held, clock) = hold.planning_parts();
        let client = &self.shared.bus.client;
        let plan = hold::keeping_alive(clock, client, &replies, self.plan(held));
        let planned = self.shared.locks.keep_during(guard, plan).await;
        if planned.is_ok() {
            failures.succeeded();
        }
        let mut turns = match planned {
            Ok(turns) => turns,
            // An entry that is not ledger JSON (edited by hand, or written
            // by a newer wakebus) will not read differently in a second:
            // an operator must look, and the retries slow down.
            Err(
                error @ plan::PlanError::Ledger(crate::wake::ledger::LedgerError::Corrupt {
                    ..
                }),
            ) => {
                error!(%error, "A wake ledger entry of this session's completions cannot be read; its completions are held until an operator fixes or deletes the entry (docs/GUARANTEES.md, \"wake ledger entry that is not ledger JSON\"). Will retry in 30 s.");
                return self.again_after(hold, Duration::from_secs(30)).await;
            }
            // Another instance or a replay wrote an entry since it was
            // read: nothing is lost, the plan is made again on what is
            // there now.
            Err(
                error @ plan::PlanError::Ledger(crate::wake::ledger::LedgerError::Changed {
                    ..
                }),
            ) => {
                info!(%error, "A wake ledger entry changed while the session's turns were planned; planning again.");
                return self.again_after(hold, REPLAN_AFTER_CHANGE).await;
            }
            Err(error) => {
                let delay = failures.failed(&error, &self.shared.plan_warned);
                return self.again_after(hold, delay).await;
            }
        };
        let mut refresh_at = guard.written_at() + self.shared.locks.refresh_interval();
        while !turns.is_empty() {
            // The turns after this one stay in `turns`, for its waits to
            // keep them alive too.
            let mut turn = turns.remove(0);
            let span = turn.span();
            let mut posting = post::Posting {
                session,
                turn: &turn,
                later: &turns,
                guard: &mut *guard,
                refresh_at: &mut refresh_at,
            };
            match self.post_turn(&mut posting, hold).instrument(span).await {
                Posted::Done => {}
                Posted::Retry => {
                    hold.held.extend(turn.messages);
                    hold.held.extend(turns.into_iter().flat_map(|t| t.messages));
                    return self.again_after(hold, Duration::from_secs(1)).await;
                }
                Posted::DoneThenShutdown => {
                    hold.held.extend(turns.into_iter().flat_map(|t| t.messages));
                    return Round::Stopped;
                }
                Posted::Shutdown => {
                    hold.held.extend(turn.messages);
                    hold.held.extend(turns.into_iter().flat_map(|t| t.messages));
                    return Round::Stopped;
                }
            }
        }
        Round::Done
    }

    /// [`Round::Again`] after `delay`, or [`Round::Stopped`] if the service
    /// stops first.
    async fn again_after(&self, hold: &mut Hold, delay: Duration) -> Round {
        if self.wait(hold, delay).await {
            Round::Again
        } else {
            Round::Stopped
        }
    }

    /// Shutdown: hand every held message back at once so another instance
    /// takes it. The closed inbox takes nothing more, so the actor's entry
    /// goes too.
    async fn hand_back(&self, session: &str, hold: Hold) {
        let Hold { held, mut rx, .. } = hold;
        rx.close();
        self.actors.forget(session);
        let mut all = held;
        while let Ok(p) = rx.try_recv() {
            all.push(*p);
        }
        for p in &all {
            crate::outcome::Outcome::HandBack.apply(&p.message).await;
        }
    }
}
