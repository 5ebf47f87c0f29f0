//! Operating wakebus: `events` filters, `status --json`, and the metrics and
//! health endpoints, all against real nats-server processes and the real
//! `wakebus` binary (`replay` is in tests/replay.rs).

mod common;

use std::time::Duration;

use common::cli::{field, publish_task, wakebus};
use common::process::{LogsOnPanic, Service, sample, spawn_with_metrics, wake_args, worker_args};
use common::*;
use futures::TryStreamExt;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use wakebus::bus::Bus;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::protocol::{EventKind, HEADER_REPLAY, Status, session_token};

const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------- events

#[tokio::test]
async fn events_for_a_session_with_dots_and_wildcards_in_its_id_show_only_that_session() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    // Ids that would be subject wildcards or extra tokens if used raw.
    let tricky = "team.alpha *> session";
    let (mine, _, _) = publish_task(&bus, Some(tricky), Status::Completed).await;
    for other in ["team.alpha", "team.*", "*", ">"] {
        publish_task(&bus, Some(other), Status::Completed).await;
    }
    publish_task(&bus, None, Status::Completed).await;

    let lines = wakebus(&nats.url(), &prefix, &["events", "--session", tricky])
        .await
        .ok_json();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert_eq!(field(&lines, "kind"), ["started", "done"]);
    for line in &lines {
        assert_eq!(line["origin_session"], tricky);
        assert_eq!(line["session_token"], session_token(tricky));
        assert_eq!(line["delegation_id"], mine.delegation_id.as_str());
        assert_eq!(line["headers"]["Wakebus-Origin-Session"], tricky);
    }
}

#[tokio::test]
async fn events_for_a_delegation_show_its_started_and_done_events_in_order() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    publish_task(&bus, Some("s1"), Status::Completed).await;
    let (wanted, started_seq, done_seq) = publish_task(&bus, Some("s1"), Status::Failed).await;
    publish_task(&bus, Some("s2"), Status::Completed).await;

    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["events", "--delegation", &wanted.delegation_id],
    )
    .await
    .ok_json();
    assert_eq!(
        field(&lines, "seq"),
        [started_seq, done_seq].map(|s| s.to_string())
    );
    assert_eq!(lines[1]["status"], "failed");
    assert_eq!(lines[1]["body"]["summary"], "failed summary");
}

#[tokio::test]
async fn events_of_one_kind_leave_out_the_other() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    for _ in 0..3 {
        publish_task(&bus, Some("s1"), Status::Completed).await;
    }
    let done = wakebus(&nats.url(), &prefix, &["events", "--kind", "done"])
        .await
        .ok_json();
    assert_eq!(field(&done, "kind"), ["done"; 3]);
    let started = wakebus(&nats.url(), &prefix, &["events", "--kind", "started"])
        .await
        .ok_json();
    assert_eq!(field(&started, "kind"), ["started"; 3]);
}

#[tokio::test]
async fn events_with_a_status_show_only_completions_with_that_status() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut failed = Vec::new();
    for status in [
        Status::Completed,
        Status::Failed,
        Status::Timeout,
        Status::Failed,
    ] {
        let (req, _, _) = publish_task(&bus, Some("s1"), status).await;
        if status == Status::Failed {
            failed.push(req.delegation_id);
        }
    }
    let lines = wakebus(&nats.url(), &prefix, &["events", "--status", "failed"])
        .await
        .ok_json();
    assert_eq!(field(&lines, "delegation_id"), failed);
    assert_eq!(field(&lines, "status"), ["failed", "failed"]);
}

#[tokio::test]
async fn events_since_and_until_select_a_time_window() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (early, _, early_done) = publish_task(&bus, Some("s1"), Status::Completed).await;
    let stream = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let stored_at = |seq| {
        let stream = stream.clone();
        async move { stream.get_raw_message(seq).await.unwrap().time }
    };
    let boundary = stored_at(early_done).await;
    // The next task must be stored strictly later than the first one.
    wait_until(WAIT, "the clock to move on", || async {
        time::OffsetDateTime::now_utc() > boundary
    })
    .await;
    let (late, late_started, _) = publish_task(&bus, Some("s1"), Status::Completed).await;
    let late_start = stored_at(late_started).await;
    let rfc = |t: time::OffsetDateTime| wakebus::history::rfc3339(t);

    let until = wakebus(&nats.url(), &prefix, &["events", "--until", &rfc(boundary)])
        .await
        .ok_json();
    assert_eq!(
        field(&until, "delegation_id"),
        [early.delegation_id.as_str(); 2]
    );
    let since = wakebus(
        &nats.url(),
        &prefix,
        &["events", "--since", &rfc(late_start)],
    )
    .await
    .ok_json();
    assert_eq!(
        field(&since, "delegation_id"),
        [late.delegation_id.as_str(); 2]
    );
    let last_hour = wakebus(&nats.url(), &prefix, &["events", "--since", "1h"])
        .await
        .ok_json();
    assert_eq!(last_hour.len(), 4);
    let before_an_hour_ago = wakebus(&nats.url(), &prefix, &["events", "--until", "1h"])
        .await
        .ok_json();
    assert!(before_an_hour_ago.is_empty(), "{before_an_hour_ago:?}");
}

#[tokio::test]
async fn events_from_and_to_a_sequence_select_that_range() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    for _ in 0..4 {
        publish_task(&bus, Some("s1"), Status::Completed).await;
    }
    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["events", "--from-seq", "3", "--to-seq", "6"],
    )
    .await
    .ok_json();
    assert_eq!(field(&lines, "seq"), ["3", "4", "5", "6"]);
    let done_in_range = wakebus(
        &nats.url(),
        &prefix,
        &[
            "events",
            "--from-seq",
            "3",
            "--to-seq",
            "6",
            "--kind",
            "done",
        ],
    )
    .await
    .ok_json();
    assert_eq!(field(&done_in_range, "seq"), ["4", "6"]);
}

#[tokio::test]
async fn events_of_task_dead_letters_select_by_pool() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    for pool in ["default", "gpu"] {
        services.worker(
            &bus,
            wakebus::worker::executor::Executor::Echo(Default::default()),
            test_worker_config(pool),
        );
        let body = format!(r#"{{"version":1,"delegation_id":"nogoal-{pool}"}}"#);
        let ack = bus
            .js
            .publish(bus.subjects.task(pool), body.into())
            .await
            .unwrap();
        ack.await.unwrap();
    }
    wait_until(WAIT, "both dead letters", || async {
        all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .len()
            == 2
    })
    .await;
    let gpu = wakebus(
        &nats.url(),
        &prefix,
        &["events", "--dead-letters", "task", "--pool", "gpu"],
    )
    .await
    .ok_json();
    assert_eq!(field(&gpu, "delegation_id"), ["nogoal-gpu"]);
    assert_eq!(gpu[0]["kind"], "dlq-task");
    assert_eq!(gpu[0]["pool"], "gpu");
    assert!(
        gpu[0]["dead_letter_reason"]
            .as_str()
            .unwrap()
            .contains("goal")
    );
    let all = wakebus(&nats.url(), &prefix, &["events", "--dead-letters"])
        .await
        .ok_json();
    assert_eq!(all.len(), 2);
    let on_events = wakebus(&nats.url(), &prefix, &["events", "--pool", "gpu"]).await;
    assert_eq!(on_events.code(), Some(1));
    assert!(
        on_events.stderr().contains("--pool"),
        "{}",
        on_events.stderr()
    );
    services.stop().await;
}

#[tokio::test]
async fn events_refuse_malformed_or_contradictory_filters_with_a_clear_error() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    bus(&nats.url(), &prefix).await;
    for (args, expected) in [
        (vec!["events", "--since", "yesterday"], "--since"),
        (vec!["events", "--delegation", "a.b"], "delegation id"),
        (
            vec!["events", "--kind", "started", "--status", "failed"],
            "events have none",
        ),
        (
            vec!["events", "--from-seq", "9", "--to-seq", "2"],
            "--from-seq",
        ),
        (vec!["events", "--session", "bad\nid"], "origin session id"),
    ] {
        let run = wakebus(&nats.url(), &prefix, &args).await;
        assert_eq!(run.code(), Some(1), "{args:?} did not fail");
        assert!(
            run.stderr().contains(expected),
            "{args:?}: {}",
            run.stderr()
        );
        assert!(run.stdout().is_empty());
    }
    let missing = wakebus(&nats.url(), "nosuchdeployment", &["events"]).await;
    assert_eq!(missing.code(), Some(1));
    assert!(
        missing.stderr().contains("NOSUCHDEPLOYMENT_EVENTS"),
        "{}",
        missing.stderr()
    );
}

// ---------------------------------------------------------------- status

#[tokio::test]
async fn status_json_reports_streams_consumers_dead_letters_instances_and_waiting_sessions() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(503); // wakes stay undelivered (retried) meanwhile
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.concurrency = 3;
    config.instance = "worker-status-test".to_owned();
    services.worker(
        &bus,
        wakebus::worker::executor::Executor::Echo(Default::default()),
        config,
    );
    let mut wake = test_wake_config(&api.url());
    wake.instance = "wake-status-test".to_owned();
    services.wake(&bus, wake);
    let waiting = "s.status *>";
    let delegator = Delegator::new(bus.clone());
    let mut ids = Vec::new();
    for goal in ["one", "two"] {
        let result = delegator
            .delegate(Delegation::new(goal).session(waiting))
            .await
            .unwrap();
        ids.push(id_of(&result));
    }
    // The unusable request only after both completions, so that its
    // session's wake is the younger one.
    // Each delegation: submitted, started and done.
    wait_until(WAIT, "both completions", || async {
        all_messages(&bus, &bus.subjects.events_stream())
            .await
            .len()
            == 6
    })
    .await;
    let ack = bus
        .js
        .publish(
            bus.subjects.task("default"),
            r#"{"version":1,"delegation_id":"nogoal","origin_session_id":"s.other"}"#.into(),
        )
        .await
        .unwrap();
    ack.await.unwrap();

    // `--strict`: once everything could be read, it exits 0 (a snapshot
    // taken while something could not be read exits 3 and is retried).
    let args = [
        "status",
        "--json",
        "--strict",
        "--discovery-timeout",
        "300ms",
    ];
    let report = eventually(WAIT, "status to show the known state", || async {
        let run = wakebus(&nats.url(), &prefix, &args).await;
        if run.code() != Some(0) {
            return None;
        }
        let report: Value = serde_json::from_str(&run.stdout()).unwrap_or_default();
        let wake = report["consumers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == "wake").cloned())
            .unwrap_or_default();
        let ready = report["services"].as_array().is_some_and(|s| s.len() == 2)
            && report["dead_letters"]["total"] == 1
            && wake["ack_pending"] == 3
            && report["oldest_undelivered"]
                .as_array()
                .is_some_and(|s| s.len() == 2);
        ready.then_some(report)
    })
    .await;

    assert_eq!(report["prefix"], prefix.as_str());
    let stream = |name: String| {
        report["streams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name.as_str())
            .cloned()
            .unwrap()
    };
    let events = stream(bus.subjects.events_stream());
    assert_eq!(events["present"], true);
    assert_eq!(
        events["messages"], 7,
        "two submitted, two started, three done"
    );
    assert!(events["bytes"].as_u64().unwrap() > 0);
    assert!(events["first_time"].is_string() && events["last_time"].is_string());
    assert_eq!(stream(bus.subjects.tasks_stream())["messages"], 0);
    assert_eq!(stream(bus.subjects.dead_letter_stream())["messages"], 1);
    // The wake's buckets are listed with the streams; a single server has
    // one replica of each and no replica set to report.
    let listed: Vec<&str> = report["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(listed, bus.subjects.all_streams());
    for name in &bus.subjects.all_streams()[3..] {
        assert_eq!(stream(name.clone())["present"], true, "{name}");
    }
    for s in report["streams"].as_array().unwrap() {
        assert_eq!(
            (s["replicas"].as_u64(), &s["cluster"]),
            (Some(1), &Value::Null),
            "{s}"
        );
    }

    let consumers = report["consumers"].as_array().unwrap();
    assert_eq!(field(consumers, "name"), ["worker-default", "wake"]);
    let worker_consumer = &consumers[0];
    assert_eq!(worker_consumer["stream"], bus.subjects.tasks_stream());
    assert_eq!(worker_consumer["pending"], 0);
    assert_eq!(worker_consumer["ack_pending"], 0);
    assert!(worker_consumer["waiting_pulls"].as_u64().unwrap() <= 1);
    let wake_consumer = &consumers[1];
    assert_eq!(wake_consumer["pending"], 0);
    assert_eq!(wake_consumer["ack_pending"], 3);

    let dead = &report["dead_letters"];
    assert_eq!(dead["tasks"], serde_json::json!({"default": 1}));
    assert_eq!(dead["wakes"], 0);
    assert_eq!(dead["poison"], 0);

    let services_seen = report["services"].as_array().unwrap();
    let worker = &services_seen[1];
    assert_eq!(worker["kind"], "worker");
    assert_eq!(worker["instance"], "worker-status-test");
    assert_eq!(worker["pool"], "default");
    assert_eq!(worker["concurrency"], 3);
    assert_eq!(worker["in_flight"], 0);
    assert_eq!(worker["version"], wakebus::VERSION);
    assert_eq!(worker["prefix"], prefix.as_str());
    let wake_seen = &services_seen[0];
    assert_eq!(wake_seen["kind"], "wake");
    assert_eq!(wake_seen["instance"], "wake-status-test");
    assert_eq!(wake_seen["pool"], Value::Null);
    assert!(
        wake_seen["in_flight"].as_u64().unwrap() <= 2,
        "one post per session at most"
    );

    let oldest = report["oldest_undelivered"].as_array().unwrap();
    assert_eq!(field(oldest, "session"), [waiting, "s.other"]);
    assert_eq!(oldest[0]["completions"], 2);
    assert_eq!(oldest[0]["oldest_delegation_id"], ids[0].as_str());
    assert_eq!(oldest[0]["session_token"], session_token(waiting));
    assert_eq!(oldest[1]["completions"], 1);
    assert_eq!(oldest[1]["oldest_delegation_id"], "nogoal");
    assert!(
        oldest[0]["age_seconds"].as_f64().unwrap() >= oldest[1]["age_seconds"].as_f64().unwrap()
    );
    assert_eq!(report["undelivered_scan"]["complete"], true);
    assert_eq!(report["undelivered_scan"]["scanned"], 3);

    // A copy of a completion (a replay, a re-send) is no second one.
    republish_completion(&bus).await;
    let again = eventually(WAIT, "status to read the copy", || async {
        let run = wakebus(&nats.url(), &prefix, &args).await;
        let again: Value = serde_json::from_str(&run.stdout()).unwrap_or_default();
        (again["undelivered_scan"]["scanned"] == 4).then_some(again)
    })
    .await;
    let counts = |report: &Value| -> Vec<(Value, Value)> {
        report["oldest_undelivered"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["session"].clone(), s["completions"].clone()))
            .collect()
    };
    assert_eq!(counts(&again), counts(&report));

    api.recover();
    wait_until(WAIT, "the wakes once the API recovers", || async {
        api.accepted().len() == 2
    })
    .await;
    services.stop().await;
    // An absence: read with time for any instance still registered to answer.
    let patient = ["status", "--json", "--discovery-timeout", "3s"];
    let after = wakebus(&nats.url(), &prefix, &patient).await;
    assert!(after.success(), "{}", after.stderr());
    let after: Value = serde_json::from_str(&after.stdout()).unwrap();
    assert_eq!(after["oldest_undelivered"], serde_json::json!([]));
    assert_eq!(
        after["services"],
        serde_json::json!([]),
        "stopped instances deregister"
    );
    let text = ["status", "--discovery-timeout", "3s"];
    let text = wakebus(&nats.url(), &prefix, &text).await;
    let no_wake = "No live wake instance found";
    assert!(text.stdout().contains(no_wake), "{}", text.stdout());
}

/// Requests for a pool that nothing serves (a mistyped `--pool`) wait in
/// the queue for ever: `status` counts the queue by pool and names the
/// pools without a consumer or a live worker.
#[tokio::test]
async fn status_names_the_pools_whose_queued_requests_nothing_serves() {
    let p = Pipeline::start().await;
    let (nats, prefix, bus, services) = (p.nats, p.prefix, p.bus, p.services);
    // Pipeline's echo worker serves `default`; `gpuu` has neither.
    for pool in ["gpuu", "gpuu"] {
        Delegator::new(bus.clone())
            .delegate(Delegation::new("typo").session("s.typo").pool(pool))
            .await
            .unwrap();
    }
    let patient = ["status", "--json", "--discovery-timeout", "3s"];
    let run = wakebus(&nats.url(), &prefix, &patient).await;
    assert!(run.success(), "{}", run.stderr());
    let report: Value = serde_json::from_str(&run.stdout()).unwrap();
    let queued = &report["queued"];
    assert_eq!(queued["pools"]["gpuu"], 2, "{queued}");
    assert_eq!(queued["total"], 2, "{queued}");
    assert_eq!(queued["without_consumer"], serde_json::json!(["gpuu"]));
    assert_eq!(queued["without_worker"], serde_json::json!(["gpuu"]));
    assert_eq!(queued["error"], Value::Null);
    let text = wakebus(
        &nats.url(),
        &prefix,
        &["status", "--discovery-timeout", "3s"],
    )
    .await;
    assert!(
        text.stdout().contains("Queued tasks: 2 (gpuu: 2)")
            && text.stdout().contains("No consumer for pool gpuu")
            && !text.stdout().contains("No live wake instance found"),
        "{}",
        text.stdout()
    );
    services.stop().await;
}

/// A caller waiting for the result of a pool nothing serves waited for
/// ever without a word: `delegate` warns while it waits, of a pool with no
/// consumer (a mistyped `--pool`), of one with no worker using it and of
/// one whose workers are all busy; of a served pool it says nothing (but
/// at DEBUG, that it checked).
#[tokio::test]
async fn a_sync_delegate_warns_when_no_worker_serves_its_pool() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let init = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(init.success(), "{}", init.stderr());
    for (pool, said) in [
        ("gpuu", "No worker has ever served this pool"),
        (
            "default",
            "No worker of this pool is pulling tasks or running one",
        ),
    ] {
        let args = [
            "delegate",
            "--goal",
            "g",
            "--pool",
            pool,
            "--wait-timeout",
            "5s",
        ];
        let run = wakebus(&nats.url(), &prefix, &args).await;
        assert_eq!(run.code(), Some(4), "{}", run.stderr());
        assert!(run.stderr().contains(said), "{pool}: {}", run.stderr());
    }
    // A worker whose task outlasts the check.
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    let config = test_worker_config("default");
    services.worker(&bus, shell("sleep 6; echo ran"), config);
    worker_pulling(&bus, "default").await;
    let args = ["delegate", "--goal", "g", "--wait-timeout", "30s"];
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(&nats.url(), &prefix, &args))
        .env("RUST_LOG", "wakebus=debug")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("The pool is served."), "{stderr}");
    assert!(!stderr.contains("this pool"), "{stderr}");
    services.stop().await;
    // A worker whose one slot is taken pulls nothing: the request waits
    // its turn, which the consumer cannot tell from workers that stopped
    // with tasks in hand.
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.concurrency = 1;
    services.worker(&bus, shell("sleep 8; echo ran"), config);
    let first = delegate(&bus, Delegation::new("first").session("s.busy")).await;
    wait_until(WAIT, "the first task running", || async {
        all_messages(&bus, &bus.subjects.events_stream())
            .await
            .iter()
            .any(|m| m.subject.contains(&first) && m.subject.ends_with(".started"))
    })
    .await;
    let args = ["delegate", "--goal", "g", "--wait-timeout", "4s"];
    let run = wakebus(&nats.url(), &prefix, &args).await;
    assert_eq!(run.code(), Some(4), "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("all are busy, or stopped with tasks in hand"),
        "{}",
        run.stderr()
    );
    services.stop().await;
}

