//! Keeps the wire contract in sync: the protocol types in `src/protocol/`, the
//! JSON Schemas in `schema/` and the examples in `docs/PROTOCOL.md`.
//!
//! Documentation examples are fenced blocks whose info string carries
//! `example=<name>`, and `schema=<stem>` when the block is a body that must
//! validate against `schema/<stem>.schema.json`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::{Value, json};
use time::macros::datetime;
use wakebus::cancel::{CancelRecord, CancelReport, CancelTarget, DelegationState};
use wakebus::delegate::DelegateResult;
use wakebus::protocol::{
    CompletionEvent, PROTOCOL_VERSION, ProgressEvent, Role, StartedEvent, Status, Subjects,
    SubmittedRecord, TaskRequest, WakeMode, session_token,
};
use wakebus::wake::turn;

const REQUEST: &str = "task-request";
const STARTED: &str = "started-event";
const PROGRESS: &str = "progress-event";
const COMPLETION: &str = "completion-event";
const SUBMITTED: &str = "submitted-record";
const CANCEL: &str = "cancel-record";
const SCHEMAS: [&str; 6] = [REQUEST, STARTED, PROGRESS, COMPLETION, SUBMITTED, CANCEL];
/// Schemas without a string pattern: every field is a date, a number or a
/// flag.
const WITHOUT_PATTERNS: [&str; 1] = [CANCEL];

/// Completion fields the library leaves out when they are false or unknown;
/// every other field is always written.
const COMPLETION_OMITTED_WHEN_EMPTY: [&str; 5] = [
    "notify_early_failure",
    "truncated",
    "prompt_tokens",
    "completion_tokens",
    "suppress_wake",
];

fn repo_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    let path = repo_path(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn schema(stem: &str) -> Value {
    let text = read(&format!("schema/{stem}.schema.json"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{stem} schema is not JSON: {e}"))
}

fn validator(stem: &str) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema(stem))
        .unwrap_or_else(|e| panic!("{stem} schema does not compile: {e}"))
}

fn schema_errors(stem: &str, instance: &Value) -> Vec<String> {
    validator(stem)
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

fn assert_valid(stem: &str, instance: &Value) {
    let errors = schema_errors(stem, instance);
    assert!(
        errors.is_empty(),
        "{stem} schema rejects {instance:#}:\n{}",
        errors.join("\n")
    );
}

/// Whether the library accepts `body` as the body of kind `stem`, exactly as
/// its readers decode it (requests are also validated).
fn library_accepts(stem: &str, body: &Value) -> Result<(), String> {
    let bytes = serde_json::to_vec(body).expect("a Value serializes");
    match stem {
        REQUEST => TaskRequest::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        STARTED => StartedEvent::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        PROGRESS => ProgressEvent::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        COMPLETION => CompletionEvent::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        SUBMITTED => SubmittedRecord::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        // As workers read a stored record and a broadcast.
        CANCEL => serde_json::from_slice::<CancelRecord>(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        other => panic!("no decoder for {other}"),
    }
}

fn full_request() -> TaskRequest {
    TaskRequest {
        version: PROTOCOL_VERSION,
        delegation_id: "01JV3N4Y8K6D2Q7R9T1W5X0ZAB".to_owned(),
        task_index: 3,
        origin_session_id: Some("sess.42 *>  ünïcode ✓".to_owned()),
        goal: "Summarise the open incidents".to_owned(),
        context: "eu-west payment gateway".to_owned(),
        role: Role::Orchestrator,
        model: Some("hermes-4-70b".to_owned()),
        toolsets: vec!["web".to_owned(), "terminal".to_owned()],
        timeout_seconds: Some(900),
        depth: 1,
        parent_session_id: Some("parent session".to_owned()),
        created_at: Some(datetime!(2025-05-14 09:30:21.004518 UTC)),
        task_count: 5,
        wake_mode: WakeMode::Independent,
        notify_early_failure: true,
        output_schema: Some(serde_json::json!({"type": "object"})),
    }
}

fn minimal_request() -> TaskRequest {
    TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":"g"}"#)
        .expect("the minimal request decodes")
}

/// A completion with every optional field set, as a worker would publish it.
fn full_completion() -> CompletionEvent {
    let mut done = CompletionEvent::for_request(&full_request(), Status::Failed, "nonzero_exit");
    done.summary = Some("partial result".to_owned());
    done.error = Some("exit code 2: boom".to_owned());
    done.api_calls = 4;
    done.prompt_tokens = Some(1200);
    done.completion_tokens = Some(340);
    done.duration_seconds = 12.5;
    done.suppress_wake = true;
    done.truncated = true;
    done
}

/// A body of each kind with every field the library writes present and non-null.
fn full_body(stem: &str) -> Value {
    let value = match stem {
        REQUEST => serde_json::to_value(full_request()),
        STARTED => serde_json::to_value(StartedEvent::for_request(&full_request(), "worker-a", 2)),
        PROGRESS => serde_json::to_value(ProgressEvent::for_request(
            &full_request(),
            "worker-a",
            "model call 2".to_owned(),
        )),
        COMPLETION => serde_json::to_value(full_completion()),
        SUBMITTED => serde_json::to_value(SubmittedRecord::for_request(
            &full_request(),
            "gpu",
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned()),
        )),
        CANCEL => serde_json::to_value(CancelRecord {
            at: datetime!(2025-05-14 09:50:59.812005 UTC),
            silent: true,
        }),
        other => panic!("no body for {other}"),
    };
    value.expect("library bodies serialize")
}

fn properties(stem: &str) -> BTreeSet<String> {
    schema(stem)["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("{stem} schema has no properties"))
        .keys()
        .cloned()
        .collect()
}

fn required(stem: &str) -> BTreeSet<String> {
    schema(stem)["required"]
        .as_array()
        .unwrap_or_else(|| panic!("{stem} schema has no required list"))
        .iter()
        .map(|v| v.as_str().expect("required entries are strings").to_owned())
        .collect()
}

/// One fenced block of `docs/PROTOCOL.md`.
#[derive(Debug)]
struct Block {
    /// The first word of the info string (`json`, `text`, `sh`...).
    lang: String,
    /// `key=value` words of the info string.
    attrs: BTreeMap<String, String>,
    /// The lines between the fences, each followed by `\n`.
    content: String,
}

fn protocol_blocks() -> Vec<Block> {
    let text = read("docs/PROTOCOL.md");
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for line in text.lines() {
        match open.as_mut() {
            None => {
                if let Some(info) = line.strip_prefix("```") {
                    let mut words = info.split_whitespace();
                    let lang = words.next().unwrap_or_default().to_owned();
                    let attrs = words
                        .filter_map(|w| w.split_once('='))
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect();
                    open = Some(Block {
                        lang,
                        attrs,
                        content: String::new(),
                    });
                }
            }
            Some(block) => {
                if line.trim_end() == "```" {
                    blocks.extend(open.take());
                } else {
                    block.content.push_str(line);
                    block.content.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "PROTOCOL.md has an unclosed code fence");
    blocks
}

fn example(name: &str) -> Block {
    protocol_blocks()
        .into_iter()
        .find(|b| b.attrs.get("example").map(String::as_str) == Some(name))
        .unwrap_or_else(|| panic!("PROTOCOL.md has no example={name} block"))
}

fn example_json(name: &str) -> Value {
    let block = example(name);
    serde_json::from_str(&block.content)
        .unwrap_or_else(|e| panic!("example {name} is not JSON: {e}\n{}", block.content))
}

mod documented;
mod library;
