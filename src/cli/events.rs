//! `wakebus events`: the event history, filtered, as JSON lines for scripts
//! or a table on a terminal; `--follow` keeps streaming.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Args;
use time::macros::format_description;
use wakebus::history::{HistoryReader, Record, RecordKind, Source};

use super::args::Global;
use super::filters::{DeadLetterArg, FilterArgs};

/// `wakebus events`.
#[derive(Debug, Args)]
pub(crate) struct EventsArgs {
    /// Which events.
    #[command(flatten)]
    pub(crate) filters: FilterArgs,
    /// Read dead letters instead of events (all, or only task or wake ones).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "all")]
    pub(crate) dead_letters: Option<DeadLetterArg>,
    /// Keep streaming new events after the stored ones (Ctrl-C to stop).
    #[arg(long, short = 'f')]
    pub(crate) follow: bool,
    /// JSON lines even on a terminal.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) async fn run(global: &Global, args: EventsArgs) -> anyhow::Result<ExitCode> {
    let source = args
        .dead_letters
        .map_or(Source::Events, DeadLetterArg::source);
    // Before connecting: a bad filter is reported at once, NATS away or not.
    let selection = args.filters.selection()?;
    selection.validate(source)?;
    let bus = super::commands::connect_within(global, "wakebus-events", std::time::Duration::ZERO)
        .await?;
    let mut reader = HistoryReader::open(&bus, source, selection, args.follow).await?;
    let json = args.json || !std::io::stdout().is_terminal();
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    let mut ended = !json && write_line(&header()).is_err();
    while !ended {
        let next = tokio::select! {
            () = &mut shutdown => break,
            next = reader.next() => next,
        };
        let Some(record) = next else { break };
        let record = match record {
            Ok(record) => record,
            Err(error) => {
                reader.close().await;
                return Err(error.into());
            }
        };
        let line = if json {
            record.to_json().to_string()
        } else {
            row(&record)
        };
        // The reader went away (`| head`): not an error.
        ended = write_line(&line).is_err();
    }
    // Stopped by Ctrl-C or a closed pipe: delete the read's consumer now
    // rather than leave it to expire.
    reader.close().await;
    Ok(ExitCode::SUCCESS)
}

fn write_line(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// Each column but the last: the width it is padded to, and the most it
/// shows. What an operator copies into a filter (the sequence for
/// `--from-seq`, the delegation id, which may end `-rt17`, the task, the
/// session) is shown whole, pushing the row out rather than being cut.
const WIDTHS: [(usize, usize); 7] = [
    (7, 20),
    (23, 23),
    (9, 9),
    (30, 80),
    (4, 10),
    (22, 80),
    (11, 11),
];

fn header() -> String {
    columns(&[
        "SEQ",
        "TIME (UTC)",
        "KIND",
        "DELEGATION",
        "TASK",
        "SESSION",
        "STATUS",
        "DETAIL",
    ])
}

fn columns(cells: &[&str]) -> String {
    let mut line = String::new();
    for (cell, (width, most)) in cells.iter().zip(WIDTHS) {
        line.push_str(&format!("{:<width$} ", fit(cell, most)));
    }
    if let Some(last) = cells.get(WIDTHS.len()) {
        line.push_str(&fit(last, 80));
    }
    line.trim_end().to_owned()
}

/// Cuts `text` to `width` characters (first line only), marking the cut.
/// What a task program or a publisher wrote is shown, not obeyed: control
/// characters (an escape sequence, a carriage return that would make
/// `failed` read `completed`) and bidirectional overrides become `�`.
fn fit(text: &str, width: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    let shown = |c: char| match c {
        '\t' => ' ',
        c if c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') => {
            '\u{fffd}'
        }
        c => c,
    };
    if line.chars().count() <= width && !text.contains('\n') {
        return line.chars().map(shown).collect();
    }
    let kept: String = line
        .chars()
        .take(width.saturating_sub(1))
        .map(shown)
        .collect();
    format!("{kept}…")
}

fn row(record: &Record) -> String {
    let time = record
        .published
        .format(format_description!(
            "[year]-[month]-[day] [hour]:[minute]:[second].[subsecond digits:3]"
        ))
        .unwrap_or_default();
    let body: serde_json::Value = serde_json::from_slice(&record.payload).unwrap_or_default();
    let text = |field: &str| body.get(field).and_then(|v| v.as_str()).unwrap_or("");
    let (status, mut detail) = match record.kind() {
        RecordKind::Submitted => (
            format!(
                "task {}/{}",
                body["task_index"].as_u64().unwrap_or(0) + 1,
                body["task_count"].as_u64().unwrap_or(1)
            ),
            format!("pool {}", text("pool")),
        ),
        RecordKind::Started => (
            format!("attempt {}", body["attempt"].as_u64().unwrap_or(0)),
            text("worker").to_owned(),
        ),
        RecordKind::Progress => (String::new(), text("message").to_owned()),
        RecordKind::Done => (
            text("status").to_owned(),
            if text("error").is_empty() {
                text("summary").to_owned()
            } else {
                text("error").to_owned()
            },
        ),
        RecordKind::WakeDeadLetter => (
            text("status").to_owned(),
            record.dead_letter_reason().unwrap_or("").to_owned(),
        ),
        RecordKind::TaskDeadLetter => (
            record.pool().unwrap_or("").to_owned(),
            record.dead_letter_reason().unwrap_or("").to_owned(),
        ),
        RecordKind::Other => (String::new(), record.subject.clone()),
    };
    if let Some(original) = record.replay_of() {
        detail = format!("[replay of {original}] {detail}");
    }
    let session = record.session_label();
    columns(&[
        &record.sequence.to_string(),
        &time,
        record.kind().as_str(),
        &record.delegation_id().unwrap_or_default(),
        &record
            .task_index()
            .map(|i| i.to_string())
            .unwrap_or_default(),
        &session,
        &status,
        &detail,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A summary written by a task program is printed to an operator's
    /// terminal: its escape sequences and carriage returns are not obeyed.
    #[test]
    fn a_cell_shows_control_characters_instead_of_obeying_them() {
        let cell = fit("\x1b[2Jok\rcompleted\u{202e}x\tend", 80);
        assert_eq!(cell, "\u{fffd}[2Jok\u{fffd}completed\u{fffd}x end");
        assert!(!cell.chars().any(char::is_control), "{cell:?}");
        let cut = fit("\x1b]0;title\x07 and more", 6);
        assert_eq!(cut, "\u{fffd}]0;t…");
        assert_eq!(fit("plain", 10), "plain");
    }

    /// What an operator copies into `--from-seq` or `--delegation` is not
    /// cut: an eight-digit sequence, a derived id ending `-rt17` (cut, it
    /// would read as `-rt10`'s), a UUID session.
    #[test]
    fn a_row_shows_long_sequences_ids_and_sessions_whole() {
        let line = columns(&[
            "12345678",
            "2026-12-07 10:00:00.000",
            "done",
            "01JV3N4Y8K6D2Q7R9T1W5X0ZAB-rt17",
            "0",
            "8f14e45f-ceea-467f-a0e6-0d3c1c1b7f2a",
            "failed",
            "detail",
        ]);
        for whole in [
            "12345678",
            "01JV3N4Y8K6D2Q7R9T1W5X0ZAB-rt17",
            "8f14e45f-ceea-467f-a0e6-0d3c1c1b7f2a",
        ] {
            assert!(line.contains(whole), "{line}");
        }
        assert!(!line.contains('…'), "{line}");
    }
}
