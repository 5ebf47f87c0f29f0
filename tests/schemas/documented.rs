//! The examples in `docs/PROTOCOL.md` against the library: each decodes,
//! validates, and is what the library writes or prints for the same input.

use super::*;

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
        turn::render_batch(
            &first.delegation_id,
            &[first.clone(), second.clone()],
            false
        ),
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
        DelegationState::NotRead,
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
