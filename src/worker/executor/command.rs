//! The `command` executor: one process per task, request JSON on stdin.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{ExecError, ExecOutput, Progress, TaskEnv};
use crate::protocol::{Status, TaskRequest};

/// The process groups of the task programs running now in this process.
static RUNNING_GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Keeps a task program's process group in [`RUNNING_GROUPS`] while it runs.
struct RunningGroup(
    /// The process group's id (the program's pid, which leads it).
    i32,
);

impl RunningGroup {
    fn register(pid: u32) -> Option<Self> {
        let group = i32::try_from(pid).ok()?;
        RUNNING_GROUPS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(group);
        Some(Self(group))
    }
}

impl Drop for RunningGroup {
    fn drop(&mut self) {
        RUNNING_GROUPS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}

/// SIGKILLs the process group of every task program running now, for a
/// process about to exit without running destructors (which would stop
/// them otherwise): a program left running would go on after its task was
/// redelivered to another worker.
pub fn kill_running_programs() {
    let groups = RUNNING_GROUPS.lock().unwrap_or_else(|p| p.into_inner());
    for &group in groups.iter() {
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
    }
}

/// How to run the program.
#[derive(Debug, Clone)]
pub struct CommandConfig {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Working directory (the worker's when `None`).
    pub working_dir: Option<PathBuf>,
    /// How much stdout to keep; the rest is dropped and the result marked truncated.
    pub max_output_bytes: usize,
    /// How long a stopped process gets between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
}

/// Why a command executor could run no task at all.
#[derive(Debug, thiserror::Error)]
pub enum CommandConfigError {
    /// The program is not on `PATH`, not at its path, or not executable.
    #[error("cannot run the task program {program}: {reason}")]
    Program {
        /// The program as given.
        program: PathBuf,
        /// Why not.
        reason: String,
    },
    /// The working directory is missing or not a directory.
    #[error("the task working directory {dir} is not a directory")]
    WorkingDir {
        /// The directory as given.
        dir: PathBuf,
    },
}

impl CommandConfig {
    /// Checks that the program can be started (an executable file on
    /// `PATH` or at its path, a relative one from the working directory)
    /// and that the working directory exists: a worker
    /// deployed with a typo should refuse to start, not fail every task it
    /// takes while healthy workers could have run them.
    pub fn check(&self) -> Result<(), CommandConfigError> {
        if let Some(dir) = &self.working_dir
            && !dir.is_dir()
        {
            return Err(CommandConfigError::WorkingDir { dir: dir.clone() });
        }
        let refused = |reason: String| CommandConfigError::Program {
            program: self.program.clone(),
            reason,
        };
        let candidate = if self.program.components().count() > 1 {
            // A path: a relative one is run from the working directory.
            match &self.working_dir {
                Some(dir) if self.program.is_relative() => dir.join(&self.program),
                _ => self.program.clone(),
            }
        } else {
            // Without PATH, exec searches the default path.
            let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
            let cwd = self
                .working_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("."));
            which::which_in(&self.program, Some(path), cwd)
                .map_err(|_| refused("not found on PATH".to_owned()))?
        };
        // The mode says whether it is an executable file at all (access(2)
        // lets root pass a file with no execute bit, which exec refuses);
        // access(2) says whether this user may run it.
        use std::os::unix::fs::PermissionsExt;
        let reason = match std::fs::metadata(&candidate) {
            Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => {
                match nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK) {
                    Ok(()) => return Ok(()),
                    Err(errno) => format!("{}: {errno}", candidate.display()),
                }
            }
            Ok(_) => format!("{} is not an executable file", candidate.display()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                format!("{}: no such file", candidate.display())
            }
            Err(error) => format!("{}: {error}", candidate.display()),
        };
        Err(refused(reason))
    }

    /// Defaults for `program args...`.
    pub fn new(program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        Self {
            program: program.into(),
            args,
            working_dir: None,
            max_output_bytes: 1024 * 1024,
            kill_grace: Duration::from_secs(5),
        }
    }
}

/// Runs a program for each task.
#[derive(Debug, Clone)]
pub struct CommandExecutor {
    /// What to run.
    config: CommandConfig,
}

