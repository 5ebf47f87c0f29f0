//! A batch's one turn: every task's completion, read from the history
//! (those in hand as they are), fitted into a turn of bounded size.
//!
//! A batch may have up to 1,000 tasks, each with a result near the max
//! payload: read whole, its turn could be a gigabyte, held in memory and
//! posted as one user message. So the results share at most the server's
//! max payload between them, less what the rest of the turn takes: each
//! is cut at the same length, the longest at which they all fit, so a
//! short result is never cut to make room and long ones get what the short
//! ones leave. A goal or an error is cut only beyond the greater of an
//! even share of the budget and [`GOAL_MIN`] or [`ERROR_MIN`], so the turn
//! is the budget, or at most about 9 KiB a task when goals and errors are
//! long. The text depends on the completions stored and the max payload
//! alone, as a turn re-sent under its key must.
//!
//! The results are read in two passes, so that memory stays near the
//! turn's bound: the first keeps of each completion only what the turn
//! shows, its result cut to its even share, and the result's length; the
//! second reads again those allowed more than that. A read that fails
//! fails the plan (tried again), rather than give a turn that a re-send
//! would give otherwise.
//!
//! Each pass has up to [`READS_IN_FLIGHT`] reads in flight: one at a time,
//! a batch of 1,000 tasks took as many round trips in a row. (The session
//! lock the turn is planned under is kept alive while it is planned,
//! `SessionLocks::keep_during`: a plan that outlasted it was planned again,
//! as slowly, for ever.) Each read holds one of the service's
//! [`batch_read_permits`] until it has cut what it read to what the pass
//! keeps, so what batch planning holds whole at once is bounded per
//! service, and what waits in a pass for its turn is only what it keeps.
//! The first read (of the last task) goes alone: a batch not complete yet
//! mostly shows it there, and each of its members is checked as it
//! arrives.

use async_nats::jetstream;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{LastRawMessageError, LastRawMessageErrorKind};
use futures::StreamExt as _;
use tracing::{info, warn};

use super::plan::PlanError;
use super::{Pending, Router};
use crate::protocol::{CompletionEvent, EventKind, HEADER_ORIGIN_SESSION, bounded, session_token};
use crate::wake::turn;

/// A goal is cut only beyond this and the task's even share of the budget.
const GOAL_MIN: usize = 1024;

/// An error is cut only beyond this and the task's even share of the
/// budget: a command's error (its exit and a 4 KiB stderr tail) seldom is.
const ERROR_MIN: usize = 8192;

/// What one task's lines take in a batch turn besides its goal, error and
/// result (its header, labels, cut markers), at most.
const TASK_LINES: usize = 128;

/// What a batch turn takes besides its tasks (its header, the closing note
/// on cut results), at most.
const TURN_LINES: usize = 512;

/// Most messages [`Router::usable_before`] reads on one subject: a task's
/// `done` subject holds one or two, unless someone floods it.
const WALK_LIMIT: usize = 64;

/// Most reads one pass has in flight.
const READS_IN_FLIGHT: usize = 16;

/// Most bytes of completions read whole at once for batch turns, across
/// the service, besides what the passes keep (each read holds its message
/// and a decoded copy for a moment).
const READ_PERMIT_BYTES: usize = 64 << 20;

/// How many completions the service reads whole at once for batch turns
/// with messages of up to `max_payload` bytes: 64 (four sessions' batches
/// read at full speed), fewer when that many could together exceed
/// [`READ_PERMIT_BYTES`] (8 at 8 MiB), and at least 4, so that large
/// payloads do not make batches planned one read at a time across the
/// service.
pub(crate) fn batch_read_permits(max_payload: usize) -> usize {
    (READ_PERMIT_BYTES / max_payload.max(1)).clamp(4, 4 * READS_IN_FLIGHT)
}

/// A batch's turn, once every task has a usable completion.
pub(super) struct BatchTurn {
    /// The turn's text.
    pub(super) text: String,
    /// How many tasks it reports.
    pub(super) tasks: u32,
}

