//! `wakebus` worker and wake processes, and their peak RSS.

use std::process::{Child, Command, Stdio};

/// A `wakebus` process; killed on drop.
pub(crate) struct Proc {
    /// The process.
    child: Child,
}

impl Proc {
    /// Starts `wakebus <args>`.
    pub(crate) fn spawn(args: &[String]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("WAKEBUS_BENCH_LOG").unwrap_or("warn".into()),
            )
            .env_remove("NATS_URL")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn wakebus");
        Self { child }
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU seconds used so far.
    pub(crate) fn cpu_seconds(&self) -> f64 {
        cpu_seconds(self.pid())
    }

    /// Peak resident set size so far, in MiB (`VmHWM`).
    pub(crate) fn peak_rss_mib(&self) -> f64 {
        peak_rss_mib(self.pid())
    }
}

/// CPU time (user + system) `pid` has used so far, in seconds (0 if
/// unreadable). Stable where wall-clock rates are not: a shared 2-core VM
/// moves throughput by ±20% between runs, CPU per delegation far less.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses;
    // utime and stime are fields 14 and 15 of the whole line.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ: 100 on every Linux this runs on.
    (ticks(11) + ticks(12)) / 100.0
}

/// `VmHWM` of `pid` in MiB (0 if unreadable).
pub(crate) fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Arguments for a worker running the echo executor.
pub(crate) fn worker_args(url: &str, prefix: &str, concurrency: usize) -> Vec<String> {
    [
        "--nats-url",
        url,
        "--prefix",
        prefix,
        "worker",
        "--executor",
        "echo",
        "--concurrency",
        &concurrency.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// Arguments for a wake service posting to `api_url` without coalescing
/// (a window only adds latency when each session has one completion).
pub(crate) fn wake_args(url: &str, prefix: &str, api_url: &str) -> Vec<String> {
    [
        "--nats-url",
        url,
        "--prefix",
        prefix,
        "wake",
        "--api-url",
        api_url,
        "--coalesce-window",
        "0s",
    ]
    .map(String::from)
    .to_vec()
}
