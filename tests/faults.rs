//! Fault injection with real processes: SIGKILLed workers and wake services,
//! SIGTERM shutdown, an outage of the session API, nats-server restarts and
//! every request published twice, with a ledger proving that every accepted
//! delegation woke its own session exactly once.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::process::{LogsOnPanic, Service, sample, wake_args, worker_args};
use common::raw;
use common::*;
use futures::StreamExt as _;
use nix::sys::signal::Signal;
use wakebus::bus::Bus;
use wakebus::delegate::Delegation;
use wakebus::protocol::{CompletionEvent, StartedEvent, Status, TaskRequest};

async fn events(bus: &Bus, suffix: &str) -> Vec<async_nats::jetstream::message::StreamMessage> {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .filter(|m| m.subject.ends_with(suffix))
        .collect()
}

/// A NATS server, a session API and a prefix, with `wakebus` processes
/// started against them, each logging to its own file.
struct Rig {
    /// The server every process of the test talks to.
    nats: NatsServer,
    /// Where the wake service posts continuations.
    api: SessionApiServer,
    /// This test's subject and stream prefix.
    prefix: String,
    /// The test's own connection, for delegating and reading history.
    bus: Bus,
    /// The processes' log files and the scripts' marker files.
    logs: tempfile::TempDir,
}

impl Rig {
    async fn start() -> Self {
        init_logs();
        let nats = NatsServer::start().await;
        let api = SessionApiServer::start().await;
        let prefix = unique_prefix();
        let bus = bus(&nats.url(), &prefix).await;
        let logs = tempfile::tempdir().unwrap();
        Self {
            nats,
            api,
            prefix,
            bus,
            logs,
        }
    }

    /// A `command` worker running `script`, logging to `<name>.log`.
    fn worker(&self, name: &str, script: &str, extra: &[&str]) -> Service {
        Service::spawn(
            worker_args(&self.nats.url(), &self.prefix, script, extra),
            self.logs.path().join(format!("{name}.log")),
        )
    }

    /// A wake service posting to the session API, logging to `<name>.log`.
    fn wake(&self, name: &str) -> Service {
        Service::spawn(
            wake_args(&self.nats.url(), &self.prefix, &self.api.url()),
            self.logs.path().join(format!("{name}.log")),
        )
    }

    /// Starts a wake (with session locks living `lock_ttl`) whose every
    /// post fails (503), so that it holds each completion and keeps it
    /// alive while it retries, and publishes
    /// `sessions` completions, each for its own session; returns once a
    /// post was tried for every one.
    async fn wake_holding_failing_sessions(&self, sessions: usize, lock_ttl: &str) -> Service {
        self.api.fail_always(503);
        let mut args = wake_args(&self.nats.url(), &self.prefix, &self.api.url());
        let ttl = args
            .iter()
            .position(|arg| arg == "--session-lock-ttl")
            .expect("wake_args sets a lock TTL");
        args[ttl + 1] = lock_ttl.to_owned();
        let wake = Service::spawn(args, self.logs.path().join("wake.log"));
        for i in 0..sessions {
            common::cli::publish_task(&self.bus, Some(&format!("s.held.{i}")), Status::Completed)
                .await;
        }
        wait_until(
            Duration::from_secs(60),
            "a post tried for every session",
            || async {
                let tried: HashSet<String> =
                    self.api.all_posts().iter().map(|p| p.session()).collect();
                tried.len() == sessions
            },
        )
        .await;
        wake
    }

    /// Publishes a request for `session` and waits until it has started.
    async fn delegate_and_wait_started(&self, session: &str, goal: &str) -> TaskRequest {
        let req = request(session, goal);
        publish_until_stored(&self.bus, &req).await;
        wait_until(Duration::from_secs(30), "the task to start", || async {
            !events(&self.bus, ".started").await.is_empty()
        })
        .await;
        req
    }
}

#[tokio::test]
async fn a_worker_killed_mid_task_is_rerun_by_another_and_wakes_once() {
    let rig = Rig::start().await;
    let (bus, api) = (&rig.bus, &rig.api);
    // The task runs until the test lets it end: after the kill.
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("finish");
    let script = format!(
        "while [ ! -e '{}' ]; do sleep 0.05; done; echo finished",
        gate.display()
    );
    let script = script.as_str();
    let mut workers: Vec<Service> = (0..2)
        .map(|i| rig.worker(&format!("worker{i}"), script, &[]))
        .collect();
    let _wake = rig.wake("wake");
    let req = rig
        .delegate_and_wait_started("s.crash", "survive a crash")
        .await;
    let started: StartedEvent =
        serde_json::from_slice(&events(bus, ".started").await[0].payload).unwrap();
    let victim = workers
        .iter_mut()
        .find(|w| started.worker.ends_with(&format!("-{}", w.pid())))
        .expect("the worker that started the task");
    victim.kill();
    std::fs::write(&gate, "").unwrap();

    wait_until(Duration::from_secs(60), "the wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    assert_eq!(
        events(bus, ".started").await.len(),
        2,
        "rerun by the other worker"
    );
    let done = events(bus, ".done").await;
    assert_eq!(done.len(), 1);
    let done = CompletionEvent::decode(&done[0].payload).unwrap();
    assert_eq!(done.summary.as_deref(), Some("finished"));
    assert_eq!(api.accepted().len(), 1);
    assert_eq!(api.accepted()[0].delegation_ids(), vec![req.delegation_id]);
}

/// The worker consumer's state.
async fn worker_consumer_info(bus: &Bus) -> async_nats::jetstream::consumer::Info {
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = bus
        .js
        .get_consumer_from_stream(
            bus.subjects.worker_consumer("default"),
            bus.subjects.tasks_stream(),
        )
        .await
        .expect("the worker consumer");
    consumer.info().await.expect("consumer info").clone()
}

#[tokio::test]
async fn a_worker_frozen_past_its_ack_wait_leaves_the_redelivery_to_its_running_attempt() {
    let rig = Rig::start().await;
    let (bus, api) = (&rig.bus, &rig.api);
    // The task's shell is a child process: it keeps running while the
    // worker is frozen, as a subagent would.
    // It finishes only when the test says so, after the redelivery was seen.
    let release = rig.logs.path().join("release");
    let script = format!(
        "until [ -e {r} ]; do sleep 0.1; done; echo finished",
        r = release.display()
    );
    let ack_wait = Duration::from_secs(1);
    let worker = rig.worker("worker", &script, &["--ack-wait", "1s"]);
    let _wake = rig.wake("wake");
    rig.delegate_and_wait_started("s.frozen", "outlive a stall")
        .await;

    // The fault itself: no in-progress ack for three AckWaits, so the server
    // hands the task out again, and only this worker is there to take it.
    // The sleep is the length of the stall, not a wait for a condition.
    worker.signal(Signal::SIGSTOP);
    tokio::time::sleep(3 * ack_wait).await;
    worker.signal(Signal::SIGCONT);
    wait_until(
        Duration::from_secs(30),
        "the worker to leave the redelivery to the running attempt",
        || async {
            std::fs::read_to_string(&worker.log)
                .is_ok_and(|log| log.contains("leaving it to the running attempt"))
        },
    )
    .await;
    assert!(worker_consumer_info(bus).await.delivered.consumer_sequence >= 2);
    std::fs::write(&release, b"").unwrap();

    wait_until(Duration::from_secs(30), "the wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "the worker consumer to settle",
        || async { worker_consumer_info(bus).await.num_ack_pending == 0 },
    )
    .await;
    assert_eq!(
        events(bus, ".started").await.len(),
        1,
        "the redelivery must not start a second run"
    );
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(
        !log.contains("Completion already published"),
        "the running attempt's ack settled the message, with no later delivery:\n{log}"
    );
    let done = events(bus, ".done").await;
    assert_eq!(done.len(), 1);
    let done = CompletionEvent::decode(&done[0].payload).unwrap();
    assert_eq!(done.summary.as_deref(), Some("finished"));
    assert_eq!(api.accepted().len(), 1);
}

