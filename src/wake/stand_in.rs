//! Placing the `error` completion of an unreadable batch member in its
//! batch.
//!
//! A worker that cannot read a request's body cannot tell its batch, and
//! writes its `error` completion as a batch of its own
//! ([`CompletionEvent::is_of_an_unreadable_batch`]). A batch whose other
//! tasks end after it finds it there ([`CompletionEvent::is_task_of`]). But
//! one whose other tasks had all ended first would never be woken: their
//! completions were acked while this task was missing, and this completion,
//! not a member of their batch, would wake its session on its own. So the
//! wake reads the other tasks' completions and, when one belongs to a batch
//! this task is part of, takes this completion as a member of that batch:
//! it ends the batch, whose turn reports it.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use tracing::info;

use super::Shared;
use super::ledger::{LedgerError, WakeLedger};
use super::session::{Pending, newest_before};
use crate::protocol::{
    CompletionEvent, EventKind, INVALID_ID_PREFIX, MAX_TASK_COUNT, WakeMode, session_token,
};

/// Other tasks whose completions are read at most, from task 0 on: enough
/// for every batch `wakebus delegate` sends (`--max-batch`, 10 by default)
/// and for many unreadable members in a larger one.
const OTHERS_READ: u32 = 16;

/// Why an unreadable member's error could not be placed yet. Either way the
/// caller hands the completion back, to be decided again, rather than post
/// it alone while its batch may wait for it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PlacementError {
    /// Its own ledger entry is not ledger JSON (edited by hand, or written
    /// by a newer wakebus): whether a post of it alone was made cannot be
    /// told, so it is held until an operator fixes or deletes the entry.
    /// Sent down the single path instead, it would be posted alone once the
    /// entry was deleted, and its batch, whose other tasks had ended, never
    /// woken.
    #[error(transparent)]
    CorruptEntry(LedgerError),
    /// Its ledger entry or another task's completion could not be read.
    #[error("{0}")]
    Read(String),
}

/// Makes `pending`, if it is an unreadable member's `error` completion, a
/// member of its delegation's batch, as another task's stored completion
/// describes it. Left as it is when no other task has a batch completion
/// yet (the batch's last task then finds this one), or when a post of it
/// alone may already have been made (its own ledger entry exists: it is
/// repeated under its own key). A forced replay copy is placed like any
/// copy: `replay wakes --force` records its key under the error's own entry
/// before publishing it, so it goes alone by that entry, and a forced
/// header that no replay recorded makes no second turn (taken out of its
/// delivered batch, it would be posted alone under the header's key).
pub(crate) async fn place_in_batch(
    shared: &Shared,
    pending: &mut Pending,
) -> Result<(), PlacementError> {
    let event = &pending.event;
    // A request with no usable id is written under one of its own, which
    // has no other tasks.
    if !event.is_of_an_unreadable_batch() || event.delegation_id.starts_with(INVALID_ID_PREFIX) {
        return Ok(());
    }
    let own = WakeLedger::key(&event.delegation_id, event.task_index);
    match shared.ledger.read(&own).await {
        Ok(recorded) if recorded.state.is_none() => {}
        // A post of it alone may be in doubt: repeated under its key.
        Ok(_) => return Ok(()),
        Err(error @ LedgerError::Corrupt { .. }) => {
            return Err(PlacementError::CorruptEntry(error));
        }
        Err(error) => return Err(PlacementError::Read(error.to_string())),
    }
    let token = session_token(&pending.session);
    let others: Vec<u32> = (0..=OTHERS_READ)
        .filter(|&index| index != event.task_index)
        .take(OTHERS_READ as usize)
        .collect();
    // Read at once, taken in index order: the same decision whatever
    // answers first.
    let reads = others.iter().map(|&other| {
        let subject =
            shared
                .bus
                .subjects
                .event(&token, &event.delegation_id, other, EventKind::Done);
        async move {
            shared
                .events
                .get_last_raw_message_by_subject(&subject)
                .await
        }
    });
    let stored = futures::future::join_all(reads).await;
    for (&other, stored) in others.iter().zip(stored) {
        let stored = match stored {
            Ok(stored) => stored,
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => continue,
            Err(error) => return Err(PlacementError::Read(error.to_string())),
        };
        let of_its_batch = |message: &StreamMessage| {
            let batch = CompletionEvent::decode(&message.payload).ok()?;
            (batch.delegation_id == event.delegation_id
                && batch.task_index == other
                && batch.wake_mode == WakeMode::Batch
                && batch.task_count > 1
                && batch.task_count > event.task_index
                && batch.task_count <= MAX_TASK_COUNT
                && batch.origin_session_id.as_deref() == Some(pending.session.as_str()))
            .then_some(batch)
        };
        let batch = match of_its_batch(&stored) {
            Some(batch) => Some(batch),
            // Garbage stored after the task's completion, which was acked
            // when it came: the newest usable one before it counts, as in
            // a batch's plan.
            None => {
                let subject =
                    shared
                        .bus
                        .subjects
                        .event(&token, &event.delegation_id, other, EventKind::Done);
                newest_before(&shared.events, &subject, stored.sequence, of_its_batch)
                    .await
                    .map_err(PlacementError::Read)?
                    .map(|(_, batch)| batch)
            }
        };
        if let Some(batch) = batch {
            info!(delegation_id = %event.delegation_id, task_index = event.task_index, tasks = batch.task_count, "An unreadable request's error completion is taken as a member of its delegation's batch.");
            let event = &mut pending.event;
            event.task_count = batch.task_count;
            event.wake_mode = WakeMode::Batch;
            event.notify_early_failure = batch.notify_early_failure;
            return Ok(());
        }
    }
    Ok(())
}
