//! Nothing lost, nothing doubled: timeouts, retries, dead letters, duplicate
//! publishes, per-session exclusion and NATS restarts, with in-process services.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use futures::StreamExt as _;
use wakebus::bus::Bus;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::protocol::{CompletionEvent, Status, TaskRequest};
use wakebus::wake::ledger::WakeLedger;
use wakebus::wake::lock::{LockGuard, SessionLocks, Taken};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

/// Completions in the history, by delegation id.
async fn completions(bus: &Bus) -> HashMap<String, Vec<CompletionEvent>> {
    let mut out: HashMap<String, Vec<CompletionEvent>> = HashMap::new();
    for message in all_messages(bus, &bus.subjects.events_stream()).await {
        if message.subject.ends_with(".done") {
            let done = CompletionEvent::decode(&message.payload).unwrap();
            out.entry(done.delegation_id.clone())
                .or_default()
                .push(done);
        }
    }
    out
}

async fn started_count(bus: &Bus, delegation_id: &str) -> usize {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.contains(delegation_id) && m.subject.ends_with(".started"))
        .count()
}

#[tokio::test]
async fn a_task_longer_than_ack_wait_is_not_redelivered_while_its_worker_is_alive() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    for name in ["a", "b"] {
        let mut config = test_worker_config("default");
        config.ack_wait = Duration::from_secs(1);
        config.instance = name.to_owned();
        services.worker(&bus, shell("sleep 3; echo long"), config);
    }
    services.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, Delegation::new("long").session("s.long")).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    assert_eq!(
        started_count(&bus, &id).await,
        1,
        "ran on a second worker while the first was alive"
    );
    let done = &completions(&bus).await[&id];
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].summary.as_deref(), Some("long"));
    assert!(done[0].duration_seconds >= 3.0);
}

#[tokio::test]
async fn a_task_that_outlives_its_timeout_is_stopped_and_ends_as_timeout() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        shell("echo partial; sleep 60"),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let mut delegation = Delegation::new("too slow").session("s.slow");
    delegation.timeout_seconds = Some(1);
    let id = delegate(&bus, delegation).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let done = &completions(&bus).await[&id][0];
    assert_eq!(done.status, Status::Timeout);
    assert_eq!(done.exit_reason, "timeout");
    assert_eq!(done.summary.as_deref(), Some("partial"));
    assert!(done.duration_seconds < 30.0, "the process was not stopped");
    assert!(api.accepted()[0].text().contains("Status: timeout"));
}

/// Starts a worker on the default pool whose subagent cannot start (a
/// transient failure, each time), giving up after `max_deliver` deliveries.
fn worker_that_cannot_start(services: &mut Services, bus: &Bus, max_deliver: u64) {
    let mut config = test_worker_config("default");
    config.max_deliver = max_deliver;
    let missing = CommandConfig::new("/nonexistent/subagent", Vec::new());
    services.worker(
        bus,
        Executor::Command(CommandExecutor::new(missing)),
        config,
    );
}

#[tokio::test]
async fn transient_failures_are_retried_then_end_failed_woken_and_dead_lettered() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    worker_that_cannot_start(&mut services, &bus, 3);
    services.wake(&bus, test_wake_config(&api.url()));
    let id = delegate(&bus, Delegation::new("cannot start").session("s.fail")).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;

    assert_eq!(started_count(&bus, &id).await, 3, "three attempts");
    let done = &completions(&bus).await[&id];
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].status, Status::Failed);
    assert_eq!(done[0].exit_reason, "max_attempts_exceeded");
    assert!(
        done[0]
            .error
            .as_deref()
            .unwrap()
            .contains("could not start"),
        "{:?}",
        done[0].error
    );
    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].subject.as_str(),
        bus.subjects.dead_letter_task("default")
    );
    let original: TaskRequest = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(original.delegation_id, id);
    assert!(api.accepted()[0].text().contains("Status: failed"));
}

#[tokio::test]
async fn a_request_published_twice_runs_once_and_wakes_once() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let req = request("s.twice", "only once");
    publish_until_stored(&bus, &req).await;
    publish_until_stored(&bus, &req).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    // Published again after it ran: still inside the dedupe window.
    publish_until_stored(&bus, &req).await;
    // Only the first of the three was ever stored.
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(tasks.info().await.unwrap().state.last_sequence, 1);
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(started_count(&bus, &req.delegation_id).await, 1);
    assert_eq!(api.all_posts().len(), 1);
}

#[tokio::test]
async fn a_completion_published_again_after_its_wake_does_not_wake_twice() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let id = delegate(&bus, Delegation::new("once").session("s.dup")).await;
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    publish_completion_again(&bus).await;
    assert_eq!(completions(&bus).await[&id].len(), 2);
    services.stop().await;
    assert_eq!(
        api.all_posts().len(),
        1,
        "the ledger must stop the second wake"
    );
}

#[tokio::test]
async fn a_burst_for_one_session_is_combined_into_one_turn() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let delegator = Delegator::new(bus.clone());
    let mut ids = HashSet::new();
    for i in 0..5 {
        ids.insert(id_of(
            &delegator
                .delegate(Delegation::new(format!("part {i}")).session("s.burst"))
                .await
                .unwrap(),
        ));
    }
    // All five are done before the wake service starts, so they arrive together.
    let mut services = Services::new();
    services.echo_worker(&bus);
    let bus_for_wait = bus.clone();
    wait_until(WAIT, "five completions", || async {
        completions(&bus_for_wait).await.len() == 5
    })
    .await;
    let mut config = test_wake_config(&api.url());
    config.coalesce_window = Duration::from_millis(500);
    services.wake(&bus, config);
    wait_until(WAIT, "five woken", || async {
        api.woken_delegations() == 5
    })
    .await;
    services.stop().await;
    let posts = api.accepted();
    assert_eq!(posts.len(), 1, "expected one combined turn");
    assert!(
        posts[0]
            .text()
            .starts_with("[5 background delegations completed]"),
        "{}",
        posts[0].text()
    );
    assert_eq!(
        posts[0]
            .delegation_ids()
            .into_iter()
            .collect::<HashSet<_>>(),
        ids
    );
}

#[tokio::test]
async fn two_wake_instances_never_post_to_one_session_at_the_same_time() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.set_delay(Duration::from_millis(100));
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    for name in ["wake-a", "wake-b"] {
        let mut config = test_wake_config(&api.url());
        config.coalesce_window = Duration::ZERO;
        config.instance = name.to_owned();
        services.wake(&bus, config);
    }
    let delegator = Delegator::new(bus.clone());
    let mut expected = 0;
    for i in 0..30 {
        delegator
            .delegate(Delegation::new(format!("t{i}")).session(format!("s{}", i % 2)))
            .await
            .unwrap();
        expected += 1;
    }
    wait_until(WAIT, "all woken", || async {
        api.woken_delegations() == expected
    })
    .await;
    services.stop().await;
    assert_eq!(api.max_in_flight_per_session(), 1);
    let ids: Vec<String> = api
        .accepted()
        .iter()
        .flat_map(|p| p.delegation_ids())
        .collect();
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        ids.len(),
        "a completion was woken twice"
    );
}

#[tokio::test]
async fn a_busy_session_keeps_its_lock_between_consecutive_turns_then_releases_it() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let mut config = test_wake_config(&api.url());
    config.coalesce_window = Duration::ZERO;
    config.lock_linger = Duration::from_secs(3);
    services.wake(&bus, config);
    let delegator = Delegator::new(bus.clone());
    // One at a time, each woken before the next is submitted: five turns.
    for i in 1..=5 {
        delegator
            .delegate(Delegation::new(format!("step {i}")).session("s.busy"))
            .await
            .unwrap();
        wait_until(WAIT, "the step woken", || async {
            api.accepted().len() == i
        })
        .await;
    }
    let locks = bus.subjects.session_lock_bucket();
    let lock_stream = format!("KV_{locks}");
    // Five turns, one lock taken (a single write, perhaps refreshed once on
    // a slow machine: a refresh is due every 10 s), not a take and a
    // release per turn: every write to the bucket counts in its sequence.
    let mut lock_stream = bus.js.get_stream(&lock_stream).await.unwrap();
    let writes = lock_stream.info().await.unwrap().state.last_sequence;
    assert!((1..=2).contains(&writes), "{writes} lock writes");
    // Once the session is idle for the linger, the lock is given back.
    let kv = bus.js.get_key_value(&locks).await.unwrap();
    let token = wakebus::protocol::session_token("s.busy");
    wait_until(WAIT, "the lock released", || async {
        kv.get(&token).await.unwrap().is_none()
    })
    .await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 5);
}

