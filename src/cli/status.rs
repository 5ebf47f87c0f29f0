//! `wakebus status`: one screen about a deployment, or `--json` for scripts.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use wakebus::history::rfc3339;
use wakebus::status::{StatusOptions, StatusReport, collect};

use super::args::Global;

/// `wakebus status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print the snapshot as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// How long to wait for live instances to answer.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub(crate) discovery_timeout: Duration,
    /// Most completions to examine when looking for undelivered wakes.
    #[arg(long, default_value_t = 5000)]
    pub(crate) scan_limit: u64,
}

pub(crate) async fn run(global: &Global, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let bus = super::commands::connect_within(global, "wakebus-status", std::time::Duration::ZERO)
        .await?;
    let options = StatusOptions {
        discovery_timeout: args.discovery_timeout,
        scan_limit: args.scan_limit,
        ..StatusOptions::default()
    };
    let report = collect(&bus, &options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
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

fn render(report: &StatusReport) -> String {
    let mut out = format!(
        "wakebus deployment {:?} at {}\n\nStreams\n",
        report.prefix,
        rfc3339(report.taken_at)
    );
    let mut streams = table(&["STREAM", "MESSAGES", "BYTES", "FIRST", "LAST"]);
    for s in &report.streams {
        if s.present {
            streams.add_row(vec![
                s.name.clone(),
                s.messages.to_string(),
                s.bytes.to_string(),
                time(s.first_time),
                time(s.last_time),
            ]);
        } else {
            streams.add_row(vec![s.name.clone(), "missing".to_owned()]);
        }
    }
    out.push_str(&format!("{streams}\n\nConsumers\n"));
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
    out.push_str(&format!(
        "Dead letters: {} (tasks: {}; wakes: {}; poison: {})\n\nLive instances\n",
        d.total,
        if pools.is_empty() {
            "0".to_owned()
        } else {
            pools.join(", ")
        },
        d.wakes,
        d.poison
    ));
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
    out.push_str(&format!("{services}\n\n"));
    let scan = &report.undelivered_scan;
    out.push_str(&format!(
        "Oldest undelivered wakes (scanned {} completions from seq {}{})\n",
        scan.scanned,
        scan.from_seq,
        if scan.complete { "" } else { ", limit reached" }
    ));
    if report.oldest_undelivered.is_empty() {
        out.push_str("none\n");
    } else {
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
