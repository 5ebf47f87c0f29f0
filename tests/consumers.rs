//! Durable consumers deleted under running `wakebus` processes (by hand, or
//! lost with a cluster's data): each service creates its own again, and a
//! wake consumer made again starts where the old one had got to.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use common::process::{
    LogsOnPanic, Service, base_args, sample, spawn_with_metrics, spawn_with_metrics_and_env,
    wake_args, worker_args,
};
use common::*;
use wakebus::bus::BusSettings;
use wakebus::delegate::{Delegation, Delegator};

/// How long a step of a test may take: a keeper checks every 1 to 2 s
/// here, and believes a consumer missing after two checks 2 s apart.
const WAIT: Duration = Duration::from_secs(30);

/// A server, a session API, an echo worker process (`--ack-wait 7s`) and a
/// wake process (`--ack-wait 2s`, `--max-in-flight 77`, its keeper logging
/// each check), each with its metrics endpoint and `--consumer-check 1s`.
struct Rig {
    /// The server every process talks to.
    _nats: NatsServer,
    /// Where the wake posts.
    api: SessionApiServer,
    /// The test's own connection.
    bus: wakebus::bus::Bus,
    /// The worker and the base URL of its metrics.
    worker: (Service, String),
    /// The wake and the base URL of its metrics.
    wake: (Service, String),
    /// Prints both logs if the test fails.
    _logs: LogsOnPanic,
    /// Where the logs are.
    _dir: tempfile::TempDir,
}

impl Rig {
    async fn start() -> Self {
        init_logs();
        let nats = NatsServer::start().await;
        let api = SessionApiServer::start().await;
        let prefix = unique_prefix();
        let bus = bus(&nats.url(), &prefix).await;
        let dir = tempfile::tempdir().unwrap();
        let often = ["--consumer-check", "1s"].map(String::from);
        let mut args = base_args(&nats.url(), &prefix);
        args.extend(["worker", "--executor", "echo", "--ack-wait", "7s"].map(String::from));
        args.extend(often.clone());
        let worker = spawn_with_metrics(args, dir.path().join("worker.log"));
        let mut args = wake_args(&nats.url(), &prefix, &api.url());
        args.extend(["--max-in-flight", "77"].map(String::from));
        args.extend(often);
        let debug = (
            "RUST_LOG".to_owned(),
            "wakebus=info,wakebus::bus::keeper=debug".to_owned(),
        );
        let wake = spawn_with_metrics_and_env(args, dir.path().join("wake.log"), vec![debug]);
        let logs = LogsOnPanic(vec![worker.0.log.clone(), wake.0.log.clone()]);
        Self {
            _nats: nats,
            api,
            bus,
            worker,
            wake,
            _logs: logs,
            _dir: dir,
        }
    }

    /// Delegates a task for `session`; returns its delegation id.
    async fn delegate(&self, session: &str) -> String {
        let delegation = Delegation::new("hello").session(session);
        id_of(
            &Delegator::new(self.bus.clone())
                .delegate(delegation)
                .await
                .unwrap(),
        )
    }

    /// Waits until `n` delegations were woken.
    async fn woken(&self, n: usize) {
        wait_until(WAIT, "the wakes", || async {
            self.api.accepted().len() >= n
        })
        .await;
        wake_consumer_settled(&self.bus).await;
    }

    /// The delegation ids of every accepted post.
    fn woken_ids(&self) -> Vec<String> {
        let posts = self.api.accepted();
        posts
            .iter()
            .flat_map(|post| post.delegation_ids())
            .collect()
    }

    fn wake_log(&self) -> String {
        std::fs::read_to_string(&self.wake.0.log).unwrap()
    }

    /// Waits until the wake's keeper has seen its consumer's ack floor at
    /// Delegates for `session` a task whose wake the session API refuses
    /// (dead-lettered and acked, with no `delivered` entry in the ledger:
    /// only where the consumer starts keeps it from being posted again),
    /// after `posted` other posts; returns its delegation id and the ack
    /// floor the keeper has seen once it is handled.
    async fn refused_wake(&self, session: &str, posted: usize) -> (String, u64) {
        self.api.fail_next(1, 422);
        let refused = self.delegate(session).await;
        wait_until(WAIT, "the refused post", || async {
            self.api.all_posts().len() == posted + 1
        })
        .await;
        wake_consumer_settled(&self.bus).await;
        let floor = wake_consumer_info(&self.bus)
            .await
            .unwrap()
            .ack_floor
            .stream_sequence;
        (refused, self.keeper_saw(floor).await)
    }

