//! The schemas against the library: what the library writes validates, what
//! it refuses the schemas refuse, and both list the same fields.

use super::*;

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
            "request with a zero time limit",
            REQUEST,
            with(&request, "timeout_seconds", json!(0)),
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

/// An event's `type` and `version` are checked as the schemas check them:
/// a completion that is really a started event, or one of a version this
/// release does not read, is refused by both (the wake dead-letters it).
#[test]
fn every_event_of_another_type_or_an_unread_version_is_refused_by_schema_and_library() {
    let kinds = [STARTED, PROGRESS, COMPLETION, SUBMITTED];
    for stem in kinds {
        let full = full_body(stem);
        let mut bodies = vec![];
        for other in kinds.into_iter().filter(|other| *other != stem) {
            let mut body = full.clone();
            body["type"] = full_body(other)["type"].clone();
            bodies.push((format!("with the type of a {other}"), body));
        }
        for version in [0, 2] {
            let mut body = full.clone();
            body["version"] = json!(version);
            bodies.push((format!("of version {version}"), body));
        }
        for (what, body) in bodies {
            assert!(
                !schema_errors(stem, &body).is_empty(),
                "the schema accepts a {stem} {what}"
            );
            let error = library_accepts(stem, &body)
                .expect_err(&format!("the library accepts a {stem} {what}"));
            assert!(
                error.contains("type is") || error.contains("is not supported"),
                "{stem} {what}: {error}"
            );
        }
        // A later version may lack what this one requires: it is refused
        // for its version, not for the missing field.
        let later = json!({"type": full["type"], "version": 2});
        assert_eq!(
            library_accepts(stem, &later),
            Err("version 2 is not supported (this release reads version 1)".to_owned()),
            "{stem}"
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

/// The schemas' patterns are read by every regex engine the same way:
/// Go's RE2 refuses `\u` escapes (the whole schema then fails to compile),
/// and its `\s`, `\S`, `\d` and `\w` are ASCII-only where others' are not.
/// Characters beyond Latin-1 appear as themselves (a JSON escape, which
/// the JSON parser resolves), never as a regex escape.
#[test]
fn schema_patterns_use_only_escapes_every_regex_engine_reads_alike() {
    fn patterns<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("pattern", Value::String(pattern)) => out.push(pattern),
                        _ => patterns(value, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|item| patterns(item, out)),
            _ => {}
        }
    }
    for stem in SCHEMAS {
        let schema = schema(stem);
        let mut found = Vec::new();
        patterns(&schema, &mut found);
        assert_eq!(
            found.is_empty(),
            WITHOUT_PATTERNS.contains(&stem),
            "{stem}: patterns {found:?}"
        );
        for pattern in found {
            for escape in ["\\u", "\\s", "\\S", "\\d", "\\w", "\\p", "\\z", "(?"] {
                assert!(
                    !pattern.contains(escape),
                    "{stem}: {pattern:?} uses {escape}, which regex engines read differently"
                );
            }
        }
    }
}

/// "Whitespace" is Unicode White_Space on both sides, and a control
/// character is one on both: a goal of one such character, and a session
/// id with one at either end or in the middle, are accepted by the schema
/// exactly when wakebus accepts them.
#[test]
fn schema_and_library_agree_on_every_whitespace_and_control_character() {
    let request = serde_json::to_value(full_request()).unwrap();
    let with = |field: &str, value: String| {
        let mut body = request.clone();
        body[field] = Value::String(value);
        body
    };
    let validator = validator(REQUEST);
    // Every control and White_Space character, the ones often taken for
    // whitespace that are not (U+180E, U+200B, U+FEFF), and a few others.
    let chars = (0..=0x20u32)
        .chain(0x7f..=0xa0)
        .chain([0x1680, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000])
        .chain(0x2000..=0x200b)
        .chain([0x180e, 0xfeff, u32::from('a'), 0xe9, 0x4e2d, 0x1f600])
        .filter_map(char::from_u32);
    for c in chars {
        let bodies = [
            with("goal", c.to_string()),
            with("origin_session_id", format!("{c}sess")),
            with("origin_session_id", format!("sess{c}")),
            with("origin_session_id", format!("se{c}ss")),
        ];
        for body in bodies {
            let schema_ok = validator.is_valid(&body);
            let library = library_accepts(REQUEST, &body);
            assert_eq!(
                schema_ok,
                library.is_ok(),
                "U+{:04X}: schema says {schema_ok}, library says {library:?}",
                c as u32
            );
        }
    }
}

/// Python's and Java's `$` also match before a line terminator that ends
/// the text: a pattern anchored with it lets `"d1\n"` through there (not
/// in this test's engine, whose `$` is strict). So every such pattern has
/// a `not` beside it that refuses a final line terminator by itself, and
/// lets `null` through where the field may be null.
#[test]
fn every_pattern_anchored_at_the_end_refuses_a_final_line_terminator_by_itself() {
    fn anchored<'a>(value: &'a Value, out: &mut Vec<&'a serde_json::Map<String, Value>>) {
        match value {
            Value::Object(map) => {
                if map
                    .get("pattern")
                    .and_then(Value::as_str)
                    .is_some_and(|p| p.ends_with('$'))
                {
                    out.push(map);
                }
                // A `not` is the guard itself, not a field's pattern.
                map.iter()
                    .filter(|(key, _)| key.as_str() != "not")
                    .for_each(|(_, value)| anchored(value, out));
            }
            Value::Array(items) => items.iter().for_each(|item| anchored(item, out)),
            _ => {}
        }
    }
    for stem in SCHEMAS {
        let schema = schema(stem);
        let mut found = Vec::new();
        anchored(&schema, &mut found);
        assert_eq!(
            found.is_empty(),
            WITHOUT_PATTERNS.contains(&stem),
            "{stem}: anchored patterns {found:?}"
        );
        for property in found {
            let not = property
                .get("not")
                .unwrap_or_else(|| panic!("{stem}: {property:?} has no `not`"));
            let guard = jsonschema::validator_for(&json!({ "not": not })).unwrap();
            for ending in ["\n", "\r", "\u{85}", "\u{2028}", "\u{2029}"] {
                let text = json!(format!("d1{ending}"));
                assert!(!guard.is_valid(&text), "{stem}: {not} lets {text} through");
            }
            assert!(guard.is_valid(&json!("d1")), "{stem}: {not}");
            assert!(guard.is_valid(&Value::Null), "{stem}: {not} refuses null");
        }
    }
}

