//! Cancellation: a durable record checked before a task starts, plus a
//! broadcast that interrupts tasks already running, on any machine.
//!
//! The record lives in the KV bucket `<PREFIX>_CANCELS` under
//! `dlg.<delegation_id>` or `ses.<session_token>`; the broadcast goes to
//! `<prefix>.ctl.cancel.dlg.<delegation_id>` or
//! `<prefix>.ctl.cancel.ses.<session_token>` with the record as body. A
//! session cancel applies to requests stored before it (like a user's /stop).

use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::bus::Bus;
use crate::protocol::{
    CompletionEvent, EventKind, IdError, SubmittedRecord, session_token, validate_delegation_id,
    validate_session_id,
};

/// What was cancelled, when, and whether the session should hear of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRecord {
    /// When the cancel was issued; a session cancel applies to requests stored before this.
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Do not wake the session with the interrupted results.
    #[serde(default)]
    pub silent: bool,
}

/// What a cancel targets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CancelTarget {
    /// One delegation (all its tasks).
    Delegation(String),
    /// Every open delegation of a session, by session token.
    Session(String),
}

impl CancelTarget {
    /// The KV key of the record.
    pub fn key(&self) -> String {
        match self {
            Self::Delegation(id) => format!("dlg.{id}"),
            Self::Session(token) => format!("ses.{token}"),
        }
    }

    /// Parses a KV key (or the tail of a broadcast subject) back.
    pub fn from_key(key: &str) -> Option<Self> {
        let (kind, rest) = key.split_once('.')?;
        match kind {
            "dlg" => Some(Self::Delegation(rest.to_owned())),
            "ses" => Some(Self::Session(rest.to_owned())),
            _ => None,
        }
    }

    /// The broadcast subject.
    pub fn subject(&self, bus: &Bus) -> String {
        format!("{}.{}", bus.subjects.cancel_broadcasts_prefix(), self.key())
    }
}

/// Where a cancelled delegation stood.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationState {
    /// Every task had already ended: nothing was cancelled.
    Finished,
    /// At least one task had started: running tasks are being interrupted.
    Running,
    /// A request is still queued: it will not run.
    Queued,
    /// Its `submitted` record is stored, but no request of it is queued,
    /// started or complete: it was stored only in part (its delegator may
    /// still send it again). The cancel is recorded: it will not run.
    Submitted,
    /// No trace of it in the history or the queue: unknown (or already expired).
    Unknown,
    /// The history could not be read (a leader election, a user that may
    /// not read it): the cancel is recorded anyway, as for a running one.
    NotRead,
}

/// The answer to a cancel, printed as JSON by the CLI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CancelReport {
    /// `cancelled`, or `nothing_to_cancel` for a finished or unknown delegation.
    pub status: &'static str,
    /// `delegation` or `session`.
    pub scope: &'static str,
    /// The delegation id or the raw session id.
    pub target: String,
    /// For a delegation: where it stood.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<DelegationState>,
    /// Whether the session is spared the interrupted results.
    pub silent: bool,
    /// A sentence for humans.
    pub message: String,
}

/// Why a cancel could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    /// The id is malformed.
    #[error(transparent)]
    InvalidId(#[from] IdError),
    /// The cancel bucket is unavailable.
    #[error("cannot reach the cancel records: {0}")]
    Bucket(#[from] async_nats::jetstream::context::KeyValueError),
    /// The record's write was not confirmed: refused, or stored with its
    /// answer lost (a timeout, a leader election).
    #[error(
        "the cancel record {key} was not confirmed stored ({source}): it may be stored or not; check with `nats kv get {bucket} {key}` before sending the cancel again (a session cancel sent again applies up to its own, later time)"
    )]
    Put {
        /// The cancel bucket.
        bucket: String,
        /// The record's key.
        key: String,
        /// The KV error.
        source: kv::PutError,
    },
    /// The broadcast could not be sent; the record was stored, and workers
    /// apply it from there.
    #[error(
        "cannot broadcast the cancel ({0}); it is recorded, and workers apply it once their cancel watch reads it"
    )]
    Broadcast(String),
    /// The history could not be read.
    #[error("cannot read the history: {0}")]
    History(String),
}

/// Cancels delegations of one deployment.
#[derive(Debug, Clone)]
pub struct Canceller {
    /// The deployment.
    bus: Bus,
}

/// How often a cancel record is read back for its stored time.
const READ_BACK_TRIES: u32 = 5;

