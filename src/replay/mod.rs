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
//!   unless `force`, which first records a new Idempotency-Key in its
//!   ledger entry (`posting`) so that the wake service posts it again under
//!   that key. A batch (several tasks, `wake_mode: batch`) is
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
//!   its pool under a **derived delegation id** `<id>-rt<task index>`
//!   (every dead letter of one task gets the same). Under its original id the re-run could not wake anyone: its
//!   completion would be dropped as a duplicate by JetStream or acknowledged
//!   unposted by the wake ledger, which already records the original's
//!   failure as delivered. The derived id is deterministic, so a request
//!   already re-queued (a started or done event exists for the derived id)
//!   is skipped unless `force`, which re-queues under a fresh ULID instead.
//!   A member of a batch is re-queued with `wake_mode: independent`, since
//!   under its new id it has no siblings to wait for.
//! * **Copy**: messages are published, unchanged but for a `Wakebus-Replay`
//!   header and without the `Nats-*` headers the server acts on (but
//!   `Nats-Msg-Id`), under another prefix or to one subject (to rebuild a
//!   downstream consumer or reproduce an incident in a test deployment).
//!
//! A replay stops between two records when cancelled (Ctrl-C), never in the
//! middle of one. A forced replay of wake dead letters reads them twice:
//! first for the completions given up after 409s, whose every dead letter
//! it then leaves alone.
//!
//! `mod.rs` (this file) holds the plan, the items and summary, the copy and
//! the loop ([`run`]); `wakes.rs` re-drives wakes, `tasks.rs` re-queues
//! tasks.

mod tasks;
mod wakes;

pub use tasks::derived_delegation_id;
pub use wakes::{HEADER_FORCED_REPLAY, forced_idempotency_key, is_forced_key_of};

use std::collections::{HashMap, HashSet};

use async_nats::HeaderMap;
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::publish::PublishAck;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::bus::{Bus, PublishError};
use crate::history::{HistoryError, HistoryReader, Record, Selection, Source};
use crate::protocol::{
    EventKind, HEADER_CE_ID, HEADER_DEAD_LETTER_REASON, HEADER_MSG_ID, HEADER_REPLAY, Subjects,
    is_server_directive,
};
use crate::wake::ledger::{LedgerError, WakeLedger};

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
    /// Replay even what was already delivered or re-queued, or what is
    /// older than the traces of an earlier replay.
    pub force: bool,
    /// What `replay tasks` re-queues besides the usual (other replays
    /// ignore it).
    pub tasks: TaskOptions,
    /// Only report what would be done.
    pub dry_run: bool,
}

/// Dead-lettered tasks `replay tasks` leaves alone unless told otherwise
/// (`force` does not re-queue them).
#[derive(Debug, Clone, Copy, Default)]
pub struct TaskOptions {
    /// Re-queue tasks whose delegation or session was cancelled too.
    pub include_cancelled: bool,
    /// Re-queue sync-mode tasks too, whose caller had the failure and
    /// whose re-run's result reaches nobody.
    pub include_sync: bool,
    /// Re-queue once more a task that was itself re-queued by a replay and
    /// failed again: without it, running the same replay again does not
    /// start another generation of re-runs of a task that keeps failing.
    pub include_requeued: bool,
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

