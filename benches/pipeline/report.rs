//! The results: JSON shape and the printed table.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::stages::Stages;

/// Where the run happened.
#[derive(Debug, Serialize)]
pub(crate) struct Machine {
    /// Logical CPUs.
    pub(crate) cpus: usize,
    /// From /proc/cpuinfo.
    pub(crate) cpu_model: String,
    /// `nats-server --version`.
    pub(crate) nats_server: String,
}

impl Machine {
    /// This machine, with the server's version string.
    pub(crate) fn detect(nats_server: &str) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        Self {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            nats_server: nats_server.to_owned(),
        }
    }
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Latency {
    /// Median.
    pub(crate) p50_ms: f64,
    /// 90th percentile.
    pub(crate) p90_ms: f64,
    /// 99th percentile.
    pub(crate) p99_ms: f64,
    /// Worst.
    pub(crate) max_ms: f64,
}

impl Latency {
    /// Percentiles of `samples` (nearest rank).
    pub(crate) fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i].as_secs_f64() * 1e3
        };
        Self {
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

/// One measured run.
#[derive(Debug, Serialize)]
pub(crate) struct Run {
    /// Worker processes.
    pub(crate) workers: usize,
    /// Delegations measured.
    pub(crate) delegations: usize,
    /// Delegations per second, submit of the first to wake of the last.
    pub(crate) throughput: f64,
    /// Submit to continuation.
    pub(crate) latency: Latency,
    /// Posts the endpoint received.
    pub(crate) posts: usize,
    /// Peak RSS of the biggest worker.
    pub(crate) worker_peak_rss_mib: f64,
    /// Peak RSS of the wake service.
    pub(crate) wake_peak_rss_mib: f64,
}

/// CPU time per delegation, microseconds, by process, over a measured run.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct CpuPerDelegation {
    /// All worker processes together.
    pub(crate) workers_us: f64,
    /// The wake service.
    pub(crate) wake_us: f64,
    /// nats-server.
    pub(crate) nats_server_us: f64,
    /// The bench process: in the end-to-end runs the delegator (the
    /// library's `Delegator`) and the HTTP endpoint the wakes are posted
    /// to; in the ceilings every client.
    pub(crate) bench_process_us: f64,
}

/// Messages stored per delegation in a run, by stream, counted from the
/// streams' last sequences (each run has streams of its own) over its
/// measured part.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct StoredWrites {
    /// The task requests.
    pub(crate) tasks: f64,
    /// The events stream: `submitted` records and completions (`started`
    /// too, for tasks running longer than `--started-after`).
    pub(crate) events: f64,
    /// Session lock takes, refreshes and releases.
    pub(crate) session_locks: f64,
    /// Wake ledger entries: `posting`, `delivered`, intents of combined turns.
    pub(crate) wake_ledger: f64,
}

impl StoredWrites {
    /// Per delegation, for `n` delegations, from the counts of
    /// [`crate::stored`] at the start and the end.
    pub(crate) fn between(start: [u64; 4], end: [u64; 4], n: usize) -> Self {
        let per = |i: usize| end[i].saturating_sub(start[i]) as f64 / n as f64;
        Self {
            tasks: per(0),
            events: per(1),
            session_locks: per(2),
            wake_ledger: per(3),
        }
    }

    /// The sum.
    pub(crate) fn total(&self) -> f64 {
        self.tasks + self.events + self.session_locks + self.wake_ledger
    }
}

impl CpuPerDelegation {
    /// The sum.
    pub(crate) fn total_us(&self) -> f64 {
        self.workers_us + self.wake_us + self.nats_server_us + self.bench_process_us
    }
}

/// Draining a queue.
#[derive(Debug, Serialize)]
pub(crate) struct BacklogRun {
    /// Requests queued before workers started.
    pub(crate) queued: usize,
    /// Delegations per second, first wake to last.
    pub(crate) throughput: f64,
    /// Peak RSS of the worker.
    pub(crate) worker_peak_rss_mib: f64,
    /// Peak RSS of the wake service.
    pub(crate) wake_peak_rss_mib: f64,
}

/// Everything, as written to JSON.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// How to reproduce.
    pub(crate) command: String,
    /// Where.
    pub(crate) machine: Machine,
    /// `--concurrency` of each worker.
    pub(crate) worker_concurrency: usize,
    /// Distinct origin sessions.
    pub(crate) sessions: usize,
    /// Raw JetStream, two hops, messages per second.
    pub(crate) ceiling_msgs_per_s: f64,
    /// As fast as it goes, one worker.
    pub(crate) saturation: Run,
    /// Saturation / ceiling.
    pub(crate) ratio_to_ceiling: f64,
    /// Stored writes per delegation in the saturation run.
    pub(crate) saturation_writes: StoredWrites,
    /// The same-work ceiling: a delegation's stored writes and consumes
    /// with bare JetStream calls, delegations per second.
    pub(crate) same_work_per_s: f64,
    /// Stored writes per delegation of the same-work ceiling (its lock
    /// writes made to match the saturation run's).
    pub(crate) same_work_writes: StoredWrites,
    /// Bytes per message of each kind (payload and header lines) of the
    /// saturation run, which the same-work ceiling stores copies of.
    pub(crate) same_work_message_bytes: crate::sample::MessageBytes,
    /// Saturation / same-work ceiling.
    pub(crate) ratio_to_same_work: f64,
    /// Offered load of the open-loop run.
    pub(crate) open_loop_offered_per_s: usize,
    /// At that load.
    pub(crate) open_loop: Run,
    /// 1, 2, 4 workers.
    pub(crate) scaling: Vec<Run>,
    /// 10k, 100k queued.
    pub(crate) backlog: Vec<BacklogRun>,
    /// CPU per delegation in the saturation run, by process.
    pub(crate) saturation_cpu: CpuPerDelegation,
    /// CPU per message of the raw ceiling (publisher, relay and sink in the
    /// bench process, plus nats-server), microseconds.
    pub(crate) ceiling_cpu_us: CpuPerDelegation,
    /// CPU per delegation of the same-work ceiling (all in the bench
    /// process, plus nats-server), microseconds.
    pub(crate) same_work_cpu_us: CpuPerDelegation,
    /// Where the saturation run's latency went, by stage.
    pub(crate) saturation_stages: Option<Stages>,
    /// Where the open-loop run's latency went, by stage.
    pub(crate) open_loop_stages: Option<Stages>,
    /// The server's own peak RSS over the whole run.
    pub(crate) nats_server_peak_rss_mib: f64,
}