/// The session-lock bucket of a fresh prefix whose locks expire after
/// `ttl`, seen by two wake instances, `wake-a` and `wake-b`.
async fn two_instances(
    nats: &NatsServer,
    ttl: Duration,
) -> (async_nats::jetstream::kv::Store, SessionLocks, SessionLocks) {
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let kv = session_lock_bucket(&bus, ttl).await;
    let a = SessionLocks::new(bus.js.clone(), kv.clone(), "wake-a", ttl);
    let b = SessionLocks::new(bus.js.clone(), kv.clone(), "wake-b", ttl);
    (kv, a, b)
}

/// Asserts that `holder` holds the lock on `tok` (its name is the value's
/// first word) and that `other` cannot take it.
async fn assert_held_by(kv: &async_nats::jetstream::kv::Store, holder: &str, other: &SessionLocks) {
    let value = kv.get("tok").await.unwrap().expect("a lock on tok");
    let value = String::from_utf8_lossy(&value);
    assert_eq!(
        value.split(' ').next(),
        Some(holder),
        "not {holder}'s: {value}"
    );
    assert!(
        other.try_acquire("tok").await.unwrap().is_none(),
        "another instance took {holder}'s lock"
    );
}

#[tokio::test]
async fn releasing_an_expired_lock_keeps_the_lock_another_instance_took_since() {
    let nats = NatsServer::start().await;
    let ttl = Duration::from_secs(1);
    let (kv, a, b) = two_instances(&nats, ttl).await;

    // A stalls past the TTL without refreshing; its lock expires.
    let stale = a.try_acquire("tok").await.unwrap().expect("a free lock");
    wait_until(WAIT, "the stalled lock to expire", || async {
        kv.get("tok").await.unwrap().is_none()
    })
    .await;
    let mut fresh = b
        .try_acquire("tok")
        .await
        .unwrap()
        .expect("an expired lock is free");
    // A wakes up and releases what it believes it holds.
    a.release(stale).await;

    assert_held_by(&kv, "wake-b", &a).await;
    b.refresh(&mut fresh).await.unwrap();
}

#[tokio::test]
async fn a_lock_taken_again_over_its_own_release_marker_still_excludes_other_instances() {
    let nats = NatsServer::start().await;
    let ttl = Duration::from_secs(30);
    let (kv, a, b) = two_instances(&nats, ttl).await;

    // A takes the lock again over the marker its release left.
    let first = a.try_acquire("tok").await.unwrap().expect("a free lock");
    assert_eq!(first.taken(), Taken::Anew);
    a.release(first).await;
    let mut again = a
        .try_acquire("tok")
        .await
        .unwrap()
        .expect("a released lock");
    assert_eq!(again.taken(), Taken::OverOwnMarker);
    assert_held_by(&kv, "wake-a", &b).await;
    a.refresh(&mut again).await.unwrap();
    a.release(again).await;

    // B takes it over A's marker; A's memory of that marker must not let A
    // take B's lock.
    let held = b
        .try_acquire("tok")
        .await
        .unwrap()
        .expect("a released lock");
    assert_eq!(held.taken(), Taken::Anew, "a's marker, not b's");
    assert_held_by(&kv, "wake-b", &a).await;
    b.release(held).await;
    assert!(a.try_acquire("tok").await.unwrap().is_some(), "free again");
}

/// How long instance `wake-a` waits for an answer in the lock tests below.
const IMPATIENCE: Duration = Duration::from_secs(2);

/// A server, a fresh prefix whose locks live 600 s, and two instances on
/// its lock bucket: `a`, whose requests give up after `IMPATIENCE`, and
/// `b`, patient.
struct LockRig {
    nats: NatsServer,
    bus: Bus,
    kv: async_nats::jetstream::kv::Store,
    a: SessionLocks,
    b: SessionLocks,
}

impl LockRig {
    async fn start() -> Self {
        let nats = NatsServer::start().await;
        let ttl = Duration::from_secs(600);
        let bus = bus(&nats.url(), &unique_prefix()).await;
        let kv = session_lock_bucket(&bus, ttl).await;
        let a = impatient_instance(&bus, ttl).await;
        let b = SessionLocks::new(bus.js.clone(), kv.clone(), "wake-b", ttl);
        Self {
            nats,
            bus,
            kv,
            a,
            b,
        }
    }
}

/// Instance `wake-a` on the lock bucket of `bus`, whose requests give up
/// after `IMPATIENCE`, so that a frozen server's answer is lost.
async fn impatient_instance(bus: &Bus, ttl: Duration) -> SessionLocks {
    let mut js = bus.js.clone();
    js.set_timeout(IMPATIENCE);
    let kv = js
        .get_key_value(bus.subjects.session_lock_bucket())
        .await
        .unwrap();
    SessionLocks::new(js, kv, "wake-a", ttl)
}

/// Takes the lock on `tok` with `locks`, retrying through errors (a client
/// reconnecting); fails if it is busy or not taken within `WAIT`.
async fn take_through_errors(locks: &SessionLocks) -> wakebus::wake::lock::LockGuard {
    eventually(WAIT, "the lock to be taken", || async {
        match locks.try_acquire("tok").await {
            Ok(Some(guard)) => Some(guard),
            Ok(None) => panic!("the lock is busy: this instance's own lock was not taken back"),
            Err(_) => None,
        }
    })
    .await
}

