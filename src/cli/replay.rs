//! `wakebus replay`: re-drive wakes, re-queue dead-lettered tasks, or copy
//! history elsewhere; with progress on a terminal and a clean stop on Ctrl-C.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;
use wakebus::protocol::Subjects;
use wakebus::replay::{
    self, Action, CopyTarget, Progress, ReplayItem, ReplayKind, ReplayPlan, Replayer, Summary,
    TaskOptions,
};

use super::args::Global;
use super::filters::{DeadLetterArg, FilterArgs};

/// `wakebus replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// What to replay.
    #[command(subcommand)]
    pub(crate) what: ReplayCommand,
}

/// Replay subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum ReplayCommand {
    /// Wake sessions again for selected completions, through the running
    /// wake service; completions already delivered are skipped unless --force.
    Wakes(WakesArgs),
    /// Re-queue dead-lettered task requests (each under a derived delegation
    /// id, <id>-rt<task index>); ones already re-queued are skipped unless --force.
    Tasks(TasksArgs),
    /// Re-publish a range of history under another prefix or to one subject,
    /// headers preserved and marked with Wakebus-Replay.
    Copy(CopyArgs),
}

/// Options every replay takes.
#[derive(Debug, Args)]
pub(crate) struct CommonArgs {
    /// Which records.
    #[command(flatten)]
    pub(crate) filters: FilterArgs,
    /// Only list what would be done.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// JSON lines even on a terminal.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `wakebus replay wakes`.
#[derive(Debug, Args)]
pub(crate) struct WakesArgs {
    /// Filters and output.
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Read the wake dead letters (completions the session API refused)
    /// instead of the completions in the event history.
    #[arg(long)]
    pub(crate) dead_letters: bool,
    /// Wake even for completions already delivered: the post carries a new
    /// Idempotency-Key, <usual key>.replay.<ULID>, recorded in the wake
    /// ledger in place of the entry before the copy is published, so that
    /// the session API does not drop it as a repeat.
    #[arg(long)]
    pub(crate) force: bool,
}

/// `wakebus replay tasks`.
#[derive(Debug, Args)]
pub(crate) struct TasksArgs {
    /// Filters and output.
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Re-queue even requests already re-queued (under a new ULID delegation
    /// id, as the derived one is taken), or older than the traces of an
    /// earlier re-queue.
    #[arg(long)]
    pub(crate) force: bool,
    /// Re-queue requests whose delegation or session was cancelled too, and
    /// those whose cancel records cannot be read (`--force` does not).
    #[arg(long)]
    pub(crate) include_cancelled: bool,
    /// Re-queue sync-mode requests (no origin session) too: their caller
    /// had the failure, and the re-run's result wakes nobody.
    #[arg(long)]
    pub(crate) include_sync: bool,
    /// Re-queue once more the requests that an earlier replay re-queued
    /// and that failed again (without it, running the same replay again
    /// leaves them alone, so that a task that keeps failing is not run
    /// once more at every run; `--force` does not re-queue them).
    #[arg(long)]
    pub(crate) include_requeued: bool,
    /// The size limits a request must meet to be re-queued: give the
    /// workers' (the same variables set them).
    #[command(flatten)]
    pub(crate) limits: super::args::LimitArgs,
}

/// `wakebus replay copy`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to_prefix", "to_subject"])))]
pub(crate) struct CopyArgs {
    /// Filters and output.
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Copy dead letters instead of events (all, or only task or wake ones).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "all")]
    pub(crate) dead_letters: Option<DeadLetterArg>,
    /// Publish each message on the same subject under this prefix.
    #[arg(long)]
    pub(crate) to_prefix: Option<String>,
    /// Publish every message on this one subject.
    #[arg(long)]
    pub(crate) to_subject: Option<String>,
}

/// The exit status of a replay that left records alone because it could
/// not check them (as `status --strict` for a partial snapshot).
const UNCHECKED: u8 = 3;

