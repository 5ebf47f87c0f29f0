//! Delegation semantics: depth limits, nested delegation from a subagent.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt as _;
use wakebus::cancel::{Canceller, DelegationState};
use wakebus::delegate::{DelegateError, DelegateResult, Delegation, Delegator};
use wakebus::protocol::{CompletionEvent, EventKind, Status, TaskRequest};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_delegation_deeper_than_the_limit_is_refused_before_publishing() {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut nested = Delegation::new("grandchild work").session("s");
    nested.depth = 2;
    let err = Delegator::new(bus.clone())
        .delegate(nested)
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        DelegateError::DepthLimit { depth: 2, max: 1 }
    ));
    assert!(
        err.to_string()
            .starts_with("Delegation depth limit reached"),
        "{err}"
    );
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(
        tasks.info().await.unwrap().state.messages,
        0,
        "nothing was published"
    );
}

#[tokio::test]
async fn a_subagent_delegating_through_the_cli_nests_one_level_and_is_refused_past_the_limit() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    // The subagent tries to delegate again with the same CLI a real one would use.
    let script = format!(
        "{bin} --nats-url \"$NATS_URL\" --prefix \"$WAKEBUS_PREFIX\" delegate --goal nested 2>&1; echo \"depth=$WAKEBUS_DEPTH\"",
        bin = env!("CARGO_BIN_EXE_wakebus")
    );
    let command = CommandConfig::new("sh", vec!["-c".into(), script]);
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.instance = "w".into();
    let env_bus = bus.clone();
    services.worker_with_env(
        &env_bus,
        Executor::Command(CommandExecutor::new(command)),
        config,
        &nats.url(),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    Delegator::new(bus.clone())
        .delegate(Delegation::new("try to nest").session("s.nest"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let text = api.accepted()[0].text();
    assert!(
        text.contains("Delegation depth limit reached: depth 2 is above the maximum of 1"),
        "{text}"
    );
    assert!(text.contains("depth=1"), "{text}");
    // No second request ever reached the bus.
    let dones: Vec<CompletionEvent> = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.ends_with(".done"))
        .map(|m| CompletionEvent::decode(&m.payload).unwrap())
        .collect();
    assert_eq!(dones.len(), 1);
    assert_eq!(dones[0].status, Status::Completed);
}

#[tokio::test]
async fn a_queued_task_that_is_cancelled_never_runs_and_wakes_its_session_as_interrupted() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = delegate(&bus, Delegation::new("never mind").session("s.q")).await;
    cancelled_while(&bus, &id, false, DelegationState::Queued).await;
    // Only now does a worker appear.
    let mut services = Services::new();
    services.worker(&bus, shell("echo ran"), test_worker_config("default"));
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    assert_eq!(started(&bus).await, 0, "a cancelled task must not start");
    let done = &done_events(&bus).await[0];
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Interrupted, "cancelled")
    );
    assert!(api.accepted()[0].text().contains("Status: interrupted"));
}

/// Cancels delegation `id`, which must be found `state`, and checks that
/// the cancel was recorded.
async fn cancelled_while(bus: &wakebus::bus::Bus, id: &str, silent: bool, state: DelegationState) {
    let report = Canceller::new(bus.clone())
        .cancel_delegation(id, silent)
        .await
        .unwrap();
    assert_eq!((report.status, report.state), ("cancelled", Some(state)));
}

/// Runs a worker on the one queued request of a cancelled delegation: it
/// must end `interrupted` by the cancel without starting.
async fn ends_interrupted_without_starting(bus: &wakebus::bus::Bus) {
    let mut services = Services::new();
    services.worker(bus, shell("echo ran"), test_worker_config("default"));
    wait_until(WAIT, "the task's completion", || async {
        !done_events(bus).await.is_empty()
    })
    .await;
    services.stop().await;
    assert_eq!(started(bus).await, 0, "a cancelled task must not start");
    let done = &done_events(bus).await[0];
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Interrupted, "cancelled")
    );
}

/// A publisher in another language may leave out the optional
/// `Wakebus-Delegation-Id` header: its queued request is still found by
/// its body, so the cancel is recorded and the task never runs.
#[tokio::test]
async fn a_queued_request_without_the_delegation_id_header_can_still_be_cancelled() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let raw = request("s.bare", "never mind");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("{}.0", raw.delegation_id).as_str());
    bus.js
        .publish_with_headers(
            bus.subjects.task("default"),
            headers,
            serde_json::to_vec(&raw).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    cancelled_while(&bus, &raw.delegation_id, true, DelegationState::Queued).await;
    ends_interrupted_without_starting(&bus).await;
}

/// A delegation stored only in part (its records written, its request
/// not: a leader election cut the delegator off) can be cancelled: the
/// cancel is recorded, so the request, sent again later, does not run.
#[tokio::test]
async fn a_delegation_with_only_its_submitted_record_stored_can_be_cancelled() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let raw = request("s.partial", "never mind");
    let record = bus.subjects.event(
        &wakebus::protocol::session_token("s.partial"),
        &raw.delegation_id,
        0,
        EventKind::Submitted,
    );
    bus.js
        .publish(record, r#"{"submitted_at":"2026-12-06T10:00:00Z"}"#.into())
        .await
        .unwrap()
        .await
        .unwrap();
    cancelled_while(&bus, &raw.delegation_id, false, DelegationState::Submitted).await;
    // The delegator sends the request again.
    publish_until_stored(&bus, &raw).await;
    ends_interrupted_without_starting(&bus).await;
}

#[tokio::test]
async fn a_running_task_is_interrupted_with_its_partial_output() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        shell("echo partial; sleep 60; echo never"),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, Delegation::new("long job").session("s.run")).await;
    wait_until(WAIT, "the task to start", || async {
        started(&bus).await == 1
    })
    .await;
    let report = Canceller::new(bus.clone())
        .cancel_delegation(&id, false)
        .await
        .unwrap();
    assert_eq!(report.state, Some(DelegationState::Running));
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Interrupted);
    assert_eq!(done.summary.as_deref(), Some("partial"));
    assert!(
        done.duration_seconds < 30.0,
        "the process group was not stopped"
    );
    let text = api.accepted()[0].text();
    assert!(
        text.contains("Status: interrupted") && text.contains("partial"),
        "{text}"
    );
}

/// A silent cancel that comes once the task's program has finished, while
/// a process it left behind still holds its output, leaves the result as
/// it is (the program finished in time) but keeps the session from
/// hearing of the task, as it asked.
#[tokio::test]
async fn a_silent_cancel_after_the_program_finished_keeps_its_result_and_wakes_nobody() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let script = format!(
        "sleep 600 & echo $$ > '{}'; echo finished",
        pid_file.display()
    );
    let mut command = CommandConfig::new("sh", vec!["-c".into(), script]);
    // The helper holds the output for this long before it is stopped.
    command.kill_grace = Duration::from_secs(60);
    let mut services = Services::new();
    services.worker(
        &bus,
        Executor::Command(CommandExecutor::new(command)),
        test_worker_config("default"),
    );
    let id = delegate(&bus, Delegation::new("finish first").session("s.drain")).await;
    // Gone, not just a zombie: reaped, so the worker knows it exited.
    let program = eventually(WAIT, "the program to exit", || async {
        let pid = std::fs::read_to_string(&pid_file).ok()?;
        let gone = !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists();
        gone.then_some(pid)
    })
    .await;
    assert!(
        done_events(&bus).await.is_empty(),
        "ended before the cancel"
    );
    let report = Canceller::new(bus.clone())
        .cancel_delegation(&id, true)
        .await
        .unwrap();
    assert_eq!(report.status, "cancelled", "program {program}");
    wait_until(WAIT, "the completion", || async {
        done_events(&bus).await.len() == 1
    })
    .await;
    services.stop().await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert!(
        done.summary
            .as_deref()
            .is_some_and(|s| s.starts_with("finished")),
        "{done:?}"
    );
    assert!(done.suppress_wake, "{done:?}");
}