/// Largest goal or context also passed in the environment
/// (`WAKEBUS_GOAL`, `WAKEBUS_CONTEXT`).
const MAX_ENV_TEXT: usize = 64 * 1024;

/// Whether `text` can be passed in the environment: a string there is
/// limited (128 KiB on Linux) and cannot hold a NUL byte, and either would
/// make every start of the program fail. Such a text is on stdin only.
fn fits_env(text: &str) -> bool {
    text.len() <= MAX_ENV_TEXT && !text.contains('\0')
}

/// How much of stderr ends up in `error`.
const STDERR_TAIL_BYTES: usize = 4096;

/// What a program may print on stdout instead of plain text.
#[derive(Debug, Deserialize)]
struct StructuredOutput {
    /// The result.
    summary: Option<String>,
    /// `completed` or `failed`, overriding the exit code's verdict.
    status: Option<Status>,
    /// Error text.
    error: Option<String>,
    /// Model calls made.
    api_calls: Option<u64>,
}

impl StructuredOutput {
    /// Whether it has any of the fields a result report has.
    fn says_anything(&self) -> bool {
        self.summary.is_some()
            || self.status.is_some()
            || self.error.is_some()
            || self.api_calls.is_some()
    }
}

impl CommandExecutor {
    /// An executor running `config.program`.
    pub fn new(config: CommandConfig) -> Self {
        Self { config }
    }

