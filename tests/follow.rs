//! `wakebus events --follow`: a follow that streams new events until
//! interrupted and rides out what happens to the server and the stream
//! meanwhile (a restart, a frozen server, a deleted stream), as the real
//! `wakebus` binary against real nats-server processes.

mod common;

use std::time::Duration;

use common::cli::publish_task;
use common::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use wakebus::protocol::Status;

const WAIT: Duration = Duration::from_secs(30);

/// `wakebus events --follow --kind done` as a process, and its stdout lines;
/// its stderr goes to `stderr` (a test reading the warnings pipes it).
fn follow_completions(
    nats_url: &str,
    prefix: &str,
    stderr: std::process::Stdio,
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    follow_completions_logging(nats_url, prefix, stderr, "wakebus=info")
}

/// [`follow_completions`] logging at `rust_log` (`RUST_LOG`).
fn follow_completions_logging(
    nats_url: &str,
    prefix: &str,
    stderr: std::process::Stdio,
    rust_log: &str,
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            nats_url,
            prefix,
            &["events", "--follow", "--kind", "done"],
        ))
        .env("RUST_LOG", rust_log)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// Three completions stored, then a follow of them: returned once it has
/// shown all three.
async fn follow_after_three_events(
    bus: &wakebus::bus::Bus,
    nats_url: &str,
    prefix: &str,
    stderr: std::process::Stdio,
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut old = Vec::new();
    for _ in 0..3 {
        old.push(publish_task(bus, Some("s.old"), Status::Completed).await.0);
    }
    let (child, mut lines) = follow_completions(nats_url, prefix, stderr);
    for request in &old {
        let line = next_json(&mut lines, WAIT).await;
        assert_eq!(line["delegation_id"], request.delegation_id.as_str());
    }
    (child, lines)
}

/// Sends SIGINT, as Ctrl-C would, and asserts a clean exit.
async fn stop_with_ctrl_c(child: &mut tokio::process::Child) {
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after Ctrl-C")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// The next line of `lines` as JSON, within `timeout`.
async fn next_json(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    timeout: Duration,
) -> Value {
    let line = tokio::time::timeout(timeout, lines.next_line())
        .await
        .expect("a line within the timeout")
        .unwrap()
        .expect("stdout open: the follow ended");
    serde_json::from_str(&line).unwrap()
}

#[tokio::test]
async fn events_follow_streams_new_events_until_interrupted_and_leaves_no_consumer() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (first, _, _) = publish_task(&bus, Some("s.follow"), Status::Completed).await;
    let (mut child, mut lines) =
        follow_completions(&nats.url(), &prefix, std::process::Stdio::null());
    let mut next_line = async || next_json(&mut lines, WAIT).await;
    assert_eq!(
        next_line().await["delegation_id"],
        first.delegation_id.as_str()
    );
    let (second, _, _) = publish_task(&bus, Some("s.follow"), Status::Failed).await;
    let line = next_line().await;
    assert_eq!(line["delegation_id"], second.delegation_id.as_str());
    assert_eq!(line["status"], "failed");

    stop_with_ctrl_c(&mut child).await;
    // Its ordered consumer is deleted on the way out, not left to expire.
    assert_eq!(
        consumers_on_events(&bus).await,
        0,
        "consumers left on EVENTS"
    );
}

/// How many consumers the events stream has.
async fn consumers_on_events(bus: &wakebus::bus::Bus) -> usize {
    let mut stream = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    stream.info().await.unwrap().state.consumer_count
}

