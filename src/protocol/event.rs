//! Lifecycle event bodies, published on `<prefix>.evt.…`.

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::{PROTOCOL_VERSION, Role, TaskRequest, WakeMode};

/// An event body's kind, as its `type` field names it.
trait Kind {
    /// The `type` every body of this kind carries.
    const TYPE: &'static str;
    /// The body's `type` and `version`.
    fn type_and_version(&self) -> (&str, u32);
}

/// Decodes an event body, refusing one of another kind (its `type`) or of
/// a version this release does not read: the schemas refuse both, and a
/// body of a later version may mean something else in the same fields.
fn decode_kind<T: Kind + DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    let unsupported = |found: u32| {
        serde_json::Error::custom(format!(
            "version {found} is not supported (this release reads version {PROTOCOL_VERSION})"
        ))
    };
    let event: T = match serde_json::from_slice(body) {
        Ok(event) => event,
        // A later version's body may lack what this one needs: the reader
        // is told the version, not that a field is missing.
        Err(error) => return Err(super::request::later_version(body).map_or(error, unsupported)),
    };
    let (found, version) = event.type_and_version();
    if found != T::TYPE {
        return Err(serde_json::Error::custom(format!(
            "type is {found:?}, not {:?}",
            T::TYPE
        )));
    }
    if version == 0 || version > PROTOCOL_VERSION {
        return Err(unsupported(version));
    }
    Ok(event)
}

/// Implements [`Kind`] for a body type with `event_type` and `version`.
macro_rules! kind {
    ($body:ty, $type:literal) => {
        impl Kind for $body {
            const TYPE: &'static str = $type;
            fn type_and_version(&self) -> (&str, u32) {
                (&self.event_type, self.version)
            }
        }
    };
}
kind!(SubmittedRecord, "delegation_submitted");
kind!(StartedEvent, "delegation_started");
kind!(ProgressEvent, "delegation_progress");
kind!(CompletionEvent, "async_delegation");

/// The last token of an event subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The delegator recorded the task before publishing its request: the
    /// record a completion must match when the wake verifies origins.
    Submitted,
    /// A worker took the task and started running it.
    Started,
    /// The running task reported progress.
    Progress,
    /// The task ended (in any status); the wake service acts on these.
    Done,
}

impl EventKind {
    /// The subject token.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Submitted => "submitted",
            Self::Started => "started",
            Self::Progress => "progress",
            Self::Done => "done",
        }
    }

    /// The kind a subject's last token names (the inverse of [`Self::as_str`]).
    pub fn from_token(token: &str) -> Option<Self> {
        [Self::Submitted, Self::Started, Self::Progress, Self::Done]
            .into_iter()
            .find(|kind| kind.as_str() == token)
    }

    /// The CloudEvents type.
    pub fn ce_type(self) -> &'static str {
        match self {
            Self::Submitted => "io.wakebus.task.submitted",
            Self::Started => "io.wakebus.task.started",
            Self::Progress => "io.wakebus.task.progress",
            Self::Done => "io.wakebus.task.done",
        }
    }
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The subagent finished its work.
    Completed,
    /// The subagent ran and failed, or every attempt failed.
    Failed,
    /// The task was cancelled while it ran.
    Interrupted,
    /// The task ran out of time.
    Timeout,
    /// The request itself was unusable (invalid JSON, missing goal, ...).
    Error,
}

