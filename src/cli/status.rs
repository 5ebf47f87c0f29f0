//! `wakebus status`: one screen about a deployment, or `--json` for scripts.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use tracing::warn;
use wakebus::history::rfc3339;
use wakebus::status::{Follower, ReplicaSet, StatusOptions, StatusReport, collect};

use super::args::Global;

/// `wakebus status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print the snapshot as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// How long to wait for live instances to answer (0 would find none,
    /// and report every pool as having no worker).
    #[arg(long, value_parser = super::args::positive_duration, default_value = "1s")]
    pub(crate) discovery_timeout: Duration,
    /// Most completions to examine when looking for undelivered wakes.
    #[arg(long, default_value_t = 5000)]
    pub(crate) scan_limit: u64,
    /// How many sessions with undelivered wakes to list, oldest first.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) sessions: u32,
    /// List only this session's undelivered wakes (the raw session id), to
    /// tell whether it waits however many older sessions wait too.
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Exit with status 3 when any part of the snapshot could not be read
    /// (the snapshot is printed all the same). Without it a partial
    /// snapshot exits 0, as it is most needed during an election; checks
    /// and scripts that must not take a partial snapshot for a full one
    /// want this.
    #[arg(long)]
    pub(crate) strict: bool,
}

/// The exit status of `status --strict` for a snapshot with parts not read.
const PARTIAL: u8 = 3;

pub(crate) async fn run(global: &Global, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let bus = super::commands::connect_within(global, "wakebus-status", std::time::Duration::ZERO)
        .await?;
    let options = StatusOptions {
        discovery_timeout: args.discovery_timeout,
        scan_limit: args.scan_limit,
        top_sessions: usize::try_from(args.sessions).unwrap_or(usize::MAX),
        session: args.session.clone(),
    };
    let report = collect(&bus, &options).await?;
    for stream in &report.streams {
        match (&stream.error, stream.present) {
            (Some(error), None) => {
                warn!(stream = %stream.name, %error, "Could not read a stream; the rest of the snapshot stands.");
            }
            (Some(error), Some(_)) => {
                warn!(stream = %stream.name, %error, "Could not read a stream's consumers; the rest of the snapshot stands.");
            }
            (None, _) => {}
        }
    }
    if let Some(error) = &report.dead_letters.error {
        warn!(%error, "Could not count the dead letters; the rest of the snapshot stands.");
    }
    if let Some(error) = &report.queued.error {
        warn!(%error, "Could not count the queued tasks; the rest of the snapshot stands.");
    }
    let scan = &report.undelivered_scan;
    if let Some(error) = &scan.error {
        warn!(%error, "Could not look for undelivered wakes; the rest of the snapshot stands.");
    }
    if let Some(error) = &scan.refused_error {
        warn!(%error, "Could not read the wake dead letters; completions the wake refused are listed as waiting.");
    }
    if scan.inconclusive() {
        warn!(
            scanned = scan.scanned,
            from_seq = scan.from_seq,
            "The undelivered scan reached --scan-limit without finding a waiting completion: whether any waits beyond it is not known."
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report, args.session.as_deref()));
    }
    let unread = report.unread();
    if args.strict && !unread.is_empty() {
        let unread: Vec<String> = unread.iter().map(ToString::to_string).collect();
        warn!(unread = %unread.join(", "), "The snapshot is partial; exiting with status 3 (--strict).");
        return Ok(ExitCode::from(PARTIAL));
    }
    Ok(ExitCode::SUCCESS)
}

fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_style(UTF8_BORDERS_ONLY).set_header(header);
    table
}

fn time(t: Option<time::OffsetDateTime>) -> String {
    t.map(rfc3339).unwrap_or_else(|| "-".to_owned())
}

/// `3, leader n1` when every replica is current; otherwise what is not:
/// `3, leader n1, n2 offline, n3 12 behind`, or `3, NO LEADER, ...`.
fn replicas(count: usize, cluster: Option<&ReplicaSet>) -> String {
    let Some(cluster) = cluster else {
        return count.to_string();
    };
    let mut text = match &cluster.leader {
        Some(leader) => format!("{count}, leader {leader}"),
        None => format!("{count}, NO LEADER"),
    };
    for follower in &cluster.followers {
        let state = match follower {
            Follower { offline: true, .. } => "offline".to_owned(),
            Follower { current: true, .. } => continue,
            Follower { lag: Some(lag), .. } if *lag > 0 => format!("{lag} behind"),
            Follower { .. } => "not current".to_owned(),
        };
        text.push_str(&format!(", {} {state}", follower.name));
    }
    text
}