/// A silent cancel that comes while the worker is still trying to store a
/// finished task's completion (the events stream not taking it) keeps the
/// session from hearing of the task, as one that came a moment earlier
/// does.
#[tokio::test]
async fn a_silent_cancel_while_the_completion_waits_to_be_stored_still_silences_the_wake() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(&bus, shell("echo ran"), test_worker_config("default"));
    worker_pulling(&bus, "default").await;
    // Dated now: a first delivery of it is not checked against the
    // history, which does not answer.
    let mut req = request("s.late", "done early");
    req.created_at = Some(time::OffsetDateTime::now_utc());
    let id = req.delegation_id.clone();
    let done_subject = bus.subjects.event(
        &wakebus::protocol::session_token("s.late"),
        &id,
        0,
        EventKind::Done,
    );
    // Every attempt to store the completion, as the worker sends it (not
    // its empty probes of whether one is stored).
    let mut attempts = bus
        .client
        .subscribe(done_subject)
        .await
        .unwrap()
        .filter(|message| std::future::ready(!message.payload.is_empty()));
    bus.client.flush().await.unwrap();
    let config = events_stream_unanswered(&bus).await;
    publish_until_stored(&bus, &req).await;
    let first = tokio::time::timeout(WAIT, attempts.next())
        .await
        .expect("an attempt to store the completion")
        .unwrap();
    let first = CompletionEvent::decode(&first.payload).unwrap();
    assert!(!first.suppress_wake, "{first:?}");
    let report = Canceller::new(bus.clone())
        .cancel_delegation(&id, true)
        .await
        .unwrap();
    assert_eq!(report.status, "cancelled");
    // The worker's later attempts carry the silence.
    let silenced = tokio::time::timeout(WAIT, async {
        while let Some(attempt) = attempts.next().await {
            if CompletionEvent::decode(&attempt.payload)
                .unwrap()
                .suppress_wake
            {
                return true;
            }
        }
        false
    })
    .await;
    assert!(
        matches!(silenced, Ok(true)),
        "no later attempt silenced the wake"
    );
    bus.js.update_stream(&config).await.unwrap();
    wait_until(WAIT, "the completion stored", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    services.stop().await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert!(done.suppress_wake, "{done:?}");
}

#[tokio::test]
async fn a_task_cancelled_before_its_started_event_is_written_is_still_interrupted() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("running");
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    // No started event for an hour: the history shows nothing running.
    config.started_after = Duration::from_secs(3600);
    services.worker(
        &bus,
        shell(&format!("touch {}; sleep 60", marker.display())),
        config,
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, Delegation::new("quiet job").session("s.early")).await;
    wait_until(WAIT, "the task to run", || async { marker.exists() }).await;
    assert_eq!(started(&bus).await, 0);
    let report = Canceller::new(bus.clone())
        .cancel_delegation(&id, false)
        .await
        .unwrap();
    // Still in the work queue (unacked), so it reads as queued...
    assert_eq!(report.state, Some(DelegationState::Queued));
    assert!(
        report.message.contains("just started"),
        "{}",
        report.message
    );
    // ...and the running task is stopped all the same.
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Interrupted);
    assert_eq!(done.error.as_deref(), Some("cancelled while running"));
    assert!(done.duration_seconds < 30.0, "the process was not stopped");
}

#[tokio::test]
async fn a_silent_cancel_records_the_interruption_but_wakes_nobody() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(&bus, shell("sleep 60"), test_worker_config("default"));
    services.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, Delegation::new("hush").session("s.silent")).await;
    wait_until(WAIT, "the task to start", || async {
        started(&bus).await == 1
    })
    .await;
    Canceller::new(bus.clone())
        .cancel_delegation(&id, true)
        .await
        .unwrap();
    wait_until(WAIT, "the interrupted completion", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Interrupted);
    assert!(done.suppress_wake);
    // The wake service has seen it and acked it without posting.
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert!(api.all_posts().is_empty());
}

/// Cancels `request` (stored, not yet run) silently, then starts a worker
/// (`max_deliver` 1) and a wake, and checks that the task ends
/// `interrupted` without waking anybody, whatever else would have refused
/// it: a silent cancel means the session hears nothing.
async fn silently_cancelled_before_a_worker_sees_it(
    bus: &wakebus::bus::Bus,
    api: &SessionApiServer,
    request: &TaskRequest,
) {
    Canceller::new(bus.clone())
        .cancel_delegation(&request.delegation_id, true)
        .await
        .unwrap();
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.max_deliver = 1;
    services.worker(bus, shell("echo ran"), config);
    services.wake(bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the completion", || async {
        !done_events(bus).await.is_empty()
    })
    .await;
    wake_consumer_settled(bus).await;
    services.stop().await;
    let done = &done_events(bus).await[0];
    assert_eq!(
        (done.status, done.exit_reason.as_str(), done.suppress_wake),
        (Status::Interrupted, "cancelled", true),
        "{done:?}"
    );
    assert!(api.all_posts().is_empty(), "{:?}", api.all_posts());
    let s = &bus.subjects;
    assert!(all_messages(bus, &s.dead_letter_stream()).await.is_empty());
}

#[tokio::test]
async fn a_silently_cancelled_request_nested_too_deep_wakes_nobody() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut deep = request("s.deep.hush", "nested too deep");
    deep.depth = 5;
    publish_until_stored(&bus, &deep).await;
    silently_cancelled_before_a_worker_sees_it(&bus, &api, &deep).await;
}

#[tokio::test]
async fn a_silently_cancelled_task_past_its_deliveries_wakes_nobody_and_is_not_dead_lettered() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let req = request("s.spent.hush", "delivered before");
    publish_until_stored(&bus, &req).await;
    // Its first deliveries went to workers that stopped without a result:
    // the next one is past the worker's one delivery.
    let consumer = bus
        .worker_consumer("default", Duration::from_secs(30))
        .await
        .unwrap();
    for delivery in 1..=2 {
        let message = eventually(WAIT, "a delivery of the request", || async {
            let mut batch = consumer.fetch().max_messages(1).messages().await.ok()?;
            batch.next().await?.ok()
        })
        .await;
        assert_eq!(message.info().unwrap().delivered, delivery);
        message
            .ack_with(async_nats::jetstream::AckKind::Nak(None))
            .await
            .unwrap();
    }
    silently_cancelled_before_a_worker_sees_it(&bus, &api, &req).await;
}

