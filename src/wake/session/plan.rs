//! Planning: which of the completions an actor holds are already woken,
//! which must be re-sent exactly as an earlier post in doubt, and which
//! become a new turn (recorded in the ledger before it is posted): one
//! combined turn, or one each when that would be too large to record, or
//! for copies that may have been posted alone before.

use std::collections::{BTreeMap, BTreeSet};

use futures::future::{join_all, try_join_all};
use tracing::{info, warn};

use super::{Pending, Router, Turn};
use crate::outcome::Outcome;
use crate::protocol::{CompletionEvent, Status, WakeMode};
use crate::wake::ledger::{Intent, LedgerEntry, LedgerError, LedgerState, WakeLedger};
use crate::wake::turn;

/// Said when a post recorded but not confirmed is sent again: its wake
/// instance stopped, crashed or lost its lock before it was confirmed.
/// Often it was never sent (a stop before posting, a retry after a
/// refusal), but one in flight when its sender died may have reached
/// the session API and run there.
const SENDING_AGAIN: &str = "Sending again, under the same Idempotency-Key, a post that was recorded but not confirmed: its wake instance stopped, crashed or lost its lock first. Often it was never sent, but one in flight then may have reached the session API and run (one that honours Idempotency-Key answers the repeat from its store; one that does not runs a second turn).";

/// Why turns could not be planned; the actor retries shortly.
#[derive(Debug, thiserror::Error)]
pub(super) enum PlanError {
    /// The wake ledger is unavailable.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The history could not be read.
    #[error("cannot read the history: {0}")]
    History(String),
}

impl Router {
    /// Sorts held completions into turns: already delivered ones are acked,
    /// ones whose earlier post ended in doubt are re-sent as recorded, the
    /// rest become new turns (see the module doc).
    ///
    /// Every message ends up in a turn, acked, or (on an error) back in
    /// `held`, where the actor keeps it alive and plans it again: each step
    /// reads what it needs before it takes a message out of `held`, and a
    /// new turn's ledger writes put its messages back if they fail.
    pub(super) async fn plan(&self, held: &mut Vec<Pending>) -> Result<Vec<Turn>, PlanError> {
        let mut turns = Vec::new();
        let planned = match self.plan_batches(held, &mut turns).await {
            Ok(()) => self.plan_singles(held, &mut turns).await,
            Err(error) => Err(error),
        };
        match planned {
            Ok(()) => Ok(turns),
            Err(error) => {
                // Planned again next time; entries already written say
                // `posting`, so those turns are re-sent as recorded.
                held.extend(turns.into_iter().flat_map(|t| t.messages));
                Err(error)
            }
        }
    }