    /// How many posts the session API received for `delegation_id`.
    fn posts_of(&self, delegation_id: &str) -> usize {
        self.api
            .all_posts()
            .iter()
            .filter(|post| post.delegation_ids().iter().any(|id| id == delegation_id))
            .count()
    }

    /// `floor` or beyond; returns the floor it saw.
    async fn keeper_saw(&self, floor: u64) -> u64 {
        eventually(WAIT, "the keeper to see the ack floor", || async {
            ack_floor_seen(&self.wake_log()).filter(|seen| *seen >= floor)
        })
        .await
    }

    /// Deletes the wake's consumer.
    async fn delete_wake_consumer(&self) {
        let s = &self.bus.subjects;
        let events = self.bus.js.get_stream(s.events_stream()).await.unwrap();
        events.delete_consumer(s.wake_consumer()).await.unwrap();
    }

    /// Waits until the wake logged `n` consumers created again; returns the
    /// `from_sequence` of the last.
    async fn wake_consumer_created(&self, n: usize) -> u64 {
        eventually(WAIT, "the wake consumer created again", || async {
            let log = self.wake_log();
            let created: Vec<&str> = log
                .lines()
                .filter(|line| line.contains("it was created again"))
                .collect();
            (created.len() == n)
                .then(|| field(created[n - 1], "from_sequence"))
                .flatten()
        })
        .await
    }

    /// Sets the wake consumer's AckWait, as another instance or `init`
    /// could.
    async fn set_wake_ack_wait(&self, ack_wait: Duration) {
        let s = &self.bus.subjects;
        let events = self.bus.js.get_stream(s.events_stream()).await.unwrap();
        let info = wake_consumer_info(&self.bus).await.unwrap();
        let config = async_nats::jetstream::consumer::Config {
            ack_wait,
            ..info.config
        };
        events
            .update_consumer::<async_nats::jetstream::consumer::Config>(config)
            .await
            .unwrap();
    }

    /// Waits until the wake's keeper has checked its consumer `n` more
    /// times than it had when this was called.
    async fn checks_later(&self, n: usize) {
        let checks = |log: String| log.matches("Consumer checked.").count();
        let before = checks(self.wake_log());
        wait_until(WAIT, "more checks of the wake consumer", || async {
            checks(self.wake_log()) >= before + n
        })
        .await;
    }
}

/// The number after `name=` in a log line, if it has one.
fn field(line: &str, name: &str) -> Option<u64> {
    let value = line.split(&format!("{name}=")).nth(1)?;
    value.split(' ').next()?.trim().parse().ok()
}

/// The ack floor the wake's keeper last logged seeing, if any.
fn ack_floor_seen(log: &str) -> Option<u64> {
    log.lines()
        .filter(|line| line.contains("Consumer checked."))
        .filter_map(|line| field(line, "ack_floor"))
        .max()
}

