//! Re-driving what failed, and copying history elsewhere.
//!
//! Three kinds of replay, each reading the history through
//! [`HistoryReader`] and handling one record at a time
//! ([`Replayer::handle`] returns a [`ReplayItem`] saying what it did):
//!
//! * **Wakes** (from completions in `<PREFIX>_EVENTS`, or from wake dead
//!   letters in `<PREFIX>_DLQ`): the completion is published again on its own
//!   `done` subject, with a fresh `Nats-Msg-Id` and a `Wakebus-Replay`
//!   header, so the running wake service delivers it through its normal path
//!   (session lock, coalescing, retries and the ledger). Nothing here posts to
//!   the session API. A completion the ledger records as delivered is skipped,
//!   unless `force`, which first removes its ledger entry so that the wake
//!   service posts it again. A batch (several tasks, `wake_mode: batch`) is
//!   one wake: its ledger entry is `<delegation_id>.batch`, and one copy of
//!   any of its completions makes the wake service post the consolidated
//!   turn again (it reads the other completions from the history).
//!   Completions cancelled silently (`suppress_wake`) and sync-mode ones
//!   are skipped: nobody is to be woken.
//!   A forced copy of a delivered wake also carries
//!   [`HEADER_FORCED_REPLAY`]: the wake service then posts it alone under
//!   the Idempotency-Key `<usual key>.replay.<ULID>` ([`forced_idempotency_key`]),
//!   since a session API that honours the usual key would drop the post as
//!   a repeat; the ledger records the key it was delivered under.
//! * **Tasks** (dead-lettered requests): the request is published again to
//!   its pool under a **derived delegation id** `<id>-r<dead-letter
//!   sequence>`. Under its original id the re-run could not wake anyone: its
//!   completion would be dropped as a duplicate by JetStream or acknowledged
//!   unposted by the wake ledger, which already records the original's
//!   failure as delivered. The derived id is deterministic, so a request
//!   already re-queued (a started or done event exists for the derived id)
//!   is skipped unless `force`, which re-queues under a fresh ULID instead.
//!   A member of a batch is re-queued with `wake_mode: independent`, since
//!   under its new id it has no siblings to wait for.
//! * **Copy**: messages are published, unchanged but for a `Wakebus-Replay`
//!   header, under another prefix or to one subject (to rebuild a downstream
//!   consumer or reproduce an incident in a test deployment).
//!
//! A replay stops between two records when cancelled (Ctrl-C), never in the
//! middle of one.

use std::collections::HashSet;

use async_nats::HeaderMap;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::bus::{Bus, PublishError};
use crate::history::{HistoryError, HistoryReader, Record, RecordKind, Selection, Source};
use crate::protocol::{
    CompletionEvent, EventKind, HEADER_CE_ID, HEADER_DEAD_LETTER_REASON, HEADER_DELEGATION_ID,
    HEADER_MSG_ID, HEADER_REPLAY, Subjects, TaskRequest, WakeMode, new_delegation_id,
    session_token,
};
use crate::wake::ledger::{LedgerError, LedgerState, WakeLedger};
use crate::wake::{Admission, check_completion};

/// On a `replay wakes --force` copy of a delivered completion: the copy's
/// ULID (the one in its `Nats-Msg-Id`). The wake service posts such a copy
/// alone, under [`forced_idempotency_key`].
pub const HEADER_FORCED_REPLAY: &str = "Wakebus-Forced-Replay";

/// The Idempotency-Key of a forced re-post: `<base>.replay.<ULID>`, `base`
/// being the key the post would otherwise carry (`<delegation_id>.<task_index>.done`,
/// or `<delegation_id>.batch` for a batch), if `headers` mark a forced copy
/// with a valid ULID. Only a ULID is taken from the header, so the key can
/// never be another completion's.
pub fn forced_idempotency_key(base: &str, headers: Option<&HeaderMap>) -> Option<String> {
    let value = headers?.get(HEADER_FORCED_REPLAY)?.as_str();
    let id = ulid::Ulid::from_string(value).ok()?;
    Some(format!("{base}.replay.{id}"))
}