    /// Refuses a plan [`Replayer::new`] would refuse for the deployment of
    /// `own`, without a connection, so that a caller can report a mistake
    /// before it connects: a bad selection, or a copy target the
    /// deployment's own streams or services would take.
    pub fn check(&self, own: &Subjects) -> Result<(), ReplayError> {
        // Wakes re-drive completions only: any other kind asked for would
        // be read as `done` and, with `--force`, wake every completion of
        // the selection.
        if matches!(self.kind, ReplayKind::Wakes)
            && let Some(kind) = self.selection.kind.filter(|kind| *kind != EventKind::Done)
        {
            return Err(ReplayError::History(HistoryError::Selection(format!(
                "replay wakes re-drives completions only (--kind done), not {} events",
                kind.as_str()
            ))));
        }
        self.effective_selection().validate(self.source())?;
        match &self.kind {
            // Its own prefix, or one its streams capture (`wakebus.task`,
            // `wakebus.evt.x`): copies would land in its task queue or its
            // history. (`wakebus.staging` is another deployment's.)
            ReplayKind::Copy {
                target: CopyTarget::Prefix(target),
                ..
            } if captured_by(target.prefix(), own.prefix()) => Err(ReplayError::SamePrefix),
            // A subject under the deployment's own prefix is one its
            // workers or wake read: copies there would run as tasks or
            // wake sessions.
            ReplayKind::Copy {
                target: CopyTarget::Subject(subject),
                ..
            } if is_under(subject, own.prefix()) && subject != own.prefix() => {
                Err(ReplayError::SamePrefix)
            }
            _ => Ok(()),
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
    /// Whether a ledger entry was (or would be) replaced by the forced
    /// post's record (`force`): one that says delivered, or one whose post
    /// was refused or is in doubt.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub ledger_cleared: bool,
    /// The Idempotency-Key a forced re-post is delivered under (a new one,
    /// so that a session API honouring the first does not drop it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Skipped because what decides it could not be read (a leader
    /// election, a refused read), not because it needs nothing, or (a
    /// forced wake) recorded but its copy perhaps not published: a later
    /// run may send it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unchecked: bool,
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
            unchecked: false,
        }
    }

    fn skipped(mut self, reason: impl Into<String>) -> Self {
        self.action = Action::Skipped;
        self.reason = Some(reason.into());
        self
    }

    /// Skipped for now: what decides it could not be read.
    fn unchecked(mut self, reason: impl Into<String>) -> Self {
        self.unchecked = true;
        self.skipped(reason)
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
    /// Of those, the ones left alone only because what decides them could
    /// not be read: run the replay again for them.
    pub unchecked: u64,
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
        if item.unchecked {
            self.unchecked += 1;
        }
    }
}

/// A replay that stopped with an error, with what it had done by then
/// (reported too: a script reading the summary learns what was replayed
/// and what was not checked).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct ReplayFailed {
    /// The totals up to the error.
    pub summary: Summary,
    /// Why it stopped.
    #[source]
    pub error: ReplayError,
}