#[tokio::test]
async fn instances_answer_the_standard_micro_service_requests() {
    let p = Pipeline::start().await;
    let (prefix, bus, services) = (p.prefix, p.bus, p.services);
    let request = |subject: &'static str| {
        let client = bus.client.clone();
        async move {
            let reply = client.request(subject, "".into()).await.ok()?;
            serde_json::from_slice::<Value>(&reply.payload).ok()
        }
    };
    let ping = eventually(WAIT, "the worker to answer $SRV.PING", || {
        request("$SRV.PING.wakebus-worker")
    })
    .await;
    assert_eq!(ping["type"], "io.nats.micro.v1.ping_response");
    assert_eq!(ping["name"], "wakebus-worker");
    assert_eq!(ping["metadata"]["prefix"], prefix.as_str());

    let info = eventually(WAIT, "the wake to answer $SRV.INFO", || {
        request("$SRV.INFO.wakebus-wake")
    })
    .await;
    assert_eq!(info["metadata"]["kind"], "wake");
    let endpoint = &info["endpoints"][0];
    assert_eq!(endpoint["name"], "status");
    let subject = endpoint["subject"].as_str().unwrap().to_owned();
    assert_eq!(
        subject,
        format!("{prefix}.status.{}", info["id"].as_str().unwrap())
    );
    let status = bus.client.request(subject, "".into()).await.unwrap();
    let snapshot: Value = serde_json::from_slice(&status.payload).unwrap();
    assert_eq!(snapshot["kind"], "wake");
    assert_eq!(snapshot["prefix"], prefix.as_str());

    let stats = request("$SRV.STATS.wakebus-worker").await.unwrap();
    assert_eq!(stats["endpoints"][0]["data"]["pool"], "default");
    services.stop().await;
}

// ---------------------------------------------------------------- metrics

#[tokio::test]
async fn metrics_after_a_known_number_of_tasks_count_exactly_those_tasks() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let logs = tempfile::tempdir().unwrap();
    let mut args = common::process::base_args(&nats.url(), &prefix);
    args.extend(["worker", "--executor", "echo"].map(String::from));
    let (_worker, base) = spawn_with_metrics(args, logs.path().join("worker.log"));
    wait_until(WAIT, "the worker to be ready", || async {
        http_get(&format!("{base}/readyz"))
            .await
            .is_some_and(|(s, _)| s == 200)
    })
    .await;
    assert_eq!(
        http_get(&format!("{base}/healthz")).await,
        Some((200, "ok\n".to_owned()))
    );
    // Counters of rare events are at 0 before the first, so that an alert
    // on their increase sees that first one.
    let fresh = http_get(&format!("{base}/metrics")).await.unwrap().1;
    for kind in ["task", "wake", "poison", "origin", "unreadable"] {
        let name = format!(r#"wakebus_dead_letters_total{{kind="{kind}"}}"#);
        assert_eq!(sample(&fresh, &name), Some(0.0), "{name} in\n{fresh}");
    }

    let delegator = Delegator::new(bus.clone());
    for goal in ["one", "two", "three"] {
        delegator
            .delegate(Delegation::new(goal).session("s.metrics"))
            .await
            .unwrap();
    }
    let ack = bus
        .js
        .publish(
            bus.subjects.task("default"),
            r#"{"version":1,"delegation_id":"nogoal"}"#.into(),
        )
        .await
        .unwrap();
    ack.await.unwrap();

    let completed = r#"wakebus_tasks_completed_total{pool="default",status="completed"}"#;
    let text = eventually(WAIT, "the scrape to count every task", || async {
        let text = http_get(&format!("{base}/metrics")).await?.1;
        let counted = sample(&text, completed) == Some(3.0)
            && sample(
                &text,
                r#"wakebus_tasks_completed_total{pool="default",status="error"}"#,
            ) == Some(1.0);
        counted.then_some(text)
    })
    .await;
    let expect = |name: &str, value: f64| {
        assert_eq!(sample(&text, name), Some(value), "{name} in\n{text}");
    };
    expect(r#"wakebus_tasks_started_total{pool="default"}"#, 3.0);
    expect(r#"wakebus_dead_letters_total{kind="task"}"#, 1.0);
    expect(
        r#"wakebus_task_duration_seconds_count{pool="default",status="completed"}"#,
        3.0,
    );
    expect(
        r#"wakebus_task_duration_seconds_bucket{pool="default",status="completed",le="+Inf"}"#,
        3.0,
    );
    expect(r#"wakebus_tasks_in_flight{pool="default"}"#, 0.0);
    let consumer = format!(
        r#"{{stream="{}",consumer="worker-default"}}"#,
        bus.subjects.tasks_stream()
    );
    expect(&format!("wakebus_consumer_pending{consumer}"), 0.0);
    expect(&format!("wakebus_consumer_ack_pending{consumer}"), 0.0);
    expect("wakebus_nats_connected", 1.0);
    expect("wakebus_nats_disconnects_total", 0.0);
    // What a container health check runs: ready, asked by URL or by the
    // address the service was given (an unspecified one asked on loopback).
    let port = base.rsplit(':').next().unwrap();
    let readyz = format!("{base}/readyz");
    let unspecified = format!("0.0.0.0:{port}");
    for args in [
        ["ready", "--url", readyz.as_str()],
        ["ready", "--metrics-addr", unspecified.as_str()],
    ] {
        let run = wakebus(&nats.url(), &prefix, &args).await;
        assert!(run.success(), "{args:?}: {}", run.stderr());
        assert_eq!(run.stdout().trim(), "ready", "{args:?}");
    }
    assert!(
        text.contains("# TYPE wakebus_task_duration_seconds histogram"),
        "{text}"
    );
    assert!(sample(&text, r#"wakebus_task_retries_total{pool="default"}"#).is_none());
    // The refused request never ran: counted, but no run time of 0 s.
    let refused_run = r#"wakebus_task_duration_seconds_count{pool="default",status="error"}"#;
    assert!(sample(&text, refused_run).is_none(), "{text}");

    // A request the NATS client cannot read (headers not UTF-8) is removed
    // by a sweep, not by a handler, and counted all the same.
    let refused = common::raw::hpub(
        nats.port,
        &bus.subjects.task("default"),
        b"NATS/1.0\r\nWakebus-Origin-Session: \xff\xfe\r\n\r\n",
        br#"{"version":1,"delegation_id":"unreadable","goal":"g"}"#,
    )
    .await;
    assert_eq!(refused, None);
    eventually(WAIT, "the unreadable request counted", || async {
        let text = http_get(&format!("{base}/metrics")).await?.1;
        (sample(&text, r#"wakebus_dead_letters_total{kind="unreadable"}"#) == Some(1.0))
            .then_some(())
    })
    .await;

    // Without NATS the process is alive but not ready, and says so in its
    // metrics too (where the backlog gauges stay as they were). The
    // unreadable request above cost the client one connection already.
    let disconnects = |text: &str| sample(text, "wakebus_nats_disconnects_total").unwrap_or(0.0);
    let before = disconnects(&http_get(&format!("{base}/metrics")).await.unwrap().1);
    nats.kill();
    wait_until(WAIT, "/readyz to fail without NATS", || async {
        http_get(&format!("{base}/readyz"))
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains("not ready"))
    })
    .await;
    // The gauge and the counter are set apart (the counter by the
    // client's event handler): both are waited for.
    let text = eventually(WAIT, "the scrape to say NATS is away", || async {
        let text = http_get(&format!("{base}/metrics")).await?.1;
        (sample(&text, "wakebus_nats_connected") == Some(0.0) && disconnects(&text) >= before + 1.0)
            .then_some(text)
    })
    .await;
    assert_eq!(disconnects(&text), before + 1.0, "{text}");
    let run = wakebus(&nats.url(), &prefix, &["ready", "--url", &readyz]).await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("answered 503: not ready: not connected to NATS"),
        "{}",
        run.stderr()
    );
    assert_eq!(
        sample(&text, &format!("wakebus_consumer_pending{consumer}")),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        http_get(&format!("{base}/healthz")).await.map(|r| r.0),
        Some(200)
    );
}

/// `/readyz` says not ready when what the service works with is gone: a
/// worker's events stream (its completions could not be stored) or cancel
/// bucket (it would hold every task it takes), a wake's ledger bucket (no
/// turn could be planned).
#[tokio::test]
async fn readiness_fails_when_the_events_stream_the_cancel_bucket_or_the_wake_ledger_is_gone() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let logs = tempfile::tempdir().unwrap();
    let mut args = common::process::base_args(&nats.url(), &prefix);
    args.extend(["worker", "--executor", "echo"].map(String::from));
    let (_worker, worker) = spawn_with_metrics(args, logs.path().join("worker.log"));
    let (_wake, wake) = spawn_with_metrics(
        common::process::wake_args(&nats.url(), &prefix, &api.url()),
        logs.path().join("wake.log"),
    );
    let ready = |base: String| async move { http_get(&format!("{base}/readyz")).await };
    for base in [&worker, &wake] {
        wait_until(WAIT, "the service to be ready", || async {
            ready(base.clone()).await.is_some_and(|(s, _)| s == 200)
        })
        .await;
    }

    let ledger = wakebus::protocol::Subjects::bucket_stream(&bus.subjects.wake_ledger_bucket());
    bus.js.delete_stream(&ledger).await.unwrap();
    wait_until(WAIT, "the wake to be not ready", || async {
        ready(wake.clone())
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains(&ledger))
    })
    .await;
    bus.js
        .delete_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    wait_until(WAIT, "the worker to be not ready", || async {
        ready(worker.clone())
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains("no stream takes completions"))
    })
    .await;
    // Streams are checked before the completions probe.
    let cancels = wakebus::protocol::Subjects::bucket_stream(&bus.subjects.cancel_bucket());
    bus.js.delete_stream(&cancels).await.unwrap();
    wait_until(WAIT, "the worker to name the cancel bucket", || async {
        ready(worker.clone())
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains(&cancels))
    })
    .await;
}

#[tokio::test]
async fn the_wake_keeps_nothing_per_session_once_its_wakes_are_delivered() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let logs = tempfile::tempdir().unwrap();
    let (_wake, base) = spawn_with_metrics(
        common::process::wake_args(&nats.url(), &prefix, &api.url()),
        logs.path().join("wake.log"),
    );
    let mut services = Services::new();
    services.echo_worker(&bus);

    let delegator = Delegator::new(bus.clone());
    for i in 0..5 {
        delegator
            .delegate(Delegation::new("hello").session(format!("s.idle.{i}")))
            .await
            .unwrap();
    }
    wait_until(WAIT, "five wakes", || async { api.accepted().len() == 5 }).await;
    // Each session's actor ends once its lock is given back (after the
    // 250 ms linger), not after a long idle time.
    let text = eventually(Duration::from_secs(10), "no session kept", || async {
        let text = http_get(&format!("{base}/metrics")).await?.1;
        (sample(&text, "wakebus_wake_sessions_active") == Some(0.0)).then_some(text)
    })
    .await;
    assert_eq!(
        sample(&text, r#"wakebus_wake_posts_total{result="delivered"}"#),
        Some(5.0),
        "{text}"
    );
    // One lock taken per session, none found held by another instance.
    assert_eq!(locks(&text, "taken"), Some(5.0), "{text}");
    assert_eq!(locks(&text, "busy"), None, "{text}");
    services.stop().await;
}

/// The wake's `wakebus_wake_session_locks_total{result=...}` sample.
fn locks(text: &str, result: &str) -> Option<f64> {
    sample(
        text,
        &format!(r#"wakebus_wake_session_locks_total{{result="{result}"}}"#),
    )
}

#[tokio::test]
async fn the_wake_counts_each_way_a_turn_gets_its_session_lock() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    // The bucket as the wake will find it, so that the test can hold a lock
    // as another instance would.
    let lock_bucket = session_lock_bucket(&bus, Duration::from_secs(30)).await;
    let logs = tempfile::tempdir().unwrap();
    let mut args = common::process::wake_args(&nats.url(), &prefix, &api.url());
    let ttl = args.iter().position(|a| a == "--session-lock-ttl").unwrap();
    args[ttl + 1] = "30s".into();
    args.extend(["--lock-linger", "8s"].map(String::from));
    let (_wake, base) = spawn_with_metrics(args, logs.path().join("wake.log"));
    let mut services = Services::new();
    services.echo_worker(&bus);
    let metrics = || async {
        http_get(&format!("{base}/metrics"))
            .await
            .map(|(_, text)| text)
    };
    let session = "s.locks";
    let token = session_token(session);

    // Busy: another instance holds the session, so the turn waits for it.
    lock_bucket
        .create(&token, "elsewhere".into())
        .await
        .unwrap();
    delegate(&bus, Delegation::new("first").session(session)).await;
    eventually(WAIT, "the turn to find the lock busy", || async {
        locks(&metrics().await?, "busy").map(|_| ())
    })
    .await;
    assert!(api.accepted().is_empty(), "posted while locked elsewhere");
    // Taken: once given back, over the other instance's release.
    lock_bucket.delete(&token).await.unwrap();
    wait_until(WAIT, "the first wake", || async {
        api.accepted().len() == 1
    })
    .await;
    // Kept: the next completion comes within the linger.
    delegate(&bus, Delegation::new("second").session(session)).await;
    wait_until(WAIT, "the second wake", || async {
        api.accepted().len() == 2
    })
    .await;
    // Retaken: after the linger, over this instance's own release.
    eventually(WAIT, "the lock given back after the linger", || async {
        (sample(&metrics().await?, "wakebus_wake_sessions_active") == Some(0.0)).then_some(())
    })
    .await;
    delegate(&bus, Delegation::new("third").session(session)).await;
    wait_until(WAIT, "the third wake", || async {
        api.accepted().len() == 3
    })
    .await;

    let text = metrics().await.expect("metrics");
    assert_eq!(locks(&text, "taken"), Some(1.0), "{text}");
    assert_eq!(locks(&text, "kept"), Some(1.0), "{text}");
    assert_eq!(locks(&text, "retaken"), Some(1.0), "{text}");
    assert!(locks(&text, "busy").is_some_and(|n| n >= 1.0), "{text}");
    assert_eq!(locks(&text, "error"), None, "{text}");
    services.stop().await;
}

// ---------------------------------------------------------------- docs

#[test]
fn the_protocol_documents_replay_copies_and_the_status_snapshot() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/PROTOCOL.md")).unwrap();
    for needle in [
        HEADER_REPLAY,
        wakebus::ops::service::WORKER_SERVICE,
        wakebus::ops::service::WAKE_SERVICE,
        "<prefix>.status.<service-id>",
        ".done.replay.<ULID>",
        "-rt<task_index>",
    ] {
        assert!(
            doc.contains(needle),
            "PROTOCOL.md does not mention {needle}"
        );
    }
    let block: String = doc
        .split("```json example=status-snapshot\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the status snapshot example")
        .to_owned();
    let snapshot: wakebus::ops::service::ServiceSnapshot =
        serde_json::from_str(&block).expect("the example is a snapshot");
    assert_eq!(
        serde_json::to_value(&snapshot).unwrap(),
        serde_json::from_str::<Value>(&block).unwrap()
    );
}