#[tokio::test]
async fn sigterm_hands_running_work_back_at_once_and_exits_zero() {
    let rig = Rig::start().await;
    let (bus, api) = (&rig.bus, &rig.api);
    let mark = rig.logs.path().join("first-run");
    let script = format!(
        "if [ -e {m} ]; then echo second run; else touch {m}; sleep 60; fi",
        m = mark.display()
    );
    // AckWait is long: only a NAK on shutdown gets the task to B quickly.
    let extra = ["--ack-wait", "60s", "--shutdown-grace", "1s"];
    let mut first = rig.worker("first", &script, &extra);
    let _wake = rig.wake("wake");
    let req = request("s.term", "hand me back");
    publish_until_stored(bus, &req).await;
    wait_until(Duration::from_secs(30), "the first run", || async {
        mark.exists()
    })
    .await;

    let _second = rig.worker("second", &script, &extra);
    let status = first
        .signal_and_wait(Signal::SIGTERM, Duration::from_secs(20))
        .await;
    assert!(status.success(), "worker exited with {status}");
    wait_until(
        Duration::from_secs(20),
        "the wake from the second worker",
        || async { !api.accepted().is_empty() },
    )
    .await;
    assert!(api.accepted()[0].text().contains("second run"));
    assert_eq!(events(bus, ".done").await.len(), 1);
}

#[tokio::test]
async fn a_hangup_stops_the_worker_and_the_wake_as_gracefully_as_sigterm() {
    let rig = Rig::start().await;
    // Started from a terminal or SSH session that then closes: left to
    // SIGHUP's default, each would die on the spot, leaving its running
    // tasks' programs behind. The closing shell and then the kernel each
    // send one: the second is no order to stop at once.
    let extra = ["--shutdown-grace", "1s"];
    let mut worker = rig.worker("worker", "sleep 60", &extra);
    let mut wake = rig.wake("wake");
    rig.delegate_and_wait_started("s.hangup", "outlive the terminal")
        .await;
    wait_until(Duration::from_secs(30), "the wake to start", || async {
        std::fs::read_to_string(&wake.log).is_ok_and(|log| log.contains("Wake service started."))
    })
    .await;
    for (service, stopped) in [
        (&mut worker, "Worker stopped."),
        (&mut wake, "Wake service stopped."),
    ] {
        service.signal(Signal::SIGHUP);
        // The second once the first is taken: sent together, they are one.
        wait_until(
            Duration::from_secs(10),
            "the first hangup taken",
            || async {
                std::fs::read_to_string(&service.log)
                    .is_ok_and(|log| log.contains("Shutdown signal received"))
            },
        )
        .await;
        let status = service
            .signal_and_wait(Signal::SIGHUP, Duration::from_secs(30))
            .await;
        assert!(status.success(), "exited with {status}");
        let log = std::fs::read_to_string(&service.log).unwrap();
        assert!(
            log.contains("signal=\"SIGHUP\"") || log.contains("signal=SIGHUP"),
            "{log}"
        );
        assert!(log.contains(stopped), "{log}");
        assert!(!log.contains("Second shutdown signal"), "{log}");
    }
}

/// Started with `nohup` (SIGHUP ignored), a service is meant to outlive
/// its terminal: it leaves SIGHUP ignored and runs on when the session
/// closes, and still stops on SIGTERM.
#[tokio::test]
async fn a_worker_started_under_nohup_runs_on_after_a_hangup() {
    let rig = Rig::start().await;
    let mut worker = Service::spawn_ignoring_hangups(
        worker_args(&rig.nats.url(), &rig.prefix, "echo ran", &[]),
        rig.logs.path().join("worker.log"),
    );
    let _wake = rig.wake("wake");
    wait_until(Duration::from_secs(30), "the worker to start", || async {
        std::fs::read_to_string(&worker.log).is_ok_and(|log| log.contains("Worker started"))
    })
    .await;
    // Its signal handlers are installed by now: SIGHUP is not among them.
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
    let mask = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        u64::from_str_radix(line[name.len()..].trim(), 16).unwrap()
    };
    assert_eq!(mask("SigIgn:") & 1, 1, "SIGHUP still ignored:\n{status}");
    assert_eq!(mask("SigCgt:") & 1, 0, "SIGHUP not caught:\n{status}");
    assert_ne!(mask("SigCgt:") & (1 << 14), 0, "SIGTERM caught:\n{status}");

    worker.signal(Signal::SIGHUP);
    let req = request("s.nohup", "after the hangup");
    publish_until_stored(&rig.bus, &req).await;
    wait_until(Duration::from_secs(30), "the task's wake", || async {
        !rig.api.accepted().is_empty()
    })
    .await;
    let status = worker
        .signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
        .await;
    assert!(status.success(), "exited with {status}");
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(
        log.contains("signal=\"SIGTERM\"") || log.contains("signal=SIGTERM"),
        "{log}"
    );
    assert!(!log.contains("SIGHUP"), "{log}");
}

#[tokio::test]
async fn a_wake_holding_hundreds_of_completions_through_an_outage_still_stops_on_sigterm() {
    let mut rig = Rig::start().await;
    let mut wake = rig.wake_holding_failing_sessions(600, "3s").await;

    rig.nats.kill();
    // The outage itself, long enough for every session to find its lock
    // refresh failing and to try to take the lock again. Each of those
    // sends, queued in the NATS client while it reconnects, filled its
    // 2,048-command queue within 12 s, after which every send, the
    // hand-backs at shutdown included, waited for the server: the wake
    // never exited. Queued keep-alives would have filled it in under 3 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let status = wake
        .signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
        .await;
    assert!(status.success(), "wake exited with {status}");
    // Not ended by the stop's last resort (the request timeout plus 10 s):
    // nothing the sessions did while stopping waited for the server.
    let log = std::fs::read_to_string(&wake.log).unwrap();
    assert!(log.contains("Wake service stopped."), "{log}");
    assert!(!log.contains("Stopping without waiting longer"), "{log}");
}

#[tokio::test]
async fn sessions_held_through_an_outage_longer_than_a_lock_refresh_are_each_woken_once_after_it() {
    const HELD: usize = 100;
    let mut rig = Rig::start().await;
    let wake = rig.wake_holding_failing_sessions(HELD, "30s").await;

    // Longer than a lock refresh (every 10 s, a third of the 30 s TTL),
    // shorter than the TTL: each session's lock goes unrefreshed but stays,
    // is kept by the wake as its own, and is adopted after the outage
    // instead of waited out.
    rig.nats.kill();
    tokio::time::sleep(Duration::from_secs(12)).await;
    rig.nats.restart().await;
    rig.api.recover();

    wait_until(Duration::from_secs(60), "every session woken", || async {
        let sessions: HashSet<String> = rig.api.accepted().iter().map(|p| p.session()).collect();
        sessions.len() == HELD
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "the wake consumer to settle",
        || async {
            wake_consumer_info(&rig.bus)
                .await
                .is_some_and(|info| info.num_ack_pending == 0 && info.num_pending == 0)
        },
    )
    .await;
    assert_eq!(rig.api.accepted().len(), HELD, "a session was woken twice");
    let log = std::fs::read_to_string(&wake.log).unwrap();
    assert_eq!(
        log.matches("Took back a session lock").count(),
        HELD,
        "every session's lock adopted:\n{log}"
    );
}

#[tokio::test]
async fn a_second_sigterm_ends_a_worker_waiting_out_its_shutdown_grace() {
    let rig = Rig::start().await;
    let pid_file = rig.logs.path().join("program.pid");
    let script = format!("echo $$ > {}; exec sleep 60", pid_file.display());
    let mut worker = rig.worker("worker", &script, &["--shutdown-grace", "60s"]);
    rig.delegate_and_wait_started("s.twice", "long").await;
    let pid = eventually_read(&pid_file).await;

    // The first signal starts the graceful stop: the running task gets its
    // 60 s of grace.
    worker.signal(Signal::SIGTERM);
    let log = worker.log.clone();
    wait_until(Duration::from_secs(30), "the graceful stop", || async {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("Worker stopping"))
    })
    .await;
    // The second ends it now.
    let status = worker
        .signal_and_wait(Signal::SIGTERM, Duration::from_secs(10))
        .await;
    assert_eq!(status.code(), Some(130), "{status}");
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(log.contains("Second shutdown signal"), "{log}");
    // Its task's program is stopped too: left running, it would go on
    // while another worker runs the redelivered task.
    wait_until(
        Duration::from_secs(10),
        "the task's program gone",
        || async {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |stat| stat.contains(") Z "))
        },
    )
    .await;
}