#[tokio::test]
async fn a_lock_created_while_its_answer_was_lost_is_taken_back_instead_of_waited_out() {
    let LockRig {
        nats,
        bus: _,
        kv,
        a,
        b,
    } = LockRig::start().await;

    // The create reaches the frozen server's socket; its answer comes too late.
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    let unanswered = a.try_acquire("tok").await;
    nats.signal(nix::sys::signal::Signal::SIGCONT);
    assert!(unanswered.is_err(), "answered by a frozen server");
    wait_until(WAIT, "the thawed server to apply the create", || async {
        kv.get("tok").await.ok().flatten().is_some()
    })
    .await;
    assert_held_by(&kv, "wake-a", &b).await;

    let mut again = take_through_errors(&a).await;
    assert_eq!(again.taken(), Taken::Adopted);
    a.refresh(&mut again).await.unwrap();
    assert_held_by(&kv, "wake-a", &b).await;
    a.release(again).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

#[tokio::test]
async fn a_lost_create_answer_that_lands_while_the_take_checks_is_adopted_not_seen_as_busy() {
    let LockRig {
        nats,
        bus,
        kv,
        a,
        b,
    } = LockRig::start().await;

    // The create times out on the frozen server; the read that follows it
    // is sent too, and only then does the server thaw: it usually applies
    // the create first, so the read finds a's own value.
    let sent = bus.client.statistics();
    let before = sent.out_messages.load(std::sync::atomic::Ordering::Relaxed);
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    let take = tokio::spawn({
        let a = a.clone();
        async move { a.try_acquire("tok").await }
    });
    wait_until(
        WAIT,
        "the create and the read after it to be sent",
        || async { sent.out_messages.load(std::sync::atomic::Ordering::Relaxed) >= before + 2 },
    )
    .await;
    nats.signal(nix::sys::signal::Signal::SIGCONT);
    let held = match take.await.unwrap() {
        Ok(Some(held)) => held,
        Ok(None) => panic!("a's own lock seen as busy"),
        // The server may serve the read before it stores the create (it
        // queues publishes to the stream apart from direct gets): the take
        // then fails, and the next one adopts the lock.
        Err(_) => {
            wait_until(WAIT, "the thawed server to apply the create", || async {
                kv.get("tok").await.ok().flatten().is_some()
            })
            .await;
            take_through_errors(&a).await
        }
    };
    assert_eq!(held.taken(), Taken::Adopted);
    assert_held_by(&kv, "wake-a", &b).await;
    a.release(held).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

#[tokio::test]
async fn an_orphaned_take_that_never_landed_does_not_adopt_another_instances_lock() {
    let LockRig {
        mut nats,
        bus: _,
        kv,
        a,
        b,
    } = LockRig::start().await;

    // A's create reaches the frozen server, which crashes before applying it.
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    assert!(
        a.try_acquire("tok").await.is_err(),
        "answered by a frozen server"
    );
    nats.restart().await;
    let held = take_through_errors(&b).await;
    assert_eq!(held.taken(), Taken::Anew);

    assert!(
        a.try_acquire("tok").await.unwrap().is_none(),
        "a adopted b's lock"
    );
    assert_held_by(&kv, "wake-b", &a).await;
    b.release(held).await;
}

/// Refreshes `held` ("tok") while the server is frozen, so that the
/// refresh goes unanswered, and waits until the thawed server applied it.
async fn refresh_applied_unanswered(
    nats: &NatsServer,
    kv: &async_nats::jetstream::kv::Store,
    locks: &SessionLocks,
    held: &mut LockGuard,
) {
    let revision = kv.entry("tok").await.unwrap().expect("the lock").revision;
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    let unanswered = locks.refresh(held).await;
    nats.signal(nix::sys::signal::Signal::SIGCONT);
    assert!(unanswered.is_err(), "answered by a frozen server");
    wait_until(WAIT, "the thawed server to apply the refresh", || async {
        kv.entry("tok")
            .await
            .ok()
            .flatten()
            .is_some_and(|entry| entry.revision > revision)
    })
    .await;
}

#[tokio::test]
async fn a_lock_refreshed_while_its_answer_was_lost_is_taken_back_instead_of_waited_out() {
    let LockRig {
        nats,
        bus: _,
        kv,
        a,
        b,
    } = LockRig::start().await;

    let mut held = a.try_acquire("tok").await.unwrap().expect("a free lock");
    refresh_applied_unanswered(&nats, &kv, &a, &mut held).await;
    assert!(held.is_lost(), "a guard whose refresh failed is used again");
    assert_held_by(&kv, "wake-a", &b).await;

    let again = take_through_errors(&a).await;
    assert_eq!(again.taken(), Taken::Adopted);
    a.release(again).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

/// A refresh unanswered but applied leaves the lock at a revision the guard
/// does not know: the next refresh (a slow post retries it every second)
/// must find its own value there and hold the lock again, not fail until
/// the lock expires under the post.
#[tokio::test]
async fn a_guard_whose_unanswered_refresh_was_applied_is_held_again_by_its_next_refresh() {
    let LockRig {
        nats,
        bus: _,
        kv,
        a,
        b,
    } = LockRig::start().await;

    let mut held = a.try_acquire("tok").await.unwrap().expect("a free lock");
    refresh_applied_unanswered(&nats, &kv, &a, &mut held).await;

    // Fails until it is answered and takes up the applied write.
    let mut tries = 0;
    while let Err(error) = a.refresh(&mut held).await {
        tries += 1;
        assert!(tries < 50, "never held again: {error}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!held.is_lost(), "the guard is held again");
    assert_held_by(&kv, "wake-a", &b).await;
    a.release(held).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

#[tokio::test]
async fn a_guard_whose_refresh_was_lost_in_a_nats_crash_is_held_again_once_a_refresh_succeeds() {
    let LockRig {
        mut nats,
        bus,
        kv,
        a,
        b,
    } = LockRig::start().await;

    // The refresh reaches the frozen server, which crashes before applying it.
    let mut held = a.try_acquire("tok").await.unwrap().expect("a free lock");
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    assert!(
        a.refresh(&mut held).await.is_err(),
        "answered by a frozen server"
    );
    assert!(held.is_lost());
    nats.restart().await;

    // The next refresh, conditioned on the same revision, succeeds: the
    // guard holds the lock again and its release frees it.
    wait_until(WAIT, "the client to reconnect", || async {
        bus.client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    a.refresh(&mut held).await.unwrap();
    assert!(
        !held.is_lost(),
        "a guard proven held is still taken as lost"
    );
    assert_held_by(&kv, "wake-a", &b).await;
    a.release(held).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

#[tokio::test]
async fn a_lock_whose_release_was_lost_in_a_nats_crash_is_taken_back_instead_of_waited_out() {
    let LockRig {
        mut nats,
        bus: _,
        kv,
        a,
        b,
    } = LockRig::start().await;

    // The release reaches the frozen server, which then crashes.
    let held = a.try_acquire("tok").await.unwrap().expect("a free lock");
    nats.signal(nix::sys::signal::Signal::SIGSTOP);
    a.release(held).await;
    nats.restart().await;
    wait_until(WAIT, "the client to reconnect", || async {
        kv.get("tok").await.is_ok()
    })
    .await;
    assert_held_by(&kv, "wake-a", &b).await;

    let mut again = take_through_errors(&a).await;
    assert_eq!(again.taken(), Taken::Adopted);
    a.refresh(&mut again).await.unwrap();
    assert_held_by(&kv, "wake-a", &b).await;
    a.release(again).await;
    assert!(b.try_acquire("tok").await.unwrap().is_some(), "released");
}

/// A 429 is retried after the `Retry-After` the API asks for, and so is a
/// 409 Conflict the wake waits out (a post under the same key still in
/// progress), rather than by the wake's own backoff.
#[tokio::test]
async fn retry_after_from_the_session_api_is_honoured_for_a_429_and_a_409() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.set_retry_after(2);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    for status in [429, 409] {
        api.fail_next(1, status);
        let session = format!("s.{status}");
        Delegator::new(bus.clone())
            .delegate(Delegation::new("throttled").session(&session))
            .await
            .unwrap();
        wait_until(WAIT, "the wake", || async {
            api.accepted().iter().any(|post| post.session() == session)
        })
        .await;
        let posts: Vec<_> = api
            .all_posts()
            .into_iter()
            .filter(|post| post.session() == session)
            .collect();
        assert_eq!(posts.len(), 2, "{status}");
        // test_wake_config retries after at most 300 ms on its own; the
        // server asked for 2 s. Timed by the server's arrivals, not the
        // test's polls.
        let waited = posts[1].at - posts[0].at;
        assert!(waited >= Duration::from_secs(2), "{status}: {waited:?}");
    }
    services.stop().await;
}

/// `Retry-After: 0` (some gateways send it while overloaded) must not make
/// a loop of posts: the wait is never below `--retry-min`.
#[tokio::test]
async fn a_retry_after_of_zero_still_waits_the_minimum_backoff_between_posts() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_next(8, 503);
    api.set_retry_after(0);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let config = test_wake_config(&api.url());
    let retry_min = config.retry_min;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, config);
    Delegator::new(bus.clone())
        .delegate(Delegation::new("throttled").session("s.retry.zero"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 9);
    // At least --retry-min between one post and the next.
    for pair in posts.windows(2) {
        let gap = pair[1].at - pair[0].at;
        assert!(gap >= retry_min, "{gap:?}");
    }
}

#[tokio::test]
async fn a_post_slower_than_ack_wait_keeps_its_completion_and_the_sessions_next_one_in_the_wake() {
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut config = test_wake_config(&api.url());
    config.api.request_timeout = 4 * config.ack_wait;
    // The session API takes two AckWaits and more to answer the first post.
    api.set_delay(2 * config.ack_wait + Duration::from_secs(1));
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, config);
    let first = delegate(&bus, Delegation::new("slow").session("s.slow")).await;
    wait_until(WAIT, "the first post to be in flight", || async {
        api.in_flight() == 1
    })
    .await;
    api.set_delay(Duration::ZERO);
    let second = delegate(&bus, Delegation::new("next").session("s.slow")).await;
    wait_until(WAIT, "the second wake", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    let info = wake_consumer_info(&bus).await.unwrap();
    services.stop().await;
    // Redelivered copies would be recognised by the ledger and acked, so
    // the consumer's count of deliveries is what shows them.
    assert_eq!(
        info.delivered.consumer_sequence, 2,
        "a completion held through the slow post was redelivered"
    );
    let posts = api.all_posts();
    assert_eq!(posts.len(), 2);
    assert_eq!(posts[0].delegation_ids(), [first]);
    assert_eq!(posts[1].delegation_ids(), [second]);
}

#[tokio::test]
async fn a_wake_stopped_while_its_post_is_failing_hands_the_completion_to_the_next_instance() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(503);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // AckWait far beyond the wait below: only the hand-back's NAK gets the
    // completion to the second instance in time.
    let mut config = test_wake_config(&api.url());
    config.ack_wait = Duration::from_secs(120);
    let mut first = Services::new();
    first.echo_worker(&bus);
    first.wake(&bus, config.clone());
    let result = Delegator::new(bus.clone())
        .delegate(Delegation::new("outlive me").session("s.handback"))
        .await
        .unwrap();
    wait_until(WAIT, "refused posts", || async {
        api.all_posts().len() >= 2
    })
    .await;
    // The stop panics (in a debug build) if a stopped session actor left
    // its entry behind: the sessions gauge would stay above 0.
    first.stop().await;
    assert!(api.accepted().is_empty());
    // The lock was given back before the service returned, not left to expire.
    let kv = bus
        .js
        .get_key_value(&bus.subjects.session_lock_bucket())
        .await
        .unwrap();
    let token = wakebus::protocol::session_token("s.handback");
    assert!(kv.get(&token).await.unwrap().is_none(), "session lock kept");

    api.recover();
    let mut second = Services::new();
    second.wake(&bus, config);
    wait_until(WAIT, "the wake from the second instance", || async {
        !api.accepted().is_empty()
    })
    .await;
    second.stop().await;
    let accepted = api.accepted();
    assert_eq!(accepted.len(), 1);
    assert_eq!(accepted[0].session(), "s.handback");
    assert_eq!(accepted[0].delegation_ids(), vec![id_of(&result)]);
}

#[tokio::test]
async fn a_wake_stopped_while_it_posts_one_of_a_sessions_turns_hands_the_others_back_unposted() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // Two tasks of a batch fail at once, each reported early (its own
    // turn); the third runs on, so the batch's own turn does not come.
    let script = r#"input=$(cat); case "$input" in *FAIL*) exit 1;; *) sleep 600;; esac"#;
    // AckWait far beyond the waits below: only a hand-back gets the
    // second turn to the next instance in time.
    let mut config = test_wake_config(&api.url());
    config.ack_wait = Duration::from_secs(120);
    let mut services = Services::new();
    services.worker(&bus, shell(script), test_worker_config("default"));
    services.wake(&bus, config.clone());
    // Another instance holds the session, so the wake collects both
    // failures before it plans: two turns in one plan.
    let (locks, guard) = hold_session_elsewhere(&bus, "s.turns").await;
    let goals = ["first FAIL", "second FAIL", "third runs on"].map(String::from);
    let mut delegation = Delegation::batch(goals).session("s.turns");
    delegation.notify_early_failure = true;
    delegate(&bus, delegation).await;
    completions_waiting_in_wake(&bus, 2).await;
    api.hold_posts();
    locks.release(guard).await;
    wait_until(WAIT, "the first turn's post", || async {
        api.in_flight() == 1
    })
    .await;
    // The stop begins (its first poll cancels the services) with the post
    // in flight, which is then answered.
    tokio::join!(services.stop(), async { api.release_posts() });
    assert_eq!(api.all_posts().len(), 1, "a turn was posted after the stop");

    // The next instance posts the other one.
    let mut next = Services::new();
    next.wake(&bus, config);
    wait_until(WAIT, "the second turn", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    next.stop().await;
    let texts: Vec<String> = api.all_posts().iter().map(|p| p.text()).collect();
    assert_eq!(texts.len(), 2);
    for task in ["Task 0 of 3", "Task 1 of 3"] {
        assert_eq!(
            texts.iter().filter(|t| t.contains(task)).count(),
            1,
            "{task}: {texts:?}"
        );
    }
}

#[tokio::test]
async fn services_started_before_the_server_wait_for_it() {
    init_logs();
    let port = nats::free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    // Connect and start services with no server listening yet.
    let client = wakebus::connect::NatsConfig::new(&url)
        .connect()
        .await
        .unwrap();
    let early = Bus::new(client, wakebus::protocol::Subjects::new(&prefix).unwrap());
    let mut services = Services::new();
    services.echo_worker(&early);
    services.wake(&early, test_wake_config(&api.url()));
    // Not a wait for a condition: the services must spend a while retrying
    // against nothing before the server appears.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _nats = NatsServer::start_on(port, Vec::new()).await;
    let bus = bus(&url, &prefix).await;
    Delegator::new(bus.clone())
        .delegate(Delegation::new("late server").session("s.late"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
}

#[tokio::test]
async fn a_nats_server_crash_mid_run_loses_and_doubles_nothing() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        shell("sleep 0.05; echo ok"),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let delegator = Delegator::new(bus.clone());
    let mut accepted = HashSet::new();
    for i in 0..60 {
        if i == 30 {
            nats.kill();
            nats.restart().await;
        }
        if let Ok(result) = delegator
            .delegate(Delegation::new(format!("t{i}")).session(format!("s{}", i % 3)))
            .await
        {
            accepted.insert(id_of(&result));
        }
    }
    assert!(
        accepted.len() >= 55,
        "most delegations should be accepted: {}",
        accepted.len()
    );
    wait_until(
        Duration::from_secs(60),
        "every accepted delegation woken",
        || async {
            let woken: HashSet<String> = api
                .turns()
                .iter()
                .flat_map(|p| p.delegation_ids())
                .collect();
            accepted.is_subset(&woken)
        },
    )
    .await;
    services.stop().await;
    let ids: Vec<String> = api
        .turns()
        .iter()
        .flat_map(|p| p.delegation_ids())
        .collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "a delegation was woken twice");
}

#[tokio::test]
async fn malformed_completions_are_dead_lettered_and_the_wake_service_goes_on() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let token = wakebus::protocol::session_token("s.victim");
    let poison = [
        // A status with a line break: its error message must not break a header.
        r#"{"type":"async_delegation","delegation_id":"d1","origin_session_id":"s.victim","status":"a\nb","completed_at":"2026-01-01T00:00:00Z","exit_reason":"x"}"#,
        // A delegation id that is no valid KV key.
        r#"{"type":"async_delegation","delegation_id":"a b","origin_session_id":"s.victim","status":"completed","completed_at":"2026-01-01T00:00:00Z","exit_reason":"x"}"#,
        // Not JSON.
        "\u{0}\u{1}garbage",
    ];
    for (i, body) in poison.iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Wakebus-Origin-Session", "s.victim");
        bus.js
            .publish_with_headers(
                format!("{}.evt.{token}.bad{i}.0.done", bus.subjects.prefix()),
                headers,
                body.as_bytes().to_vec().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    Delegator::new(bus.clone())
        .delegate(Delegation::new("after the poison").session("s.victim"))
        .await
        .unwrap();
    wait_until(WAIT, "the good wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "three poison dead letters", || async {
        all_messages(&bus, &dlq).await.len() == 3
    })
    .await;
    services.stop().await;
    assert_eq!(
        api.all_posts().len(),
        1,
        "only the good completion is woken"
    );
    for dead in all_messages(&bus, &dlq).await {
        assert_eq!(
            dead.subject.as_str(),
            bus.subjects.dead_letter_wake("poison")
        );
        let reason = dead
            .headers
            .get("Wakebus-Dead-Letter-Reason")
            .unwrap()
            .to_string();
        assert!(!reason.contains('\n'), "{reason:?}");
    }
}

/// A service must not run on with a NATS client that can never send again:
/// its stop signal fires, and says the service must fail, once the client's
/// connection task has ended (drained here; async-nats 0.51 ended it by
/// panicking on some messages), but not while the client only reconnects.
#[tokio::test]
async fn a_service_is_stopped_to_fail_once_its_nats_client_has_ended_but_not_while_it_reconnects() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let client = wakebus::connect::NatsConfig::new(nats.url())
        .connect()
        .await
        .unwrap();
    let (stop, lost) =
        wakebus::connect::stop_or_connection_loss(&client, std::future::pending::<()>());
    tokio::pin!(stop);

    // An outage longer than a client check (every 2 s), a reconnect, and a
    // few more checks, all while the stop is watched.
    let outage = async {
        nats.kill();
        // Not a wait for a condition: the outage must outlast a check.
        tokio::time::sleep(Duration::from_secs(3)).await;
        nats.spawn();
        nats.wait_ready().await;
        wait_until(WAIT, "the client reconnected", || async {
            wakebus::connect::is_connected(&client)
        })
        .await;
        // Not a wait for a condition either: checks after the reconnect.
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        () = &mut stop => panic!("the stop fired on an outage and reconnect"),
        () = outage => {}
    }
    assert!(lost.check().is_ok());

    client.drain().await.unwrap();
    tokio::time::timeout(WAIT, &mut stop)
        .await
        .expect("the stop fires once the client has ended");
    assert!(lost.check().is_err());
}

/// What `events_stream_acking_duplicates_of_nothing` was sent: each
/// completion's `Nats-Msg-Id` and body, and the count of `started` events.
type Answered = (Vec<(Option<String>, CompletionEvent)>, usize);

/// A plain NATS responder standing in for the events stream of `bus`
/// (which must not exist), answering as nats-server before 2.10.25 does
/// after a publish was dropped in a leader election (nats-io/nats-server#6415):
/// the first two publishes of a completion get `duplicate: true` with
/// sequence 0, although nothing is stored; the third is stored. Every other
/// event is stored, and the worker's probe finds the stream. Returns the
/// completions published (their `Nats-Msg-Id` and body), after the third,
/// and how many `started` events were.
fn events_stream_acking_duplicates_of_nothing(
    bus: &Bus,
    prefix: &str,
) -> tokio::task::JoinHandle<Answered> {
    let client = bus.client.clone();
    let subject = format!("{prefix}.evt.>");
    tokio::spawn(async move {
        let mut events = client.subscribe(subject).await.expect("subscribe");
        let (mut done, mut started) = (Vec::new(), 0);
        while let Some(message) = events.next().await {
            let Some(reply) = message.reply.clone() else {
                continue;
            };
            let headers = message.headers.clone().unwrap_or_default();
            let answer = if headers.get("Nats-Expected-Last-Subject-Sequence").is_some() {
                // The worker's probe: "nothing stored on this subject".
                r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 0"}}"#
            } else if message.subject.ends_with(".done") {
                let id = headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
                let event = serde_json::from_slice(&message.payload).expect("a completion");
                done.push((id, event));
                if done.len() <= 2 {
                    r#"{"stream":"EVENTS","seq":0,"duplicate":true}"#
                } else {
                    r#"{"stream":"EVENTS","seq":41}"#
                }
            } else {
                started += usize::from(message.subject.ends_with(".started"));
                r#"{"stream":"EVENTS","seq":40}"#
            };
            client.publish(reply, answer.into()).await.expect("answer");
            if done.len() == 3 {
                break;
            }
        }
        (done, started)
    })
}

/// Fails if an events stream was created after all: it would have taken
/// the publishes meant for `events_stream_acking_duplicates_of_nothing`.
async fn assert_no_events_stream(bus: &Bus) {
    let found = bus.js.get_stream(bus.subjects.events_stream()).await;
    assert!(found.is_err(), "a real events stream raced the responder");
}

/// A client for a worker under a new prefix whose events stream is
/// `events_stream_acking_duplicates_of_nothing`, and that responder.
/// Nothing is provisioned (the worker's probe, answered by the responder,
/// finds the stream, so the worker does not create it).
async fn bus_behind_a_duplicate_acking_events_stream(
    nats: &NatsServer,
) -> (Bus, tokio::task::JoinHandle<Answered>) {
    let prefix = unique_prefix();
    let client = wakebus::connect::NatsConfig::new(nats.url())
        .connect()
        .await
        .expect("connect");
    let bus = Bus::new(client, wakebus::protocol::Subjects::new(&prefix).unwrap());
    let responder = events_stream_acking_duplicates_of_nothing(&bus, &prefix);
    (bus, responder)
}

/// Taking a duplicate ack of nothing stored (see
/// `events_stream_acking_duplicates_of_nothing`) as stored lost the
/// completion: the worker must publish it again, under the same id, until
/// an ack names a sequence, and only then ack the task.
#[tokio::test]
async fn a_completion_acked_as_a_duplicate_of_nothing_stored_is_published_again_until_stored() {
    init_logs();
    let nats = NatsServer::start().await;
    let (bus, responder) = bus_behind_a_duplicate_acking_events_stream(&nats).await;

    let mut services = Services::new();
    services.echo_worker(&bus);
    let req = request("s.dropped", "stored at the third try");
    publish_until_stored(&bus, &req).await;
    let (done, _) = tokio::time::timeout(WAIT, responder)
        .await
        .expect("three publishes of the completion")
        .expect("responder");
    assert_no_events_stream(&bus).await;
    let expected = Some(CompletionEvent::id_for(&req.delegation_id, 0));
    let ids: Vec<_> = done.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, vec![expected.clone(), expected.clone(), expected]);
    // Acked once stored: nothing left to deliver or to acknowledge.
    let s = &bus.subjects;
    drained(&bus, &s.tasks_stream(), &s.worker_consumer("default"), WAIT).await;
    services.stop().await;
}

/// A task given up (its attempts used up) whose failed completion is not
/// stored at first keeps it and publishes it again in place, as a finished
/// task's: handed back, it was delivered again and given up again as
/// `max_deliveries_exceeded` ("the worker running it crashed, stalled or stopped"),
/// the wrong reason for the session.
#[tokio::test]
async fn a_given_up_task_whose_failed_completion_is_not_stored_at_first_keeps_its_reason() {
    init_logs();
    let nats = NatsServer::start().await;
    let (bus, responder) = bus_behind_a_duplicate_acking_events_stream(&nats).await;

    let mut services = Services::new();
    worker_that_cannot_start(&mut services, &bus, 1);
    let req = request("s.given.up", "cannot start");
    publish_until_stored(&bus, &req).await;
    let (done, started) = tokio::time::timeout(WAIT, responder)
        .await
        .expect("three publishes of the completion")
        .expect("responder");
    let s = &bus.subjects;
    drained(&bus, &s.tasks_stream(), &s.worker_consumer("default"), WAIT).await;
    services.stop().await;

    assert_no_events_stream(&bus).await;
    assert_eq!(started, 1, "the task ran once");
    for (id, event) in &done {
        assert_eq!(id, &Some(CompletionEvent::id_for(&req.delegation_id, 0)));
        assert_eq!(event.status, Status::Failed);
        assert_eq!(event.exit_reason, "max_attempts_exceeded", "{event:?}");
    }
    let dead_letters = all_messages(&bus, &s.dead_letter_stream()).await;
    assert_eq!(dead_letters.len(), 1);
}

/// A given-up task whose dead letter JetStream refuses at first (the
/// dead-letter stream full, discard=new) keeps it and publishes it again
/// in place, holding the task with in-progress acks: the task is not
/// delivered again (and so not given up again for another reason), and
/// once there is room, one dead letter and one completion with the real
/// reason are stored.
#[tokio::test]
async fn a_given_up_task_whose_dead_letter_is_refused_at_first_keeps_it_until_stored() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let s = &bus.subjects;
    let mut services = Services::new();
    worker_that_cannot_start(&mut services, &bus, 1);
    let consumer = s.worker_consumer("default");
    // The worker's consumer, once the worker has created it.
    let held = || async {
        let mut c = bus
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                &consumer,
                s.tasks_stream(),
            )
            .await
            .ok()?;
        c.info().await.ok().cloned()
    };
    wait_until(WAIT, "the worker's consumer", || async {
        held().await.is_some()
    })
    .await;
    // Fill the dead letters (after the worker provisioned the streams, which
    // would have undone it): one message, no room for more.
    let filler = bus
        .js
        .publish(s.dead_letter_task("elsewhere"), "filler".into())
        .await
        .expect("publish");
    filler.await.expect("stored");
    let mut dead_letters = bus.js.get_stream(s.dead_letter_stream()).await.unwrap();
    let room = dead_letters.info().await.unwrap().config.clone();
    let mut full = room.clone();
    full.max_messages = 1;
    full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    bus.js
        .update_stream(&full)
        .await
        .expect("fill the dead letters");

    let req = request("s.dlq.full", "cannot start");
    publish_until_stored(&bus, &req).await;
    wait_until(WAIT, "the task held by the worker", || async {
        held().await.is_some_and(|info| info.num_ack_pending == 1)
    })
    .await;
    // Not a wait for a condition: the task must stay held, undelivered
    // again, for longer than its ack wait while the dead letter is refused.
    let ack_wait = test_worker_config("default").ack_wait;
    tokio::time::sleep(ack_wait + Duration::from_secs(2)).await;
    let info = held().await.expect("the worker's consumer");
    assert_eq!(
        (info.num_ack_pending, info.delivered.consumer_sequence),
        (1, 1),
        "held, and delivered once: {info:?}"
    );
    assert!(
        done_events(&bus).await.is_empty(),
        "a completion before its dead letter"
    );

    bus.js.update_stream(&room).await.expect("make room");
    drained(&bus, &s.tasks_stream(), &consumer, WAIT).await;
    let info = held().await.expect("the worker's consumer");
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "delivered once: {info:?}"
    );
    services.stop().await;
    let done = done_events(&bus).await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].exit_reason, "max_attempts_exceeded", "{done:?}");
    let stored = all_messages(&bus, &s.dead_letter_stream()).await;
    assert_eq!(stored.len(), 2, "the filler and one dead letter");
}