    /// Runs one task until the process exits or `stop` is cancelled.
    pub async fn run(
        &self,
        request: &TaskRequest,
        env: &TaskEnv,
        stop: &CancellationToken,
        progress: &Progress,
    ) -> Result<ExecOutput, ExecError> {
        let cfg = &self.config;
        let mut command = Command::new(&cfg.program);
        command
            .args(&cfg.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .env("WAKEBUS_DELEGATION_ID", &request.delegation_id)
            .env("WAKEBUS_TASK_INDEX", request.task_index.to_string())
            .env("WAKEBUS_DEPTH", request.depth.to_string())
            .env("WAKEBUS_POOL", &env.pool)
            .env("NATS_URL", &env.nats_url)
            .env("WAKEBUS_PREFIX", &env.prefix);
        match &request.origin_session_id {
            Some(session) => command.env("WAKEBUS_ORIGIN_SESSION", session),
            None => command.env_remove("WAKEBUS_ORIGIN_SESSION"),
        };
        for (name, text) in [
            ("WAKEBUS_GOAL", &request.goal),
            ("WAKEBUS_CONTEXT", &request.context),
        ] {
            if fits_env(text) {
                command.env(name, text);
            } else {
                command.env_remove(name);
            }
        }
        if let Some(dir) = &cfg.working_dir {
            command.current_dir(dir);
        }
        // Cancelled (or the worker's grace over) between the task's start
        // and here: the program is not started at all.
        if stop.is_cancelled() {
            return Err(ExecError::Stopped {
                partial: None,
                api_calls: 0,
                tokens: None,
                truncated: false,
            });
        }
        let mut child = command.spawn().map_err(|err| {
            ExecError::transient(format!("could not start {}: {err}", cfg.program.display()))
        })?;
        let pid = child.id();
        let _running = pid.and_then(RunningGroup::register);

        let input = serde_json::to_vec(request).unwrap_or_default();
        let mut stdin = child.stdin.take();
        // Fed beside the reading, not as part of it: a program that does
        // not read its input is fine, and once it exits, what it did not
        // read is given up (closing the pipe), even if a process it left
        // behind holds its stdin.
        let mut feed = Some(Box::pin(async move {
            if let Some(stdin) = stdin.as_mut() {
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            }
        }));
        // The output is kept here, outside the reading: a read given up
        // (below) loses only what was still to come, not what was read.
        let mut out = Output::new(cfg.max_output_bytes);
        let mut err = Vec::new();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let (out_kept, err_kept) = (&mut out, &mut err);
        let mut io = Box::pin(async move {
            tokio::join!(
                read_stdout(stdout, out_kept, progress),
                read_tail(stderr, err_kept, STDERR_TAIL_BYTES),
            )
        });

        // The output is read while the program runs (a full pipe would
        // block it), and to its end after it exits, which a process it left
        // behind in its group may keep open: that one gets `kill_grace` to
        // let go, and is then stopped with the rest of the group.
        let mut read = false;
        let mut exit = None;
        let mut drain_until = None;
        // Whether the output was cut short by stopping what held it open,
        // and whether the rest of it was given up.
        let mut cut = false;
        let mut lost = false;
        let stopped = loop {
            if exit.is_some() && read {
                break false;
            }
            tokio::select! {
                _ = &mut io, if !read => read = true,
                () = async { if let Some(feed) = feed.as_mut() { feed.await } }, if feed.is_some() => {
                    feed = None;
                }
                exited = child.wait(), if exit.is_none() => {
                    exit = Some(exited);
                    feed = None;
                    drain_until = Some(tokio::time::Instant::now() + cfg.kill_grace);
                }
                // The drain ends after `kill_grace`, or sooner at a stop (a
                // timeout, a cancel, the grace's end) that comes once the
                // program has exited: it finished in time, and its result
                // stands.
                () = async {
                    tokio::select! {
                        () = sleep_until_some(drain_until) => {}
                        () = stop.cancelled() => {}
                    }
                }, if !read && exit.is_some() => {
                    warn!(?pid, "The task's program exited, but a process it started still holds its output; stopping its process group.");
                    stop_group(pid, cfg.kill_grace, &mut child).await;
                    lost = !read_rest(io.as_mut(), cfg.kill_grace).await;
                    read = true;
                    cut = true;
                }
                () = stop.cancelled(), if exit.is_none() => {
                    stop_group(pid, cfg.kill_grace, &mut child).await;
                    if !read {
                        lost = !read_rest(io.as_mut(), cfg.kill_grace).await;
                    }
                    break true;
                }
            }
        };
        // Done reading: what was read is in `out` and `err`, but for a
        // last line a read given up never ended.
        drop(io);
        out.end_line(progress);
        let truncated = out.dropped || cut || lost;
        if stopped {
            let mut partial = String::from_utf8_lossy(&out.kept).trim().to_owned();
            if truncated {
                partial.push_str("\n[output truncated]");
            }
            let partial = (!partial.trim().is_empty()).then_some(partial);
            return Err(ExecError::Stopped {
                partial,
                api_calls: 0,
                tokens: None,
                truncated,
            });
        }
        // Whatever it left running in its group ends with its task.
        stop_group(pid, cfg.kill_grace, &mut child).await;
        let exit = exit
            .expect("the loop ends once the program has exited")
            .map_err(|err| {
                ExecError::transient(format!("could not wait for the process: {err}"))
            })?;
        // Said even when the program succeeded: its result may be missing
        // its end.
        let lost_note = lost.then_some(
            "the end of the output was lost: a process that left the task's process group kept it open",
        );

        let stdout_text = String::from_utf8_lossy(&out.kept).trim().to_owned();
        let mut stderr_text = String::from_utf8_lossy(&err).trim().to_owned();
        if let Some(note) = lost_note {
            if !stderr_text.is_empty() {
                stderr_text.push_str("; ");
            }
            stderr_text.push_str(note);
        }
        // A JSON object with none of the fields is the result itself (a
        // structured answer), not an empty report.
        let structured = serde_json::from_str::<StructuredOutput>(&stdout_text)
            .ok()
            .filter(StructuredOutput::says_anything);
        let (mut summary, status_override, error_override, api_calls) = match structured {
            Some(s) => (s.summary, s.status, s.error, s.api_calls.unwrap_or(0)),
            None => (
                (!stdout_text.is_empty()).then_some(stdout_text),
                None,
                None,
                0,
            ),
        };
        if let Some(text) = summary.as_mut().filter(|_| truncated) {
            text.push_str("\n[output truncated]");
        }
        let (status, exit_reason, error) = if exit.success() {
            let error = error_override.or_else(|| lost_note.map(str::to_owned));
            (Status::Completed, "completed".to_owned(), error)
        } else {
            let reason = match exit.code() {
                Some(code) => format!("exit code {code}"),
                None => "killed by a signal".to_owned(),
            };
            let detail = if stderr_text.is_empty() {
                reason
            } else {
                format!("{reason}: {stderr_text}")
            };
            (
                Status::Failed,
                "nonzero_exit".to_owned(),
                Some(error_override.unwrap_or(detail)),
            )
        };
        Ok(ExecOutput {
            status: status_override.unwrap_or(status),
            summary,
            error,
            api_calls,
            tokens: None,
            truncated,
            exit_reason,
        })
    }
}

/// Longest stdout line looked at as a possible progress report.
const MAX_PROGRESS_LINE: usize = 64 * 1024;

/// Reads stdout to its end: JSON lines with a `"progress"` string are
/// reported as progress; everything else is kept in `out`, up to its cap.
async fn read_stdout(pipe: Option<impl AsyncRead + Unpin>, out: &mut Output, progress: &Progress) {
    let Some(mut pipe) = pipe else {
        return;
    };
    // On the heap: a stack buffer held across `.await` would live in the
    // future, and every task's future is moved when it is spawned.
    let mut chunk = vec![0u8; 8192];
    loop {
        let n = match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        out.take(&chunk[..n], progress);
    }
    out.end_line(progress);
}

/// Output kept up to a cap, read line by line (a line may be a progress
/// report). It lives outside the reading, so that a read given up keeps
/// what came before, its unfinished last line included.
struct Output {
    /// What is kept.
    kept: Vec<u8>,
    /// The cap.
    cap: usize,
    /// Whether anything was dropped.
    dropped: bool,
    /// The line being read.
    line: Vec<u8>,
    /// Inside a line too long to be a progress report: the rest is output.
    long_line: bool,
}

impl Output {
    /// Nothing kept yet, up to `cap` bytes.
    fn new(cap: usize) -> Self {
        Self {
            kept: Vec::new(),
            cap,
            dropped: false,
            line: Vec::new(),
            long_line: false,
        }
    }

