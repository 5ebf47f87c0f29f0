//! Delegating: turning one goal, or a batch of them, into requests on the bus.
//!
//! With an origin session the call returns as soon as JetStream has stored
//! every request (background mode); the wake service later continues that
//! session. Without one there is nothing to wake, so the call waits for the
//! completions and returns them inline (sync mode).
//!
//! Before a task's request, the delegator writes its `submitted` record to
//! the events stream (`<prefix>.evt.<token>.<delegation>.<task>.submitted`):
//! a wake that verifies origins only acts on completions that have one.
//!
//! - `mod.rs` (this file): what a delegation is, validating it and building
//!   its requests, and [`Delegator::delegate`];
//! - `publish.rs`: storing the records and requests, retrying what
//!   JetStream did not confirm;
//! - `wait.rs`: waiting for the completions in sync mode.

mod publish;
mod wait;

use std::time::Duration;

use async_nats::jetstream::stream::{LastRawMessageErrorKind, RawMessageErrorKind};
use serde::Serialize;
use time::OffsetDateTime;
use tracing::Instrument as _;

use crate::bus::{Bus, PublishError};
use crate::protocol::{
    CompletionEvent, DEFAULT_MAX_DEPTH, IdError, Limits, Role, TaskRequest, TooLarge, TraceParent,
    WakeMode, new_delegation_id, validate_delegation_id, validate_pool, validate_session_id,
};

/// The largest batch accepted by default.
pub const DEFAULT_MAX_BATCH: usize = 10;

/// One task of a delegation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskSpec {
    /// What the subagent should achieve.
    pub goal: String,
    /// Background for the subagent.
    pub context: String,
}

/// What to delegate: one task or a batch, and how to run and wake them.
#[derive(Debug, Clone)]
pub struct Delegation {
    /// The tasks (one request each, `task_index` 0..N-1, run in parallel).
    pub tasks: Vec<TaskSpec>,
    /// The session to wake; `None` runs synchronously.
    pub origin_session_id: Option<String>,
    /// The pool to run on.
    pub pool: String,
    /// Leaf or orchestrator.
    pub role: Role,
    /// Model preference.
    pub model: Option<String>,
    /// Tool sets.
    pub toolsets: Vec<String>,
    /// Per-task time limit.
    pub timeout_seconds: Option<u64>,
    /// Nesting level of the subagent this creates: 1 when a top-level
    /// session delegates; a subagent delegating passes its own depth + 1.
    pub depth: u32,
    /// The delegating agent's session, if it differs from the origin.
    pub parent_session_id: Option<String>,
    /// A trace to continue; a new one is started otherwise.
    pub traceparent: Option<TraceParent>,
    /// Also wait for the completions in background mode.
    pub wait: bool,
    /// For a batch: one consolidated wake (default) or one per task.
    pub wake_mode: WakeMode,
    /// For a batch: an early notice when a task fails while others run.
    pub notify_early_failure: bool,
    /// A JSON Schema every answer must satisfy.
    pub output_schema: Option<serde_json::Value>,
    /// The delegation's id; a new one when `None`. Giving the id of a
    /// delegation whose `delegate` call failed with
    /// [`DelegateError::NotStored`] stores what is missing without running
    /// any task twice, as long as it is done within the streams' duplicate
    /// window (2 minutes by default): every message's dedupe id derives
    /// from the delegation id, so JetStream drops the copies of what was
    /// stored.
    pub delegation_id: Option<String>,
}

impl Default for Delegation {
    /// No tasks yet, the `default` pool, depth 1, sync mode.
    fn default() -> Self {
        Self {
            tasks: Vec::new(),
            origin_session_id: None,
            pool: "default".to_owned(),
            role: Role::default(),
            model: None,
            toolsets: Vec::new(),
            timeout_seconds: None,
            depth: 1,
            parent_session_id: None,
            traceparent: None,
            wait: false,
            wake_mode: WakeMode::default(),
            notify_early_failure: false,
            output_schema: None,
            delegation_id: None,
        }
    }
}

impl Delegation {
    /// A delegation of one `goal` to the `default` pool, in sync mode.
    pub fn new(goal: impl Into<String>) -> Self {
        Self::batch([goal.into()])
    }