/// Whether the default pool's worker consumer and the wake consumer each
/// have a pull request waiting.
async fn both_consumers_pulling(admin: &Bus) -> bool {
    let s = &admin.subjects;
    for (stream, consumer) in [
        (s.tasks_stream(), s.worker_consumer("default")),
        (s.events_stream(), s.wake_consumer().to_owned()),
    ] {
        let found = admin
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                consumer, stream,
            )
            .await;
        let Ok(mut consumer) = found else {
            return false;
        };
        if !consumer.info().await.is_ok_and(|info| info.num_waiting > 0) {
            return false;
        }
    }
    true
}

/// PUBs `bus`'s client has sent (a command queued while disconnected is
/// counted when it is sent, after the reconnect).
fn sent(bus: &Bus) -> u64 {
    bus.client
        .statistics()
        .out_messages
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// Through a NATS outage neither a worker nor the wake asks for messages
/// again: a pull made while the client reconnects is only queued (SUB, PUB,
/// UNSUB), so re-pulling every few seconds would fill the client's command
/// queue in a long outage (and then hold up every send, hand-backs at a
/// stop included) and, on the reconnect, send the server a pull request
/// for every inbox given up meanwhile. Each waits for its client to
/// connect and then pulls once.
#[tokio::test]
async fn neither_a_worker_nor_the_wake_queues_pull_requests_while_nats_is_down() {
    init_logs();
    let mut nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let admin = bus(&nats.url(), &prefix).await;
    let (worker_bus, wake_bus) = (
        bus(&nats.url(), &prefix).await,
        bus(&nats.url(), &prefix).await,
    );
    let mut services = Services::new();
    services.echo_worker(&worker_bus);
    services.wake(&wake_bus, test_wake_config(&api.url()));
    wait_until(WAIT, "both consumers pulling", || {
        both_consumers_pulling(&admin)
    })
    .await;
    let before = [sent(&worker_bus), sent(&wake_bus)];

    nats.kill();
    // Not a wait for a condition: the outage must outlast several of each
    // service's pulls (a worker's ends after 7 s, the wake's after two
    // missed 2 s heartbeats), so that re-pulling would show.
    tokio::time::sleep(Duration::from_secs(40)).await;
    nats.spawn();
    nats.wait_ready().await;
    for (service, bus, before) in [
        ("worker", &worker_bus, before[0]),
        ("wake", &wake_bus, before[1]),
    ] {
        wait_until(WAIT, "the client reconnected", || async {
            wakebus::connect::is_connected(&bus.client)
        })
        .await;
        // A flush is queued behind whatever the outage queued: once it
        // returns, all of that has been sent and counted.
        bus.client.flush().await.expect("flush");
        // At most: a pull sent between the count and the outage, the pull
        // after the reconnect, and the look for unreadable messages that
        // follows a reconnect (a consumer info). A worker's cancel watch
        // (an async-nats ordered consumer) also asks to re-create its
        // consumer about every 10 s while disconnected, out of our hands:
        // up to 4 more. Re-pulling through the outage sent 9 (worker) and
        // 10 (wake) here.
        let sent = sent(bus) - before;
        let most = if service == "worker" { 7 } else { 3 };
        assert!(
            sent <= most,
            "the {service} sent {sent} messages around a 40 s outage"
        );
    }
    let admin = bus(&nats.url(), &prefix).await;
    wait_until(WAIT, "both consumers pulling again", || {
        both_consumers_pulling(&admin)
    })
    .await;
    services.stop().await;
}

/// A combined turn's intent is written after its completions' `posting`
/// marks and before its post, so a completion marked for a combined turn
/// whose intent is missing (an instance stopped between the two) was never
/// posted: it is woken on its own, under its own key, not re-sent under a
/// combined key that no recorded intent explains (which would report it
/// twice if another instance later recovered a turn covering it).
#[tokio::test]
async fn a_completion_marked_for_a_combined_turn_never_recorded_is_woken_under_its_own_key() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let id = id_of(
        &Delegator::new(bus.clone())
            .delegate(Delegation::new("half recorded").session("s.half"))
            .await
            .unwrap(),
    );
    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    WakeLedger::new(state.wake_ledger)
        .mark_posting(
            &WakeLedger::key(&id, 0),
            "wake.01JV3S2D6F8H0K2M4P6R8T0W2Y",
            0,
        )
        .await
        .unwrap();
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let posts = api.accepted();
    assert_eq!(posts.len(), 1, "{posts:?}");
    assert_eq!(
        posts[0].header("idempotency-key"),
        Some(format!("{id}.0.done"))
    );
    assert_eq!(posts[0].delegation_ids(), vec![id]);
}