/// One task's completion as the first pass keeps it.
struct Kept {
    /// The completion as the turn shows it: no context, its goal and error
    /// cut, its result to at most the first pass's share (each in an
    /// allocation of that size, not the decoded one's).
    event: CompletionEvent,
    /// The result's whole length in bytes.
    whole: usize,
    /// Where it is stored, to read it again; `None` for one in hand.
    sequence: Option<u64>,
}

impl Kept {
    /// Keeps what the turn shows of `event`, whose result is cut to
    /// `share` bytes, the task's even share of the budget, for now.
    fn new(mut event: CompletionEvent, sequence: Option<u64>, share: usize) -> Self {
        // Not shown, and up to the max payload each.
        event.context = String::new();
        event.goal = bounded(&event.goal, share.max(GOAL_MIN));
        event.error = event
            .error
            .map(|error| bounded(&error, share.max(ERROR_MIN)));
        let whole = event.summary.as_ref().map_or(0, String::len);
        event.summary = event.summary.map(|summary| prefix(&summary, share));
        Self {
            event,
            whole,
            sequence,
        }
    }

    /// What its lines take besides its result.
    fn lines(&self) -> usize {
        TASK_LINES + self.event.goal.len() + self.event.error.as_ref().map_or(0, String::len)
    }
}

impl Router {
    /// The batch's one turn, if every task has a usable completion: those
    /// of `members` (the batch's completions in hand) as they are, the
    /// others from the history, fitted as the module doc says.
    pub(super) async fn batch_turn(
        &self,
        members: &[&Pending],
    ) -> Result<Option<BatchTurn>, PlanError> {
        let member = members[0];
        let tasks = member.event.task_count;
        let budget = self.shared.bus.max_payload().saturating_sub(TURN_LINES);
        let first = budget / tasks.max(1) as usize;
        let Some(kept) = self.batch_completions(members, first).await? else {
            return Ok(None);
        };
        let lines: usize = kept.iter().map(Kept::lines).sum();
        let lengths: Vec<usize> = kept.iter().map(|k| k.whole).collect();
        let share = turn::result_share(&lengths, budget.saturating_sub(lines));
        let mut cut = 0;
        let mut events = Vec::with_capacity(kept.len());
        // The second pass: each result allowed more than the first kept,
        // read again whole, in order, a few at a time.
        let mut second = std::pin::pin!(
            futures::stream::iter(kept)
                .map(|kept| async move {
                    let Kept {
                        mut event,
                        whole,
                        sequence,
                    } = kept;
                    let allowed = share.map_or(whole, |share| share.min(whole));
                    let have = event.summary.as_ref().map_or(0, String::len);
                    if allowed > have {
                        let _permit = self.shared.batch_reads.acquire().await;
                        let again = self.read_again(members, sequence, event.task_index);
                        let summary = again.await?.summary;
                        event.summary = summary.map(|summary| prefix(&summary, allowed));
                    } else if allowed < have {
                        // What the goals and errors take can leave less
                        // than the first pass's even share.
                        event.summary = event.summary.map(|summary| prefix(&summary, allowed));
                    }
                    Ok::<_, PlanError>((event, whole))
                })
                .buffered(READS_IN_FLIGHT)
        );
        while let Some(read) = second.next().await {
            let (mut event, whole) = read?;
            if let Some(summary) = event.summary.as_mut()
                && summary.len() < whole
            {
                let cut_off = whole - summary.len();
                summary.push_str(&format!("… [{cut_off} bytes cut]"));
                cut += 1;
            }
            events.push(event);
        }
        if cut > 0 {
            info!(delegation_id = %member.event.delegation_id, tasks, cut, budget, "The batch's results are longer than one turn holds; each is cut to fit.");
        }
        Ok(Some(BatchTurn {
            text: turn::render_batch(&member.event.delegation_id, &events, cut > 0),
            tasks,
        }))
    }