#[tokio::test]
async fn cancelling_a_session_stops_its_delegations_and_no_others() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.concurrency = 2;
    // The session's tasks run until stopped (only the cancel can end
    // them), so some run and some wait in the queue; the other one ends.
    let script =
        r#"input=$(cat); case "$input" in *"keep me"*) echo kept;; *) echo part; sleep 600;; esac"#;
    services.worker(&bus, shell(script), config);
    services.wake(&bus, test_wake_config(&api.url()));
    let delegator = Delegator::new(bus.clone());
    for i in 0..4 {
        delegator
            .delegate(Delegation::new(format!("stop me {i}")).session("s.stop"))
            .await
            .unwrap();
    }
    let other = id_of(
        &delegator
            .delegate(Delegation::new("keep me").session("s.keep"))
            .await
            .unwrap(),
    );
    wait_until(WAIT, "two tasks running", || async {
        started(&bus).await >= 2
    })
    .await;
    let report = Canceller::new(bus.clone())
        .cancel_session("s.stop", false)
        .await
        .unwrap();
    assert_eq!((report.status, report.scope), ("cancelled", "session"));
    wait_until(WAIT, "five completions", || async {
        done_events(&bus).await.len() == 5
    })
    .await;
    services.stop().await;
    for done in done_events(&bus).await {
        if done.delegation_id == other {
            assert_eq!(done.status, Status::Completed);
        } else {
            assert_eq!(done.status, Status::Interrupted, "{done:?}");
        }
    }
}

#[tokio::test]
async fn cancelling_a_finished_or_unknown_delegation_says_so() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(Delegation::new("quick"))
        .await
        .unwrap();
    services.stop().await;
    let canceller = Canceller::new(bus.clone());
    let finished = canceller
        .cancel_delegation(&id_of(&result), false)
        .await
        .unwrap();
    assert_eq!(finished.status, "nothing_to_cancel");
    assert_eq!(finished.state, Some(DelegationState::Finished));
    assert!(
        finished.message.contains("already finished"),
        "{}",
        finished.message
    );
    let unknown = canceller
        .cancel_delegation("no-such-delegation", false)
        .await
        .unwrap();
    assert_eq!(unknown.state, Some(DelegationState::Unknown));
    assert!(unknown.message.contains("unknown"), "{}", unknown.message);
    assert!(canceller.cancel_delegation("bad id!", false).await.is_err());
}

/// Garbage on a delegation's completion subject (anyone allowed to publish
/// events can put it there) must not make the delegation impossible to
/// cancel: it is taken as still running, and the cancel record written.
#[tokio::test]
async fn an_unreadable_completion_does_not_stop_the_delegation_from_being_cancelled() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = wakebus::protocol::new_delegation_id();
    bus.js
        .publish(
            format!("{}.evt.sync.{id}.0.done", bus.subjects.prefix()),
            "not a completion".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let outcome = Canceller::new(bus.clone())
        .cancel_delegation(&id, false)
        .await
        .expect("the cancel is not refused");
    assert_eq!(outcome.state, Some(DelegationState::Running), "{outcome:?}");
    let records = bus
        .js
        .get_key_value(bus.subjects.cancel_bucket())
        .await
        .unwrap();
    assert!(
        records
            .get(wakebus::cancel::CancelTarget::Delegation(id.clone()).key())
            .await
            .unwrap()
            .is_some(),
        "no cancel record"
    );
}

/// A delegation counts as finished when each of its tasks has a
/// completion: completions stored under indexes outside it, or under
/// another session's token, or saying it has fewer tasks than its
/// `submitted` record does (by a misbehaving publisher), do not make a
/// batch whose other tasks still wait look finished, which would leave
/// them to run uncancelled.
#[tokio::test]
async fn completions_of_tasks_outside_a_batch_do_not_make_it_look_finished_to_a_cancel() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = wakebus::protocol::new_delegation_id();
    let prefix = bus.subjects.prefix().to_owned();
    let completion = |index: u32, task_count: u32| {
        serde_json::json!({
            "type": "async_delegation", "delegation_id": id, "task_index": index,
            "task_count": task_count, "status": "completed", "exit_reason": "completed",
            "completed_at": "2026-01-01T00:00:00Z", "summary": "done",
        })
        .to_string()
    };
    let submitted = serde_json::json!({
        "type": "delegation_submitted", "version": 1, "delegation_id": id,
        "task_index": 0, "task_count": 3, "pool": "default",
        "submitted_at": "2026-01-01T00:00:00Z",
    });
    let mut stored = vec![(format!("sync.{id}.0.submitted"), submitted.to_string())];
    // Task 0 ended; tasks 1 and 2 have not. Strangers: indexes 7 and 8,
    // task 0 again under another token, and last a completion of task 1
    // under another token that says the delegation has one task.
    for (token, index, task_count) in [
        ("sync", 0, 3),
        ("sync", 7, 3),
        ("sync", 8, 3),
        ("other", 0, 3),
        ("other", 1, 1),
    ] {
        let subject = format!("{token}.{id}.{index}.done");
        stored.push((subject, completion(index, task_count)));
    }
    for (subject, body) in stored {
        bus.js
            .publish(format!("{prefix}.evt.{subject}"), body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let outcome = Canceller::new(bus.clone())
        .cancel_delegation(&id, false)
        .await
        .expect("the cancel is not refused");
    assert_eq!(outcome.state, Some(DelegationState::Running), "{outcome:?}");
}

/// The queue check reads at most 10,000 stored requests. With more queued
/// it cannot tell, and a cancel of a delegation it did not find assumes it
/// is queued (better a cancel record too many than a task that runs after
/// its cancel was refused).
#[tokio::test]
async fn a_cancel_assumes_queued_when_the_queue_is_longer_than_the_check_reads() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let subject = bus.subjects.task("default");
    let mut acks = Vec::new();
    for index in 0..10_001 {
        let body = serde_json::to_vec(&request("s.queued", &format!("queued {index}"))).unwrap();
        acks.push(bus.js.publish(subject.clone(), body.into()).await.unwrap());
        if acks.len() == 1_000 {
            for ack in acks.drain(..) {
                ack.await.unwrap();
            }
        }
    }
    for ack in acks {
        ack.await.unwrap();
    }
    let canceller = Canceller::new(bus.clone());
    let id = wakebus::protocol::new_delegation_id();
    let report = canceller.cancel_delegation(&id, false).await.unwrap();
    assert_eq!(
        report.state,
        Some(DelegationState::Queued),
        "{}",
        report.message
    );
    assert_eq!(report.status, "cancelled");
}

/// Fails goals containing FAIL, sleeps 2 s for SLOW, completes the rest.
const BATCH_SCRIPT: &str = r#"input=$(cat); case "$input" in *FAIL*) echo "it broke" >&2; exit 1;; *SLOW*) sleep 2; echo "slow done";; *) echo "fine";; esac"#;

/// [`BATCH_SCRIPT`], but a SLOW task runs until the file `gate` exists:
/// the test says when it ends.
fn gated_batch_script(gate: &std::path::Path) -> String {
    format!(
        r#"input=$(cat); case "$input" in *FAIL*) echo "it broke" >&2; exit 1;; *SLOW*) while [ ! -e '{}' ]; do sleep 0.05; done; echo "slow done";; *) echo "fine";; esac"#,
        gate.display()
    )
}

fn batch(goals: &[&str], session: &str) -> Delegation {
    Delegation::batch(goals.iter().map(|g| g.to_string())).session(session)
}

