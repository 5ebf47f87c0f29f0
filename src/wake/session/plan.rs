//! Planning: which of the completions an actor holds are already woken,
//! which must be re-sent exactly as an earlier post in doubt, and which
//! become one new turn (recorded in the ledger before it is posted).

use std::collections::BTreeMap;

use futures::future::join_all;
use tracing::{info, warn};

use super::{Pending, Router, Turn};
use crate::outcome::Outcome;
use crate::protocol::{CompletionEvent, EventKind, Status, WakeMode, session_token};
use crate::wake::ledger::{Intent, LedgerError, LedgerState, WakeLedger};
use crate::wake::turn;
use async_nats::jetstream::stream::LastRawMessageErrorKind;

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
    /// rest become one new turn.
    pub(super) async fn plan(&self, held: &mut Vec<Pending>) -> Result<Vec<Turn>, PlanError> {
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
}
