//! Running `wakebus` tool commands (events, replay, status) as processes,
//! and publishing synthetic history for them to read.

use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use wakebus::bus::Bus;
use wakebus::protocol::{
    CompletionEvent, EventHeaders, EventKind, StartedEvent, Status, TaskRequest, TraceParent,
    new_delegation_id, session_token,
};

/// What a finished `wakebus` command printed.
pub struct Run {
    pub output: Output,
}

impl Run {
    pub fn success(&self) -> bool {
        self.output.status.success()
    }

    pub fn code(&self) -> Option<i32> {
        self.output.status.code()
    }

    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    /// Every stdout line as JSON; panics (showing the output) on anything else.
    pub fn json_lines(&self) -> Vec<Value> {
        self.stdout()
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nstderr: {}", self.stderr()))
            })
            .collect()
    }

    /// Asserts success and returns the JSON lines.
    pub fn ok_json(&self) -> Vec<Value> {
        assert!(
            self.success(),
            "wakebus failed ({:?}): {}{}",
            self.code(),
            self.stderr(),
            self.stdout()
        );
        self.json_lines()
    }
}

/// The base arguments of a tool command for one deployment.
pub fn tool_args(nats_url: &str, prefix: &str, args: &[&str]) -> Vec<String> {
    let mut all = vec![
        "--nats-url".to_owned(),
        nats_url.to_owned(),
        "--prefix".to_owned(),
        prefix.to_owned(),
    ];
    all.extend(args.iter().map(|s| s.to_string()));
    all
}

/// Runs `wakebus <global> <args>` to completion (stdout is a pipe, so
/// output is JSON lines).
pub async fn wakebus(nats_url: &str, prefix: &str, args: &[&str]) -> Run {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .args(tool_args(nats_url, prefix, args))
            .env_remove("NATS_URL")
            .env_remove("WAKEBUS_PREFIX")
            .env_remove("WAKEBUS_METRICS_ADDR")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("wakebus did not finish within 60s")
    .expect("run wakebus");
    Run { output }
}

/// A request for `session` (sync mode when `None`).
pub fn request(session: Option<&str>, goal: &str) -> TaskRequest {
    let mut request = TaskRequest::new(new_delegation_id(), goal);
    request.origin_session_id = session.map(str::to_owned);
    request
}

/// Publishes one event for `request` as a worker would; returns its stream sequence.
pub async fn publish_event(
    bus: &Bus,
    request: &TaskRequest,
    kind: EventKind,
    body: &impl serde::Serialize,
) -> u64 {
    let token = request
        .origin_session_id
        .as_deref()
        .map_or_else(|| "sync".to_owned(), session_token);
    let subject = bus
        .subjects
        .event(&token, &request.delegation_id, request.task_index, kind);
    let id = match kind {
        EventKind::Done => CompletionEvent::id_for(&request.delegation_id, request.task_index),
        other => format!(
            "{}.{}.{}.{}",
            request.delegation_id,
            request.task_index,
            other.as_str(),
            ulid::Ulid::new()
        ),
    };
    let headers = EventHeaders {
        id: &id,
        ce_type: kind.ce_type(),
        source: "wakebus/worker/test",
        origin_session: request.origin_session_id.as_deref(),
        delegation_id: &request.delegation_id,
        task_index: request.task_index,
        traceparent: TraceParent::new_root(),
    }
    .to_header_map();
    let payload: bytes::Bytes = serde_json::to_vec(body).unwrap().into();
    bus.js
        .publish_with_headers(subject, headers, payload)
        .await
        .expect("publish")
        .await
        .expect("stored")
        .sequence
}

/// Publishes a started and a done event for a new task of `session`;
/// returns the request and the two stream sequences.
pub async fn publish_task(
    bus: &Bus,
    session: Option<&str>,
    status: Status,
) -> (TaskRequest, u64, u64) {
    let request = request(session, "synthetic");
    let started = StartedEvent::for_request(&request, "test-worker", 1);
    let started_seq = publish_event(bus, &request, EventKind::Started, &started).await;
    let mut done = CompletionEvent::for_request(&request, status, "completed");
    done.summary = Some(format!("{status} summary"));
    let done_seq = publish_event(bus, &request, EventKind::Done, &done).await;
    (request, started_seq, done_seq)
}

/// `field` of every JSON line, as strings.
pub fn field(lines: &[Value], field: &str) -> Vec<String> {
    lines
        .iter()
        .map(|line| match &line[field] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect()
}