pub(crate) async fn run(global: &Global, args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let mut limits = wakebus::protocol::Limits::default();
    let (kind, common, force, tasks) = match args.what {
        ReplayCommand::Wakes(a) => (
            if a.dead_letters {
                ReplayKind::WakeDeadLetters
            } else {
                ReplayKind::Wakes
            },
            a.common,
            a.force,
            TaskOptions::default(),
        ),
        ReplayCommand::Tasks(a) => {
            limits = a.limits.limits();
            let tasks = TaskOptions {
                include_cancelled: a.include_cancelled,
                include_sync: a.include_sync,
                include_requeued: a.include_requeued,
            };
            (ReplayKind::Tasks, a.common, a.force, tasks)
        }
        ReplayCommand::Copy(a) => {
            let target = match (a.to_prefix, a.to_subject) {
                (Some(prefix), _) => CopyTarget::Prefix(Subjects::new(&prefix)?),
                (None, Some(subject)) => {
                    if subject.is_empty()
                        || subject.contains(|c: char| {
                            matches!(c, '*' | '>') || c.is_whitespace() || c.is_control()
                        })
                        || subject.split('.').any(str::is_empty)
                    {
                        bail!("--to-subject {subject:?} is not a valid subject to publish to");
                    }
                    CopyTarget::Subject(subject)
                }
                (None, None) => bail!("give --to-prefix or --to-subject"),
            };
            let source = a
                .dead_letters
                .map_or(wakebus::history::Source::Events, DeadLetterArg::source);
            (
                ReplayKind::Copy { source, target },
                a.common,
                false,
                TaskOptions::default(),
            )
        }
    };
    let plan = ReplayPlan {
        kind,
        selection: common.filters.selection()?,
        force,
        tasks,
        dry_run: common.dry_run,
    };
    // Before connecting: a bad filter is reported at once, NATS away or not.
    plan.check(&Subjects::new(&global.prefix)?)?;
    let bus = super::commands::connect_within(global, "wakebus-replay", std::time::Duration::ZERO)
        .await?;
    let replayer = Replayer::new(bus, plan).await?.with_limits(limits);

    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        // The record in hand is finished, then the run stops.
        on_signal.cancel();
        super::second_interrupt().await;
        // A second Ctrl-C: the operator will not wait (NATS unreachable?).
        eprintln!("Interrupted again: exiting now; the last record may not have been handled.");
        std::process::exit(130);
    });
    let json = common.json || !std::io::stdout().is_terminal();
    let bar = ProgressBar::hidden();
    let show = |total: u64, template: &str| {
        if std::io::stderr().is_terminal() {
            bar.reset();
            bar.set_length(total);
            bar.set_style(
                ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.enable_steady_tick(Duration::from_millis(200));
        }
    };
    let summary = replay::run(replayer, cancel, |progress| match progress {
        Progress::Prereading { total } => show(
            total,
            "{spinner} {pos}/{len} wake dead letters read for turns given up after 409s, before any is forced  ETA {eta}  [{elapsed}]",
        ),
        Progress::Preread => bar.inc(1),
        Progress::Opened { total } => show(
            total,
            "{spinner} {pos}/{len} replayed or checked  {per_sec}  ETA {eta}  [{elapsed}]",
        ),
        Progress::Item(item) => {
            bar.inc(1);
            let line = if json {
                serde_json::to_string(item).unwrap_or_default()
            } else {
                describe(item)
            };
            // On stdout whatever the bar does (it draws on stderr):
            // `| jq` and `> file` get every item.
            bar.suspend(|| {
                let _ = writeln!(std::io::stdout().lock(), "{line}");
            });
        }
    })
    .await;
    bar.finish_and_clear();
    let summary = match summary {
        Ok(summary) => summary,
        Err(failed) => {
            // What was done before the error is reported all the same.
            print_summary(&failed.summary, json, Some(&failed.error));
            return Err(failed.error.into());
        }
    };
    print_summary(&summary, json, None);
    Ok(if summary.interrupted {
        ExitCode::from(130)
    } else if summary.unchecked > 0 {
        tracing::warn!(
            unchecked = summary.unchecked,
            "Some records could not be checked, or their copy not published; run the replay again for them, as each one's reason says (exit status 3)."
        );
        ExitCode::from(UNCHECKED)
    } else {
        ExitCode::SUCCESS
    })
}

fn describe(item: &ReplayItem) -> String {
    let what = format!(
        "{} {}/{}",
        item.source,
        item.delegation_id.as_deref().unwrap_or("?"),
        item.task_index.map(|i| i.to_string()).unwrap_or_default()
    );
    let target = item.target_subject.as_deref().unwrap_or("");
    let renamed = item
        .new_delegation_id
        .as_deref()
        .map(|id| format!(" as delegation {id}"))
        .unwrap_or_default();
    let cleared = match (&item.idempotency_key, item.ledger_cleared) {
        (Some(key), true) => {
            format!(" (ledger entry replaced; posted under Idempotency-Key {key})")
        }
        (Some(key), false) => format!(" (posted under Idempotency-Key {key})"),
        (None, true) => " (ledger entry replaced)".to_owned(),
        (None, false) => String::new(),
    };
    match item.action {
        Action::Replayed => format!("replayed     {what} -> {target}{renamed}{cleared}"),
        Action::WouldReplay => format!("would replay {what} -> {target}{renamed}{cleared}"),
        Action::Skipped => format!(
            "skipped      {what}: {}",
            item.reason.as_deref().unwrap_or("")
        ),
    }
}

/// The run's totals, last on stdout (JSON) or on stderr; with the error
/// that stopped it, if one did.
fn print_summary(summary: &Summary, json: bool, error: Option<&replay::ReplayError>) {
    if json {
        let mut line = serde_json::json!({ "summary": summary });
        if let Some(error) = error {
            line["error"] = serde_json::Value::from(error.to_string());
        }
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    } else {
        eprintln!(
            "{} selected: {} replayed, {} would be replayed, {} skipped ({} of them not checked){}",
            summary.selected,
            summary.replayed,
            summary.would_replay,
            summary.skipped,
            summary.unchecked,
            if summary.interrupted {
                " (interrupted)"
            } else if error.is_some() {
                " (stopped by an error)"
            } else {
                ""
            }
        );
    }
}