/// The pause between two read-backs.
const READ_BACK_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// How long one read-back waits for its answer: a replica answers in
/// milliseconds, a role that may not read the record never.
const READ_BACK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl Canceller {
    /// A canceller on `bus` (streams and the cancel bucket must exist).
    pub fn new(bus: Bus) -> Self {
        Self { bus }
    }

    /// Cancels every task of `delegation_id`.
    pub async fn cancel_delegation(
        &self,
        delegation_id: &str,
        silent: bool,
    ) -> Result<CancelReport, CancelError> {
        validate_delegation_id(delegation_id)?;
        let state = match self.state_of(delegation_id).await {
            Ok(state) => state,
            // Better a cancel record too many than a task that runs after
            // its cancel was refused (a leader election, a user that may
            // not read the history).
            Err(CancelError::History(error)) => {
                tracing::warn!(%error, delegation_id, "Could not tell where the delegation stands; writing the cancel record anyway.");
                DelegationState::NotRead
            }
            Err(error) => return Err(error),
        };
        let report = |status, message: String| CancelReport {
            status,
            scope: "delegation",
            target: delegation_id.to_owned(),
            state: Some(state),
            silent,
            message,
        };
        match state {
            DelegationState::Finished => {
                return Ok(report(
                    "nothing_to_cancel",
                    format!("Delegation {delegation_id} already finished; nothing to cancel."),
                ));
            }
            DelegationState::Unknown => {
                return Ok(report(
                    "nothing_to_cancel",
                    format!(
                        "Delegation {delegation_id} is unknown: no event or queued request has that id."
                    ),
                ));
            }
            DelegationState::Running
            | DelegationState::Queued
            | DelegationState::Submitted
            | DelegationState::NotRead => {}
        }
        self.record_and_broadcast(&CancelTarget::Delegation(delegation_id.to_owned()), silent)
            .await?;
        let message = match state {
            DelegationState::Running => format!(
                "Delegation {delegation_id} is being interrupted; queued tasks of it will not run."
            ),
            DelegationState::NotRead => format!(
                "Could not read where delegation {delegation_id} stands; the cancel is recorded anyway: its tasks that are running are interrupted, and queued ones will not run."
            ),
            DelegationState::Submitted => format!(
                "Delegation {delegation_id} was submitted, but none of its requests is stored (it was stored only in part); the cancel is recorded: if they are sent again, they will not run."
            ),
            _ => format!(
                "Delegation {delegation_id} is queued; it will not run (a task that has only just started is interrupted)."
            ),
        };
        Ok(report("cancelled", message))
    }

    /// Cancels every open delegation of `session` (requests stored before now).
    pub async fn cancel_session(
        &self,
        session: &str,
        silent: bool,
    ) -> Result<CancelReport, CancelError> {
        validate_session_id(session)?;
        self.record_and_broadcast(&CancelTarget::Session(session_token(session)), silent)
            .await?;
        Ok(CancelReport {
            status: "cancelled",
            scope: "session",
            target: session.to_owned(),
            state: None,
            silent,
            message: "Every delegation of the session requested before now is interrupted or will not run.".to_owned(),
        })
    }

    async fn record_and_broadcast(
        &self,
        target: &CancelTarget,
        silent: bool,
    ) -> Result<(), CancelError> {
        let record = CancelRecord {
            at: OffsetDateTime::now_utc(),
            silent,
        };
        let body = serde_json::to_vec(&record).unwrap_or_default();
        // Record first, broadcast second: a task either starts after the
        // record exists or is already running when the broadcast arrives.
        let bucket = self
            .bus
            .js
            .get_key_value(self.bus.subjects.cancel_bucket())
            .await?;
        let revision = bucket
            .put(target.key(), body.into())
            .await
            .map_err(|source| CancelError::Put {
                bucket: self.bus.subjects.cancel_bucket(),
                key: target.key(),
                source,
            })?;
        // Workers compare `at` with the server's stored time of each request,
        // so broadcast the server's time of the record, not this machine's:
        // read back from any replica, which may not have it yet (asked
        // again a few times), and only this write's own revision.
        let mut stored = None;
        for _ in 0..READ_BACK_TRIES {
            match tokio::time::timeout(READ_BACK_WAIT, bucket.entry(target.key())).await {
                Ok(Ok(Some(entry))) if entry.revision == revision => {
                    stored = Some(entry.created);
                    break;
                }
                _ => tokio::time::sleep(READ_BACK_PAUSE).await,
            }
        }
        let record = match stored {
            Some(at) => CancelRecord { at, ..record },
            None => {
                tracing::warn!(key = %target.key(), "Could not read the cancel record back; broadcasting it with this machine's time (workers take the server's from the record itself).");
                record
            }
        };
        let body = serde_json::to_vec(&record).unwrap_or_default();
        // Bounded: with the server gone (after the record was stored) the
        // client would wait for a reconnect for ever. The record stands,
        // and workers read it at their next start or watch.
        let subject = target.subject(&self.bus);
        let sent = async {
            self.bus
                .client
                .publish(subject, body.into())
                .await
                .map_err(|e| CancelError::Broadcast(e.to_string()))?;
            self.bus
                .client
                .flush()
                .await
                .map_err(|e| CancelError::Broadcast(e.to_string()))
        };
        match tokio::time::timeout(crate::connect::STOP_TIMEOUT, sent).await {
            Ok(sent) => sent,
            Err(_) => Err(CancelError::Broadcast(format!(
                "NATS did not take it within {:?}",
                crate::connect::STOP_TIMEOUT
            ))),
        }
    }

    /// Where a delegation stands, from its events and the request queue.
    async fn state_of(&self, delegation_id: &str) -> Result<DelegationState, CancelError> {
        let history = |e: &dyn std::fmt::Display| CancelError::History(e.to_string());
        let events = self
            .bus
            .js
            .get_stream(self.bus.subjects.events_stream())
            .await
            .map_err(|e| history(&e))?;
        let filter = |kind: EventKind| self.bus.subjects.delegation_events(delegation_id, kind);
        // Only "no such event" means none: a read that failed (a leader
        // election) is an error, not a delegation to call unknown.
        let none = |e: &async_nats::jetstream::stream::LastRawMessageError| {
            e.kind() == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
        };
        match events
            .get_last_raw_message_by_subject(&filter(EventKind::Done))
            .await
        {
            Ok(done) => {
                // Garbage on a completion subject (anyone allowed to publish
                // events can put it there) must not make the delegation
                // impossible to cancel: taken as running, the record is
                // written.
                let Ok(done) = CompletionEvent::decode(&done.payload) else {
                    return Ok(DelegationState::Running);
                };
                return self.finished_or_running(&events, &filter, &done).await;
            }
            Err(e) if none(&e) => {}
            Err(e) => return Err(history(&e)),
        }
        match events
            .get_last_raw_message_by_subject(&filter(EventKind::Started))
            .await
        {
            Ok(_) => return Ok(DelegationState::Running),
            Err(e) if none(&e) => {}
            Err(e) => return Err(history(&e)),
        }
        if self.is_queued(delegation_id).await? {
            return Ok(DelegationState::Queued);
        }
        // Its delegator stored the records, but not (yet) every request.
        match events
            .get_last_raw_message_by_subject(&filter(EventKind::Submitted))
            .await
        {
            Ok(_) => Ok(DelegationState::Submitted),
            Err(e) if none(&e) => Ok(DelegationState::Unknown),
            Err(e) => Err(history(&e)),
        }
    }

    /// Finished when every task of the delegation has a completion.
    async fn finished_or_running(
        &self,
        events: &async_nats::jetstream::stream::Stream,
        filter: &impl Fn(EventKind) -> String,
        done: &CompletionEvent,
    ) -> Result<DelegationState, CancelError> {
        // One subject per task: count the tasks, by index, that have a
        // completion. Subjects of indexes outside the delegation, or of one
        // task under several session tokens, which only a misbehaving
        // publisher stores, must not make it look finished while tasks
        // still wait to run. How many tasks there are, and under which
        // session token, the delegator's `submitted` record says, where
        // there is one: the last completion stored may be the stranger.
        let submitted = match events
            .get_last_raw_message_by_subject(&filter(EventKind::Submitted))
            .await
        {
            Ok(message) => {
                let record = serde_json::from_slice::<SubmittedRecord>(&message.payload).ok();
                let token = self
                    .bus
                    .subjects
                    .parse_event(&message.subject)
                    .map(|subject| subject.session_token.to_owned());
                record
                    .zip(token)
                    .map(|(record, token)| (record.task_count, token))
            }
            Err(error)
                if error.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                None
            }
            // Not read (a leader election): not a count to guess.
            Err(error) => return Err(CancelError::History(error.to_string())),
        };
        let (task_count, token) = match submitted {
            Some((task_count, token)) => (task_count, Some(token)),
            None => (done.task_count, None),
        };
        let task_count = task_count.max(1);
        let mut subjects = events
            .info_with_subjects(filter(EventKind::Done))
            .await
            .map_err(|e| CancelError::History(e.to_string()))?;
        let mut tasks_done = std::collections::BTreeSet::new();
        while let Some(subject) = subjects.next().await {
            let (subject, _) = subject.map_err(|e| CancelError::History(e.to_string()))?;
            let Some(done) = self.bus.subjects.parse_event(&subject) else {
                continue;
            };
            if token
                .as_deref()
                .is_some_and(|token| done.session_token != token)
            {
                continue;
            }
            if done.task_index < task_count {
                tasks_done.insert(done.task_index);
            }
        }
        Ok(if tasks_done.len() >= task_count as usize {
            DelegationState::Finished
        } else {
            DelegationState::Running
        })
    }

    /// Whether a request of the delegation waits in the work queue (see
    /// [`Bus::is_queued`]).
    async fn is_queued(&self, delegation_id: &str) -> Result<bool, CancelError> {
        self.bus
            .is_queued(delegation_id)
            .await
            .map_err(|e| CancelError::History(e.to_string()))
    }
}