/// How full a stream may be before `status` says it nears its byte limit.
const NEAR_LIMIT_PERCENT: u64 = 90;

/// A line for each stream holding at least [`NEAR_LIMIT_PERCENT`] of its
/// byte limit: at the limit, writes to it are refused (a completion then
/// waits in its worker, and no wake follows), which the counts alone do
/// not show.
fn near_byte_limits(report: &StatusReport) -> String {
    let subjects = wakebus::protocol::Subjects::new(&report.prefix).ok();
    let mut out = String::new();
    for s in report.streams.iter().filter(|s| s.present == Some(true)) {
        let Some(limit) = s.max_bytes else {
            continue;
        };
        let percent = s.bytes.saturating_mul(100) / limit.max(1);
        if percent < NEAR_LIMIT_PERCENT {
            continue;
        }
        let store = subjects
            .as_ref()
            .and_then(|subjects| wakebus::bus::Store::of_stream(subjects, &s.name));
        let at_limit = if store == Some(wakebus::bus::Store::DeadLetters) {
            "drops its oldest messages"
        } else {
            "refuses new messages"
        };
        let part = store.map_or("PART", wakebus::bus::Store::name);
        out.push_str(&format!(
            "{} holds {percent}% of its byte limit ({}): at the limit it {at_limit}; raise it with `wakebus init --max-bytes {part}=SIZE`.\n",
            s.name,
            bytesize::ByteSize(limit)
        ));
    }
    out
}