/// The trimmed contents of `path` once it has some.
async fn eventually_read(path: &std::path::Path) -> String {
    let mut text = String::new();
    wait_until(Duration::from_secs(30), "the file written", || {
        text = std::fs::read_to_string(path)
            .unwrap_or_default()
            .trim()
            .to_owned();
        let written = !text.is_empty();
        async move { written }
    })
    .await;
    text
}

#[tokio::test]
async fn a_worker_and_a_wake_stopped_while_nats_is_down_exit_without_waiting_for_it() {
    let mut rig = Rig::start().await;
    let mut worker = rig.worker("worker", "echo ok", &[]);
    let mut wake = rig.wake("wake");
    // Both connected and working.
    delegate(
        &rig.bus,
        Delegation::new("before the outage").session("s.down"),
    )
    .await;
    wait_until(Duration::from_secs(30), "the wake", || async {
        rig.api.accepted().len() == 1
    })
    .await;

    rig.nats.kill();
    // A flush or a drain would wait for the server to come back; stopping
    // gives up on them after a bound instead.
    for (name, service) in [("worker", &mut worker), ("wake", &mut wake)] {
        let status = service
            .signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
            .await;
        assert!(status.success(), "{name} exited with {status}");
    }
}

#[tokio::test]
async fn a_worker_and_a_wake_still_waiting_for_nats_to_start_stop_on_the_first_sigterm() {
    // Nothing listens there: both keep retrying their provisioning.
    let url = format!("nats://127.0.0.1:{}", nats::free_port());
    let prefix = unique_prefix();
    let logs = tempfile::tempdir().unwrap();
    let mut services = [
        (
            "worker",
            Service::spawn(
                worker_args(&url, &prefix, "echo ok", &[]),
                logs.path().join("worker.log"),
            ),
        ),
        (
            "wake",
            Service::spawn(
                // Port 1: nothing listens there (never reached: NATS is not up).
                wake_args(&url, &prefix, "http://127.0.0.1:1/"),
                logs.path().join("wake.log"),
            ),
        ),
    ];
    for (name, service) in &services {
        wait_until(
            Duration::from_secs(60),
            &format!("the {name} to retry provisioning"),
            || async {
                std::fs::read_to_string(&service.log)
                    .unwrap_or_default()
                    .contains("Provisioning failed")
            },
        )
        .await;
    }

    for (name, service) in &mut services {
        let status = service
            .signal_and_wait(Signal::SIGTERM, Duration::from_secs(10))
            .await;
        assert!(status.success(), "{name} exited with {status}");
        let log = std::fs::read_to_string(&service.log).unwrap();
        assert!(log.contains("stopped before it started"), "{name}: {log}");
    }
}