/// What to replay.
#[derive(Debug, Clone)]
pub enum ReplayKind {
    /// Re-drive the wakes of completions in the events history.
    Wakes,
    /// Re-drive the wakes of dead-lettered completions.
    WakeDeadLetters,
    /// Re-queue dead-lettered task requests.
    Tasks,
    /// Copy history from `source` to `target`.
    Copy {
        /// Which stream to copy from.
        source: Source,
        /// Where the copies go.
        target: CopyTarget,
    },
}

/// Where `Copy` publishes.
#[derive(Debug, Clone)]
pub enum CopyTarget {
    /// The same subject under another deployment prefix.
    Prefix(Subjects),
    /// One subject for everything.
    Subject(String),
}

/// A replay to run.
#[derive(Debug, Clone)]
pub struct ReplayPlan {
    /// What to replay.
    pub kind: ReplayKind,
    /// Which records.
    pub selection: Selection,
    /// Replay even what was already delivered or re-queued.
    pub force: bool,
    /// Only report what would be done.
    pub dry_run: bool,
}

impl ReplayPlan {
    /// The history source the plan reads.
    pub fn source(&self) -> Source {
        match &self.kind {
            ReplayKind::Wakes => Source::Events,
            ReplayKind::WakeDeadLetters => Source::WakeDeadLetters,
            ReplayKind::Tasks => Source::TaskDeadLetters,
            ReplayKind::Copy { source, .. } => *source,
        }
    }

    /// The selection as read: wakes only ever read completions.
    fn effective_selection(&self) -> Selection {
        let mut selection = self.selection.clone();
        if matches!(self.kind, ReplayKind::Wakes) {
            selection.kind = Some(EventKind::Done);
        }
        selection
    }
}

/// What was done with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Published again.
    Replayed,
    /// Would be published again (dry run).
    WouldReplay,
    /// Left alone; `reason` says why.
    Skipped,
}

/// The outcome of one record.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayItem {
    /// What was done.
    pub action: Action,
    /// Why it was skipped, or a note on what was done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The original, `<stream>:<sequence>`.
    pub source: String,
    /// The original's subject.
    pub subject: String,
    /// The original's delegation id.
    pub delegation_id: Option<String>,
    /// The original's task index.
    pub task_index: Option<u32>,
    /// The origin session, if any.
    pub origin_session: Option<String>,
    /// Where the copy was (or would be) published.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_subject: Option<String>,
    /// The delegation id a re-queued task runs under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_delegation_id: Option<String>,
    /// Whether a delivered ledger entry was (or would be) removed (`force`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub ledger_cleared: bool,
    /// The Idempotency-Key a forced re-post is delivered under (a new one,
    /// so that a session API honouring the first does not drop it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl ReplayItem {
    fn for_record(record: &Record) -> Self {
        Self {
            action: Action::Skipped,
            reason: None,
            source: record.origin_ref(),
            subject: record.subject.clone(),
            delegation_id: record.delegation_id(),
            task_index: record.task_index(),
            origin_session: record.origin_session().map(str::to_owned),
            target_subject: None,
            new_delegation_id: None,
            ledger_cleared: false,
            idempotency_key: None,
        }
    }

    fn skipped(mut self, reason: impl Into<String>) -> Self {
        self.action = Action::Skipped;
        self.reason = Some(reason.into());
        self
    }
}

/// Totals of a replay run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Records read that matched the selection.
    pub selected: u64,
    /// Records published again.
    pub replayed: u64,
    /// Records that would be published again (dry run).
    pub would_replay: u64,
    /// Records left alone.
    pub skipped: u64,
    /// Whether the run was cancelled before the end.
    pub interrupted: bool,
}

impl Summary {
    fn count(&mut self, item: &ReplayItem) {
        self.selected += 1;
        match item.action {
            Action::Replayed => self.replayed += 1,
            Action::WouldReplay => self.would_replay += 1,
            Action::Skipped => self.skipped += 1,
        }
    }
}

/// Why a replay stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The history could not be read.
    #[error(transparent)]
    History(#[from] HistoryError),
    /// The wake ledger could not be opened.
    #[error(
        "cannot open the wake ledger {bucket} (has the wake service of this deployment ever run?): {source}"
    )]
    OpenLedger {
        /// The bucket.
        bucket: String,
        /// The JetStream error.
        source: async_nats::jetstream::context::KeyValueError,
    },
    /// The wake ledger could not be read or written.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// A copy could not be published; the replay stops there.
    #[error("cannot publish to {subject}: {source}")]
    Publish {
        /// The subject.
        subject: String,
        /// The publish error.
        source: PublishError,
    },
    /// The copy target is the deployment being read.
    #[error(
        "the target prefix is this deployment's own prefix; to re-drive wakes use `replay wakes`"
    )]
    SamePrefix,
}