    /// A batch: one task per goal, all on the `default` pool.
    pub fn batch(goals: impl IntoIterator<Item = String>) -> Self {
        Self {
            tasks: goals
                .into_iter()
                .map(|goal| TaskSpec {
                    goal,
                    context: String::new(),
                })
                .collect(),
            ..Self::default()
        }
    }

    /// Sets the session to wake (background mode).
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.origin_session_id = Some(session.into());
        self
    }

    /// Sets the context of every task.
    pub fn context(mut self, context: impl Into<String>) -> Self {
        let context = context.into();
        for task in &mut self.tasks {
            task.context.clone_from(&context);
        }
        self
    }

    /// Sets the pool.
    pub fn pool(mut self, pool: impl Into<String>) -> Self {
        self.pool = pool.into();
        self
    }
}

/// What `delegate` returns; printed as JSON by the CLI.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum DelegateResult {
    /// Background mode: accepted; the session will be woken.
    Dispatched {
        /// Always `dispatched`.
        status: &'static str,
        /// Always `background`.
        mode: &'static str,
        /// The new delegation's id.
        delegation_id: String,
        /// How many tasks were submitted.
        tasks: usize,
        /// The completions, when `wait` was asked for.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        results: Vec<CompletionEvent>,
    },
    /// Sync mode: the completions, inline.
    Completed {
        /// The status of a single task, or `completed` when every task of a
        /// batch completed and `partial` otherwise.
        status: String,
        /// Always `sync`.
        mode: &'static str,
        /// The delegation id.
        delegation_id: String,
        /// The completion of a single task.
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Box<CompletionEvent>>,
        /// The completions of a batch, by task index.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        results: Vec<CompletionEvent>,
        /// Says that it ran synchronously and why.
        note: &'static str,
    },
}

impl DelegateResult {
    /// The delegation id.
    pub fn delegation_id(&self) -> &str {
        match self {
            Self::Dispatched { delegation_id, .. } | Self::Completed { delegation_id, .. } => {
                delegation_id
            }
        }
    }
}

/// The note on sync results.
pub const SYNC_NOTE: &str = "Ran SYNCHRONOUSLY: no origin session id was given, so there is no session to wake; the result is returned inline and no continuation turn will be posted.";

/// Why a delegation was not accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DelegateError {
    /// No task was given.
    #[error("a delegation needs at least one task")]
    NoTasks,
    /// A goal is empty.
    #[error("goal of task {0} must not be empty")]
    EmptyGoal(usize),
    /// The batch is larger than allowed.
    #[error(
        "batch of {size} tasks is larger than the limit of {max}; split it or raise the limit (at most 1000)"
    )]
    BatchTooLarge {
        /// Tasks given.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The output schema is not a usable JSON Schema.
    #[error("output_schema is not a valid JSON Schema: {0}")]
    OutputSchema(String),
    /// `timeout_seconds` is 0, which would time every task out at once.
    #[error("timeout_seconds must be at least 1 (None: the worker's default)")]
    ZeroTimeout,
    /// `depth` is 0: a top-level session delegates at depth 1.
    #[error("depth must be at least 1 (1: delegated by a top-level session)")]
    ZeroDepth,
    /// The delegation would nest subagents deeper than allowed.
    #[error("Delegation depth limit reached: depth {depth} is above the maximum of {max}")]
    DepthLimit {
        /// The requested depth.
        depth: u32,
        /// The configured maximum.
        max: u32,
    },
    /// An id or pool name is malformed.
    #[error(transparent)]
    InvalidId(#[from] IdError),
    /// The goal, context or whole request is larger than workers accept or
    /// the NATS server carries.
    #[error("delegation refused: {0}")]
    TooLarge(#[from] TooLarge),
    /// A request could not be encoded.
    #[error("the request could not be published: {0}")]
    Publish(#[from] PublishError),
    /// JetStream did not confirm every message of the delegation, after
    /// retries: some of its tasks may be stored (and will run), others
    /// not. Delegating again with the same [`Delegation::delegation_id`]
    /// stores the rest without running any task twice.
    #[error(
        "delegation {delegation_id} was not fully stored ({source}); some of its tasks may run: delegate it again with the same delegation id (--delegation-id {delegation_id}) to store the rest without running any task twice, or cancel it"
    )]
    NotStored {
        /// The delegation's id, to delegate again with.
        delegation_id: String,
        /// The last publish failure.
        source: PublishError,
    },
    /// No stream stores the subject: the bus was never provisioned under
    /// this prefix (or the prefix is wrong).
    #[error(
        "no JetStream stream stores {subject}: run `wakebus init` for this prefix, or check --prefix"
    )]
    NoStream {
        /// The subject the publish went to.
        subject: String,
    },
    /// Waiting for the completions failed, after the delegation was stored:
    /// it runs anyway (delegating again would run it twice).
    #[error(
        "delegation {delegation_id} was stored and runs, but waiting for its completion failed: {reason} (follow it with `wakebus events --delegation {delegation_id}`; do not delegate it again)"
    )]
    Wait {
        /// The stored delegation.
        delegation_id: String,
        /// Why the wait failed.
        reason: String,
    },
    /// Not every completion arrived within the wait timeout: the
    /// delegation was stored, and its tasks may still run.
    #[error(
        "{received} of {tasks} completions of delegation {delegation_id} arrived within {limit:?}; its tasks may still run (follow them with `wakebus events --delegation {delegation_id} --kind done --follow`; do not delegate it again)"
    )]
    WaitTimeout {
        /// The stored delegation.
        delegation_id: String,
        /// The wait timeout.
        limit: Duration,
        /// How many of its completions arrived.
        received: usize,
        /// How many tasks it has.
        tasks: usize,
    },
}

