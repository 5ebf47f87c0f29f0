//! What a session's actor has in hand: the completions it holds, its inbox,
//! and when their in-progress acks are next due.
//!
//! Everything the actor waits on (the coalesce window, a busy lock, a post,
//! a retry's backoff, a ledger record written again) runs through
//! [`Hold::wait`] or [`Hold::during`], so whatever it has in hand, and
//! whatever arrives meanwhile, stays with this instance for as long as the
//! actor lives, not just until the consumer's AckWait. The NATS round
//! trips in between (a lock take or the refresh before a post, a
//! delivery's record and acks, a dead letter) do not: each is bounded by
//! the 5 s JetStream timeout, and a JetStream slow enough to string them
//! past AckWait gets the completions redelivered, which the ledger then
//! settles. Planning, whose reads grow with a batch (its members' history,
//! over a slow link), keeps what it plans alive on the same schedule
//! ([`keeping_alive`]), by the messages' ack subjects: the plan has the
//! messages themselves in hand.

use std::future::Future;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use async_nats::jetstream::AckKind;
use async_nats::{Client, Subject};
use tracing::warn;

use super::{Inbox, Pending, Turn};
use crate::bus::{KeepAliveClock, KeepAliveEvery};

/// An actor's completions in hand, and their keep-alive schedule.
#[derive(Debug)]
pub(super) struct Hold {
    /// Completions not in a turn being posted: waiting for the next plan.
    pub(super) held: Vec<Pending>,
    /// Where the session's next completions arrive.
    pub(super) rx: Inbox,
    /// When everything in hand next gets an in-progress ack (every third
    /// of the consumer's AckWait). One schedule for all waits: a timer
    /// started afresh by each wait would never fire through a run of waits
    /// shorter than the interval.
    keep_alive: KeepAliveClock,
}

impl Hold {
    /// An empty hand for the actor reading `rx`.
    pub(super) fn new(rx: Inbox, every: KeepAliveEvery) -> Self {
        Self {
            held: Vec::new(),
            rx,
            keep_alive: KeepAliveClock::new(every),
        }
    }

    /// Waits until `until`, collecting arrivals and keeping alive what is
    /// held and the messages of `turns` (those being posted). Returns false
    /// if `shutdown` came first.
    pub(super) async fn wait(
        &mut self,
        until: Instant,
        turns: &[&[Turn]],
        shutdown: &CancellationToken,
    ) -> bool {
        tokio::select! {
            // A stop wins over a deadline reached at the same moment.
            biased;
            () = shutdown.cancelled() => false,
            () = self.during(tokio::time::sleep_until(until), turns) => true,
        }
    }

    /// Runs `work` to its end while collecting arrivals and keeping alive
    /// what is held and the messages of `turns`.
    pub(super) async fn during<F: Future>(&mut self, work: F, turns: &[&[Turn]]) -> F::Output {
        tokio::pin!(work);
        loop {
            tokio::select! {
                output = &mut work => return output,
                Some(p) = self.rx.recv() => self.held.push(*p),
                () = tokio::time::sleep_until(self.keep_alive.look_at()) => {
                    if !self.keep_alive.is_due() {
                        continue;
                    }
                    let mut sent = true;
                    for p in in_hand(&self.held, turns) {
                        sent &= crate::outcome::keep_alive(&p.message).await;
                    }
                    self.keep_alive.went_out(sent);
                }
            }
        }
    }

    /// The held completions and the keep-alive schedule, borrowed apart:
    /// planning takes the first, [`keeping_alive`] the second.
    pub(super) fn planning_parts(&mut self) -> (&mut Vec<Pending>, &mut KeepAliveClock) {
        (&mut self.held, &mut self.keep_alive)
    }
}

/// The ack subjects of `held`, for [`keeping_alive`].
pub(super) fn ack_subjects(held: &[Pending]) -> Vec<Subject> {
    held.iter()
        .filter_map(|p| p.message.reply.clone())
        .collect()
}

/// Runs `work` (a plan, which has the held messages in hand) while
/// sending an in-progress ack to each of `replies` whenever `clock` says
/// one is due. A message the plan acks meanwhile ignores a later one.
pub(super) async fn keeping_alive<F: Future>(
    clock: &mut KeepAliveClock,
    client: &Client,
    replies: &[Subject],
    work: F,
) -> F::Output {
    tokio::pin!(work);
    loop {
        tokio::select! {
            output = &mut work => return output,
            () = tokio::time::sleep_until(clock.look_at()) => {
                if !clock.is_due() {
                    continue;
                }
                let sent = crate::connect::is_connected(client);
                if sent {
                    for reply in replies {
                        let in_progress = AckKind::Progress.into();
                        if let Err(error) = client.publish(reply.clone(), in_progress).await {
                            warn!(%error, %reply, "Could not send an in-progress ack.");
                        }
                    }
                }
                clock.went_out(sent);
            }
        }
    }
}

/// The held completions and those of `turns`.
fn in_hand<'a>(held: &'a [Pending], turns: &'a [&'a [Turn]]) -> impl Iterator<Item = &'a Pending> {
    let turns = turns
        .iter()
        .flat_map(|turns| turns.iter())
        .flat_map(|turn| turn.messages.iter());
    held.iter().chain(turns)
}
