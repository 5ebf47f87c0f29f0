//! The history filters shared by `events` and `replay`.

use clap::{Args, ValueEnum};
use time::OffsetDateTime;
use wakebus::history::{Selection, Source, parse_time_bound};
use wakebus::protocol::{EventKind, Status};

/// Which records to read.
#[derive(Debug, Args)]
pub(crate) struct FilterArgs {
    /// Only this origin session: the raw id, dots, spaces and wildcards
    /// included (the subject token is derived from it).
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Only this delegation.
    #[arg(long)]
    pub(crate) delegation: Option<String>,
    /// Only events of this kind (not with dead letters; `replay wakes`
    /// always takes `done`, `replay tasks` refuses it).
    #[arg(long, value_enum)]
    pub(crate) kind: Option<KindArg>,
    /// Only completions with this status (not with task dead letters;
    /// `replay tasks` refuses it).
    #[arg(long, value_enum)]
    pub(crate) status: Option<StatusArg>,
    /// Only task dead letters of this pool (with `--dead-letters` or
    /// `replay tasks` only).
    #[arg(long)]
    pub(crate) pool: Option<String>,
    /// From this time on: a duration back from now (90s, 2h, 3d) or an RFC 3339 time.
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// Up to this time: a duration back from now or an RFC 3339 time.
    #[arg(long)]
    pub(crate) until: Option<String>,
    /// From this stream sequence on.
    #[arg(long)]
    pub(crate) from_seq: Option<u64>,
    /// Up to this stream sequence.
    #[arg(long)]
    pub(crate) to_seq: Option<u64>,
}

/// Event kinds.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum KindArg {
    /// The delegator recorded the task before publishing it.
    Submitted,
    /// A worker started the task.
    Started,
    /// The running task reported progress.
    Progress,
    /// The task ended.
    Done,
}

/// Completion statuses.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StatusArg {
    /// Finished its work.
    Completed,
    /// Ran and failed.
    Failed,
    /// Cancelled while running.
    Interrupted,
    /// Ran out of time.
    Timeout,
    /// The request was unusable.
    Error,
}

/// Which dead letters.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum DeadLetterArg {
    /// Both kinds.
    All,
    /// Task requests workers gave up on.
    Task,
    /// Completions that could not be woken.
    Wake,
}

impl DeadLetterArg {
    /// The history source.
    pub(crate) fn source(self) -> Source {
        match self {
            Self::All => Source::DeadLetters,
            Self::Task => Source::TaskDeadLetters,
            Self::Wake => Source::WakeDeadLetters,
        }
    }
}

impl FilterArgs {
    /// The library selection; bad time bounds are reported by name.
    pub(crate) fn selection(&self) -> anyhow::Result<Selection> {
        let now = OffsetDateTime::now_utc();
        let bound = |value: &Option<String>, flag: &str| {
            value
                .as_deref()
                .map(|v| parse_time_bound(v, now))
                .transpose()
                .map_err(|err| anyhow::anyhow!("{flag}: {err}"))
        };
        Ok(Selection {
            session: self.session.clone(),
            delegation: self.delegation.clone(),
            kind: self.kind.map(|kind| match kind {
                KindArg::Submitted => EventKind::Submitted,
                KindArg::Started => EventKind::Started,
                KindArg::Progress => EventKind::Progress,
                KindArg::Done => EventKind::Done,
            }),
            status: self.status.map(|status| match status {
                StatusArg::Completed => Status::Completed,
                StatusArg::Failed => Status::Failed,
                StatusArg::Interrupted => Status::Interrupted,
                StatusArg::Timeout => Status::Timeout,
                StatusArg::Error => Status::Error,
            }),
            pool: self.pool.clone(),
            since: bound(&self.since, "--since")?,
            until: bound(&self.until, "--until")?,
            from_seq: self.from_seq,
            to_seq: self.to_seq,
        })
    }
}