/// Handles records one at a time for a plan.
#[derive(Debug)]
pub struct Replayer {
    /// The deployment read and written.
    bus: Bus,
    /// What to do.
    plan: ReplayPlan,
    /// The wake ledger (wakes only).
    ledger: Option<WakeLedger>,
    /// The events stream, to find earlier re-queues (tasks only).
    events: Option<async_nats::jetstream::stream::Stream>,
    /// Tasks already handled in this run: the history holds earlier replay
    /// copies of the same completion, and one wake per task is enough.
    seen: HashSet<String>,
}

impl Replayer {
    /// Prepares a replay of `plan` on `bus`.
    pub async fn new(bus: Bus, plan: ReplayPlan) -> Result<Self, ReplayError> {
        plan.effective_selection().validate(plan.source())?;
        let mut ledger = None;
        let mut events = None;
        match &plan.kind {
            ReplayKind::Wakes | ReplayKind::WakeDeadLetters => {
                let bucket = bus.subjects.wake_ledger_bucket();
                let kv = bus
                    .js
                    .get_key_value(&bucket)
                    .await
                    .map_err(|source| ReplayError::OpenLedger { bucket, source })?;
                ledger = Some(WakeLedger::new(kv));
            }
            ReplayKind::Tasks => {
                let name = bus.subjects.events_stream();
                events = Some(bus.js.get_stream(&name).await.map_err(|source| {
                    HistoryError::Stream {
                        stream: name.clone(),
                        source,
                    }
                })?);
            }
            ReplayKind::Copy {
                target: CopyTarget::Prefix(target),
                ..
            } if target.prefix() == bus.subjects.prefix() => {
                return Err(ReplayError::SamePrefix);
            }
            ReplayKind::Copy { .. } => {}
        }
        Ok(Self {
            bus,
            plan,
            ledger,
            events,
            seen: HashSet::new(),
        })
    }

    /// Opens the history read the plan needs.
    pub async fn open(&self) -> Result<HistoryReader, ReplayError> {
        Ok(HistoryReader::open(
            &self.bus,
            self.plan.source(),
            self.plan.effective_selection(),
            false,
        )
        .await?)
    }

    /// Handles one record.
    pub async fn handle(&mut self, record: &Record) -> Result<ReplayItem, ReplayError> {
        match &self.plan.kind {
            ReplayKind::Wakes | ReplayKind::WakeDeadLetters => self.redrive_wake(record).await,
            ReplayKind::Tasks => self.requeue_task(record).await,
            ReplayKind::Copy { target, .. } => {
                let target = target.clone();
                self.copy(record, &target).await
            }
        }
    }