#[tokio::test]
async fn a_batch_wakes_its_session_once_when_every_task_has_ended() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(&bus, shell(BATCH_SCRIPT), test_worker_config("default"));
    services.wake(&bus, test_wake_config(&api.url()));
    let result = Delegator::new(bus.clone())
        .delegate(batch(&["first SLOW", "second FAIL", "third"], "s.batch"))
        .await
        .unwrap();
    let json = serde_json::to_value(&result).unwrap();
    assert_eq!(json["tasks"], 3);
    let id = id_of(&result);
    wait_until(WAIT, "the batch wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    // Every completion has been handled by the wake service by now.
    wait_until(WAIT, "three completions", || async {
        done_events(&bus).await.len() == 3
    })
    .await;
    services.stop().await;
    let posts = api.accepted();
    assert_eq!(posts.len(), 1, "one consolidated turn");
    let text = posts[0].text();
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]\n")),
        "{text}"
    );
    assert!(
        text.contains("3 tasks: 2 completed, 1 not completed"),
        "{text}"
    );
    let first = text.find("Task 0: completed").expect("task 0");
    let second = text.find("Task 1: failed").expect("task 1");
    let third = text.find("Task 2: completed").expect("task 2");
    assert!(
        first < second && second < third,
        "ordered by task index: {text}"
    );
    assert!(
        text.contains("slow done") && text.contains("it broke"),
        "{text}"
    );
    assert_eq!(
        posts[0].header("idempotency-key"),
        Some(format!("{id}.batch"))
    );
}

#[tokio::test]
async fn independent_batch_tasks_each_wake_on_their_own() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // The second task ends only once the first has woken the session.
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("b");
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(&gated_batch_script(&gate)),
        test_worker_config("default"),
    );
    let mut config = test_wake_config(&api.url());
    config.coalesce_window = Duration::ZERO;
    services.wake(&bus, config);
    let mut delegation = batch(&["a", "b SLOW"], "s.indep");
    delegation.wake_mode = wakebus::protocol::WakeMode::Independent;
    Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .unwrap();
    wait_until(WAIT, "the first task woken", || async {
        api.accepted().len() == 1
    })
    .await;
    assert_eq!(done_events(&bus).await.len(), 1, "the sibling still runs");
    std::fs::write(&gate, "").unwrap();
    wait_until(WAIT, "both tasks woken", || async {
        api.woken_delegations() == 2
    })
    .await;
    services.stop().await;
    assert!(
        api.accepted()
            .iter()
            .all(|p| !p.text().contains("BATCH COMPLETE"))
    );
}

#[tokio::test]
async fn an_early_failure_notice_arrives_while_siblings_still_run() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("slow");
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(&gated_batch_script(&gate)),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let mut delegation = batch(&["quick FAIL", "patient SLOW"], "s.early");
    delegation.notify_early_failure = true;
    let id = delegate(&bus, delegation).await;
    wait_until(WAIT, "the notice", || async { api.accepted().len() == 1 }).await;
    // The sibling still runs: it has no completion yet.
    assert_eq!(done_events(&bus).await.len(), 1);
    std::fs::write(&gate, "").unwrap();
    wait_until(WAIT, "the batch wake", || async {
        api.accepted().len() == 2
    })
    .await;
    services.stop().await;
    let posts = api.accepted();
    assert!(
        posts[0]
            .text()
            .starts_with(&format!("[ASYNC DELEGATION TASK FAILED EARLY — {id}]")),
        "{}",
        posts[0].text()
    );
    assert!(
        posts[0].text().contains("Task 0 of 2 ended failed"),
        "{}",
        posts[0].text()
    );
    assert!(
        posts[1]
            .text()
            .starts_with(&format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]"))
    );
}

#[tokio::test]
async fn a_batch_larger_than_the_limit_is_refused_and_nothing_is_published() {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let goals: Vec<String> = (0..11).map(|i| format!("task {i}")).collect();
    let err = Delegator::new(bus.clone())
        .delegate(Delegation::batch(goals).session("s"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, DelegateError::BatchTooLarge { size: 11, max: 10 }),
        "{err}"
    );
    assert!(err.to_string().contains("larger than the limit of 10"));
    // A raised limit stops at the protocol's: a worker would refuse more.
    let goals: Vec<String> = (0..1_001).map(|i| format!("task {i}")).collect();
    let err = Delegator::new(bus.clone())
        .with_max_batch(1_000_000)
        .delegate(Delegation::batch(goals).session("s"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DelegateError::BatchTooLarge {
                size: 1_001,
                max: 1_000
            }
        ),
        "{err}"
    );
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(tasks.info().await.unwrap().state.messages, 0);
}

#[tokio::test]
async fn a_sync_batch_returns_every_result_inline_in_task_order() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(Delegation::batch([
            "x".to_string(),
            "y".to_string(),
            "z".to_string(),
        ]))
        .await
        .unwrap();
    services.stop().await;
    let json = serde_json::to_value(&result).unwrap();
    assert_eq!(json["mode"], "sync");
    assert_eq!(json["status"], "completed");
    let summaries: Vec<&str> = json["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["summary"].as_str().unwrap())
        .collect();
    assert_eq!(summaries, ["echo: x", "echo: y", "echo: z"]);
}

#[tokio::test]
async fn batches_wake_exactly_once_with_two_wake_instances_racing_for_the_last_completions() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.concurrency = 32;
    services.worker(
        &bus,
        Executor::Echo(wakebus::worker::executor::EchoExecutor),
        config,
    );
    for name in ["wake-a", "wake-b"] {
        let mut config = test_wake_config(&api.url());
        config.instance = name.into();
        config.coalesce_window = Duration::ZERO;
        services.wake(&bus, config);
    }
    let delegator = Delegator::new(bus.clone());
    let mut ids = Vec::new();
    for i in 0..20 {
        let result = delegator
            .delegate(batch(&["a", "b", "c"], &format!("s{}", i % 5)))
            .await
            .unwrap();
        ids.push(id_of(&result));
    }
    wait_until(WAIT, "20 batch wakes", || async {
        api.accepted().len() >= 20
    })
    .await;
    wait_until(WAIT, "60 completions", || async {
        done_events(&bus).await.len() == 60
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let mut keys: Vec<String> = api
        .accepted()
        .iter()
        .map(|p| p.header("idempotency-key").unwrap())
        .collect();
    keys.sort();
    let mut expected: Vec<String> = ids.iter().map(|id| format!("{id}.batch")).collect();
    expected.sort();
    assert_eq!(keys, expected, "each batch woke exactly once");
}

#[tokio::test]
async fn a_batch_survives_a_wake_service_restart_between_its_completions() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("later");
    let mut workers = Services::new();
    workers.worker(
        &bus,
        shell(&gated_batch_script(&gate)),
        test_worker_config("default"),
    );
    let mut first_wake = Services::new();
    first_wake.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, batch(&["now", "later SLOW"], "s.restart")).await;
    // The first completion is handled (acked) by the first wake instance...
    wait_until(WAIT, "the first completion acked", || async {
        wake_consumer_info(&bus)
            .await
            .is_some_and(|info| info.ack_floor.stream_sequence > 0)
    })
    .await;
    // ...which then goes away; a new one sees only the second.
    first_wake.stop().await;
    let mut second_wake = Services::new();
    second_wake.wake(&bus, test_wake_config(&api.url()));
    // Only now does the second task end.
    assert_eq!(done_events(&bus).await.len(), 1);
    std::fs::write(&gate, "").unwrap();
    wait_until(WAIT, "the batch wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    second_wake.stop().await;
    workers.stop().await;
    assert_eq!(api.accepted().len(), 1);
    let text = api.accepted()[0].text();
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]")),
        "{text}"
    );
    assert!(
        text.contains("fine") && text.contains("slow done"),
        "{text}"
    );
}

