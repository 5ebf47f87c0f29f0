//! One actor per origin session with completions in hand: it combines them,
//! takes the session lock, posts one turn and acks.
//!
//! Within an instance the actor serializes a session's wakes; across
//! instances the KV lock does. While it waits (for the lock, for a retry), it
//! keeps every message it holds alive with in-progress acks, so nothing is
//! redelivered elsewhere meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use backon::{BackoffBuilder, ExponentialBuilder};
use futures::future::join_all;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

use super::Shared;
use super::ledger::{Intent, LedgerError, LedgerState, WakeLedger};
use super::lock::LockGuard;
use super::session_api::{Post, PostResult};
use super::turn;
use crate::ops::metrics as m;
use crate::outcome::Outcome;
use crate::protocol::{CompletionEvent, EventKind, Status, WakeMode, session_token};
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use std::collections::BTreeMap;

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
}

/// One continuation turn to post.
#[derive(Debug)]
struct Turn {
    /// The `Idempotency-Key`.
    key: String,
    /// The rendered text.
    text: String,
    /// Ledger keys of the completions it reports.
    covers: Vec<String>,
    /// Messages to ack once it is delivered.
    messages: Vec<Pending>,
    /// Trace context: the completion's until [`Turn::span`] makes the
    /// turn its own hop, then the post's.
    traceparent: Option<String>,
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