#[tokio::test]
async fn events_follow_goes_on_after_a_nats_restart_without_repeating_or_skipping_events() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (first, _, _) = publish_task(&bus, Some("s.follow"), Status::Completed).await;
    let (mut child, mut lines) =
        follow_completions(&nats.url(), &prefix, std::process::Stdio::null());
    // The client notices the lost consumer some seconds after reconnecting.
    let mut next_line = async || next_json(&mut lines, Duration::from_secs(90)).await;
    assert_eq!(
        next_line().await["delegation_id"],
        first.delegation_id.as_str()
    );

    // A restarted single server has forgotten the follow's ephemeral consumer.
    nats.restart().await;
    wait_until(WAIT, "the test's client to reconnect", || async {
        bus.client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    let (second, _, _) = publish_task(&bus, Some("s.follow"), Status::Failed).await;
    let line = next_line().await;
    assert_eq!(
        line["delegation_id"],
        second.delegation_id.as_str(),
        "not the next event"
    );

    stop_with_ctrl_c(&mut child).await;
    // Whichever read replaced the lost one (the follow's own, or the one
    // the client created by itself), it is deleted on the way out.
    assert_eq!(
        consumers_on_events(&bus).await,
        0,
        "consumers left on EVENTS"
    );
}

#[tokio::test]
async fn events_follow_waits_out_a_deleted_stream_and_reads_its_successor_from_the_start() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (mut child, mut lines) =
        follow_after_three_events(&bus, &nats.url(), &prefix, std::process::Stdio::piped()).await;
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();

    let events = bus.subjects.events_stream();
    bus.js.delete_stream(&events).await.expect("delete");
    let told = tokio::time::timeout(WAIT, async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            if line.contains("no longer exists") {
                return Some(line);
            }
        }
        None
    })
    .await
    .expect("a warning within the timeout")
    .expect("the follow ended instead of waiting");
    assert!(told.contains(&events), "{told}");

    // Provisioned again (as the next worker or wake to start does): a new
    // stream whose sequences start at 1 again, below the last one shown.
    bus.provision(&wakebus::bus::BusSettings::default())
        .await
        .expect("provision");
    let (new, _, _) = publish_task(&bus, Some("s.gone"), Status::Failed).await;
    let line = next_json(&mut lines, WAIT).await;
    assert_eq!(
        line["delegation_id"],
        new.delegation_id.as_str(),
        "the new stream's first event was skipped"
    );

    stop_with_ctrl_c(&mut child).await;
}

#[tokio::test]
async fn events_follow_shows_each_event_once_when_its_stream_is_deleted_and_created_again_at_once()
{
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (mut child, mut lines) =
        follow_after_three_events(&bus, &nats.url(), &prefix, std::process::Stdio::null()).await;

    // Deleted and provisioned again at once, well within the 5 s between
    // the follow's looks at its stream. The client's own new read would go
    // on after the last sequence shown, in the middle of the new events.
    let events = bus.subjects.events_stream();
    bus.js.delete_stream(&events).await.expect("delete");
    bus.provision(&wakebus::bus::BusSettings::default())
        .await
        .expect("provision");
    let mut new = Vec::new();
    for _ in 0..5 {
        new.push(publish_task(&bus, Some("s.again"), Status::Failed).await.0);
    }
    // The last one shows that nothing came twice before it.
    let (last, _, _) = publish_task(&bus, Some("s.again"), Status::Completed).await;
    new.push(last);
    for request in &new {
        let line = next_json(&mut lines, WAIT).await;
        assert_eq!(
            line["delegation_id"],
            request.delegation_id.as_str(),
            "not the next event of the new stream"
        );
    }

    stop_with_ctrl_c(&mut child).await;
}

