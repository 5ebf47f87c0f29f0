//! A batch's one turn: every task's completion, read from the history
//! (those in hand as they are), fitted into a turn of bounded size.
//!
//! A batch may have up to 1,000 tasks, each with a result near the max
//! payload: read whole, its turn could be a gigabyte, held in memory and
//! posted as one user message. So the results share at most the server's
//! max payload between them, less what the goals and errors take: each
//! is cut at the same length, the longest at which they all fit, so a
//! short result is never cut to make room and long ones get what the short
//! ones leave. Goals are cut to [`GOAL_MAX`] (the session wrote them) and
//! errors to [`ERROR_MAX`]. The results are read in two passes, to keep
//! memory near the turn's size: the first keeps of each result its even
//! share of the budget and its length, the second reads again only those
//! allowed more than that.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use tracing::{info, warn};

use super::plan::PlanError;
use super::{Pending, Router};
use crate::protocol::{CompletionEvent, EventKind, HEADER_ORIGIN_SESSION, bounded, session_token};
use crate::wake::turn;

/// The most of a goal a batch turn repeats.
const GOAL_MAX: usize = 1024;

/// The most of an error a batch turn gives (a command's stderr tail, which
/// errors quote, is 4 KiB).
const ERROR_MAX: usize = 4096;

/// What one task's lines take in a batch turn besides its goal, error and
/// result.
const TASK_LINES: usize = 64;

/// Most messages [`Router::usable_before`] reads on one subject: a task's
/// `done` subject holds one or two, unless someone floods it.
const WALK_LIMIT: usize = 64;

/// A batch's turn, once every task has a usable completion.
pub(super) struct BatchTurn {
    /// The turn's text.
    pub(super) text: String,
    /// How many tasks it reports.
    pub(super) tasks: u32,
}

/// One task's completion as the first pass keeps it.
struct Kept {
    /// The completion: its goal and error cut, its result to at most the
    /// first pass's share.
    event: CompletionEvent,
    /// The result's whole length in bytes.
    whole: usize,
    /// Where it is stored, to read it again; `None` for one in hand.
    sequence: Option<u64>,
}