/// `wakebus_pulls_failed_total` for `consumer` from the metrics at `base`
/// (0 until one failed).
async fn failed_pulls(base: &str, consumer: &str) -> f64 {
    let (_, text) = eventually(Duration::from_secs(10), "the metrics", || async {
        http_get(&format!("{base}/metrics")).await
    })
    .await;
    let name = format!(r#"wakebus_pulls_failed_total{{consumer="{consumer}"}}"#);
    sample(&text, &name).unwrap_or(0.0)
}

#[tokio::test]
async fn a_worker_and_a_wake_whose_consumers_are_deleted_create_them_again_and_wake_everything_once()
 {
    let rig = Rig::start().await;
    let mut ids = HashSet::from([rig.delegate("s.vanish.0").await]);
    rig.woken(1).await;

    // Both consumers are deleted under the running services. Their pulls in
    // flight end with a 409; later ones go unanswered.
    let s = &rig.bus.subjects;
    let tasks = rig.bus.js.get_stream(s.tasks_stream()).await.unwrap();
    let worker_consumer = s.worker_consumer("default");
    tasks.delete_consumer(&worker_consumer).await.unwrap();
    rig.delete_wake_consumer().await;
    for i in 1..=3 {
        ids.insert(rig.delegate(&format!("s.vanish.{i}")).await);
    }

    // Each service finds its consumer gone and creates it again, with its
    // own settings; the work that waited is done, once.
    rig.woken(4).await;
    assert_eq!(rig.woken_ids().len(), 4, "{:?}", rig.woken_ids());
    assert_eq!(rig.woken_ids().into_iter().collect::<HashSet<_>>(), ids);
    let restored = tasks.consumer_info(&worker_consumer).await.unwrap();
    assert_eq!(restored.config.ack_wait, Duration::from_secs(7));
    let restored = wake_consumer_info(&rig.bus).await.unwrap();
    assert_eq!(restored.config.ack_wait, Duration::from_secs(2));
    assert_eq!(restored.config.max_ack_pending, 77);
    for ((service, base), consumer) in [(&rig.worker, "tasks"), (&rig.wake, "completions")] {
        let log = std::fs::read_to_string(&service.log).unwrap();
        assert_eq!(log.matches("it was created again").count(), 1, "{consumer}");
        // The pull in flight at the deletion ended in an error, counted.
        assert!(failed_pulls(base, consumer).await >= 1.0, "{consumer}");
    }
}

#[tokio::test]
async fn a_wake_consumer_made_again_starts_after_its_ack_floor_so_a_refused_completion_is_not_posted_again()
 {
    let mut rig = Rig::start().await;
    let mut ids = HashSet::from([rig.delegate("s.floor.0").await]);
    rig.woken(1).await;
    let (refused, seen) = rig.refused_wake("s.floor.refused", 1).await;

    // Deleted, with a completion stored while it is gone.
    rig.delete_wake_consumer().await;
    ids.insert(rig.delegate("s.floor.1").await);
    let from_sequence = rig.wake_consumer_created(1).await;
    rig.woken(2).await;
    let restored = wake_consumer_info(&rig.bus).await.unwrap();
    assert_eq!(
        restored.config.deliver_policy,
        DeliverPolicy::ByStartSequence {
            start_sequence: seen + 1
        }
    );
    assert_eq!(from_sequence, seen + 1);
    assert_eq!(
        rig.posts_of(&refused),
        1,
        "the refused completion was posted again"
    );
    assert_eq!(rig.woken_ids().into_iter().collect::<HashSet<_>>(), ids);

    // A wake starting on that consumer keeps where it starts (the server
    // refuses to change it) and works.
    rig.wake.0.restart();
    ids.insert(rig.delegate("s.floor.2").await);
    rig.woken(3).await;
    assert_eq!(rig.wake_log().matches("Wake service started.").count(), 2);
    assert_eq!(rig.woken_ids().into_iter().collect::<HashSet<_>>(), ids);
}

/// nats-server 2.9 answers an ack floor of 0 for a consumer made to start
/// after a sequence until it acks something. The keeper took that 0 from
/// its next check as the floor, and a consumer lost again before anything
/// was acked was made from the stream's start: the completion the session
/// API had refused was posted again. (On later servers the floor is right
/// from the start; the test holds on both.)
#[tokio::test]
async fn a_wake_consumer_lost_twice_in_a_quiet_spell_starts_after_the_same_floor_both_times() {
    let rig = Rig::start().await;
    rig.delegate("s.quiet.0").await;
    rig.woken(1).await;
    let (refused, _) = rig.refused_wake("s.quiet.refused", 1).await;

    rig.delete_wake_consumer().await;
    let first = rig.wake_consumer_created(1).await;
    // A check of the new consumer, nothing acked on it since.
    let checks = |log: &str| log.matches("Consumer checked.").count();
    let before = checks(&rig.wake_log());
    wait_until(WAIT, "a check of the new consumer", || async {
        checks(&rig.wake_log()) > before
    })
    .await;
    rig.delete_wake_consumer().await;
    let second = rig.wake_consumer_created(2).await;
    assert_eq!(second, first, "made again from another place");
    // Everything it was given, handled (its ack floor stays 0 on 2.9).
    wait_until(
        WAIT,
        "the new consumer to have handled all it has",
        || async {
            wake_consumer_info(&rig.bus)
                .await
                .is_some_and(|info| info.num_pending == 0 && info.num_ack_pending == 0)
        },
    )
    .await;
    assert_eq!(
        rig.posts_of(&refused),
        1,
        "the refused completion was posted again"
    );
}

#[tokio::test]
async fn a_wake_whose_events_stream_was_made_anew_reads_the_new_stream_from_its_start() {
    let rig = Rig::start().await;
    let mut ids = HashSet::from([rig.delegate("s.anew.0").await]);
    rig.woken(1).await;
    let floor = wake_consumer_info(&rig.bus)
        .await
        .unwrap()
        .ack_floor
        .stream_sequence;
    assert!(floor > 0, "a floor the new stream's sequences start below");
    rig.keeper_saw(floor).await;

    // The events stream is deleted (and its consumer with it) and made
    // again: its sequences start again at 1, below the floor the keeper saw.
    let events = rig.bus.subjects.events_stream();
    rig.bus.js.delete_stream(&events).await.unwrap();
    rig.bus.provision(&BusSettings::default()).await.unwrap();
    for i in 1..=2 {
        ids.insert(rig.delegate(&format!("s.anew.{i}")).await);
    }
    assert_eq!(rig.wake_consumer_created(1).await, 1);
    rig.woken(3).await;
    assert_eq!(rig.woken_ids().into_iter().collect::<HashSet<_>>(), ids);
    let restored = wake_consumer_info(&rig.bus).await.unwrap();
    assert_eq!(restored.config.deliver_policy, DeliverPolicy::All);
    // The stream missing for a moment is one warning at most.
    assert!(rig.wake_log().matches("The stream does not exist").count() <= 1);
}

#[tokio::test]
async fn a_service_whose_consumer_has_another_ack_wait_warns_once_until_the_setting_changes_again()
{
    let rig = Rig::start().await;
    let warning = "The consumer's AckWait is not this service's --ack-wait";
    let warnings = || rig.wake_log().matches(warning).count();
    rig.checks_later(1).await;
    assert_eq!(warnings(), 0, "the wake's own setting is no warning");

    // Another instance (or `init`) gives the consumer a longer AckWait.
    rig.set_wake_ack_wait(Duration::from_secs(30)).await;
    wait_until(WAIT, "the warning", || async { warnings() == 1 }).await;
    let line = rig
        .wake_log()
        .lines()
        .find(|line| line.contains(warning))
        .map(str::to_owned)
        .unwrap();
    assert!(
        line.contains("consumer_ack_wait=30s") && line.contains(" ack_wait=2s"),
        "{line}"
    );
    // Later checks find the same setting: no more warnings.
    rig.checks_later(3).await;
    assert_eq!(warnings(), 1);

    // Set back, the next difference is a new warning.
    rig.set_wake_ack_wait(Duration::from_secs(2)).await;
    rig.checks_later(2).await;
    assert_eq!(warnings(), 1);
    rig.set_wake_ack_wait(Duration::from_secs(30)).await;
    wait_until(WAIT, "the second warning", || async { warnings() == 2 }).await;
}

/// A consumer an operator made again by hand with settings wakebus does
/// not manage (a larger `max_waiting`, which the server refuses to change)
/// keeps them when a worker starts, and gets back those wakebus's
/// guarantees rest on (here a server-side `max_deliver`, which would strand
/// a task silently, a backoff and an inactive threshold). Rebuilt from defaults, the update asked to change
/// `max_waiting`, and every worker start failed.
#[tokio::test]
async fn a_starting_worker_keeps_the_consumer_settings_it_does_not_manage() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let s = &bus.subjects;
    let stream = bus.js.get_stream(s.tasks_stream()).await.unwrap();
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(s.worker_consumer("default")),
            filter_subject: s.task("default"),
            ack_policy: consumer::AckPolicy::Explicit,
            max_waiting: 2048,
            max_deliver: 3,
            backoff: vec![Duration::from_secs(1)],
            inactive_threshold: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .unwrap();
    bus.worker_consumer("default", Duration::from_secs(30))
        .await
        .expect("a worker's start");
    let info = worker_consumer_info(&bus).await.unwrap();
    assert_eq!(info.config.max_waiting, 2048, "the operator's, kept");
    assert_eq!(
        (info.config.max_deliver, info.config.max_ack_pending),
        (-1, 100_000),
        "wakebus's, restored"
    );
    assert_eq!(
        (
            info.config.backoff.as_slice(),
            info.config.inactive_threshold
        ),
        (&[][..], Duration::ZERO),
        "a backoff would replace AckWait, an inactive threshold delete the consumer"
    );
}