/// A combined turn whose intent is recorded but not every one of whose
/// completions was marked for it (a mark failed, then the instance
/// stopped) was never posted: the turn is posted only after the last
/// mark. Its completions are planned afresh, not re-sent as the recorded
/// turn, which would report again a completion that another instance has
/// meanwhile woken on its own.
#[tokio::test]
async fn a_combined_turn_not_every_completion_was_marked_for_is_not_resent() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let delegator = Delegator::new(bus.clone());
    let mut ids = Vec::new();
    for goal in ["first", "second"] {
        ids.push(id_of(
            &delegator
                .delegate(Delegation::new(goal).session("s.half.marked"))
                .await
                .unwrap(),
        ));
    }
    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let ledger = WakeLedger::new(state.wake_ledger);
    let key = "wake.01JV3S2D6F8H0K2M4P6R8T0W2Y";
    let recorded = "the recorded turn, never posted";
    ledger
        .put_intent(
            key,
            &wakebus::wake::ledger::Intent {
                text: recorded.to_owned(),
                covers: vec![WakeLedger::key(&ids[0], 0), WakeLedger::key(&ids[1], 0)],
            },
        )
        .await
        .unwrap();
    // Only the first completion's mark was stored.
    ledger
        .mark_posting(&WakeLedger::key(&ids[0], 0), key, 0)
        .await
        .unwrap();
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "both wakes", || async {
        api.woken_delegations() == 2
    })
    .await;
    services.stop().await;
    for post in api.accepted() {
        assert_ne!(post.header("idempotency-key").as_deref(), Some(key));
        assert!(!post.text().contains(recorded), "{}", post.text());
    }
}