/// Submits delegations to one deployment.
#[derive(Debug, Clone)]
pub struct Delegator {
    /// The deployment.
    bus: Bus,
    /// How long sync mode (and `wait`) waits for completions; `None`: forever.
    wait_timeout: Option<Duration>,
    /// Deepest subagent nesting accepted.
    max_depth: u32,
    /// Largest batch accepted.
    max_batch: usize,
    /// Size limits checked before publishing, so an oversized delegation is
    /// refused here with a clear error rather than by a worker later.
    limits: Limits,
}

impl Delegator {
    /// A delegator on `bus`, waiting forever in sync mode.
    pub fn new(bus: Bus) -> Self {
        Self {
            bus,
            wait_timeout: None,
            max_depth: DEFAULT_MAX_DEPTH,
            max_batch: DEFAULT_MAX_BATCH,
            limits: Limits::default(),
        }
    }

    /// Sets the size limits (use the workers' limits).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Limits how long sync mode waits.
    pub fn with_wait_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Sets the deepest subagent nesting accepted (default 1: subagents cannot delegate).
    pub fn with_max_depth(mut self, max_depth: u32) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// Sets the largest batch accepted (default 10; never above
    /// [`crate::protocol::MAX_TASK_COUNT`]).
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// Publishes the requests and, in sync mode (or with `wait`), waits for
    /// every completion.
    pub async fn delegate(&self, delegation: Delegation) -> Result<DelegateResult, DelegateError> {
        let mut requests = self.requests(&delegation)?;
        let mut sent_before = Vec::new();
        if delegation.delegation_id.is_some()
            && let Some(first) = self.first_submitted_at(&requests[0]).await
        {
            for request in &mut requests {
                request.created_at = Some(first);
            }
            // The queue first: a worker stores a task's completion before
            // it acks the request, so a request gone from the queue by the
            // time it is read has its completion stored when that is read.
            sent_before = self.queued_tasks(&requests).await;
            let finished = self.finished_tasks(&requests).await;
            for (sent, finished) in sent_before.iter_mut().zip(finished) {
                *sent |= finished;
            }
        }
        // The delegation's span, parent of its tasks' spans (`otel` feature).
        let span = tracing::info_span!(
            "delegate",
            delegation_id = %requests[0].delegation_id,
            pool = %delegation.pool,
            trace_id = tracing::field::Empty,
        );
        let trace = crate::telemetry::hop(&span, delegation.traceparent);
        span.record("trace_id", trace.trace_id_hex());
        self.publish_all(&delegation.pool, &requests, &sent_before, trace)
            .instrument(span.clone())
            .await?;

        let delegation_id = requests[0].delegation_id.clone();
        let tasks = requests.len();
        let waits = delegation.wait || delegation.origin_session_id.is_none();
        let mut results = if waits {
            self.wait_for(&requests[0], tasks).await?
        } else {
            Vec::new()
        };
        if delegation.origin_session_id.is_some() {
            return Ok(DelegateResult::Dispatched {
                status: "dispatched",
                mode: "background",
                delegation_id,
                tasks,
                results,
            });
        }
        let status = match results.as_slice() {
            [only] => only.status.to_string(),
            all if all
                .iter()
                .all(|r| r.status == crate::protocol::Status::Completed) =>
            {
                "completed".to_owned()
            }
            _ => "partial".to_owned(),
        };
        let result = (tasks == 1).then(|| Box::new(results.remove(0)));
        Ok(DelegateResult::Completed {
            status,
            mode: "sync",
            delegation_id,
            result,
            results,
            note: SYNC_NOTE,
        })
    }