/// Why a replay stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The history could not be read.
    #[error(transparent)]
    History(#[from] HistoryError),
    /// The wake ledger could not be opened.
    #[error("cannot open the wake ledger {bucket} ({hint}): {source}")]
    OpenLedger {
        /// The bucket.
        bucket: String,
        /// What to look at: whether the wake ever ran, when the bucket
        /// does not exist; the server and the user's permissions otherwise.
        hint: &'static str,
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
    /// The copy target is the deployment being read (its prefix, or a
    /// subject under it).
    #[error(
        "the copy target is under this deployment's own prefix, where its workers and wake would take the copies for tasks and completions; to re-drive them use `replay tasks` or `replay wakes`"
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
    /// The events stream: to find earlier re-queues (tasks), and the
    /// `submitted` records that tell a forged completion (forced wakes).
    events: Option<async_nats::jetstream::stream::Stream>,
    /// The cancel records, so that a cancelled task is not run again
    /// (tasks only): `Ok(None)` when there is no cancel bucket (no worker
    /// ever ran), `Err` with why it could not be opened (every task is
    /// then left unchecked, not run on a guess).
    cancels: Result<Option<async_nats::jetstream::kv::Store>, String>,
    /// How long what an earlier run of this replay wrote is kept (the
    /// ledger's entries for wakes, the events of a re-queue for tasks):
    /// of a record older than that, no trace of an earlier run proves
    /// there was none. Zero: kept for ever.
    kept: std::time::Duration,
    /// What this run already handled: wakes by ledger key and the session
    /// the completion names (the history holds earlier replay copies of
    /// the same completion, and one wake per task is enough; a completion
    /// naming another session, a forged one, is not a copy of the task's
    /// own and must not stand in for it), tasks by delegation id and task
    /// index (a task given up twice has two dead letters, and runs once).
    seen: Handled,
    /// Copy targets a dry run has asked JetStream about, by the part of
    /// the target they fall in (`<prefix>.evt`, `<prefix>.task`, ... or
    /// the one subject): `None` when a stream takes them, else why the
    /// real run would fail there.
    uncaptured: HashMap<String, Option<String>>,
    /// Completions a wake dead letter says were given up after 409s (their
    /// turn may have been delivered under its key), by the same key as
    /// `seen`: read before a forced run over the wake dead letters
    /// ([`Replayer::note_conflicts`]), so that it forces no other dead
    /// letter of theirs either.
    conflicted: Handled,
    /// The size limits a re-queued request must meet: the workers'.
    limits: crate::protocol::Limits,
}

impl Replayer {
    /// Prepares a replay of `plan` on `bus`.
    pub async fn new(bus: Bus, plan: ReplayPlan) -> Result<Self, ReplayError> {
        plan.check(&bus.subjects)?;
        let mut ledger = None;
        let mut events = None;
        let mut kept = std::time::Duration::ZERO;
        let mut cancels = Ok(None);
        match &plan.kind {
            ReplayKind::Wakes | ReplayKind::WakeDeadLetters => {
                let bucket = bus.subjects.wake_ledger_bucket();
                let kv = bus
                    .js
                    .get_key_value(&bucket)
                    .await
                    .map_err(|source| ReplayError::OpenLedger {
                        bucket,
                        hint: if crate::bus::is_bucket_missing(&source) {
                            "has the wake service of this deployment ever run?"
                        } else {
                            "a leader election passes by itself, so run the replay again; a refused request needs the user's permission to read the bucket's stream"
                        },
                        source,
                    })?;
                kept = kv.stream.cached_info().config.max_age;
                ledger = Some(WakeLedger::new(kv));
                if plan.force {
                    events = Some(events_stream(&bus).await?);
                }
            }
            ReplayKind::Tasks => {
                let stream = events_stream(&bus).await?;
                kept = stream.cached_info().config.max_age;
                events = Some(stream);
                cancels = match bus.js.get_key_value(bus.subjects.cancel_bucket()).await {
                    Ok(store) => Ok(Some(store)),
                    Err(error) if crate::bus::is_bucket_missing(&error) => Ok(None),
                    Err(error) => Err(format!("the cancel records cannot be read ({error})")),
                };
            }
            ReplayKind::Copy { .. } => {}
        }
        Ok(Self {
            bus,
            plan,
            ledger,
            events,
            kept,
            cancels,
            seen: Handled::default(),
            uncaptured: HashMap::new(),
            conflicted: Handled::default(),
            limits: crate::protocol::Limits::default(),
        })
    }

    /// Sets the size limits a request must meet to be re-queued: the
    /// workers' (`--max-*-bytes`). A request over them would only be
    /// refused again, waking its session with the same error; one within
    /// larger limits than the defaults can run.
    #[must_use]
    pub fn with_limits(mut self, limits: crate::protocol::Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Whether `event`'s task was submitted for another session than
    /// `session` and not for it: the completion then is not the task's
    /// genuine one (a worker credential named another session for a real
    /// delegation). False when no `submitted` record of the task is found
    /// (a publisher that writes none, or one expired).
    async fn submitted_for_another_session(
        &self,
        event: &crate::protocol::CompletionEvent,
        session: &str,
    ) -> Result<bool, String> {
        let token = crate::protocol::session_token(session);
        let own = self.submitted_under(event, &token).await?;
        Ok(!own && self.submitted_under(event, "*").await?)
    }

    /// Whether a `submitted` record of `event`'s task is stored under the
    /// session token `token` (`*`: any).
    async fn submitted_under(
        &self,
        event: &crate::protocol::CompletionEvent,
        token: &str,
    ) -> Result<bool, String> {
        let events = self.events.as_ref().expect("forced wakes open the history");
        let subject = self
            .bus
            .subjects
            .submitted(token, &event.delegation_id, event.task_index);
        match events.get_last_raw_message_by_subject(&subject).await {
            Ok(_) => Ok(true),
            Err(error)
                if error.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                Ok(false)
            }
            Err(error) => Err(error.to_string()),
        }
    }

    /// Why no trace of an earlier run of this replay proves that there was
    /// none for `record`: it was stored longer ago than such a trace is
    /// kept (less a margin for the clocks). `None` when the trace would
    /// still be there.
    fn outlived_its_traces(&self, record: &Record, traces: &str) -> Option<String> {
        let age = time::OffsetDateTime::now_utc() - record.published;
        outlived(self.kept, age).map(|(age, kept)| {
            format!(
                "stored {age} ago, and {traces} are kept {kept}: whether an earlier replay handled it is not known (use --force to replay it anyway)"
            )
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
            match self.uncaptured(target, record, &subject).await {
                Ok(Some(reason)) => return Ok(item.skipped(reason)),
                Ok(None) => {}
                Err(reason) => return Ok(item.unchecked(reason)),
            }
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        let (ack, tried_again) = self
            .publish(subject, copy_headers(record), record.payload.clone())
            .await?;
        if ack.duplicate && tried_again {
            // Most likely this copy's own earlier try, stored with its
            // answer lost.
            item.action = Action::Replayed;
            item.reason = Some(format!(
                "stored at {}:{} (by an earlier try whose answer was lost, or an earlier copy with the same Nats-Msg-Id)",
                ack.stream, ack.sequence
            ));
            return Ok(item);
        }
        if ack.duplicate {
            // Copies keep their `Nats-Msg-Id`, which two messages can share
            // (the two dead letters of a task given up twice): the target
            // kept the first one and dropped this one.
            let id = record.header(HEADER_MSG_ID).unwrap_or_default();
            return Ok(item.skipped(format!(
                "not stored: {}:{} already holds a message with its Nats-Msg-Id {id:?}, stored within the stream's duplicate window",
                ack.stream, ack.sequence
            )));
        }
        item.action = Action::Replayed;
        Ok(item)
    }

    /// Why a copy to `subject` would not be stored, as far as a dry run
    /// can tell: no stream of this account takes it, which fails the real
    /// run at its first copy (skipped: running again changes nothing).
    /// Asked once per part of the target; `Err` when JetStream could not
    /// say (unchecked, and asked again for the next record).
    async fn uncaptured(
        &mut self,
        target: &CopyTarget,
        record: &Record,
        subject: &str,
    ) -> Result<Option<String>, String> {
        let part = match target {
            CopyTarget::Prefix(subjects) => {
                let kind = record.local_subject.split('.').next().unwrap_or_default();
                format!("{}.{kind}", subjects.prefix())
            }
            CopyTarget::Subject(subject) => subject.clone(),
        };
        if let Some(known) = self.uncaptured.get(&part) {
            return Ok(known.clone());
        }
        let (what, hint) = match target {
            CopyTarget::Prefix(subjects) => (
                format!("{part}.>"),
                format!(
                    "run `wakebus init --prefix {}` (or start a worker there) first",
                    subjects.prefix()
                ),
            ),
            CopyTarget::Subject(_) => (
                part.clone(),
                "create a stream that takes it first".to_owned(),
            ),
        };
        let reason = match self.bus.js.stream_by_subject(subject).await {
            Ok(_) => None,
            Err(error) if error.kind() == GetStreamByNameErrorKind::NotFound => Some(format!(
                "no stream of this account takes {what}: the real run would fail at its first copy there (unless another account's stream takes it); {hint}"
            )),
            Err(error) => {
                return Err(format!(
                    "could not ask which stream takes {subject}: {error}"
                ));
            }
        };
        self.uncaptured.insert(part, reason.clone());
        Ok(reason)
    }

    /// Publishes a copy until JetStream confirms it stored, trying again
    /// for a few seconds (a replay runs after an outage, when leader
    /// elections are common); every try has the same `Nats-Msg-Id`, so
    /// the copy is stored once. Returns the ack, and whether it took more
    /// than one try.
    async fn publish(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<(PublishAck, bool), ReplayError> {
        use backon::BackoffBuilder;
        let mut waits = backon::ExponentialBuilder::default()
            .with_min_delay(PUBLISH_RETRY_MIN)
            .with_max_delay(PUBLISH_RETRY_MAX)
            .with_max_times(PUBLISH_RETRIES)
            .build();
        let mut tried_again = false;
        loop {
            let stored = self
                .bus
                .publish_stored(subject.clone(), headers.clone(), payload.clone())
                .await;
            match stored {
                Ok(ack) => return Ok((ack, tried_again)),
                Err(source @ PublishError::Encode(_)) => {
                    return Err(ReplayError::Publish { subject, source });
                }
                Err(source) => match waits.next() {
                    Some(wait) => {
                        tracing::warn!(%subject, error = %source, retry_in = ?wait, "Could not store the copy; trying again.");
                        tokio::time::sleep(wait).await;
                        tried_again = true;
                    }
                    None => return Err(ReplayError::Publish { subject, source }),
                },
            }
        }
    }
}

/// The first wait before a copy JetStream did not store is published again.
const PUBLISH_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(250);

/// The longest wait between two tries of a copy.
const PUBLISH_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(4);

/// How many times a copy is published again: with the waits above, about
/// 8 s of waiting (plus each try's own wait for an answer, up to 5 s),
/// longer than a stream's leader election takes.
const PUBLISH_RETRIES: usize = 5;

/// Whether `subject` is `prefix` or a subject under it.
fn is_under(subject: &str, prefix: &str) -> bool {
    subject
        .strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// Whether the copies made under the prefix `target` would be taken by the
/// deployment of prefix `own`: `target` is `own`, or lies under one of the
/// subject roots of its streams and broadcasts (`<own>.task`, `.evt`,
/// `.dlq`, `.ctl`).
fn captured_by(target: &str, own: &str) -> bool {
    match target.strip_prefix(own) {
        Some("") => true,
        Some(rest) => rest.strip_prefix('.').is_some_and(|rest| {
            let root = rest.split('.').next().unwrap_or_default();
            matches!(root, "task" | "evt" | "dlq" | "ctl")
        }),
        None => false,
    }
}

/// What a replay run already handled, each as a digest of what names it:
/// a run over a week of history holds 16 bytes per task, not the session
/// ids (up to 16 KiB each) that name them.
#[derive(Debug, Default)]
struct Handled(HashSet<HandledKey>);

/// One entry of [`Handled`].
type HandledKey = [u8; 16];

impl Handled {
    /// The entry for `parts` (length-prefixed, so that no two lists of
    /// parts give the same bytes to hash).
    fn key(parts: &[&str]) -> HandledKey {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let digest = hash.finalize();
        let mut key = [0; 16];
        key.copy_from_slice(&digest[..16]);
        key
    }

    /// Marks `key` handled; false if it already was.
    fn insert(&mut self, key: HandledKey) -> bool {
        self.0.insert(key)
    }

    /// Whether `key` is in.
    fn contains(&self, key: &HandledKey) -> bool {
        self.0.contains(key)
    }

    /// Lets `key` be handled again (what decided it could not be read).
    fn remove(&mut self, key: &HandledKey) {
        self.0.remove(key);
    }
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

/// The original's headers for a copy: all of them but those the server
/// acts on, which held where the original was stored and may not where the
/// copy goes (`Nats-Expected-Stream`, say, would have it refused), except
/// `Nats-Msg-Id`, so that the target drops a second copy; plus
/// `Wakebus-Replay: <stream>:<sequence>`.
fn copy_headers(record: &Record) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in record.headers.iter() {
        let name: &str = name.as_ref();
        if is_server_directive(name) && !name.eq_ignore_ascii_case(HEADER_MSG_ID) {
            continue;
        }
        for value in values {
            headers.append(name, value.as_str());
        }
    }
    headers.insert(HEADER_REPLAY, record.origin_ref().as_str());
    headers
}

/// The original's headers without the dead-letter reason (nor an earlier
/// replay's marks, nor those the server acts on: the copy's `Nats-Msg-Id`
/// is set by the caller), plus `Wakebus-Replay: <stream>:<sequence>`.
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
            || is_server_directive(name)
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

/// Whether something `age` old may have outlived a trace kept `kept`
/// (less a margin for the clocks: 5 minutes, or a tenth of a shorter
/// keep, a test deployment's), as both durations for a reason; `None`
/// while the trace would still be there, or when kept for ever (zero).
fn outlived(kept: std::time::Duration, age: time::Duration) -> Option<(String, String)> {
    let margin = std::time::Duration::from_secs(300).min(kept / 10);
    (!kept.is_zero() && age >= kept.saturating_sub(margin)).then(|| {
        let age = std::time::Duration::from_secs(u64::try_from(age.whole_seconds()).unwrap_or(0));
        (
            humantime::format_duration(age).to_string(),
            humantime::format_duration(kept).to_string(),
        )
    })
}

/// The events stream of `bus`'s deployment.
async fn events_stream(bus: &Bus) -> Result<async_nats::jetstream::stream::Stream, ReplayError> {
    let name = bus.subjects.events_stream();
    bus.js
        .get_stream(&name)
        .await
        .map_err(|source| HistoryError::Stream {
            stream: name.clone(),
            source,
        })
        .map_err(ReplayError::from)
}

/// Progress of a run, for display.
#[derive(Debug)]
pub enum Progress<'a> {
    /// A forced replay of the wake dead letters first reads them for turns
    /// given up after 409s (which it must leave alone); about this many
    /// dead letters match the subject filter.
    Prereading {
        /// The estimate.
        total: u64,
    },
    /// One dead letter was read by that first pass.
    Preread,
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
) -> Result<Summary, ReplayFailed> {
    match replayer.note_conflicts(&cancel, &mut progress).await {
        Ok(true) => {}
        Ok(false) => {
            return Ok(Summary {
                interrupted: true,
                ..Summary::default()
            });
        }
        Err(error) => {
            return Err(ReplayFailed {
                summary: Summary::default(),
                error,
            });
        }
    }
    let mut reader = match replayer.open().await {
        Ok(reader) => reader,
        Err(error) => {
            return Err(ReplayFailed {
                summary: Summary::default(),
                error,
            });
        }
    };
    progress(Progress::Opened {
        total: reader.estimated_total(),
    });
    let mut summary = Summary::default();
    let result = async {
        loop {
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    // Come while the last record was handled, the cancel
                    // stopped nothing: the run is whole, and said so (a
                    // script would run an interrupted `--force` again,
                    // waking every session a second time).
                    summary.interrupted = !reader.has_nothing_left().await;
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
    match result {
        Ok(()) => Ok(summary),
        Err(error) => Err(ReplayFailed { summary, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_under_a_prefix_the_deployment_captures_are_refused_and_another_deployments_are_not() {
        for taken in [
            "wakebus",
            "wakebus.task",
            "wakebus.evt.x",
            "wakebus.dlq",
            "wakebus.ctl",
        ] {
            assert!(captured_by(taken, "wakebus"), "{taken}");
        }
        for other in [
            "wakebus.staging",
            "wakebus2",
            "staging",
            "wakebus.tasks",
            "acme.wakebus",
        ] {
            assert!(!captured_by(other, "wakebus"), "{other}");
        }
    }
}