/// Panics with the error `check` returns, if it returns one at any look
/// (every 50 ms) within `window`: for what must not happen.
async fn holds_throughout<F, Fut>(window: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let end = tokio::time::Instant::now() + window;
    while tokio::time::Instant::now() < end {
        if let Err(broken) = check().await {
            panic!("{broken}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes `value` over the session lock on `token` that the wake named
/// `wake` holds, as another instance's take would look once the wake's
/// lock expired; the wake may refresh it meanwhile (a changed revision is
/// read again). Returns the revision written.
async fn take_over_lock(
    kv: &async_nats::jetstream::kv::Store,
    token: &str,
    wake: &str,
    value: &bytes::Bytes,
) -> u64 {
    use async_nats::jetstream::kv::{Operation, UpdateErrorKind};
    loop {
        let entry = kv.entry(token).await.unwrap().expect("the wake's lock");
        let held = String::from_utf8_lossy(&entry.value).into_owned();
        assert!(
            entry.operation == Operation::Put && held.starts_with(&format!("{wake} ")),
            "not the wake's lock: {entry:?}"
        );
        match kv.update(token, value.clone(), entry.revision).await {
            Ok(revision) => return revision,
            Err(error) if error.kind() == UpdateErrorKind::WrongLastRevision => {}
            Err(error) => panic!("cannot take the lock over: {error}"),
        }
    }
}

/// Refreshes the lock on `token` every second from `revision`, as the
/// instance holding it would, until `stop`; returns the last revision
/// written, or why a refresh failed (someone else wrote the lock).
fn keep_lock(
    kv: async_nats::jetstream::kv::Store,
    token: String,
    value: bytes::Bytes,
    mut revision: u64,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Result<u64, String>> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return Ok(revision),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            revision = kv
                .update(&token, value.clone(), revision)
                .await
                .map_err(|error| format!("the other instance's lock refresh failed: {error}"))?;
        }
    })
}

/// The `Idempotency-Key` of every post in `posts`.
fn keys_of(posts: &[common::session_api::Recorded]) -> Vec<Option<String>> {
    posts.iter().map(|p| p.header("idempotency-key")).collect()
}

/// Two completions for `session` in the history, from an echo worker
/// started in `services`, for a wake started once this returns to post
/// as one combined turn (with a coalesce window long enough to take both:
/// `combining_wake_config`). A combined turn's Idempotency-Key,
/// `wake.<ULID>`, is new at each plan, so that only the key recorded in
/// the ledger can be sent again; a single completion's key is its event's
/// id, the same at every plan. Returns the delegation ids.
async fn two_completions_waiting(bus: &Bus, services: &mut Services, session: &str) -> [String; 2] {
    let ids = [
        delegate(bus, Delegation::new("first").session(session)).await,
        delegate(bus, Delegation::new("second").session(session)).await,
    ];
    services.echo_worker(bus);
    wait_until(WAIT, "both completions", || async {
        done_events(bus).await.len() == 2
    })
    .await;
    ids
}

/// `test_wake_config` posting to `url`, whose coalesce window takes both
/// completions of `two_completions_waiting` into one turn.
fn combining_wake_config(url: &str) -> wakebus::wake::WakeConfig {
    let mut config = test_wake_config(url);
    config.coalesce_window = Duration::from_millis(500);
    config
}

/// Asserts that `post` is the combined turn of the delegations `ids`;
/// returns its Idempotency-Key.
fn assert_combined(post: &common::session_api::Recorded, ids: &[String; 2]) -> String {
    let key = post.header("idempotency-key").expect("a key");
    assert!(key.starts_with("wake."), "not a combined turn's key: {key}");
    let mut reported = post.delegation_ids();
    reported.sort();
    let mut expected = ids.to_vec();
    expected.sort();
    assert_eq!(reported, expected, "{}", post.text());
    key
}

/// A wake whose lock another instance takes while it retries a failing
/// post (its refreshes were lost past the TTL, say) learns it at its next
/// refresh: it posts no more, leaves the other instance's lock alone and
/// keeps the completions, unacked, until it takes the lock again; then it
/// sends the turn again under the key its ledger recorded.
#[tokio::test]
async fn a_wake_that_loses_its_session_lock_while_retrying_stops_posting_and_resends_under_the_same_key()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(503);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let session = "s.lock.lost";
    let mut services = Services::new();
    let ids = two_completions_waiting(&bus, &mut services, session).await;
    // Refreshed every second (a third of the TTL) while the post is retried.
    let ttl = Duration::from_secs(3);
    let settings = wakebus::bus::BusSettings {
        session_lock_ttl: ttl,
        ..Default::default()
    };
    let mut config = combining_wake_config(&api.url());
    config.instance = "wake-under-test".to_owned();
    let ack_wait = config.ack_wait;
    services.wake_with(&bus, settings, config);
    wait_until(WAIT, "the wake retrying its post", || async {
        api.all_posts().len() >= 3
    })
    .await;
    let key = assert_combined(&api.all_posts()[0], &ids);

    let kv = session_lock_bucket(&bus, ttl).await;
    let token = wakebus::protocol::session_token(session);
    let foreign = bytes::Bytes::from(format!("another-wake {}", ulid::Ulid::new()));
    let taken = take_over_lock(&kv, &token, "wake-under-test", &foreign).await;
    let taken_at = std::time::Instant::now();
    let stop_keeping = tokio_util::sync::CancellationToken::new();
    let keeper = keep_lock(
        kv.clone(),
        token.clone(),
        foreign.clone(),
        taken,
        stop_keeping.clone(),
    );

    // Posts came every 50 to 300 ms (test_wake_config's backoff); the
    // wake's next refresh, due at most a third of the TTL after the take,
    // fails, and they stop.
    let quiet = Duration::from_millis(1500);
    wait_until(WAIT, "the wake to stop posting", || async {
        api.all_posts().last().unwrap().at.elapsed() >= quiet
    })
    .await;
    let posts = api.all_posts().len();
    let posted_on = api
        .all_posts()
        .last()
        .unwrap()
        .at
        .saturating_duration_since(taken_at);
    assert!(
        posted_on < ttl,
        "the wake posted for {posted_on:?} after another instance took its lock"
    );
    // Not a wait for a condition: nothing may happen while the other
    // instance holds the lock. Two TTLs, past the AckWait: the wake tries
    // to take the lock at least once a second, a wake waiting out a lock's
    // TTL and taking it would post within one, and completions the wake
    // did not keep alive would be redelivered.
    let window = (2 * ttl).max(ack_wait + Duration::from_secs(1));
    holds_throughout(window, || async {
        let now = api.all_posts().len();
        if now != posts {
            return Err(format!(
                "{} post(s) while another instance held the lock",
                now - posts
            ));
        }
        if keeper.is_finished() {
            return Err("the other instance's lock was written over".to_owned());
        }
        Ok(())
    })
    .await;

    stop_keeping.cancel();
    let revision = keeper
        .await
        .unwrap()
        .unwrap_or_else(|error| panic!("{error}"));
    let entry = kv.entry(&token).await.unwrap().expect("the other lock");
    assert_eq!(
        (entry.operation, &entry.value, entry.revision),
        (
            async_nats::jetstream::kv::Operation::Put,
            &foreign,
            revision
        ),
        "the wake wrote over another instance's lock"
    );
    let info = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(
        (info.num_ack_pending, info.num_pending, info.num_redelivered),
        (2, 0, 0),
        "a completion left the wake: {info:?}"
    );
    let dlq = bus.subjects.dead_letter_stream();
    assert_eq!(stored_messages(&bus, &dlq).await, 0, "dead-lettered");
    let ledger = WakeLedger::new(
        bus.js
            .get_key_value(bus.subjects.wake_ledger_bucket())
            .await
            .unwrap(),
    );
    for id in &ids {
        assert_eq!(
            ledger.get(&WakeLedger::key(id, 0)).await.unwrap(),
            Some(wakebus::wake::ledger::LedgerState::Posting {
                idempotency_key: key.clone()
            })
        );
    }

    // The other instance is done with the session, and the API is back.
    api.recover();
    kv.delete(&token).await.unwrap();
    wait_until(WAIT, "the turn accepted", || async {
        !api.accepted().is_empty()
    })
    .await;
    for id in &ids {
        ledger_records_delivery(&bus, id).await;
    }
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(api.turns().len(), 1, "{:?}", api.accepted());
    assert_combined(&api.accepted()[0], &ids);
    let all = api.all_posts();
    assert_eq!(all.len(), posts + 1, "once the lock was free: one post");
    assert!(
        keys_of(&all).iter().all(|k| k.as_ref() == Some(&key)),
        "posted under another key than {key}: {:?}",
        keys_of(&all)
    );
    assert_eq!(api.max_in_flight_per_session(), 1);
    assert_eq!(stored_messages(&bus, &dlq).await, 0, "dead-lettered");
}

