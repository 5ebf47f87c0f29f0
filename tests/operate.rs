//! Operating wakebus: `events` filters, `replay` of wakes and dead-lettered
//! tasks, `status --json`, and the metrics and health endpoints, all against
//! real nats-server processes and the real `wakebus` binary.

mod common;

use std::time::Duration;

use common::cli::{field, publish_task, request, wakebus};
use common::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use wakebus::delegate::{DelegateResult, Delegation, Delegator};
use wakebus::history::HEADER_REPLAY;
use wakebus::protocol::{Status, session_token};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

fn id_of(result: &DelegateResult) -> String {
    match result {
        DelegateResult::Dispatched { delegation_id, .. }
        | DelegateResult::Completed { delegation_id, .. } => delegation_id.clone(),
    }
}

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
async fn events_follow_streams_new_events_until_interrupted() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (first, _, _) = publish_task(&bus, Some("s.follow"), Status::Completed).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            &nats.url(),
            &prefix,
            &["events", "--follow", "--kind", "done"],
        ))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next_line = async || -> Value {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("a line within the timeout")
            .unwrap()
            .expect("stdout open");
        serde_json::from_str(&line).unwrap()
    };
    assert_eq!(
        next_line().await["delegation_id"],
        first.delegation_id.as_str()
    );
    let (second, _, _) = publish_task(&bus, Some("s.follow"), Status::Failed).await;
    let line = next_line().await;
    assert_eq!(line["delegation_id"], second.delegation_id.as_str());
    assert_eq!(line["status"], "failed");

    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after Ctrl-C")
        .unwrap();
    assert!(status.success(), "{status}");
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
            "started events have none",
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