    /// Batch members: one consolidated turn once every task has a
    /// completion in the history (whoever handles the last one sees them
    /// all); until then each member is acked, or reported early if it failed
    /// and the batch asked for that.
    async fn plan_batches(
        &self,
        held: &mut Vec<Pending>,
        turns: &mut Vec<Turn>,
    ) -> Result<(), PlanError> {
        let ledger = &self.shared.ledger;
        let mut delegations: Vec<String> = held
            .iter()
            .filter(|p| is_batch_member(p))
            .map(|p| p.event.delegation_id.clone())
            .collect();
        delegations.sort_unstable();
        delegations.dedup();
        for delegation_id in delegations {
            let of_batch =
                |p: &Pending| is_batch_member(p) && p.event.delegation_id == delegation_id;
            let batch_key = WakeLedger::batch_key(&delegation_id);
            let recorded = ledger.read(&batch_key).await?;
            // A forced replay copy's key is used only when nothing is
            // recorded: see `plan_singles`.
            let forced_copy = held
                .iter()
                .filter(|p| of_batch(p))
                .find_map(|p| p.forced_key(&batch_key));
            let forced = forced_copy.clone().filter(|_| recorded.state.is_none());
            if let Some(LedgerState::Delivered { .. }) = recorded.state
                && forced.is_none()
            {
                for pending in take_where(held, of_batch) {
                    Outcome::Ack.apply(&pending.message).await;
                }
                continue;
            }
            let members: Vec<&Pending> = held.iter().filter(|p| of_batch(p)).collect();
            if let Some(batch) = self.batch_turn(&members).await? {
                info!(delegation_id = %delegation_id, tasks = batch.tasks, "Every task of the batch has ended; waking once.");
                let group = take_where(held, of_batch);
                // A post recorded in doubt (a forced replay's) is repeated
                // under its key.
                let in_doubt = match &recorded.state {
                    Some(LedgerState::Posting { idempotency_key }) => Some(idempotency_key.clone()),
                    _ => None,
                };
                turns.push(Turn {
                    traceparent: group[0].traceparent.clone(),
                    key: forced.or(in_doubt).unwrap_or_else(|| batch_key.clone()),
                    text: batch.text,
                    at: BTreeMap::from([(batch_key.clone(), recorded.revision)]),
                    covers: vec![batch_key],
                    reports: Some(
                        (0..batch.tasks)
                            .map(|index| WakeLedger::key(&delegation_id, index))
                            .collect(),
                    ),
                    messages: group,
                    first_send: false,
                });
                continue;
            }
            // Not complete yet: a failure is reported early if the batch
            // asked for that and it was not reported before; the rest is
            // recorded in the history, and the batch's last task reports it.
            // The key the forced turn waits under: its replay's record, or
            // its own when nothing is recorded.
            let waiting = forced_copy.and(match &recorded.state {
                Some(LedgerState::Posting { idempotency_key })
                    if crate::replay::is_forced_key_of(&batch_key, idempotency_key) =>
                {
                    Some(idempotency_key.clone())
                }
                _ => forced,
            });
            if let Some(key) = &waiting {
                // The replay recorded its key and said it replayed: say
                // why nothing is posted now.
                warn!(delegation_id = %delegation_id, idempotency_key = %key, "A forced replay of a batch task arrived while not every task of the batch has a completion in the history; its turn is posted under the forced key when the missing one arrives. If that one was removed (older than the history, or trimmed by a limit), nothing is posted: see the batch with `wakebus events --delegation`.");
            }
            let asking: BTreeSet<String> = held
                .iter()
                .filter(|p| of_batch(p) && notify_early(&p.event))
                .map(early_key)
                .collect();
            // Unreported early failures, with the revision read.
            let mut unreported = BTreeMap::new();
            for key in asking {
                let entry = ledger.read(&key).await?;
                if entry.state.is_none() {
                    unreported.insert(key, entry.revision);
                }
            }
            for pending in take_where(held, of_batch) {
                let early_key = early_key(&pending);
                let revision = unreported.get(&early_key).copied();
                if !notify_early(&pending.event) || revision.is_none() {
                    Outcome::Ack.apply(&pending.message).await;
                } else if let Some(turn) = turns.iter_mut().find(|t| t.key == early_key) {
                    // The same failure twice (a redelivery while held).
                    turn.messages.push(pending);
                } else {
                    turns.push(Turn {
                        traceparent: pending.traceparent.clone(),
                        text: turn::render_early_failure(&pending.event),
                        at: BTreeMap::from([(early_key.clone(), revision.unwrap_or(0))]),
                        covers: vec![early_key.clone()],
                        reports: Some(vec![pending.ledger_key()]),
                        key: early_key,
                        messages: vec![pending],
                        first_send: false,
                    });
                }
            }
        }
        Ok(())
    }