/// What a connection through [`PostTap`] carried from the client.
#[derive(Default)]
struct Wire {
    bytes: Vec<u8>,
    /// Where each read began in `bytes`, and when it came.
    reads: Vec<(usize, std::time::Instant)>,
}

/// A post as it went over the wire.
#[derive(Debug)]
struct SentPost {
    /// When its first bytes reached the tap.
    at: std::time::Instant,
    key: Option<String>,
}

/// A TCP forwarder in front of the session API that keeps what the wake
/// sent over each connection. A post the wake gives up on is in none of
/// the API's records (the API stops handling a request whose connection
/// closes, before it records it), but it went over the wire.
struct PostTap {
    addr: std::net::SocketAddr,
    wires: Arc<Mutex<Vec<Arc<Mutex<Wire>>>>>,
}

impl PostTap {
    async fn start(api: &SessionApiServer) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = api.addr;
        let wires: Arc<Mutex<Vec<Arc<Mutex<Wire>>>>> = Arc::default();
        tokio::spawn({
            let wires = Arc::clone(&wires);
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let wire: Arc<Mutex<Wire>> = Arc::default();
                    wires.lock().unwrap().push(Arc::clone(&wire));
                    tokio::spawn(Self::forward(inbound, target, wire));
                }
            }
        });
        Self { addr, wires }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn forward(
        inbound: tokio::net::TcpStream,
        target: std::net::SocketAddr,
        wire: Arc<Mutex<Wire>>,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
            return;
        };
        let (mut from_client, mut to_client) = inbound.into_split();
        let (mut from_server, mut to_server) = outbound.into_split();
        let upstream = async {
            let mut buffer = vec![0; 64 * 1024];
            while let Ok(n @ 1..) = from_client.read(&mut buffer).await {
                {
                    let mut wire = wire.lock().unwrap();
                    let at = wire.bytes.len();
                    wire.reads.push((at, std::time::Instant::now()));
                    wire.bytes.extend_from_slice(&buffer[..n]);
                }
                if to_server.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
            // The client gave up: so does the connection to the API.
            let _ = to_server.shutdown().await;
        };
        let downstream = async {
            let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
            let _ = to_client.shutdown().await;
        };
        tokio::join!(upstream, downstream);
    }

    /// Every post sent through the tap, in the order sent.
    fn posts(&self) -> Vec<SentPost> {
        fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
            haystack.windows(needle.len()).position(|w| w == needle)
        }
        let mut posts = Vec::new();
        for wire in self.wires.lock().unwrap().iter() {
            let wire = wire.lock().unwrap();
            let bytes = &wire.bytes;
            let mut from = 0;
            // The JSON body holds no raw line break, so a request line
            // is only ever at the start of a request.
            while let Some(start) = find(&bytes[from..], b"POST /v1/chat/completions ") {
                let start = from + start;
                let end = find(&bytes[start..], b"\r\n\r\n").map_or(bytes.len(), |i| start + i);
                let head = String::from_utf8_lossy(&bytes[start..end]);
                let key = head.lines().find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.trim()
                        .eq_ignore_ascii_case("idempotency-key")
                        .then(|| value.trim().to_owned())
                });
                let at = wire
                    .reads
                    .iter()
                    .rev()
                    .find(|(offset, _)| *offset <= start)
                    .map(|(_, at)| *at)
                    .expect("a read");
                posts.push(SentPost { at, key });
                from = end;
            }
        }
        posts.sort_by_key(|post| post.at);
        posts
    }
}

