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

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::RawMessageErrorKind;
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use time::OffsetDateTime;
use tracing::Instrument as _;

use crate::bus::{Bus, PublishError};
use crate::protocol::{
    CompletionEvent, DEFAULT_MAX_DEPTH, EventHeaders, EventKind, IdError, Limits, Role,
    SubmittedRecord, TaskRequest, TooLarge, TraceParent, WakeMode, new_delegation_id,
    validate_delegation_id, validate_pool, validate_session_id,
};

/// The largest batch accepted by default.
pub const DEFAULT_MAX_BATCH: usize = 10;

/// The waits before publishing again what JetStream did not confirm.
const PUBLISH_RETRY_WAITS: [Duration; 2] = [Duration::from_millis(250), Duration::from_secs(1)];

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
    #[error("batch of {size} tasks is larger than the limit of {max}; split it or raise the limit")]
    BatchTooLarge {
        /// Tasks given.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The output schema is not a usable JSON Schema.
    #[error("output_schema is not a valid JSON Schema: {0}")]
    OutputSchema(String),
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
    /// Waiting for the completions failed.
    #[error("could not wait for the completion: {0}")]
    Wait(String),
    /// Not every completion arrived within the wait timeout.
    #[error("no completion within {0:?}; the task may still run (delegation {1})")]
    WaitTimeout(Duration, String),
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

    /// Sets the largest batch accepted (default 10).
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// Publishes the requests and, in sync mode (or with `wait`), waits for
    /// every completion.
    pub async fn delegate(&self, delegation: Delegation) -> Result<DelegateResult, DelegateError> {
        let mut requests = self.requests(&delegation)?;
        if delegation.delegation_id.is_some()
            && let Some(first) = self.first_submitted_at(&requests[0]).await
        {
            for request in &mut requests {
                request.created_at = Some(first);
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
        self.publish_all(&delegation.pool, &requests, trace)
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

    /// Validates the delegation and builds one request per task.
    fn requests(&self, delegation: &Delegation) -> Result<Vec<TaskRequest>, DelegateError> {
        let count = delegation.tasks.len();
        if count == 0 {
            return Err(DelegateError::NoTasks);
        }
        if count > self.max_batch {
            return Err(DelegateError::BatchTooLarge {
                size: count,
                max: self.max_batch,
            });
        }
        if let Some(index) = delegation
            .tasks
            .iter()
            .position(|t| t.goal.trim().is_empty())
        {
            return Err(DelegateError::EmptyGoal(index));
        }
        for task in &delegation.tasks {
            self.limits.check_fields(&task.goal, &task.context)?;
        }
        validate_pool(&delegation.pool)?;
        if let Some(schema) = &delegation.output_schema {
            crate::protocol::check_output_schema(schema).map_err(DelegateError::OutputSchema)?;
        }
        if let Some(session) = &delegation.origin_session_id {
            validate_session_id(session)?;
        }
        if delegation.depth > self.max_depth {
            return Err(DelegateError::DepthLimit {
                depth: delegation.depth,
                max: self.max_depth,
            });
        }
        let delegation_id = match &delegation.delegation_id {
            Some(id) => {
                validate_delegation_id(id)?;
                id.clone()
            }
            None => new_delegation_id(),
        };
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

    /// Checks the encoded request against the limits and the server's max payload.
    fn check_size(&self, len: usize, request: &TaskRequest) -> Result<(), TooLarge> {
        self.limits.check_body(len)?;
        // Headers count against max_payload too: ours take well under 1 KiB
        // plus the session id.
        let headers = 1024 + request.origin_session_id.as_ref().map_or(0, String::len);
        // Zero until the client has connected: the server then has the last word.
        let max_payload = self.bus.client.server_info().max_payload;
        if max_payload > 0 && len + headers > max_payload {
            return Err(TooLarge {
                what: "request with its headers (the NATS server's max_payload)",
                len: len + headers,
                max: max_payload,
            });
        }
        Ok(())
    }

    /// Writes every task's `submitted` record and waits until JetStream has
    /// stored them, then publishes every request and waits for all acks
    /// (each step pipelined: one round trip per step, not per task).
    ///
    /// The records go first so that no completion can exist without one: a
    /// wake that verifies origins would refuse it.
    async fn publish_all(
        &self,
        pool: &str,
        requests: &[TaskRequest],
        trace: TraceParent,
    ) -> Result<(), DelegateError> {
        let subject = self.bus.subjects.task(pool);
        let traceparent = trace.to_string();
        let mut records = Vec::with_capacity(requests.len());
        let mut pending = Vec::with_capacity(requests.len());
        for request in requests {
            let token = crate::worker::token_for(request.origin_session_id.as_deref());
            let record = SubmittedRecord::for_request(request, pool, Some(traceparent.clone()));
            records.push((
                self.bus
                    .subjects
                    .submitted(&token, &request.delegation_id, request.task_index),
                Self::record_headers(request, trace),
                Bytes::from(serde_json::to_vec(&record).map_err(PublishError::from)?),
            ));
            let payload = Bytes::from(serde_json::to_vec(request).map_err(PublishError::from)?);
            self.check_size(payload.len(), request)?;
            pending.push((subject.clone(), Self::task_headers(request, trace), payload));
        }
        let stored = match self
            .publish_stored(records, |i| Self::record_headers(&requests[i], trace))
            .await
        {
            Ok(()) => {
                self.publish_stored(pending, |i| Self::task_headers(&requests[i], trace))
                    .await
            }
            failed => failed,
        };
        let Err((subject, error)) = stored else {
            return Ok(());
        };
        // "No responders" can also mean a stream between leaders; say to
        // run `init` only when no stream takes the subject at all.
        if error.kind() == PublishErrorKind::StreamNotFound
            && self
                .bus
                .js
                .stream_by_subject(&subject)
                .await
                .is_err_and(|e| {
                    e.kind() == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound
                })
        {
            return Err(DelegateError::NoStream { subject });
        }
        Err(DelegateError::NotStored {
            delegation_id: requests[0].delegation_id.clone(),
            source: PublishError::Publish(error),
        })
    }

    /// The headers of a task's `submitted` record. Built the same way on a
    /// retry, so the retry carries the same dedupe id.
    fn record_headers(request: &TaskRequest, trace: TraceParent) -> async_nats::HeaderMap {
        let id = SubmittedRecord::id_for(&request.delegation_id, request.task_index);
        Self::headers(&id, EventKind::Submitted.ce_type(), request, trace)
    }

    /// The headers of a task request; its dedupe id is
    /// `<delegation_id>.<task_index>`, the same on every attempt.
    fn task_headers(request: &TaskRequest, trace: TraceParent) -> async_nats::HeaderMap {
        let id = format!("{}.{}", request.delegation_id, request.task_index);
        Self::headers(&id, "io.wakebus.task.requested", request, trace)
    }

    /// The headers of a delegator's publish.
    fn headers(
        id: &str,
        ce_type: &str,
        request: &TaskRequest,
        trace: TraceParent,
    ) -> async_nats::HeaderMap {
        EventHeaders {
            id,
            ce_type,
            source: "wakebus/delegate",
            origin_session: request.origin_session_id.as_deref(),
            delegation_id: &request.delegation_id,
            task_index: request.task_index,
            traceparent: trace,
        }
        .to_header_map()
    }

    /// Publishes every message, then waits for all acks (pipelined), and
    /// publishes again what was not confirmed: up to three attempts, 250 ms
    /// and then 1 s apart, so that a stream leader election (which refuses
    /// writes for about a second) does not fail the delegation. Returns the
    /// subject and error of the last failure.
    ///
    /// A lost ack is retried with the same id: JetStream drops duplicates.
    /// The first attempt gives each message's headers away (cloning a
    /// header map costs more than building it); a retry builds message
    /// `i`'s again with `headers_again(i)`.
    async fn publish_stored(
        &self,
        messages: Vec<(String, async_nats::HeaderMap, Bytes)>,
        headers_again: impl Fn(usize) -> async_nats::HeaderMap,
    ) -> Result<(), (String, async_nats::jetstream::context::PublishError)> {
        let mut unconfirmed: Vec<_> = messages.into_iter().enumerate().collect();
        let mut last_error = None;
        for (attempt, wait) in [Duration::ZERO]
            .iter()
            .chain(&PUBLISH_RETRY_WAITS)
            .enumerate()
        {
            if unconfirmed.is_empty() {
                return Ok(());
            }
            if !wait.is_zero() {
                tokio::time::sleep(*wait).await;
            }
            let mut acks = Vec::with_capacity(unconfirmed.len());
            for (i, (subject, headers, payload)) in &mut unconfirmed {
                let headers = match attempt {
                    0 => std::mem::take(headers),
                    _ => headers_again(*i),
                };
                let ack = self
                    .bus
                    .js
                    .publish_with_headers(subject.clone(), headers, payload.clone())
                    .await;
                acks.push(ack);
            }
            let mut results = Vec::with_capacity(acks.len());
            for ack in acks {
                results.push(match ack {
                    Ok(ack) => ack.await.map(drop),
                    Err(error) => Err(error),
                });
            }
            let mut results = results.into_iter();
            unconfirmed.retain(|(_, (subject, ..))| match results.next() {
                Some(Err(error)) => {
                    last_error = Some((subject.clone(), error));
                    true
                }
                _ => false,
            });
        }
        if unconfirmed.is_empty() {
            Ok(())
        } else {
            Err(last_error.expect("an unconfirmed message has its error"))
        }
    }

    /// Reads the delegation's completions from the events stream (stored or
    /// future) until every task has one; returns them by task index.
    async fn wait_for(
        &self,
        first: &TaskRequest,
        tasks: usize,
    ) -> Result<Vec<CompletionEvent>, DelegateError> {
        let token = crate::worker::token_for(first.origin_session_id.as_deref());
        let subject = format!(
            "{}.evt.{token}.{}.*.done",
            self.bus.subjects.prefix(),
            first.delegation_id
        );
        let wait = async {
            let failed = |e: &dyn std::fmt::Display| DelegateError::Wait(e.to_string());
            let stream = self
                .bus
                .js
                .get_stream(self.bus.subjects.events_stream())
                .await
                .map_err(|e| failed(&e))?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    // Named, so that the name and filter are in the API
                    // subject and NATS permissions can check them; unique,
                    // so that two waiters never share one.
                    name: Some(format!(
                        "wait-{}-{}",
                        first.delegation_id,
                        ulid::Ulid::new()
                    )),
                    filter_subject: subject,
                    deliver_policy: DeliverPolicy::All,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(&e))?;
            let mut messages = consumer.messages().await.map_err(|e| failed(&e))?;
            let mut done = BTreeMap::new();
            while done.len() < tasks {
                match messages.next().await {
                    // Garbage on the subject (anyone may publish there)
                    // neither ends the wait early nor fails it.
                    Some(Ok(message)) => match CompletionEvent::decode(&message.payload) {
                        Ok(event) if (event.task_index as usize) < tasks => {
                            done.insert(event.task_index, event);
                        }
                        Ok(event) => {
                            tracing::warn!(subject = %message.subject, task_index = event.task_index, tasks, "A completion names a task this delegation does not have; ignoring it.");
                        }
                        Err(error) => {
                            tracing::warn!(subject = %message.subject, %error, "A completion cannot be read; ignoring it.");
                        }
                    },
                    Some(Err(error)) => {
                        tracing::debug!(%error, "Ordered consumer hiccup; it recreates itself.");
                    }
                    None => return Err(DelegateError::Wait("event stream ended".to_owned())),
                }
            }
            Ok(done.into_values().collect())
        };
        match self.wait_timeout {
            Some(limit) => tokio::time::timeout(limit, wait)
                .await
                .map_err(|_| DelegateError::WaitTimeout(limit, first.delegation_id.clone()))?,
            None => wait.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        HEADER_CE_ID, HEADER_DELEGATION_ID, HEADER_MSG_ID, HEADER_ORIGIN_SESSION,
        HEADER_TASK_INDEX, HEADER_TRACEPARENT,
    };

    /// `publish_stored` gives the first attempt's header maps away and
    /// builds them again for a retry: JetStream drops a retried message as
    /// a duplicate only if the rebuilt headers carry the same ids.
    #[test]
    fn a_retried_publish_carries_the_first_attempts_dedupe_id_and_trace() {
        let mut request = TaskRequest::new("01JDELEGATION", "goal");
        request.task_index = 2;
        request.origin_session_id = Some("s.retry".to_owned());
        let trace = TraceParent::new_root();
        type Build = fn(&TaskRequest, TraceParent) -> async_nats::HeaderMap;
        let builders: [(Build, String); 2] = [
            (
                Delegator::record_headers,
                SubmittedRecord::id_for("01JDELEGATION", 2),
            ),
            (Delegator::task_headers, "01JDELEGATION.2".to_owned()),
        ];
        for (build, id) in builders {
            let (first, again) = (build(&request, trace), build(&request, trace));
            let value = |map: &async_nats::HeaderMap, name: &str| {
                map.get(name).map(|v| v.as_str().to_owned())
            };
            assert_eq!(value(&first, HEADER_MSG_ID).as_deref(), Some(id.as_str()));
            for name in [
                HEADER_MSG_ID,
                HEADER_CE_ID,
                HEADER_TRACEPARENT,
                HEADER_ORIGIN_SESSION,
                HEADER_DELEGATION_ID,
                HEADER_TASK_INDEX,
            ] {
                assert!(value(&first, name).is_some(), "{name} is set");
                assert_eq!(value(&first, name), value(&again, name), "{name}");
            }
        }
    }
}
