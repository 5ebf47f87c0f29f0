//! The `echo` executor: completes at once, for demos and benchmarks.

use super::ExecOutput;
use crate::protocol::{Status, TaskRequest};

/// Completes every task at once with a summary built from its goal.
#[derive(Debug, Clone, Copy, Default)]
pub struct EchoExecutor;

impl EchoExecutor {
    /// Runs one task.
    pub fn run(self, request: &TaskRequest) -> ExecOutput {
        ExecOutput {
            status: Status::Completed,
            summary: Some(format!("echo: {}", request.goal)),
            error: None,
            api_calls: 0,
            tokens: None,
            truncated: false,
            exit_reason: "completed".to_owned(),
        }
    }
}