/// Every integer bound of the request schema is the library's: the bound
/// itself is accepted by both, one past it refused by both. (Lowering a
/// limit in the code alone, say the largest batch, fails here.)
#[test]
fn the_request_schemas_integer_bounds_are_the_librarys() {
    let schema = schema(REQUEST);
    // task_count at its largest, so that any task_index may be tried.
    let base = json!({"version": 1, "delegation_id": "d1", "goal": "g", "task_count": 1000});
    let mut tried = 0;
    for (name, property) in schema["properties"].as_object().unwrap() {
        for (bound, step) in [("minimum", -1i128), ("maximum", 1)] {
            let Some(limit) = property[bound].as_number() else {
                continue;
            };
            let limit = limit
                .as_i64()
                .map_or_else(|| i128::from(limit.as_u64().unwrap()), i128::from);
            let body = |value: i128| {
                let mut body = base.clone();
                body[name] = match (u64::try_from(value), i64::try_from(value)) {
                    (Ok(v), _) => json!(v),
                    (_, Ok(v)) => json!(v),
                    _ => return None,
                };
                Some(body)
            };
            let at = body(limit).unwrap();
            assert!(schema_errors(REQUEST, &at).is_empty(), "{name} = {limit}");
            assert!(library_accepts(REQUEST, &at).is_ok(), "{name} = {limit}");
            // One past a bound JSON can still hold.
            if let Some(past) = body(limit + step) {
                assert!(
                    !schema_errors(REQUEST, &past).is_empty(),
                    "{name} = {}",
                    limit + step
                );
                assert!(
                    library_accepts(REQUEST, &past).is_err(),
                    "{name} = {}",
                    limit + step
                );
            }
            tried += 1;
        }
    }
    assert!(tried >= 8, "only {tried} bounds found");
}

/// A field left out takes the value the schema gives as its `default`.
#[test]
fn the_request_schemas_defaults_are_the_librarys() {
    let schema = schema(REQUEST);
    let minimal = json!({"version": 1, "delegation_id": "d1", "goal": "g"});
    let decode = |body: &Value| TaskRequest::decode(&serde_json::to_vec(body).unwrap());
    let left_out = decode(&minimal).unwrap();
    let mut compared = 0;
    for (name, property) in schema["properties"].as_object().unwrap() {
        let Some(default) = property.get("default") else {
            continue;
        };
        let mut given = minimal.clone();
        given[name] = default.clone();
        assert_eq!(decode(&given).unwrap(), left_out, "{name}: {default}");
        compared += 1;
    }
    assert!(compared >= 5, "only {compared} defaults found");
}