    /// Completions woken one by one (single tasks, tasks of `independent`
    /// batches): duplicates of delivered ones are acked, posts in doubt
    /// re-sent under their key, the rest recorded as new turns.
    async fn plan_singles(
        &self,
        held: &mut Vec<Pending>,
        turns: &mut Vec<Turn>,
    ) -> Result<(), PlanError> {
        let ledger = &self.shared.ledger;
        // The common case: one completion, never seen before. Creating its
        // `posting` entry both tells that nothing was recorded for it and
        // records the post, in one write; if an entry exists, nothing is
        // written and the full plan below reads it.
        if let [only] = held.as_slice() {
            let key = only.event_key();
            if let Some(revision) = ledger.mark_posting_if_new(&only.ledger_key(), &key).await? {
                let pending = held.pop().expect("one held");
                turns.push(Turn {
                    traceparent: pending.traceparent.clone(),
                    text: turn::render(&[&pending.event]),
                    at: BTreeMap::from([(pending.ledger_key(), revision)]),
                    covers: vec![pending.ledger_key()],
                    reports: None,
                    key,
                    messages: vec![pending],
                    first_send: false,
                });
                return Ok(());
            }
        }
        // Everything read first, so that an error leaves `held` whole; each
        // task once, so that two copies of it are planned on the same read.
        // The entries keep their revisions: a turn's marks and records are
        // written only over them, so that a change since (another
        // instance, a replay) is noticed rather than overwritten.
        let keys: BTreeSet<String> = held.iter().map(Pending::ledger_key).collect();
        let read = join_all(keys.iter().map(|key| ledger.read(key)))
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let mut known: BTreeMap<String, LedgerEntry> = keys.into_iter().zip(read).collect();
        let states: Vec<Option<LedgerState>> = held
            .iter()
            .map(|p| known[&p.ledger_key()].state.clone())
            .collect();
        let mut intents: BTreeMap<String, Option<Intent>> = BTreeMap::new();
        for state in &states {
            if let Some(LedgerState::Posting { idempotency_key }) = state
                && !intents.contains_key(idempotency_key)
            {
                let intent = match ledger.intent(idempotency_key).await? {
                    Some(intent)
                        if self
                            .all_marked(idempotency_key, &intent, &mut known)
                            .await? =>
                    {
                        Some(intent)
                    }
                    // Recorded, but not every covered completion was marked
                    // for it: it was never posted (the post comes after the
                    // last mark), and re-sending it could report a
                    // completion woken since on its own.
                    Some(_) => {
                        info!(idempotency_key = %idempotency_key, "A combined turn was never recorded in full, so never posted; planning its completions afresh.");
                        None
                    }
                    None => None,
                };
                intents.insert(idempotency_key.clone(), intent);
            }
        }
        let mut recovering: Vec<Turn> = Vec::new();
        let mut fresh: Vec<Pending> = Vec::new();
        for (pending, state) in std::mem::take(held).into_iter().zip(states) {
            // A forced replay copy goes by the record like any copy:
            // `replay wakes --force` records the copy's key before it
            // publishes it, so by the time it arrives the record is its
            // own post (or a later forced run's, or the delivery of one).
            // A forced header on a copy no replay recorded (a publisher's
            // own, a copy of a forced copy) is no reason to post again.
            match state {
                Some(LedgerState::Delivered { .. }) => {
                    info!(delegation_id = %pending.event.delegation_id, task_index = pending.event.task_index, "Wake already delivered; acking the duplicate.");
                    Outcome::Ack.apply(&pending.message).await;
                }
                Some(LedgerState::Posting { idempotency_key }) => {
                    let covered = |t: &&mut Turn| {
                        t.key == idempotency_key && t.covers.contains(&pending.ledger_key())
                    };
                    if let Some(turn) = recovering.iter_mut().find(covered) {
                        turn.messages.push(pending);
                    } else if let Some(intent) = intents
                        .get(&idempotency_key)
                        .and_then(Option::as_ref)
                        // A completion the recorded turn does not cover
                        // (inconsistent entries: a hand edit) is not acked
                        // with it unreported.
                        .filter(|intent| intent.covers.contains(&pending.ledger_key()))
                        .cloned()
                    {
                        intents.remove(&idempotency_key);
                        warn!(idempotency_key = %idempotency_key, "{SENDING_AGAIN}");
                        recovering.push(Turn {
                            traceparent: pending.traceparent.clone(),
                            at: marked_for(&known, &intent.covers, &idempotency_key),
                            key: idempotency_key,
                            text: intent.text,
                            reports: None,
                            covers: intent.covers,
                            messages: vec![pending],
                            first_send: false,
                        });
                    } else if is_combined_key(&idempotency_key) {
                        // Marked for a combined turn that was never
                        // recorded in full (no intent, or not every mark):
                        // never posted. Planned afresh (alone, if
                        // redelivered).
                        fresh.push(pending);
                    } else {
                        // A single post in doubt (singles record no
                        // intent): repeat it alone, under the same key.
                        // A forced replay's is recorded before its copy
                        // goes out: posting it is the normal course.
                        if crate::replay::is_forced_key_of(&pending.base_key(), &idempotency_key) {
                            info!(idempotency_key = %idempotency_key, "Posting the wake a forced replay recorded.");
                        } else {
                            warn!(idempotency_key = %idempotency_key, "{SENDING_AGAIN}");
                        }
                        recovering.push(Turn {
                            traceparent: pending.traceparent.clone(),
                            text: turn::render(&[&pending.event]),
                            at: revisions(&known, &[pending.ledger_key()]),
                            covers: vec![pending.ledger_key()],
                            reports: None,
                            key: idempotency_key,
                            messages: vec![pending],
                            first_send: false,
                        });
                    }
                }
                None => fresh.push(pending),
            }
        }
        // A completion that a doubtful post already reported goes with it;
        // a forced replay copy does not: it is posted on its own.
        let mut remaining: Vec<Pending> = Vec::new();
        for pending in fresh {
            let key = pending.ledger_key();
            match recovering.iter_mut().find(|t| t.covers.contains(&key)) {
                Some(turn) if pending.forced_key("").is_none() => turn.messages.push(pending),
                _ => remaining.push(pending),
            }
        }
        // In the order a new turn has them (by ledger key), not as they
        // arrived: a webhook post re-sent with all its completions in hand
        // is then the body first sent.
        for turn in &mut recovering {
            turn.messages.sort_by_key(Pending::ledger_key);
        }
        turns.append(&mut recovering);
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
        // Each entry becomes one new turn.
        let mut new_turns = Vec::new();
        for messages in by_task.into_values() {
            // A forced replay is posted alone too, under its own key.
            if messages.iter().any(|p| {
                p.message.info().is_ok_and(|info| info.delivered > 1) || p.forced_key("").is_some()
            }) {
                new_turns.push(messages);
            } else {
                first_time.push(messages);
            }
        }
        // The rest is one combined turn, if its intent fits in one ledger
        // entry; if not, it could never be recorded (and so never posted),
        // so each task goes alone.
        if first_time.len() > 1 {
            let budget = self.shared.bus.max_payload().saturating_sub(INTENT_MARGIN);
            if combined_intent_size(&first_time) <= budget {
                new_turns.push(first_time.into_iter().flatten().collect());
            } else {
                warn!(
                    tasks = first_time.len(),
                    budget,
                    "Completions too large to record as one combined turn; posting each alone."
                );
                new_turns.append(&mut first_time);
            }
        } else {
            new_turns.append(&mut first_time);
        }
        // A failed write puts the messages of the turn it was for, and of
        // those not tried yet, back in `held`.
        let mut groups = new_turns.into_iter();
        while let Some(messages) = groups.next() {
            if let Err(error) = self.new_turn(messages, &known, held, turns).await {
                held.extend(groups.flatten());
                return Err(error.into());
            }
        }
        Ok(())
    }

