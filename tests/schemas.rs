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
const SCHEMAS: [&str; 5] = [REQUEST, STARTED, PROGRESS, COMPLETION, SUBMITTED];

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
        STARTED => serde_json::from_slice::<StartedEvent>(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        PROGRESS => serde_json::from_slice::<ProgressEvent>(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        COMPLETION => CompletionEvent::decode(&bytes)
            .map(drop)
            .map_err(|e| e.to_string()),
        SUBMITTED => SubmittedRecord::decode(&bytes)
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

#[test]
fn every_schema_is_valid_draft_2020_12() {
    for stem in SCHEMAS {
        let schema = schema(stem);
        assert_eq!(
            schema["$schema"], "https://json-schema.org/draft/2020-12/schema",
            "{stem}"
        );
        assert!(
            jsonschema::draft202012::meta::is_valid(&schema),
            "{stem} schema is not a valid draft 2020-12 schema"
        );
        assert_eq!(
            schema["additionalProperties"],
            json!(true),
            "{stem} schema must allow unknown fields"
        );
    }
}

#[test]
fn request_built_by_the_library_matches_its_schema() {
    for request in [full_request(), minimal_request()] {
        let body = serde_json::to_value(&request).unwrap();
        assert_valid(REQUEST, &body);
        assert_eq!(
            TaskRequest::decode(body.to_string().as_bytes()).unwrap(),
            request
        );
    }
}

#[test]
fn started_event_built_by_the_worker_matches_its_schema() {
    for request in [full_request(), minimal_request()] {
        let started = StartedEvent::for_request(&request, "worker-gpu-box-3-48211", 1);
        let body = serde_json::to_value(&started).unwrap();
        assert_valid(STARTED, &body);
        assert!(
            body["started_at"].as_str().unwrap().ends_with('Z'),
            "{body}"
        );
    }
}

#[test]
fn progress_event_built_by_the_worker_matches_its_schema() {
    for request in [full_request(), minimal_request()] {
        for message in ["model call 1", "", "línea\nwith a break"] {
            let progress =
                ProgressEvent::for_request(&request, "worker-gpu-box-3-48211", message.to_owned());
            let body = serde_json::to_value(&progress).unwrap();
            assert_valid(PROGRESS, &body);
            assert_eq!(body["message"], message);
            assert!(body["at"].as_str().unwrap().ends_with('Z'), "{body}");
        }
    }
}

#[test]
fn completion_built_by_the_worker_matches_its_schema() {
    let statuses = [
        (Status::Completed, "completed"),
        (Status::Completed, "completed_truncated"),
        (Status::Failed, "nonzero_exit"),
        (Status::Failed, "max_deliveries_exceeded"),
        (Status::Failed, "max_attempts_exceeded"),
        (Status::Interrupted, "completed"),
        (Status::Interrupted, "cancelled"),
        (Status::Timeout, "timeout"),
        (Status::Error, "invalid_request"),
        (Status::Error, "depth_limit"),
    ];
    for request in [full_request(), minimal_request()] {
        for (status, exit_reason) in statuses {
            let mut done = CompletionEvent::for_request(&request, status, exit_reason);
            assert_valid(COMPLETION, &serde_json::to_value(&done).unwrap());
            done.summary = Some("result".to_owned());
            done.error = Some("what went wrong".to_owned());
            done.api_calls = 3;
            done.prompt_tokens = Some(10);
            done.completion_tokens = Some(0);
            done.duration_seconds = 0.25;
            done.suppress_wake = status == Status::Interrupted;
            let body = serde_json::to_value(&done).unwrap();
            assert_valid(COMPLETION, &body);
            assert_eq!(body["status"], status.as_str());
            assert_eq!(body["task_count"], request.task_count);
        }
    }
}

#[test]
fn completion_for_an_unusable_request_matches_its_schema() {
    // What a worker publishes when a request cannot be decoded at all.
    let stand_in = TaskRequest {
        version: PROTOCOL_VERSION,
        delegation_id: "invalid-4711".to_owned(),
        task_index: 0,
        origin_session_id: None,
        goal: String::new(),
        context: String::new(),
        role: Role::Leaf,
        model: None,
        toolsets: Vec::new(),
        timeout_seconds: None,
        depth: 0,
        parent_session_id: None,
        created_at: None,
        ..TaskRequest::new("", "")
    };
    let mut done = CompletionEvent::for_request(&stand_in, Status::Error, "invalid_request");
    done.error = Some("request body is not a valid task request".to_owned());
    let body = serde_json::to_value(&done).unwrap();
    assert_valid(COMPLETION, &body);
    assert_eq!(body["origin_session_id"], Value::Null);
    assert_eq!(body["dispatched_at"], Value::Null);
    assert_eq!(body["task_count"], 1);
    assert_eq!(body["wake_mode"], "batch");
}

#[test]
fn schemas_list_exactly_the_fields_the_library_writes() {
    for stem in SCHEMAS {
        let written: BTreeSet<String> = full_body(stem)
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(
            properties(stem),
            written,
            "{stem}: schema properties differ from the fields the library writes"
        );
        assert!(required(stem).is_subset(&written), "{stem}");
    }
}

#[test]
fn events_write_every_field_even_when_empty() {
    // Option fields of events are written as null, never omitted, except
    // the completion's flags and token counts, which are left out when
    // false or unknown.
    let request = minimal_request();
    let done = serde_json::to_value(CompletionEvent::for_request(
        &request,
        Status::Completed,
        "completed",
    ))
    .unwrap();
    let started = serde_json::to_value(StartedEvent::for_request(&request, "w", 1)).unwrap();
    let progress =
        serde_json::to_value(ProgressEvent::for_request(&request, "w", String::new())).unwrap();
    let mut always_written = properties(COMPLETION);
    for field in COMPLETION_OMITTED_WHEN_EMPTY {
        assert!(always_written.remove(field), "{field} is not in the schema");
        assert!(
            !required(COMPLETION).contains(field),
            "{field} is omitted, so it cannot be required"
        );
    }
    for (stem, body, expected) in [
        (COMPLETION, done, always_written),
        (STARTED, started, properties(STARTED)),
        (PROGRESS, progress, properties(PROGRESS)),
    ] {
        let written: BTreeSet<String> = body.as_object().unwrap().keys().cloned().collect();
        assert_eq!(written, expected, "{stem}");
    }
}

#[test]
fn request_omits_optional_fields_it_does_not_have() {
    let body = serde_json::to_value(minimal_request()).unwrap();
    let written: BTreeSet<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let expected: BTreeSet<&str> = [
        "version",
        "delegation_id",
        "task_index",
        "task_count",
        "wake_mode",
        "goal",
        "context",
        "role",
        "depth",
    ]
    .into();
    assert_eq!(written, expected);
}

#[test]
fn schema_and_library_agree_on_which_fields_are_required() {
    for stem in SCHEMAS {
        let full = full_body(stem);
        let required = required(stem);
        for field in properties(stem) {
            let mut body = full.clone();
            body.as_object_mut().unwrap().remove(&field);
            let schema_ok = schema_errors(stem, &body).is_empty();
            let library = library_accepts(stem, &body);
            assert_eq!(required.contains(&field), !schema_ok, "{stem}.{field}");
            if stem == REQUEST && field == "task_count" {
                // The full request is task 3 of 5: without task_count it is
                // task 3 of 1, which only the library can tell is wrong.
                let error = library.expect_err("task 3 of 1 is refused");
                assert_eq!(error, "task_index 3 is not below task_count 1");
                continue;
            }
            assert_eq!(
                schema_ok,
                library.is_ok(),
                "{stem} without {field}: schema says {schema_ok}, library says {library:?}"
            );
        }
    }
}

#[test]
fn schema_and_library_agree_on_which_fields_may_be_null() {
    for stem in SCHEMAS {
        let full = full_body(stem);
        for field in properties(stem) {
            let mut body = full.clone();
            body[&field] = Value::Null;
            let schema_ok = schema_errors(stem, &body).is_empty();
            let library = library_accepts(stem, &body);
            assert_eq!(
                schema_ok,
                library.is_ok(),
                "{stem} with {field}: null: schema says {schema_ok}, library says {library:?}"
            );
        }
    }
}

#[test]
fn schema_and_library_reject_the_same_broken_bodies() {
    let request = serde_json::to_value(full_request()).unwrap();
    let completion = serde_json::to_value(full_completion()).unwrap();
    let started = full_body(STARTED);
    let progress = full_body(PROGRESS);
    let with = |base: &Value, field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };
    let without = |base: &Value, field: &str| {
        let mut body = base.clone();
        body.as_object_mut().unwrap().remove(field);
        body
    };
    let cases = [
        (
            "request without goal",
            REQUEST,
            json!({"version": 1, "delegation_id": "d1"}),
        ),
        (
            "request with a blank goal",
            REQUEST,
            with(&request, "goal", json!(" \t ")),
        ),
        (
            "request with a numeric goal",
            REQUEST,
            with(&request, "goal", json!(7)),
        ),
        (
            "request from the future",
            REQUEST,
            with(&request, "version", json!(2)),
        ),
        (
            "request with a session id ending in a space",
            REQUEST,
            with(&request, "origin_session_id", json!("sess.42 ")),
        ),
        (
            "request with a session id starting with an ideographic space",
            REQUEST,
            with(&request, "origin_session_id", json!("\u{3000}sess")),
        ),
        (
            "request of version 0",
            REQUEST,
            with(&request, "version", json!(0)),
        ),
        (
            "request with a dotted delegation id",
            REQUEST,
            with(&request, "delegation_id", json!("a.b")),
        ),
        (
            "request with a wildcard delegation id",
            REQUEST,
            with(&request, "delegation_id", json!("a*")),
        ),
        (
            "request with an empty delegation id",
            REQUEST,
            with(&request, "delegation_id", json!("")),
        ),
        (
            "request with a long delegation id",
            REQUEST,
            with(&request, "delegation_id", json!("x".repeat(65))),
        ),
        (
            "request with a header-splitting session",
            REQUEST,
            with(&request, "origin_session_id", json!("s\r\nX-Evil: 1")),
        ),
        (
            "request with an empty session",
            REQUEST,
            with(&request, "origin_session_id", json!("")),
        ),
        (
            "request with a huge session",
            REQUEST,
            with(
                &request,
                "origin_session_id",
                json!("s".repeat(16 * 1024 + 1)),
            ),
        ),
        (
            "request with an unknown role",
            REQUEST,
            with(&request, "role", json!("boss")),
        ),
        (
            "request with a negative task index",
            REQUEST,
            with(&request, "task_index", json!(-1)),
        ),
        (
            "request with no tasks",
            REQUEST,
            with(&request, "task_count", json!(0)),
        ),
        (
            "request with a negative task count",
            REQUEST,
            with(&request, "task_count", json!(-2)),
        ),
        (
            "request with an unknown wake mode",
            REQUEST,
            with(&request, "wake_mode", json!("together")),
        ),
        (
            "request with an uppercase wake mode",
            REQUEST,
            with(&request, "wake_mode", json!("Batch")),
        ),
        (
            "request with a string notify_early_failure",
            REQUEST,
            with(&request, "notify_early_failure", json!("true")),
        ),
        (
            "request with a fractional timeout",
            REQUEST,
            with(&request, "timeout_seconds", json!(1.5)),
        ),
        (
            "request with a non-date created_at",
            REQUEST,
            with(&request, "created_at", json!("yesterday")),
        ),
        ("request that is not an object", REQUEST, json!("a string")),
        (
            "completion with status weird",
            COMPLETION,
            with(&completion, "status", json!("weird")),
        ),
        (
            "completion with an uppercase status",
            COMPLETION,
            with(&completion, "status", json!("Completed")),
        ),
        (
            "completion with a non-date completed_at",
            COMPLETION,
            with(&completion, "completed_at", json!("yesterday")),
        ),
        (
            "completion with a numeric exit_reason",
            COMPLETION,
            with(&completion, "exit_reason", json!(0)),
        ),
        (
            "completion with an unknown role",
            COMPLETION,
            with(&completion, "role", json!("boss")),
        ),
        (
            "completion with an unknown wake mode",
            COMPLETION,
            with(&completion, "wake_mode", json!("together")),
        ),
        (
            "completion with a string task count",
            COMPLETION,
            with(&completion, "task_count", json!("5")),
        ),
        (
            "completion with a numeric suppress_wake",
            COMPLETION,
            with(&completion, "suppress_wake", json!(1)),
        ),
        (
            "completion with a string notify_early_failure",
            COMPLETION,
            with(&completion, "notify_early_failure", json!("yes")),
        ),
        (
            "completion with negative prompt tokens",
            COMPLETION,
            with(&completion, "prompt_tokens", json!(-1)),
        ),
        (
            "completion with fractional completion tokens",
            COMPLETION,
            with(&completion, "completion_tokens", json!(1.5)),
        ),
        (
            "started event with a string attempt",
            STARTED,
            with(&started, "attempt", json!("1")),
        ),
        (
            "started event with a non-date started_at",
            STARTED,
            with(&started, "started_at", json!("soon")),
        ),
        (
            "progress event with a numeric message",
            PROGRESS,
            with(&progress, "message", json!(42)),
        ),
        (
            "progress event without a message",
            PROGRESS,
            without(&progress, "message"),
        ),
        (
            "progress event with a non-date at",
            PROGRESS,
            with(&progress, "at", json!("now")),
        ),
    ];
    for (what, stem, body) in cases {
        assert!(
            !schema_errors(stem, &body).is_empty(),
            "schema accepts {what}"
        );
        assert!(
            library_accepts(stem, &body).is_err(),
            "library accepts {what}"
        );
    }
}

#[test]
fn a_task_index_not_below_the_task_count_is_refused_with_a_clear_error() {
    // The one rule the schema cannot state (it compares two fields), as
    // documented in the schema's description and PROTOCOL.md 5.1.
    assert!(
        schema(REQUEST)["description"]
            .as_str()
            .unwrap()
            .contains("task_index must be below task_count")
    );
    assert!(
        read("docs/PROTOCOL.md")
            .contains("A request's `task_index` must be below its `task_count`")
    );
    let request = serde_json::to_value(full_request()).unwrap();
    for (index, count) in [(5, 5), (6, 5), (1, 1)] {
        let mut body = request.clone();
        body["task_index"] = json!(index);
        body["task_count"] = json!(count);
        assert_valid(REQUEST, &body);
        assert_eq!(
            library_accepts(REQUEST, &body),
            Err(format!(
                "task_index {index} is not below task_count {count}"
            ))
        );
    }
}

#[test]
fn schemas_accept_unknown_fields_like_the_library() {
    for stem in SCHEMAS {
        let mut body = full_body(stem);
        body["added_in_a_later_release"] = json!({"anything": [1, 2, 3]});
        assert_valid(stem, &body);
        assert!(library_accepts(stem, &body).is_ok(), "{stem}");
    }
}

#[test]
fn documented_examples_match_their_schemas_and_decode() {
    let blocks = protocol_blocks();
    let mut seen = BTreeSet::new();
    for block in blocks.iter().filter(|b| b.lang == "json") {
        let name = block
            .attrs
            .get("example")
            .map_or("<unnamed>", String::as_str);
        let body: Value = serde_json::from_str(&block.content).unwrap_or_else(|e| {
            panic!("json example {name} does not parse: {e}\n{}", block.content)
        });
        if let Some(stem) = block.attrs.get("schema") {
            assert!(
                SCHEMAS.contains(&stem.as_str()),
                "example {name}: unknown schema {stem}"
            );
            assert_valid(stem, &body);
            if let Err(error) = library_accepts(stem, &body) {
                panic!("example {name} is refused by the library: {error}");
            }
            seen.insert(stem.clone());
        }
    }
    for stem in SCHEMAS {
        assert!(seen.contains(stem), "PROTOCOL.md has no example for {stem}");
    }
}

#[test]
fn documented_completions_are_what_the_library_writes() {
    // Round-tripping an example through the library changes nothing, so the
    // examples show every field in the order and form a worker writes them.
    for name in [
        "completion-completed",
        "completion-failed",
        "completion-error",
        "completion-batch-0",
        "completion-batch-1",
        "completion-cancelled",
    ] {
        let documented = example_json(name);
        let decoded = CompletionEvent::decode(documented.to_string().as_bytes()).unwrap();
        assert_eq!(
            serde_json::to_value(&decoded).unwrap(),
            documented,
            "{name}"
        );
        assert_eq!(
            decoded.event_id,
            CompletionEvent::id_for(&decoded.delegation_id, decoded.task_index),
            "{name}"
        );
    }
    for name in ["request-full", "request-batch"] {
        let request = example_json(name);
        let decoded = TaskRequest::decode(request.to_string().as_bytes()).unwrap();
        assert_eq!(serde_json::to_value(&decoded).unwrap(), request, "{name}");
    }
}

#[test]
fn documented_started_and_progress_events_are_what_the_library_writes() {
    let started = example_json("started");
    let decoded: StartedEvent = serde_json::from_value(started.clone()).unwrap();
    assert_eq!(serde_json::to_value(&decoded).unwrap(), started);
    let progress = example_json("progress");
    let decoded: ProgressEvent = serde_json::from_value(progress.clone()).unwrap();
    assert_eq!(serde_json::to_value(&decoded).unwrap(), progress);
    assert_eq!(decoded.event_type, "delegation_progress");
}

#[test]
fn submitted_record_built_by_the_delegator_matches_its_schema() {
    for request in [full_request(), minimal_request()] {
        for trace in [None, Some(TRACE.to_owned())] {
            let record = SubmittedRecord::for_request(&request, "default", trace);
            let body = serde_json::to_value(&record).unwrap();
            assert_valid(SUBMITTED, &body);
            assert!(body["submitted_at"].as_str().unwrap().ends_with('Z'));
            assert_eq!(
                SubmittedRecord::decode(body.to_string().as_bytes()).unwrap(),
                record
            );
        }
    }
}

#[test]
fn documented_submitted_record_is_what_the_library_writes() {
    let documented = example_json("submitted");
    let decoded = SubmittedRecord::decode(documented.to_string().as_bytes()).unwrap();
    assert_eq!(serde_json::to_value(&decoded).unwrap(), documented);
    assert_eq!(decoded.event_type, "delegation_submitted");
}

/// A trace context as the delegator writes it.
const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A documented completion, decoded.
fn documented_completion(name: &str) -> CompletionEvent {
    CompletionEvent::decode(example(name).content.as_bytes())
        .unwrap_or_else(|e| panic!("example {name} does not decode: {e}"))
}

#[test]
fn documented_batch_completions_are_what_a_worker_writes_for_the_documented_batch() {
    // The second request of the batch is documented; the first differs only
    // in task_index and goal.
    let second = TaskRequest::decode(example("request-batch").content.as_bytes()).unwrap();
    assert_eq!(second.task_count, 2);
    assert_eq!(second.wake_mode, WakeMode::Batch);
    assert!(second.notify_early_failure);
    for (index, name) in ["completion-batch-0", "completion-batch-1"]
        .into_iter()
        .enumerate()
    {
        let documented = documented_completion(name);
        let mut request = second.clone();
        request.task_index = u32::try_from(index).unwrap();
        request.goal.clone_from(&documented.goal);
        let mut expected =
            CompletionEvent::for_request(&request, documented.status, &documented.exit_reason);
        expected.summary.clone_from(&documented.summary);
        expected.error.clone_from(&documented.error);
        expected.api_calls = documented.api_calls;
        expected.prompt_tokens = documented.prompt_tokens;
        expected.completion_tokens = documented.completion_tokens;
        expected.duration_seconds = documented.duration_seconds;
        expected.completed_at = documented.completed_at;
        assert_eq!(documented, expected, "{name}");
    }
    // Task 1 ended first, and not completed: it is the one noticed early.
    let first = documented_completion("completion-batch-0");
    let early = documented_completion("completion-batch-1");
    assert!(early.completed_at < first.completed_at);
    assert_ne!(early.status, Status::Completed);
}

#[test]
fn documented_cancelled_completion_is_what_a_worker_writes_for_a_silent_cancel() {
    let done = documented_completion("completion-cancelled");
    assert_eq!(done.status, Status::Interrupted);
    assert_eq!(done.exit_reason, "cancelled");
    assert_eq!(done.error.as_deref(), Some("cancelled while running"));
    assert!(done.suppress_wake);
    assert!(done.summary.is_some(), "partial output is kept");
}

#[test]
fn documented_turn_texts_are_what_the_wake_service_renders() {
    let completed =
        CompletionEvent::decode(example("completion-completed").content.as_bytes()).unwrap();
    let failed = CompletionEvent::decode(example("completion-failed").content.as_bytes()).unwrap();
    let single = turn::render(&[&completed]);
    assert_eq!(single, example("turn-single").content);
    assert_eq!(
        turn::render(&[&completed, &failed]),
        example("turn-combined").content
    );
    let body = example_json("wake-body");
    assert_eq!(body["messages"][0]["content"], single.as_str());
    assert_eq!(body["messages"][0]["role"], "user");
    assert_eq!(body["stream"], false);
}

#[test]
fn documented_batch_turn_texts_are_what_the_wake_service_renders() {
    let first = documented_completion("completion-batch-0");
    let second = documented_completion("completion-batch-1");
    assert_eq!(first.delegation_id, second.delegation_id);
    assert_eq!(
        turn::render_batch(&first.delegation_id, &[first.clone(), second.clone()]),
        example("turn-batch").content
    );
    assert_eq!(
        turn::render_early_failure(&second),
        example("turn-early-failure").content
    );
    let doc = read("docs/PROTOCOL.md");
    for key in [
        "`Idempotency-Key: <delegation_id>.batch`",
        "`Idempotency-Key: <delegation_id>.<task_index>.early`",
    ] {
        assert!(doc.contains(key), "PROTOCOL.md does not say {key}");
    }
}

#[test]
fn documented_cancel_record_decodes_and_round_trips() {
    let block = example("cancel-record");
    let record: CancelRecord = serde_json::from_str(&block.content).unwrap();
    assert_eq!(
        record,
        CancelRecord {
            at: datetime!(2025-05-14 09:50:59.812005 UTC),
            silent: true,
        }
    );
    assert_eq!(
        serde_json::to_value(&record).unwrap(),
        example_json("cancel-record")
    );
    // `silent` is optional and defaults to false.
    let loud: CancelRecord = serde_json::from_str(r#"{"at":"2025-05-14T09:50:59Z"}"#).unwrap();
    assert!(!loud.silent);
}

#[test]
fn documented_cancel_keys_subjects_and_bucket_are_the_librarys() {
    let doc = read("docs/PROTOCOL.md");
    let subjects = Subjects::new("wakebus").unwrap();
    let id = "01JV3S2D6F8H0K2M4P6R8T0W2Y";
    let target = CancelTarget::Delegation(id.to_owned());
    assert_eq!(target.key(), format!("dlg.{id}"));
    assert_eq!(CancelTarget::from_key(&target.key()), Some(target.clone()));
    let token = session_token("sess.42 *>");
    let session = CancelTarget::Session(token.clone());
    assert_eq!(session.key(), format!("ses.{token}"));
    assert_eq!(CancelTarget::from_key(&session.key()), Some(session));
    let subject = format!("{}.{}", subjects.cancel_broadcasts_prefix(), target.key());
    let bucket = subjects.cancel_bucket();
    assert_eq!(bucket, "WAKEBUS_CANCELS");
    for shown in [
        format!("nats kv put {bucket} {} ", target.key()),
        format!("nats pub {subject} "),
        "`<prefix>.ctl.cancel.dlg.<delegation_id>`".to_owned(),
        "`<prefix>.ctl.cancel.ses.<session_token>`".to_owned(),
        "`dlg.<delegation_id>` or `ses.<session_token>`".to_owned(),
        "`<PREFIX>_CANCELS`".to_owned(),
    ] {
        assert!(doc.contains(&shown), "PROTOCOL.md does not show {shown:?}");
    }
}

#[test]
fn documented_cancel_reports_are_what_the_library_prints() {
    let id = "01JV3S2D6F8H0K2M4P6R8T0W2Y";
    let delegation = CancelReport {
        status: "cancelled",
        scope: "delegation",
        target: id.to_owned(),
        state: Some(DelegationState::Running),
        silent: true,
        message: format!("Delegation {id} is being interrupted; queued tasks of it will not run."),
    };
    assert_eq!(
        serde_json::to_value(&delegation).unwrap(),
        example_json("cancel-report")
    );
    let session = CancelReport {
        status: "cancelled",
        scope: "session",
        target: "sess.42 *>".to_owned(),
        state: None,
        silent: false,
        message:
            "Every delegation of the session requested before now is interrupted or will not run."
                .to_owned(),
    };
    assert_eq!(
        serde_json::to_value(&session).unwrap(),
        example_json("cancel-report-session")
    );
    let doc = read("docs/PROTOCOL.md");
    for state in [
        DelegationState::Finished,
        DelegationState::Running,
        DelegationState::Queued,
        DelegationState::Unknown,
    ] {
        let name = serde_json::to_value(state).unwrap();
        let shown = format!("`{}`:", name.as_str().unwrap());
        assert!(doc.contains(&shown), "PROTOCOL.md does not explain {shown}");
    }
}

#[test]
fn documented_delegate_output_is_what_the_library_prints() {
    let batch = documented_completion("completion-batch-0");
    let dispatched = DelegateResult::Dispatched {
        status: "dispatched",
        mode: "background",
        delegation_id: batch.delegation_id.clone(),
        tasks: batch.task_count as usize,
        results: Vec::new(),
    };
    assert_eq!(
        serde_json::to_value(&dispatched).unwrap(),
        example_json("delegate-background")
    );
}

#[test]
fn documented_session_token_example_is_correct() {
    let token = session_token("sess.42 *>");
    assert_eq!(token, "57cee281a2d9d49f710a64f0a1b50a31");
    let doc = read("docs/PROTOCOL.md");
    let completion = example_json("completion-completed");
    let subject = format!(
        "wakebus.evt.{token}.{}.{}.done",
        completion["delegation_id"].as_str().unwrap(),
        completion["task_index"]
    );
    assert!(
        doc.contains(&subject),
        "PROTOCOL.md does not show {subject}"
    );
    assert!(doc.contains(&format!("wakebus.evt.{token}.>")));
}

#[test]
fn documented_cli_example_publishes_a_valid_request_with_matching_headers() {
    let block = example("nats-cli-publish");
    // Single-quoted arguments: `-H 'Name:Value'` headers and the body last.
    let parts: Vec<&str> = block.content.split('\'').collect();
    let mut headers = BTreeMap::new();
    let mut body = None;
    for pair in parts.windows(2).step_by(2) {
        let (before, quoted) = (pair[0], pair[1]);
        if before.trim_end().ends_with("-H") {
            let (name, value) = quoted.split_once(':').expect("headers are Name:Value");
            headers.insert(name.trim().to_owned(), value.trim().to_owned());
        } else {
            body = Some(quoted);
        }
    }
    let body: Value = serde_json::from_str(body.expect("the example has a body")).unwrap();
    assert_valid(REQUEST, &body);
    let request = TaskRequest::decode(body.to_string().as_bytes()).unwrap();
    let id = format!("{}.{}", request.delegation_id, request.task_index);
    assert_eq!(headers["Nats-Msg-Id"], id);
    assert_eq!(headers["ce-id"], id);
    assert_eq!(headers["ce-type"], "io.wakebus.task.requested");
    assert_eq!(headers["ce-specversion"], "1.0");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers["Wakebus-Delegation-Id"], request.delegation_id);
    assert_eq!(
        headers["Wakebus-Task-Index"],
        request.task_index.to_string()
    );
    let origin = headers.get("Wakebus-Origin-Session").map(String::as_str);
    assert!(request.check_origin_header(origin).is_ok());
    assert_eq!(origin, request.origin_session_id.as_deref());
    assert!(
        block
            .content
            .starts_with("nats pub wakebus.task.default --jetstream"),
        "{}",
        block.content
    );
}
