//! `wakebus` services as real processes, so kills are real.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A running `wakebus` subcommand; SIGKILLed on drop.
pub struct Service {
    /// The arguments, kept for restarts.
    args: Vec<String>,
    /// Where its log goes (appended across restarts).
    pub log: PathBuf,
    /// Extra environment variables, kept for restarts.
    env: Vec<(String, String)>,
    /// What SIGHUP is at the start: `env`'s option setting it.
    hangup: &'static str,
    /// Started in a process group of its own, as a shell starts a job, so
    /// that a signal can go to the whole group as a terminal's Ctrl-C does.
    own_group: bool,
    child: Option<Child>,
}

impl Service {
    /// Starts `wakebus <args>`, logging to `log`.
    pub fn spawn(args: Vec<String>, log: PathBuf) -> Self {
        Self::spawn_with_env(args, log, Vec::new())
    }

    /// Starts `wakebus <args>` with extra environment variables.
    pub fn spawn_with_env(args: Vec<String>, log: PathBuf, env: Vec<(String, String)>) -> Self {
        let mut service = Self {
            args,
            log,
            env,
            // As a terminal's shell starts it, whatever this test run
            // inherited (a run under `nohup` ignores SIGHUP).
            hangup: "--default-signal=HUP",
            own_group: false,
            child: None,
        };
        service.start();
        service
    }

    /// Starts `wakebus <args>` in a process group of its own, as an
    /// interactive shell starts a foreground job: see [`Self::signal_group`].
    pub fn spawn_as_terminal_job(args: Vec<String>, log: PathBuf) -> Self {
        let mut service = Self {
            args,
            log,
            env: Vec::new(),
            hangup: "--default-signal=HUP",
            own_group: true,
            child: None,
        };
        service.start();
        service
    }

    /// Starts `wakebus <args>` with SIGHUP ignored, as `nohup` starts it.
    pub fn spawn_ignoring_hangups(args: Vec<String>, log: PathBuf) -> Self {
        let mut service = Self {
            args,
            log,
            env: Vec::new(),
            hangup: "--ignore-signal=HUP",
            own_group: false,
            child: None,
        };
        service.start();
        service
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        // GNU env sets the signal's disposition, then runs wakebus in its
        // place (the same process).
        let mut command = Command::new("env");
        if self.own_group {
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
        }
        let child = command
            .arg(self.hangup)
            .arg(env!("CARGO_BIN_EXE_wakebus"))
            .args(&self.args)
            .env("RUST_LOG", "wakebus=info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("NATS_URL")
            // Tests read the text logs.
            .env_remove("WAKEBUS_LOG_FORMAT")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn wakebus");
        self.child = Some(child);
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again with the same arguments.
    pub fn restart(&mut self) {
        self.kill();
        self.start();
    }

    /// Sends `signal` (SIGSTOP and SIGCONT freeze and thaw it).
    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid() as i32), signal).expect("signal wakebus");
    }

    /// Sends `signal` to its whole process group, as a terminal sends Ctrl-C
    /// to every process of its foreground job (started with
    /// [`Self::spawn_as_terminal_job`]).
    pub fn signal_group(&self, signal: Signal) {
        assert!(self.own_group, "not started in a process group of its own");
        nix::sys::signal::killpg(Pid::from_raw(self.pid() as i32), signal)
            .expect("signal the process group");
    }

    /// The processes it started (its children), by pid.
    pub fn children(&self) -> Vec<u32> {
        let tasks = format!("/proc/{}/task", self.pid());
        std::fs::read_dir(tasks)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
            .flat_map(|pids| {
                pids.split_whitespace()
                    .filter_map(|pid| pid.parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect()
    }

    /// Sends `signal` and waits up to `timeout` for the exit status.
    pub async fn signal_and_wait(&mut self, signal: Signal, timeout: Duration) -> ExitStatus {
        let child = self.child.as_ref().expect("running");
        let _ = kill(Pid::from_raw(child.id() as i32), signal);
        self.wait_exit(timeout, &format!("after {signal:?}")).await
    }

    /// Whether it is still running (it has not exited by itself).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| child.try_wait().expect("wait").is_none())
    }

    /// Waits up to `timeout` for it to exit by itself, and returns its exit
    /// status; panics with its log's end if it does not (`when` says what
    /// it was expected to exit after). Polls without blocking the runtime,
    /// so that the test's own servers (a session API, a collector) answer
    /// the process while it stops.
    pub async fn wait_exit(&mut self, timeout: Duration, when: &str) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "wakebus did not exit within {timeout:?} {when}; its log ends:\n{}",
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Arguments every service gets.
pub fn base_args(nats_url: &str, prefix: &str) -> Vec<String> {
    vec![
        "--nats-url".into(),
        nats_url.into(),
        "--prefix".into(),
        prefix.into(),
    ]
}

/// `wakebus worker` running `script` with `sh -c`.
pub fn worker_args(nats_url: &str, prefix: &str, script: &str, extra: &[&str]) -> Vec<String> {
    let mut args = base_args(nats_url, prefix);
    args.extend(["worker", "--executor", "command", "--concurrency", "8"].map(String::from));
    if !extra.contains(&"--ack-wait") {
        args.extend(["--ack-wait", "2s"].map(String::from));
    }
    // A `started` event for every run, as tests count attempts by them.
    if !extra.contains(&"--started-after") {
        args.extend(["--started-after", "0s"].map(String::from));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--", "sh", "-c", script].map(String::from));
    args
}

/// `wakebus wake` posting to `api_url`.
pub fn wake_args(nats_url: &str, prefix: &str, api_url: &str) -> Vec<String> {
    let mut args = base_args(nats_url, prefix);
    args.extend(
        [
            "--session-lock-ttl",
            "3s",
            "wake",
            "--api-url",
            api_url,
            "--ack-wait",
            "2s",
            "--coalesce-window",
            "20ms",
            "--retry-min",
            "50ms",
            "--retry-max",
            "500ms",
            "--request-timeout",
            "2s",
        ]
        .map(String::from),
    );
    args
}

/// Prints these log files if the test panics while it is alive, so that a
/// failure in CI shows what the processes did.
pub struct LogsOnPanic(pub Vec<PathBuf>);

impl Drop for LogsOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in &self.0 {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                eprintln!("--- {} ---\n{text}", log.display());
            }
        }
    }
}

/// The value of the sample `name` (with its labels, exactly as rendered).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Starts `wakebus <args> --metrics-addr <a free port>`, logging to
/// `log`; returns it and the base URL of its metrics.
pub fn spawn_with_metrics(args: Vec<String>, log: PathBuf) -> (Service, String) {
    spawn_with_metrics_and_env(args, log, Vec::new())
}

/// [`spawn_with_metrics`] with extra environment variables.
pub fn spawn_with_metrics_and_env(
    mut args: Vec<String>,
    log: PathBuf,
    env: Vec<(String, String)>,
) -> (Service, String) {
    let addr = format!("127.0.0.1:{}", super::nats::free_port());
    args.extend(["--metrics-addr".to_owned(), addr.clone()]);
    (
        Service::spawn_with_env(args, log, env),
        format!("http://{addr}"),
    )
}
