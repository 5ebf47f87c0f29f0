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
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

use super::Shared;
use super::ledger::{LedgerState, WakeLedger};
use super::session_api::PostResult;
use super::turn;
use crate::outcome::Outcome;
use crate::protocol::{CompletionEvent, HEADER_DEAD_LETTER_REASON, session_token};

/// A completion waiting to be woken, with the message that carries it.
#[derive(Debug)]
pub(crate) struct Pending {
    /// The JetStream message, acked once the wake is delivered.
    pub(crate) message: jetstream::Message,
    /// The decoded completion.
    pub(crate) event: CompletionEvent,
    /// The origin session (already validated).
    pub(crate) session: String,
    /// The trace context to pass on to the session API.
    pub(crate) traceparent: Option<String>,
}

impl Pending {
    fn ledger_key(&self) -> String {
        WakeLedger::key(&self.event.delegation_id, self.event.task_index)
    }
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
        loop {
            if held.is_empty() {
                tokio::select! {
                    next = rx.recv() => match next {
                        Some(p) => held.push(p),
                        None => return,
                    },
                    () = tokio::time::sleep(Duration::from_secs(30)) => {
                        if self.retire(&session, &rx) { return; }
                        continue;
                    }
                    () = self.shutdown.cancelled() => {
                        if self.retire(&session, &rx) { return; }
                        continue;
                    }
                }
            }
            // Combine whatever arrives within the window.
            let window_end = Instant::now() + config.coalesce_window;
            if !self.wait(window_end, &mut held, &mut rx).await {
                return self.hand_back(held, &mut rx).await;
            }
            let Some(mut guard) = self.acquire_lock(&mut held, &mut rx).await else {
                return self.hand_back(held, &mut rx).await;
            };
            let delivered = self.deliver(&session, &mut held, &mut rx, &mut guard).await;
            self.shared.locks.release(guard).await;
            if !delivered {
                return self.hand_back(held, &mut rx).await;
            }
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
    ) -> Option<super::lock::LockGuard> {
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

    /// Delivers everything in `held` (plus arrivals while the lock is held).
    /// Returns false if shutdown interrupted it; `held` then keeps what is left.
    async fn deliver(
        &self,
        session: &str,
        held: &mut Vec<Pending>,
        rx: &mut UnboundedReceiver<Pending>,
        guard: &mut super::lock::LockGuard,
    ) -> bool {
        let shared = &self.shared;
        // Drop members already delivered; note those with an unfinished post.
        let mut members: Vec<(Pending, Option<String>)> = Vec::new();
        let mut unchecked = std::mem::take(held).into_iter();
        while let Some(pending) = unchecked.next() {
            match shared.ledger.get(&pending.ledger_key()).await {
                Ok(Some(LedgerState::Delivered { .. })) => {
                    info!(delegation_id = %pending.event.delegation_id, task_index = pending.event.task_index, "Wake already delivered; acking the duplicate.");
                    Outcome::Ack.apply(&pending.message).await;
                }
                Ok(Some(LedgerState::Posting { idempotency_key })) => {
                    members.push((pending, Some(idempotency_key)));
                }
                Ok(None) => members.push((pending, None)),
                Err(error) => {
                    warn!(%error, "Could not read the wake ledger; will retry.");
                    members.push((pending, None));
                    held.extend(members.into_iter().map(|(p, _)| p));
                    held.extend(unchecked);
                    return self
                        .wait(Instant::now() + Duration::from_secs(1), held, rx)
                        .await;
                }
            }
        }
        // The same task twice (a redelivery while we held it): one post, both acked.
        members.sort_by_key(|(p, _)| p.ledger_key());
        let mut groups: Vec<Vec<(Pending, Option<String>)>> = Vec::new();
        let mut fresh: Vec<(Pending, Option<String>)> = Vec::new();
        for member in members {
            if member.1.is_some() {
                // An earlier post of unknown outcome: repeat it alone, same key.
                groups.push(vec![member]);
            } else {
                fresh.push(member);
            }
        }
        if !fresh.is_empty() {
            groups.push(fresh);
        }
        let mut refresh_at = Instant::now() + shared.locks.refresh_interval();
        while let Some(group) = groups.pop() {
            let mut unique: Vec<&CompletionEvent> = Vec::new();
            for (p, _) in &group {
                if unique.last().is_none_or(|last| {
                    (&last.delegation_id, last.task_index)
                        != (&p.event.delegation_id, p.event.task_index)
                }) {
                    unique.push(&p.event);
                }
            }
            let key = match (&group[0].1, unique.as_slice()) {
                (Some(previous), _) => previous.clone(),
                (None, [only]) => only.event_id.clone(),
                (None, _) => format!("wake.{}", ulid::Ulid::new()),
            };
            if unique.len() > 1 && group[0].1.is_none() {
                for (p, _) in &group {
                    if let Err(error) = shared.ledger.mark_posting(&p.ledger_key(), &key).await {
                        warn!(%error, "Could not record the post in the wake ledger; will retry.");
                        held.extend(group.into_iter().map(|(p, _)| p));
                        held.extend(groups.into_iter().flatten().map(|(p, _)| p));
                        return self
                            .wait(Instant::now() + Duration::from_secs(1), held, rx)
                            .await;
                    }
                }
            }
            let text = turn::render(&unique);
            let traceparent = group[0].0.traceparent.as_deref();
            let mut backoff = ExponentialBuilder::default()
                .with_min_delay(shared.config.retry_min)
                .with_max_delay(shared.config.retry_max)
                .with_jitter()
                .without_max_times()
                .build();
            let mut attempt = 0u32;
            loop {
                attempt += 1;
                if Instant::now() >= refresh_at {
                    if let Err(error) = shared.locks.refresh(guard).await {
                        warn!(%error, "Session lock lost while posting; another instance may post too.");
                    }
                    refresh_at = Instant::now() + shared.locks.refresh_interval();
                }
                match shared.api.post(session, &text, &key, traceparent).await {
                    PostResult::Delivered => {
                        for (p, _) in &group {
                            if let Err(error) =
                                shared.ledger.mark_delivered(&p.ledger_key(), &key).await
                            {
                                warn!(%error, "Could not record the delivery; a redelivery may post again with the same Idempotency-Key.");
                            }
                        }
                        for (p, _) in &group {
                            Outcome::Ack.apply(&p.message).await;
                        }
                        info!(completions = unique.len(), attempt, idempotency_key = %key, "Wake delivered.");
                        break;
                    }
                    PostResult::Rejected { status, body } => {
                        error!(status, body = %body, completions = unique.len(), "Session API rejected the wake; dead-lettering it for replay.");
                        for (p, _) in &group {
                            let reason = format!("session API answered {status}: {body}");
                            if let Err(error) = self.dead_letter(p, &reason).await {
                                warn!(%error, "Could not dead-letter the completion; will retry.");
                                held.extend(group.into_iter().map(|(p, _)| p));
                                held.extend(groups.into_iter().flatten().map(|(p, _)| p));
                                return self
                                    .wait(Instant::now() + Duration::from_secs(1), held, rx)
                                    .await;
                            }
                        }
                        for (p, _) in &group {
                            Outcome::Ack.apply(&p.message).await;
                        }
                        break;
                    }
                    PostResult::Retry { reason, after } => {
                        let delay = after
                            .unwrap_or_else(|| backoff.next().unwrap_or(shared.config.retry_max));
                        warn!(%reason, attempt, retry_in = ?delay, "Wake post failed, will retry.");
                        let mut waiting = Vec::new();
                        // Keep the group and everything else alive while waiting.
                        let alive = self
                            .wait_holding(Instant::now() + delay, &group, &mut waiting, rx)
                            .await;
                        held.append(&mut waiting);
                        if !alive {
                            held.extend(group.into_iter().map(|(p, _)| p));
                            held.extend(groups.into_iter().flatten().map(|(p, _)| p));
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// Like [`Self::wait`], also keeping `group` alive.
    async fn wait_holding(
        &self,
        until: Instant,
        group: &[(Pending, Option<String>)],
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
                    for (p, _) in group {
                        let _ = p.message.ack_with(AckKind::Progress).await;
                    }
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
        let mut headers = pending.message.headers.clone().unwrap_or_default();
        let reason: String = reason
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(1024)
            .collect();
        headers.insert(HEADER_DEAD_LETTER_REASON, reason.as_str());
        headers.insert(
            crate::protocol::HEADER_MSG_ID,
            format!("dlq.wake.{}", pending.event.event_id).as_str(),
        );
        let subject = bus
            .subjects
            .dead_letter_wake(&session_token(&pending.session));
        bus.js
            .publish_with_headers(subject, headers, pending.message.payload.clone())
            .await?
            .await?;
        Ok(())
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