impl Report {
    /// The human-readable table.
    pub(crate) fn table(&self) -> String {
        let mut t = String::new();
        let m = &self.machine;
        let _ = writeln!(
            t,
            "\nwakebus pipeline benchmark — {} CPUs, {}, {}",
            m.cpus, m.cpu_model, m.nats_server
        );
        let _ = writeln!(
            t,
            "{:<44} {:>12} {:>8} {:>8} {:>8} {:>8}",
            "run", "per second", "p50 ms", "p90 ms", "p99 ms", "max ms"
        );
        let _ = writeln!(
            t,
            "{:<44} {:>12.0}",
            "raw JetStream ceiling (2 hops, 512 B)", self.ceiling_msgs_per_s
        );
        let _ = writeln!(
            t,
            "{:<44} {:>12.0}",
            format!(
                "same-work ceiling ({:.2} writes, 2 pull+acks)",
                self.same_work_writes.total()
            ),
            self.same_work_per_s
        );
        let mut row = |name: String, r: &Run| {
            let l = &r.latency;
            let _ = writeln!(
                t,
                "{name:<44} {:>12.0} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
                r.throughput, l.p50_ms, l.p90_ms, l.p99_ms, l.max_ms
            );
        };
        row(
            format!("end-to-end, saturation, {} worker", self.saturation.workers),
            &self.saturation,
        );
        row(
            format!(
                "end-to-end, open loop {}/s offered",
                self.open_loop_offered_per_s
            ),
            &self.open_loop,
        );
        for r in &self.scaling {
            row(format!("scaling, {} worker process(es)", r.workers), r);
        }
        let _ = writeln!(
            t,
            "{:<44} {:>12.2}",
            "end-to-end / ceiling", self.ratio_to_ceiling
        );
        let _ = writeln!(
            t,
            "{:<44} {:>12.2}",
            "end-to-end / same-work ceiling", self.ratio_to_same_work
        );
        for (run, stages) in [
            ("saturation", &self.saturation_stages),
            ("open loop", &self.open_loop_stages),
        ] {
            let Some(stages) = stages else { continue };
            for (stage, latency) in [
                ("submit → submitted stored", &stages.record),
                ("submitted → done stored", &stages.worker),
                ("done stored → continuation", &stages.wake),
            ] {
                if let Some(l) = latency {
                    let _ = writeln!(
                        t,
                        "{:<44} {:>12} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
                        format!("  {run}: {stage}"),
                        "",
                        l.p50_ms,
                        l.p90_ms,
                        l.p99_ms,
                        l.max_ms
                    );
                }
            }
        }
        let _ = writeln!(
            t,
            "{:<44} {:>12} {:>8} {:>8} {:>8} {:>8}",
            "CPU µs per delegation (saturation)", "total", "workers", "wake", "server", "bench"
        );
        for (name, c) in [
            ("end-to-end", &self.saturation_cpu),
            ("raw ceiling (per message, both hops)", &self.ceiling_cpu_us),
            ("same-work ceiling", &self.same_work_cpu_us),
        ] {
            let _ = writeln!(
                t,
                "{name:<44} {:>12.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                c.total_us(),
                c.workers_us,
                c.wake_us,
                c.nats_server_us,
                c.bench_process_us
            );
        }
        let w = &self.saturation_writes;
        let _ = writeln!(
            t,
            "{:<44} {:>12} {:>8} {:>8} {:>8} {:>8}",
            "stored writes per delegation (saturation)",
            "total",
            "tasks",
            "events",
            "locks",
            "ledger"
        );
        for (name, w) in [
            ("end-to-end", w),
            ("same-work ceiling", &self.same_work_writes),
        ] {
            let _ = writeln!(
                t,
                "{:<44} {:>12.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                name,
                w.total(),
                w.tasks,
                w.events,
                w.session_locks,
                w.wake_ledger
            );
        }
        let b = &self.same_work_message_bytes;
        let _ = writeln!(
            t,
            "{:<44} {:>12} {:>8} {:>8} {:>8} {:>8}\n{:<44} {:>12} {:>8} {:>8} {:>8} {:>8}",
            "bytes per message, payload + headers",
            "task",
            "submitted",
            "done",
            "posting",
            "delivered",
            "sampled from the saturation run",
            b.task,
            b.submitted,
            b.done,
            b.posting,
            b.delivered
        );
        let _ = writeln!(
            t,
            "{:<44} {:>12} {:>14} {:>14}",
            "backlog drain (1 worker)", "per second", "worker RSS MiB", "wake RSS MiB"
        );
        for b in &self.backlog {
            let _ = writeln!(
                t,
                "{:<44} {:>12.0} {:>14.1} {:>14.1}",
                format!("{} queued", b.queued),
                b.throughput,
                b.worker_peak_rss_mib,
                b.wake_peak_rss_mib
            );
        }
        let _ = writeln!(
            t,
            "{:<44} {:>12.1}",
            "nats-server peak RSS MiB", self.nats_server_peak_rss_mib
        );
        t
    }
}