    /// Checks the delegation ([`check`]) and builds one request per task.
    fn requests(&self, delegation: &Delegation) -> Result<Vec<TaskRequest>, DelegateError> {
        check(delegation, self.max_batch, self.max_depth, &self.limits)?;
        let count = delegation.tasks.len();
        let delegation_id = delegation
            .delegation_id
            .clone()
            .unwrap_or_else(new_delegation_id);
        let created_at = Some(OffsetDateTime::now_utc());
        Ok(delegation
            .tasks
            .iter()
            .enumerate()
            .map(|(index, task)| {
                let mut request = TaskRequest::new(delegation_id.clone(), task.goal.clone());
                request.task_index = u32::try_from(index).unwrap_or(u32::MAX);
                request.task_count = u32::try_from(count).unwrap_or(u32::MAX);
                request.wake_mode = delegation.wake_mode;
                request.notify_early_failure = delegation.notify_early_failure;
                request
                    .origin_session_id
                    .clone_from(&delegation.origin_session_id);
                request.context.clone_from(&task.context);
                request.role = delegation.role;
                request.model.clone_from(&delegation.model);
                request.toolsets.clone_from(&delegation.toolsets);
                request.timeout_seconds = delegation.timeout_seconds;
                request.depth = delegation.depth;
                request
                    .parent_session_id
                    .clone_from(&delegation.parent_session_id);
                request.created_at = created_at;
                request.output_schema.clone_from(&delegation.output_schema);
                request
            })
            .collect())
    }

    /// When a delegation sent again under its id (a retry after
    /// [`DelegateError::NotStored`]) was first submitted: the server's time
    /// of its earliest `submitted` record. Its requests keep that as their
    /// `created_at`, so that a worker recognises a copy JetStream stored
    /// after its duplicate window and first asks whether the task already
    /// ran. `None` for an id not used before, or when this NATS user may not
    /// read the events stream (then a copy stored after the window may run
    /// again).
    async fn first_submitted_at(&self, first: &TaskRequest) -> Option<OffsetDateTime> {
        let token = crate::worker::token_for(first.origin_session_id.as_deref());
        let subject = format!(
            "{}.evt.{token}.{}.*.{}",
            self.bus.subjects.prefix(),
            first.delegation_id,
            crate::protocol::EventKind::Submitted.as_str()
        );
        let events = self
            .bus
            .js
            .get_stream_no_info(self.bus.subjects.events_stream())
            .await;
        let found = match events {
            Ok(events) => events.get_first_raw_message_by_subject(&subject, 1).await,
            Err(error) => {
                tracing::warn!(%error, delegation_id = %first.delegation_id, "Cannot read the events stream to tell whether this delegation was submitted before; a copy of a task stored after the duplicate window may run again.");
                return None;
            }
        };
        match found {
            Ok(record) => Some(record.time),
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => None,
            Err(error) => {
                tracing::warn!(%error, delegation_id = %first.delegation_id, "Cannot read this delegation's earlier submission; a copy of a task stored after the duplicate window may run again.");
                None
            }
        }
    }