#[tokio::test]
async fn progress_lines_become_throttled_progress_events_and_stay_out_of_the_summary() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    // Three quick reports (throttled to one per second), a pause, a last one.
    let script = r#"echo '{"progress": "reading"}'; echo '{"progress": "thinking"}'; echo '{"progress": "still thinking"}'; sleep 1.5; echo '{"progress": "writing"}'; echo "the answer""#;
    services.worker(&bus, shell(script), test_worker_config("default"));
    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(Delegation::new("report as you go"))
        .await
        .unwrap();
    services.stop().await;
    let json = serde_json::to_value(&result).unwrap();
    assert_eq!(json["result"]["summary"], "the answer");
    let progress: Vec<wakebus::protocol::ProgressEvent> =
        all_messages(&bus, &bus.subjects.events_stream())
            .await
            .iter()
            .filter(|m| m.subject.ends_with(".progress"))
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect();
    let messages: Vec<&str> = progress.iter().map(|p| p.message.as_str()).collect();
    assert!(
        messages.len() >= 2 && messages.len() < 4,
        "throttled: {messages:?}"
    );
    // Latest wins within an interval: the first event carries one of the early reports.
    assert!(
        ["reading", "thinking", "still thinking"].contains(&messages[0]),
        "{messages:?}"
    );
    assert_eq!(messages.last(), Some(&"writing"));
    assert!(progress.iter().all(|p| p.delegation_id == id_of(&result)));
}

#[tokio::test]
async fn an_unusable_member_still_completes_its_batch() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    // Task 0 is fine; task 1 has no goal. Both claim a batch of two.
    let id = wakebus::protocol::new_delegation_id();
    let bodies = [
        format!(
            r#"{{"version":1,"delegation_id":"{id}","task_index":0,"task_count":2,"origin_session_id":"s.mixed","goal":"fine"}}"#
        ),
        format!(
            r#"{{"version":1,"delegation_id":"{id}","task_index":1,"task_count":2,"origin_session_id":"s.mixed"}}"#
        ),
    ];
    for (index, body) in bodies.iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("{id}.{index}").as_str());
        headers.insert("Wakebus-Origin-Session", "s.mixed");
        bus.js
            .publish_with_headers(bus.subjects.task("default"), headers, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    wait_until(WAIT, "the batch wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    services.stop().await;
    let text = api.accepted()[0].text();
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]")),
        "{text}"
    );
    assert!(
        text.contains("Task 1: error") && text.contains("missing field `goal`"),
        "{text}"
    );
}

