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
//! wake reads the completion of another task of the delegation and, when
//! that one belongs to a batch this task is part of, takes this completion
//! as a member of that batch: it ends the batch, whose turn reports it.

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use tracing::{debug, info};

use super::Shared;
use super::session::Pending;
use crate::protocol::{CompletionEvent, EventKind, MAX_TASK_COUNT, WakeMode, session_token};

/// Makes `pending`, if it is an unreadable member's `error` completion, a
/// member of its delegation's batch, as another task's stored completion
/// describes it. Left as it is when there is no such completion yet (the
/// batch's last task then finds this one), or it cannot be read.
pub(crate) async fn place_in_batch(shared: &Shared, pending: &mut Pending) {
    let event = &pending.event;
    if !event.is_of_an_unreadable_batch() {
        return;
    }
    let other = u32::from(event.task_index == 0);
    let subject = shared.bus.subjects.event(
        &session_token(&pending.session),
        &event.delegation_id,
        other,
        EventKind::Done,
    );
    let stored = match shared
        .events
        .get_last_raw_message_by_subject(&subject)
        .await
    {
        Ok(stored) => stored,
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => return,
        Err(error) => {
            debug!(delegation_id = %event.delegation_id, %error, "Could not read another task's completion; the unreadable task's error wakes its session on its own.");
            return;
        }
    };
    let Ok(batch) = CompletionEvent::decode(&stored.payload) else {
        return;
    };
    let of_its_batch = batch.delegation_id == event.delegation_id
        && batch.task_index == other
        && batch.wake_mode == WakeMode::Batch
        && batch.task_count > 1
        && batch.task_count > event.task_index
        && batch.task_count <= MAX_TASK_COUNT
        && batch.origin_session_id.as_deref() == Some(pending.session.as_str());
    if !of_its_batch {
        return;
    }
    info!(delegation_id = %event.delegation_id, task_index = event.task_index, tasks = batch.task_count, "An unreadable request's error completion is taken as a member of its delegation's batch.");
    let event = &mut pending.event;
    event.task_count = batch.task_count;
    event.wake_mode = WakeMode::Batch;
    event.notify_early_failure = batch.notify_early_failure;
}