#[tokio::test]
async fn every_delegation_wakes_its_session_exactly_once_through_crashes_outages_and_restarts() {
    init_logs();
    const N: usize = 300;
    let mut nats = NatsServer::start().await;
    let url = nats.url();
    let api = SessionApiServer::start().await;
    api.set_delay(Duration::from_millis(10));
    let prefix = unique_prefix();
    let bus = bus(&url, &prefix).await;
    let logs = tempfile::tempdir().unwrap();
    let mut workers: Vec<Service> = (0..2)
        .map(|i| {
            Service::spawn(
                worker_args(&url, &prefix, "sleep 0.1; echo ok", &[]),
                logs.path().join(format!("worker{i}.log")),
            )
        })
        .collect();
    let mut wakes: Vec<Service> = (0..2)
        .map(|i| {
            Service::spawn(
                wake_args(&url, &prefix, &api.url()),
                logs.path().join(format!("wake{i}.log")),
            )
        })
        .collect();

    // Every request is published twice, at about 100 per second.
    let requests: Vec<TaskRequest> = (0..N)
        .map(|i| request(&format!("session.{}", i % 10), &format!("task {i}")))
        .collect();
    let expected: HashMap<String, String> = requests
        .iter()
        .map(|r| {
            (
                r.delegation_id.clone(),
                r.origin_session_id.clone().unwrap(),
            )
        })
        .collect();
    let publisher = {
        let bus = bus.clone();
        tokio::spawn(async move {
            for request in &requests {
                publish_until_stored(&bus, request).await;
                publish_until_stored(&bus, request).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let woken = |api: &SessionApiServer| -> usize {
        api.turns()
            .iter()
            .flat_map(|t| t.delegation_ids())
            .collect::<HashSet<_>>()
            .len()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    let mut phase = 0;
    let mut refused_at_outage = 0;
    loop {
        let n = woken(&api);
        match phase {
            0 if n >= 30 => {
                api.fail_always(500);
                refused_at_outage = api.all_posts().len();
                phase += 1;
            }
            1 if api.all_posts().len() >= refused_at_outage + 10 => {
                api.recover();
                phase += 1;
            }
            2 if n >= 80 => {
                workers[0].kill();
                workers[0].restart();
                phase += 1;
            }
            3 if n >= 120 => {
                wakes[0].kill();
                wakes[0].restart();
                phase += 1;
            }
            4 if n >= 160 => {
                nats.restart_gracefully().await;
                phase += 1;
            }
            5 if n >= 220 => {
                nats.restart().await;
                phase += 1;
            }
            6 if n >= N => break,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stuck in phase {phase} with {n} of {N} woken; logs in {}",
            logs.keep().display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.await.unwrap();

    // The ledger: each delegation in exactly one turn, of its own session.
    let mut turns_per_delegation: HashMap<String, usize> = HashMap::new();
    for turn in api.turns() {
        for id in turn.delegation_ids() {
            assert_eq!(expected[&id], turn.session(), "{id} woke the wrong session");
            *turns_per_delegation.entry(id).or_default() += 1;
        }
    }
    assert_eq!(
        turns_per_delegation.len(),
        N,
        "some delegation was never woken"
    );
    let doubled: Vec<_> = turns_per_delegation
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| {
            let keys: Vec<String> = api
                .turns()
                .iter()
                .filter(|t| t.delegation_ids().contains(id))
                .map(|t| t.header("idempotency-key").unwrap_or_default())
                .collect();
            (id, n, keys, logs.path().display().to_string())
        })
        .collect();
    if !doubled.is_empty() {
        let kept = logs.keep();
        panic!(
            "woken more than once: {doubled:?}; logs kept in {}",
            kept.display()
        );
    }
    // A repeated post only ever repeats an earlier key (a post in doubt),
    // so a session API honouring Idempotency-Key never shows a second turn.
    assert_eq!(api.delegations_under_two_keys(), Vec::<String>::new());
}

/// A worker whose one task ends when the test says so, leaving a line in
/// `runs` each time it starts.
struct HeldTask {
    script: String,
    runs: std::path::PathBuf,
    release: std::path::PathBuf,
    worker: Service,
}

impl Rig {
    /// Starts a worker (with `extra` flags) and a wake, and a task for
    /// `session` that runs until released.
    async fn held_task(&self, session: &str, extra: &[&str]) -> (HeldTask, Service) {
        let runs = self.logs.path().join("runs");
        let release = self.logs.path().join("release");
        let script = format!(
            "echo run >> {runs}; until [ -e {r} ]; do sleep 0.1; done; echo finished",
            runs = runs.display(),
            r = release.display()
        );
        let worker = self.worker("worker", &script, extra);
        let wake = self.wake("wake");
        self.delegate_and_wait_started(session, "held until released")
            .await;
        // Done provisioning (which would put the stream's limits back).
        wait_until(Duration::from_secs(30), "the wake's consumer", || async {
            wake_consumer_info(&self.bus).await.is_some()
        })
        .await;
        let held = HeldTask {
            script,
            runs,
            release,
            worker,
        };
        (held, wake)
    }

    /// Waits for the wake and for the worker consumer to settle, then
    /// checks that the held task ran `runs` times and has one completion
    /// (its own output) and one wake.
    async fn assert_finished_once_and_woken_once(&self, task: &HeldTask, runs: usize) {
        wait_until(Duration::from_secs(60), "the wake", || async {
            !self.api.accepted().is_empty()
        })
        .await;
        wait_until(
            Duration::from_secs(30),
            "the worker consumer to settle",
            || async {
                let info = worker_consumer_info(&self.bus).await;
                info.num_ack_pending == 0 && info.num_pending == 0
            },
        )
        .await;
        assert_eq!(
            task.runs(),
            runs,
            "how often the task ran:\n{}",
            std::fs::read_to_string(&task.worker.log).unwrap_or_default()
        );
        let done = events(&self.bus, ".done").await;
        assert_eq!(done.len(), 1);
        let done = CompletionEvent::decode(&done[0].payload).unwrap();
        assert_eq!(done.summary.as_deref(), Some("finished"));
        assert_eq!(self.api.accepted().len(), 1);
    }

    /// Makes the events stream refuse new messages (a limit reached with
    /// discard=new, as on a full disk); returns its config to restore.
    async fn fill_events_stream(&self) -> async_nats::jetstream::stream::Config {
        let name = self.bus.subjects.events_stream();
        let mut stream = self.bus.js.get_stream(&name).await.unwrap();
        let info = stream.info().await.unwrap().clone();
        assert!(info.state.messages > 0, "the started event is stored");
        let mut full = info.config.clone();
        full.max_messages = info.state.messages as i64;
        full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
        self.bus.js.update_stream(&full).await.unwrap();
        info.config
    }
}

impl HeldTask {
    /// Ends the run and waits until its completion was refused.
    async fn release_and_see_the_completion_refused(&self) {
        std::fs::write(&self.release, b"").unwrap();
        wait_until(
            Duration::from_secs(30),
            "the worker to fail to publish the completion",
            || async {
                std::fs::read_to_string(&self.worker.log)
                    .is_ok_and(|log| log.contains("Could not publish the completion"))
            },
        )
        .await;
    }

    fn runs(&self) -> usize {
        std::fs::read_to_string(&self.runs).unwrap().lines().count()
    }
}

#[tokio::test]
async fn a_task_whose_completion_cannot_be_stored_keeps_its_result_and_is_not_run_again() {
    let rig = Rig::start().await;
    let (task, _wake) = rig.held_task("s.full", &[]).await;
    let config = rig.fill_events_stream().await;
    task.release_and_see_the_completion_refused().await;
    // The operator makes room.
    rig.bus.js.update_stream(&config).await.unwrap();

    rig.assert_finished_once_and_woken_once(&task, 1).await;
}

#[tokio::test]
async fn a_worker_stopping_while_its_completion_cannot_be_stored_hands_the_task_back() {
    let rig = Rig::start().await;
    let (mut task, _wake) = rig.held_task("s.full", &["--shutdown-grace", "1s"]).await;
    let config = rig.fill_events_stream().await;
    task.release_and_see_the_completion_refused().await;

    let status = task
        .worker
        .signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
        .await;
    assert!(status.success(), "worker exited with {status}");
    let log = std::fs::read_to_string(&task.worker.log).unwrap();
    assert!(
        log.contains("the worker is stopping; handing the task back"),
        "{log}"
    );

    // Its result is gone with it: the next worker runs the task again, and
    // the session is woken once.
    rig.bus.js.update_stream(&config).await.unwrap();
    let _next = rig.worker("next", &task.script, &[]);
    rig.assert_finished_once_and_woken_once(&task, 2).await;
}

#[tokio::test]
async fn a_task_that_ends_while_nats_is_down_is_stored_once_nats_returns_and_not_run_again() {
    let mut rig = Rig::start().await;
    let (task, _wake) = rig.held_task("s.outage", &[]).await;
    rig.nats.kill();
    task.release_and_see_the_completion_refused().await;
    rig.nats.spawn();
    rig.nats.wait_ready().await;

    rig.assert_finished_once_and_woken_once(&task, 1).await;
}

/// async-nats 0.51 panicked in its connection task on a header value
/// holding a carriage return (nats-server stores and delivers it without
/// checking), and the client never worked again: every such message
/// stopped the service it reached. 0.52 reads the value with a space in
/// place of the carriage return, so the request runs and wakes its session,
/// the completion that cannot be decoded is dead-lettered, and neither
/// service stops.
#[tokio::test]
async fn a_header_value_with_a_carriage_return_is_handled_like_any_other_message() {
    let rig = Rig::start().await;
    let (bus, api) = (&rig.bus, &rig.api);
    let mut worker = rig.worker("worker", "echo finished", &[]);
    let mut wake = rig.wake("wake");
    let _logs = LogsOnPanic(vec![worker.log.clone(), wake.log.clone()]);

    let headers = b"NATS/1.0\r\nWakebus-Origin-Session: s.cr\r\nX-Note: one\rtwo\r\n\r\n";
    let task = serde_json::to_vec(&request("s.cr", "run despite its header")).unwrap();
    let refused = raw::hpub(rig.nats.port, &bus.subjects.task("default"), headers, &task).await;
    assert_eq!(refused, None, "nats-server stores it without complaint");
    let token = wakebus::protocol::session_token("s.cr");
    let completion = format!("{}.evt.{token}.crdone.0.done", bus.subjects.prefix());
    let refused = raw::hpub(rig.nats.port, &completion, headers, b"{}").await;
    assert_eq!(refused, None);

    wait_until(
        Duration::from_secs(30),
        "the request with the carriage return woken",
        || async { api.accepted().iter().any(|p| p.session() == "s.cr") },
    )
    .await;
    publish_until_stored(bus, &request("s.after", "after")).await;
    wait_until(Duration::from_secs(30), "the later wake", || async {
        api.accepted().iter().any(|p| p.session() == "s.after")
    })
    .await;
    wake_consumer_settled(bus).await;
    wait_until(
        Duration::from_secs(30),
        "the worker consumer settled",
        || async {
            let info = worker_consumer_info(bus).await;
            info.num_ack_pending == 0 && info.num_pending == 0
        },
    )
    .await;

    for (name, service) in [("worker", &mut worker), ("wake", &mut wake)] {
        assert!(service.is_running(), "{name} exited");
        let log = std::fs::read_to_string(&service.log).unwrap();
        assert!(!log.contains("stopped working"), "{name}:\n{log}");
    }
    let dead = all_messages(bus, &bus.subjects.dead_letter_stream()).await;
    let dead: Vec<(&str, Option<String>)> = dead
        .iter()
        .map(|m| {
            let reason = m.headers.get("Wakebus-Dead-Letter-Reason");
            (m.subject.as_str(), reason.map(ToString::to_string))
        })
        .collect();
    assert_eq!(dead.len(), 1, "only the undecodable completion: {dead:?}");
    assert!(dead[0].0.ends_with(".dlq.wake.poison"), "{dead:?}");
    let woken: Vec<String> = api.accepted().iter().map(|p| p.session()).collect();
    assert_eq!(woken, ["s.cr", "s.after"]);
}

/// A task published while the only worker is stopping lands in the pull
/// that worker still has open. Handed back at once, it would come straight
/// back into that same pull, once per free slot, and the next worker would
/// give it up as delivered too often without ever running it; handed back
/// for after that pull has ended, it is delivered once more and run.
#[tokio::test]
async fn a_task_arriving_while_the_only_worker_stops_is_run_by_the_next_worker() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let wait = Duration::from_secs(30);
    let mut stopping = Services::new();
    stopping.echo_worker(&bus);
    worker_pulling(&bus, "default").await;
    stopping.stop.cancel();
    publish_until_stored(&bus, &request("s.late", "arrives during the stop")).await;
    stopping.stop().await;

    let mut next = Services::new();
    next.echo_worker(&bus);
    wait_until(wait, "the completion", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    next.stop().await;
    let done = &done_events(&bus).await[0];
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Completed, "completed"),
        "{done:?}"
    );
}

/// A worker cut off from NATS for part of its keep-alive period sends its
/// next in-progress ack as soon as it is back, not a whole period later:
/// here the consumer's AckWait (7 s, set by another instance) is shorter
/// than this worker's own (15 s, a keep-alive every 5 s), and an outage
/// from one keep-alive to just after the next would otherwise leave the
/// running task without one until after the AckWait, so that the server
/// handed it to another worker while it still runs here.
#[tokio::test]
async fn a_running_task_gets_its_keep_alive_as_soon_as_its_worker_reconnects() {
    init_logs();
    let CutWorker {
        nats: _nats,
        bus,
        proxy,
        worker_bus: _,
        services,
    } = CutWorker::start("sleep 60", Duration::from_secs(15)).await;
    publish_until_stored(&bus, &request("s.cut", "keeps running")).await;
    let wait = Duration::from_secs(30);
    wait_until(wait, "the task to start", || async {
        !events(&bus, ".started").await.is_empty()
    })
    .await;
    let tasks = bus.subjects.tasks_stream();
    let stream = bus.js.get_stream(&tasks).await.unwrap();
    let name = bus.subjects.worker_consumer("default");
    let mut consumer_config = stream.consumer_info(&name).await.unwrap().config;
    consumer_config.ack_wait = Duration::from_secs(7);
    stream.create_consumer(consumer_config).await.unwrap();

    let mut acks = bus
        .client
        .subscribe(format!("$JS.ACK.{tasks}.>"))
        .await
        .unwrap();
    cut_between_keep_alives(&proxy, &mut acks).await;
    let info = stream.consumer_info(&name).await.unwrap();
    assert_eq!(
        info.num_redelivered, 0,
        "handed to another worker: {info:?}"
    );
    services.stop().await;
}

/// An unusable request whose `error` completion cannot be stored (the
/// events stream between leaders) is kept, the completion tried again, and
/// its dead letter stored once. Handled again from the start on each
/// redelivery instead, it was dead-lettered again each time, stored again
/// once the dead letters' duplicate window had passed, and `replay tasks`
/// re-queued every copy: the task ran twice.
#[tokio::test]
async fn an_unusable_request_is_dead_lettered_once_while_its_completion_cannot_be_stored() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let dlq = bus.subjects.dead_letter_stream();
    // Its consumer made last, once its streams are as it wants them.
    wait_until(Duration::from_secs(30), "the worker's consumer", || async {
        bus.js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                bus.subjects.worker_consumer("default"),
                bus.subjects.tasks_stream(),
            )
            .await
            .is_ok()
    })
    .await;
    // Copies a second apart are stored twice.
    let mut dead_letters = bus.js.get_stream(&dlq).await.unwrap();
    let mut short = dead_letters.info().await.unwrap().config.clone();
    short.duplicate_window = Duration::from_secs(1);
    bus.js.update_stream(&short).await.unwrap();
    let events = events_stream_unanswered(&bus).await;
    let mut attempts = bus
        .client
        .subscribe(format!("{}.evt.>", bus.subjects.prefix()))
        .await
        .unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", "s.unusable");
    bus.js
        .publish_with_headers(bus.subjects.task("default"), headers, "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // Its completion tried for three seconds: three deliveries (1 and 2 s
    // apart) when each was handled from the start.
    tokio::time::timeout(Duration::from_secs(30), async {
        attempts.next().await.expect("a first attempt");
        let first = std::time::Instant::now();
        while first.elapsed() < Duration::from_secs(3) {
            attempts.next().await.expect("another attempt");
        }
    })
    .await
    .expect("the completion tried for three seconds");
    bus.js.update_stream(&events).await.unwrap();
    wait_until(
        Duration::from_secs(30),
        "the error completion stored",
        || async { done_events(&bus).await.len() == 1 },
    )
    .await;
    services.stop().await;
    let dead = all_messages(&bus, &dlq).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
}

/// A redelivered task is checked for a completion an earlier attempt
/// stored. When the worker's grace ends before the answer comes (no stream
/// answers: a leader election), it is not known to be undone, so it is
/// handed back: neither given up (past `--max-deliver`, as here), refused
/// nor run. Taken for undone, it was dead-lettered and marked failed,
/// though it may have completed.
#[tokio::test]
async fn a_task_whose_done_check_outlasts_the_grace_is_handed_back_not_given_up() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let ack_wait = Duration::from_secs(60);
    let consumer = bus.worker_consumer("default", ack_wait).await.unwrap();
    publish_until_stored(&bus, &request("s.grace", "delivered before")).await;
    // A first delivery, held here until the worker is ready: handed back
    // then, its next is the worker's and the second, one past its
    // --max-deliver.
    // A pull that waits for it (a fetch answers at once, and may come
    // before the consumer counts the message just stored).
    let mut delivered = consumer
        .batch()
        .max_messages(1)
        .expires(Duration::from_secs(10))
        .messages()
        .await
        .unwrap();
    let first = delivered.next().await.unwrap().unwrap();
    let mut config = test_worker_config("default");
    config.ack_wait = ack_wait;
    config.max_deliver = 1;
    config.shutdown_grace = Duration::from_secs(1);
    let mut services = Services::new();
    services.worker(&bus, shell("echo ran"), config);
    // Started (it sets its streams as it wants them), and waiting.
    wait_until(Duration::from_secs(30), "the worker pulling", || async {
        let mut consumer = consumer.clone();
        consumer.info().await.is_ok_and(|info| info.num_waiting > 0)
    })
    .await;
    // No stream answers on the events subjects from now on; this
    // subscriber keeps the worker's question from failing at once for
    // want of a responder: it waits for its answer.
    let events = events_stream_unanswered(&bus).await;
    let mut questions = bus
        .client
        .subscribe(format!("{}.evt.>", bus.subjects.prefix()))
        .await
        .unwrap();
    first
        .ack_with(async_nats::jetstream::AckKind::Nak(None))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), questions.next())
        .await
        .expect("the worker asking whether the task is done")
        .unwrap();
    services.stop().await;
    bus.js.update_stream(&events).await.unwrap();
    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert!(dead.is_empty(), "given up: {dead:?}");
    let queued = all_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(queued.len(), 1, "the request is still queued");
}