impl Status {
    /// The lowercase wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Interrupted => "interrupted",
            Self::Timeout => "timeout",
            Self::Error => "error",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `submitted` record body: written by the delegator, before the task's
/// request is published, on a subject only delegators may publish to. With
/// `verify_origin` on, the wake acts on a completion only if this record
/// exists and names the same origin session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubmittedRecord {
    /// Always `delegation_submitted`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Body version.
    pub version: u32,
    /// The delegation id.
    pub delegation_id: String,
    /// The task index.
    pub task_index: u32,
    /// How many tasks the delegation has.
    pub task_count: u32,
    /// The session the delegation wakes; `None` in sync mode.
    #[serde(default)]
    pub origin_session_id: Option<String>,
    /// The pool the request was published to.
    pub pool: String,
    /// When the delegator wrote the record.
    #[serde(with = "super::rfc3339")]
    pub submitted_at: OffsetDateTime,
    /// The delegation's W3C trace context, also in the `traceparent` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl SubmittedRecord {
    /// The record of `request`, submitted to `pool`.
    pub fn for_request(request: &TaskRequest, pool: &str, traceparent: Option<String>) -> Self {
        Self {
            event_type: <Self as Kind>::TYPE.to_owned(),
            version: PROTOCOL_VERSION,
            delegation_id: request.delegation_id.clone(),
            task_index: request.task_index,
            task_count: request.task_count,
            origin_session_id: request.origin_session_id.clone(),
            pool: pool.to_owned(),
            submitted_at: OffsetDateTime::now_utc(),
            traceparent,
        }
    }

    /// The deterministic record id (`Nats-Msg-Id`, `ce-id`): a retried
    /// write is dropped by JetStream as a duplicate.
    pub fn id_for(delegation_id: &str, task_index: u32) -> String {
        format!("{delegation_id}.{task_index}.submitted")
    }

    /// Decodes a record body, refusing one of another `type` or of a
    /// version this release does not read.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        decode_kind(body)
    }
}

/// The `started` event body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartedEvent {
    /// Always `delegation_started`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Body version.
    pub version: u32,
    /// The delegation id.
    pub delegation_id: String,
    /// The task index.
    pub task_index: u32,
    /// The origin session, if any.
    #[serde(default)]
    pub origin_session_id: Option<String>,
    /// The worker instance that runs the task.
    pub worker: String,
    /// Which delivery of the request this is (1 for the first).
    pub attempt: u64,
    /// When the run started.
    #[serde(with = "super::rfc3339")]
    pub started_at: OffsetDateTime,
}

impl StartedEvent {
    /// The event a worker publishes when it starts running `request`.
    pub fn for_request(request: &TaskRequest, worker: &str, attempt: u64) -> Self {
        Self {
            event_type: <Self as Kind>::TYPE.to_owned(),
            version: PROTOCOL_VERSION,
            delegation_id: request.delegation_id.clone(),
            task_index: request.task_index,
            origin_session_id: request.origin_session_id.clone(),
            worker: worker.to_owned(),
            attempt,
            started_at: OffsetDateTime::now_utc(),
        }
    }

    /// Decodes a started event body, refusing one of another `type` or of
    /// a version this release does not read.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        decode_kind(body)
    }
}

/// The `progress` event body: what a running task last reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressEvent {
    /// Always `delegation_progress`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Body version.
    pub version: u32,
    /// The delegation id.
    pub delegation_id: String,
    /// The task index.
    pub task_index: u32,
    /// The origin session, if any.
    #[serde(default)]
    pub origin_session_id: Option<String>,
    /// The worker instance running the task.
    pub worker: String,
    /// The message the executor reported.
    pub message: String,
    /// When it was reported.
    #[serde(with = "super::rfc3339")]
    pub at: OffsetDateTime,
}

impl ProgressEvent {
    /// A progress event for `request`.
    pub fn for_request(request: &TaskRequest, worker: &str, message: String) -> Self {
        Self {
            event_type: <Self as Kind>::TYPE.to_owned(),
            version: PROTOCOL_VERSION,
            delegation_id: request.delegation_id.clone(),
            task_index: request.task_index,
            origin_session_id: request.origin_session_id.clone(),
            worker: worker.to_owned(),
            message,
            at: OffsetDateTime::now_utc(),
        }
    }

    /// Decodes a progress event body, refusing one of another `type` or of
    /// a version this release does not read.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        decode_kind(body)
    }
}