    /// One turn for completions never posted before, added to `turns`; if
    /// its ledger writes fail, its messages go back to `held`. A combined
    /// turn's intent is recorded first, so a post that ends in doubt can be
    /// repeated exactly. Each mark is written only over the entry's
    /// revision in `known` (as planned).
    async fn new_turn(
        &self,
        mut messages: Vec<Pending>,
        known: &BTreeMap<String, LedgerEntry>,
        held: &mut Vec<Pending>,
        turns: &mut Vec<Turn>,
    ) -> Result<(), LedgerError> {
        if messages.is_empty() {
            return Ok(());
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
        let recorded = match events.as_slice() {
            [_] => {
                // Recorded before the post: if the post's outcome is lost
                // (ledger write failed, ack lost, even a redelivery count
                // lost in a failover), the completion is re-sent alone under
                // this key and never joins a new combined turn.
                // A forced replay copy's new key wins over an ordinary
                // copy of the same task held with it.
                let key = messages
                    .iter()
                    .find(|p| p.forced_key("").is_some())
                    .unwrap_or(&messages[0])
                    .event_key();
                self.shared
                    .ledger
                    .mark_posting(&covers[0], &key, revision(known, &covers[0]))
                    .await
                    .map(|revision| (key, vec![revision]))
            }
            _ => {
                let key = format!("{COMBINED_KEY_PREFIX}{}", ulid::Ulid::new());
                self.record_intent(&key, &text, &covers, known)
                    .await
                    .map(|revisions| (key, revisions))
            }
        };
        match recorded {
            Ok((key, marked)) => {
                turns.push(Turn {
                    traceparent: messages[0].traceparent.clone(),
                    key,
                    text,
                    at: covers.iter().cloned().zip(marked).collect(),
                    reports: None,
                    covers,
                    messages,
                    first_send: true,
                });
                Ok(())
            }
            Err(error) => {
                held.extend(messages);
                Err(error)
            }
        }
    }

    /// Records a combined turn before its post: the intent, then each
    /// covered completion's `posting` entry (all at once). The turn is
    /// posted only once every mark is stored, so a turn whose intent
    /// exists but not every mark (one failed, or the instance stopped in
    /// between) was never posted: [`Router::all_marked`] tells, and its
    /// completions are planned afresh. (The intent comes first so that a
    /// wakebus older than this rule, which re-sends any intent it finds,
    /// never meets a mark without one during a rolling upgrade.) Each mark
    /// is written only over the revision planned on; a refused one leaves
    /// the turn unposted, like a failed one. Returns the marks' revisions,
    /// in the order of `covers`.
    async fn record_intent(
        &self,
        key: &str,
        text: &str,
        covers: &[String],
        known: &BTreeMap<String, LedgerEntry>,
    ) -> Result<Vec<u64>, LedgerError> {
        let ledger = &self.shared.ledger;
        let intent = Intent {
            text: text.to_owned(),
            covers: covers.to_vec(),
        };
        ledger.put_intent(key, &intent).await?;
        try_join_all(
            covers
                .iter()
                .map(|covered| ledger.mark_posting(covered, key, revision(known, covered))),
        )
        .await
    }

    /// Whether every completion `intent` covers is marked for the turn
    /// `key` (posting or delivered under it, or since for its forced
    /// replay), as it is once the turn may have been posted. `known` holds
    /// the entries already read; those
    /// read here are added, for a re-sent turn's records.
    async fn all_marked(
        &self,
        key: &str,
        intent: &Intent,
        known: &mut BTreeMap<String, LedgerEntry>,
    ) -> Result<bool, LedgerError> {
        for covered in &intent.covers {
            if !known.contains_key(covered) {
                let entry = self.shared.ledger.read(covered).await?;
                known.insert(covered.clone(), entry);
            }
            let entry = &known[covered];
            // Marked since by `replay wakes --force` (posting or delivered
            // under the forced key of this completion), or deleted, counts:
            // the operator took it out of the turn, which may well have
            // been posted, so the turn is re-sent for the others it covers
            // rather than waking them again under new keys (and records
            // its delivery for those only, and for a deleted one).
            let marked = match &entry.state {
                Some(state) => {
                    state.key() == key
                        || crate::replay::is_forced_key_of(&format!("{covered}.done"), state.key())
                }
                // Deleted since it was marked (a forced replay of an
                // earlier release, or `nats kv del`): counted the same (and
                // recorded delivered by the re-sent turn). Nothing has
                // woken it since the deletion: a wake would have marked it.
                // (Had it been woken alone before, under a mark that landed
                // late over this turn's, the deletion lost that; the turn
                // then reports it again.)
                None => entry.revision > 0,
            };
            if !marked {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The revision `key` was read at. Every task a turn covers was read when
/// it was planned; were one not, 0 (the key never written) is the
/// strictest guess: refused over any entry, a deletion's included.
fn revision(known: &BTreeMap<String, LedgerEntry>, key: &str) -> u64 {
    debug_assert!(known.contains_key(key), "{key} was not read");
    known.get(key).map_or(0, |entry| entry.revision)
}

/// The revisions `keys` were read at, for a re-sent turn's records.
fn revisions(known: &BTreeMap<String, LedgerEntry>, keys: &[String]) -> BTreeMap<String, u64> {
    keys.iter()
        .map(|key| (key.clone(), revision(known, key)))
        .collect()
}

/// The revisions of those of `covers` marked for the turn `key`, or
/// deleted: a re-sent combined turn records its delivery for them, never
/// over a forced replay's record of a completion it covers.
fn marked_for(
    known: &BTreeMap<String, LedgerEntry>,
    covers: &[String],
    key: &str,
) -> BTreeMap<String, u64> {
    covers
        .iter()
        .filter_map(|covered| {
            let entry = known.get(covered)?;
            let ours = entry
                .state
                .as_ref()
                .map_or(entry.revision > 0, |state| state.key() == key);
            ours.then(|| (covered.clone(), entry.revision))
        })
        .collect()
}

/// How a combined turn's Idempotency-Key begins (`wake.<ULID>`); a
/// single's is its completion's id.
const COMBINED_KEY_PREFIX: &str = "wake.";

/// Whether `key` is a combined turn's: the prefix and a ULID, nothing
/// else (a delegation whose id is `wake` has single keys `wake.0.done`).
pub(super) fn is_combined_key(key: &str) -> bool {
    key.strip_prefix(COMBINED_KEY_PREFIX)
        .is_some_and(|id| ulid::Ulid::from_string(id).is_ok())
}

/// Room left in a ledger entry for the KV layer beyond the intent's JSON.
const INTENT_MARGIN: usize = 1024;

/// The size of the intent a combined turn of these tasks (one group of
/// messages each) would record.
fn combined_intent_size(tasks: &[Vec<Pending>]) -> usize {
    let events: Vec<&CompletionEvent> = tasks.iter().map(|group| &group[0].event).collect();
    let intent = Intent {
        text: turn::render(&events),
        covers: tasks.iter().map(|group| group[0].ledger_key()).collect(),
    };
    serde_json::to_vec(&intent).map_or(usize::MAX, |json| json.len())
}

fn is_batch_member(pending: &Pending) -> bool {
    pending.event.task_count > 1 && pending.event.wake_mode == WakeMode::Batch
}

/// Whether a batch member's failure is reported before the batch ends: if
/// the batch asked, any status but `completed`, except a cancel (the
/// canceller knows already). An `interrupted` that a subagent reported
/// itself is no cancel.
fn notify_early(event: &CompletionEvent) -> bool {
    event.notify_early_failure
        && match event.status {
            Status::Completed => false,
            Status::Interrupted => event.exit_reason != "cancelled",
            Status::Failed | Status::Timeout | Status::Error => true,
        }
}

/// The ledger key of a batch member's early failure report.
fn early_key(pending: &Pending) -> String {
    format!(
        "{}.{}.early",
        pending.event.delegation_id, pending.event.task_index
    )
}

/// Takes the messages `matching` out of `held`, keeping the order of both.
fn take_where(held: &mut Vec<Pending>, matching: impl Fn(&Pending) -> bool) -> Vec<Pending> {
    let (taken, kept) = std::mem::take(held).into_iter().partition(|p| matching(p));
    *held = kept;
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_but_completed_is_reported_early_except_a_cancel() {
        let request = crate::protocol::TaskRequest::new("d1".to_owned(), "g".to_owned());
        let early = |status, exit_reason: &str| {
            let mut event = CompletionEvent::for_request(&request, status, exit_reason);
            event.notify_early_failure = true;
            notify_early(&event)
        };
        assert!(!early(Status::Completed, "completed"));
        assert!(early(Status::Failed, "nonzero_exit"));
        assert!(early(Status::Timeout, "timeout"));
        assert!(early(Status::Error, "invalid_request"));
        // A subagent that reported `interrupted` itself.
        assert!(early(Status::Interrupted, "completed"));
        assert!(!early(Status::Interrupted, "cancelled"));
    }

    #[test]
    fn only_the_prefix_and_a_ulid_make_a_combined_key() {
        assert!(is_combined_key("wake.01JV3S2D6F8H0K2M4P6R8T0W2Y"));
        // The single key of a delegation whose id is `wake`.
        assert!(!is_combined_key("wake.0.done"));
        assert!(!is_combined_key("01JV3S2D6F8H0K2M4P6R8T0W2Y.0.done"));
        assert!(!is_combined_key(
            "wake.01JV3S2D6F8H0K2M4P6R8T0W2Y.replay.01JV3S2D6F8H0K2M4P6R8T0W2Z"
        ));
    }
}