#[tokio::test]
async fn a_worker_started_without_an_executor_refuses_to_start_and_names_the_flag() {
    // Refused while reading its arguments, before connecting anywhere.
    let run = wakebus(
        "nats://127.0.0.1:1",
        "wakebus",
        &["worker", "--pool", "default"],
    )
    .await;
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(
        run.stderr().contains("--executor <EXECUTOR>"),
        "{}",
        run.stderr()
    );
    assert!(run.stdout().is_empty());
}

/// A zero where wakebus needs a positive value would fail every task or
/// post (a timeout firing at once, a give-up on the first delivery), loop
/// (a zero check interval or retry delay), or quietly mean something else
/// to the server (a zero max age keeps for ever, zero replicas is one): the
/// command refuses to start and names the flag (and its least value, where
/// that is more than zero: an AckWait or a consumer check under a second
/// is too short to keep work alive with, or a flood of checks).
#[tokio::test]
async fn a_service_given_a_zero_that_would_fail_or_loop_refuses_to_start_and_says_why() {
    let worker = ["worker", "--executor", "echo"];
    let wake = ["wake", "--api-url", "http://127.0.0.1:1"];
    let cases: [(&[&str], &[&str], &str); 25] = [
        (
            &[],
            &["worker", "--executor", "echo", "--ack-wait", "300ms"],
            "invalid value '300ms' for '--ack-wait <ACK_WAIT>': must be at least 1s",
        ),
        (
            &["--consumer-check", "500ms"],
            &wake,
            "invalid value '500ms' for '--consumer-check <CONSUMER_CHECK>': must be at least 1s",
        ),
        (
            &["--consumer-check", "0s"],
            &worker,
            "'--consumer-check <CONSUMER_CHECK>': must be at least 1s",
        ),
        (
            &["--history", "0s"],
            &worker,
            "'--history <HISTORY>': must be at least 1s",
        ),
        (
            &["--history", "0.5s"],
            &worker,
            "'--history <HISTORY>': must be at least 1s",
        ),
        (
            &["--session-lock-ttl", "0s"],
            &wake,
            "'--session-lock-ttl <SESSION_LOCK_TTL>': must be at least 1s",
        ),
        (
            &["--replicas", "0"],
            &worker,
            "'--replicas <REPLICAS>': 0 is not in 1..=5",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--task-timeout", "0s"],
            "'--task-timeout <TASK_TIMEOUT>': must be more than 0",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--max-deliver", "0"],
            "'--max-deliver <MAX_DELIVER>': must be at least 1",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--retry-min", "0s"],
            "'--retry-min <RETRY_MIN>': must be more than 0",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--retry-max", "0s"],
            "'--retry-max <RETRY_MAX>': must be more than 0",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--max-goal-bytes", "0"],
            "'--max-goal-bytes <MAX_GOAL_BYTES>': must be at least 1",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--ack-wait", "0s"],
            "'--ack-wait <ACK_WAIT>': must be at least 1s",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--llm-timeout", "0s"],
            "'--llm-timeout <LLM_TIMEOUT>': must be more than 0",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--concurrency", "0"],
            "'--concurrency <CONCURRENCY>': must be at least 1",
        ),
        (
            &[],
            &[
                "wake",
                "--api-url",
                "http://127.0.0.1:1",
                "--retry-min",
                "0s",
            ],
            "'--retry-min <RETRY_MIN>': must be more than 0",
        ),
        (
            &[],
            &[
                "wake",
                "--api-url",
                "http://127.0.0.1:1",
                "--retry-max",
                "0s",
            ],
            "'--retry-max <RETRY_MAX>': must be more than 0",
        ),
        (
            &[],
            &[
                "wake",
                "--api-url",
                "http://127.0.0.1:1",
                "--request-timeout",
                "0s",
            ],
            "'--request-timeout <REQUEST_TIMEOUT>': must be more than 0",
        ),
        (
            &[],
            &[
                "wake",
                "--api-url",
                "http://127.0.0.1:1",
                "--ack-wait",
                "0s",
            ],
            "'--ack-wait <ACK_WAIT>': must be at least 1s",
        ),
        (
            &[],
            &["delegate", "--goal", "g", "--timeout-seconds", "0"],
            "'--timeout-seconds <TIMEOUT_SECONDS>': must be at least 1",
        ),
        (
            &[],
            &["delegate", "--goal", "g", "--wait-timeout", "0s"],
            "'--wait-timeout <WAIT_TIMEOUT>': must be more than 0",
        ),
        (
            &[],
            &["delegate", "--goal", "g", "--max-depth", "0"],
            "'--max-depth <MAX_DEPTH>': must be at least 1",
        ),
        (
            &[],
            &["delegate", "--goal", "g", "--max-batch", "0"],
            "'--max-batch <MAX_BATCH>': must be at least 1",
        ),
        (
            &[],
            &["worker", "--executor", "echo", "--max-depth", "0"],
            "'--max-depth <MAX_DEPTH>': must be at least 1",
        ),
        (
            &[],
            &["status", "--discovery-timeout", "0s"],
            "'--discovery-timeout <DISCOVERY_TIMEOUT>': must be more than 0",
        ),
    ];
    for (global, command, said) in cases {
        let args: Vec<&str> = global.iter().chain(command).copied().collect();
        let run = wakebus("nats://127.0.0.1:1", "wakebus", &args).await;
        assert_eq!(run.code(), Some(2), "{args:?}: {}", run.stderr());
        assert!(
            run.stderr().contains("invalid value '") && run.stderr().contains(said),
            "{args:?}: {}",
            run.stderr()
        );
        assert!(run.stdout().is_empty(), "{args:?}");
    }
}

/// A mistake in a command's own arguments is reported before it connects:
/// with NATS away, it would otherwise come as `cannot connect` after the
/// connect timeout, and a gateway would retry what can never work.
#[tokio::test]
async fn bad_arguments_are_reported_before_connecting() {
    refused_at_start(&[
        (
            vec!["delegate", "--goal", "g", "--output-schema", "{"],
            "--output-schema",
        ),
        (
            vec!["delegate", "--goal", "g", "--traceparent", "nonsense"],
            "is not a W3C traceparent",
        ),
        (vec!["events", "--since", "soon"], "--since"),
        (vec!["events", "--from-seq", "0"], "--from-seq"),
        (vec!["events", "--pool", "gpu"], "--pool"),
        (vec!["replay", "tasks", "--from-seq", "0"], "--from-seq"),
        (
            vec!["replay", "wakes", "--kind", "started", "--force"],
            "completions only (--kind done), not started",
        ),
        (
            vec!["replay", "copy", "--to-prefix", "wakebus.task"],
            "under this deployment's own prefix",
        ),
        (vec!["delegate", "--goal", " "], "goal"),
        (vec!["delegate", "--goal", "g", "--pool", "gpu a"], "pool"),
        (
            vec!["delegate", "--goal", "g", "--delegation-id", "a.b"],
            "delegation id",
        ),
        (vec!["cancel", "a.b"], "delegation id \"a.b\""),
        (vec!["cancel", "--session", " s"], "--session \" s\""),
        // A health check with nothing to ask, or nothing answering.
        (vec!["ready"], "no service to ask"),
        (
            vec!["ready", "--url", "http://127.0.0.1:1/readyz"],
            "cannot reach http://127.0.0.1:1/readyz",
        ),
        // Half of a user/password pair (often a variable inherited alone).
        (
            vec!["--user", "u", "status"],
            "needs both --user (NATS_USER) and --password-file",
        ),
        (
            vec!["--password-file", "/nonexistent", "status"],
            "needs both --user (NATS_USER) and --password-file",
        ),
    ])
    .await;
}

/// Inside a task (its worker sets `WAKEBUS_DEPTH`), a parent depth that is
/// not a number is reported with its value; one set to nothing counts as
/// unset, as every option's variable does.
#[tokio::test]
async fn a_parent_depth_that_is_not_a_number_is_named_and_an_empty_one_is_unset() {
    let word = delegate_offline("WAKEBUS_DEPTH", "one").await;
    assert!(
        word.contains("WAKEBUS_DEPTH \"one\" is not a number"),
        "{word}"
    );
    let empty = delegate_offline("WAKEBUS_DEPTH", "").await;
    assert!(
        empty.contains("cannot connect") && !empty.contains("WAKEBUS_DEPTH"),
        "{empty}"
    );
}