    /// The tasks of a delegation sent before that already have their
    /// completion, by index: their requests are not sent again. The task
    /// queue drops a re-sent request as a duplicate only while it
    /// remembers its id: for its duplicate window (2 minutes by default),
    /// and a nats-server restart forgets the ids of requests already
    /// consumed (it rebuilds its duplicate window from the messages still
    /// stored, and the queue deletes each request once its task is done).
    /// A retry after the restart that made the first attempt fail would
    /// otherwise run a finished task again. Tasks still queued or running
    /// are [`Self::queued_tasks`]'.
    async fn finished_tasks(&self, requests: &[TaskRequest]) -> Vec<bool> {
        let Ok(events) = self
            .bus
            .js
            .get_stream_no_info(self.bus.subjects.events_stream())
            .await
        else {
            // Read a moment ago by `first_submitted_at`: every task is sent.
            return vec![false; requests.len()];
        };
        let token = crate::worker::token_for(requests[0].origin_session_id.as_deref());
        let finished = requests.iter().map(|request| {
            let subject = self.bus.subjects.event(
                &token,
                &request.delegation_id,
                request.task_index,
                crate::protocol::EventKind::Done,
            );
            let events = &events;
            async move {
                match events.get_last_raw_message_by_subject(&subject).await {
                    // Garbage on the subject, or a completion of another
                    // task (which the wake would not take for this one),
                    // is no completion of it: the task is sent.
                    Ok(done) => crate::protocol::CompletionEvent::decode(&done.payload)
                        .is_ok_and(|done| {
                            done.is_task_of(
                                &request.delegation_id,
                                request.task_index,
                                request.task_count,
                            )
                        }),
                    Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => false,
                    Err(error) => {
                        tracing::warn!(%error, delegation_id = %request.delegation_id, task_index = request.task_index, "Cannot tell whether this task finished before; sending it again (after a nats-server restart it may run twice).");
                        false
                    }
                }
            }
        });
        futures::future::join_all(finished).await
    }

    /// The tasks of a delegation sent before whose requests are still in
    /// the task queue (waiting, or running and not acknowledged), by index:
    /// the queue forgets a request's id once its duplicate window has
    /// passed, even while it holds the request, so a copy sent later would
    /// be stored beside it and the task run twice. When the queue cannot be
    /// read, or is too long to read, none: every task without a completion
    /// is sent, as before.
    async fn queued_tasks(&self, requests: &[TaskRequest]) -> Vec<bool> {
        let delegation_id = &requests[0].delegation_id;
        match self.bus.queued_tasks(delegation_id).await {
            Ok(Some(queued)) => requests
                .iter()
                .map(|request| queued.contains(&request.task_index))
                .collect(),
            Ok(None) => {
                tracing::warn!(%delegation_id, "The task queue is too long to tell whether this delegation's requests are still in it; sending those without a completion again (one still queued and sent after its duplicate window runs twice).");
                vec![false; requests.len()]
            }
            Err(error) => {
                tracing::warn!(%error, %delegation_id, "Cannot read the task queue to tell whether this delegation's requests are still in it; sending those without a completion again (one still queued and sent after its duplicate window runs twice).");
                vec![false; requests.len()]
            }
        }
    }
}

/// Refuses a delegation that [`Delegator::delegate`] would refuse before it
/// sends anything, under these limits (those a [`Delegator`] is given with
/// `with_max_batch`, `with_max_depth` and `with_limits`), without a
/// connection: `wakebus delegate` checks its arguments with it before it
/// connects, so that a mistake is not reported as an outage.
pub fn check(
    delegation: &Delegation,
    max_batch: usize,
    max_depth: u32,
    limits: &Limits,
) -> Result<(), DelegateError> {
    let count = delegation.tasks.len();
    if count == 0 {
        return Err(DelegateError::NoTasks);
    }
    // A raised limit still stops at the protocol's.
    let max = max_batch.min(crate::protocol::MAX_TASK_COUNT as usize);
    if count > max {
        return Err(DelegateError::BatchTooLarge { size: count, max });
    }
    if let Some(index) = delegation
        .tasks
        .iter()
        .position(|t| t.goal.trim().is_empty())
    {
        return Err(DelegateError::EmptyGoal(index));
    }
    for task in &delegation.tasks {
        limits.check_fields(&task.goal, &task.context)?;
    }
    validate_pool(&delegation.pool)?;
    if let Some(schema) = &delegation.output_schema {
        crate::protocol::check_output_schema(schema).map_err(DelegateError::OutputSchema)?;
    }
    if let Some(session) = &delegation.origin_session_id {
        validate_session_id(session)?;
    }
    if delegation.timeout_seconds == Some(0) {
        return Err(DelegateError::ZeroTimeout);
    }
    if delegation.depth == 0 {
        return Err(DelegateError::ZeroDepth);
    }
    if delegation.depth > max_depth {
        return Err(DelegateError::DepthLimit {
            depth: delegation.depth,
            max: max_depth,
        });
    }
    if let Some(id) = &delegation.delegation_id {
        validate_delegation_id(id)?;
    }
    Ok(())
}