/// The `done` event body: the field names of Hermes's `async_delegation`
/// completion event, plus `version` and `event_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionEvent {
    /// Always `async_delegation`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Body version.
    #[serde(default = "default_version")]
    pub version: u32,
    /// Same as the `ce-id` header: `<delegation_id>.<task_index>.done`.
    #[serde(default)]
    pub event_id: String,
    /// The delegation id.
    pub delegation_id: String,
    /// The task index.
    #[serde(default)]
    pub task_index: u32,
    /// How many tasks the delegation has.
    #[serde(default = "default_task_count")]
    pub task_count: u32,
    /// Batch (one consolidated wake) or independent wakes.
    #[serde(default)]
    pub wake_mode: WakeMode,
    /// In batch mode, send an early notice for a failed task.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub notify_early_failure: bool,
    /// The session to wake; `None` in sync mode.
    #[serde(default)]
    pub origin_session_id: Option<String>,
    /// The delegating agent's session, if it differs from the origin.
    #[serde(default)]
    pub parent_session_id: Option<String>,
    /// The task's goal.
    #[serde(default)]
    pub goal: String,
    /// The task's context.
    #[serde(default)]
    pub context: String,
    /// The subagent's role.
    #[serde(default)]
    pub role: Role,
    /// The model used, if known.
    #[serde(default)]
    pub model: Option<String>,
    /// How the task ended.
    pub status: Status,
    /// The result (possibly partial).
    #[serde(default)]
    pub summary: Option<String>,
    /// What went wrong, when the status is not `completed`.
    #[serde(default)]
    pub error: Option<String>,
    /// How many model calls the subagent made.
    #[serde(default)]
    pub api_calls: u64,
    /// Prompt tokens used, when the executor knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens used, when the executor knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    /// Wall time of the run.
    #[serde(default)]
    pub duration_seconds: f64,
    /// When the delegation was created (the request's `created_at`).
    #[serde(default, with = "super::rfc3339::option")]
    pub dispatched_at: Option<OffsetDateTime>,
    /// When the task ended.
    #[serde(with = "super::rfc3339")]
    pub completed_at: OffsetDateTime,
    /// The executor's output was longer than its cap and was cut.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Set when the task was cancelled silently: record it, wake nobody.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suppress_wake: bool,
    /// Machine-readable reason the run ended (`completed`, `nonzero_exit`,
    /// `timeout`, `invalid_request`, `max_deliveries_exceeded`, ...).
    pub exit_reason: String,
}

fn default_task_count() -> u32 {
    1
}

fn default_version() -> u32 {
    PROTOCOL_VERSION
}

impl CompletionEvent {
    /// The deterministic event id of a task's completion.
    ///
    /// Deterministic on purpose: a re-run of the same task after a crash
    /// publishes the same `Nats-Msg-Id` (deduped by JetStream) and the wake
    /// service sends the same `Idempotency-Key`.
    pub fn id_for(delegation_id: &str, task_index: u32) -> String {
        format!("{delegation_id}.{task_index}.done")
    }

    /// Whether this is a completion of task `task_index` of delegation
    /// `delegation_id` of `task_count` tasks: its ids are that task's, and
    /// it names the same task count, or it is the `error` completion of a
    /// request whose batch could not be read
    /// ([`Self::is_of_an_unreadable_batch`]). A worker writes that one as a
    /// batch of its own, since it cannot tell the real count; it still ends
    /// its task, so a batch waiting for that task counts it.
    pub fn is_task_of(&self, delegation_id: &str, task_index: u32, task_count: u32) -> bool {
        self.delegation_id == delegation_id
            && self.task_index == task_index
            && task_index < task_count
            && (self.task_count == task_count || self.is_of_an_unreadable_batch())
    }

    /// Whether this is the `error` completion a worker writes for a request
    /// whose batch it could not read: `invalid_request`, a batch of its own
    /// (`task_count: index + 1`; `wake_mode: independent`, or the single
    /// task 0 with the default mode).
    pub fn is_of_an_unreadable_batch(&self) -> bool {
        self.status == Status::Error
            && self.exit_reason == "invalid_request"
            && self.task_count == self.task_index.saturating_add(1)
            && (self.wake_mode == WakeMode::Independent || self.task_count == 1)
    }