#[tokio::test]
async fn events_follow_rides_out_a_frozen_server_whose_stream_lookups_fail() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let (first, _, _) = publish_task(&bus, Some("s.frozen"), Status::Completed).await;
    let (mut child, mut lines) = follow_completions_logging(
        &nats.url(),
        &prefix,
        std::process::Stdio::piped(),
        "wakebus=debug",
    );
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel();
    // Drained throughout, so debug lines never fill the pipe.
    tokio::spawn(async move {
        let mut failed_tx = Some(failed_tx);
        while let Ok(Some(line)) = stderr.next_line().await {
            let lookup_failed = line.contains("Cannot look the stream up")
                || line.contains("Cannot follow again yet");
            if lookup_failed && let Some(tx) = failed_tx.take() {
                let _ = tx.send(line);
            }
        }
    });
    let line = next_json(&mut lines, WAIT).await;
    assert_eq!(line["delegation_id"], first.delegation_id.as_str());

    // Frozen, the server takes bytes but answers nothing: the follow's
    // stream lookups (every 5 s, or on reopening a read) time out.
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    let failed = tokio::time::timeout(Duration::from_secs(60), failed_rx)
        .await
        .expect("a failed stream lookup while the server is frozen")
        .expect("the follow ended instead of retrying");
    nats.signal(nix::sys::signal::Signal::SIGCONT);
    assert!(failed.contains(&bus.subjects.events_stream()), "{failed}");

    let (second, _, _) = publish_task(&bus, Some("s.frozen"), Status::Failed).await;
    let line = next_json(&mut lines, Duration::from_secs(60)).await;
    assert_eq!(
        line["delegation_id"],
        second.delegation_id.as_str(),
        "not the next event"
    );
    stop_with_ctrl_c(&mut child).await;
}

/// A server whose events stream holds `total` progress events of one task,
/// and a bus to it.
async fn progress_events(total: u64) -> (NatsServer, wakebus::bus::Bus) {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let subject = format!("{}.evt.tok.d1.0.progress", bus.subjects.prefix());
    for _ in 0..total {
        // Acks awaited below, all at once.
        drop(bus.js.publish(subject.clone(), "{}".into()).await.unwrap());
    }
    let events = bus.subjects.events_stream();
    wait_until(WAIT, "every event stored", || async {
        stored_messages(&bus, &events).await == total
    })
    .await;
    (nats, bus)
}

/// A bounded read (`events`, `replay`) whose last pending messages are
/// deleted before they reach it (a purge of handled dead letters, a sweep)
/// ends with what there is, instead of failing as stalled: a forced replay
/// reported as failed invites the re-run that wakes every session again.
#[tokio::test]
async fn a_bounded_read_whose_last_pending_messages_are_deleted_ends_instead_of_stalling() {
    use wakebus::history::{HistoryReader, Selection, Source};
    let (_nats, bus) = progress_events(3_000).await;
    let total = 3_000_u64;
    let mut reader = HistoryReader::open(&bus, Source::Events, Selection::default(), false)
        .await
        .unwrap();
    let first = reader.next().await.unwrap().unwrap();
    // Everything after what the reader has taken in so far (its first
    // pull, some hundreds) goes away.
    let stream = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    for sequence in 3..=total {
        let _ = stream.delete_message(sequence).await;
    }
    let mut read = 1;
    while let Some(record) = tokio::time::timeout(WAIT, reader.next())
        .await
        .expect("the read to end")
    {
        let record = record.expect("the read ends without an error");
        assert!(record.sequence > first.sequence);
        read += 1;
    }
    assert!(read < total, "read {read}");
}

/// `events --follow --until T`, T `seconds` from now, its output dropped.
fn follow_until(
    nats_url: &str,
    prefix: &str,
    seconds: i64,
    stderr: std::process::Stdio,
) -> tokio::process::Child {
    let until = time::OffsetDateTime::now_utc() + time::Duration::seconds(seconds);
    let until = until
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            nats_url,
            prefix,
            &["events", "--follow", "--until", &until],
        ))
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn")
}