    /// Task `index`'s completion read again whole (see [`Kept`]): from
    /// `members` when in hand, else at `sequence`. An error fails the plan,
    /// tried again later: a turn given with this result cut further would
    /// differ from the same turn re-sent after a crash.
    async fn read_again(
        &self,
        members: &[&Pending],
        sequence: Option<u64>,
        index: u32,
    ) -> Result<CompletionEvent, PlanError> {
        let Some(sequence) = sequence else {
            return members
                .iter()
                .find(|p| p.event.task_index == index)
                .map(|held| held.event.clone())
                .ok_or_else(|| PlanError::History(format!("task {index} is no longer in hand")));
        };
        let message = self
            .shared
            .events
            .raw_message_builder()
            .sequence(sequence)
            .send()
            .await
            .map_err(|error| {
                PlanError::History(format!(
                    "cannot read task {index}'s completion again at sequence {sequence}: {error}"
                ))
            })?;
        sibling(&message, members[0], index).map_err(|error| {
            PlanError::History(format!(
                "task {index}'s completion read again at sequence {sequence} cannot be used: {error}"
            ))
        })
    }

    /// Every completion of a batch, by task index, if all exist, kept with
    /// results of at most `share` bytes ([`Kept`]). Read from the last task
    /// down: tasks mostly end in the order they were queued, so a batch not
    /// complete yet usually shows it at the first read (up from the first,
    /// each member's check read all the tasks before it: N²/2 reads for a
    /// batch of N).
    async fn batch_completions(
        &self,
        members: &[&Pending],
        share: usize,
    ) -> Result<Option<Vec<Kept>>, PlanError> {
        let member = members[0];
        let subjects = &self.shared.bus.subjects;
        let token = session_token(&member.session);
        let mut all: Vec<Option<Kept>> = Vec::new();
        all.resize_with(member.event.task_count as usize, || None);
        // The last task alone, then the others a few at a time.
        let order: Vec<u32> = (0..member.event.task_count).rev().collect();
        let (last, others) = order.split_at(order.len().min(1));
        let token = token.as_str();
        for (indices, ahead) in [(last, 1), (others, READS_IN_FLIGHT)] {
            let mut reads = std::pin::pin!(
                futures::stream::iter(indices.iter().copied())
                    .map(|index| async move {
                        if let Some(held) = members.iter().find(|p| p.event.task_index == index) {
                            let kept = Kept::new(held.event.clone(), None, share);
                            return (index, Ok(Some(kept)));
                        }
                        let permit = self.shared.batch_reads.acquire().await.ok();
                        let subject = subjects.event(
                            token,
                            &member.event.delegation_id,
                            index,
                            EventKind::Done,
                        );
                        let read = self
                            .shared
                            .events
                            .get_last_raw_message_by_subject(&subject)
                            .await;
                        let kept = self.kept_sibling(&subject, read, permit, member, index, share);
                        (index, kept.await)
                    })
                    .buffered(ahead)
            );
            while let Some((index, kept)) = reads.next().await {
                let kept = kept?;
                if kept.is_none() {
                    return Ok(None);
                }
                all[index as usize] = kept;
            }
        }
        Ok(all.into_iter().collect())
    }

    /// Task `index`'s completion as kept, from what the read of the
    /// history on its `subject` found (or the newest usable one stored
    /// before that); `None` while the task has no usable completion.
    async fn kept_sibling(
        &self,
        subject: &str,
        read: Result<StreamMessage, LastRawMessageError>,
        permit: Option<tokio::sync::SemaphorePermit<'_>>,
        member: &Pending,
        index: u32,
        share: usize,
    ) -> Result<Option<Kept>, PlanError> {
        let message = match read {
            Ok(message) => message,
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                if self.older_than_history(&member.event) {
                    warn!(delegation_id = %member.event.delegation_id, task_index = index, "A batch task's completion is not in the history, and the batch was dispatched longer ago than the history keeps: if that task ended and its completion expired, this batch never wakes its session. See its completions with `wakebus events --delegation`.");
                }
                return Ok(None);
            }
            Err(error) => return Err(PlanError::History(error.to_string())),
        };
        let error = match sibling(&message, member, index) {
            Ok(done) => return Ok(Some(Kept::new(done, Some(message.sequence), share))),
            Err(error) => error,
        };
        // The walk below reads one message at a time, for as long as it
        // takes: it does not hold other sessions' batches back.
        let sequence = message.sequence;
        drop(message);
        drop(permit);
        // Garbage on the task's subject, or a completion the wake would
        // not admit for this task (dead-lettered when the wake met it): the
        // newest usable completion stored before it counts. With none, the
        // task has not ended as far as the batch can tell, and its real
        // completion, stored later, ends the batch.
        let before = self.usable_before(subject, sequence, member, index).await?;
        if before.is_none() {
            warn!(delegation_id = %member.event.delegation_id, task_index = index, error = %bounded(&error, 300), "A batch task's last stored completion cannot be used; the batch waits for a usable one.");
        }
        Ok(before.map(|(sequence, done)| Kept::new(done, Some(sequence), share)))
    }

    /// Whether `event`'s delegation was dispatched longer ago than the
    /// events stream keeps messages (so completions of it may have expired).
    fn older_than_history(&self, event: &CompletionEvent) -> bool {
        let max_age = self.shared.events.cached_info().config.max_age;
        match event.dispatched_at {
            Some(at) if !max_age.is_zero() => at < time::OffsetDateTime::now_utc() - max_age,
            _ => false,
        }
    }

    /// The newest completion of task `index` of `member`'s batch on
    /// `subject` stored before `sequence` that can be used ([`sibling`]),
    /// with its sequence.
    async fn usable_before(
        &self,
        subject: &str,
        sequence: u64,
        member: &Pending,
        index: u32,
    ) -> Result<Option<(u64, CompletionEvent)>, PlanError> {
        newest_before(&self.shared.events, subject, sequence, |message| {
            sibling(message, member, index).ok()
        })
        .await
        .map_err(PlanError::History)
    }
}