    /// The post for this turn.
    fn post<'a>(&'a self, session: &'a str, events: &'a [&'a CompletionEvent]) -> Post<'a> {
        Post {
            session,
            text: &self.text,
            idempotency_key: &self.key,
            traceparent: self.traceparent.as_deref(),
            covers: &self.covers,
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

/// Why turns could not be planned; the actor retries shortly.
#[derive(Debug, thiserror::Error)]
enum PlanError {
    /// The wake ledger is unavailable.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The history could not be read.
    #[error("cannot read the history: {0}")]
    History(String),
}

/// How posting one turn ended.
enum Posted {
    /// Delivered or dead-lettered; its messages are acked.
    Done,
    /// A NATS write failed; try the whole thing again shortly.
    Retry,
    /// Shutting down; hand its messages back.
    Shutdown,
}

/// Routes completions to their session's actor, starting actors on demand.
#[derive(Debug)]
pub(crate) struct Router {
    /// Senders to live actors, by raw session id.
    sessions: Mutex<HashMap<String, UnboundedSender<Pending>>>,
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
            sessions: Mutex::new(HashMap::new()),
            shared,
            tracker,
            shutdown,
        })
    }

    /// Hands `pending` to its session's actor.
    pub(crate) fn route(self: &Arc<Self>, pending: Pending) {
        let mut sessions = self.sessions.lock().expect("router lock poisoned");
        let pending = match sessions.get(&pending.session) {
            Some(tx) => match tx.send(pending) {
                Ok(()) => return,
                Err(returned) => returned.0,
            },
            None => pending,
        };
        let (tx, rx) = unbounded_channel();
        let session = pending.session.clone();
        tx.send(pending).expect("receiver is alive");
        sessions.insert(session.clone(), tx);
        let router = self.clone();
        let span = info_span!("session", session_token = %session_token(&session));
        self.tracker
            .spawn(async move { router.actor(session, rx).await }.instrument(span));
    }

    /// Removes an idle actor, unless something arrived for it meanwhile.
    fn retire(&self, session: &str, rx: &UnboundedReceiver<Pending>) -> bool {
        let mut sessions = self.sessions.lock().expect("router lock poisoned");
        if rx.is_empty() {
            sessions.remove(session);
            true
        } else {
            false
        }
    }

    async fn actor(self: Arc<Self>, session: String, mut rx: UnboundedReceiver<Pending>) {
        let config = &self.shared.config;
        let mut held: Vec<Pending> = Vec::new();
        // The session lock, kept for `lock_linger` after a turn so that the
        // session's next completion does not pay for a release and a take.
        let mut lock: Option<LockGuard> = None;
        loop {
            if held.is_empty() {
                let idle = match lock {
                    Some(_) => config.lock_linger.min(self.shared.locks.refresh_interval()),
                    None => Duration::from_secs(30),
                };
                tokio::select! {
                    next = rx.recv() => match next {
                        Some(p) => held.push(p),
                        None => return self.release(lock).await,
                    },
                    () = tokio::time::sleep(idle) => {
                        if lock.is_some() {
                            self.release(lock.take()).await;
                        } else if self.retire(&session, &rx) {
                            return;
                        }
                        continue;
                    }
                    () = self.shutdown.cancelled() => {
                        self.release(lock.take()).await;
                        if self.retire(&session, &rx) { return; }
                        continue;
                    }
                }
            }
            // Combine whatever arrives within the window.
            let window_end = Instant::now() + config.coalesce_window;
            if !self.wait(window_end, &mut held, &mut rx).await {
                self.release(lock).await;
                return self.hand_back(held, &mut rx).await;
            }
            let mut guard = match lock.take() {
                Some(guard) => guard,
                None => match self.acquire_lock(&mut held, &mut rx).await {
                    Some(guard) => guard,
                    None => return self.hand_back(held, &mut rx).await,
                },
            };
            if !self.deliver(&session, &mut held, &mut rx, &mut guard).await {
                self.release(Some(guard)).await;
                return self.hand_back(held, &mut rx).await;
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

    /// Waits until `until` while keeping `held` alive and collecting arrivals.
    /// Returns false if the service is shutting down.
    async fn wait(
        &self,
        until: Instant,
        held: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
    ) -> bool {
        let mut keepalive = tokio::time::interval_at(
            Instant::now() + self.shared.config.progress_interval(),
            self.shared.config.progress_interval(),
        );
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return true,
                Some(p) = rx.recv() => held.push(p),
                _ = keepalive.tick() => keep_alive(held).await,
                () = self.shutdown.cancelled() => return false,
            }
        }
    }

    async fn acquire_lock(
        &self,
        held: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
    ) -> Option<LockGuard> {
        let token = session_token(&held[0].session);
        let mut delay = Duration::from_millis(20);
        loop {
            match self.shared.locks.try_acquire(&token).await {
                Ok(Some(guard)) => return Some(guard),
                Ok(None) => {}
                Err(error) => warn!(%error, "Could not take the session lock; will retry."),
            }
            if !self.wait(Instant::now() + delay, held, rx).await {
                return None;
            }
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// Delivers everything in `held`. Returns false if shutdown interrupted
    /// it; `held` then keeps what is left to hand back.
    async fn deliver(
        &self,
        session: &str,
        held: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
        guard: &mut LockGuard,
    ) -> bool {
        let mut turns = match self.plan(held).await {
            Ok(turns) => turns,
            Err(error) => {
                warn!(%error, "Wake ledger unavailable; will retry.");
                return self
                    .wait(Instant::now() + Duration::from_secs(1), held, rx)
                    .await;
            }
        };
        let mut refresh_at = guard.written_at() + self.shared.locks.refresh_interval();
        while !turns.is_empty() {
            let mut turn = turns.remove(0);
            let span = turn.span();
            match self
                .post_turn(session, &turn, guard, &mut refresh_at, held, rx)
                .instrument(span)
                .await
            {
                Posted::Done => {}
                Posted::Retry => {
                    held.extend(turn.messages);
                    held.extend(turns.into_iter().flat_map(|t| t.messages));
                    return self
                        .wait(Instant::now() + Duration::from_secs(1), held, rx)
                        .await;
                }
                Posted::Shutdown => {
                    held.extend(turn.messages);
                    held.extend(turns.into_iter().flat_map(|t| t.messages));
                    return false;
                }
            }
        }
        true
    }

    /// Sorts held completions into turns: already delivered ones are acked,
    /// ones whose earlier post ended in doubt are re-sent as recorded, the
    /// rest become one new turn.
    async fn plan(&self, held: &mut Vec<Pending>) -> Result<Vec<Turn>, PlanError> {
        let (members, singles): (Vec<Pending>, Vec<Pending>) = std::mem::take(held)
            .into_iter()
            .partition(|p| p.event.task_count > 1 && p.event.wake_mode == WakeMode::Batch);
        *held = singles;
        let mut turns = self.plan_batches(members).await?;
        turns.extend(self.plan_singles(held).await?);
        Ok(turns)
    }

    /// Batch members: one consolidated turn once every task has a
    /// completion in the history (whoever handles the last one sees them
    /// all); until then each member is acked, or reported early if it failed
    /// and the batch asked for that.
    async fn plan_batches(&self, members: Vec<Pending>) -> Result<Vec<Turn>, PlanError> {
        let ledger = &self.shared.ledger;
        let mut by_delegation: BTreeMap<String, Vec<Pending>> = BTreeMap::new();
        for pending in members {
            by_delegation
                .entry(pending.event.delegation_id.clone())
                .or_default()
                .push(pending);
        }
        let mut turns = Vec::new();
        for (delegation_id, group) in by_delegation {
            let batch_key = WakeLedger::batch_key(&delegation_id);
            if let Some(LedgerState::Delivered { .. }) = ledger.get(&batch_key).await? {
                for pending in &group {
                    Outcome::Ack.apply(&pending.message).await;
                }
                continue;
            }
            if let Some(all) = self.batch_completions(&group[0]).await? {
                info!(delegation_id = %delegation_id, tasks = all.len(), "Every task of the batch has ended; waking once.");
                let key = group.iter().find_map(|p| p.forced_key(&batch_key));
                turns.push(Turn {
                    traceparent: group[0].traceparent.clone(),
                    key: key.unwrap_or_else(|| batch_key.clone()),
                    text: turn::render_batch(&delegation_id, &all),
                    covers: vec![batch_key],
                    messages: group,
                });
                continue;
            }
            for pending in group {
                let event = &pending.event;
                let early_key = format!("{}.{}.early", event.delegation_id, event.task_index);
                // A failure, not a cancel: the canceller knows already.
                let notify = event.notify_early_failure
                    && matches!(
                        event.status,
                        Status::Failed | Status::Timeout | Status::Error
                    );
                if notify && ledger.get(&early_key).await?.is_none() {
                    turns.push(Turn {
                        traceparent: pending.traceparent.clone(),
                        key: early_key.clone(),
                        text: turn::render_early_failure(event),
                        covers: vec![early_key],
                        messages: vec![pending],
                    });
                } else {
                    // Recorded in the history; the batch's last task reports it.
                    Outcome::Ack.apply(&pending.message).await;
                }
            }
        }
        Ok(turns)
    }

    /// Every completion of `member`'s batch, by task index, if all exist.
    async fn batch_completions(
        &self,
        member: &Pending,
    ) -> Result<Option<Vec<CompletionEvent>>, PlanError> {
        let subjects = &self.shared.bus.subjects;
        let token = session_token(&member.session);
        let mut all = Vec::with_capacity(member.event.task_count as usize);
        for index in 0..member.event.task_count {
            if index == member.event.task_index {
                all.push(member.event.clone());
                continue;
            }
            let subject =
                subjects.event(&token, &member.event.delegation_id, index, EventKind::Done);
            match self
                .shared
                .events
                .get_last_raw_message_by_subject(&subject)
                .await
            {
                Ok(message) => all.push(
                    CompletionEvent::decode(&message.payload)
                        .map_err(|e| PlanError::History(e.to_string()))?,
                ),
                Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    return Ok(None);
                }
                Err(error) => return Err(PlanError::History(error.to_string())),
            }
        }
        Ok(Some(all))
    }

    async fn plan_singles(&self, held: &mut Vec<Pending>) -> Result<Vec<Turn>, PlanError> {
        let ledger = &self.shared.ledger;
        // The common case: one completion, never seen before. Creating its
        // `posting` entry both tells that nothing was recorded for it and
        // records the post, in one write; if an entry exists, nothing is
        // written and the full plan below reads it.
        if let [only] = held.as_slice() {
            let key = only.event_key();
            if ledger.mark_posting_if_new(&only.ledger_key(), &key).await? {
                let pending = held.pop().expect("one held");
                return Ok(vec![Turn {
                    traceparent: pending.traceparent.clone(),
                    text: turn::render(&[&pending.event]),
                    covers: vec![pending.ledger_key()],
                    key,
                    messages: vec![pending],
                }]);
            }
        }
        let states = join_all(
            held.iter()
                .map(|p| async move { ledger.get(&p.ledger_key()).await }),
        )
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        let mut recovering: Vec<Turn> = Vec::new();
        let mut fresh: Vec<Pending> = Vec::new();
        for (pending, state) in std::mem::take(held).into_iter().zip(states) {
            match state {
                Some(LedgerState::Delivered { .. }) => {
                    info!(delegation_id = %pending.event.delegation_id, task_index = pending.event.task_index, "Wake already delivered; acking the duplicate.");
                    Outcome::Ack.apply(&pending.message).await;
                }
                Some(LedgerState::Posting { idempotency_key }) => {
                    if let Some(turn) = recovering.iter_mut().find(|t| t.key == idempotency_key) {
                        turn.messages.push(pending);
                    } else if let Some(intent) = ledger.intent(&idempotency_key).await? {
                        warn!(idempotency_key = %idempotency_key, "An earlier post ended in doubt; re-sending it with the same Idempotency-Key.");
                        recovering.push(Turn {
                            traceparent: pending.traceparent.clone(),
                            key: idempotency_key,
                            text: intent.text,
                            covers: intent.covers,
                            messages: vec![pending],
                        });
                    } else {
                        // A single post in doubt (singles record no
                        // intent): repeat it alone, under the same key.
                        warn!(idempotency_key = %idempotency_key, "An earlier post ended in doubt; re-sending it with the same Idempotency-Key.");
                        recovering.push(Turn {
                            traceparent: pending.traceparent.clone(),
                            text: turn::render(&[&pending.event]),
                            covers: vec![pending.ledger_key()],
                            key: idempotency_key,
                            messages: vec![pending],
                        });
                    }
                }
                None => fresh.push(pending),
            }
        }
        // A completion that a doubtful post already reported goes with it.
        let mut remaining: Vec<Pending> = Vec::new();
        for pending in fresh {
            let key = pending.ledger_key();
            match recovering.iter_mut().find(|t| t.covers.contains(&key)) {
                Some(turn) => turn.messages.push(pending),
                None => remaining.push(pending),
            }
        }
        // A redelivered completion may have been posted alone before (its
        // ledger entry lost with the instance that posted it): post it alone
        // again, under the same key, never inside a new combined turn.
        // Group by task first: the same task can arrive as two messages
        // (a completion published twice), and must end up in one turn.
        let mut by_task: BTreeMap<String, Vec<Pending>> = BTreeMap::new();
        for pending in remaining {
            by_task
                .entry(pending.ledger_key())
                .or_default()
                .push(pending);
        }
        let mut first_time = Vec::new();
        for messages in by_task.into_values() {
            // A forced replay is posted alone too, under its own key.
            let alone = messages.iter().any(|p| {
                p.message.info().is_ok_and(|info| info.delivered > 1) || p.forced_key("").is_some()
            });
            if alone {
                recovering.extend(self.new_turn(messages).await?);
            } else {
                first_time.extend(messages);
            }
        }
        if let Some(turn) = self.new_turn(first_time).await? {
            recovering.push(turn);
        }
        Ok(recovering)
    }

    /// One turn for completions never posted before. A combined turn's
    /// intent is recorded first, so a post that ends in doubt can be repeated exactly.
    async fn new_turn(&self, mut messages: Vec<Pending>) -> Result<Option<Turn>, LedgerError> {
        if messages.is_empty() {
            return Ok(None);
        }
        // A stable order: by delegation id (ULIDs sort by creation), then task.
        messages.sort_by_key(Pending::ledger_key);
        let mut covers: Vec<String> = Vec::new();
        let mut events: Vec<&CompletionEvent> = Vec::new();
        for pending in &messages {
            // The same task twice (a redelivery while held): report it once.
            let key = pending.ledger_key();
            if !covers.contains(&key) {
                covers.push(key);
                events.push(&pending.event);
            }
        }
        let text = turn::render(&events);
        let key = match events.as_slice() {
            [_] => {
                // Recorded before the post: if the post's outcome is lost
                // (ledger write failed, ack lost, even a redelivery count
                // lost in a failover), the completion is re-sent alone under
                // this key and never joins a new combined turn.
                let key = messages[0].event_key();
                self.shared.ledger.mark_posting(&covers[0], &key).await?;
                key
            }
            _ => {
                let key = format!("wake.{}", ulid::Ulid::new());
                let ledger = &self.shared.ledger;
                ledger
                    .put_intent(
                        &key,
                        &Intent {
                            text: text.clone(),
                            covers: covers.clone(),
                        },
                    )
                    .await?;
                for covered in &covers {
                    ledger.mark_posting(covered, &key).await?;
                }
                key
            }
        };
        Ok(Some(Turn {
            traceparent: messages[0].traceparent.clone(),
            key,
            text,
            covers,
            messages,
        }))
    }

    /// Posts one turn until it is delivered, refused for good, or shutdown.
    async fn post_turn(
        &self,
        session: &str,
        turn: &Turn,
        guard: &mut LockGuard,
        refresh_at: &mut Instant,
        held: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
    ) -> Posted {
        let shared = &self.shared;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(shared.config.retry_min)
            .with_max_delay(shared.config.retry_max)
            .with_jitter()
            .without_max_times()
            .build();
        let events = turn.events();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            // Post only while the lock is surely ours: refresh it when due,
            // and give up the turn (it is re-planned under a new lock) if
            // that fails, since another instance may hold the session now.
            if Instant::now() >= *refresh_at {
                if let Err(error) = shared.locks.refresh(guard).await {
                    warn!(%error, "Session lock lost; re-planning under a new lock.");
                    return Posted::Retry;
                }
                *refresh_at = guard.written_at() + shared.locks.refresh_interval();
            }
            let posting = m::InFlight::wake_post(&shared.posting);
            let post = shared.api.post(turn.post(session, &events));
            tokio::pin!(post);
            let mut lock_lost = false;
            let result = loop {
                tokio::select! {
                    result = &mut post => break result,
                    () = tokio::time::sleep_until(*refresh_at), if !lock_lost => {
                        // A slow post keeps the lock alive.
                        match shared.locks.refresh(guard).await {
                            Ok(()) => *refresh_at = guard.written_at() + shared.locks.refresh_interval(),
                            Err(error) => {
                                warn!(%error, "Session lock lost during a post; another instance may post for this session.");
                                lock_lost = true;
                            }
                        }
                    }
                }
            };
            drop(posting);
            match result {
                PostResult::Delivered => {
                    m::wake_posted("delivered");
                    // The records and the acks go out together: an ack does
                    // not depend on its record (a failed record only leaves
                    // the entry at `posting`), and the session lock, which
                    // another copy of a completion would need, is released
                    // only after both.
                    let records = join_all(
                        turn.covers
                            .iter()
                            .map(|covered| shared.ledger.mark_delivered(covered, &turn.key)),
                    );
                    let acks = join_all(
                        turn.messages
                            .iter()
                            .map(|pending| Outcome::Ack.apply(&pending.message)),
                    );
                    let (records, _) = tokio::join!(records, acks);
                    if let Some(Err(error)) = records.into_iter().find(Result::is_err) {
                        warn!(%error, "Could not record the delivery; a redelivery will re-send with the same Idempotency-Key.");
                    }
                    info!(completions = turn.covers.len(), attempt, idempotency_key = %turn.key, "Wake delivered.");
                    return Posted::Done;
                }
                PostResult::Rejected { status, body } => {
                    error!(status, body = %body, completions = turn.covers.len(), "Session API rejected the wake; dead-lettering it for replay.");
                    m::wake_posted("rejected");
                    let reason = format!("session API answered {status}: {body}");
                    for pending in &turn.messages {
                        if let Err(error) = self.dead_letter(pending, &reason).await {
                            warn!(%error, "Could not dead-letter the completion; will retry.");
                            return Posted::Retry;
                        }
                        m::dead_lettered("wake");
                    }
                    for pending in &turn.messages {
                        Outcome::Ack.apply(&pending.message).await;
                    }
                    return Posted::Done;
                }
                PostResult::Retry { reason, after } => {
                    let delay =
                        after.unwrap_or_else(|| backoff.next().unwrap_or(shared.config.retry_max));
                    warn!(%reason, attempt, retry_in = ?delay, "Wake post failed, will retry.");
                    m::wake_posted("retry");
                    let mut arrivals = Vec::new();
                    let alive = self
                        .wait_holding(Instant::now() + delay, &turn.messages, &mut arrivals, rx)
                        .await;
                    held.append(&mut arrivals);
                    if !alive {
                        return Posted::Shutdown;
                    }
                }
            }
        }
    }

    /// Like [`Self::wait`], also keeping `group` alive.
    async fn wait_holding(
        &self,
        until: Instant,
        group: &[Pending],
        arrivals: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
    ) -> bool {
        let interval = self.shared.config.progress_interval();
        let mut keepalive = tokio::time::interval_at(Instant::now() + interval, interval);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return true,
                Some(p) = rx.recv() => arrivals.push(p),
                _ = keepalive.tick() => {
                    keep_alive(group).await;
                    keep_alive(arrivals).await;
                }
                () = self.shutdown.cancelled() => return false,
            }
        }
    }

    async fn dead_letter(
        &self,
        pending: &Pending,
        reason: &str,
    ) -> Result<(), crate::bus::PublishError> {
        let bus = &self.shared.bus;
        let subject = bus
            .subjects
            .dead_letter_wake(&session_token(&pending.session));
        bus.dead_letter(
            subject,
            &pending.message,
            reason,
            &format!("dlq.wake.{}", pending.event.event_id),
        )
        .await
    }

    /// Shutdown: hand every held message back at once so another instance takes it.
    async fn hand_back(&self, held: Vec<Pending>, rx: &mut UnboundedReceiver<Pending>) {
        rx.close();
        let mut all = held;
        while let Ok(p) = rx.try_recv() {
            all.push(p);
        }
        for p in &all {
            Outcome::Nak(None).apply(&p.message).await;
        }
    }
}

async fn keep_alive(held: &[Pending]) {
    for p in held {
        let _ = p.message.ack_with(AckKind::Progress).await;
    }
}