/// A `TRACEPARENT` inherited from the environment that is not a W3C
/// traceparent starts a new trace, with a warning, as one in a message
/// header does: it does not refuse every delegation of the process that
/// inherited it, nor blame a `--traceparent` nobody typed. Typed, it is
/// refused (`bad_arguments_are_reported_before_connecting`).
#[tokio::test]
async fn an_inherited_traceparent_that_is_not_one_starts_a_new_trace() {
    let stderr = delegate_offline("TRACEPARENT", "nonsense").await;
    assert!(
        stderr.contains("TRACEPARENT is not a W3C traceparent; starting a new trace")
            && stderr.contains("cannot connect")
            && !stderr.contains("--traceparent"),
        "{stderr}"
    );
}

/// Runs `wakebus delegate --goal g` with `name=value` in its environment
/// against a URL where nothing listens; returns its stderr.
async fn delegate_offline(name: &str, value: &str) -> String {
    let args = common::cli::tool_args(
        "nats://127.0.0.1:1",
        "wakebus",
        &["delegate", "--goal", "g", "--connect-timeout", "0s"],
    );
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(args)
        .env(name, value)
        // Its warnings are what some cases look for.
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("wakebus did not finish within 60s")
        .expect("run wakebus");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs each command line of `cases` against a URL where nothing listens
/// and checks that it is refused before connecting, exit status 1, saying
/// what its case expects.
async fn refused_at_start(cases: &[(Vec<&str>, &str)]) {
    for (args, expected) in cases {
        let run = wakebus("nats://127.0.0.1:1", "wakebus", args).await;
        assert_eq!(run.code(), Some(1), "{args:?}: {}", run.stderr());
        assert!(
            run.stderr().contains(expected),
            "{args:?}: {}",
            run.stderr()
        );
    }
}

/// Settings under which every task or post would fail, or every request
/// time out: refused at start, with what to change.
#[tokio::test]
async fn a_service_whose_settings_would_fail_every_call_refuses_to_start_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.key");
    std::fs::write(&empty, "\n").unwrap();
    let empty = empty.display().to_string();
    let llm = [
        "worker",
        "--executor",
        "llm",
        "--llm-base-url",
        "http://127.0.0.1:1/v1",
        "--llm-model",
        "m",
    ];
    let cases: [(Vec<&str>, &str); 6] = [
        (
            vec![
                "worker",
                "--executor",
                "echo",
                "--retry-min",
                "2m",
                "--retry-max",
                "1m",
            ],
            "--retry-min (2m) is above --retry-max (1m)",
        ),
        (
            vec!["worker", "--executor", "echo", "--", "/bin/true"],
            "a task program (after --) or --workdir is given, but the executor is echo",
        ),
        (
            vec!["worker", "--executor", "llm", "--workdir", "/tmp"],
            "but the executor is llm",
        ),
        (
            [&llm[..], &["--llm-api-key-file", &empty]].concat(),
            "is empty: put the LLM API key in it",
        ),
        (
            vec![
                "wake",
                "--api-url",
                "http://127.0.0.1:1",
                "--api-key-file",
                &empty,
            ],
            "is empty: put the API key in it",
        ),
        (
            vec!["--inbox-prefix", "_INBOX.*", "worker", "--executor", "echo"],
            "invalid inbox prefix \"_INBOX.*\"",
        ),
    ];
    refused_at_start(&cases).await;
}

#[tokio::test]
async fn a_worker_whose_task_program_cannot_run_refuses_to_start_and_says_why() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let not_executable = dir.path().join("task.sh");
    std::fs::write(&not_executable, "#!/bin/sh\necho ok\n").unwrap();
    std::fs::set_permissions(&not_executable, std::fs::Permissions::from_mode(0o644)).unwrap();
    let not_executable = not_executable.display().to_string();
    let command = ["worker", "--executor", "command"];
    let cases: [(Vec<&str>, &str); 4] = [
        (
            [&command[..], &["--", "/nonexistent/task-program"]].concat(),
            "cannot run the task program /nonexistent/task-program",
        ),
        (
            [&command[..], &["--", "no-such-task-program-on-path"]].concat(),
            "cannot run the task program no-such-task-program-on-path",
        ),
        (
            [&command[..], &["--", &not_executable]].concat(),
            "is not an executable file",
        ),
        (
            [&command[..], &["--workdir", "/nonexistent-dir", "--", "sh"]].concat(),
            "working directory /nonexistent-dir is not a directory",
        ),
    ];
    refused_at_start(&cases).await;
}

#[tokio::test]
async fn delegating_under_a_prefix_nobody_initialised_says_to_run_init() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let run = wakebus(
        &nats.url(),
        &prefix,
        &["delegate", "--goal", "anything", "--session", "s1"],
    )
    .await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains(&format!("no JetStream stream stores {prefix}.")),
        "{stderr}"
    );
    assert!(stderr.contains("run `wakebus init`"), "{stderr}");
    assert!(run.stdout().is_empty(), "nothing reported as dispatched");
}

#[tokio::test]
async fn commands_run_by_hand_say_soon_and_once_that_nats_is_unreachable() {
    // Nothing listens there.
    let url = format!("nats://127.0.0.1:{}", nats::free_port());
    let commands: [&[&str]; 5] = [
        &["status"],
        &["events"],
        &["replay", "wakes", "--session", "s1"],
        &["cancel", "--session", "s1"],
        &["delegate", "--goal", "x", "--session", "s1"],
    ];
    for args in commands {
        let run = wakebus(&url, &unique_prefix(), args).await;
        let stderr = run.stderr();
        assert!(!run.success(), "{args:?} succeeded without NATS: {stderr}");
        let said = format!("cannot connect to NATS at {url}");
        assert_eq!(stderr.matches(&said).count(), 1, "{args:?}: {stderr}");
        assert_eq!(
            stderr.matches("Connection refused").count(),
            1,
            "{args:?}: {stderr}"
        );
    }
}

#[tokio::test]
async fn a_gateway_sets_how_long_delegate_and_cancel_keep_trying_to_reach_nats() {
    // Nothing listens there.
    let url = format!("nats://127.0.0.1:{}", nats::free_port());
    let commands: [&[&str]; 2] = [
        &["delegate", "--goal", "x", "--session", "s1"],
        &["cancel", "--session", "s1"],
    ];
    // (flag, environment, whether it tries again before giving up)
    let patiences = [
        (Some("0s"), None, false),
        (Some("1s"), None, true),
        (None, Some("0s"), false),
    ];
    // A name that does not resolve (yet: a container restarting) too.
    let unresolved = "nats://wakebus-restarting.invalid:4222";
    for url in [url.as_str(), unresolved] {
        for args in commands {
            for (flag, env, retries) in patiences {
                let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"));
                let mut args = args.to_vec();
                if let Some(flag) = flag {
                    args.extend(["--connect-timeout", flag]);
                }
                command
                    .args(common::cli::tool_args(url, &unique_prefix(), &args))
                    .env("RUST_LOG", "wakebus=info")
                    .env_remove("WAKEBUS_CONNECT_TIMEOUT")
                    .stdin(std::process::Stdio::null());
                if let Some(env) = env {
                    command.env("WAKEBUS_CONNECT_TIMEOUT", env);
                }
                let output = tokio::time::timeout(WAIT, command.output())
                    .await
                    .expect("gives up within the timeout")
                    .unwrap();
                let stderr = String::from_utf8_lossy(&output.stderr);
                assert!(!output.status.success(), "{args:?}: {stderr}");
                let said = format!("cannot connect to NATS at {url}");
                assert_eq!(stderr.matches(&said).count(), 1, "{args:?}: {stderr}");
                assert_eq!(
                    stderr.contains("NATS did not answer; trying again."),
                    retries,
                    "{args:?} {flag:?} {env:?}: {stderr}"
                );
            }
        }
    }
}

#[tokio::test]
async fn connect_timeout_bounds_the_wait_for_a_server_that_accepts_but_never_answers() {
    // Accepts connections and never says INFO, like a host that drops
    // packets after the handshake: each client attempt would wait for its
    // own 5 s connection timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{}", silent.local_addr().unwrap());
    // When each connection was accepted: the wait is timed from the
    // attempt, not from the start of a process that may start slowly.
    let accepted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let accepting = accepted.clone();
    let _held = std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in silent.incoming() {
            accepting.lock().unwrap().push(std::time::Instant::now());
            open.push(stream);
        }
    });
    let run = wakebus(
        &url,
        &unique_prefix(),
        &[
            "delegate",
            "--goal",
            "x",
            "--session",
            "s1",
            "--connect-timeout",
            "0s",
        ],
    )
    .await;
    let ended = std::time::Instant::now();
    assert!(!run.success(), "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("cannot connect to NATS at {url}")),
        "{}",
        run.stderr()
    );
    // One attempt, cut off at 2 s (well under the client's own 5 s).
    let accepted = accepted.lock().unwrap().clone();
    assert_eq!(accepted.len(), 1, "one attempt");
    let waited = ended - accepted[0];
    assert!(waited < Duration::from_millis(4500), "waited {waited:?}");
}

/// A cluster node that is down but still takes connections (or drops
/// packets) must not use up a command's one attempt before the healthy
/// nodes are tried: the client tries the servers one after another, in a
/// random order, so here the silent one comes first in about half the runs.
#[tokio::test]
async fn a_command_run_by_hand_reaches_a_healthy_server_after_one_that_never_answers() {
    let nats = NatsServer::start().await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{},{}", silent.local_addr().unwrap(), nats.url());
    let tried = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counting = tried.clone();
    let _held = std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in silent.incoming() {
            counting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            open.push(stream);
        }
    });
    let prefix = unique_prefix();
    bus(&nats.url(), &prefix).await;
    // Until the silent one has come first in a run (each run has one
    // chance in two; 30 runs without it, one in a billion).
    let mut runs = 0;
    while tried.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(runs < 30, "the silent server was never tried first");
        let run = wakebus(&url, &prefix, &["events"]).await;
        assert!(run.success(), "{}", run.stderr());
        runs += 1;
    }
}

