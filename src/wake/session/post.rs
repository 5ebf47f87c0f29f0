//! Posting one planned turn: under the session lock (refreshed while a slow
//! post runs), with retries and backoff, then the ledger records and acks;
//! a refusal is dead-lettered for replay.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::future::join_all;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::hold::Hold;
use super::{Pending, Posted, Router, Turn};
use crate::ops::metrics as m;
use crate::outcome::Outcome;
use crate::protocol::session_token;
use crate::wake::lock::{LockError, LockGuard, SessionLocks};
use crate::wake::session_api::PostResult;

/// A turn being posted, with what its post needs from the actor.
pub(super) struct Posting<'a> {
    /// The origin session.
    pub(super) session: &'a str,
    /// The turn.
    pub(super) turn: &'a Turn,
    /// The turns to post after it: kept alive while this one is posted.
    pub(super) later: &'a [Turn],
    /// The session lock, refreshed when due.
    pub(super) guard: &'a mut LockGuard,
    /// When the lock is next due for a refresh.
    pub(super) refresh_at: &'a mut Instant,
}

impl Posting<'_> {
    /// Refreshes the lock if due, or if an earlier refresh failed. An error
    /// leaves the guard lost (the lock may be another instance's now) and
    /// `refresh_at` due, so the next post tries again first.
    async fn refresh_lock_if_due(&mut self, locks: &SessionLocks) -> Result<(), LockError> {
        if Instant::now() < *self.refresh_at && !self.guard.is_lost() {
            return Ok(());
        }
        locks.refresh(self.guard).await?;
        *self.refresh_at = self.guard.written_at() + locks.refresh_interval();
        Ok(())
    }
}