impl Kept {
    /// Keeps `event`, whose result is cut to `share` bytes for now.
    fn new(mut event: CompletionEvent, sequence: Option<u64>, share: usize) -> Self {
        event.goal = bounded(&event.goal, GOAL_MAX);
        event.error = event.error.map(|error| bounded(&error, ERROR_MAX));
        let whole = event.summary.as_ref().map_or(0, String::len);
        if let Some(summary) = event.summary.as_mut() {
            summary.truncate(floor_boundary(summary, share));
        }
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
        let budget = self.shared.bus.max_payload();
        let first = budget / tasks.max(1) as usize;
        let Some(kept) = self.batch_completions(members, first).await? else {
            return Ok(None);
        };
        let lines: usize = kept.iter().map(Kept::lines).sum();
        let lengths: Vec<usize> = kept.iter().map(|k| k.whole).collect();
        let share = turn::result_share(&lengths, budget.saturating_sub(lines));
        let mut cut = 0;
        let mut events = Vec::with_capacity(kept.len());
        for k in kept {
            let allowed = share.map_or(k.whole, |share| share.min(k.whole));
            let mut event = k.event;
            let have = event.summary.as_ref().map_or(0, String::len);
            if allowed > have
                && let Some(whole) = self.read_again(members, k.sequence, event.task_index).await
            {
                event.summary = whole.summary;
            }
            if let Some(summary) = event.summary.as_mut()
                && k.whole > allowed
            {
                summary.truncate(floor_boundary(summary, allowed));
                summary.push_str(&format!("… [{} bytes cut]", k.whole - summary.len()));
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
    /// `members` when in hand, else at `sequence`. `None` if it cannot be:
    /// the turn then gives what the first pass kept.
    async fn read_again(
        &self,
        members: &[&Pending],
        sequence: Option<u64>,
        index: u32,
    ) -> Option<CompletionEvent> {
        let Some(sequence) = sequence else {
            let held = members.iter().find(|p| p.event.task_index == index)?;
            return Some(held.event.clone());
        };
        let read = self
            .shared
            .events
            .raw_message_builder()
            .sequence(sequence)
            .send()
            .await;
        match read.map(|message| sibling(&message, members[0], index)) {
            Ok(Ok(done)) => Some(done),
            Ok(Err(error)) => {
                warn!(task_index = index, sequence, %error, "A batch task's completion read again cannot be used; its turn gives it cut.");
                None
            }
            Err(error) => {
                warn!(task_index = index, sequence, %error, "A batch task's completion could not be read again; its turn gives it cut.");
                None
            }
        }
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
        for index in (0..member.event.task_count).rev() {
            let slot = &mut all[index as usize];
            if let Some(held) = members.iter().find(|p| p.event.task_index == index) {
                *slot = Some(Kept::new(held.event.clone(), None, share));
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
                Ok(message) => match sibling(&message, member, index) {
                    Ok(done) => *slot = Some(Kept::new(done, Some(message.sequence), share)),
                    Err(error) => {
                        // Garbage on the task's subject, or a completion the
                        // wake would not admit for this task (dead-lettered
                        // when the wake met it): the newest usable
                        // completion stored before it counts. With none, the
                        // task has not ended as far as the batch can tell,
                        // and its real completion, stored later, ends the
                        // batch.
                        match self
                            .usable_before(&subject, message.sequence, member, index)
                            .await?
                        {
                            Some((sequence, done)) => {
                                *slot = Some(Kept::new(done, Some(sequence), share));
                            }
                            None => {
                                warn!(delegation_id = %member.event.delegation_id, task_index = index, %error, "A batch task's last stored completion cannot be used; the batch waits for a usable one.");
                                return Ok(None);
                            }
                        }
                    }
                },
                Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    if self.older_than_history(&member.event) {
                        warn!(delegation_id = %member.event.delegation_id, task_index = index, "A batch task's completion is not in the history, and the batch was dispatched longer ago than the history keeps: if that task ended and its completion expired, this batch never wakes its session. See its completions with `wakebus events --delegation`.");
                    }
                    return Ok(None);
                }
                Err(error) => return Err(PlanError::History(error.to_string())),
            }
        }
        Ok(all.into_iter().collect())
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
    /// with its sequence, walking the subject's messages from its first
    /// (usually one or two: a completion, a duplicate, garbage), at most
    /// [`WALK_LIMIT`] of them.
    async fn usable_before(
        &self,
        subject: &str,
        sequence: u64,
        member: &Pending,
        index: u32,
    ) -> Result<Option<(u64, CompletionEvent)>, PlanError> {
        let mut newest = None;
        let mut from = 1;
        for _ in 0..WALK_LIMIT {
            if from >= sequence {
                break;
            }
            let message = match self
                .shared
                .events
                .raw_message_builder()
                .sequence(from)
                .next_by_subject(subject)
                .send()
                .await
            {
                Ok(message) => message,
                Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                Err(error) => return Err(PlanError::History(error.to_string())),
            };
            if message.sequence >= sequence {
                break;
            }
            if let Ok(done) = sibling(&message, member, index) {
                newest = Some((message.sequence, done));
            }
            from = from.max(message.sequence) + 1;
        }
        Ok(newest)
    }
}

/// The largest length up to `max` at which `text` can be cut: on a
/// character boundary.
fn floor_boundary(text: &str, max: usize) -> usize {
    let mut cut = max.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

/// A stored completion of task `index` of `member`'s batch, if it is one
/// the wake would admit as that task's: a readable body whose ids, task
/// count and origin session (body and header) are the batch's. Anything
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
    if done.delegation_id != batch.delegation_id
        || done.task_index != index
        || done.task_count != batch.task_count
    {
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