#[tokio::test]
async fn a_delegate_called_while_nats_restarts_waits_for_it_and_is_stored() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    nats.kill();

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            &nats.url(),
            &prefix,
            &[
                "delegate",
                "--goal",
                "during a restart",
                "--session",
                "s.blip",
            ],
        ))
        .env("RUST_LOG", "wakebus=info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let retried = tokio::time::timeout(WAIT, async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            if line.contains("NATS did not answer; trying again.") {
                return true;
            }
        }
        false
    })
    .await
    .expect("a retry within the timeout");
    assert!(retried, "delegate ended without retrying");

    nats.spawn();
    nats.wait_ready().await;
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("delegate ends")
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let reply: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(reply["status"], "dispatched");
    wait_until(WAIT, "the test's client to reconnect", || async {
        bus.client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(tasks.info().await.unwrap().state.messages, 1);
}

/// A wake consumer made anew reads the whole history again, and a
/// completion the ledger does not record delivered (one the session API
/// refused) is posted again: `init` (or a starting wake) that makes it
/// while completions are stored says so at WARN, with how many, once a
/// wake has taken a session lock or written the ledger (each is checked:
/// two deployments here). Made for an empty history, it says nothing;
/// made where no wake has done either (a deployment whose wake starts
/// after its workers ran), it says so at INFO.
#[tokio::test]
async fn init_warns_when_it_makes_the_wake_consumer_anew_over_a_stored_history() {
    init_logs();
    let nats = NatsServer::start().await;
    let said = "The wake consumer was missing and is made anew from the start of the history";
    let first_wake = "No wake has taken a session lock or written the wake ledger here";
    for bucket in ["locks", "ledger"] {
        let prefix = unique_prefix();
        let bus = bus(&nats.url(), &prefix).await;
        let first = wakebus(&nats.url(), &prefix, &["init"]).await;
        assert!(first.success(), "{}", first.stderr());
        assert!(!first.stderr().contains(said), "{}", first.stderr());
        publish_completion(&bus, "s.anew", "d-anew", 0, serde_json::json!({})).await;
        // Another task's started event: stored, but no completion to read.
        let started =
            bus.subjects
                .event(&session_token("s.anew"), "d-running", 0, EventKind::Started);
        bus.js
            .publish(started, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        forget_the_wake_floor(&bus).await;
        let before_any_wake = wakebus(&nats.url(), &prefix, &["init"]).await;
        let stderr = before_any_wake.stderr();
        assert!(before_any_wake.success(), "{stderr}");
        assert!(
            stderr.contains(first_wake) && !stderr.contains(said),
            "{stderr}"
        );
        // A wake takes the session's lock before it posts, and records
        // the post in the ledger.
        let written = match bucket {
            "locks" => bus.subjects.session_lock_bucket(),
            _ => bus.subjects.wake_ledger_bucket(),
        };
        let store = bus.js.get_key_value(written).await.unwrap();
        store.put("s-anew", "wake-1".into()).await.unwrap();
        forget_the_wake_floor(&bus).await;
        let again = wakebus(&nats.url(), &prefix, &["init"]).await;
        let stderr = again.stderr();
        assert!(again.success(), "{bucket}: {stderr}");
        assert!(stderr.contains(said), "{bucket}: {stderr}");
        assert!(!stderr.contains(first_wake), "{bucket}: {stderr}");
        assert!(stderr.contains("completions=1"), "{bucket}: {stderr}");
    }
}

/// A server configuration whose one account (the default user's) requires
/// a byte limit on every stream when `required`, as hosted accounts do.
fn byte_limits_account(required: bool) -> String {
    format!(
        "accounts {{ APP {{ jetstream {{ max_file: 1G, max_mem: 64M, max_bytes_required: {required} }}, users: [ {{ user: app, password: app }} ] }} }}\nno_auth_user: app\n"
    )
}

/// A NATS account that requires a byte limit on every stream (as hosted
/// accounts do) refuses wakebus's streams without one: `init` says which
/// flag to give, and with `--max-bytes` creates them, each part with the
/// size asked for it.
#[tokio::test]
async fn init_gives_an_account_that_requires_byte_limits_the_sizes_asked_for() {
    init_logs();
    let (nats, _conf) = NatsServer::start_with_config(&byte_limits_account(true)).await;
    let prefix = unique_prefix();
    // A library caller (as `wakebus dev`) gets the error; only the worker
    // and wake services wait for `init`.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let library = Bus::new(client, wakebus::protocol::Subjects::new(&prefix).unwrap());
    let provisioned = tokio::time::timeout(WAIT, library.provision(&Default::default()))
        .await
        .expect("a library caller waited for init");
    assert!(
        matches!(
            provisioned,
            Err(wakebus::bus::ProvisionError::MaxBytesRequired { .. })
        ),
        "{provisioned:?}"
    );
    let refused = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(!refused.success(), "{}", refused.stdout());
    assert!(
        refused.stderr().contains("max_bytes_required")
            && refused.stderr().contains("(part tasks)")
            && refused.stderr().contains("`wakebus init --max-bytes SIZE`"),
        "{}",
        refused.stderr()
    );
    let args = [
        "init",
        "--max-bytes",
        "16MiB",
        "--max-bytes",
        "events=64MiB",
    ];
    let run = wakebus(&nats.url(), &prefix, &args).await;
    assert!(run.success(), "{}", run.stderr());
    let bus = bus(&nats.url(), &prefix).await;
    for store in wakebus::bus::Store::ALL {
        let stream = bus
            .js
            .get_stream(store.stream(&bus.subjects))
            .await
            .unwrap();
        let expected = if store == wakebus::bus::Store::Events {
            64 << 20
        } else {
            16 << 20
        };
        assert_eq!(stream.cached_info().config.max_bytes, expected, "{store}");
    }
    let status = wakebus(&nats.url(), &prefix, &["status", "--json"]).await;
    let status: Value = serde_json::from_str(&status.stdout()).unwrap();
    let limits: Vec<&Value> = status["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| &s["max_bytes"])
        .collect();
    let mut expected = vec![serde_json::json!(16 << 20); 6];
    expected[1] = serde_json::json!(64 << 20);
    assert_eq!(limits, expected.iter().collect::<Vec<_>>());
}

/// Streams made before their account came to require byte limits (a
/// configuration reload) keep working, but the server refuses any change
/// to one without a limit: an `init` changing them (a longer history here)
/// names the flag, as for a new stream, and with `--max-bytes` makes the
/// change. (A server restarted with the requirement does not load such a
/// stream at all: OPERATIONS.md, "Byte limits".)
#[tokio::test]
async fn init_changing_streams_made_before_the_account_required_byte_limits_names_the_flag() {
    init_logs();
    let (nats, conf) = NatsServer::start_with_config(&byte_limits_account(false)).await;
    // nats-server 2.9 shuts JetStream down on this reload: it has no such
    // streams to change (2.10 and later reload the account's limits).
    let client = async_nats::connect(nats.url()).await.unwrap();
    let version = client.server_info().version;
    if version.starts_with("2.9.") {
        eprintln!("nats-server {version} cannot reload an account's JetStream limits; skipped");
        return;
    }
    let prefix = unique_prefix();
    let first = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(first.success(), "{}", first.stderr());
    std::fs::write(conf.path().join("nats.conf"), byte_limits_account(true)).unwrap();
    nats.signal(nix::sys::signal::Signal::SIGHUP);
    let server_log = nats.store.path().join("server.stderr");
    wait_until(WAIT, "the configuration reloaded", || async {
        std::fs::read_to_string(&server_log)
            .is_ok_and(|log| log.contains("Reloaded server configuration"))
    })
    .await;
    let longer = ["--history", "14d", "init"];
    let refused = wakebus(&nats.url(), &prefix, &longer).await;
    assert!(!refused.success(), "{}", refused.stdout());
    assert!(
        refused.stderr().contains("`wakebus init --max-bytes SIZE`"),
        "{}",
        refused.stderr()
    );
    let sized = [&longer[..], &["--max-bytes", "16MiB"]].concat();
    let run = wakebus(&nats.url(), &prefix, &sized).await;
    assert!(run.success(), "{}", run.stderr());
    let bus = bus(&nats.url(), &prefix).await;
    let events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let config = &events.cached_info().config;
    assert_eq!(
        (config.max_age, config.max_bytes),
        (Duration::from_secs(14 * 24 * 3600), 16 << 20)
    );
}

/// On an account that requires byte limits, a worker and a wake started
/// before `init --max-bytes` (as a compose stack starts them side by side)
/// wait for it, saying what they wait for, instead of exiting; once `init`
/// has made the streams, a delegation runs and wakes its session.
#[tokio::test]
async fn services_on_an_account_that_requires_byte_limits_wait_for_init() {
    init_logs();
    let (nats, _conf) = NatsServer::start_with_config(&byte_limits_account(true)).await;
    let prefix = unique_prefix();
    let api = SessionApiServer::start().await;
    let logs = tempfile::tempdir().unwrap();
    let (worker_log, wake_log) = (logs.path().join("worker.log"), logs.path().join("wake.log"));
    let _shown = LogsOnPanic(vec![worker_log.clone(), wake_log.clone()]);
    let mut worker = Service::spawn(
        worker_args(&nats.url(), &prefix, "echo ran", &[]),
        worker_log.clone(),
    );
    let mut wake = Service::spawn(
        wake_args(&nats.url(), &prefix, &api.url()),
        wake_log.clone(),
    );
    for log in [&worker_log, &wake_log] {
        wait_until(WAIT, "the service waiting for init", || async {
            std::fs::read_to_string(log)
                .is_ok_and(|log| log.contains("Waiting for `wakebus init --max-bytes`"))
        })
        .await;
    }
    assert!(worker.is_running() && wake.is_running());
    let init = wakebus(&nats.url(), &prefix, &["init", "--max-bytes", "16MiB"]).await;
    assert!(init.success(), "{}", init.stderr());
    let bus = bus(&nats.url(), &prefix).await;
    let request = common::request("s-bytes", "after init");
    publish_until_stored(&bus, &request).await;
    wait_until(WAIT, "the session woken", || async {
        !api.accepted().is_empty()
    })
    .await;
    assert_eq!(
        api.accepted()[0].delegation_ids(),
        vec![request.delegation_id]
    );
}

/// A history below the duplicate window takes the window down with it
/// (the server refuses a longer one), and a longer history takes it back
/// up: wakebus's own doing, not a hand edit set back, which `init` warns
/// about. The short history itself is warned about.
#[tokio::test]
async fn init_changing_a_short_history_does_not_call_the_window_a_hand_edit() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let short_warning = "A history shorter than the duplicate window";
    for (history, window) in [("30s", 30), ("1h", 120), ("30s", 30)] {
        let run = wakebus(&nats.url(), &prefix, &["--history", history, "init"]).await;
        let stderr = run.stderr();
        assert!(run.success(), "{history}: {stderr}");
        assert!(!stderr.contains("set back"), "{history}: {stderr}");
        assert_eq!(stderr.contains(short_warning), window < 120, "{stderr}");
        let bus = bus(&nats.url(), &prefix).await;
        let events = bus
            .js
            .get_stream(bus.subjects.events_stream())
            .await
            .unwrap();
        let window = Duration::from_secs(window);
        assert_eq!(events.cached_info().config.duplicate_window, window);
    }
}

/// A server that limits the duplicate window below wakebus's 2 minutes
/// (`jetstream { limits { duplicate_window } }`) refused every stream, and
/// nothing could start. `init` makes them with the server's limit and
/// says so; run again, it keeps them so, without calling the limit a hand
/// edit set back, and a starting service asks for no update.
#[tokio::test]
async fn init_makes_the_streams_within_the_servers_duplicate_window_limit() {
    init_logs();
    let (nats, _conf) =
        NatsServer::start_with_config("jetstream { limits { duplicate_window: \"1m\" } }\n").await;
    let prefix = unique_prefix();
    // A history other than the services' default, as OPERATIONS.md
    // shows it: a service then keeps the stream's age, and its window.
    let init = ["--history", "14d", "init"];
    let first = wakebus(&nats.url(), &prefix, &init).await;
    assert!(first.success(), "{}", first.stderr());
    assert!(
        first.stderr().contains("limits the duplicate window"),
        "{}",
        first.stderr()
    );
    let again = wakebus(&nats.url(), &prefix, &init).await;
    assert!(again.success(), "{}", again.stderr());
    assert!(!again.stderr().contains("set back"), "{}", again.stderr());
    // A service keeps the shorter window: no update is even asked for (a
    // service's user may not make one, and would wait out its refusal).
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut updates = client.subscribe("$JS.API.STREAM.UPDATE.>").await.unwrap();
    client.flush().await.unwrap();
    let bus = bus(&nats.url(), &prefix).await;
    let wake_settings = wakebus::bus::BusSettings::default();
    bus.provision_wake_state(&wake_settings).await.unwrap();
    let asked = tokio::time::timeout(
        Duration::from_millis(500),
        futures::StreamExt::next(&mut updates),
    )
    .await;
    assert!(asked.is_err(), "{:?}", asked.map(|m| m.map(|m| m.subject)));
    let s = &bus.subjects;
    for stream in [s.tasks_stream(), s.events_stream(), s.dead_letter_stream()] {
        let stream = bus.js.get_stream(&stream).await.unwrap();
        let window = stream.cached_info().config.duplicate_window;
        assert_eq!(
            window,
            Duration::from_secs(60),
            "{}",
            stream.cached_info().config.name
        );
    }
}

/// `init --max-bytes` sets the limit of an existing stream too, but never
/// below what it holds (the stream would refuse every new completion),
/// and checks every part before it changes any; an `init` without it
/// keeps the limit; a part that does not exist, or a size without a unit
/// (bytes, easily meant as MiB), is refused before NATS is asked
/// anything.
#[tokio::test]
async fn init_sets_a_streams_byte_limit_but_never_below_what_it_holds() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    // A little over 1 MiB of history.
    for i in 0..3u32 {
        let long = serde_json::json!({"summary": "x".repeat(400 * 1024)});
        let id = format!("01JV3N4Y8K6D2Q7R9T1W5XBYT{i}");
        publish_completion(&bus, "s.bytes", &id, 0, long).await;
    }
    let limits = || async {
        let s = &bus.subjects;
        let mut limits = Vec::new();
        for stream in [s.tasks_stream(), s.events_stream()] {
            let stream = bus.js.get_stream(&stream).await.unwrap();
            limits.push(stream.cached_info().config.max_bytes);
        }
        limits
    };
    let unlimited = limits().await;
    assert!(unlimited.iter().all(|limit| *limit <= 0), "{unlimited:?}");

    // The tasks stream comes first, and is not changed either.
    let args = ["init", "--max-bytes", "2MiB", "--max-bytes", "events=1MiB"];
    let refused = wakebus(&nats.url(), &prefix, &args).await;
    assert!(!refused.success(), "{}", refused.stdout());
    let said = refused.stderr();
    assert!(
        said.contains("(part events) holds 1.") && said.contains("nothing was changed"),
        "{said}"
    );
    assert_eq!(limits().await, unlimited);

    let args = ["init", "--max-bytes", "2MiB", "--max-bytes", "events=8MiB"];
    let run = wakebus(&nats.url(), &prefix, &args).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(limits().await, [2 << 20, 8 << 20]);
    let again = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(again.success(), "{}", again.stderr());
    assert_eq!(limits().await, [2 << 20, 8 << 20], "kept");

    for (arg, said) in [
        ("history=1GiB", "unknown part \"history\""),
        ("events=512", "a number without a unit is bytes: 512MiB?"),
    ] {
        let bad = wakebus(&nats.url(), &prefix, &["init", "--max-bytes", arg]).await;
        assert!(!bad.success());
        assert!(bad.stderr().contains(said), "{arg}: {}", bad.stderr());
    }
}

/// The consumers' AckWait and in-flight limit are the running services'
/// (`--ack-wait`, `--max-in-flight`): `wakebus init`, run again after a
/// settings change, must not put them back to its defaults, or long tasks
/// would be redelivered while they run.
#[tokio::test]
async fn init_run_again_keeps_the_settings_the_services_gave_their_consumers() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let long = Duration::from_secs(600);
    let mut worker = bus.worker_consumer("default", long).await.unwrap();
    let mut wake = bus.wake_consumer(long, 50).await.unwrap();

    let run = wakebus(
        &nats.url(),
        &prefix,
        &["init", "--pool", "default", "--pool", "gpu"],
    )
    .await;
    assert!(run.success(), "{}", run.stderr());

    let worker = worker.info().await.unwrap().config.clone();
    assert_eq!(worker.ack_wait, long);
    let wake = wake.info().await.unwrap().config.clone();
    assert_eq!((wake.ack_wait, wake.max_ack_pending), (long, 50));
    // A missing one is created, with the defaults.
    let mut gpu: async_nats::jetstream::consumer::PullConsumer = bus
        .js
        .get_consumer_from_stream(
            bus.subjects.worker_consumer("gpu"),
            bus.subjects.tasks_stream(),
        )
        .await
        .unwrap();
    assert_eq!(
        gpu.info().await.unwrap().config.ack_wait,
        Duration::from_secs(30)
    );
}

/// A service started with a `--history` shorter than the duplicate window
/// keeps the deployment's age, and must keep its window too: a window cut
/// to the shorter age would halve the dedupe of re-sent requests and
/// completions, and flip back with the next service started without it.
#[tokio::test]
async fn a_service_with_a_short_history_keeps_the_streams_duplicate_window() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let short = wakebus::bus::BusSettings {
        history_max_age: Duration::from_secs(60),
        ..Default::default()
    };
    bus.provision(&short).await.unwrap();
    let mut events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let config = events.info().await.unwrap().config.clone();
    let defaults = wakebus::bus::BusSettings::default();
    assert_eq!(config.max_age, defaults.history_max_age);
    assert_eq!(config.duplicate_window, defaults.duplicate_window);
}

