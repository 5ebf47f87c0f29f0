//! Executors run one task and say how it ended.
//!
//! A closed enum rather than a trait object: dispatch is a `match`, with no
//! boxing on the hot path.

mod command;
mod echo;
mod llm;

pub use command::{CommandConfig, CommandConfigError, CommandExecutor, kill_running_programs};
pub use echo::EchoExecutor;
pub use llm::{LlmConfig, LlmConfigError, LlmExecutor};

use tokio_util::sync::CancellationToken;

use crate::protocol::{Status, TaskRequest};

/// How a run ended, as far as the executor can tell.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutput {
    /// `completed` or `failed` (timeouts and interruptions are decided by the caller).
    pub status: Status,
    /// The result text.
    pub summary: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// Model calls made.
    pub api_calls: u64,
    /// Prompt and completion tokens used, when known.
    pub tokens: Option<(u64, u64)>,
    /// Whether output beyond the cap was dropped.
    pub truncated: bool,
    /// Machine-readable end reason.
    pub exit_reason: String,
}

/// Why a run produced no usable outcome.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// Worth retrying later: the executor could not start, an endpoint was down...
    #[error("transient executor failure: {reason}")]
    Transient {
        /// What went wrong.
        reason: String,
        /// How long the endpoint asked to be left alone (its
        /// `Retry-After`): the retry waits at least that long, so that a
        /// rate limit is not hit again on every try until the task's
        /// deliveries run out.
        retry_after: Option<std::time::Duration>,
        /// Whether the failure is this worker's, not the task's (the
        /// endpoint refused its credentials): another worker may run the
        /// task, and this one takes no task for a while.
        this_worker: bool,
    },
    /// The run was stopped through its cancellation token; whatever it had
    /// produced and used so far is kept.
    #[error("run stopped")]
    Stopped {
        /// Partial output.
        partial: Option<String>,
        /// Model calls made, the one cut short included.
        api_calls: u64,
        /// Prompt and completion tokens of the calls that answered.
        tokens: Option<(u64, u64)>,
        /// Whether the partial output was cut at the executor's cap (it
        /// then ends with `[output truncated]`).
        truncated: bool,
    },
}

impl ExecError {
    /// A transient failure that asked for no particular delay.
    pub fn transient(reason: impl Into<String>) -> Self {
        Self::Transient {
            reason: reason.into(),
            retry_after: None,
            this_worker: false,
        }
    }

    /// A failure of this worker rather than of the task (its credentials
    /// refused): the task goes back for another worker to run.
    pub fn this_worker(reason: impl Into<String>) -> Self {
        Self::Transient {
            reason: reason.into(),
            retry_after: None,
            this_worker: true,
        }
    }
}

/// Where a run reports progress. Latest wins: the worker publishes at most
/// one `progress` event per interval, with the newest message.
#[derive(Debug, Clone)]
pub struct Progress {
    /// The newest message.
    latest: tokio::sync::watch::Sender<Option<String>>,
}

impl Progress {
    /// A sink and the receiver the worker watches.
    pub fn channel() -> (Self, tokio::sync::watch::Receiver<Option<String>>) {
        let (latest, rx) = tokio::sync::watch::channel(None);
        (Self { latest }, rx)
    }

    /// Reports a progress message.
    pub fn report(&self, message: impl Into<String>) {
        self.latest.send_replace(Some(message.into()));
    }
}

/// Facts about the worker a run may pass on (to a child process, say).
#[derive(Debug, Clone, Default)]
pub struct TaskEnv {
    /// The NATS URL the worker uses, so a subagent can delegate in turn.
    pub nats_url: String,
    /// The deployment's subject prefix.
    pub prefix: String,
    /// The worker's pool.
    pub pool: String,
}

/// The executors a worker can run.
#[derive(Debug, Clone)]
pub enum Executor {
    /// Completes at once with the goal echoed (demos, benchmarks).
    Echo(EchoExecutor),
    /// Runs a program per task.
    Command(CommandExecutor),
    /// Asks an OpenAI-compatible chat-completions endpoint.
    Llm(LlmExecutor),
}

impl Executor {
    /// Runs `request` until it ends or `stop` is cancelled.
    pub async fn run(
        &self,
        request: &TaskRequest,
        env: &TaskEnv,
        stop: &CancellationToken,
        progress: &Progress,
    ) -> Result<ExecOutput, ExecError> {
        // The command and llm runs are boxed: their futures are tens of KiB
        // (pipes, an HTTP client call) and would otherwise make every task's
        // future that large, echo's included, to be copied at each spawn.
        // A process or a model call costs far more than the allocation.
        match self {
            Self::Echo(echo) => Ok(echo.run(request)),
            Self::Command(command) => Box::pin(command.run(request, env, stop, progress)).await,
            Self::Llm(llm) => Box::pin(llm.run(request, stop, progress)).await,
        }
    }

    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Echo(_) => "echo",
            Self::Command(_) => "command",
            Self::Llm(_) => "llm",
        }
    }
}