    async fn redrive_wake(&mut self, record: &Record) -> Result<ReplayItem, ReplayError> {
        let item = ReplayItem::for_record(record);
        if !matches!(record.kind(), RecordKind::Done | RecordKind::WakeDeadLetter) {
            return Ok(item.skipped("not a completion"));
        }
        // The wake service's own admission rules: a copy it would only
        // dead-letter again (a wake dead letter of `dlq.wake.poison` is
        // exactly such a completion) is not published.
        let (event, session) = match check_completion(&record.payload, record.origin_session()) {
            Ok(admitted) => admitted,
            Err(Admission::NothingToWake) => {
                let sync = CompletionEvent::decode(&record.payload)
                    .is_ok_and(|event| event.origin_session_id.is_none());
                return Ok(item.skipped(if sync {
                    "sync mode: there is no session to wake"
                } else {
                    "cancelled silently: nobody is to be woken"
                }));
            }
            Err(Admission::Poison(reason)) => {
                return Ok(item.skipped(format!(
                    "the wake service cannot use it ({reason}); it stays where it is"
                )));
            }
        };
        // A batch wakes once for all its tasks: one copy of any member
        // makes the wake service post the consolidated turn again.
        let batch = event.task_count > 1 && event.wake_mode == WakeMode::Batch;
        let key = if batch {
            WakeLedger::batch_key(&event.delegation_id)
        } else {
            WakeLedger::key(&event.delegation_id, event.task_index)
        };
        if !self.seen.insert(key.clone()) {
            return Ok(item.skipped(if batch {
                "another completion of this batch was already handled"
            } else {
                "an earlier copy of this completion was already handled"
            }));
        }
        let ledger = self.ledger.as_ref().expect("wake replays open the ledger");
        let delivered = match ledger.get(&key).await? {
            Some(LedgerState::Delivered { at, .. }) => Some(at),
            _ => None,
        };
        let mut item = item;
        if let Some(at) = delivered {
            if !self.plan.force {
                return Ok(item.skipped(format!(
                    "already delivered at {} (use --force to post it again)",
                    crate::history::rfc3339(at)
                )));
            }
            item.ledger_cleared = true;
        }
        let subject = self.bus.subjects.event(
            &session_token(&session),
            &event.delegation_id,
            event.task_index,
            EventKind::Done,
        );
        item.target_subject = Some(subject.clone());
        if self.plan.dry_run {
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        if item.ledger_cleared {
            ledger.forget(&key).await?;
        }
        let mut headers = replay_headers(record);
        let event_id = CompletionEvent::id_for(&event.delegation_id, event.task_index);
        let copy = ulid::Ulid::new().to_string();
        let msg_id = format!("{event_id}.replay.{copy}");
        headers.insert(HEADER_MSG_ID, msg_id.as_str());
        if self.plan.force {
            // Posted before (or by an earlier forced replay that cleared
            // the ledger and then failed): the usual key would be a repeat
            // to the session API.
            headers.insert(HEADER_FORCED_REPLAY, copy.as_str());
            let base = if batch {
                key.as_str()
            } else {
                event_id.as_str()
            };
            item.idempotency_key = forced_idempotency_key(base, Some(&headers));
        }
        self.publish(subject, headers, record.payload.clone())
            .await?;
        item.action = Action::Replayed;
        Ok(item)
    }

    async fn requeue_task(&mut self, record: &Record) -> Result<ReplayItem, ReplayError> {
        let mut item = ReplayItem::for_record(record);
        let Some(pool) = record.pool().map(str::to_owned) else {
            return Ok(item.skipped("not a task dead letter"));
        };
        let request = TaskRequest::decode(&record.payload).and_then(|request| {
            request
                .check_origin_header(record.origin_session())
                .map(|()| request)
        });
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return Ok(item.skipped(format!("the request cannot run again: {error}")));
            }
        };
        let new_id = if self.plan.force {
            new_delegation_id()
        } else {
            derived_delegation_id(&request.delegation_id, record.sequence)
        };
        item.new_delegation_id = Some(new_id.clone());
        let subject = self.bus.subjects.task(&pool);
        item.target_subject = Some(subject.clone());
        let earlier = if self.plan.force {
            Requeued::No
        } else {
            self.requeued(&request, &new_id).await
        };
        match earlier {
            Requeued::No | Requeued::RecordOnly => {}
            Requeued::Yes => {
                return Ok(item.skipped(format!(
                    "already re-queued as delegation {new_id} (use --force to run it once more)"
                )));
            }
            Requeued::Unknown(error) => {
                return Ok(item.skipped(format!(
                    "cannot tell whether delegation {new_id} is queued: {error}"
                )));
            }
        }
        if self.plan.dry_run {
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        // Edit the JSON rather than re-encode the request, so that fields
        // this version does not know survive.
        let mut body: serde_json::Value =
            serde_json::from_slice(&record.payload).unwrap_or_default();
        body["delegation_id"] = serde_json::Value::from(new_id.as_str());
        if request.task_count > 1 {
            // Alone under its new id: a batch would wait for siblings that
            // will never run.
            body["wake_mode"] = serde_json::Value::from("independent");
        }
        let payload = encode(&subject, &body)?;
        let mut headers = replay_headers(record);
        set_ids(&mut headers, &format!("{new_id}.{}", request.task_index));
        headers.insert(HEADER_DELEGATION_ID, new_id.as_str());
        // After a re-queue whose task write failed, the record is there:
        // only the task is sent (under the same Nats-Msg-Id).
        if !matches!(earlier, Requeued::RecordOnly) {
            self.publish_submitted(&request, &new_id, &pool, &headers)
                .await?;
        }
        self.publish(subject, headers, payload).await?;
        item.action = Action::Replayed;
        Ok(item)
    }