/// The members of a batch whose delegation id is unusable each get an id
/// of their own for their `error` completion; as members of a batch under
/// that id they would wait for siblings that never come, and the session
/// would never learn that its delegation went nowhere.
#[tokio::test]
async fn a_batch_whose_delegation_id_is_unusable_still_wakes_its_session_with_the_error() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    for index in 0..2 {
        let body = format!(
            r#"{{"version":1,"delegation_id":"job.42","task_index":{index},"task_count":2,"wake_mode":"batch","origin_session_id":"s.badid","goal":"g"}}"#
        );
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Wakebus-Origin-Session", "s.badid");
        bus.js
            .publish_with_headers(bus.subjects.task("default"), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let reported = || {
        api.accepted()
            .iter()
            .map(|post| post.text())
            .collect::<Vec<_>>()
            .join("\n")
    };
    wait_until(WAIT, "both members' errors woken", || async {
        let text = reported();
        text.contains("task_index 0:") && text.contains("task_index 1:")
    })
    .await;
    services.stop().await;
    let text = reported();
    assert!(
        text.contains("Status: error") && text.contains("delegation id contains '.'"),
        "{text}"
    );
    assert!(
        api.accepted()
            .iter()
            .all(|post| post.session() == "s.badid")
    );
}

/// A request whose index no usable batch holds (numbered from 1, a count
/// above the limit) still gets a completion the wake accepts: its session
/// learns the task went nowhere, instead of the completion being
/// dead-lettered as inconsistent and the session hearing nothing.
#[tokio::test]
async fn a_request_whose_index_is_outside_its_batch_still_wakes_its_session_with_the_error() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let (off_by_one, far) = (
        wakebus::protocol::new_delegation_id(),
        wakebus::protocol::new_delegation_id(),
    );
    let requests = [
        (
            "s.off",
            format!(
                r#"{{"version":1,"delegation_id":"{off_by_one}","task_index":2,"task_count":2,"origin_session_id":"s.off","goal":"g"}}"#
            ),
        ),
        (
            "s.far",
            format!(
                r#"{{"version":1,"delegation_id":"{far}","task_index":5000,"task_count":6000,"origin_session_id":"s.far","goal":"g"}}"#
            ),
        ),
        // An index that cannot be read is not task 0, whose id belongs
        // to the real task 0.
        (
            "s.huge",
            format!(
                r#"{{"version":1,"delegation_id":"{far}","task_index":5000000000,"origin_session_id":"s.huge","goal":"g"}}"#
            ),
        ),
    ];
    for (session, body) in &requests {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Wakebus-Origin-Session", *session);
        bus.js
            .publish_with_headers(bus.subjects.task("default"), headers, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    wait_until(WAIT, "the three sessions' wakes", || async {
        api.accepted().len() == 3
    })
    .await;
    let text_for = |session: &str| {
        api.accepted()
            .into_iter()
            .find(|post| post.session() == session)
            .unwrap_or_else(|| panic!("no wake for {session}"))
            .text()
    };
    let off = text_for("s.off");
    assert!(
        off.contains(&off_by_one) && off.contains("task_index 2 is not below task_count 2"),
        "{off}"
    );
    let far_text = text_for("s.far");
    assert!(
        far_text.contains(&format!("delegation {far}, task_index 5000"))
            && far_text.contains("above the limit"),
        "{far_text}"
    );
    let huge = text_for("s.huge");
    assert!(
        huge.contains(&format!("delegation {far}, task_index unreadable"))
            && huge.contains("[ASYNC DELEGATION COMPLETE — invalid-"),
        "{huge}"
    );
    // Nothing was found inconsistent on the way.
    let poison = all_messages(&bus, &bus.subjects.dead_letter_stream())
        .await
        .into_iter()
        .filter(|m| m.subject.contains(".wake."))
        .count();
    assert_eq!(poison, 0, "a completion was dead-lettered by the wake");
    services.stop().await;
}

/// Makes the task queue take one request and refuse the others; returns
/// it and its settings before, to restore.
async fn take_one_request_only(
    bus: &wakebus::bus::Bus,
) -> (
    async_nats::jetstream::stream::Stream,
    async_nats::jetstream::stream::Config,
) {
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    let config = tasks.info().await.unwrap().config.clone();
    let mut refusing = config.clone();
    refusing.max_messages = 1;
    refusing.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    bus.js.update_stream(&refusing).await.unwrap();
    (tasks, config)
}

/// Delegates `delegation` while the task queue takes one request only, so
/// that it fails as stored in part: the delegation id the error names, and
/// the queue's own settings to put back.
async fn delegated_in_part(
    bus: &wakebus::bus::Bus,
    delegation: Delegation,
) -> (String, async_nats::jetstream::stream::Config) {
    let (_, config) = take_one_request_only(bus).await;
    let error = Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .unwrap_err();
    let DelegateError::NotStored { delegation_id, .. } = error else {
        panic!("{error}");
    };
    (delegation_id, config)
}

#[tokio::test]
async fn a_batch_stored_only_in_part_is_completed_by_delegating_it_again_under_its_id_and_runs_each_task_once()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let (mut tasks, config) = take_one_request_only(&bus).await;
    let goals = ["first", "second", "third"].map(String::from);
    let delegation = || Delegation::batch(goals.clone()).session("s.part");
    let error = Delegator::new(bus.clone())
        .delegate(delegation())
        .await
        .unwrap_err();
    let DelegateError::NotStored { delegation_id, .. } = &error else {
        panic!("{error}");
    };
    assert!(
        error
            .to_string()
            .contains(&format!("--delegation-id {delegation_id}")),
        "{error}"
    );
    assert_eq!(tasks.info().await.unwrap().state.messages, 1);

    bus.js.update_stream(&config).await.unwrap();
    let mut again = delegation();
    again.delegation_id = Some(delegation_id.clone());
    let result = Delegator::new(bus.clone()).delegate(again).await.unwrap();
    assert_eq!(result.delegation_id(), delegation_id);
    assert_eq!(tasks.info().await.unwrap().state.messages, 3);

    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the batch's wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 1);
    assert!(
        posts[0].text().contains("3 completed"),
        "{}",
        posts[0].text()
    );
    let mut ran: Vec<u32> = done_events(&bus)
        .await
        .iter()
        .map(|d| d.task_index)
        .collect();
    ran.sort_unstable();
    assert_eq!(ran, [0, 1, 2], "each task ran once");
}

/// A nats-server restart forgets the ids of requests already consumed: it
/// rebuilds its duplicate window from the messages still stored, and the
/// task queue deleted each finished task's request. The retry that the
/// restart made necessary must not send a finished task again (nothing
/// else would stop it running twice: it is a first delivery of a request
/// stored within the window), and still sends the task never stored.
#[tokio::test]
async fn a_retry_after_a_server_restart_does_not_run_a_finished_task_again() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let delegation = || Delegation::batch(["first", "second"].map(String::from)).session("s.rs");
    let (delegation_id, config) = delegated_in_part(&bus, delegation()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    wait_until(
        WAIT,
        "the stored task to finish and its request to go",
        || async {
            done_events(&bus).await.len() == 1
                && stored_messages(&bus, &bus.subjects.tasks_stream()).await == 0
        },
    )
    .await;
    services.stop().await;
    bus.js.update_stream(&config).await.unwrap();

    nats.restart_gracefully().await;
    wait_until(WAIT, "the test's connection to come back", || async {
        bus.client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    let mut again = delegation();
    again.delegation_id = Some(delegation_id.clone());
    Delegator::new(bus.clone()).delegate(again).await.unwrap();
    let queued: Vec<TaskRequest> = all_messages(&bus, &bus.subjects.tasks_stream())
        .await
        .iter()
        .map(|m| TaskRequest::decode(&m.payload).unwrap())
        .collect();
    let indexes: Vec<u32> = queued.iter().map(|r| r.task_index).collect();
    assert_eq!(indexes, [1], "only the task never stored is sent again");
    // With the time of the first submission, by which a worker tells a
    // copy stored after the duplicate window.
    let first_record = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .find(|m| m.subject.ends_with(".submitted"))
        .unwrap();
    assert_eq!(queued[0].created_at, Some(first_record.time));
}

/// A deployment whose requests stream forgets ids after 1 s, and the
/// settings it was provisioned with (for a worker to keep them).
async fn bus_with_a_short_duplicate_window(
    nats: &NatsServer,
) -> (wakebus::bus::Bus, wakebus::bus::BusSettings) {
    let settings = wakebus::bus::BusSettings {
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    };
    let client = wakebus::connect::NatsConfig::new(nats.url())
        .connect()
        .await
        .unwrap();
    let prefix = unique_prefix();
    let bus = wakebus::bus::Bus::new(client, wakebus::protocol::Subjects::new(&prefix).unwrap());
    bus.provision(&settings).await.unwrap();
    (bus, settings)
}

/// The task queue forgets a request's id once its duplicate window has
/// passed, even while it still holds the request. A delegation sent again
/// under its id after that, while one of its requests still waits for a
/// worker, must not store that request beside the first (both would run),
/// and still sends the task never stored.
#[tokio::test]
async fn a_retry_after_the_duplicate_window_does_not_send_a_request_still_queued_again() {
    init_logs();
    let nats = NatsServer::start().await;
    let (bus, _) = bus_with_a_short_duplicate_window(&nats).await;
    let delegation = || Delegation::batch(["first", "second"].map(String::from)).session("s.q2");
    let (delegation_id, config) = delegated_in_part(&bus, delegation()).await;
    bus.js.update_stream(&config).await.unwrap();
    // Another request, sent after the first delegation's, stored again
    // as a new message: the window has passed for the delegation's too.
    let marker = request("s.marker", "marker");
    publish_until_stored(&bus, &marker).await;
    publish_until_stored_anew(&bus, &marker).await;

    let mut again = delegation();
    again.delegation_id = Some(delegation_id.clone());
    Delegator::new(bus.clone()).delegate(again).await.unwrap();
    let mut indexes: Vec<u32> = all_messages(&bus, &bus.subjects.tasks_stream())
        .await
        .iter()
        .map(|m| TaskRequest::decode(&m.payload).unwrap())
        .filter(|r| r.delegation_id == delegation_id)
        .map(|r| r.task_index)
        .collect();
    indexes.sort_unstable();
    assert_eq!(indexes, [0, 1], "each task queued once");
}

/// JetStream drops a request sent again under its `Nats-Msg-Id` only within
/// the requests stream's duplicate window (1 s here). A delegation sent
/// again under its id later sends nothing for a task that has a
/// completion; a copy a publisher sends again is checked against the
/// history before it runs (stored long after its `created_at`, or without
/// one), and does not run again.
#[tokio::test]
async fn a_task_sent_again_after_the_duplicate_window_does_not_run_again() {
    init_logs();
    // The process's recorder: under nextest (one process per test) it
    // counts this test's worker only; under `cargo test` others' too.
    let metrics = wakebus::ops::metrics::recorder().unwrap();
    let nats = NatsServer::start().await;
    let (bus, settings) = bus_with_a_short_duplicate_window(&nats).await;
    let mut services = Services::new();
    services.worker_with_settings(
        &bus,
        settings.clone(),
        Executor::Echo(wakebus::worker::executor::EchoExecutor),
        test_worker_config("default"),
    );
    let tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    // The requests stream has stored `stored` requests, all acknowledged.
    let settled = |stored: u64| {
        let mut tasks = tasks.clone();
        async move {
            let info = tasks.info().await.unwrap();
            info.state.last_sequence == stored && info.state.messages == 0
        }
    };

    // A delegation with an id of the caller's, and a request from another
    // publisher that does not say when it was created.
    let id = wakebus::protocol::new_delegation_id();
    let delegation = || {
        let mut delegation = Delegation::new("once").session("s.again");
        delegation.delegation_id = Some(id.clone());
        delegation
    };
    let mut raw = request("s.raw", "once too");
    raw.created_at = None;
    let send_both = || async {
        Delegator::new(bus.clone())
            .delegate(delegation())
            .await
            .unwrap();
        publish_until_stored(&bus, &raw).await;
    };
    send_both().await;
    wait_until(WAIT, "both tasks done", || settled(2)).await;
    assert_eq!(done_events(&bus).await.len(), 2);

    // A publisher that sends the delegation's request again as it was
    // (its `created_at` kept), and the one without `created_at`, each
    // until JetStream stores it rather than drop it as a duplicate: past
    // the window.
    let first = done_events(&bus)
        .await
        .into_iter()
        .find(|done| done.delegation_id == id)
        .unwrap();
    let mut copy = request("s.again", "once");
    copy.delegation_id = id.clone();
    copy.created_at = first.dispatched_at;
    // Every request published from here on, stored or dropped.
    let mut sent = bus
        .client
        .subscribe(bus.subjects.task("default"))
        .await
        .unwrap();
    bus.client.flush().await.unwrap();
    publish_until_stored_anew(&bus, &copy).await;
    publish_until_stored_anew(&bus, &raw).await;
    // The delegator sends again only the tasks without a completion: none
    // here. Seen by what it publishes, not by what JetStream stores (a
    // request it sent would be dropped now, as a duplicate of the copy).
    Delegator::new(bus.clone())
        .delegate(delegation())
        .await
        .unwrap();
    // Whatever this connection published has come back to it once a round
    // trip returns.
    bus.client.flush().await.unwrap();
    let mut sources = Vec::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(100), sent.next()).await
    {
        let source = message
            .headers
            .and_then(|h| h.get("ce-source").map(|v| v.to_string()));
        sources.push(source.unwrap_or_default());
    }
    assert!(
        sources.iter().filter(|source| *source == "test").count() >= 2,
        "the copies are seen: {sources:?}"
    );
    assert!(
        sources.iter().all(|source| source == "test"),
        "the delegator sent a request again: {sources:?}"
    );
    // JetStream stored both copies (sequences 3 and 4: nothing from the
    // delegator), and the worker settled them.
    wait_until(WAIT, "both copies settled", || settled(4)).await;
    services.stop().await;
    let mut ran: Vec<String> = done_events(&bus)
        .await
        .into_iter()
        .map(|d| d.delegation_id)
        .collect();
    ran.sort_unstable();
    let mut expected = vec![id.clone(), raw.delegation_id.clone()];
    expected.sort_unstable();
    assert_eq!(ran, expected, "each task ran once");
    // Both copies were acked unrun, and counted.
    let rendered = metrics.render();
    let already_done: u64 = rendered
        .lines()
        .find_map(|line| line.strip_prefix(r#"wakebus_tasks_already_done_total{pool="default"} "#))
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no count of tasks already done:\n{rendered}"));
    assert!(already_done >= 2, "{rendered}");
}

/// A copy of a task that ran reaches a worker while no stream answers
/// for its completions, as while the events stream elects a leader. The
/// worker keeps asking whether the completion is stored, instead of giving
/// up within a second and a half and running the task a second time.
#[tokio::test]
async fn a_worker_keeps_asking_whether_a_task_already_ran_while_no_stream_answers() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let runs = tempfile::tempdir().unwrap();
    let log = runs.path().join("runs");
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(&format!(
            "cat > /dev/null; echo run >> '{}'; echo ok",
            log.display()
        )),
        test_worker_config("default"),
    );
    let ran = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    // Undated, so that every copy of it is asked about.
    let mut raw = request("s.probe", "once");
    raw.created_at = None;
    publish_until_stored(&bus, &raw).await;
    wait_until(WAIT, "the task's completion", || async {
        done_events(&bus).await.len() == 1
    })
    .await;
    assert_eq!(ran(), 1);

    // Nobody listens on the events stream's subjects for a while.
    let config = events_stream_unanswered(&bus).await;
    // A copy JetStream does not take for a duplicate (another message id).
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "a-copy");
    headers.insert("Wakebus-Origin-Session", "s.probe");
    bus.js
        .publish_with_headers(
            bus.subjects.task("default"),
            headers,
            serde_json::to_vec(&raw).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    // The election lasts 3 s (its length is the scenario, not a wait for
    // a condition): twice what the worker used to keep asking.
    tokio::time::sleep(Duration::from_secs(3)).await;
    bus.js.update_stream(&config).await.unwrap();
    let tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    wait_until(WAIT, "the copy acknowledged", || {
        let mut tasks = tasks.clone();
        async move {
            let state = tasks.info().await.unwrap().state.clone();
            state.last_sequence == 2 && state.messages == 0
        }
    })
    .await;
    services.stop().await;
    assert_eq!(ran(), 1, "the task ran a second time");
}

/// A task still being checked when its worker is told to stop (here: asked
/// whether it already ran, while no stream answers) is handed back at once,
/// not started within the shutdown grace: the grace is for tasks already
/// running, and one started in it and cut short at its end would run again
/// elsewhere from the start.
#[tokio::test]
async fn a_task_still_being_checked_when_its_worker_stops_is_handed_back_unstarted() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let runs = tempfile::tempdir().unwrap();
    let log = runs.path().join("runs");
    let worker = |services: &mut Services| {
        let mut config = test_worker_config("default");
        config.shutdown_grace = Duration::from_secs(120);
        services.worker(
            &bus,
            shell(&format!(
                "cat > /dev/null; echo run >> '{}'; echo ok",
                log.display()
            )),
            config,
        );
    };
    let ran = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let mut first = Services::new();
    worker(&mut first);
    // Undated, so that the worker asks whether it already ran; no stream
    // answers, so it keeps asking (and, left to itself, runs it after some
    // fifteen seconds).
    let events = events_stream_unanswered(&bus).await;
    let mut raw = request("s.stopping", "unstarted");
    raw.created_at = None;
    publish_until_stored(&bus, &raw).await;
    let consumer = bus.subjects.worker_consumer("default");
    let tasks = bus.subjects.tasks_stream();
    // (Its consumer is made by the worker as it starts.)
    wait_until(WAIT, "the worker holding the task", || async {
        let consumer = bus.js.get_consumer_from_stream(&consumer, &tasks).await;
        let consumer: Option<async_nats::jetstream::consumer::PullConsumer> = consumer.ok();
        consumer.is_some_and(|c| c.cached_info().num_ack_pending == 1)
    })
    .await;
    tokio::time::timeout(Duration::from_secs(60), first.stop())
        .await
        .expect("the worker waited out its grace for a task that had not started");
    assert_eq!(ran(), 0, "the task started after the stop signal");

    // Handed back: the next worker runs it, once.
    bus.js.update_stream(&events).await.unwrap();
    let mut second = Services::new();
    worker(&mut second);
    wait_until(WAIT, "the task's completion", || async {
        done_events(&bus).await.len() == 1
    })
    .await;
    second.stop().await;
    assert_eq!(ran(), 1);
}

/// The error completion of a request nested too deep is kept and
/// published again until stored, like any completion, while the request
/// stays with its worker: it was handed back on the first failure, to be
/// delivered, decoded and refused again.
#[tokio::test]
async fn a_depth_limit_completion_not_stored_at_once_is_published_again_by_the_same_delivery() {
    init_logs();
    // The process's recorder: under nextest (one process per test) it
    // counts this test's worker only.
    let metrics = wakebus::ops::metrics::recorder().unwrap();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.max_depth = 1;
    services.worker(&bus, shell("cat > /dev/null; echo ran"), config);
    let events = events_stream_unanswered(&bus).await;
    let mut deep = request("s.deep", "nested too deep");
    deep.depth = 2;
    publish_until_stored(&bus, &deep).await;
    let retried = format!(
        "{}{{pool=\"default\"}} ",
        wakebus::ops::metrics::COMPLETION_PUBLISH_RETRIES
    );
    wait_until(WAIT, "the refusal's publish to fail", || async {
        metrics
            .render()
            .lines()
            .any(|line| line.starts_with(&retried))
    })
    .await;
    bus.js.update_stream(&events).await.unwrap();
    wait_until(WAIT, "the refusal stored", || async {
        done_events(&bus).await.len() == 1
    })
    .await;
    let done = &done_events(&bus).await[0];
    assert_eq!(done.status, Status::Error, "{done:?}");
    assert_eq!(done.exit_reason, "depth_limit", "{done:?}");
    let consumer = bus.subjects.worker_consumer("default");
    let tasks = bus.subjects.tasks_stream();
    wait_until(WAIT, "the request acknowledged", || async {
        let consumer: async_nats::jetstream::consumer::PullConsumer = bus
            .js
            .get_consumer_from_stream(&consumer, &tasks)
            .await
            .unwrap();
        let info = consumer.cached_info();
        info.num_ack_pending == 0 && info.ack_floor.stream_sequence == 1
    })
    .await;
    let consumer: async_nats::jetstream::consumer::PullConsumer = bus
        .js
        .get_consumer_from_stream(&consumer, &tasks)
        .await
        .unwrap();
    assert_eq!(
        consumer.cached_info().num_redelivered,
        0,
        "the request was handed back and delivered again"
    );
    services.stop().await;
}

#[tokio::test]
async fn a_delegation_id_given_by_the_caller_must_be_a_valid_id() {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut delegation = Delegation::new("work").session("s");
    delegation.delegation_id = Some("not.an id".to_owned());
    let error = Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .unwrap_err();
    assert!(matches!(error, DelegateError::InvalidId(_)), "{error}");
}

/// Delegates `delegation` as `id` with `--wait`, runs it with an echo
/// worker, and returns its results.
async fn run_and_wait(
    bus: &wakebus::bus::Bus,
    id: &str,
    mut delegation: Delegation,
) -> Vec<CompletionEvent> {
    delegation.delegation_id = Some(id.to_owned());
    delegation.wait = true;
    let mut services = Services::new();
    services.echo_worker(bus);
    let result = tokio::time::timeout(WAIT, Delegator::new(bus.clone()).delegate(delegation))
        .await
        .expect("the wait ends")
        .unwrap();
    services.stop().await;
    let DelegateResult::Dispatched { results, .. } = result else {
        panic!("{result:?}");
    };
    results
}

#[tokio::test]
async fn waiting_for_a_delegation_reads_past_garbage_and_strangers_on_its_subjects() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = wakebus::protocol::new_delegation_id();
    let token = wakebus::protocol::session_token("s.wait");
    let subject = |index| bus.subjects.event(&token, &id, index, EventKind::Done);
    // Stored before the task runs: garbage on its completion subject, and a
    // completion of a task index the delegation does not have.
    let garbage = bus.js.publish(subject(0), "garbage".into()).await.unwrap();
    garbage.await.unwrap();
    let mut stranger = TaskRequest::new(id.clone(), "stranger");
    stranger.task_index = 3;
    stranger.task_count = 4;
    let stranger = CompletionEvent::for_request(&stranger, Status::Completed, "completed");
    let body = serde_json::to_vec(&stranger).unwrap();
    let stored = bus.js.publish(subject(3), body.into()).await.unwrap();
    stored.await.unwrap();

    let delegation = Delegation::new("real work").session("s.wait");
    let results = run_and_wait(&bus, &id, delegation).await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].task_index, 0);
    assert_eq!(results[0].status, Status::Completed);
}

