//! Delegating: turning a goal into a request on the bus.
//!
//! With an origin session the call returns as soon as JetStream has stored
//! the request (background mode); the wake service later continues that
//! session. Without one there is nothing to wake, so the call waits for the
//! completion and returns it inline (sync mode).

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use time::OffsetDateTime;

use crate::bus::{Bus, PublishError};
use crate::protocol::{
    CompletionEvent, EventHeaders, EventKind, IdError, Limits, PROTOCOL_VERSION, Role, TaskRequest,
    TooLarge, TraceParent, new_delegation_id, validate_pool, validate_session_id,
};

/// What to delegate.
#[derive(Debug, Clone, Default)]
pub struct Delegation {
    /// What the subagent should achieve.
    pub goal: String,
    /// Background for the subagent.
    pub context: String,
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
    /// The delegating agent's depth (0 for a top-level session).
    pub depth: u32,
    /// The delegating agent's session, if it differs from the origin.
    pub parent_session_id: Option<String>,
    /// A trace to continue; a new one is started otherwise.
    pub traceparent: Option<TraceParent>,
    /// Also wait for the completion in background mode.
    pub wait: bool,
}

impl Delegation {
    /// A delegation of `goal` to the `default` pool, in sync mode.
    pub fn new(goal: impl Into<String>) -> Self {
        Self {
            goal: goal.into(),
            pool: "default".to_owned(),
            ..Self::default()
        }
    }

    /// Sets the session to wake (background mode).
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.origin_session_id = Some(session.into());
        self
    }

    /// Sets the context.
    pub fn context(mut self, context: impl Into<String>) -> Self {
        self.context = context.into();
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
        /// The completion, when `wait` was asked for.
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Box<CompletionEvent>>,
    },
    /// Sync mode: the completion, inline.
    Completed {
        /// The task's status.
        status: String,
        /// Always `sync`.
        mode: &'static str,
        /// The delegation id.
        delegation_id: String,
        /// The completion event.
        result: Box<CompletionEvent>,
        /// Says that it ran synchronously and why.
        note: &'static str,
    },
}

/// The note on sync results.
pub const SYNC_NOTE: &str = "Ran SYNCHRONOUSLY: no origin session id was given, so there is no session to wake; the result is returned inline and no continuation turn will be posted.";