    /// How far an earlier re-queue of the derived delegation got. Its
    /// `submitted` record is written before the task, so a record alone
    /// means either a task still in the queue (or in its first second of
    /// running, before its started event) or a task write that failed.
    async fn requeued(&self, request: &TaskRequest, new_id: &str) -> Requeued {
        let events = self
            .events
            .as_ref()
            .expect("task replays open the events stream");
        let token = crate::worker::token_for(request.origin_session_id.as_deref());
        // Whether an event of `kind` exists; a failed read is no answer.
        let has = |kind| {
            let subject = self
                .bus
                .subjects
                .event(&token, new_id, request.task_index, kind);
            async move {
                match events.get_last_raw_message_by_subject(&subject).await {
                    Ok(_) => Ok(true),
                    Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                        Ok(false)
                    }
                    Err(error) => Err(error.to_string()),
                }
            }
        };
        let answer = async {
            if has(EventKind::Done).await? || has(EventKind::Started).await? {
                return Ok(Requeued::Yes);
            }
            if !has(EventKind::Submitted).await? {
                return Ok(Requeued::No);
            }
            match self.bus.find_queued(new_id).await {
                Ok(Some(true)) => Ok(Requeued::Yes),
                Ok(Some(false)) => Ok(Requeued::RecordOnly),
                Ok(None) => Err(
                    "the task queue is longer than this check reads; try again when it is shorter"
                        .to_owned(),
                ),
                Err(error) => Err(error.to_string()),
            }
        };
        answer.await.unwrap_or_else(Requeued::Unknown)
    }

    async fn copy(
        &mut self,
        record: &Record,
        target: &CopyTarget,
    ) -> Result<ReplayItem, ReplayError> {
        let mut item = ReplayItem::for_record(record);
        let subject = match target {
            CopyTarget::Prefix(subjects) => {
                format!("{}.{}", subjects.prefix(), record.local_subject)
            }
            CopyTarget::Subject(subject) => subject.clone(),
        };
        item.target_subject = Some(subject.clone());
        if self.plan.dry_run {
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        let mut headers = record.headers.clone();
        headers.insert(HEADER_REPLAY, record.origin_ref().as_str());
        self.publish(subject, headers, record.payload.clone())
            .await?;
        item.action = Action::Replayed;
        Ok(item)
    }

    /// Writes the re-queued task's `submitted` record, which a wake that
    /// verifies origins requires of its completion (docs/PROTOCOL.md, 5.6).
    async fn publish_submitted(
        &self,
        request: &TaskRequest,
        new_id: &str,
        pool: &str,
        request_headers: &HeaderMap,
    ) -> Result<(), ReplayError> {
        let mut requeued = request.clone();
        requeued.delegation_id = new_id.to_owned();
        let token = crate::worker::token_for(request.origin_session_id.as_deref());
        let subject = self
            .bus
            .subjects
            .submitted(&token, new_id, request.task_index);
        let body = crate::protocol::SubmittedRecord::for_request(&requeued, pool, None);
        let payload = encode(&subject, &body)?;
        let mut headers = request_headers.clone();
        set_ids(
            &mut headers,
            &crate::protocol::SubmittedRecord::id_for(new_id, request.task_index),
        );
        headers.insert(
            crate::protocol::HEADER_CE_TYPE,
            crate::protocol::EventKind::Submitted.ce_type(),
        );
        self.publish(subject, headers, payload).await
    }

    async fn publish(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<(), ReplayError> {
        let stored = async {
            self.bus
                .js
                .publish_with_headers(subject.clone(), headers, payload)
                .await?
                .await?;
            Ok::<_, async_nats::jetstream::context::PublishError>(())
        };
        stored.await.map_err(|source| ReplayError::Publish {
            subject,
            source: PublishError::Publish(source),
        })
    }
}

/// How far an earlier re-queue of a dead letter got.
enum Requeued {
    /// Never re-queued.
    No,
    /// Its `submitted` record is stored but its task is neither queued nor
    /// run: the task write failed.
    RecordOnly,
    /// Queued, running or done.
    Yes,
    /// The queue could not be read.
    Unknown(String),
}

/// `body` as JSON, or the error a replay to `subject` reports.
fn encode(subject: &str, body: &impl serde::Serialize) -> Result<bytes::Bytes, ReplayError> {
    serde_json::to_vec(body)
        .map(bytes::Bytes::from)
        .map_err(|error| ReplayError::Publish {
            subject: subject.to_owned(),
            source: PublishError::Encode(error),
        })
}

/// Gives a re-queued message its id, as both `Nats-Msg-Id` (deduplication)
/// and `ce-id`.
fn set_ids(headers: &mut HeaderMap, id: &str) {
    headers.insert(HEADER_MSG_ID, id);
    headers.insert(HEADER_CE_ID, id);
}

/// The original's headers without the dead-letter reason (nor an earlier
/// replay's marks), plus `Wakebus-Replay: <stream>:<sequence>`.
fn replay_headers(record: &Record) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in record.headers.iter() {
        let name: &str = name.as_ref();
        if [
            HEADER_DEAD_LETTER_REASON,
            HEADER_REPLAY,
            HEADER_FORCED_REPLAY,
        ]
        .contains(&name)
        {
            continue;
        }
        for value in values {
            headers.append(name, value.as_str());
        }
    }
    headers.insert(HEADER_REPLAY, record.origin_ref().as_str());
    headers
}

