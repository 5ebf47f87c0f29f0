//! End-to-end benchmark of wakebus against a nats-server it starts itself.
//!
//! ```sh
//! cargo bench --bench pipeline
//! ```
//!
//! Delegations are submitted with the library's `Delegator`, run by `wakebus
//! worker --executor echo` processes, and their continuations posted by a
//! `wakebus wake` process to an HTTP endpoint in this process, which notes
//! when each arrives. In the same run and on the same server it measures the
//! raw JetStream ceiling (publish → pull+ack → publish → pull+ack) and the
//! same-work ceiling (a delegation's stored writes and consumes, with no
//! pipeline logic).
//!
//! Prints a table, writes `target/bench/pipeline.json` and
//! `target/bench/pipeline.svg` (`WAKEBUS_BENCH_OUT` to change the directory).
//! Sizes come from the environment; see [`Config::from_env`].

mod chart;
mod nats;
mod procs;
mod raw;
mod report;
mod same_work;
mod sample;
mod sink;
mod stages;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::delegate::{DelegateResult, Delegation, Delegator};
use wakebus::protocol::Subjects;

use nats::NatsServer;
use procs::{Proc, wake_args, worker_args};
use report::{BacklogRun, CpuPerDelegation, Latency, Machine, Report, Run, StoredWrites};
use sink::Sink;
use stages::Stages;