/// A completion is cut to fit the max payload of the server it is
/// published to, at every try: a task that ends while NATS is away, which
/// comes back taking smaller messages (`max_payload` lowered in a rolling
/// config change), gets its completion stored, cut to fit. Cut once for
/// the old server, it was refused by the client on every try, and the
/// task held its slot until the worker restarted.
#[tokio::test]
async fn a_completion_is_cut_again_for_a_server_that_comes_back_taking_smaller_messages() {
    init_logs();
    let confs = tempfile::tempdir().unwrap();
    let conf = |name: &str, max_payload: &str| {
        let path = confs.path().join(name);
        std::fs::write(&path, format!("max_payload: {max_payload}\n")).unwrap();
        path.display().to_string()
    };
    let (large, small) = (conf("large.conf", "8MB"), conf("small.conf", "1MB"));
    let mut nats = NatsServer::start_with(vec!["-c".into(), large]).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let ended = confs.path().join("ended");
    // 2 MB of output, of which the worker keeps 1 MiB: a completion the
    // large server takes and the small one does not.
    let script = format!(
        "sleep 2; head -c 2000000 /dev/zero | tr '\\0' a; touch {}",
        ended.display()
    );
    let mut services = Services::new();
    services.worker(&bus, shell(&script), test_worker_config("default"));
    let req = request("s.smaller", "a long answer");
    publish_until_stored(&bus, &req).await;
    wait_until(Duration::from_secs(30), "the task started", || async {
        started(&bus).await == 1
    })
    .await;
    nats.kill();
    wait_until(Duration::from_secs(30), "the task ended", || async {
        ended.exists()
    })
    .await;
    nats.extra_args = vec!["-c".into(), small];
    nats.spawn();
    nats.wait_ready().await;
    // Asked without failing: the test's client may still be reconnecting.
    let done = bus.subjects.event(
        &wakebus::protocol::session_token("s.smaller"),
        &req.delegation_id,
        0,
        wakebus::protocol::EventKind::Done,
    );
    wait_until(Duration::from_secs(30), "the completion stored", || async {
        let Ok(events) = bus.js.get_stream(bus.subjects.events_stream()).await else {
            return false;
        };
        events.get_last_raw_message_by_subject(&done).await.is_ok()
    })
    .await;
    services.stop().await;
    let done = done_events(&bus).await.remove(0);
    assert_eq!(done.status, Status::Completed, "{:?}", done.error);
    assert!(done.truncated);
    let summary = done.summary.unwrap_or_default();
    assert!(summary.len() < 1024 * 1024, "{}", summary.len());
}

