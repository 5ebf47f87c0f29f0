//! The text of a continuation turn.

use std::fmt::Write;

use crate::protocol::CompletionEvent;

/// Renders the user message that wakes a session for `completions`.
///
/// One completion gives `[ASYNC DELEGATION COMPLETE — <id>]`; several that
/// arrived together give `[N background delegations completed]` followed by
/// each one in the single form.
pub fn render(completions: &[&CompletionEvent]) -> String {
    let mut text = String::new();
    if let [only] = completions {
        write_one(&mut text, only);
        return text;
    }
    let _ = writeln!(
        text,
        "[{} background delegations completed]",
        completions.len()
    );
    for completion in completions {
        text.push('\n');
        write_one(&mut text, completion);
    }
    text
}

/// Renders the one turn that reports a whole batch, `completions` ordered
/// by task index.
pub fn render_batch(delegation_id: &str, completions: &[CompletionEvent]) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "[ASYNC DELEGATION BATCH COMPLETE — {delegation_id}]");
    let completed = completions
        .iter()
        .filter(|c| c.status == crate::protocol::Status::Completed)
        .count();
    let _ = writeln!(
        text,
        "{} tasks: {completed} completed, {} not completed",
        completions.len(),
        completions.len() - completed
    );
    for c in completions {
        let _ = writeln!(text, "\nTask {}: {}", c.task_index, c.status);
        let _ = writeln!(text, "Goal: {}", c.goal);
        if let Some(summary) = c.summary.as_deref().filter(|s| !s.is_empty()) {
            let _ = writeln!(text, "Result:\n{summary}");
        }
        if let Some(error) = c.error.as_deref().filter(|s| !s.is_empty()) {
            let _ = writeln!(text, "Error: {error}");
        }
    }
    text
}

/// Renders the early notice for a batch task that failed while its
/// siblings still run.
pub fn render_early_failure(c: &CompletionEvent) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "[ASYNC DELEGATION TASK FAILED EARLY — {}]",
        c.delegation_id
    );
    let _ = writeln!(
        text,
        "Task {} of {} ended {} while the others still run; the whole batch is reported when every task has ended.",
        c.task_index, c.task_count, c.status
    );
    let _ = writeln!(text, "Goal: {}", c.goal);
    if let Some(error) = c.error.as_deref().filter(|s| !s.is_empty()) {
        let _ = writeln!(text, "Error: {error}");
    }
    text
}

fn write_one(text: &mut String, c: &CompletionEvent) {
    let _ = writeln!(text, "[ASYNC DELEGATION COMPLETE — {}]", c.delegation_id);
    if c.task_index > 0 {
        let _ = writeln!(text, "Task: {}", c.task_index);
    }
    let _ = writeln!(text, "Goal: {}", c.goal);
    let _ = writeln!(text, "Status: {}", c.status);
    if let Some(summary) = c.summary.as_deref().filter(|s| !s.is_empty()) {
        let _ = writeln!(text, "Result:\n{summary}");
    }
    if let Some(error) = c.error.as_deref().filter(|s| !s.is_empty()) {
        let _ = writeln!(text, "Error: {error}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Status, TaskRequest};

    fn completion(id: &str, status: Status) -> CompletionEvent {
        let req = TaskRequest::decode(
            format!(r#"{{"version":1,"delegation_id":"{id}","goal":"find x"}}"#).as_bytes(),
        )
        .unwrap();
        let mut c = CompletionEvent::for_request(&req, status, "completed");
        c.summary = Some("x is 4".into());
        c
    }

    #[test]
    fn a_single_completion_names_its_delegation_goal_status_and_result() {
        let c = completion("d1", Status::Completed);
        let text = render(&[&c]);
        assert!(
            text.starts_with("[ASYNC DELEGATION COMPLETE — d1]\n"),
            "{text}"
        );
        assert!(
            text.contains("Goal: find x\nStatus: completed\nResult:\nx is 4"),
            "{text}"
        );
    }

    #[test]
    fn several_completions_are_listed_under_one_header() {
        let (a, b) = (
            completion("d1", Status::Completed),
            completion("d2", Status::Failed),
        );
        let text = render(&[&a, &b]);
        assert!(
            text.starts_with("[2 background delegations completed]\n"),
            "{text}"
        );
        assert!(text.contains("COMPLETE — d1]") && text.contains("COMPLETE — d2]"));
    }
}
