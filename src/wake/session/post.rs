//! Posting one planned turn: under the session lock (refreshed while a slow
//! post runs), with retries and backoff, then the ledger records and acks;
//! a refusal is dead-lettered for replay.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::future::join_all;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::{Inbox, Pending, Posted, Router, Turn, keep_alive};
use crate::ops::metrics as m;
use crate::outcome::Outcome;
use crate::protocol::session_token;
use crate::wake::lock::LockGuard;
use crate::wake::session_api::PostResult;

impl Router {
    /// Posts one turn until it is delivered, refused for good, or shutdown.
    pub(super) async fn post_turn(
        &self,
        session: &str,
        turn: &Turn,
        guard: &mut LockGuard,
        refresh_at: &mut Instant,
        held: &mut Vec<Pending>,
        rx: &mut Inbox,
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
                    let recorded = self.record_delivery(turn, held, rx).await;
                    info!(completions = turn.covers.len(), attempt, idempotency_key = %turn.key, "Wake delivered.");
                    return if recorded {
                        Posted::Done
                    } else {
                        Posted::DoneThenShutdown
                    };
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

    /// Records a delivered turn in the ledger and acks its messages.
    ///
    /// The `delivered` records are what keep a copy of a covered completion
    /// (a redelivery, a re-published completion) from being posted again, so
    /// they are written until JetStream stores them: a write that fails (a
    /// leader election, NATS unreachable) is made again with backoff, and
    /// while the client is disconnected nothing is sent, as it would only
    /// queue. The acks go out with the first write: an ack does not depend on
    /// its record, and once the messages are acked no copy circulates to be
    /// re-posted. Completions arriving meanwhile are kept alive in `held`.
    ///
    /// Returns false if the service stopped first. With the records unwritten
    /// the entries stay at `posting`, and a copy of a completion is posted
    /// again under the same `Idempotency-Key` (GUARANTEES.md, "The one
    /// window").
    async fn record_delivery(&self, turn: &Turn, held: &mut Vec<Pending>, rx: &mut Inbox) -> bool {
        let shared = &self.shared;
        let mut backoff = crate::bus::until_stored_backoff();
        let mut unrecorded: Vec<&str> = turn.covers.iter().map(String::as_str).collect();
        let mut acked = false;
        let mut attempt = 0u32;
        loop {
            let delay = if crate::connect::is_connected(&shared.bus.client) {
                attempt += 1;
                let records = join_all(
                    unrecorded
                        .iter()
                        .map(|covered| shared.ledger.mark_delivered(covered, &turn.key)),
                );
                let results = if acked {
                    records.await
                } else {
                    let acks = join_all(
                        turn.messages
                            .iter()
                            .map(|pending| Outcome::Ack.apply(&pending.message)),
                    );
                    acked = true;
                    tokio::join!(records, acks).0
                };
                let mut failure = None;
                let mut results = results.into_iter();
                unrecorded.retain(|_| match results.next() {
                    Some(Err(error)) => {
                        failure = Some(error);
                        true
                    }
                    _ => false,
                });
                let Some(error) = failure else {
                    return true;
                };
                m::wake_delivery_record_retried();
                let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                warn!(%error, attempt, retry_in = ?delay, "Could not record the delivery; keeping the session and trying again.");
                delay
            } else {
                // Looked at again soon: the records wait for the connection.
                Duration::from_millis(250)
            };
            let mut arrivals = Vec::new();
            let alive = self
                .wait_holding(Instant::now() + delay, &[], &mut arrivals, rx)
                .await;
            held.append(&mut arrivals);
            if !alive {
                if acked {
                    warn!(
                        unrecorded = unrecorded.len(),
                        "Stopping before the delivery was recorded; its completions were acked, but a copy published again would be posted again under the same Idempotency-Key."
                    );
                } else {
                    warn!(
                        unrecorded = unrecorded.len(),
                        "Stopping before the delivery was recorded or acked (NATS unreachable); its completions will be redelivered and posted again under the same Idempotency-Key."
                    );
                }
                return false;
            }
        }
    }

    /// Like [`Self::wait`], also keeping `group` alive.
    async fn wait_holding(
        &self,
        until: Instant,
        group: &[Pending],
        arrivals: &mut Vec<Pending>,
        rx: &mut Inbox,
    ) -> bool {
        let interval = self.shared.config.progress_interval();
        let mut keepalive = tokio::time::interval_at(Instant::now() + interval, interval);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return true,
                Some(p) = rx.recv() => arrivals.push(*p),
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
}