/// The snapshot as text; `only` is the session `--session` asked about.
fn render(report: &StatusReport, only: Option<&str>) -> String {
    let mut out = format!(
        "wakebus deployment {:?} at {}\n\nStreams\n",
        report.prefix,
        rfc3339(report.taken_at)
    );
    let mut streams = table(&[
        "STREAM", "MESSAGES", "BYTES", "LIMIT", "FIRST", "LAST", "REPLICAS",
    ]);
    for s in &report.streams {
        match (s.present, &s.error) {
            (Some(true), _) => {
                streams.add_row(vec![
                    s.name.clone(),
                    s.messages.to_string(),
                    s.bytes.to_string(),
                    s.max_bytes
                        .map_or_else(|| "-".to_owned(), |limit| limit.to_string()),
                    time(s.first_time),
                    time(s.last_time),
                    replicas(s.replicas, s.cluster.as_ref()),
                ]);
            }
            (Some(false), _) => {
                streams.add_row(vec![s.name.clone(), "missing".to_owned()]);
            }
            (None, error) => {
                let error = error.as_deref().unwrap_or("unknown error");
                streams.add_row(vec![s.name.clone(), format!("not read ({error})")]);
            }
        }
    }
    out.push_str(&format!("{streams}\n"));
    // A stream read whose consumers were not: its row stands, the consumer
    // table below lacks them.
    for s in report.streams.iter().filter(|s| s.present == Some(true)) {
        if let Some(error) = &s.error {
            out.push_str(&format!("Not read: {error}.\n"));
        }
    }
    out.push_str(&near_byte_limits(report));
    let unsettled: Vec<&str> = report
        .streams
        .iter()
        .filter(|s| s.cluster.as_ref().is_some_and(|c| !c.healthy()))
        .map(|s| s.name.as_str())
        .collect();
    if !unsettled.is_empty() {
        out.push_str(&format!(
            "Not every replica is current on {}: restart no other NATS node before they are.\n",
            unsettled.join(", ")
        ));
    }
    out.push_str("\nConsumers\n");
    let mut consumers = table(&[
        "STREAM",
        "CONSUMER",
        "PENDING",
        "ACK PENDING",
        "REDELIVERED",
        "WAITING PULLS",
    ]);
    for c in &report.consumers {
        consumers.add_row(vec![
            c.stream.clone(),
            c.name.clone(),
            c.pending.to_string(),
            c.ack_pending.to_string(),
            c.redelivered.to_string(),
            c.waiting_pulls.to_string(),
        ]);
    }
    out.push_str(&format!("{consumers}\n\n"));
    let d = &report.dead_letters;
    let pools: Vec<String> = d.tasks.iter().map(|(p, n)| format!("{p}: {n}")).collect();
    match &d.error {
        Some(error) => out.push_str(&format!("Dead letters: not read ({error})\n")),
        None => out.push_str(&format!(
            "Dead letters: {} (tasks: {}; wakes: {}; poison: {})\n",
            d.total,
            if pools.is_empty() {
                "0".to_owned()
            } else {
                pools.join(", ")
            },
            d.wakes,
            d.poison
        )),
    }
    let q = &report.queued;
    match &q.error {
        Some(error) => out.push_str(&format!("Queued tasks: not read ({error})\n")),
        None => {
            let pools: Vec<String> = q.pools.iter().map(|(p, n)| format!("{p}: {n}")).collect();
            out.push_str(&format!(
                "Queued tasks: {}{}\n",
                q.total,
                if pools.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", pools.join(", "))
                }
            ));
            for pool in &q.without_consumer {
                out.push_str(&format!(
                    "No consumer for pool {pool}: its requests wait until a worker of that pool starts (or `wakebus init --pool {pool}`); a mistyped --pool?\n"
                ));
            }
            let unserved: Vec<&String> = q
                .without_worker
                .iter()
                .filter(|pool| !q.without_consumer.contains(pool))
                .collect();
            for pool in unserved {
                out.push_str(&format!("No live worker found for pool {pool}.\n"));
            }
        }
    }
    out.push_str("\nLive instances\n");
    let mut services = table(&[
        "KIND",
        "INSTANCE",
        "POOL",
        "CONCURRENCY",
        "IN FLIGHT",
        "VERSION",
    ]);
    for s in &report.services {
        let snap = &s.snapshot;
        services.add_row(vec![
            snap.kind.clone(),
            snap.instance.clone(),
            snap.pool.clone().unwrap_or_else(|| "-".to_owned()),
            snap.concurrency
                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            snap.in_flight.to_string(),
            snap.version.clone(),
        ]);
    }
    out.push_str(&format!("{services}\n"));
    if !report.services.iter().any(|s| s.snapshot.kind == "wake") {
        out.push_str(
            "No live wake instance found: completions are not posted to their sessions until one starts.\n",
        );
    }
    out.push('\n');
    let scan = &report.undelivered_scan;
    if let Some(error) = &scan.error {
        out.push_str(&format!(
            "Oldest undelivered wakes: not read ({error}); the sections above stand.\n"
        ));
        return out;
    }
    out.push_str(&format!(
        "Oldest undelivered wakes (scanned {} completions from seq {}{})\n",
        scan.scanned,
        scan.from_seq,
        if scan.complete { "" } else { ", limit reached" }
    ));
    if scan.no_wake_consumer {
        out.push_str("The events stream has no wake consumer, so no acknowledgement floor: the scan started at the beginning of the history.\n");
    }
    // What the scan met that does not wait for a wake, and what it could
    // not judge.
    let mut notes = Vec::new();
    if scan.refused > 0 {
        notes.push(format!(
            "{} dead-lettered by the wake (see `wakebus events --dead-letters wake`)",
            scan.refused
        ));
    }
    if scan.unusable > 0 {
        notes.push(format!(
            "{} unusable (dead-lettered as poison)",
            scan.unusable
        ));
    }
    if scan.batch_waiting > 0 {
        notes.push(format!(
            "{} batch members waiting for their batch's other tasks",
            scan.batch_waiting
        ));
    }
    if !notes.is_empty() {
        out.push_str(&format!("Not waiting: {}.\n", notes.join("; ")));
    }
    if scan.unreadable_entries > 0 {
        out.push_str(&format!(
            "Listed as waiting: {} completions whose ledger entry does not parse.\n",
            scan.unreadable_entries
        ));
    }
    if let Some(error) = &scan.refused_error {
        out.push_str(&format!(
            "The wake dead letters were not read ({error}): completions the wake refused are listed as waiting.\n"
        ));
    }
    if scan.inconclusive() {
        out.push_str(&format!(
            "none in the {} completions scanned, but the scan stopped at its limit: completions after them may wait (raise --scan-limit).\n",
            scan.scanned
        ));
    } else if let (Some(session), true) = (only, report.oldest_undelivered.is_empty()) {
        let scanned = if scan.complete {
            String::new()
        } else {
            format!(
                " in the {} completions scanned (raise --scan-limit to look further)",
                scan.scanned
            )
        };
        out.push_str(&format!("none for session {session:?}{scanned}.\n"));
    } else if report.oldest_undelivered.is_empty() {
        out.push_str("none\n");
    } else {
        // Beyond the limit, more sessions and completions may wait.
        let at_least = if scan.complete { "" } else { "at least " };
        if only.is_none()
            && (scan.sessions > report.oldest_undelivered.len() as u64 || !scan.complete)
        {
            out.push_str(&format!(
                "Showing the oldest {} of {at_least}{} sessions ({at_least}{} completions waiting in all).\n",
                report.oldest_undelivered.len(),
                scan.sessions,
                scan.completions
            ));
        }
        let mut waiting = table(&["SESSION", "COMPLETIONS", "OLDEST", "AGE", "DELEGATION"]);
        for w in &report.oldest_undelivered {
            waiting.add_row(vec![
                w.session.clone(),
                w.completions.to_string(),
                rfc3339(w.oldest),
                humantime::format_duration(Duration::from_secs(w.age_seconds as u64)).to_string(),
                w.oldest_delegation_id.clone(),
            ]);
        }
        out.push_str(&format!("{waiting}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use wakebus::status::{
        DeadLetterCounts, QueuedTasks, ScanInfo, StreamStatus, UndeliveredSession,
    };

    fn follower(name: &str, current: bool, offline: bool, lag: Option<u64>) -> Follower {
        Follower {
            name: name.to_owned(),
            current,
            offline,
            lag,
        }
    }

    #[test]
    fn the_replicas_column_names_the_leader_and_only_the_followers_that_are_not_current() {
        assert_eq!(replicas(1, None), "1");
        let set = |leader: Option<&str>, followers| ReplicaSet {
            leader: leader.map(str::to_owned),
            followers,
        };
        let all_current = set(
            Some("n1"),
            vec![
                follower("n2", true, false, Some(0)),
                follower("n3", true, false, None),
            ],
        );
        assert_eq!(replicas(3, Some(&all_current)), "3, leader n1");
        assert!(all_current.healthy());
        let troubled = set(
            None,
            vec![
                follower("n1", false, true, Some(7)),
                follower("n2", false, false, Some(120)),
                follower("n3", false, false, None),
            ],
        );
        assert_eq!(
            replicas(3, Some(&troubled)),
            "3, NO LEADER, n1 offline, n2 120 behind, n3 not current"
        );
        assert!(!troubled.healthy());
        assert!(!set(None, Vec::new()).healthy(), "no leader, no writes");
    }

    fn stream(name: &str, present: Option<bool>, error: Option<&str>) -> StreamStatus {
        StreamStatus {
            name: name.to_owned(),
            present,
            error: error.map(str::to_owned),
            messages: 7,
            bytes: 70,
            max_bytes: None,
            first_time: None,
            last_time: None,
            first_seq: 1,
            last_seq: 7,
            consumer_count: 1,
            replicas: 1,
            cluster: None,
        }
    }

    #[test]
    fn a_stream_near_its_byte_limit_is_named_with_the_part_to_raise() {
        // With times, so that no other column shows `-`.
        let limited = |name: &str, bytes: u64, max_bytes: Option<u64>| StreamStatus {
            bytes,
            max_bytes,
            first_time: Some(time::OffsetDateTime::UNIX_EPOCH),
            last_time: Some(time::OffsetDateTime::UNIX_EPOCH),
            ..stream(name, Some(true), None)
        };
        let report = StatusReport {
            prefix: "P".to_owned(),
            taken_at: time::OffsetDateTime::UNIX_EPOCH,
            streams: vec![
                limited("P_TASKS", 89 << 20, Some(100 << 20)),
                limited("P_EVENTS", 95 << 20, Some(100 << 20)),
                limited("P_DLQ", 1 << 20, Some(1 << 20)),
                limited("KV_P_WAKES", 1 << 30, None),
            ],
            consumers: Vec::new(),
            dead_letters: DeadLetterCounts::default(),
            queued: QueuedTasks::default(),
            services: Vec::new(),
            oldest_undelivered: Vec::new(),
            undelivered_scan: ScanInfo::default(),
        };
        let text = render(&report, None);
        // STREAM, MESSAGES, BYTES, LIMIT, ...
        let limit = |name: &str| {
            let row = text.lines().find(|l| l.contains(name)).unwrap();
            row.split_whitespace()
                .filter(|cell| *cell != "│")
                .nth(3)
                .unwrap()
                .to_owned()
        };
        assert_eq!(limit("P_EVENTS"), (100u64 << 20).to_string(), "{text}");
        assert_eq!(limit("KV_P_WAKES"), "-", "{text}");
        let near: Vec<&str> = text.lines().filter(|l| l.contains("byte limit")).collect();
        assert_eq!(
            near,
            [
                "P_EVENTS holds 95% of its byte limit (100.0 MiB): at the limit it refuses new messages; raise it with `wakebus init --max-bytes events=SIZE`.",
                "P_DLQ holds 100% of its byte limit (1.0 MiB): at the limit it drops its oldest messages; raise it with `wakebus init --max-bytes dead-letters=SIZE`.",
            ],
            "{text}"
        );
    }

    #[test]
    fn what_could_not_be_read_is_named_and_never_shown_as_missing_or_empty() {
        let report = StatusReport {
            prefix: "P".to_owned(),
            taken_at: time::OffsetDateTime::UNIX_EPOCH,
            streams: vec![
                stream("P_TASKS", Some(true), None),
                stream("P_EVENTS", None, Some("cannot read P_EVENTS: timed out")),
                stream("P_DLQ", Some(false), None),
                stream(
                    "KV_P_WAKES",
                    Some(true),
                    Some("cannot read consumers of KV_P_WAKES: timed out"),
                ),
            ],
            consumers: Vec::new(),
            dead_letters: DeadLetterCounts {
                error: Some("cannot read P_DLQ: refused".to_owned()),
                ..DeadLetterCounts::default()
            },
            queued: QueuedTasks {
                error: Some("cannot read subjects of P_TASKS: timed out".to_owned()),
                ..QueuedTasks::default()
            },
            services: Vec::new(),
            oldest_undelivered: Vec::new(),
            undelivered_scan: ScanInfo::default(),
        };
        let text = render(&report, None);
        let row = |name: &str| text.lines().find(|l| l.contains(name)).unwrap().to_owned();
        assert!(row("P_TASKS").contains('7'), "{text}");
        assert!(
            row("P_EVENTS").contains("not read (cannot read P_EVENTS: timed out)"),
            "{text}"
        );
        assert!(row("P_DLQ ").contains("missing"), "{text}");
        assert!(row("KV_P_WAKES").contains('7'), "{text}");
        assert!(
            text.contains("Not read: cannot read consumers of KV_P_WAKES: timed out."),
            "{text}"
        );
        assert!(
            text.contains("Dead letters: not read (cannot read P_DLQ: refused)"),
            "{text}"
        );
        assert!(
            text.contains("Queued tasks: not read (cannot read subjects of P_TASKS: timed out)"),
            "{text}"
        );
    }

    /// A list cut to the oldest sessions says so, with the totals, so
    /// that nobody reads it as every session waiting.
    #[test]
    fn a_shortened_undelivered_list_says_how_many_sessions_wait_in_all() {
        let waiting = |n: usize| UndeliveredSession {
            session: format!("s.{n}"),
            session_token: "t".to_owned(),
            completions: 2,
            oldest: time::OffsetDateTime::UNIX_EPOCH,
            age_seconds: 60.0,
            oldest_delegation_id: "D".to_owned(),
        };
        let report = StatusReport {
            prefix: "P".to_owned(),
            taken_at: time::OffsetDateTime::UNIX_EPOCH,
            streams: Vec::new(),
            consumers: Vec::new(),
            dead_letters: DeadLetterCounts::default(),
            queued: QueuedTasks::default(),
            services: Vec::new(),
            oldest_undelivered: (0..10).map(waiting).collect(),
            undelivered_scan: ScanInfo {
                scanned: 40,
                complete: true,
                sessions: 12,
                completions: 24,
                refused: 3,
                unreadable_entries: 1,
                ..ScanInfo::default()
            },
        };
        let text = render(&report, None);
        assert!(
            text.contains("Showing the oldest 10 of 12 sessions (24 completions waiting in all)."),
            "{text}"
        );
        assert!(
            text.contains("Not waiting: 3 dead-lettered by the wake"),
            "{text}"
        );
        assert!(
            text.contains("Listed as waiting: 1 completions whose ledger entry does not parse."),
            "{text}"
        );
    }
}