/// The newest message on `subject` stored before `sequence` that `usable`
/// makes something of, with its sequence, walking the subject's messages
/// from its first (usually one or two: a completion, a duplicate, garbage
/// stored after it), at most [`WALK_LIMIT`] of them. For a task whose last
/// stored completion cannot be used.
pub(crate) async fn newest_before<T>(
    events: &jetstream::stream::Stream,
    subject: &str,
    sequence: u64,
    usable: impl Fn(&StreamMessage) -> Option<T>,
) -> Result<Option<(u64, T)>, String> {
    let mut newest = None;
    let mut from = 1;
    for _ in 0..WALK_LIMIT {
        if from >= sequence {
            break;
        }
        let message = match events
            .raw_message_builder()
            .sequence(from)
            .next_by_subject(subject)
            .send()
            .await
        {
            Ok(message) => message,
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => break,
            Err(error) => return Err(error.to_string()),
        };
        if message.sequence >= sequence {
            break;
        }
        if let Some(found) = usable(&message) {
            newest = Some((message.sequence, found));
        }
        from = from.max(message.sequence) + 1;
    }
    Ok(newest)
}

/// At most the first `max` bytes of `text` (cut on a character
/// boundary), in an allocation of their own size.
fn prefix(text: &str, max: usize) -> String {
    let mut cut = max.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text[..cut].to_owned()
}

/// A stored completion of task `index` of `member`'s batch, if it is one
/// the wake would admit as that task's: a readable body whose ids, task
/// count and origin session (body and header) are the batch's (or the
/// `error` completion of the task's unreadable request, which could not
/// name the batch: `CompletionEvent::is_task_of`). Anything
/// else stored on the task's subject (a forged or mistaken publish, which
/// the wake dead-lettered when it met it) does not end the batch: counted,
/// it would wake the session before the task's real completion, whose
/// text would then never be posted.
fn sibling(
    message: &StreamMessage,
    member: &Pending,
    index: u32,
) -> Result<CompletionEvent, String> {
    let done = CompletionEvent::decode(&message.payload).map_err(|error| error.to_string())?;
    let batch = &member.event;
    if !done.is_task_of(&batch.delegation_id, index, batch.task_count) {
        return Err("its delegation id, task index or task count is not this task's".to_owned());
    }
    let session = Some(member.session.as_str());
    let header = message
        .headers
        .get(HEADER_ORIGIN_SESSION)
        .map(|value| value.as_str());
    if done.origin_session_id.as_deref() != session || header != session {
        return Err("it names another origin session, in its body or its header".to_owned());
    }
    let event_id = CompletionEvent::id_for(&done.delegation_id, index);
    if !done.event_id.is_empty() && done.event_id != event_id {
        return Err(format!("its event_id is not {event_id:?}"));
    }
    Ok(done)
}