/// `events --follow --until T` ends once T has passed, even when nothing
/// arrives after it to show that it has.
#[tokio::test]
async fn events_follow_until_a_time_ends_after_it_with_nothing_arriving() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    bus(&nats.url(), &prefix).await;
    let mut child = follow_until(&nats.url(), &prefix, 1, std::process::Stdio::null());
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the follow to end after --until")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// `events --follow --until T` whose stream is deleted (and not made
/// again) ends once T has passed, as it does with the stream there.
#[tokio::test]
async fn events_follow_until_a_time_ends_after_it_while_its_stream_is_gone() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut child = follow_until(&nats.url(), &prefix, 2, std::process::Stdio::piped());
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    wait_until(WAIT, "the follow to open its read", || async {
        consumers_on_events(&bus).await == 1
    })
    .await;
    bus.js
        .delete_stream(bus.subjects.events_stream())
        .await
        .expect("delete");
    tokio::time::timeout(WAIT, async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            if line.contains("no longer exists") {
                return;
            }
        }
        panic!("the follow ended before it saw its stream gone");
    })
    .await
    .expect("the follow to see its stream gone");
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the follow to end after --until while its stream is gone")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// `events --follow --to-seq N` ends once the stream has passed N with
/// nothing left to show before it, even when no message it shows is ever
/// stored at or after N.
#[tokio::test]
async fn a_follow_up_to_a_sequence_ends_once_the_stream_has_passed_it() {
    use wakebus::history::{HistoryReader, Selection, Source};
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let prefix = bus.subjects.prefix().to_owned();
    // Sequences 1 and 2 are shown; 3 and 4, another delegation's, are not.
    for delegation in ["shown", "shown", "other", "other"] {
        let subject = format!("{prefix}.evt.tok.{delegation}.0.progress");
        let ack = bus.js.publish(subject, "{}".into()).await.unwrap();
        ack.await.unwrap();
    }
    let selection = Selection {
        delegation: Some("shown".to_owned()),
        to_seq: Some(3),
        ..Selection::default()
    };
    let mut reader = HistoryReader::open(&bus, Source::Events, selection, true)
        .await
        .unwrap();
    let mut shown = Vec::new();
    while let Some(record) = tokio::time::timeout(WAIT, reader.next())
        .await
        .expect("the follow to end past --to-seq")
    {
        shown.push(record.unwrap().sequence);
    }
    assert_eq!(shown, [1, 2]);
}

/// The same for a follow that starts at a time after every message on its
/// filter: the older messages are none of what it has still to show.
#[tokio::test]
async fn a_follow_from_a_time_up_to_a_sequence_ends_once_the_stream_has_passed_it() {
    use wakebus::history::{HistoryReader, Selection, Source};
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let subject = format!("{}.evt.tok.d1.0.progress", bus.subjects.prefix());
    for _ in 0..2 {
        let ack = bus.js.publish(subject.clone(), "{}".into()).await.unwrap();
        ack.await.unwrap();
    }
    let selection = Selection {
        since: Some(time::OffsetDateTime::now_utc() + time::Duration::seconds(1)),
        to_seq: Some(2),
        ..Selection::default()
    };
    let mut reader = HistoryReader::open(&bus, Source::Events, selection, true)
        .await
        .unwrap();
    let next = tokio::time::timeout(WAIT, reader.next())
        .await
        .expect("the follow to end past --to-seq");
    assert!(next.is_none(), "{next:?}");
}

/// A follow with `--until` in the past shows everything stored before it,
/// then ends: `--until` having passed does not cut short a long history
/// still being read.
#[tokio::test]
async fn a_follow_until_a_past_time_shows_everything_stored_before_it() {
    use wakebus::history::{HistoryReader, Selection, Source};
    let (_nats, bus) = progress_events(2_000).await;
    let total = 2_000_u64;
    let until = time::OffsetDateTime::now_utc();
    // `--until` and the margin a follow gives the server's clock.
    let ended = until + time::Duration::seconds(6);
    wait_until(WAIT, "--until and its margin to pass", || async {
        time::OffsetDateTime::now_utc() > ended
    })
    .await;
    let selection = Selection {
        until: Some(until),
        ..Selection::default()
    };
    let mut reader = HistoryReader::open(&bus, Source::Events, selection, true)
        .await
        .unwrap();
    let mut shown = 0;
    while let Some(record) = tokio::time::timeout(WAIT, reader.next())
        .await
        .expect("the follow to end past --until")
    {
        record.expect("no read error");
        shown += 1;
    }
    assert_eq!(shown, total);
}