/// The delegation id a dead-lettered task is re-queued under:
/// `<original>-r<dead-letter sequence>`, or, when that would exceed the
/// 64-character limit, the first 32 hex digits of the original's SHA-256
/// instead of the original.
pub fn derived_delegation_id(original: &str, dead_letter_sequence: u64) -> String {
    let suffix = format!("-r{dead_letter_sequence}");
    if original.len() + suffix.len() <= 64 {
        format!("{original}{suffix}")
    } else {
        let digest = Sha256::digest(original.as_bytes());
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{hex}{suffix}")
    }
}

/// Progress of a run, for display.
#[derive(Debug)]
pub enum Progress<'a> {
    /// The read is open; about this many records match the subject filter.
    Opened {
        /// The estimate.
        total: u64,
    },
    /// One record was handled.
    Item(&'a ReplayItem),
}

/// Runs `replayer` over its history until the end or `cancel`.
pub async fn run(
    mut replayer: Replayer,
    cancel: CancellationToken,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<Summary, ReplayError> {
    let mut reader = replayer.open().await?;
    progress(Progress::Opened {
        total: reader.estimated_total(),
    });
    let mut summary = Summary::default();
    let result = async {
        loop {
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    summary.interrupted = true;
                    return Ok(());
                }
                next = reader.next() => next,
            };
            let Some(record) = next else {
                return Ok(());
            };
            // Not raced against `cancel`: a record being handled is
            // finished (and reported) before the run stops.
            let item = replayer.handle(&record?).await?;
            summary.count(&item);
            progress(Progress::Item(&item));
        }
    }
    .await;
    // Stopped early or not, leave no consumer behind.
    reader.close().await;
    result.map(|()| summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::validate_delegation_id;

    #[test]
    fn a_forced_key_takes_only_a_ulid_from_the_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(forced_idempotency_key("d.0.done", Some(&headers)), None);
        headers.insert(HEADER_FORCED_REPLAY, "01JV3N4Y8K6D2Q7R9T1W5X0ZAB");
        assert_eq!(
            forced_idempotency_key("d.0.done", Some(&headers)).as_deref(),
            Some("d.0.done.replay.01JV3N4Y8K6D2Q7R9T1W5X0ZAB")
        );
        headers.insert(HEADER_FORCED_REPLAY, "other.0.done");
        assert_eq!(forced_idempotency_key("d.0.done", Some(&headers)), None);
        assert_eq!(forced_idempotency_key("d.0.done", None), None);
    }

    #[test]
    fn derived_ids_are_valid_deterministic_and_distinct_per_dead_letter() {
        let id = derived_delegation_id("01JV3N4Y8K6D2Q7R9T1W5X0ZAB", 17);
        assert_eq!(id, "01JV3N4Y8K6D2Q7R9T1W5X0ZAB-r17");
        assert_ne!(id, derived_delegation_id("01JV3N4Y8K6D2Q7R9T1W5X0ZAB", 18));
        let long = "x".repeat(64);
        let derived = derived_delegation_id(&long, u64::MAX);
        assert!(validate_delegation_id(&derived).is_ok(), "{derived}");
        assert_eq!(derived, derived_delegation_id(&long, u64::MAX));
    }
}