/// What to run, from `WAKEBUS_BENCH_*` environment variables.
pub(crate) struct Config {
    /// Delegations per saturation run and messages of the raw ceiling.
    n: usize,
    /// Offered load of the open-loop run, per second.
    rate: usize,
    /// Length of the open-loop run.
    open_loop: Duration,
    /// Worker process counts to compare.
    workers: Vec<usize>,
    /// Backlog sizes to drain.
    backlogs: Vec<usize>,
    /// `--concurrency` of each worker.
    concurrency: usize,
    /// Distinct origin sessions, round robin.
    sessions: usize,
    /// Delegations submitted at once in closed-loop runs.
    window: usize,
    /// Where JSON and SVG go.
    out: PathBuf,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

impl Config {
    /// `WAKEBUS_BENCH_N` (20000), `_RATE` (1000), `_OPEN_LOOP_SECS` (10),
    /// `_WORKERS` (1,2,4), `_BACKLOGS` (10000,100000), `_CONCURRENCY` (64),
    /// `_SESSIONS` (1000), `_WINDOW` (512), `_OUT` (target/bench).
    fn from_env() -> Self {
        Self {
            n: env("WAKEBUS_BENCH_N", 20_000),
            rate: env("WAKEBUS_BENCH_RATE", 1_000),
            open_loop: Duration::from_secs(env("WAKEBUS_BENCH_OPEN_LOOP_SECS", 10)),
            workers: env_list("WAKEBUS_BENCH_WORKERS", &[1, 2, 4]),
            backlogs: env_list("WAKEBUS_BENCH_BACKLOGS", &[10_000, 100_000]),
            concurrency: env("WAKEBUS_BENCH_CONCURRENCY", 64),
            sessions: env("WAKEBUS_BENCH_SESSIONS", 1_000),
            window: env("WAKEBUS_BENCH_WINDOW", 512),
            out: std::env::var_os("WAKEBUS_BENCH_OUT")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench")),
        }
    }
}

/// How delegations are offered.
#[derive(Clone, Copy)]
enum Load {
    /// `n` as fast as the pipeline takes them (a window in flight).
    Saturation(usize),
    /// `n` at `rate` per second, each on schedule whatever came before.
    OpenLoop { n: usize, rate: usize },
    /// `n` queued before any worker starts, then drained.
    Backlog(usize),
}

/// What one scenario measured.
struct Measured {
    /// The run's deployment prefix (its streams are its own).
    prefix: String,
    /// Delegations per second.
    throughput: f64,
    /// Submit-to-continuation latency.
    latency: Latency,
    /// Peak RSS of the biggest worker, MiB.
    worker_rss: f64,
    /// Peak RSS of the wake service, MiB.
    wake_rss: f64,
    /// Posts received (fewer than delegations when turns were combined).
    posts: usize,
    /// CPU per delegation over the measured part (zero for a backlog).
    cpu: CpuPerDelegation,
    /// Latency by stage, from the history's store times (not for a
    /// backlog, whose submit times say nothing).
    stages: Option<Stages>,
    /// Messages stored per delegation in the measured part, by stream.
    writes: StoredWrites,
}

/// Messages stored so far in the streams of `bus`'s prefix: tasks, events,
/// session locks, wake ledger (each run has streams of its own).
pub(crate) async fn stored(bus: &Bus) -> [u64; 4] {
    let s = &bus.subjects;
    let mut counts = [0; 4];
    let streams = [
        s.tasks_stream(),
        s.events_stream(),
        Subjects::bucket_stream(&s.session_lock_bucket()),
        Subjects::bucket_stream(&s.wake_ledger_bucket()),
    ];
    for (count, stream) in counts.iter_mut().zip(streams) {
        let mut stream = bus.js.get_stream(stream).await.expect("stream");
        *count = stream
            .info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
    }
    counts
}

/// Delegations run before a measured run (not measured, but stored).
const WARMUP: usize = 200;

/// CPU seconds so far of the bench process, the server, the wake and the workers.
fn cpu_now(server: &NatsServer, wake: &Proc, workers: &[Proc]) -> [f64; 4] {
    [
        procs::cpu_seconds(std::process::id()),
        procs::cpu_seconds(server.pid()),
        wake.cpu_seconds(),
        workers.iter().map(Proc::cpu_seconds).sum(),
    ]
}

/// Submission times of delegations, by id.
type Submitted = Arc<Mutex<HashMap<String, Instant>>>;

/// Delegates one task for `session`, noting when; returns its delegation id.
async fn submit(delegator: &Delegator, session: String, submitted: &Submitted) -> String {
    let begun = Instant::now();
    let goal = format!("benchmark task {session:0>240}");
    let result = delegator
        .delegate(Delegation::new(goal).session(session))
        .await
        .expect("delegation accepted");
    let DelegateResult::Dispatched { delegation_id, .. } = result else {
        panic!("a delegation with a session is dispatched");
    };
    submitted
        .lock()
        .unwrap()
        .insert(delegation_id.clone(), begun);
    delegation_id
}

async fn submit_window(
    delegator: &Delegator,
    config: &Config,
    range: std::ops::Range<usize>,
    submitted: &Submitted,
) {
    futures::stream::iter(range)
        .map(|i| {
            submit(
                delegator,
                format!("bench.s{}", i % config.sessions),
                submitted,
            )
        })
        .buffer_unordered(config.window)
        .for_each(|_| std::future::ready(()))
        .await;
}

async fn connect(url: &str, prefix: &str) -> Bus {
    let client = NatsConfig::new(url).connect().await.expect("connect");
    let bus = Bus::new(client, Subjects::new(prefix).expect("prefix"));
    bus.provision(&BusSettings::default())
        .await
        .expect("provision");
    bus
}

/// Waits until the wake and worker consumers exist (the services are up).
async fn wait_for_services(bus: &Bus) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let s = &bus.subjects;
    let wanted = [
        (s.tasks_stream(), s.worker_consumer("default")),
        (s.events_stream(), s.wake_consumer().to_owned()),
    ];
    for (stream, consumer) in &wanted {
        loop {
            let found = bus
                .js
                .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                    consumer, stream,
                )
                .await
                .is_ok();
            if found {
                break;
            }
            assert!(Instant::now() < deadline, "services did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn scenario(server: &NatsServer, config: &Config, workers: usize, load: Load) -> Measured {
    let prefix = format!("b{}", ulid::Ulid::new().to_string().to_ascii_lowercase());
    let bus = connect(&server.url, &prefix).await;
    let delegator = Delegator::new(bus.clone());
    let sink = Sink::start().await;
    let submitted: Submitted = Arc::default();
    let anchor = (Instant::now(), SystemTime::now());
    let start_services = || {
        let wake = Proc::spawn(&wake_args(&server.url, &prefix, &sink.url()));
        let workers: Vec<Proc> = (0..workers)
            .map(|_| Proc::spawn(&worker_args(&server.url, &prefix, config.concurrency)))
            .collect();
        (wake, workers)
    };

    // What the streams held when the measured part began (the warm-up's
    // writes; nothing for a backlog, whose every write is measured).
    let mut stored_at_start = [0; 4];
    let (measured, begun, services, cpu_at_start) = match load {
        Load::Backlog(n) => {
            submit_window(&delegator, config, 0..n, &submitted).await;
            let services = start_services();
            (n, None, services, None)
        }
        Load::Saturation(n) | Load::OpenLoop { n, .. } => {
            let services = start_services();
            wait_for_services(&bus).await;
            // Warm up connections and caches; these are not measured.
            let warm: Submitted = Arc::default();
            submit_window(&delegator, config, 0..WARMUP, &warm).await;
            assert!(
                sink.wait_for(WARMUP, Duration::from_secs(60)).await,
                "warm-up stalled"
            );
            let cpu_at_start = cpu_now(server, &services.0, &services.1);
            stored_at_start = stored(&bus).await;
            let begun = Instant::now();
            match load {
                Load::OpenLoop { rate, .. } => {
                    let tick = Duration::from_secs_f64(1.0 / rate as f64);
                    let mut tasks = Vec::with_capacity(n);
                    for i in 0..n {
                        tokio::time::sleep_until((begun + tick * i as u32).into()).await;
                        let delegator = delegator.clone();
                        let submitted = submitted.clone();
                        let session = format!("bench.s{}", i % config.sessions);
                        tasks.push(tokio::spawn(async move {
                            submit(&delegator, session, &submitted).await;
                        }));
                    }
                    for task in tasks {
                        task.await.expect("submit");
                    }
                }
                _ => submit_window(&delegator, config, 0..n, &submitted).await,
            }
            let total = WARMUP + n;
            assert!(
                sink.wait_for(total, Duration::from_secs(600)).await,
                "run stalled"
            );
            (n, Some(begun), services, Some(cpu_at_start))
        }
    };
    if begun.is_none() {
        assert!(
            sink.wait_for(measured, Duration::from_secs(1200)).await,
            "drain stalled"
        );
    }
    let (wake, workers) = services;
    let cpu = cpu_at_start.map_or_else(CpuPerDelegation::default, |start| {
        let end = cpu_now(server, &wake, &workers);
        let us = |i: usize| (end[i] - start[i]) * 1e6 / measured as f64;
        CpuPerDelegation {
            bench_process_us: us(0),
            nats_server_us: us(1),
            wake_us: us(2),
            workers_us: us(3),
        }
    });
    // Before the wake is stopped: a lock it still holds then is counted
    // taken but not released (as locks held at the start were counted
    // released but not taken).
    let writes = StoredWrites::between(stored_at_start, stored(&bus).await, measured);
    let worker_rss = workers.iter().map(Proc::peak_rss_mib).fold(0.0, f64::max);
    let wake_rss = wake.peak_rss_mib();
    drop(workers);
    drop(wake);

    let (arrivals, posts, duplicates) = sink.snapshot();
    assert_eq!(
        duplicates, 0,
        "a delegation was woken under two idempotency keys"
    );
    // Every submission has finished: take the map out of its lock.
    let submitted = std::mem::take(&mut *submitted.lock().unwrap());
    assert_eq!(submitted.len(), measured);
    let stages = match begun {
        Some(_) => Some(stages::measure(&bus, &submitted, &arrivals, |i| wall(anchor, i)).await),
        None => None,
    };
    let mut latencies = Vec::with_capacity(measured);
    let mut first = None::<Instant>;
    let mut last = None::<Instant>;
    for (id, at) in submitted.iter() {
        let arrived = *arrivals.get(id).expect("every delegation woken");
        latencies.push(arrived.saturating_duration_since(*at));
        first = Some(first.map_or(arrived, |f| f.min(arrived)));
        last = Some(last.map_or(arrived, |l| l.max(arrived)));
    }
    let (first, last) = (first.unwrap(), last.unwrap());
    let throughput = match begun {
        Some(begun) => measured as f64 / (last - begun).as_secs_f64(),
        // A backlog is timed from its first continuation to its last.
        None => (measured - 1) as f64 / (last - first).as_secs_f64(),
    };
    Measured {
        prefix,
        throughput,
        latency: Latency::of(latencies),
        worker_rss,
        wake_rss,
        posts,
        cpu,
        stages,
        writes,
    }
}

/// `instant` as wall-clock time, by its distance from `anchor` (taken together).
fn wall(anchor: (Instant, SystemTime), instant: Instant) -> SystemTime {
    match instant.checked_duration_since(anchor.0) {
        Some(after) => anchor.1 + after,
        None => anchor.1 - anchor.0.duration_since(instant),
    }
}

fn run_of(workers: usize, n: usize, m: &Measured) -> Run {
    Run {
        workers,
        delegations: n,
        throughput: m.throughput,
        latency: m.latency.clone(),
        posts: m.posts,
        worker_peak_rss_mib: m.worker_rss,
        wake_peak_rss_mib: m.wake_rss,
    }
}

/// Runs a ceiling, which runs in this process, and its CPU per message:
/// this process's and the server's.
async fn in_process(
    server: &NatsServer,
    n: usize,
    run: impl Future<Output = f64>,
) -> (f64, CpuPerDelegation) {
    let before = [
        procs::cpu_seconds(std::process::id()),
        procs::cpu_seconds(server.pid()),
    ];
    let per_second = run.await;
    let per_message = |now: f64, then: f64| (now - then) * 1e6 / n as f64;
    let cpu = CpuPerDelegation {
        bench_process_us: per_message(procs::cpu_seconds(std::process::id()), before[0]),
        nats_server_us: per_message(procs::cpu_seconds(server.pid()), before[1]),
        ..CpuPerDelegation::default()
    };
    (per_second, cpu)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken from argv.
    let config = Config::from_env();
    std::fs::create_dir_all(&config.out).expect("output directory");
    let server = NatsServer::start().await;
    let machine = Machine::detect(&server.version);
    eprintln!(
        "wakebus bench: {} CPUs ({}), {}",
        machine.cpus, machine.cpu_model, machine.nats_server
    );

    eprintln!("raw JetStream ceiling, {} messages...", config.n);
    let (ceiling, ceiling_cpu_us) = in_process(
        &server,
        config.n,
        raw::ceiling(&server.url, "RAW", config.n),
    )
    .await;

    let single = config.workers.first().copied().unwrap_or(1);
    eprintln!(
        "saturation, {} delegations, {single} worker(s)...",
        config.n
    );
    let saturation = scenario(&server, &config, single, Load::Saturation(config.n)).await;

    // What its delegations stored, message by message, for the ceiling to
    // store the same bytes.
    let messages = sample::Messages::sample(&connect(&server.url, &saturation.prefix).await).await;
    let same_work_message_bytes = messages.bytes();
    // The ceiling runs on a server as empty as the raw ceiling's: without
    // the saturation run's streams, consumers and held locks.
    same_work::SameWork::clean_up(&server.url, &saturation.prefix).await;
    // As many lock writes per delegation as the saturation run stored,
    // made as take-and-release pairs.
    let lock_share = (saturation.writes.session_locks / 2.0).min(1.0);
    eprintln!(
        "same-work ceiling, {} delegations, {:.2} lock writes each...",
        config.n,
        2.0 * lock_share
    );
    // A prefix as long as a scenario's.
    let ceiling_prefix = format!("c{}", ulid::Ulid::new().to_string().to_ascii_lowercase());
    let same_work =
        same_work::SameWork::prepare(&server.url, &ceiling_prefix, &config, lock_share, messages)
            .await;
    let (same_work_per_s, same_work_cpu_us) = in_process(&server, config.n, same_work.run()).await;
    let same_work_writes = same_work::SameWork::clean_up(&server.url, &ceiling_prefix).await;
    let same_work_writes = StoredWrites::between([0; 4], same_work_writes, config.n);

    let open_n = config.rate * config.open_loop.as_secs() as usize;
    eprintln!("open loop, {}/s for {:?}...", config.rate, config.open_loop);
    let open = scenario(
        &server,
        &config,
        single,
        Load::OpenLoop {
            n: open_n,
            rate: config.rate,
        },
    )
    .await;

    let mut scaling = Vec::new();
    for &workers in &config.workers {
        eprintln!("scaling, {workers} worker(s)...");
        let m = if workers == single {
            None
        } else {
            Some(scenario(&server, &config, workers, Load::Saturation(config.n)).await)
        };
        scaling.push(run_of(workers, config.n, m.as_ref().unwrap_or(&saturation)));
    }

    let mut backlog = Vec::new();
    for &queued in &config.backlogs {
        eprintln!("backlog of {queued}, {single} worker(s)...");
        let m = scenario(&server, &config, single, Load::Backlog(queued)).await;
        backlog.push(BacklogRun {
            queued,
            throughput: m.throughput,
            worker_peak_rss_mib: m.worker_rss,
            wake_peak_rss_mib: m.wake_rss,
        });
    }

    let report = Report {
        command: "cargo bench --bench pipeline".to_owned(),
        machine,
        worker_concurrency: config.concurrency,
        sessions: config.sessions,
        ceiling_msgs_per_s: ceiling,
        saturation: run_of(single, config.n, &saturation),
        ratio_to_ceiling: saturation.throughput / ceiling,
        saturation_writes: saturation.writes.clone(),
        same_work_per_s,
        same_work_writes,
        same_work_message_bytes,
        ratio_to_same_work: saturation.throughput / same_work_per_s,
        open_loop_offered_per_s: config.rate,
        open_loop: run_of(single, open_n, &open),
        saturation_stages: saturation.stages.clone(),
        open_loop_stages: open.stages.clone(),
        scaling,
        backlog,
        saturation_cpu: saturation.cpu.clone(),
        ceiling_cpu_us,
        same_work_cpu_us,
        nats_server_peak_rss_mib: procs::peak_rss_mib(server.pid()),
    };
    print!("{}", report.table());
    let json = config.out.join("pipeline.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&report).expect("json")).expect("write json");
    let svg = config.out.join("pipeline.svg");
    chart::render(&report, &svg);
    eprintln!("wrote {} and {}", json.display(), svg.display());
}