/// Caps `stream`'s max message size at `bytes`, below the server's max
/// payload, as an operator may (provisioning keeps it).
async fn cap_message_size(bus: &Bus, stream: &str, bytes: i32) {
    let mut handle = bus.js.get_stream(stream).await.expect("stream");
    let mut config = handle.info().await.expect("info").config.clone();
    config.max_message_size = bytes;
    bus.js.update_stream(config).await.expect("cap the stream");
}

/// An events stream whose max message size an operator set below the
/// server's max payload refuses a completion cut to the server's: the
/// same bytes on every try, the task held for ever. The worker cuts it
/// until the stream takes it.
#[tokio::test]
async fn a_completion_is_cut_to_fit_an_events_stream_capped_below_the_max_payload() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    cap_message_size(&bus, &bus.subjects.events_stream(), 64 * 1024).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        shell("head -c 300000 /dev/zero | tr '\\0' a"),
        test_worker_config("default"),
    );
    let req = request("s.capped", "a long answer");
    publish_until_stored(&bus, &req).await;
    wait_until(Duration::from_secs(30), "the completion stored", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    services.stop().await;
    let done = done_events(&bus).await;
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].status, Status::Completed, "{:?}", done[0].error);
    let summary = done[0].summary.clone().unwrap_or_default();
    assert!(summary.len() < 64 * 1024, "{}", summary.len());
    assert!(summary.starts_with("aaaa"), "{summary:.40}");
    assert!(summary.ends_with("[truncated to fit the NATS max payload]"));
}

/// A dead-letter stream capped below the server's max payload refuses the
/// copy of a large unusable request: the worker stores a copy without the
/// body instead of holding the request for ever, and the session still
/// learns of the refusal.
#[tokio::test]
async fn an_unusable_request_is_dead_lettered_without_its_body_to_a_capped_dead_letter_stream() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    cap_message_size(&bus, &bus.subjects.dead_letter_stream(), 8 * 1024).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    // A blank goal: refused, with 20 KB of context.
    let mut req = request("s.capped-dlq", " ");
    req.context = "c".repeat(20_000);
    publish_until_stored(&bus, &req).await;
    wait_until(Duration::from_secs(30), "the refusal stored", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    services.stop().await;
    let done = done_events(&bus).await;
    assert_eq!(done[0].status, Status::Error, "{done:?}");
    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert_eq!(dead.len(), 1);
    assert!(dead[0].payload.is_empty(), "{}", dead[0].payload.len());
    let reason = dead[0]
        .headers
        .get(wakebus::protocol::HEADER_DEAD_LETTER_REASON)
        .expect("a reason")
        .as_str();
    assert!(reason.starts_with("(body of "), "{reason}");
}

/// A task's in-progress acks keep one pace from its delivery to its end,
/// whatever steps its handling goes through. Here it first asks whether an
/// earlier copy already completed it while no stream answers (a leader
/// election), and the answer comes just before a keep-alive is due. With a
/// keep-alive per step, the run's first would come a whole period after
/// the run began: the gaps between steps add up towards the AckWait, after
/// which the server hands the task to another worker while it runs here.
#[tokio::test]
async fn a_task_keeps_one_keep_alive_pace_from_asking_to_running() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut config = test_worker_config("default");
    // A keep-alive every 4 s.
    config.ack_wait = Duration::from_secs(12);
    let mut services = Services::new();
    services.worker(&bus, shell("sleep 5; echo ok"), config);
    let tasks = bus.subjects.tasks_stream();
    let mut acks = bus
        .client
        .subscribe(format!("$JS.ACK.{tasks}.>"))
        .await
        .unwrap();
    // Nobody listens on the events stream's subjects for a while.
    let config = events_stream_unanswered(&bus).await;
    // Undated, so the worker asks whether it ran before: at 0, 0.5, 1.5,
    // 3.5, 7.5 and 11.5 s after its delivery, keeping it alive at 4, 8, 12
    // s and on.
    let mut raw = request("s.pace", "paced");
    raw.created_at = None;
    publish_until_stored(&bus, &raw).await;
    next_keep_alive(&mut acks).await;
    next_keep_alive(&mut acks).await;
    // Answered from 9.5 s on: the question ends at 11.5 s, and the run
    // starts half a second before the next keep-alive is due.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    bus.js.update_stream(&config).await.unwrap();
    let mut last = std::time::Instant::now() - Duration::from_millis(1500);
    let mut gaps = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(message) = acks.next().await {
            gaps.push(last.elapsed());
            last = std::time::Instant::now();
            if message.payload.as_ref() != b"+WPI" {
                return;
            }
        }
    })
    .await
    .expect("the task's ack");
    // 4 s apart, and 7.5 s when the run kept alive on a clock of its own.
    assert!(
        gaps.iter().all(|gap| *gap < Duration::from_secs(6)),
        "{gaps:?}"
    );
    let done = done_events(&bus).await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].status, Status::Completed, "{done:?}");
    services.stop().await;
}

/// A worker cut off while its pull waits pulls again once that pull has
/// surely ended (3 s after the reconnect), not only when async-nats gives
/// up on it (7 s after it was sent): the server forgot the pull when it
/// found nobody listening as a task came in, so nothing would have ended
/// it, and the worker would have sat idle after the reconnect.
#[tokio::test]
async fn a_worker_whose_pull_was_lost_with_its_connection_pulls_again_once_it_has_surely_ended() {
    init_logs();
    // A delivery lost with the cut would come back late, not look early.
    let CutWorker {
        nats: _nats,
        bus,
        proxy,
        worker_bus,
        services,
    } = CutWorker::start("echo ran", Duration::from_secs(30)).await;
    let tasks = bus.subjects.tasks_stream();
    let consumer = bus.subjects.worker_consumer("default");
    let mut pulls = bus
        .client
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{tasks}.{consumer}"))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), pulls.next())
        .await
        .expect("a pull")
        .expect("a pull");
    let pulled = std::time::Instant::now();
    proxy.cut();
    wait_until(
        Duration::from_secs(30),
        "the worker to see the cut",
        || async {
            worker_bus.client.connection_state() != async_nats::connection::State::Connected
        },
    )
    .await;
    publish_until_stored(&bus, &request("s.lost", "after the cut")).await;
    // Pulls sent before the cut and not read here yet.
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), pulls.next()).await {}
    proxy.restore();
    tokio::time::timeout(Duration::from_secs(30), pulls.next())
        .await
        .expect("a pull after the reconnect")
        .expect("a pull after the reconnect");
    // About 3.3 s (its reconnect 0.1 s after the restore, noticed within
    // 0.25 s, and the next pull 3 s after that); 7 s or more when the
    // worker waited for async-nats to give up. Timed by the pull itself,
    // as the server receives it, so that nothing else is in the count.
    let pulled_again = pulled.elapsed();
    assert!(
        pulled_again < Duration::from_millis(6500),
        "pulled again {pulled_again:?} after the lost pull was sent"
    );
    wait_until(Duration::from_secs(30), "the task to start", || async {
        !events(&bus, ".started").await.is_empty()
    })
    .await;
    services.stop().await;
}

