//! Posting one planned turn: under the session lock (refreshed while a slow
//! post runs), with retries and backoff, then the ledger records and acks;
//! a refusal is dead-lettered for replay.

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