/// Why a delegation was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum DelegateError {
    /// The goal is empty.
    #[error("goal must not be empty")]
    EmptyGoal,
    /// An id or pool name is malformed.
    #[error(transparent)]
    InvalidId(#[from] IdError),
    /// The goal, context or whole request is larger than workers accept or
    /// the NATS server carries.
    #[error("delegation refused: {0}")]
    TooLarge(#[from] TooLarge),
    /// JetStream did not confirm the request.
    #[error("the request was not accepted by JetStream: {0}")]
    Publish(#[from] PublishError),
    /// Waiting for the completion failed.
    #[error("could not wait for the completion: {0}")]
    Wait(String),
    /// No completion arrived within the wait timeout.
    #[error("no completion within {0:?}; the task may still run (delegation {1})")]
    WaitTimeout(Duration, String),
}

/// Submits delegations to one deployment.
#[derive(Debug, Clone)]
pub struct Delegator {
    /// The deployment.
    bus: Bus,
    /// How long sync mode (and `wait`) waits for a completion; `None`: forever.
    wait_timeout: Option<Duration>,
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

    /// Publishes the request and, in sync mode (or with `wait`), waits for its completion.
    pub async fn delegate(&self, delegation: Delegation) -> Result<DelegateResult, DelegateError> {
        if delegation.goal.trim().is_empty() {
            return Err(DelegateError::EmptyGoal);
        }
        validate_pool(&delegation.pool)?;
        if let Some(session) = &delegation.origin_session_id {
            validate_session_id(session)?;
        }
        self.limits
            .check_fields(&delegation.goal, &delegation.context)?;
        let request = TaskRequest {
            version: PROTOCOL_VERSION,
            delegation_id: new_delegation_id(),
            task_index: 0,
            origin_session_id: delegation.origin_session_id.clone(),
            goal: delegation.goal,
            context: delegation.context,
            role: delegation.role,
            model: delegation.model,
            toolsets: delegation.toolsets,
            timeout_seconds: delegation.timeout_seconds,
            depth: delegation.depth,
            parent_session_id: delegation.parent_session_id,
            created_at: Some(OffsetDateTime::now_utc()),
        };
        let trace = delegation
            .traceparent
            .map_or_else(TraceParent::new_root, |t| t.child());
        self.publish(&delegation.pool, &request, trace).await?;

        let delegation_id = request.delegation_id.clone();
        match request.origin_session_id {
            Some(_) => {
                let result = if delegation.wait {
                    Some(Box::new(self.wait_for(&request).await?))
                } else {
                    None
                };
                Ok(DelegateResult::Dispatched {
                    status: "dispatched",
                    mode: "background",
                    delegation_id,
                    result,
                })
            }
            None => {
                let done = self.wait_for(&request).await?;
                Ok(DelegateResult::Completed {
                    status: done.status.to_string(),
                    mode: "sync",
                    delegation_id,
                    result: Box::new(done),
                    note: SYNC_NOTE,
                })
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

    /// Publishes one request, idempotently (same `Nats-Msg-Id` on a retry).
    async fn publish(
        &self,
        pool: &str,
        request: &TaskRequest,
        trace: TraceParent,
    ) -> Result<(), DelegateError> {
        let id = format!("{}.{}", request.delegation_id, request.task_index);
        let headers = EventHeaders {
            id: &id,
            ce_type: "io.wakebus.task.requested",
            source: "wakebus/delegate",
            origin_session: request.origin_session_id.as_deref(),
            delegation_id: &request.delegation_id,
            task_index: request.task_index,
            traceparent: trace,
        }
        .to_header_map();
        let payload = Bytes::from(serde_json::to_vec(request).map_err(PublishError::from)?);
        self.check_size(payload.len(), request)?;
        let subject = self.bus.subjects.task(pool);
        let mut last_error = None;
        // A lost ack is retried with the same id: JetStream drops the duplicate.
        for _ in 0..3 {
            match self
                .bus
                .js
                .publish_with_headers(subject.clone(), headers.clone(), payload.clone())
                .await
            {
                Ok(ack) => match ack.await {
                    Ok(_) => return Ok(()),
                    Err(error) => last_error = Some(error),
                },
                Err(error) => last_error = Some(error),
            }
        }
        Err(PublishError::Publish(last_error.expect("loop ran")).into())
    }

    /// Reads the task's completion from the events stream (stored or future).
    async fn wait_for(&self, request: &TaskRequest) -> Result<CompletionEvent, DelegateError> {
        let token = crate::worker::token_for(request.origin_session_id.as_deref());
        let subject = self.bus.subjects.event(
            &token,
            &request.delegation_id,
            request.task_index,
            EventKind::Done,
        );
        let wait = async {
            let stream = self
                .bus
                .js
                .get_stream(self.bus.subjects.events_stream())
                .await
                .map_err(|e| DelegateError::Wait(e.to_string()))?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    // Named, so that the name and filter are in the API
                    // subject and NATS permissions can check them; unique,
                    // so that two waiters never share one.
                    name: Some(format!(
                        "wait-{}-{}-{}",
                        request.delegation_id,
                        request.task_index,
                        ulid::Ulid::new()
                    )),
                    filter_subject: subject,
                    deliver_policy: DeliverPolicy::All,
                    ..Default::default()
                })
                .await
                .map_err(|e| DelegateError::Wait(e.to_string()))?;
            let mut messages = consumer
                .messages()
                .await
                .map_err(|e| DelegateError::Wait(e.to_string()))?;
            loop {
                match messages.next().await {
                    Some(Ok(message)) => match CompletionEvent::decode(&message.payload) {
                        Ok(done) => return Ok(done),
                        Err(error) => {
                            return Err(DelegateError::Wait(format!(
                                "completion is not valid: {error}"
                            )));
                        }
                    },
                    Some(Err(error)) => {
                        tracing::debug!(%error, "Ordered consumer hiccup; it recreates itself.");
                    }
                    None => return Err(DelegateError::Wait("event stream ended".to_owned())),
                }
            }
        };
        match self.wait_timeout {
            Some(limit) => tokio::time::timeout(limit, wait)
                .await
                .map_err(|_| DelegateError::WaitTimeout(limit, request.delegation_id.clone()))?,
            None => wait.await,
        }
    }
}