/// A worker of the default pool running `command`, its consumer's AckWait
/// `ack_wait`, connected through a proxy the test can cut.
struct CutWorker {
    /// The server; stops when dropped.
    nats: NatsServer,
    /// Straight to the server, for the test.
    bus: Bus,
    /// The worker's way to the server.
    proxy: common::proxy::Proxy,
    /// The worker's connection, through the proxy.
    worker_bus: Bus,
    /// The worker.
    services: Services,
}

impl CutWorker {
    /// Starts the server, the proxy and the worker.
    async fn start(command: &str, ack_wait: Duration) -> Self {
        let nats = NatsServer::start().await;
        let bus = bus(&nats.url(), &unique_prefix()).await;
        let proxy = common::proxy::Proxy::start(nats.port).await;
        let worker_bus = proxy.bus(&bus).await;
        let mut config = test_worker_config("default");
        config.ack_wait = ack_wait;
        let mut services = Services::new();
        services.worker(&worker_bus, shell(command), config);
        Self {
            nats,
            bus,
            proxy,
            worker_bus,
            services,
        }
    }
}

/// Waits for the next in-progress ack among `acks`.
async fn next_keep_alive(acks: &mut async_nats::Subscriber) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(message) = acks.next().await {
            if message.payload.as_ref() == b"+WPI" {
                return;
            }
        }
    })
    .await
    .expect("a keep-alive");
}

/// Cuts a service's connection (`proxy`) from one of its keep-alives (of
/// `acks`, every 5 s) to just past the next one's time, then checks that
/// the next comes within the consumer's AckWait (7 s) of the last one
/// before the cut, and waits until past that AckWait, for the caller to
/// check that nothing was handed on.
async fn cut_between_keep_alives(proxy: &common::proxy::Proxy, acks: &mut async_nats::Subscriber) {
    next_keep_alive(acks).await;
    proxy.cut();
    let cut = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(5300)).await;
    proxy.restore();
    next_keep_alive(acks).await;
    let back = cut.elapsed();
    assert!(
        back < Duration::from_secs(7),
        "keep-alive {back:?} after the last"
    );
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(cut.elapsed())).await;
}

/// The same for a wake holding a completion whose post the session API
/// keeps waiting: cut off for part of its keep-alive period, it sends the
/// next in-progress ack as soon as it is back, so the completion is not
/// handed to another wake instance (which would post it beside this one's
/// post still in flight).
#[tokio::test]
async fn a_held_completion_gets_its_keep_alive_as_soon_as_its_wake_reconnects() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.hold_posts();
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let proxy = common::proxy::Proxy::start(nats.port).await;
    let wake_bus = proxy.bus(&bus).await;
    let mut config = test_wake_config(&api.url());
    config.ack_wait = Duration::from_secs(15);
    config.api.request_timeout = Duration::from_secs(60);
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&wake_bus, config);
    publish_until_stored(&bus, &request("s.cut.wake", "woken once")).await;
    wait_until(Duration::from_secs(30), "the post", || async {
        api.in_flight() == 1
    })
    .await;
    let events = bus.subjects.events_stream();
    let stream = bus.js.get_stream(&events).await.unwrap();
    let name = bus.subjects.wake_consumer();
    let mut consumer_config = stream.consumer_info(&name).await.unwrap().config;
    consumer_config.ack_wait = Duration::from_secs(7);
    stream.create_consumer(consumer_config).await.unwrap();

    let mut acks = bus
        .client
        .subscribe(format!("$JS.ACK.{events}.>"))
        .await
        .unwrap();
    cut_between_keep_alives(&proxy, &mut acks).await;
    let info = stream.consumer_info(&name).await.unwrap();
    assert_eq!(
        info.num_redelivered, 0,
        "handed to another instance: {info:?}"
    );
    api.release_posts();
    wait_until(Duration::from_secs(30), "the wake", || async {
        api.accepted().len() == 1
    })
    .await;
    services.stop().await;
    assert_eq!(api.all_posts().len(), 1, "{:?}", api.all_posts());
}

/// A forced replay of a batch whose other task has not ended: the replay
/// records the forced key and reports the copy replayed, but the wake can
/// post the batch's turn only once every task has a completion. It says
/// so, and posts the turn under the forced key when the last one arrives.
#[tokio::test]
async fn a_forced_replay_of_an_unfinished_batch_warns_and_posts_when_its_last_task_ends() {
    let rig = Rig::start().await;
    let (bus, api) = (&rig.bus, &rig.api);
    let mark = rig.logs.path().join("let-task-1-end");
    let script = format!(
        "if [ \"$WAKEBUS_TASK_INDEX\" = 1 ]; then while [ ! -e {m} ]; do sleep 0.05; done; fi; echo ok",
        m = mark.display()
    );
    let _worker = rig.worker("worker", &script, &[]);
    let wake = rig.wake("wake");
    let id = delegate(
        bus,
        Delegation::batch(["first", "second"].map(String::from)).session("s.forced.batch"),
    )
    .await;
    wait_until(
        Duration::from_secs(30),
        "the first task's completion",
        || async { !events(bus, ".0.done").await.is_empty() },
    )
    .await;
    // The replay reads the wake's ledger, which the wake makes as it
    // starts: a worker's completion can come first.
    wait_until(Duration::from_secs(30), "the wake to start", || async {
        std::fs::read_to_string(&wake.log).is_ok_and(|log| log.contains("Wake service started."))
    })
    .await;
    let forced = common::cli::wakebus(
        &rig.nats.url(),
        &rig.prefix,
        &["replay", "wakes", "--delegation", &id, "--force"],
    )
    .await
    .ok_json();
    assert_eq!(forced[0]["action"], "replayed", "{forced:#?}");
    let key = forced[0]["idempotency_key"].as_str().unwrap().to_owned();
    wait_until(Duration::from_secs(30), "the wake's warning", || async {
        std::fs::read_to_string(&wake.log).is_ok_and(|log| {
            log.contains("A forced replay of a batch task arrived while not every task")
                && log.contains(&key)
        })
    })
    .await;
    assert!(api.all_posts().is_empty(), "posted before the batch ended");
    std::fs::write(&mark, "").unwrap();
    wait_until(Duration::from_secs(30), "the batch's turn", || async {
        !api.accepted().is_empty()
    })
    .await;
    assert_eq!(api.accepted()[0].header("idempotency-key"), Some(key));
    assert_eq!(api.all_posts().len(), 1);
}

/// A server that stops answering without closing the connection (its host
/// lost power, a partition) sends no FIN or RST: only the client's pings
/// tell. A service's client notices within three of them (30 s) and
/// connects again; async-nats's own 60 s interval took up to three minutes.
#[tokio::test]
async fn a_connection_that_goes_silent_is_given_up_and_made_again_within_half_a_minute() {
    use std::sync::atomic::Ordering::Relaxed;
    init_logs();
    let nats = NatsServer::start().await;
    let proxy = common::proxy::Proxy::start(nats.port).await;
    let client = wakebus::connect::NatsConfig::new(format!("nats://127.0.0.1:{}", proxy.port))
        .connect()
        .await
        .unwrap();
    client.flush().await.unwrap();
    let stats = client.statistics();
    let before = stats.connects.load(Relaxed);
    proxy.silence();
    wait_until(
        Duration::from_secs(45),
        "the client to give up the silent connection and connect again",
        || async { stats.connects.load(Relaxed) > before },
    )
    .await;
    tokio::time::timeout(Duration::from_secs(5), client.flush())
        .await
        .expect("a flush over the new connection is answered")
        .unwrap();
}

