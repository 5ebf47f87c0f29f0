//! The queued tasks this worker is running, by stream sequence.
//!
//! JetStream redelivers a task whose in-progress acks stop for longer than
//! the AckWait. Usually that means its worker died, but a worker that only
//! stalled (a frozen VM, a stop-the-world pause, a saturated machine) may
//! get the redelivery itself while the first run goes on. Running it again
//! would run the subagent twice on one machine, so the first delivery to
//! reach this worker claims the task and later ones are left to it: its
//! in-progress acks and its final ack name the same stream sequence, which
//! is all the server needs to settle the message.

use std::collections::HashSet;
use std::sync::Mutex;

use super::REFUSED_REDELIVERY_DELAY;
use crate::outcome::Outcome;

/// Stream sequences of the tasks running here.
#[derive(Debug, Default)]
pub(crate) struct Claims {
    /// The claimed sequences (the lock is never held across an await).
    held: Mutex<HashSet<u64>>,
}

/// A claimed task; gives the claim up when dropped.
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    /// Where the claim is held.
    claims: &'a Claims,
    /// The task's stream sequence.
    sequence: u64,
}

impl Claims {
    /// Claims the task stored at `sequence`, or `None` if a delivery of it
    /// is already being handled here.
    pub(crate) fn claim(&self, sequence: u64) -> Option<Claim<'_>> {
        if !self.held.lock().expect("claims").insert(sequence) {
            // No `Claim` value here: dropping it would release the holder's.
            return None;
        }
        Some(Claim {
            claims: self,
            sequence,
        })
    }

    /// What to do with a delivery pulled after the shutdown signal: hand it
    /// back for another worker once this worker's open pull has ended (a
    /// NAK for at once would bring it straight back into that pull, once
    /// per free slot, each a delivery, until the next worker gave it up
    /// unrun), unless it is a redelivery of a task still running here,
    /// whose running attempt settles it (a NAK would have another worker
    /// run it a second time).
    pub(crate) fn after_stop(&self, sequence: Option<u64>) -> Outcome {
        match sequence {
            Some(sequence) if self.held.lock().expect("claims").contains(&sequence) => {
                Outcome::Leave
            }
            _ => Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY),
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.claims
            .held
            .lock()
            .expect("claims")
            .remove(&self.sequence);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_is_claimed_once_until_its_claim_is_dropped() {
        let claims = Claims::default();
        let first = claims.claim(7).expect("a fresh sequence is claimed");
        assert!(claims.claim(7).is_none(), "a second delivery is refused");
        assert!(claims.claim(7).is_none(), "a refusal keeps the claim held");
        assert!(claims.claim(8).is_some(), "other tasks are unaffected");
        drop(first);
        assert!(claims.claim(7).is_some(), "claimable again once released");
    }

    #[test]
    fn a_delivery_pulled_while_stopping_is_left_only_if_it_runs_here() {
        let claims = Claims::default();
        let running = claims.claim(7).expect("a fresh sequence is claimed");
        assert_eq!(claims.after_stop(Some(7)), Outcome::Leave);
        let later = Outcome::HandBackAfter(REFUSED_REDELIVERY_DELAY);
        assert_eq!(claims.after_stop(Some(8)), later);
        assert_eq!(claims.after_stop(None), later);
        drop(running);
        assert_eq!(claims.after_stop(Some(7)), later);
    }
}
