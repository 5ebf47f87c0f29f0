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
/// by task index; `cut` when some of their results were cut to fit (see
/// [`result_share`]), which the turn then says.
pub fn render_batch(delegation_id: &str, completions: &[CompletionEvent], cut: bool) -> String {
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
    if cut {
        let _ = writeln!(
            text,
            "\nResults marked \"bytes cut\" were shortened to fit one turn; each is whole in the history: `wakebus events --delegation {delegation_id}`."
        );
    }
    text
}

/// The length at which results of `lengths` bytes are cut so that they
/// fit in `budget` bytes together: the longest at which they do, so that
/// none shorter is cut and the longer ones share what the shorter leave.
/// `None` when they fit whole.
pub fn result_share(lengths: &[usize], budget: usize) -> Option<usize> {
    let mut sorted = lengths.to_vec();
    sorted.sort_unstable();
    let mut left = budget;
    for (i, &length) in sorted.iter().enumerate() {
        let others = sorted.len() - i;
        if length.saturating_mul(others) > left {
            return Some(left / others);
        }
        left -= length;
    }
    None
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

    #[test]
    fn results_are_cut_at_one_length_that_spares_the_short_ones_and_fills_the_budget() {
        assert_eq!(result_share(&[10, 20], 30), None, "they fit");
        assert_eq!(result_share(&[], 0), None);
        // The short one whole; the long ones share the 900 it leaves.
        assert_eq!(result_share(&[600, 100, 600], 1000), Some(450));
        assert_eq!(result_share(&[5, 5, 5], 3), Some(1));
        assert_eq!(result_share(&[usize::MAX, 1], 10), Some(9));
    }

    #[test]
    fn a_batch_turn_with_cut_results_says_where_they_are_whole() {
        let c = completion("d1", Status::Completed);
        assert!(!render_batch("d1", std::slice::from_ref(&c), false).contains("bytes cut"));
        let text = render_batch("d1", &[c], true);
        assert!(text.contains("`wakebus events --delegation d1`"), "{text}");
    }
}