/// A plan that keeps failing (here the wake ledger deleted under the wake,
/// as a lost permission or a removed bucket would) is tried again ever
/// more slowly and warned of once a minute, not every second for every
/// session in hand.
#[tokio::test]
async fn a_plan_that_keeps_failing_is_retried_ever_more_slowly_and_warned_of_once() {
    let rig = Rig::start().await;
    let _worker = rig.worker("worker", "echo done", &[]);
    let log = rig.logs.path().join("wake.log");
    let _wake = Service::spawn_with_env(
        wake_args(&rig.nats.url(), &rig.prefix, &rig.api.url()),
        log.clone(),
        vec![("RUST_LOG".to_owned(), "wakebus=debug".to_owned())],
    );
    let _logs = LogsOnPanic(vec![log.clone()]);
    wait_until(Duration::from_secs(30), "the wake to start", || async {
        std::fs::read_to_string(&log).is_ok_and(|log| log.contains("Wake service started."))
    })
    .await;
    let ledger = rig.bus.subjects.wake_ledger_bucket();
    rig.bus.js.delete_key_value(&ledger).await.unwrap();
    publish_until_stored(&rig.bus, &request("s.unplanned", "no ledger")).await;
    let failed = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("Could not plan the session's turns"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_until(Duration::from_secs(60), "four failed plans", || async {
        failed().len() >= 4
    })
    .await;
    let failed = failed();
    let warned = failed.iter().filter(|line| line.contains("WARN")).count();
    assert_eq!(warned, 1, "{failed:#?}");
    // Waits of at least 1, 2 and 4 s between the four, by the log's own
    // timestamps (a line starts with one).
    let at = |line: &str| {
        let stamp = line.split_whitespace().next().unwrap_or_default();
        let format = time::format_description::well_known::Rfc3339;
        time::OffsetDateTime::parse(stamp, &format).unwrap_or_else(|_| panic!("{line}"))
    };
    let spread = at(&failed[3]) - at(&failed[0]);
    assert!(
        spread >= time::Duration::seconds(7),
        "{spread}: {failed:#?}"
    );
    assert!(rig.api.all_posts().is_empty());
}

/// A model endpoint whose calls each wait until the test lets one
/// through, then answer 503 (a failure the `llm` executor retries later).
struct HeldModel {
    /// Its base URL (`…/v1`).
    url: String,
    /// Calls received so far.
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// One permit per call let through.
    through: std::sync::Arc<tokio::sync::Semaphore>,
}

impl HeldModel {
    async fn start() -> Self {
        use axum::extract::State;
        type Shared = (
            std::sync::Arc<std::sync::atomic::AtomicUsize>,
            std::sync::Arc<tokio::sync::Semaphore>,
        );
        async fn held(State((calls, through)): State<Shared>) -> axum::http::StatusCode {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            through.acquire().await.expect("open").forget();
            axum::http::StatusCode::SERVICE_UNAVAILABLE
        }
        let calls = std::sync::Arc::default();
        let through = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(held))
            .with_state((
                std::sync::Arc::clone(&calls),
                std::sync::Arc::clone(&through),
            ));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url,
            calls,
            through,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn executor(&self) -> wakebus::worker::executor::Executor {
        use wakebus::worker::executor::{Executor, LlmConfig, LlmExecutor};
        Executor::Llm(
            LlmExecutor::new(&LlmConfig {
                base_url: self.url.clone(),
                model: "test-model".into(),
                api_key: None,
                request_timeout: Duration::from_secs(120),
            })
            .unwrap(),
        )
    }
}

/// A task whose model call fails for a moment (a 503) while its worker is
/// cut off from NATS is not NAKed when that worker reconnects: by then its
/// AckWait has run out and another worker runs the task, and a NAK for the
/// old delivery would settle that worker's (nats-server checks only the
/// stream sequence), sending the task to a third run beside the second.
#[tokio::test]
async fn a_task_failing_while_its_worker_is_cut_off_is_not_nakked_away_from_the_worker_running_it_now()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let model = HeldModel::start().await;
    let proxy = common::proxy::Proxy::start(nats.port).await;
    let cut_bus = proxy.bus(&bus).await;
    let mut config = test_worker_config("default");
    config.ack_wait = Duration::from_secs(2);
    config.concurrency = 1;
    let mut services = Services::new();
    services.worker(&cut_bus, model.executor(), config.clone());
    // Every ack, keep-alive and NAK of a task as the server receives it.
    let mut acks = bus
        .client
        .subscribe(format!("$JS.ACK.{}.>", bus.subjects.tasks_stream()))
        .await
        .unwrap();
    bus.client.flush().await.unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seeing = seen.clone();
    let collector = tokio::spawn(async move {
        while let Some(ack) = acks.next().await {
            let ack = String::from_utf8_lossy(&ack.payload).into_owned();
            seeing.lock().unwrap().push(ack);
        }
    });
    delegate(&bus, Delegation::new("flaky").session("s.flaky")).await;
    wait_until(
        Duration::from_secs(30),
        "the first worker's model call",
        || async { model.calls() == 1 },
    )
    .await;

    proxy.cut();
    wait_until(
        Duration::from_secs(30),
        "the first worker to notice the cut",
        || async { cut_bus.client.connection_state() != async_nats::connection::State::Connected },
    )
    .await;
    // Its call fails while it is cut off; a second worker takes the task
    // once the AckWait has run out, and its call is held.
    model.through.add_permits(1);
    services.worker(&bus, model.executor(), config);
    wait_until(
        Duration::from_secs(30),
        "the second worker's model call",
        || async { model.calls() == 2 },
    )
    .await;
    proxy.restore();
    wait_until(
        Duration::from_secs(30),
        "the first worker to reconnect",
        || async { cut_bus.client.connection_state() == async_nats::connection::State::Connected },
    )
    .await;
    // What the first worker had queued has reached the server once a
    // round trip on its connection returns, and the server's copies of it
    // have reached this test once a round trip on the test's returns.
    cut_bus.client.flush().await.unwrap();
    bus.client.flush().await.unwrap();
    // The second worker's next keep-alive, seen after that: what is seen
    // here is seen.
    let before = seen.lock().unwrap().len();
    wait_until(
        Duration::from_secs(30),
        "a keep-alive of the second worker",
        || async {
            seen.lock().unwrap()[before..]
                .iter()
                .any(|ack| ack == "+WPI")
        },
    )
    .await;
    collector.abort();
    let seen = seen.lock().unwrap().clone();
    assert!(
        !seen.iter().any(|ack| ack.starts_with("-NAK")),
        "the task was NAKed away from its second worker: {seen:?}"
    );
    assert_eq!(model.calls(), 2, "a third run");
    drop(services);
}

/// A session-lock take that fails (here the lock bucket is deleted under
/// the wake) fails for every session in hand alike: it is warned of once a
/// minute across the service, not once a second for each session, and
/// tried again more slowly than a lock that is busy.
#[tokio::test]
async fn failed_session_lock_takes_are_warned_of_once_for_every_session() {
    let rig = Rig::start().await;
    let (api, bus) = (&rig.api, &rig.bus);
    let log = rig.logs.path().join("wake.log");
    let (_wake, metrics) = common::process::spawn_with_metrics(
        wake_args(&rig.nats.url(), &rig.prefix, &api.url()),
        log.clone(),
    );
    let _logs = LogsOnPanic(vec![log.clone()]);
    wait_until(Duration::from_secs(30), "the wake ready", || async {
        http_get(&format!("{metrics}/readyz"))
            .await
            .is_some_and(|(status, _)| status == 200)
    })
    .await;
    bus.js
        .delete_key_value(bus.subjects.session_lock_bucket())
        .await
        .unwrap();
    for i in 0..20 {
        common::cli::publish_task(bus, Some(&format!("s.unlockable.{i}")), Status::Completed).await;
    }
    let failed_takes = || async {
        let text = http_get(&format!("{metrics}/metrics")).await?.1;
        sample(&text, r#"wakebus_wake_session_locks_total{result="error"}"#)
    };
    wait_until(
        Duration::from_secs(30),
        "two failed takes a session",
        || async { failed_takes().await.is_some_and(|n| n >= 40.0) },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    let warned = text
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("Could not take the session lock"))
        .count();
    assert_eq!(warned, 1, "{text}");
    assert!(
        api.all_posts().is_empty(),
        "nothing posted without the lock"
    );
}