/// How soon a lock refresh that failed during a post is tried again.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl Router {
    /// Posts one turn until it is delivered, refused for good, or shutdown.
    pub(super) async fn post_turn(&self, posting: &mut Posting<'_>, hold: &mut Hold) -> Posted {
        let shared = &self.shared;
        // Jitter adds up to as much again: doubling up to half of
        // `retry_max` keeps the waits below it, and spread out at the top.
        let retry_max = shared.config.retry_max;
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(shared.config.retry_min.min(retry_max / 2))
            .with_max_delay(retry_max / 2)
            .with_jitter()
            .without_max_times()
            .build();
        let turn = posting.turn;
        let in_hand = [std::slice::from_ref(turn), posting.later];
        let events = turn.events();
        let mut attempt = 0u32;
        let mut first_conflict: Option<Instant> = None;
        let conflict_patience = shared.config.conflict_patience;
        loop {
            attempt += 1;
            // Post only while the lock is surely ours: refresh it when due
            // (or when a refresh failed), and give up the turn (it is
            // re-planned under a new lock) if that fails, since another
            // instance may hold the session now.
            if let Err(error) = posting.refresh_lock_if_due(&shared.locks).await {
                warn!(%error, "Session lock lost; re-planning under a new lock.");
                return Posted::Retry;
            }
            if self.shutdown.is_cancelled() {
                // Stopped while the turn was planned, an earlier turn of
                // the session was posted, or this one waited to be tried
                // again: handed back, not posted.
                return Posted::Shutdown;
            }
            let posting_gauge = m::InFlight::wake_post(&shared.posting);
            let post = async {
                let post = shared.api.post(turn.post(posting.session, &events));
                tokio::pin!(post);
                // When a refresh failed: when to try again. A refresh at the
                // lock's revision that succeeds later (a NATS hiccup, not
                // another holder) holds it again, before it can expire.
                let mut retry_at = None;
                // An answer that came during a lock refresh.
                let mut answered = None;
                loop {
                    let next = retry_at.unwrap_or(*posting.refresh_at);
                    tokio::select! {
                        result = &mut post => break result,
                        () = tokio::time::sleep_until(next) => {
                            // A slow post keeps the lock alive. Its answer is
                            // read meanwhile: the HTTP client checks the
                            // request's deadline before it reads, so an
                            // answer left unread while a slow refresh (a
                            // leader election) ran past the deadline would
                            // be taken for a timeout and posted again.
                            let refresh = posting.refresh_lock_if_due(&shared.locks);
                            tokio::pin!(refresh);
                            let refreshed = loop {
                                tokio::select! {
                                    refreshed = &mut refresh => break refreshed,
                                    result = &mut post, if answered.is_none() => answered = Some(result),
                                }
                            };
                            match refreshed {
                                Ok(()) if retry_at.take().is_some() => {
                                    info!("Session lock held again during the post.");
                                }
                                Ok(()) => {}
                                Err(error) => {
                                    if retry_at.is_none() {
                                        warn!(%error, "Session lock refresh failed during a post; trying again every second. If the lock expires meanwhile, another instance may post for this session.");
                                    }
                                    retry_at = Some(Instant::now() + LOCK_RETRY);
                                }
                            }
                            if let Some(result) = answered.take() {
                                break result;
                            }
                        }
                    }
                }
            };
            let mut result = hold.during(post, &in_hand).await;
            drop(posting_gauge);
            if let PostResult::Rejected {
                status: 409, after, ..
            } = result
            {
                let since = first_conflict.get_or_insert_with(Instant::now).elapsed();
                // An API enforcing Idempotency-Key answers 409 while a post
                // under the same key is still being processed: most often
                // this wake's own, given up after `--request-timeout` while
                // the agent's turn runs on (minutes, with tool calls), or a
                // dead instance's. It settles; only a conflict that lasts
                // past `--conflict-patience` is taken as a refusal.
                if since < conflict_patience {
                    // Its Retry-After, but not past the patience left.
                    let left = conflict_patience - since;
                    result = PostResult::Retry {
                        reason: "session API answered 409 Conflict (a post under this Idempotency-Key may still be in progress)".to_owned(),
                        after: after.map(|after| after.min(left)),
                    };
                }
            } else {
                // Only conflicts in a row last: one after an outage (the
                // post in progress may be the last one sent before it)
                // gets its patience anew.
                first_conflict = None;
            }
            match result {
                PostResult::Delivered => {
                    m::wake_posted("delivered");
                    info!(completions = turn.reports().len(), attempt, idempotency_key = %turn.key, "Wake delivered.");
                    return if self.record_delivery(posting, hold).await {
                        Posted::Done
                    } else {
                        Posted::DoneThenShutdown
                    };
                }
                PostResult::Rejected {
                    status: 409, body, ..
                } => {
                    // The post in progress may still deliver the turn: a
                    // replay under the same key is answered from the API's
                    // store, a forced one (a new key) would be a second turn.
                    error!(body = ?body, completions = turn.reports().len(), idempotency_key = %turn.key, patience = ?conflict_patience, "Session API answered 409 Conflict for longer than --conflict-patience; dead-lettering the wake. The turn under this key may still be delivered: replay it without --force.");
                    m::wake_posted("rejected");
                    let reason = format!(
                        "{} (the turn under this Idempotency-Key may have been delivered; replay without --force): {body}",
                        crate::wake::CONFLICT_REFUSAL
                    );
                    return if self.dead_letter_refused(posting, hold, &reason).await {
                        Posted::Done
                    } else {
                        Posted::Shutdown
                    };
                }
                // Too large as one turn: each of its completions may not
                // be. A 413 refuses the body unread, so on the turn's very
                // first send nothing of it was taken: its completions are
                // marked for posts of their own and planned again. A turn
                // sent before (re-sent after a crash, or tried again after
                // a post in doubt) may have been taken then, under a limit
                // lowered since: it is dead-lettered as below.
                PostResult::Rejected {
                    status: 413, body, ..
                } if super::plan::is_combined_key(&turn.key) && turn.first_send && attempt == 1 => {
                    warn!(body = ?body, completions = turn.reports().len(), idempotency_key = %turn.key, "Session API refused the combined turn as too large (413); posting its completions one by one.");
                    m::wake_posted("split");
                    self.split(turn).await;
                    return Posted::Retry;
                }
                PostResult::Rejected { status, body, .. } => {
                    error!(status, body = ?body, completions = turn.reports().len(), "Session API rejected the wake; dead-lettering it for replay.");
                    m::wake_posted("rejected");
                    let reason = format!("session API answered {status}: {body}");
                    return if self.dead_letter_refused(posting, hold, &reason).await {
                        Posted::Done
                    } else {
                        Posted::Shutdown
                    };
                }
                PostResult::Retry { reason, after } => {
                    // The API's `Retry-After`, but never below `--retry-min`:
                    // `Retry-After: 0` from an overloaded gateway would
                    // otherwise make a loop of posts.
                    let delay = match after {
                        Some(after) => after.max(shared.config.retry_min),
                        None => backoff.next().unwrap_or(retry_max),
                    };
                    warn!(%reason, attempt, retry_in = ?delay, "Wake post failed, will retry.");
                    m::wake_posted("retry");
                    let until = Instant::now() + delay;
                    if !self.keep_session(posting, hold, until, &in_hand).await {
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
    /// re-posted. Meanwhile the actor keeps the session: the lock is
    /// refreshed when due, and the completions held and the turns still to
    /// post are kept alive.
    ///
    /// Returns false if the service stopped first. With the records unwritten
    /// the entries stay at `posting`, and a copy of a completion is posted
    /// again under the same `Idempotency-Key` (GUARANTEES.md, "The one
    /// window").
    async fn record_delivery(&self, posting: &mut Posting<'_>, hold: &mut Hold) -> bool {
        let shared = &self.shared;
        let turn = posting.turn;
        let mut backoff = crate::bus::until_stored_backoff();
        let mut unrecorded: Vec<&str> = turn.at.keys().map(String::as_str).collect();
        let mut acked = false;
        let mut attempt = 0u32;
        loop {
            let delay = if crate::connect::is_connected(&shared.bus.client) {
                attempt += 1;
                let records = join_all(
                    unrecorded
                        .iter()
                        .map(|covered| record_delivered(&shared.ledger, turn, covered)),
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
            // Once acked, the turn's own messages need no keep-alives.
            let turn_alone = std::slice::from_ref(turn);
            let in_hand: &[&[Turn]] = if acked {
                &[posting.later]
            } else {
                &[turn_alone, posting.later]
            };
            if !self
                .keep_session(posting, hold, Instant::now() + delay, in_hand)
                .await
            {
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

    /// Dead-letters a turn the session API refused, acking each message
    /// once its dead letter is stored.
    ///
    /// The turn is not posted again: a dead letter that cannot be stored
    /// yet (the dead-letter stream has no leader, the account is full) is
    /// tried again with backoff while the session and the messages are
    /// kept, as a delivery's records are. Returns false if the service
    /// stopped first: the messages not yet dead-lettered are then handed
    /// back, and the next instance posts them again.
    async fn dead_letter_refused(
        &self,
        posting: &mut Posting<'_>,
        hold: &mut Hold,
        reason: &str,
    ) -> bool {
        let turn = posting.turn;
        let mut backoff = crate::bus::until_stored_backoff();
        let mut left: Vec<&Pending> = turn.messages.iter().collect();
        loop {
            let delay = if crate::connect::is_connected(&self.shared.bus.client) {
                // Up to the first failure (a publish to a leaderless stream
                // takes its whole timeout), keeping everything alive.
                let round = async {
                    let mut rest = left.into_iter();
                    for pending in rest.by_ref() {
                        match self.dead_letter(pending, reason).await {
                            // Each one acked once its dead letter is stored.
                            Ok(()) => {
                                Outcome::Ack.apply(&pending.message).await;
                            }
                            Err(error) => {
                                let mut still = vec![pending];
                                still.extend(rest);
                                return (still, Some(error));
                            }
                        }
                    }
                    (Vec::new(), None)
                };
                let (still, failure) = hold
                    .during(round, &[std::slice::from_ref(turn), posting.later])
                    .await;
                left = still;
                let Some(error) = failure else {
                    break;
                };
                let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                warn!(%error, left = left.len(), retry_in = ?delay, "Could not dead-letter the refused wake; keeping its completions and trying again.");
                delay
            } else {
                // Looked at again soon: the dead letters wait for the connection.
                Duration::from_millis(250)
            };
            if !self
                .keep_session(
                    posting,
                    hold,
                    Instant::now() + delay,
                    &[std::slice::from_ref(turn), posting.later],
                )
                .await
            {
                warn!(
                    left = left.len(),
                    "Stopping before the refused wake was dead-lettered; its completions will be redelivered and posted again."
                );
                return false;
            }
        }
        true
    }

    /// Marks each completion in hand of a combined turn the API refused as
    /// too large for a post of its own, under its own key, over the
    /// revision the turn holds: planned again, each is then re-sent alone.
    /// A mark that fails (the entry changed since) leaves the entry to the
    /// next plan: a combined turn no longer marked in full is never sent
    /// again, and its completions not marked alone are planned afresh.
    async fn split(&self, turn: &Turn) {
        let mut marked = std::collections::BTreeSet::new();
        for pending in &turn.messages {
            let covered = pending.ledger_key();
            // Once per task (a redelivery held with it is the same task).
            let Some(&revision) = turn
                .at
                .get(&covered)
                .filter(|_| marked.insert(covered.clone()))
            else {
                continue;
            };
            let key = pending.event_key();
            if let Err(error) = self
                .shared
                .ledger
                .mark_posting(&covered, &key, revision)
                .await
            {
                info!(%error, ledger_key = %covered, "Could not mark a completion of the refused combined turn for a post of its own; it is planned afresh.");
            }
        }
    }

    /// Waits until `until` keeping the session: what `hold` has and the
    /// messages of `in_hand` stay alive, and the lock is refreshed when due.
    /// A refresh that fails leaves the lock lost and is tried again every
    /// second (a NATS hiccup passes, and the lock is held again before it
    /// expires; one another instance took meanwhile stays lost, and the
    /// next post takes the session again first). Returns false if the
    /// service is shutting down.
    async fn keep_session(
        &self,
        posting: &mut Posting<'_>,
        hold: &mut Hold,
        until: Instant,
        in_hand: &[&[Turn]],
    ) -> bool {
        loop {
            let lock_due = if posting.guard.is_lost() {
                Instant::now() + LOCK_RETRY
            } else {
                *posting.refresh_at
            };
            if !hold
                .wait(lock_due.min(until), in_hand, &self.shutdown)
                .await
            {
                return false;
            }
            if Instant::now() >= until {
                return true;
            }
            let was_lost = posting.guard.is_lost();
            // What is in hand is kept alive meanwhile too: a refresh waits
            // up to the JetStream timeout for its answer.
            let refreshed = hold
                .during(posting.refresh_lock_if_due(&self.shared.locks), in_hand)
                .await;
            match refreshed {
                Err(error) if !was_lost => {
                    warn!(%error, "Could not refresh the session lock; trying again every second. If it expires meanwhile, another instance may take the session.");
                }
                Ok(()) if was_lost => info!("Session lock held again."),
                _ => {}
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
            // Per stored message: a redelivery of this one is dropped as
            // a duplicate, a replayed copy refused again is recorded again.
            &format!(
                "dlq.wake.{}.{}",
                pending.event.event_id,
                pending
                    .message
                    .info()
                    .map_or(0, |info| info.stream_sequence)
            ),
            "wake",
        )
        .await
    }
}

/// Records `covered` delivered by `turn`, over the revision the turn was
/// planned on. A refusal means the entry changed since: a `replay wakes
/// --force` recorded its key (its forced copy must still be posted, not
/// acked as delivered), this instance's own earlier write of the record,
/// whose answer was lost, landed, or the entry expired with the ledger's
/// history. Either way there is nothing more to write.
async fn record_delivered(
    ledger: &crate::wake::ledger::WakeLedger,
    turn: &Turn,
    covered: &str,
) -> Result<(), crate::wake::ledger::LedgerError> {
    let revision = turn.at[covered];
    match ledger.mark_delivered(covered, &turn.key, revision).await {
        Err(crate::wake::ledger::LedgerError::Changed { .. }) => {
            info!(
                ledger_key = covered,
                "The wake ledger entry changed since the turn was planned (a forced replay, this instance's own record landing late, or the entry expired); leaving it as it is."
            );
            Ok(())
        }
        result => result,
    }
}