/// A consumer given a server-side `max_deliver` under running services
/// would strand a message that keeps failing (a worker's task: no
/// completion, no dead letter, no wake): the service's keeper finds the
/// change at its next check and says so at ERROR, once, naming the
/// setting.
#[tokio::test]
async fn a_consumer_setting_changed_under_a_running_service_is_reported_once() {
    let rig = Rig::start().await;
    let info = eventually(WAIT, "the wake's consumer", || async {
        wake_consumer_info(&rig.bus).await
    })
    .await;
    let stream = rig.bus.js.get_stream(&info.stream_name).await.unwrap();
    stream
        .update_consumer::<consumer::Config>(consumer::Config {
            max_deliver: 3,
            ..info.config
        })
        .await
        .unwrap();
    let reported = |log: &str| {
        log.lines()
            .filter(|line| line.contains("settings were changed under this service"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_until(WAIT, "the report", || async {
        !reported(&rig.wake_log()).is_empty()
    })
    .await;
    let lines = reported(&rig.wake_log());
    assert!(
        lines[0].contains("ERROR") && lines[0].contains("max_deliver"),
        "{lines:?}"
    );
    // Three more checks find it changed still, and say nothing more.
    let checks_after_report = |log: &str| {
        log.split("settings were changed under this service")
            .nth(1)
            .map_or(0, |after| after.matches("Consumer checked.").count())
    };
    wait_until(WAIT, "three more checks", || async {
        checks_after_report(&rig.wake_log()) >= 3
    })
    .await;
    assert_eq!(
        reported(&rig.wake_log()).len(),
        1,
        "one report for one change"
    );
}

/// A server whose `max_request_batch` is below what a service asks for in
/// one pull (a worker its free slots, 16 here; the wake 256) refuses such a
/// pull whole, and the service never got a message. Each pull asks for at
/// most its consumer's `max_batch`, which the server sets from that limit.
#[tokio::test]
async fn services_pull_no_more_than_the_servers_max_request_batch_allows() {
    init_logs();
    let (nats, _conf) =
        NatsServer::start_with_config("jetstream { limits { max_request_batch: 4 } }\n").await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    for i in 0..10 {
        let session = format!("s.limited.{i}");
        delegate(&bus, Delegation::new(format!("task {i}")).session(&session)).await;
    }
    wait_until(WAIT, "every delegation woken", || async {
        api.accepted().len() == 10
    })
    .await;
    let info = worker_consumer_info(&bus).await.unwrap();
    assert_eq!(info.config.max_batch, 4, "the server's limit");
    services.stop().await;
}

/// A server, an account or a stream limiting `max_ack_pending` below what
/// a service asks for (a worker pool 100,000, the wake its
/// `--max-in-flight`, 1,000 by default) refused the consumer, and the
/// service failed to start. It takes the limits the refusals name, one
/// after the other (here the server's, then the account's), when it starts
/// and when its keeper makes its consumer again after a deletion.
#[tokio::test]
async fn services_take_the_servers_max_ack_pending_limit_for_their_consumers() {
    init_logs();
    let (nats, _conf) = NatsServer::start_with_config(
        "jetstream { limits { max_ack_pending: 10000 } }\naccounts { APP { jetstream { max_file: 1G, max_mem: 64M, max_ack_pending: 500 }, users: [ { user: app, password: app } ] } }\nno_auth_user: app\n",
    )
    .await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    // One delegation woken; then both consumers are within the limit.
    let woken_within_limit = |n: usize| {
        let (bus, api) = (&bus, &api);
        async move {
            let session = format!("s.limited.{n}");
            delegate(bus, Delegation::new("limited").session(&session)).await;
            wait_until(WAIT, "the wake", || async { api.accepted().len() == n + 1 }).await;
            let worker = worker_consumer_info(bus).await.unwrap();
            let wake = wake_consumer_info(bus).await.unwrap();
            assert_eq!(
                (worker.config.max_ack_pending, wake.config.max_ack_pending),
                (500, 500)
            );
        }
    };
    woken_within_limit(0).await;

    // Deleted under the running services: made again, within the limit.
    wake_consumer_settled(&bus).await;
    let s = &bus.subjects;
    let tasks = bus.js.get_stream(s.tasks_stream()).await.unwrap();
    tasks
        .delete_consumer(&s.worker_consumer("default"))
        .await
        .unwrap();
    let events = bus.js.get_stream(s.events_stream()).await.unwrap();
    events.delete_consumer(s.wake_consumer()).await.unwrap();
    woken_within_limit(1).await;
    services.stop().await;
}

/// The pool's consumer, as the server describes it.
async fn worker_consumer_info(bus: &wakebus::bus::Bus) -> Option<consumer::Info> {
    let s = &bus.subjects;
    let mut consumer: consumer::PullConsumer = bus
        .js
        .get_consumer_from_stream(s.worker_consumer("default"), s.tasks_stream())
        .await
        .ok()?;
    consumer.info().await.ok().cloned()
}

/// Waits until the pool's one task is acknowledged, and checks that it
/// was delivered once: never handed to another worker while it ran.
async fn delivered_once(bus: &wakebus::bus::Bus) {
    let done = eventually(WAIT, "the task acknowledged", || async {
        worker_consumer_info(bus)
            .await
            .filter(|info| info.ack_floor.stream_sequence >= 1 && info.num_ack_pending == 0)
    })
    .await;
    assert_eq!(
        done.delivered.consumer_sequence, 1,
        "the running task was delivered again"
    );
}

/// Gives the consumer `info` describes the AckWait `to`, as another
/// instance or `init` could, and waits until the keeper of the service
/// logging to `log` has seen it.
async fn shorten_ack_wait(
    bus: &wakebus::bus::Bus,
    info: consumer::Info,
    to: Duration,
    log: &std::path::Path,
) {
    let stream = bus.js.get_stream(&info.stream_name).await.unwrap();
    let config = consumer::Config {
        ack_wait: to,
        ..info.config
    };
    stream
        .update_consumer::<consumer::Config>(config)
        .await
        .unwrap();
    wait_until(WAIT, "the service's keeper to see it", || async {
        std::fs::read_to_string(log)
            .unwrap()
            .contains("The consumer's AckWait is not this service's --ack-wait")
    })
    .await;
}

/// A worker process running `script` for each task, whose own 30 s
/// `--ack-wait` would keep a task alive every 10 s, and which checks its
/// consumer every second; with its server, bus and log directory.
async fn slow_worker(script: &str) -> (NatsServer, wakebus::bus::Bus, Service, tempfile::TempDir) {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let extra = ["--ack-wait", "30s", "--consumer-check", "1s"];
    let args = worker_args(&nats.url(), &prefix, script, &extra);
    let worker = Service::spawn(args, dir.path().join("worker.log"));
    (nats, bus, worker, dir)
}

#[tokio::test]
async fn a_worker_keeps_its_task_alive_by_its_consumers_ack_wait_when_that_is_shorter_than_its_own()
{
    let (_nats, bus, worker, _dir) = slow_worker("sleep 5; echo slow").await;
    let _logs = LogsOnPanic(vec![worker.log.clone()]);
    let info = eventually(WAIT, "the worker's consumer", || worker_consumer_info(&bus)).await;
    shorten_ack_wait(&bus, info, Duration::from_secs(2), &worker.log).await;

    delegate(&bus, Delegation::new("slow")).await;
    delivered_once(&bus).await;
}

/// The same when the AckWait is shortened (by hand) while the task already
/// runs: its keep-alive, due 10 s after it arrived by the worker's own
/// 30 s, comes by the new 9 s AckWait's pace once the consumer check has
/// seen it, not after the server has handed the task to another worker.
#[tokio::test]
async fn a_running_task_is_kept_alive_by_an_ack_wait_shortened_while_it_runs() {
    let (_nats, bus, worker, _dir) = slow_worker("sleep 12; echo slow").await;
    let _logs = LogsOnPanic(vec![worker.log.clone()]);
    eventually(WAIT, "the worker's consumer", || worker_consumer_info(&bus)).await;
    // With a session, so that `delegate` returns at once instead of
    // waiting for the run.
    delegate(&bus, Delegation::new("slow").session("s.slow")).await;
    let info = eventually(WAIT, "the task in hand", || async {
        worker_consumer_info(&bus)
            .await
            .filter(|info| info.num_ack_pending == 1)
    })
    .await;
    shorten_ack_wait(&bus, info, Duration::from_secs(9), &worker.log).await;
    delivered_once(&bus).await;
}

/// The same for a completion the wake holds (for its coalesce window)
/// when the AckWait is shortened.
#[tokio::test]
async fn a_held_completion_is_kept_alive_by_an_ack_wait_shortened_while_it_is_held() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let mut args = wake_args(&nats.url(), &prefix, &api.url());
    let extra = ["--ack-wait", "30s", "--coalesce-window", "12s"];
    args.extend(
        extra
            .into_iter()
            .chain(["--consumer-check", "1s"])
            .map(String::from),
    );
    let wake = Service::spawn(args, dir.path().join("wake.log"));
    let _logs = LogsOnPanic(vec![wake.log.clone()]);
    eventually(WAIT, "the wake's consumer", || wake_consumer_info(&bus)).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    delegate(&bus, Delegation::new("held").session("s.held")).await;
    let info = eventually(WAIT, "the completion in hand", || async {
        wake_consumer_info(&bus)
            .await
            .filter(|info| info.num_ack_pending == 1)
    })
    .await;
    shorten_ack_wait(&bus, info, Duration::from_secs(9), &wake.log).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let done = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(
        done.delivered.consumer_sequence, 1,
        "the held completion was delivered again"
    );
}

#[tokio::test]
async fn a_wake_keeps_what_it_holds_alive_by_its_consumers_ack_wait_when_that_is_shorter_than_its_own()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    // By its own 30 s, this wake would keep what it holds alive every
    // 10 s; it holds each completion 5 s, for its coalesce window.
    let mut args = wake_args(&nats.url(), &prefix, &api.url());
    args.extend(
        [
            "--ack-wait",
            "30s",
            "--coalesce-window",
            "5s",
            "--consumer-check",
            "1s",
        ]
        .map(String::from),
    );
    let wake = Service::spawn(args, dir.path().join("wake.log"));
    let _logs = LogsOnPanic(vec![wake.log.clone()]);
    let info = eventually(WAIT, "the wake's consumer", || wake_consumer_info(&bus)).await;
    shorten_ack_wait(&bus, info, Duration::from_secs(2), &wake.log).await;
    let mut services = Services::new();
    services.echo_worker(&bus);

    delegate(&bus, Delegation::new("held").session("s.held")).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let done = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(
        done.delivered.consumer_sequence, 1,
        "the held completion was delivered again"
    );
}

/// A worker starting with a shorter `--ack-wait` while another worker runs
/// a task must not shorten the shared consumer's: the server would measure
/// the running task, kept alive by the longer one, against it at once and
/// hand it to another worker.
#[tokio::test]
async fn a_worker_starting_with_a_shorter_ack_wait_leaves_the_consumers_while_work_is_held() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let script = format!("echo run >> '{}'; sleep 6; echo slow", runs.display());
    let long = ["--ack-wait", "30s", "--consumer-check", "1s"];
    let first = Service::spawn(
        worker_args(&nats.url(), &prefix, &script, &long),
        dir.path().join("first.log"),
    );
    eventually(WAIT, "the first worker's consumer", || {
        worker_consumer_info(&bus)
    })
    .await;
    delegate(&bus, Delegation::new("slow").session("s.slow")).await;
    wait_until(WAIT, "the task to run", || async { runs.exists() }).await;

    let short = ["--ack-wait", "2s", "--consumer-check", "1s"];
    let second = Service::spawn(
        worker_args(&nats.url(), &prefix, &script, &short),
        dir.path().join("second.log"),
    );
    let _logs = LogsOnPanic(vec![first.log.clone(), second.log.clone()]);
    wait_until(WAIT, "the second worker to keep the consumer's", || async {
        std::fs::read_to_string(&second.log)
            .unwrap_or_default()
            .contains("keeping the consumer's")
    })
    .await;
    let info = worker_consumer_info(&bus).await.unwrap();
    assert_eq!(info.config.ack_wait, Duration::from_secs(30));
    delivered_once(&bus).await;
    let ran = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(ran.lines().count(), 1, "the task ran twice");
}