/// Shortening a stream's max age deletes at once what is older: a service
/// started with a shorter `--history` than the deployment's must not do it;
/// `wakebus init` with the shorter setting does, on the operator's word,
/// and only when given it: `init --pool gpu` from a shell without the
/// deployment's settings must not move them to the defaults, either way.
#[tokio::test]
async fn only_init_given_a_shorter_setting_shortens_what_a_stream_keeps_and_a_default_changes_nothing()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let month = Duration::from_secs(30 * 24 * 3600);
    // As `init --history 30d --session-lock-ttl 2m` sets them.
    let long = wakebus::bus::BusSettings {
        history_max_age: month,
        session_lock_ttl: Duration::from_secs(120),
        history_change: wakebus::bus::AgeChange::Set,
        session_lock_ttl_change: wakebus::bus::AgeChange::Set,
        ..Default::default()
    };
    bus.provision(&long).await.unwrap();
    bus.provision_wake_state(&long).await.unwrap();
    let age_of = |stream: String| {
        let bus = bus.clone();
        async move {
            let mut stream = bus.js.get_stream(stream).await.unwrap();
            stream.info().await.unwrap().config.max_age
        }
    };
    let max_age = || age_of(bus.subjects.events_stream());
    let lock_ttl = || {
        age_of(wakebus::protocol::Subjects::bucket_stream(
            &bus.subjects.session_lock_bucket(),
        ))
    };
    assert_eq!(max_age().await, month);

    // init for another pool, without the deployment's settings.
    let run = wakebus(&nats.url(), &prefix, &["init", "--pool", "gpu"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(max_age().await, month, "init shortened to a default");
    assert_eq!(lock_ttl().await, Duration::from_secs(120));
    let run = wakebus(&nats.url(), &prefix, &["--session-lock-ttl", "30s", "init"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(lock_ttl().await, Duration::from_secs(30));
    assert_eq!(max_age().await, month, "only the lock TTL was given");

    // A service with the default week.
    bus.provision(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    assert_eq!(max_age().await, month, "a service shortened the history");

    let run = wakebus(&nats.url(), &prefix, &["--history", "7d", "init"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(max_age().await, Duration::from_secs(7 * 24 * 3600));

    // Shorter than the default: a default does not lengthen it either.
    let days = Duration::from_secs(3 * 24 * 3600);
    let run = wakebus(&nats.url(), &prefix, &["--history", "3d", "init"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(max_age().await, days);
    let run = wakebus(&nats.url(), &prefix, &["init", "--pool", "gpu"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert_eq!(max_age().await, days, "init lengthened to a default");
    assert_eq!(lock_ttl().await, Duration::from_secs(30));
    bus.provision(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    bus.provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    assert_eq!(max_age().await, days, "a service lengthened to a default");

    // A service given a longer history lengthens it.
    let given = wakebus::bus::BusSettings {
        history_max_age: month,
        history_change: wakebus::bus::AgeChange::Lengthen,
        ..Default::default()
    };
    bus.provision(&given).await.unwrap();
    assert_eq!(max_age().await, month);
}

/// `wakebus status --json`, as a user refused the JetStream API requests
/// `denied`, on streams provisioned under `prefix`: the server (for more
/// runs), the report and the command's log. The command must succeed.
async fn status_refused(
    prefix: &str,
    denied: &[String],
) -> (common::nats::LimitedUserServer, Value, String) {
    let server = common::nats::LimitedUserServer::start(denied).await;
    bus(&server.nats.url(), prefix)
        .await
        .provision(&Default::default())
        .await
        .unwrap();
    let run = server
        .wakebus_as_limited(
            prefix,
            &["status", "--json", "--discovery-timeout", "100ms"],
        )
        .await;
    assert!(run.success(), "{}", run.stderr());
    let report = serde_json::from_str(&run.stdout()).unwrap();
    (server, report, run.stderr())
}

/// When the events stream was read but its consumers were not, the stream
/// keeps its row and counts, and the undelivered scan is skipped for the
/// reason that holds: the wake's ack floor is unknown (not "the stream was
/// not read", which would send an operator to the wrong place).
#[tokio::test]
async fn status_skips_the_undelivered_scan_when_the_events_streams_consumers_were_not_read() {
    init_logs();
    let prefix = unique_prefix();
    let events = wakebus::protocol::Subjects::new(&prefix)
        .unwrap()
        .events_stream();
    let denied = [format!("$JS.API.CONSUMER.LIST.{events}")];
    let (server, report, stderr) = status_refused(&prefix, &denied).await;

    let streams = report["streams"].as_array().unwrap();
    let row = streams
        .iter()
        .find(|s| s["name"] == events.as_str())
        .unwrap();
    assert_eq!(row["present"], true, "{row}");
    assert!(
        row["error"]
            .as_str()
            .is_some_and(|e| e.contains(&format!("consumers of {events}"))),
        "{row}"
    );
    let scan = report["undelivered_scan"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        scan.contains(&format!("the consumers of {events} were not read"))
            && !scan.contains("was not read"),
        "{report}"
    );
    assert!(
        stderr.contains("Could not read a stream's consumers"),
        "{stderr}"
    );
    assert!(!stderr.contains("Could not read a stream;"), "{stderr}");
    // `--strict` names the consumers, not the stream, as what was not read.
    strict_status_names(
        &server,
        &prefix,
        &format!("{events}'s consumers, the undelivered scan"),
    )
    .await;
}

/// Runs `status --strict` on a snapshot with parts not read: it must exit
/// with status 3 and end its warning with exactly `unread`, the parts'
/// names in order. Returns the run.
async fn strict_status_names(
    server: &common::nats::LimitedUserServer,
    prefix: &str,
    unread: &str,
) -> common::cli::Run {
    let strict = server
        .wakebus_as_limited(
            prefix,
            &["status", "--strict", "--discovery-timeout", "100ms"],
        )
        .await;
    assert_eq!(strict.code(), Some(3), "{}", strict.stderr());
    let stderr = strict.stderr();
    // Logs to a pipe, as a collector reads them, are plain text.
    assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");
    let warning = stderr
        .lines()
        .find(|line| line.contains("The snapshot is partial"))
        .unwrap_or_else(|| panic!("no warning naming the unread parts:\n{stderr}"));
    assert!(
        warning.trim_end().ends_with(&format!("unread={unread}")),
        "{warning}"
    );
    strict
}

/// A stream `status` cannot read (a refused request; in a cluster, a
/// timeout while its leader is elected) is reported as not read, never as
/// absent: that would send an operator to re-create what is there. The
/// rest of the snapshot stands, as the operator needs it most then.
#[tokio::test]
async fn status_reports_a_stream_it_cannot_read_as_not_read_and_keeps_the_rest() {
    init_logs();
    let prefix = unique_prefix();
    let subjects = wakebus::protocol::Subjects::new(&prefix).unwrap();
    let (events, dead_letters) = (subjects.events_stream(), subjects.dead_letter_stream());
    let denied = [
        format!("$JS.API.STREAM.INFO.{events}"),
        format!("$JS.API.STREAM.INFO.{dead_letters}"),
    ];
    let (server, report, stderr) = status_refused(&prefix, &denied).await;
    let streams = report["streams"].as_array().unwrap();
    let row = |name: &str| streams.iter().find(|s| s["name"] == name).unwrap();
    let unread = row(&events);
    assert_eq!(unread["present"], Value::Null, "{unread}");
    assert!(
        unread["error"]
            .as_str()
            .is_some_and(|e| e.contains(&format!("cannot read {events}"))),
        "{unread}"
    );
    let tasks = row(&subjects.tasks_stream());
    assert_eq!(tasks["present"], true, "{tasks}");
    assert_eq!(tasks["error"], Value::Null, "{tasks}");
    // Without the events stream, there is nothing to scan for undelivered
    // wakes; that says so too.
    assert!(
        report["undelivered_scan"]["error"]
            .as_str()
            .is_some_and(|e| e.contains(&events)),
        "{report}"
    );
    assert!(
        report["dead_letters"]["error"]
            .as_str()
            .is_some_and(|e| e.contains(&dead_letters)),
        "{report}"
    );
    for warning in [
        "Could not read a stream;",
        "Could not count the dead letters",
    ] {
        assert!(stderr.contains(warning), "{stderr}");
    }

    let run = server
        .wakebus_as_limited(&prefix, &["status", "--discovery-timeout", "100ms"])
        .await;
    assert!(run.success(), "{}", run.stderr());
    let text = run.stdout();
    // The same snapshot with `--strict`: printed, and exit status 3.
    let strict = strict_status_names(
        &server,
        &prefix,
        &format!("{events}, {dead_letters}, the dead letters, the undelivered scan"),
    )
    .await;
    assert!(strict.stdout().contains("not read (cannot read"));
    let events_row = text.lines().find(|l| l.contains(&events)).expect("a row");
    assert!(events_row.contains("not read (cannot read"), "{text}");
    assert!(!events_row.contains("missing"), "{text}");
    assert!(
        text.contains("Dead letters: not read (cannot read"),
        "{text}"
    );
}

/// The API subjects that create a consumer on the events stream under
/// `prefix` (with and without name and filter in the subject).
fn consumer_creates_on_events(prefix: &str) -> [String; 2] {
    let events = wakebus::protocol::Subjects::new(prefix)
        .unwrap()
        .events_stream();
    [
        format!("$JS.API.CONSUMER.CREATE.{events}"),
        format!("$JS.API.CONSUMER.CREATE.{events}.>"),
    ]
}

/// The undelivered-wakes scan reads through a consumer of its own; when
/// that cannot be created (refused here; in a cluster, while leaders are
/// elected) the snapshot says so and keeps everything else.
#[tokio::test]
async fn status_keeps_the_rest_of_the_snapshot_when_it_cannot_scan_for_undelivered_wakes() {
    init_logs();
    let prefix = unique_prefix();
    let events = wakebus::protocol::Subjects::new(&prefix)
        .unwrap()
        .events_stream();
    let denied = consumer_creates_on_events(&prefix);
    let (server, report, stderr) = status_refused(&prefix, &denied).await;
    let scan = &report["undelivered_scan"];
    assert!(
        scan["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot read completions")),
        "{report}"
    );
    assert_eq!(scan["complete"], false);
    assert_eq!(report["oldest_undelivered"], serde_json::json!([]));
    let streams = report["streams"].as_array().unwrap();
    assert!(
        streams
            .iter()
            .any(|s| s["name"] == events.as_str() && s["present"] == true),
        "{report}"
    );
    assert!(
        stderr.contains("Could not look for undelivered wakes"),
        "{stderr}"
    );

    let run = server
        .wakebus_as_limited(&prefix, &["status", "--discovery-timeout", "100ms"])
        .await;
    assert!(run.success(), "{}", run.stderr());
    assert!(run.stdout().contains(&events), "{}", run.stdout());
    assert!(
        run.stdout()
            .contains("Oldest undelivered wakes: not read (cannot read completions"),
        "{}",
        run.stdout()
    );
}

/// A worker whose consumer cannot be created (its NATS user may not, and
/// `init` was not run for its pool) retries without end; it must not say
/// it is ready while it does, even though the streams exist.
#[tokio::test]
async fn a_worker_without_its_consumer_is_not_ready() {
    init_logs();
    let denied = [
        "$JS.API.CONSUMER.CREATE.>",
        "$JS.API.CONSUMER.DURABLE.CREATE.>",
    ];
    let server = common::nats::LimitedUserServer::start(&denied.map(String::from)).await;
    let nats = &server.nats;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();

    let mut args = common::process::base_args(&nats.url(), &prefix);
    args.extend(server.limited_args());
    args.extend(["worker", "--pool", "gpu", "--executor", "echo"].map(String::from));
    let log = tempfile::NamedTempFile::new().unwrap();
    let (_worker, base) = spawn_with_metrics(args, log.path().to_owned());
    wait_until(
        WAIT,
        "the worker to fail to create its consumer",
        || async {
            std::fs::read_to_string(log.path()).is_ok_and(|log| log.contains("setup failed"))
        },
    )
    .await;
    let (status, body) = eventually(WAIT, "/readyz to answer", || async {
        http_get(&format!("{base}/readyz")).await
    })
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("consumer worker-gpu"), "{body}");
}

/// Streams and consumer all there, but a setup step that retries without
/// end (here the cancel watch, which this worker's user may not create):
/// it takes no work, and a rolling deploy must not take it for ready and
/// retire the instances that do.
#[tokio::test]
async fn a_worker_still_setting_up_is_not_ready_though_its_streams_and_consumer_exist() {
    init_logs();
    let prefix = unique_prefix();
    let cancels = wakebus::protocol::Subjects::bucket_stream(
        &wakebus::protocol::Subjects::new(&prefix)
            .unwrap()
            .cancel_bucket(),
    );
    let denied = [
        format!("$JS.API.CONSUMER.CREATE.{cancels}"),
        format!("$JS.API.CONSUMER.CREATE.{cancels}.>"),
    ];
    let server = common::nats::LimitedUserServer::start(&denied).await;
    let nats = &server.nats;
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();

    let mut args = common::process::base_args(&nats.url(), &prefix);
    args.extend(server.limited_args());
    args.extend(["worker", "--executor", "echo"].map(String::from));
    let log = tempfile::NamedTempFile::new().unwrap();
    let (_worker, base) = spawn_with_metrics(args, log.path().to_owned());
    wait_until(WAIT, "the worker to retry its cancel watch", || async {
        std::fs::read_to_string(log.path())
            .is_ok_and(|log| log.contains("Cannot follow the cancel records"))
    })
    .await;
    let (status, body) = eventually(WAIT, "/readyz to answer", || async {
        http_get(&format!("{base}/readyz")).await
    })
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("starting"), "{body}");
    // Its consumer exists: only the setup keeps it from being ready.
    let tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    tasks
        .consumer_info(bus.subjects.worker_consumer("default"))
        .await
        .expect("the worker's consumer");
}

/// A stream at a limit with discard=old makes room by deleting its oldest
/// messages, stored work among them; with discard=new it refuses the write,
/// which a publisher sees and retries. So streams are made with new, and the
/// policy of an existing stream is never changed.
#[tokio::test]
async fn updating_a_stream_keeps_the_limits_an_operator_set_by_hand() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();
    let config = || async {
        let mut events = bus
            .js
            .get_stream(bus.subjects.events_stream())
            .await
            .unwrap();
        events.info().await.unwrap().config.clone()
    };
    let mut capped = config().await;
    assert_eq!(
        capped.discard,
        async_nats::jetstream::stream::DiscardPolicy::New
    );
    capped.max_bytes = 1 << 30;
    bus.js.update_stream(&capped).await.unwrap();
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    let tasks_config = tasks.info().await.unwrap().config.clone();
    assert_eq!(
        tasks_config.discard,
        async_nats::jetstream::stream::DiscardPolicy::New
    );

    // A service that keeps history longer updates the stream.
    let month = Duration::from_secs(30 * 24 * 3600);
    let longer = wakebus::bus::BusSettings {
        history_max_age: month,
        history_change: wakebus::bus::AgeChange::Lengthen,
        ..Default::default()
    };
    bus.provision(&longer).await.unwrap();
    let updated = config().await;
    assert_eq!(updated.max_age, month);
    assert_eq!(updated.max_bytes, 1 << 30, "the operator's cap was cleared");
    assert_eq!(
        updated.discard,
        async_nats::jetstream::stream::DiscardPolicy::New
    );

    // An operator's discard=old (a history that keeps its newest part) stays
    // too, through an update of other settings.
    let mut old = config().await;
    old.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    bus.js.update_stream(&old).await.unwrap();
    let week = wakebus::bus::BusSettings {
        history_change: wakebus::bus::AgeChange::Set,
        ..Default::default()
    };
    bus.provision(&week).await.unwrap();
    let updated = config().await;
    assert_eq!(updated.max_age, week.history_max_age);
    assert_eq!(
        updated.discard,
        async_nats::jetstream::stream::DiscardPolicy::Old
    );
}

/// Another stream taking the deployment's subjects (an archive on
/// `<prefix>.>`, a deployment with a nested prefix) is an error naming the
/// overlap, not a race with another instance ending in "stream not found".
#[tokio::test]
async fn a_stream_that_already_takes_the_deployments_subjects_is_an_error_naming_the_overlap() {
    init_logs();
    let nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let prefix = unique_prefix();
    let subjects = wakebus::protocol::Subjects::new(&prefix).unwrap();
    let bus = wakebus::bus::Bus::new(client, subjects);
    bus.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ARCHIVE".to_owned(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let error = bus
        .provision(&Default::default())
        .await
        .expect_err("the subjects are taken");
    let said = error.to_string();
    assert!(
        matches!(error, wakebus::bus::ProvisionError::SubjectsOverlap { .. }),
        "{said}"
    );
    assert!(said.contains("overlap those of stream ARCHIVE"), "{said}");
    assert!(said.contains(&bus.subjects.tasks_stream()), "{said}");
}

/// `deny_delete` and `deny_purge` are one-way: the server refuses an update
/// that clears them. An operator protecting the history with them must not
/// make every later update fail (and the history keep its old max age).
#[tokio::test]
async fn a_stream_an_operator_protected_with_deny_flags_is_still_updated_and_keeps_them() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let events = bus.subjects.events_stream();
    let config = || {
        let bus = bus.clone();
        let events = events.clone();
        async move {
            let mut stream = bus.js.get_stream(events).await.unwrap();
            stream.info().await.unwrap().config.clone()
        }
    };
    let mut protected = config().await;
    protected.deny_delete = true;
    protected.deny_purge = true;
    bus.js.update_stream(&protected).await.unwrap();

    let month = Duration::from_secs(30 * 24 * 3600);
    let settings = wakebus::bus::BusSettings {
        history_max_age: month,
        history_change: wakebus::bus::AgeChange::Set,
        require_update: true,
        ..Default::default()
    };
    bus.provision(&settings).await.unwrap();
    let updated = config().await;
    assert_eq!(updated.max_age, month);
    assert!(updated.deny_delete && updated.deny_purge, "{updated:?}");
}

/// `wakebus init` exists to make the settings right: an update the server
/// refuses (here: a user without `STREAM.UPDATE`, whose request goes
/// unanswered) is its failure, at once, not an `ok` and not a retry for
/// ever.
#[tokio::test]
async fn init_fails_when_the_server_refuses_an_update_it_needs() {
    init_logs();
    let prefix = unique_prefix();
    let events = wakebus::protocol::Subjects::new(&prefix)
        .unwrap()
        .events_stream();
    let server =
        common::nats::LimitedUserServer::start(&[format!("$JS.API.STREAM.UPDATE.{events}")]).await;
    bus(&server.nats.url(), &prefix).await;
    let run = server
        .wakebus_as_limited(&prefix, &["--history", "14d", "init"])
        .await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("cannot update stream {events}")),
        "{}",
        run.stderr()
    );
    assert!(!run.stdout().contains("\"ok\""), "{}", run.stdout());
}

/// A user that may not create streams cannot make `init` wait for ever:
/// its requests go unanswered like those to a server still electing a
/// leader, so `init` gives up after `--timeout`, names the causes to
/// check, and creates nothing.
#[tokio::test]
async fn init_gives_up_after_its_timeout_when_this_user_may_not_create_streams() {
    init_logs();
    let prefix = unique_prefix();
    let server =
        common::nats::LimitedUserServer::start(&["$JS.API.STREAM.CREATE.>".to_owned()]).await;
    let run = server
        .wakebus_as_limited(&prefix, &["init", "--timeout", "2s"])
        .await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    assert!(
        run.stderr().contains("init did not finish within 2s")
            && run.stderr().contains("may not create streams"),
        "{}",
        run.stderr()
    );
    assert!(!run.stdout().contains("\"ok\""), "{}", run.stdout());
    let client = async_nats::connect(server.nats.url()).await.unwrap();
    let streams: Vec<String> = async_nats::jetstream::new(client)
        .stream_names()
        .try_collect::<Vec<String>>()
        .await
        .unwrap();
    assert!(streams.is_empty(), "{streams:?}");
}

/// A cancel that cannot read where its delegation stands (here: a user
/// that may not read the history) records the cancel all the same, and
/// says that it could not tell instead of calling the delegation running.
#[tokio::test]
async fn a_cancel_that_cannot_read_the_history_records_the_cancel_and_says_so() {
    init_logs();
    let prefix = unique_prefix();
    let events = wakebus::protocol::Subjects::new(&prefix)
        .unwrap()
        .events_stream();
    let denied = common::nats::message_reads_of(&events);
    let server = common::nats::LimitedUserServer::start(&denied).await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let id = delegate(&bus, Delegation::new("queued work").session("s.unread")).await;
    let run = server
        .wakebus_as_limited(&prefix, &["cancel", &id, "--connect-timeout", "2s"])
        .await;
    let report = &run.ok_json()[0];
    assert_eq!(
        (report["status"].as_str(), report["state"].as_str()),
        (Some("cancelled"), Some("not_read")),
        "{report}"
    );
    assert!(
        report["message"]
            .as_str()
            .is_some_and(|m| m.contains("Could not read where")),
        "{report}"
    );
    let record = bus
        .js
        .get_key_value(bus.subjects.cancel_bucket())
        .await
        .unwrap()
        .entry(wakebus::cancel::CancelTarget::Delegation(id.clone()).key())
        .await
        .unwrap();
    assert!(record.is_some(), "no cancel record for {id}");
}

/// A canceller that may write its record but not read it back (for the
/// server's time of it) broadcasts it with its own time: the running task
/// is still stopped.
#[tokio::test]
async fn a_cancel_that_cannot_read_its_record_back_still_stops_the_running_task() {
    init_logs();
    let prefix = unique_prefix();
    let cancels = wakebus::protocol::Subjects::bucket_stream(
        &wakebus::protocol::Subjects::new(&prefix)
            .unwrap()
            .cancel_bucket(),
    );
    let denied = common::nats::message_reads_of(&cancels);
    let server = common::nats::LimitedUserServer::start(&denied).await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let mut services = Services::new();
    services.worker(&bus, shell("sleep 60"), test_worker_config("default"));
    let id = delegate(&bus, Delegation::new("long work").session("s.unread.back")).await;
    wait_until(WAIT, "the task to start", || async {
        started(&bus).await == 1
    })
    .await;
    let run = server.wakebus_as_limited(&prefix, &["cancel", &id]).await;
    let report = &run.ok_json()[0];
    assert_eq!(
        (report["status"].as_str(), report["state"].as_str()),
        (Some("cancelled"), Some("running")),
        "{report}"
    );
    assert!(
        run.stderr()
            .contains("Could not read the cancel record back"),
        "{}",
        run.stderr()
    );
    let done = eventually(WAIT, "the interrupted completion", || async {
        done_events(&bus).await.into_iter().next()
    })
    .await;
    services.stop().await;
    assert_eq!(
        (done.status, done.error.as_deref()),
        (Status::Interrupted, Some("cancelled while running"))
    );
}

/// A pool name `init` cannot use is refused before it waits for anything.
#[tokio::test]
async fn init_refuses_a_bad_pool_name_at_once_even_with_nats_unreachable() {
    let prefix = unique_prefix();
    let run = wakebus("nats://127.0.0.1:1", &prefix, &["init", "--pool", "gpu.a"]).await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    assert!(run.stderr().contains("gpu.a"), "{}", run.stderr());
}

/// Two prefixes can map to one set of stream names (`acme.prod` and
/// `acme_prod` both make `ACME_PROD_TASKS`): the second deployment must
/// not take the first one's streams by changing their subjects, and says
/// what it found instead.
#[tokio::test]
async fn a_prefix_whose_stream_names_another_deployment_uses_is_refused_and_changes_nothing() {
    init_logs();
    let nats = NatsServer::start().await;
    let base = unique_prefix();
    let first = bus(&nats.url(), &format!("{base}.prod")).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let second = wakebus::bus::Bus::new(
        client,
        wakebus::protocol::Subjects::new(&format!("{base}_prod")).unwrap(),
    );
    assert_eq!(
        first.subjects.tasks_stream(),
        second.subjects.tasks_stream(),
        "the two prefixes share stream names"
    );
    let error = second
        .provision(&Default::default())
        .await
        .expect_err("the streams are the first deployment's");
    assert!(
        matches!(error, wakebus::bus::ProvisionError::SubjectsTaken { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("another deployment"), "{error}");
    let mut tasks = first
        .js
        .get_stream(first.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(
        tasks.info().await.unwrap().config.subjects,
        vec![first.subjects.tasks_all()]
    );
}

/// A stream that takes other subjects or lets messages go otherwise than
/// wakebus needs, and that cannot be updated, is an error: a service
/// using it as it is would lose work (a tasks stream with limits
/// retention keeps every acked request and hands nothing to a second pool).
#[tokio::test]
async fn a_stream_whose_retention_cannot_be_made_right_is_an_error_not_a_warning() {
    init_logs();
    let nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = wakebus::protocol::Subjects::new(&unique_prefix()).unwrap();
    let bus = wakebus::bus::Bus::new(client, subjects);
    bus.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: bus.subjects.tasks_stream(),
            subjects: vec![bus.subjects.tasks_all()],
            retention: async_nats::jetstream::stream::RetentionPolicy::Limits,
            ..Default::default()
        })
        .await
        .unwrap();
    let error = bus
        .provision_for_worker(&Default::default())
        .await
        .expect_err("the server refuses to change a stream's retention");
    assert!(
        error.to_string().contains(&bus.subjects.tasks_stream()),
        "{error}"
    );
}

/// A delegation stored whose completion does not come within the wait
/// exits 4, not 1: stored, it runs, and only the same id may send it
/// again; 1 means nothing was stored.
#[tokio::test]
async fn a_stored_delegation_whose_wait_times_out_exits_4() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();
    let run = wakebus(
        &nats.url(),
        &prefix,
        &[
            "delegate",
            "--goal",
            "nobody runs it",
            "--wait-timeout",
            "1s",
        ],
    )
    .await;
    assert_eq!(run.code(), Some(4), "{}", run.stderr());
    assert!(run.stderr().contains("may still run"), "{}", run.stderr());
    let queued = all_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(queued.len(), 1, "the request was stored");
}

/// A batch whose wait times out says how many of its completions came, and
/// how to follow the rest, rather than "no completion".
#[tokio::test]
async fn a_batch_whose_wait_times_out_says_how_many_completions_came() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();
    // The first task's completion is in the history already; nobody runs
    // the second.
    let id = "01JV3S2D6F8H0K2M4P6R8T0W2Y";
    let request = wakebus::protocol::TaskRequest::decode(
        format!(r#"{{"version":1,"delegation_id":"{id}","goal":"a","task_count":2}}"#).as_bytes(),
    )
    .unwrap();
    let done =
        wakebus::protocol::CompletionEvent::for_request(&request, Status::Completed, "completed");
    bus.js
        .publish(
            bus.subjects.event("sync", id, 0, EventKind::Done),
            serde_json::to_vec(&done).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let run = wakebus(
        &nats.url(),
        &prefix,
        &[
            "delegate",
            "--delegation-id",
            id,
            "--task",
            "a",
            "--task",
            "b",
            "--wait-timeout",
            "2s",
        ],
    )
    .await;
    assert_eq!(run.code(), Some(4), "{}", run.stderr());
    assert!(
        run.stderr().contains(&format!(
            "1 of 2 completions of delegation {id} arrived within 2s; its tasks may still run (follow them with `wakebus events --delegation {id} --kind done --follow`"
        )),
        "{}",
        run.stderr()
    );
}

/// A sync delegation whose requests were stored but whose wait then failed
/// (here: the user may not create the consumer it waits with) must say the
/// delegation was stored and name it: a caller that delegates again on an
/// error would run the task twice.
#[tokio::test]
async fn a_delegation_stored_whose_wait_fails_names_itself_and_says_not_to_delegate_again() {
    init_logs();
    let prefix = unique_prefix();
    let denied = consumer_creates_on_events(&prefix);
    let server = common::nats::LimitedUserServer::start(&denied).await;
    let bus = bus(&server.nats.url(), &prefix).await;
    bus.provision(&Default::default()).await.unwrap();

    let run = server
        .wakebus_as_limited(
            &prefix,
            &["delegate", "--goal", "stored, then not waited for"],
        )
        .await;
    assert_eq!(run.code(), Some(4), "{}", run.stderr());
    let queued = all_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(queued.len(), 1, "the request was stored");
    let id = queued[0]
        .headers
        .get("Wakebus-Delegation-Id")
        .unwrap()
        .to_string();
    let said = run.stderr();
    assert!(
        said.contains(&format!(
            "delegation {id} was stored and runs, but waiting for its completion failed"
        )),
        "{said}"
    );
    assert!(said.contains("do not delegate it again"), "{said}");
}

/// Locks expire when the bucket says, whatever `--session-lock-ttl` says: a
/// wake that may not (or must not) change the bucket times its refreshes by
/// the bucket's age, and says so.
#[tokio::test]
async fn a_wake_whose_lock_ttl_is_not_the_buckets_times_its_locks_by_the_bucket_and_warns() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let run = wakebus(&nats.url(), &prefix, &["--session-lock-ttl", "30s", "init"]).await;
    assert!(run.success(), "{}", run.stderr());
    let logs = tempfile::tempdir().unwrap();
    // `wake_args` asks for 3 s, which a service never shortens the bucket to.
    let args = common::process::wake_args(&nats.url(), &prefix, &api.url());
    assert!(
        args.windows(2)
            .any(|pair| pair == ["--session-lock-ttl", "3s"])
    );
    let log = logs.path().join("wake.log");
    let _wake = common::process::Service::spawn(args, log.clone());
    let line = eventually(WAIT, "the warning", || async {
        std::fs::read_to_string(&log).ok().and_then(|text| {
            text.lines()
                .find(|line| line.contains("The session-lock bucket expires locks"))
                .map(str::to_owned)
        })
    })
    .await;
    assert!(
        line.contains("bucket_ttl=30s") && line.contains("session_lock_ttl=3s"),
        "{line}"
    );
}

/// A woken batch is recorded once, under `<delegation>.batch`, and a
/// completion that wakes nobody is recorded nowhere: neither may show as an
/// undelivered wake, which is what an operator reads when a session is stuck.
/// Nor may the error of a member whose request could not be read, which
/// the wake may take into its batch: the batch's turn reports it.
#[tokio::test]
async fn status_does_not_list_a_woken_batch_or_a_silent_completion_as_undelivered() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let goals = ["first", "second"].map(String::from);
    let batch = delegate(&bus, Delegation::batch(goals).session("s.batch.woken")).await;
    wait_until(WAIT, "the batch's one wake", || async {
        api.accepted().len() == 1
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    forget_the_wake_floor(&bus).await;
    let completion = |session, id, extra| publish_completion(&bus, session, id, 0, extra);
    completion(
        "s.silent",
        "01JV3N4Y8K6D2Q7R9T1W5X0SIL",
        serde_json::json!({"suppress_wake": true}),
    )
    .await;
    completion(
        "s.waiting",
        "01JV3N4Y8K6D2Q7R9T1W5X0WAI",
        serde_json::json!({}),
    )
    .await;
    let unreadable = serde_json::json!({
        "status": "error", "exit_reason": "invalid_request",
        "task_count": 2, "wake_mode": "independent",
    });
    publish_completion(&bus, "s.batch.woken", &batch, 1, unreadable).await;

    let (report, sessions) = status_waiting(&nats, &prefix).await;
    assert_eq!(sessions, ["s.waiting"], "{report:#}");
}

/// Without the wake consumer there is no acknowledgement floor, and a scan
/// from the start of the history can stop at `--scan-limit` among
/// completions the wake is done with. `status` must not then say that
/// nothing waits, the very case an operator reads it for before making
/// the consumer again: it says the scan stopped short, and `--strict`
/// calls the snapshot partial.
#[tokio::test]
async fn status_does_not_say_nothing_waits_when_its_scan_stopped_at_the_limit() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let init = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(init.success(), "{}", init.stderr());
    forget_the_wake_floor(&bus).await;
    // Two completions that wake nobody, then one that waits.
    let silent = serde_json::json!({"suppress_wake": true});
    publish_completion(
        &bus,
        "s.silent",
        "01JV3N4Y8K6D2Q7R9T1W5X0SI1",
        0,
        silent.clone(),
    )
    .await;
    publish_completion(&bus, "s.silent", "01JV3N4Y8K6D2Q7R9T1W5X0SI2", 0, silent).await;
    let waiting = serde_json::json!({});
    publish_completion(&bus, "s.waiting", "01JV3N4Y8K6D2Q7R9T1W5X0WAI", 0, waiting).await;
    let url = nats.url();
    let status = |args: &'static [&'static str]| wakebus(&url, &prefix, args);

    let cut = status(&["status", "--json", "--strict", "--scan-limit", "2"]).await;
    assert_eq!(cut.code(), Some(3), "{}", cut.stderr());
    assert!(
        cut.stderr().contains("the completions beyond --scan-limit"),
        "{}",
        cut.stderr()
    );
    let report: Value = serde_json::from_str(&cut.stdout()).unwrap();
    let scan = &report["undelivered_scan"];
    assert_eq!(scan["complete"], false, "{report:#}");
    assert_eq!(scan["no_wake_consumer"], true, "{report:#}");
    let text = status(&["status", "--scan-limit", "2"]).await;
    assert!(text.success(), "{}", text.stderr());
    let out = text.stdout();
    assert!(
        out.contains("none in the 2 completions scanned, but the scan stopped at its limit"),
        "{out}"
    );
    assert!(out.contains("has no wake consumer"), "{out}");
    assert!(!out.contains("\nnone\n"), "{out}");

    // Scanned to the end, it finds the waiting one, and the snapshot is
    // whole.
    let whole = status(&["status", "--json", "--strict"]).await;
    assert!(whole.success(), "{}", whole.stderr());
    let report: Value = serde_json::from_str(&whole.stdout()).unwrap();
    assert_eq!(
        report["oldest_undelivered"][0]["session"], "s.waiting",
        "{report:#}"
    );
    assert_eq!(report["undelivered_scan"]["complete"], true, "{report:#}");
}

/// A flood of poison wake dead letters (a broken publisher) does not keep
/// `status` reading them for minutes: they count towards its bound on the
/// dead letters it reads for refused completions, and past it the
/// snapshot says that the rest were not read.
#[tokio::test]
async fn status_stops_at_its_bound_on_wake_dead_letters_poison_ones_included() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let init = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(init.success(), "{}", init.stderr());
    forget_the_wake_floor(&bus).await;
    let waiting = serde_json::json!({});
    publish_completion(&bus, "s.waiting", "01JV3N4Y8K6D2Q7R9T1W5X0WAI", 0, waiting).await;
    // One more than the bound, stored after the waiting completion.
    let poison = bus.subjects.dead_letter_wake("poison");
    let mut left = 50_001;
    while left > 0 {
        let window = left.min(1_000);
        let mut acks = Vec::with_capacity(window);
        for _ in 0..window {
            acks.push(
                bus.js
                    .publish(poison.clone(), "not a completion".into())
                    .await
                    .unwrap(),
            );
        }
        let acks = acks.into_iter().map(std::future::IntoFuture::into_future);
        for ack in futures::future::join_all(acks).await {
            ack.unwrap();
        }
        left -= window;
    }

    let run = wakebus(&nats.url(), &prefix, &["status", "--json"]).await;
    assert!(run.success(), "{}", run.stderr());
    let report: Value = serde_json::from_str(&run.stdout()).unwrap();
    let scan = &report["undelivered_scan"];
    assert!(
        scan["refused_error"]
            .as_str()
            .is_some_and(|error| error.contains("the rest were not read")),
        "{scan:#}"
    );
    assert_eq!(
        report["oldest_undelivered"][0]["session"], "s.waiting",
        "{report:#}"
    );
}

/// `status` lists the ten oldest sessions that wait; `--sessions` lists
/// more, and `--session S` says whether S waits however many older
/// sessions wait too (the list was always cut to the ten oldest, `--json`
/// too, so a younger session could not be found in it), and however many
/// completions of other sessions lie before it: the scan reads S's only.
#[tokio::test]
async fn status_tells_whether_one_session_waits_however_many_older_ones_do() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    for i in 0..12 {
        let id = format!("01JV3N4Y8K6D2Q7R9T1W5X0A{i:02}");
        publish_completion(&bus, &format!("s.{i:02}"), &id, 0, serde_json::json!({})).await;
    }
    let listed = |args: &'static [&'static str]| {
        let url = nats.url();
        let prefix = prefix.clone();
        async move {
            let mut all = vec!["status", "--json"];
            all.extend(args);
            let run = wakebus(&url, &prefix, &all).await;
            assert!(run.success(), "{}", run.stderr());
            let report: Value = serde_json::from_str(&run.stdout()).unwrap();
            report["oldest_undelivered"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["session"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    let oldest = listed(&[]).await;
    assert_eq!(oldest.len(), 10);
    assert!(!oldest.contains(&"s.11".to_owned()), "{oldest:?}");
    assert_eq!(listed(&["--sessions", "20"]).await.len(), 12);
    assert_eq!(listed(&["--session", "s.11"]).await, ["s.11"]);
    // Eleven other completions before it, a scan limit of two.
    let args = ["status", "--json", "--session", "s.11", "--scan-limit", "2"];
    let run = wakebus(&nats.url(), &prefix, &args).await;
    assert!(run.success(), "{}", run.stderr());
    let report: Value = serde_json::from_str(&run.stdout()).unwrap();
    assert_eq!(
        report["oldest_undelivered"][0]["session"], "s.11",
        "{report:#}"
    );
    let scan = &report["undelivered_scan"];
    assert_eq!(
        (&scan["session"], &scan["scanned"], &scan["complete"]),
        (
            &serde_json::json!("s.11"),
            &serde_json::json!(1),
            &serde_json::json!(true)
        ),
        "{scan:#}"
    );

    let run = wakebus(&nats.url(), &prefix, &["status", "--session", "s.absent"]).await;
    assert!(run.success(), "{}", run.stderr());
    assert!(
        run.stdout().contains(r#"none for session "s.absent"."#),
        "{}",
        run.stdout()
    );
}

/// Stores a completion of task `index` of delegation `id` for `session`,
/// as a publisher could: the body (with `extra` fields), the origin header.
async fn publish_completion(bus: &Bus, session: &str, id: &str, index: u32, extra: Value) {
    let mut body = serde_json::json!({
        "type": "async_delegation", "delegation_id": id, "origin_session_id": session,
        "task_index": index, "status": "completed", "completed_at": "2026-01-01T00:00:00Z",
        "exit_reason": "completed",
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", session);
    let subject = bus
        .subjects
        .event(&session_token(session), id, index, EventKind::Done);
    bus.js
        .publish_with_headers(subject, headers, serde_json::to_vec(&body).unwrap().into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Deletes the wake's consumer: without its ack floor, status scans every
/// completion, as when an old one holds the floor back.
async fn forget_the_wake_floor(bus: &Bus) {
    let events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    events
        .delete_consumer(bus.subjects.wake_consumer())
        .await
        .unwrap();
}

/// `wakebus status --json`, and the sessions it lists as waiting.
async fn status_waiting(nats: &NatsServer, prefix: &str) -> (Value, Vec<String>) {
    let run = wakebus(&nats.url(), prefix, &["status", "--json"]).await;
    assert!(run.success(), "{}", run.stderr());
    let report: Value = serde_json::from_str(&run.stdout()).unwrap();
    let sessions = report["oldest_undelivered"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["session"].as_str().unwrap().to_owned())
        .collect();
    (report, sessions)
}

/// Above a held-back ack floor lie completions the wake has finished
/// with: a turn the session API refused (dead-lettered and acknowledged),
/// a completion the wake cannot use, a batch member whose batch waits for
/// its other task. None waits for a wake: `status` says what they are
/// instead of listing their sessions as undelivered, which would send an
/// operator after the wrong sessions.
#[tokio::test]
async fn status_tells_refused_unusable_and_batch_waiting_completions_from_undelivered_ones() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let publish = |session, id, index, extra| publish_completion(&bus, session, id, index, extra);
    api.fail_always(404);
    // A batch whose turn is refused: the refusal dead-letters the member
    // that ended it, and the other, acknowledged when it came, is refused
    // with it.
    let batch = serde_json::json!({"task_count": 2, "wake_mode": "batch"});
    let refused = "01JV3N4Y8K6D2Q7R9T1W5X0REF";
    publish("s.refused", refused, 0, batch.clone()).await;
    wake_consumer_settled(&bus).await;
    publish("s.refused", refused, 1, batch.clone()).await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "the refused turn's dead letter", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(all_messages(&bus, &dlq).await.len(), 1, "one member held");
    forget_the_wake_floor(&bus).await;
    publish(
        "s.waiting",
        "01JV3N4Y8K6D2Q7R9T1W5X0WAI",
        0,
        serde_json::json!({}),
    )
    .await;
    publish(
        "s.unusable",
        "01JV3N4Y8K6D2Q7R9T1W5X0UNU",
        3,
        serde_json::json!({"task_count": 2}),
    )
    .await;
    publish("s.batch", "01JV3N4Y8K6D2Q7R9T1W5X0BAT", 0, batch).await;

    let (report, sessions) = status_waiting(&nats, &prefix).await;
    assert_eq!(sessions, ["s.waiting"], "{report:#}");
    let scan = &report["undelivered_scan"];
    let counts = [
        "sessions",
        "completions",
        "refused",
        "unusable",
        "batch_waiting",
    ]
    .map(|field| scan[field].as_u64());
    assert_eq!(counts, [1, 1, 2, 1, 1].map(Some), "{scan:#}");

    let run = wakebus(&nats.url(), &prefix, &["status"]).await;
    assert!(run.success(), "{}", run.stderr());
    let text = run.stdout();
    assert!(
        text.contains("Not waiting: 2 dead-lettered by the wake")
            && text.contains("1 unusable")
            && text.contains("1 batch members waiting"),
        "{text}"
    );
}

/// `--version` and the services report the package's version with the
/// commit the build came from, so that an operator can tell builds apart.
#[tokio::test]
async fn the_version_names_the_commit_the_build_came_from() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .arg("--version")
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    let said = String::from_utf8(output.stdout).unwrap();
    assert_eq!(said.trim(), format!("wakebus {}", wakebus::VERSION));
    // What build.rs read: the commit of this checkout, when the package
    // is a checkout of its own and no commit was given.
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8(output.stdout).unwrap().trim().to_owned())
    };
    let own_checkout = git(&["rev-parse", "--show-toplevel"]).is_some_and(|top| {
        std::fs::canonicalize(top).ok() == std::fs::canonicalize(env!("CARGO_MANIFEST_DIR")).ok()
    });
    let package = env!("CARGO_PKG_VERSION");
    // A commit given by the build (an image), as semver build metadata
    // allows it; an empty one counts as none.
    let given = option_env!("WAKEBUS_BUILD_COMMIT")
        .filter(|commit| !commit.is_empty())
        .map(|commit| {
            commit
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
                .take(40)
                .collect::<String>()
        });
    let expected = match (given, git(&["rev-parse", "--short=12", "HEAD"])) {
        (Some(given), _) if !given.is_empty() => format!("{package}+g{given}"),
        (Some(_), _) => package.to_owned(),
        (None, Some(commit)) if own_checkout => format!("{package}+g{commit}"),
        // No checkout of its own (a tarball, a vendored copy).
        (None, _) => package.to_owned(),
    };
    assert_eq!(wakebus::VERSION, expected);
}

/// `status` run while its server is gone (it died after `status`
/// connected) ends, saying what it could not do, instead of waiting for
/// ever for the client to reconnect and confirm service discovery's
/// request.
#[tokio::test]
async fn status_ends_when_its_server_goes_away() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    nats.kill();
    let options = wakebus::status::StatusOptions::default();
    let collected = tokio::time::timeout(
        Duration::from_secs(60),
        wakebus::status::collect(&bus, &options),
    )
    .await;
    let error = collected
        .expect("status to end")
        .expect_err("nothing answered discovery");
    assert!(error.to_string().contains("service discovery"), "{error}");
}