/// A post whose answer does not come within `--request-timeout` is in
/// doubt: the wake gives it up and sends it again under the same
/// Idempotency-Key, so an API honouring the key shows one turn, and the
/// ledger records that one turn delivered. A combined turn: see
/// `two_completions_waiting`.
#[tokio::test]
async fn a_post_that_times_out_is_sent_again_under_the_same_idempotency_key() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let tap = PostTap::start(&api).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let ids = two_completions_waiting(&bus, &mut services, "s.timed.out").await;
    let mut config = combining_wake_config(&tap.url());
    config.api.request_timeout = Duration::from_secs(2);
    let request_timeout = config.api.request_timeout;
    // The first post would be answered long after the wake gave it up.
    api.set_delay(3 * request_timeout);
    services.wake(&bus, config);
    wait_until(WAIT, "the first post in flight", || async {
        api.in_flight() == 1
    })
    .await;
    // The posts after it are answered at once (the first keeps its delay).
    api.set_delay(Duration::ZERO);
    wait_until(WAIT, "the turn accepted", || async {
        !api.accepted().is_empty()
    })
    .await;
    for id in &ids {
        ledger_records_delivery(&bus, id).await;
    }
    wake_consumer_settled(&bus).await;
    services.stop().await;

    let accepted = api.accepted();
    let key = assert_combined(&accepted[0], &ids);
    assert_eq!(api.turns().len(), 1, "{:?}", keys_of(&accepted));
    // The ledger: one turn delivered, covering both completions.
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    let mut delivered = Vec::new();
    let mut entries = ledger.keys().await.unwrap();
    while let Some(entry) = entries.next().await {
        let entry = entry.unwrap();
        let value = ledger.get(&entry).await.unwrap().unwrap_or_default();
        if let Ok(wakebus::wake::ledger::LedgerState::Delivered {
            idempotency_key, ..
        }) = serde_json::from_slice(&value)
        {
            delivered.push((entry, idempotency_key));
        }
    }
    delivered.sort();
    let mut expected: Vec<_> = ids
        .iter()
        .map(|id| (WakeLedger::key(id, 0), key.clone()))
        .collect();
    expected.sort();
    assert_eq!(delivered, expected);

    let sent = tap.posts();
    assert_eq!(
        sent.len(),
        2,
        "the post given up, then its repeat: {sent:?}"
    );
    assert!(
        sent.iter().all(|post| post.key.as_ref() == Some(&key)),
        "sent under another key than the delivered {key}: {sent:?}"
    );
    // Sent again once the first was given up, a request timeout after it
    // was sent (less the connection's setup, before the tap saw it).
    let gap = sent[1].at - sent[0].at;
    assert!(
        gap >= request_timeout - Duration::from_millis(500),
        "sent again after {gap:?}"
    );
}

/// A worker or wake service whose NATS client has ended returns an error,
/// not a clean stop, so that its process exits non-zero and a supervisor
/// restarts it with a new client.
#[tokio::test]
async fn a_worker_and_a_wake_whose_nats_client_has_ended_fail_instead_of_stopping_cleanly() {
    use wakebus::bus::BusSettings;
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();

    let worker_bus = bus(&nats.url(), &prefix).await;
    let env = wakebus::worker::executor::TaskEnv {
        nats_url: String::new(),
        prefix: prefix.clone(),
        pool: "default".to_owned(),
    };
    let worker = tokio::spawn(wakebus::worker::run(
        worker_bus.clone(),
        BusSettings::default(),
        Executor::Echo(wakebus::worker::executor::EchoExecutor),
        env,
        test_worker_config("default"),
        std::future::pending::<()>(),
    ));
    let wake_bus = bus(&nats.url(), &prefix).await;
    let wake = tokio::spawn(wakebus::wake::run(
        wake_bus.clone(),
        BusSettings::default(),
        test_wake_config(&api.url()),
        std::future::pending::<()>(),
    ));
    // Both running: a delegation goes all the way through.
    let id = delegate(&worker_bus, Delegation::new("once").session("s.ended")).await;
    wait_until(WAIT, "the wake", || async {
        api.accepted()
            .iter()
            .any(|post| post.delegation_ids() == [id.clone()])
    })
    .await;

    worker_bus.client.drain().await.unwrap();
    let worker = tokio::time::timeout(WAIT, worker)
        .await
        .expect("the worker stops once its client has ended")
        .expect("the worker did not panic");
    assert!(
        matches!(worker, Err(wakebus::worker::WorkerError::ConnectionLost(_))),
        "{worker:?}"
    );
    wake_bus.client.drain().await.unwrap();
    let wake = tokio::time::timeout(WAIT, wake)
        .await
        .expect("the wake stops once its client has ended")
        .expect("the wake did not panic");
    assert!(
        matches!(wake, Err(wakebus::wake::WakeError::ConnectionLost(_))),
        "{wake:?}"
    );
}