/// A batch task run twice (a stall) has two completions: the wait keeps
/// the first, as PROTOCOL 11.5 tells other clients to; and a completion on
/// the delegation's subject that names another delegation or task count is
/// not taken for one of its tasks.
#[tokio::test]
async fn waiting_for_a_batch_keeps_each_tasks_first_completion_and_ignores_other_delegations() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = wakebus::protocol::new_delegation_id();
    let token = wakebus::protocol::session_token("s.first");
    let subject = bus.subjects.event(&token, &id, 0, EventKind::Done);
    let publish = |delegation_id: &str, task_count: u32, summary: &str| {
        let mut request = TaskRequest::new(delegation_id.to_owned(), "a");
        request.task_count = task_count;
        let mut event = CompletionEvent::for_request(&request, Status::Failed, "failed");
        event.summary = Some(summary.to_owned());
        let body = serde_json::to_vec(&event).unwrap();
        let (bus, subject) = (bus.clone(), subject.clone());
        async move {
            let stored = bus.js.publish(subject, body.into()).await.unwrap();
            stored.await.unwrap();
        }
    };
    publish("another-delegation", 2, "not this one").await;
    publish(&id, 3, "another task count").await;
    publish(&id, 2, "the first run").await;
    publish(&id, 2, "the second run").await;

    let delegation = Delegation::batch(["a".to_owned(), "b".to_owned()]).session("s.first");
    let results = run_and_wait(&bus, &id, delegation).await;
    assert_eq!(results.len(), 2);
    assert_eq!(
        results[0].summary.as_deref(),
        Some("the first run"),
        "{results:#?}"
    );
    assert_eq!(results[1].status, Status::Completed);
}