    /// A completion for `request`, with everything but the outcome filled in.
    pub fn for_request(request: &TaskRequest, status: Status, exit_reason: &str) -> Self {
        Self {
            event_type: <Self as Kind>::TYPE.to_owned(),
            version: PROTOCOL_VERSION,
            event_id: Self::id_for(&request.delegation_id, request.task_index),
            delegation_id: request.delegation_id.clone(),
            task_index: request.task_index,
            task_count: request.task_count,
            wake_mode: request.wake_mode,
            notify_early_failure: request.notify_early_failure,
            origin_session_id: request.origin_session_id.clone(),
            parent_session_id: request.parent_session_id.clone(),
            goal: request.goal.clone(),
            context: request.context.clone(),
            role: request.role,
            model: request.model.clone(),
            status,
            summary: None,
            error: None,
            api_calls: 0,
            prompt_tokens: None,
            completion_tokens: None,
            duration_seconds: 0.0,
            dispatched_at: request.created_at,
            completed_at: OffsetDateTime::now_utc(),
            truncated: false,
            suppress_wake: false,
            exit_reason: exit_reason.to_owned(),
        }
    }

    /// Decodes a completion body, refusing one of another `type` or of a
    /// version this release does not read.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        decode_kind(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_is_ended_by_its_own_completion_or_by_the_error_of_its_unreadable_request() {
        let mut request = TaskRequest::new("d1".to_owned(), "g");
        request.task_index = 1;
        request.task_count = 3;
        request.wake_mode = WakeMode::Batch;
        let done = CompletionEvent::for_request(&request, Status::Completed, "completed");
        assert!(done.is_task_of("d1", 1, 3));
        assert!(!done.is_task_of("d2", 1, 3), "another delegation");
        assert!(!done.is_task_of("d1", 2, 3), "another task");
        assert!(!done.is_task_of("d1", 1, 4), "another batch");
        // What a worker writes for a request whose batch it could not read.
        request.task_count = 2;
        request.wake_mode = WakeMode::Independent;
        let unreadable = CompletionEvent::for_request(&request, Status::Error, "invalid_request");
        assert!(unreadable.is_task_of("d1", 1, 3));
        assert!(unreadable.is_task_of("d1", 1, 2));
        assert!(
            !unreadable.is_task_of("d1", 1, 1),
            "not a task of that batch"
        );
        // Any other completion naming another count is not the task's.
        for (status, reason) in [
            (Status::Completed, "completed"),
            (Status::Error, "nonzero_exit"),
        ] {
            let other = CompletionEvent::for_request(&request, status, reason);
            assert!(!other.is_task_of("d1", 1, 3), "{reason}");
        }
        let mut batch = unreadable.clone();
        batch.wake_mode = WakeMode::Batch;
        assert!(!batch.is_task_of("d1", 1, 3), "a batch of its own");
        let mut counted = unreadable;
        counted.task_count = 5;
        assert!(
            !counted.is_task_of("d1", 1, 3),
            "a count other than index + 1"
        );
        // Task 0 of an unreadable batch is written as a single task.
        request.task_index = 0;
        request.task_count = 1;
        request.wake_mode = WakeMode::Batch;
        let first = CompletionEvent::for_request(&request, Status::Error, "invalid_request");
        assert!(first.is_task_of("d1", 0, 3));
    }

    #[test]
    fn completion_keeps_hermes_field_names() {
        let req = TaskRequest::decode(
            br#"{"version":1,"delegation_id":"d1","goal":"g","origin_session_id":"s"}"#,
        )
        .unwrap();
        let event = CompletionEvent::for_request(&req, Status::Completed, "completed");
        let json = serde_json::to_value(&event).unwrap();
        for field in [
            "type",
            "delegation_id",
            "task_index",
            "origin_session_id",
            "parent_session_id",
            "goal",
            "context",
            "role",
            "model",
            "status",
            "summary",
            "error",
            "api_calls",
            "duration_seconds",
            "dispatched_at",
            "completed_at",
            "exit_reason",
        ] {
            assert!(json.get(field).is_some(), "missing {field}");
        }
        assert_eq!(json["type"], "async_delegation");
        assert_eq!(json["status"], "completed");
        assert_eq!(
            CompletionEvent::decode(&serde_json::to_vec(&event).unwrap()).unwrap(),
            event
        );
    }
}