    /// Takes `bytes` read: each line ended is reported or kept.
    fn take(&mut self, bytes: &[u8], progress: &Progress) {
        for &byte in bytes {
            self.line.push(byte);
            if byte == b'\n' {
                self.end_line(progress);
            } else if self.line.len() > MAX_PROGRESS_LINE {
                let line = std::mem::take(&mut self.line);
                self.keep(&line);
                self.long_line = true;
            }
        }
    }

    /// Ends the line being read (at its newline, or where the output
    /// stopped): a progress report, or output.
    fn end_line(&mut self, progress: &Progress) {
        let line = std::mem::take(&mut self.line);
        match progress_message(&line).filter(|_| !self.long_line) {
            Some(message) => progress.report(message),
            None => self.keep(&line),
        }
        self.long_line = false;
    }

    fn keep(&mut self, bytes: &[u8]) {
        let room = self.cap.saturating_sub(self.kept.len());
        if bytes.len() > room {
            self.dropped = true;
        }
        self.kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

/// The message of a `{"progress": "..."}` line, if it is one.
fn progress_message(line: &[u8]) -> Option<String> {
    let trimmed = line.trim_ascii();
    if !trimmed.starts_with(b"{") {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(trimmed).ok()?;
    match value.get("progress")? {
        serde_json::Value::String(message) => Some(message.clone()),
        other => Some(other.to_string()),
    }
}

/// Reads a pipe to its end, keeping its last `cap` bytes in `kept`.
async fn read_tail(pipe: Option<impl AsyncRead + Unpin>, kept: &mut Vec<u8>, cap: usize) {
    let Some(mut pipe) = pipe else {
        return;
    };
    // On the heap: a stack buffer held across `.await` would live in the
    // future, and every task's future is moved when it is spawned.
    let mut chunk = vec![0u8; 8192];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                kept.extend_from_slice(&chunk[..n]);
                if kept.len() > cap {
                    kept.drain(..kept.len() - cap);
                }
            }
        }
    }
}

/// Reads the rest of the output once the program's group was stopped,
/// within `patience`: a process that left the group (`setsid`) may still
/// hold it open, and must not hold the task for ever. `false` if the rest
/// was given up (what was read before is kept).
async fn read_rest(io: std::pin::Pin<&mut impl std::future::Future>, patience: Duration) -> bool {
    let finished = tokio::time::timeout(patience, io).await.is_ok();
    if !finished {
        warn!(
            "A process outside the task's process group still holds its output; giving up on reading the rest of it."
        );
    }
    finished
}

/// Sleeps until `deadline`, or for ever without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Stops the program's process group, whatever of it is left: SIGTERM,
/// then SIGKILL to every process still in it after `grace` (the leader's
/// exit is not enough: a process it started may have outlived it). Reaps
/// the leader. Nothing is sent to a group already empty.
async fn stop_group(pid: Option<u32>, grace: Duration, child: &mut tokio::process::Child) {
    let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) else {
        return;
    };
    let group = Pid::from_raw(pid);
    if !group_alive(group) {
        let _ = child.wait().await;
        return;
    }
    if let Err(err) = killpg(group, Signal::SIGTERM) {
        debug!(pid, %err, "SIGTERM to the process group failed (already gone?).");
    }
    let emptied = async {
        let _ = child.wait().await;
        while group_alive(group) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    if tokio::time::timeout(grace, emptied).await.is_err() {
        warn!(pid, "Process group ignored SIGTERM; sending SIGKILL.");
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait().await;
    }
}

/// Whether any process is left in `group` (a zombie leader counts until it
/// is reaped; a group the worker may not signal is taken as alive).
fn group_alive(group: Pid) -> bool {
    !matches!(killpg(group, None), Err(nix::errno::Errno::ESRCH))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A file `name` in `dir` with `mode`.
    fn file(dir: &std::path::Path, name: &str, mode: u32) {
        let path = dir.join(name);
        std::fs::write(&path, "#!/bin/sh\necho ok\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn config(program: &str, working_dir: Option<&std::path::Path>) -> CommandConfig {
        let mut config = CommandConfig::new(program, Vec::new());
        config.working_dir = working_dir.map(std::path::Path::to_path_buf);
        config
    }

    #[test]
    fn a_program_that_exec_would_run_passes_the_start_check() {
        let dir = tempfile::tempdir().unwrap();
        file(dir.path(), "task.sh", 0o755);
        let absolute = dir.path().join("task.sh").display().to_string();
        for ok in [
            config("sh", None),
            config(&absolute, None),
            config("./task.sh", Some(dir.path())),
            config("./scripts/demo", None),
            config("sh", Some(dir.path())),
        ] {
            assert!(ok.check().is_ok(), "{ok:?}: {:?}", ok.check());
        }
    }

    #[test]
    fn a_program_that_exec_would_refuse_fails_the_start_check_saying_why() {
        let dir = tempfile::tempdir().unwrap();
        file(dir.path(), "plain.txt", 0o644);
        let not_executable = dir.path().join("plain.txt").display().to_string();
        for (refused, why) in [
            (
                config("no-such-program-anywhere", None),
                "not found on PATH",
            ),
            (config(&not_executable, None), "is not an executable file"),
            (config("/nonexistent/task", None), "no such file"),
            // Relative programs run from the working directory, not the
            // worker's (a test's is the crate's root).
            (config("./scripts/demo", Some(dir.path())), "no such file"),
        ] {
            let error = refused.check().expect_err(&format!("{refused:?}"));
            assert!(error.to_string().contains(why), "{refused:?}: {error}");
        }
        let missing_dir = config("sh", Some(std::path::Path::new("/nonexistent-dir")));
        assert!(matches!(
            missing_dir.check(),
            Err(CommandConfigError::WorkingDir { .. })
        ));
    }

    #[tokio::test]
    async fn a_run_cancelled_before_its_program_starts_does_not_start_it() {
        // A program that cannot start: trying to is seen in the result.
        let executor =
            CommandExecutor::new(CommandConfig::new("/nonexistent/wakebus-task", Vec::new()));
        let env = TaskEnv {
            nats_url: "nats://127.0.0.1:1".into(),
            prefix: "wakebus".into(),
            pool: "default".into(),
        };
        let (progress, _) = Progress::channel();
        let request = TaskRequest::new("d1", "g");
        let stop = CancellationToken::new();
        stop.cancel();
        let result = executor.run(&request, &env, &stop, &progress).await;
        assert!(
            matches!(result, Err(ExecError::Stopped { partial: None, .. })),
            "{result:?}"
        );

        let result = executor
            .run(&request, &env, &CancellationToken::new(), &progress)
            .await;
        assert!(
            matches!(&result, Err(error) if error.to_string().contains("could not start")),
            "{result:?}"
        );
    }
}