/// Each publish's wait for its acknowledgement starts when it is awaited:
/// awaited one after the other, a round of a batch's writes that nobody
/// answers lasted 5 s per task (76 s for five tasks, hours for the largest
/// batches), far past the bound gateways size their timeouts on.
#[tokio::test]
async fn a_batch_whose_writes_nobody_answers_fails_within_the_documented_bound() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.js
        .delete_stream(bus.subjects.events_stream())
        .await
        .expect("delete the events stream");
    // Takes the records' publishes, so the client gets no "no responders"
    // answer, and never replies.
    let _silent = bus
        .client
        .subscribe(format!("{prefix}.evt.>"))
        .await
        .expect("subscribe");
    let goals = ["a", "b", "c", "d", "e"].map(String::from);
    let started = std::time::Instant::now();
    let error = Delegator::new(bus.clone())
        .delegate(Delegation::batch(goals).session("s.silent"))
        .await
        .expect_err("nothing was stored");
    let took = started.elapsed();
    assert!(
        matches!(error, DelegateError::NotStored { .. }),
        "{error:?}"
    );
    // Three rounds of 5 s and the pauses between them; the docs promise
    // about 35 s for both steps.
    assert!(took < Duration::from_secs(35), "took {took:?}");
}

/// A delegation whose `submitted` record is acknowledged only as a
/// duplicate of nothing stored (nats-server before 2.10.25 after a leader
/// election: `duplicate: true`, sequence 0) is reported as not published,
/// rather than returned as if it were queued. A NATS responder stands in
/// for the events stream and answers so.
#[tokio::test]
async fn a_delegation_whose_record_is_acked_as_a_duplicate_of_nothing_stored_is_reported_unpublished()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.js
        .delete_stream(bus.subjects.events_stream())
        .await
        .expect("delete the events stream");
    let mut events = bus
        .client
        .subscribe(format!("{prefix}.evt.>"))
        .await
        .expect("subscribe");
    let client = bus.client.clone();
    let responder = tokio::spawn(async move {
        let mut answered = 0;
        while let Some(message) = events.next().await {
            if let Some(reply) = message.reply {
                let answer = r#"{"stream":"EVENTS","seq":0,"duplicate":true}"#;
                client.publish(reply, answer.into()).await.expect("answer");
                answered += 1;
            }
        }
        answered
    });
    let error = Delegator::new(bus.clone())
        .delegate(Delegation::new("never queued").session("s.dropped"))
        .await
        .expect_err("not published");
    assert!(
        matches!(error, DelegateError::NotStored { .. }),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("as a duplicate of a copy it has not stored yet"),
        "{error}"
    );
    // Records first: with the record not stored, the task was never sent.
    let tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .expect("the tasks stream")
        .info()
        .await
        .expect("its info")
        .state
        .messages;
    assert_eq!(tasks, 0, "a task was queued");
    responder.abort();
}
