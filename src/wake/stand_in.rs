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

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use tracing::info;

use super::Shared;
use super::ledger::WakeLedger;
use super::session::Pending;
use crate::protocol::{CompletionEvent, EventKind, MAX_TASK_COUNT, WakeMode, session_token};

/// Other tasks whose completions are read at most, from task 0 on: enough
/// for every batch `wakebus delegate` sends (`--max-batch`, 10 by default)
/// and for many unreadable members in a larger one.
const OTHERS_READ: u32 = 16;

/// Makes `pending`, if it is an unreadable member's `error` completion, a
/// member of its delegation's batch, as another task's stored completion
/// describes it. Left as it is when no other task has a batch completion
/// yet (the batch's last task then finds this one), when a post of it alone
/// may already have been made (its own ledger entry exists: it is repeated
/// under its own key), or for a forced replay copy (posted alone, as asked).
/// An error is a read that failed: the caller hands the completion back, to
/// be decided again, rather than post it alone while its batch may wait.
pub(crate) async fn place_in_batch(shared: &Shared, pending: &mut Pending) -> Result<(), String> {
    let event = &pending.event;
    if !event.is_of_an_unreadable_batch() || pending.is_forced_copy() {
        return Ok(());
    }
    let own = WakeLedger::key(&event.delegation_id, event.task_index);
    let recorded = shared
        .ledger
        .read(&own)
        .await
        .map_err(|error| error.to_string())?;
    if recorded.state.is_some() {
        return Ok(());
    }
    let token = session_token(&pending.session);
    let others = (0..=OTHERS_READ).filter(|&index| index != event.task_index);
    for other in others.take(OTHERS_READ as usize) {
        let subject =
            shared
                .bus
                .subjects
                .event(&token, &event.delegation_id, other, EventKind::Done);
        let stored = match shared
            .events
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(stored) => stored,
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => continue,
            Err(error) => return Err(error.to_string()),
        };
        let Ok(batch) = CompletionEvent::decode(&stored.payload) else {
            continue;
        };
        let of_its_batch = batch.delegation_id == event.delegation_id
            && batch.task_index == other
            && batch.wake_mode == WakeMode::Batch
            && batch.task_count > 1
            && batch.task_count > event.task_index
            && batch.task_count <= MAX_TASK_COUNT
            && batch.origin_session_id.as_deref() == Some(pending.session.as_str());
        if of_its_batch {
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
