//! A delivered wake's ledger record: written until JetStream stores it,
//! with the session kept meanwhile, so that no copy of a woken completion
//! is posted again (GUARANTEES.md, "The one window").

mod common;

use std::time::Duration;

use async_nats::jetstream::stream::Config as StreamConfig;
use common::*;
use futures::StreamExt;
use wakebus::bus::{Bus, BusSettings};
use wakebus::delegate::Delegation;
use wakebus::wake::ledger::{LedgerError, LedgerState, WakeLedger};

const WAIT: Duration = Duration::from_secs(30);

/// Makes the wake ledger refuse every write, as a stream at a limit would
/// (a 16-byte message limit), and returns its config for the operator's
/// fix: `room_again`.
async fn refuse_ledger_writes(bus: &Bus) -> StreamConfig {
    let name = wakebus::protocol::Subjects::bucket_stream(&bus.subjects.wake_ledger_bucket());
    // Created by the wake service as it starts.
    let mut stream = eventually(WAIT, "the wake ledger", || async {
        bus.js.get_stream(&name).await.ok()
    })
    .await;
    let config = stream.info().await.unwrap().config.clone();
    let mut refusing = config.clone();
    refusing.max_message_size = 16;
    bus.js.update_stream(&refusing).await.unwrap();
    config
}

/// Gives the ledger its room back.
async fn room_again(bus: &Bus, config: &StreamConfig) {
    bus.js.update_stream(config).await.unwrap();
}

/// The ledger's entry for task 0 of delegation `id`.
async fn ledger_entry(bus: &Bus, id: &str) -> String {
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    let entry = ledger.get(format!("{id}.0")).await.unwrap();
    String::from_utf8_lossy(&entry.expect("a ledger entry")).into_owned()
}

/// The operator makes room: the delivery is then recorded, and a copy of
/// the completion published after that is settled without a post.
async fn recorded_once_there_is_room(bus: &Bus, config: &StreamConfig, id: &str) {
    room_again(bus, config).await;
    ledger_records_delivery(bus, id).await;
    publish_completion_again(bus).await;
}

#[tokio::test]
async fn a_delivery_the_ledger_refuses_to_record_is_recorded_once_it_takes_writes_again() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    // Held until the ledger refuses writes.
    api.hold_posts();
    let id = delegate(&bus, Delegation::new("refused").session("s.refused")).await;
    wait_until(WAIT, "the post to be in flight", || async {
        api.in_flight() == 1
    })
    .await;
    let config = refuse_ledger_writes(&bus).await;
    api.release_posts();
    // The acks go out with the first `delivered` write, after it on the
    // same connection: once the completion is acked, the write was refused.
    wake_consumer_settled(&bus).await;
    assert!(
        ledger_entry(&bus, &id).await.contains("posting"),
        "the delivery was recorded through a refusing stream"
    );

    recorded_once_there_is_room(&bus, &config, &id).await;
    services.stop().await;
    assert_eq!(api.all_posts().len(), 1, "the wake was posted again");
}

#[tokio::test]
async fn a_wake_delivered_while_nats_is_down_is_recorded_by_a_write_made_after_it_returns() {
    let p = Pipeline::start().await;
    let (mut nats, api, bus, services) = (p.nats, p.api, p.bus, p.services);
    // The post is held until NATS is down under it.
    api.hold_posts();
    let id = delegate(&bus, Delegation::new("outage").session("s.outage")).await;
    wait_until(WAIT, "the post to be in flight", || async {
        api.in_flight() == 1
    })
    .await;
    // The ledger refuses writes through the outage and after it (the stream
    // keeps its config across the restart), so that a write queued by the
    // client during the outage cannot be what records the delivery.
    let config = refuse_ledger_writes(&bus).await;
    nats.kill();
    api.release_posts();
    wait_until(WAIT, "the post to be answered 200", || async {
        api.accepted().len() == 1
    })
    .await;
    // The outage (its length is the scenario) outlasts a JetStream write's
    // 5 s timeout.
    tokio::time::sleep(Duration::from_secs(7)).await;
    nats.restart().await;
    wake_consumer_settled(&bus).await;
    assert!(
        ledger_entry(&bus, &id).await.contains("posting"),
        "the delivery was recorded through a refusing stream"
    );
    recorded_once_there_is_room(&bus, &config, &id).await;
    services.stop().await;
    assert_eq!(api.all_posts().len(), 1, "the wake was posted again");
}

#[tokio::test]
async fn a_session_stays_with_its_wake_and_keeps_its_lock_while_a_delivery_record_is_refused() {
    session_kept_while_a_delivery_record_is_refused(false).await;
}

/// A lock refresh that fails while the record is retried (the lock bucket
/// refuses writes for a moment) is tried again until it holds, rather than
/// left to expire and give the session to another instance.
#[tokio::test]
async fn a_session_lock_refresh_that_fails_while_a_delivery_record_is_refused_is_tried_again() {
    session_kept_while_a_delivery_record_is_refused(true).await;
}

/// One wake holds a session while its delivery record is refused for three
/// AckWaits; with `lock_refused`, its lock bucket also refuses writes for
/// longer than one refresh interval meanwhile.
async fn session_kept_while_a_delivery_record_is_refused(lock_refused: bool) {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // A lock TTL shorter than the refusal: only refreshes keep it. (Longer
    // when a refresh is refused: room for the refusal and a retry after it.)
    let settings = BusSettings {
        session_lock_ttl: Duration::from_secs(if lock_refused { 9 } else { 4 }),
        ..Default::default()
    };
    let config = test_wake_config(&api.url());
    let ack_wait = config.ack_wait;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake_with(&bus, settings.clone(), config);
    // Held until the ledger refuses writes.
    api.hold_posts();
    let first = delegate(&bus, Delegation::new("first").session("s.kept")).await;
    wait_until(WAIT, "the first post to be in flight", || async {
        api.in_flight() == 1
    })
    .await;
    let room = refuse_ledger_writes(&bus).await;
    api.release_posts();
    let second = delegate(&bus, Delegation::new("second").session("s.kept")).await;
    wait_until(WAIT, "both completions to be published", || async {
        done_events(&bus).await.len() == 2
    })
    .await;
    // The first is acked with its refused record; the second waits in the
    // wake for the session.
    wait_until(
        WAIT,
        "the second completion to wait in the wake",
        || async {
            wake_consumer_info(&bus)
                .await
                .is_some_and(|info| info.num_ack_pending == 1 && info.num_pending == 0)
        },
    )
    .await;
    assert_eq!(api.accepted().len(), 1);

    if lock_refused {
        // Every write of the session's lock, stored or refused.
        let lock_bucket = bus.subjects.session_lock_bucket();
        let token = wakebus::protocol::session_token("s.kept");
        let mut writes = bus
            .client
            .subscribe(format!("$KV.{lock_bucket}.{token}"))
            .await
            .unwrap();
        bus.client.flush().await.unwrap();
        let name = wakebus::protocol::Subjects::bucket_stream(&lock_bucket);
        let mut stream = bus.js.get_stream(&name).await.unwrap();
        let config = stream.info().await.unwrap().config.clone();
        let mut refusing = config.clone();
        refusing.max_message_size = 16;
        bus.js.update_stream(&refusing).await.unwrap();
        // A refused refresh is tried again a second later, not at the next
        // regular refresh (a third of the TTL, 3 s, later): two writes well
        // under 3 s apart while the bucket refuses them.
        tokio::time::timeout(WAIT, async {
            let mut last: Option<std::time::Instant> = None;
            while writes.next().await.is_some() {
                let now = std::time::Instant::now();
                if last.is_some_and(|last| now - last < Duration::from_millis(2200)) {
                    return;
                }
                last = Some(now);
            }
        })
        .await
        .expect("a refused lock refresh tried again within 2.2 s");
        bus.js.update_stream(&config).await.unwrap();
    }
    // The refusal (its length is the scenario) lasts three AckWaits.
    tokio::time::sleep(3 * ack_wait).await;
    let info = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(
        info.num_redelivered, 0,
        "a completion the wake held was redelivered"
    );
    assert_eq!(
        info.num_ack_pending, 1,
        "the second completion left the wake"
    );
    let locks = session_lock_bucket(&bus, settings.session_lock_ttl).await;
    let token = wakebus::protocol::session_token("s.kept");
    assert!(
        locks
            .get(&token)
            .await
            .unwrap()
            .is_some_and(|v| !v.is_empty()),
        "the session lock lapsed"
    );
    assert!(ledger_entry(&bus, &first).await.contains("posting"));

    room_again(&bus, &room).await;
    ledger_records_delivery(&bus, &first).await;
    ledger_records_delivery(&bus, &second).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 2, "a wake was posted twice or not at all");
    assert_eq!(posts[1].delegation_ids(), [second]);
}

#[tokio::test]
async fn a_wake_stopped_while_its_delivery_record_is_refused_stops_and_leaves_the_entry_posting() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    // Held until the ledger refuses writes.
    api.hold_posts();
    let id = delegate(&bus, Delegation::new("stopped").session("s.stopped")).await;
    wait_until(WAIT, "the post to be in flight", || async {
        api.in_flight() == 1
    })
    .await;
    refuse_ledger_writes(&bus).await;
    api.release_posts();
    wake_consumer_settled(&bus).await;

    // The record loop ends at the stop instead of retrying forever.
    tokio::time::timeout(WAIT, services.stop())
        .await
        .expect("the wake stopped");
    assert!(ledger_entry(&bus, &id).await.contains("posting"));
    assert_eq!(api.all_posts().len(), 1);
}

#[tokio::test]
async fn completions_whose_turn_the_ledger_refuses_to_record_stay_with_the_wake_until_woken() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let ack_wait = test_wake_config(&api.url()).ack_wait;
    // Refused before the completions arrive: their plan cannot record the
    // turn (two of them: a combined turn, whose intent is written first),
    // and the wake keeps them and plans again.
    let config = refuse_ledger_writes(&bus).await;
    let mut ids = Vec::new();
    for goal in ["one", "two"] {
        ids.push(delegate(&bus, Delegation::new(goal).session("s.unplanned")).await);
    }
    completions_waiting_in_wake(&bus, 2).await;
    // The refusal (its length is the scenario) lasts three AckWaits.
    tokio::time::sleep(3 * ack_wait).await;
    let info = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(
        info.num_redelivered, 0,
        "a completion was dropped and redelivered"
    );
    assert_eq!(info.num_ack_pending, 2);
    assert!(api.all_posts().is_empty(), "posted without a ledger entry");

    room_again(&bus, &config).await;
    for id in &ids {
        ledger_records_delivery(&bus, id).await;
    }
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let mut woken: Vec<String> = api
        .all_posts()
        .iter()
        .flat_map(|post| post.delegation_ids())
        .collect();
    woken.sort();
    ids.sort();
    assert_eq!(woken, ids, "each delegation is woken once");
}

/// A ledger entry that is not ledger JSON (edited by hand) cannot be
/// planned around: the completion is held, not posted on a guess and not
/// dropped, and it is woken once an operator deletes the entry.
#[tokio::test]
async fn a_completion_whose_ledger_entry_is_corrupt_is_held_until_the_entry_is_fixed() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let request = request("s.corrupt", "held behind a bad entry");
    let key = WakeLedger::key(&request.delegation_id, 0);
    state
        .wake_ledger
        .put(&key, "not ledger json".into())
        .await
        .unwrap();
    // Reads of the entry, as the server receives them (direct gets name
    // the key in their subject, others in their body).
    let wanted = format!("$KV.{}.{key}", bus.subjects.wake_ledger_bucket());
    let mut api_requests = bus.client.subscribe("$JS.API.>").await.unwrap();
    bus.client.flush().await.unwrap();
    let reads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counting = reads.clone();
    let counter = tokio::spawn(async move {
        while let Some(message) = api_requests.next().await {
            let body = String::from_utf8_lossy(&message.payload);
            if message.subject.contains(".GET.")
                && (message.subject.ends_with(&wanted) || body.contains(&wanted))
            {
                counting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    publish_until_stored(&bus, &request).await;
    completions_waiting_in_wake(&bus, 1).await;
    // Planned: the wake met the entry (and tries again in 30 s). A wake
    // that posted past it would do so within milliseconds of that read;
    // nothing is posted in the second after it.
    wait_until(WAIT, "the wake to read the entry", || async {
        reads.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    counter.abort();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(api.all_posts().is_empty(), "posted past a corrupt entry");
    let info = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(info.num_ack_pending, 1, "the completion is still held");
    let deleted_at = std::time::Instant::now();
    state.wake_ledger.delete(&key).await.unwrap();
    wait_until(
        Duration::from_secs(45),
        "the wake once the entry is gone",
        || async { api.accepted().len() == 1 },
    )
    .await;
    services.stop().await;
    // One post, and none before the entry was gone: nothing was posted on
    // a guess past it.
    let posts = api.all_posts();
    assert_eq!(posts.len(), 1);
    assert!(posts[0].at >= deleted_at, "posted past a corrupt entry");
}

/// The wake ledger of `bus`, provisioned.
async fn ledger_of(bus: &Bus) -> WakeLedger {
    let state = bus
        .provision_wake_state(&BusSettings::default())
        .await
        .unwrap();
    WakeLedger::new(state.wake_ledger)
}

/// Another instance wakes the completion of `key`: its entry is
/// `delivered` under `theirs`; returns that record's revision.
async fn woken_by_another_instance(ledger: &WakeLedger, key: &str) -> u64 {
    let posting = ledger
        .mark_posting_if_new(key, "theirs")
        .await
        .unwrap()
        .expect("a new entry");
    ledger.mark_delivered(key, "theirs", posting).await.unwrap();
    ledger.read(key).await.unwrap().revision
}

/// A `posting` mark is written only over the revision the planner read:
/// one planned on a read that another instance's write has since made
/// stale is refused, and that write stays.
#[tokio::test]
async fn a_posting_mark_planned_on_a_stale_read_is_refused_and_the_newer_entry_stays() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let ledger = ledger_of(&bus).await;
    let key = WakeLedger::key("01JV3S2D6F8H0K2M4P6R8T0W2Y", 0);
    let planned = ledger.read(&key).await.unwrap();
    assert_eq!((planned.state.clone(), planned.revision), (None, 0));
    // Another instance wakes the completion meanwhile.
    let theirs = woken_by_another_instance(&ledger, &key).await;
    let refused = ledger.mark_posting(&key, "mine", planned.revision).await;
    assert!(
        matches!(&refused, Err(LedgerError::Changed { key: changed }) if *changed == key),
        "{refused:?}"
    );
    assert_eq!(
        ledger.mark_posting_if_new(&key, "mine").await.unwrap(),
        None
    );
    assert!(matches!(
        ledger.get(&key).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == "theirs"
    ));
    // A forced replay records its key over whatever is there...
    ledger.record_forced(&key, "forced").await.unwrap();
    let forced = ledger.read(&key).await.unwrap();
    assert!(forced.revision > theirs);
    // ...so a `delivered` record planned before it (a post that was still
    // being made) is refused: the forced copy is still to be posted.
    let late = ledger.mark_delivered(&key, "theirs", theirs).await;
    assert!(matches!(late, Err(LedgerError::Changed { .. })), "{late:?}");
    // A deleted entry is written over its deletion's revision, and only that.
    let bucket = bus.subjects.wake_ledger_bucket();
    let kv = bus.js.get_key_value(bucket).await.unwrap();
    kv.delete(&key).await.unwrap();
    let deleted = ledger.read(&key).await.unwrap();
    assert_eq!(deleted.state, None);
    assert!(deleted.revision > forced.revision);
    assert_eq!(
        ledger.mark_posting_if_new(&key, "replayed").await.unwrap(),
        None
    );
    ledger
        .mark_posting(&key, "replayed", deleted.revision)
        .await
        .unwrap();
    assert_eq!(
        ledger.get(&key).await.unwrap(),
        Some(LedgerState::Posting {
            idempotency_key: "replayed".to_owned()
        })
    );
}

/// A mark made while its instance is cut off from NATS is given up, but
/// its client still holds it and sends it once reconnected, after another
/// instance may have woken the completion. Written over anything, it would
/// turn that `delivered` back into `posting` (or revive a combined turn),
/// and the completion would be woken again; written only over the
/// revision read, it is refused when it lands.
#[tokio::test]
async fn a_posting_mark_that_reaches_nats_late_does_not_overwrite_a_wake_made_meanwhile() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let ledger = ledger_of(&bus).await;
    let proxy = common::proxy::Proxy::start(nats.port).await;
    let cut_off = proxy.bus(&bus).await;
    let client = cut_off.client.clone();
    let cut_off_ledger = WakeLedger::new(
        cut_off
            .js
            .get_key_value(bus.subjects.wake_ledger_bucket())
            .await
            .unwrap(),
    );
    let key = WakeLedger::key("01JV3S2D6F8H0K2M4P6R8T0W2Y", 0);
    let planned = cut_off_ledger.read(&key).await.unwrap();
    proxy.cut();
    wait_until(WAIT, "the client to notice the cut", || async {
        client.connection_state() != async_nats::connection::State::Connected
    })
    .await;
    let given_up = tokio::time::timeout(
        WAIT,
        cut_off_ledger.mark_posting(&key, "late", planned.revision),
    )
    .await
    .expect("the mark to time out");
    assert!(given_up.is_err(), "a mark answered while cut off");
    // A write made with no condition the same way: it does land, later,
    // which shows the mark above is sent late too, not dropped.
    let control = WakeLedger::key("01JV3S2D6F8H0K2M4P6R8T0W30", 0);
    let lands = tokio::time::timeout(
        WAIT,
        cut_off_ledger.mark_delivered(&control, "written late", 0),
    )
    .await
    .expect("the control write to time out");
    assert!(lands.is_err(), "a write answered while cut off");
    // Another instance wakes the completion meanwhile.
    woken_by_another_instance(&ledger, &key).await;
    proxy.restore();
    // A later write from the reconnected client is stored after the queued
    // mark has been applied or refused.
    let barrier = WakeLedger::key("01JV3S2D6F8H0K2M4P6R8T0W2Z", 0);
    eventually(WAIT, "a write through the reconnected client", || async {
        cut_off_ledger
            .mark_posting_if_new(&barrier, "after")
            .await
            .ok()
    })
    .await;
    assert!(matches!(
        ledger.get(&control).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == "written late"
    ));
    assert!(matches!(
        ledger.get(&key).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == "theirs"
    ));
}

/// Another instance records a completion's delivery between the wake's
/// read of its entry and the wake's mark. The mark, made over the revision
/// read, is refused; the wake plans again on what is there now, finds the
/// delivery, and acks its copy unposted.
#[tokio::test]
async fn a_wake_whose_entry_changes_between_its_read_and_its_mark_plans_again_and_does_not_post() {
    let p = Pipeline::start().await;
    let (nats, api, bus, services) = (p.nats, p.api, p.bus, p.services);
    let id = delegate(&bus, Delegation::new("raced").session("s.raced")).await;
    wait_until(WAIT, "the wake", || async { api.accepted().len() == 1 }).await;
    ledger_records_delivery(&bus, &id).await;
    services.stop().await;
    // The operator deletes the entry (`nats kv del`): a copy of the
    // completion is then read and planned, not created and posted at once.
    let ledger = ledger_of(&bus).await;
    let key = WakeLedger::key(&id, 0);
    let kv = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    kv.delete(&key).await.unwrap();
    let deleted = ledger.read(&key).await.unwrap().revision;

    // As soon as NATS answers a read of the entry, another instance records
    // the delivery; the wake's mark, 150 ms away each way, comes later.
    let answer = format!(
        "\"subject\":\"$KV.{}.{key}\"",
        bus.subjects.wake_ledger_bucket()
    );
    let mut replies = bus.client.subscribe("_INBOX.>").await.unwrap();
    let theirs = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move {
            while let Some(reply) = replies.next().await {
                if String::from_utf8_lossy(&reply.payload).contains(&answer) {
                    return ledger.mark_delivered(&key, "theirs", deleted).await;
                }
            }
            panic!("the subscription ended");
        })
    };
    let proxy = common::proxy::Proxy::start_delayed(nats.port, Duration::from_millis(150)).await;
    let dir = tempfile::tempdir().unwrap();
    let proxied = format!("nats://127.0.0.1:{}", proxy.port);
    let wake = common::process::Service::spawn(
        common::process::wake_args(&proxied, bus.subjects.prefix(), &api.url()),
        dir.path().join("wake.log"),
    );
    let _logs = common::process::LogsOnPanic(vec![wake.log.clone()]);
    republish_completion(&bus).await;
    tokio::time::timeout(WAIT, theirs)
        .await
        .expect("the wake to read the entry")
        .unwrap()
        .expect("the other instance's record");
    wake_consumer_settled(&bus).await;

    assert_eq!(api.all_posts().len(), 1, "the copy was posted");
    assert!(matches!(
        ledger.get(&key).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == "theirs"
    ));
    let log = std::fs::read_to_string(&wake.log).unwrap();
    assert!(
        log.contains("changed while the session's turns were planned; planning again"),
        "{log}"
    );
}

/// A batch's turn is planned under the session lock, reading the other
/// tasks' completions from the history: over a slow link, a large batch's
/// plan outlasts the lock's TTL. The lock is kept alive while the plan
/// runs; left to lapse, the refresh before the post failed, the turn was
/// planned again under a new lock, as slowly, and the session was never
/// woken. The completion being planned is kept alive too: with an
/// AckWait shorter than the plan it was delivered again meanwhile.
#[tokio::test]
async fn a_batch_whose_plan_outlasts_the_session_lock_is_woken_once() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let ttl = Duration::from_secs(1);
    session_lock_bucket(&bus, ttl).await;
    let settings = || BusSettings {
        session_lock_ttl: ttl,
        ..Default::default()
    };
    // Every task ends at once but the last, which waits for the gate.
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("last");
    let script = format!(
        "if [ \"$WAKEBUS_TASK_INDEX\" = 199 ]; then while [ ! -e '{}' ]; do sleep 0.05; done; fi; echo ok",
        gate.display()
    );
    let mut worker = Services::new();
    worker.worker(&bus, shell(&script), test_worker_config("default"));
    let mut near = Services::new();
    near.wake_with(&bus, settings(), test_wake_config(&api.url()));
    let goals: Vec<String> = (0..200).map(|i| format!("part {i}")).collect();
    let result = wakebus::delegate::Delegator::new(bus.clone())
        .with_max_batch(200)
        .delegate(Delegation::batch(goals).session("s.slow-plan"))
        .await
        .unwrap();
    let id = id_of(&result);
    // The first 199 are acked as members of a batch not complete yet.
    wait_until(WAIT, "199 completions", || async {
        done_events(&bus).await.len() == 199
    })
    .await;
    wake_consumer_settled(&bus).await;
    near.stop().await;

    // The wake that gets the last one reads the other 199, 16 at a time,
    // every round trip 200 ms long: well over the lock's second.
    let proxy = common::proxy::Proxy::start_delayed(nats.port, Duration::from_millis(100)).await;
    let distant = common::bus(&format!("nats://127.0.0.1:{}", proxy.port), &prefix).await;
    let mut far = Services::new();
    let mut config = test_wake_config(&api.url());
    config.ack_wait = Duration::from_secs(1);
    far.wake_with(&distant, settings(), config);
    std::fs::write(&gate, "").unwrap();
    wait_until(Duration::from_secs(60), "the batch's turn", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    far.stop().await;
    worker.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 1, "one turn for the batch");
    assert!(posts[0].text().contains(&id), "{}", posts[0].text());
    let consumer = wake_consumer_info(&bus).await.unwrap();
    assert_eq!(consumer.config.ack_wait, Duration::from_secs(1));
    assert_eq!(
        consumer.delivered.consumer_sequence, 200,
        "each completion delivered once"
    );
}

/// A lock refresh that falls due during a post runs while the post's
/// answer is read. Here the lock bucket's stream stops answering (as
/// between two leaders) while a post is in flight, so the next refresh
/// waits for its ack until it times out, and the answer comes meanwhile,
/// well before the post's deadline. Awaited before the answer was read,
/// the refresh let the deadline pass first, and the HTTP client took the
/// delivered turn for a timeout: it was posted again.
#[tokio::test]
async fn an_answer_that_arrives_during_a_slow_lock_refresh_is_not_posted_again() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // Refreshed every two seconds; a refresh without an answer waits
    // for it longer than the rest of the post's 5 s.
    let ttl = Duration::from_secs(6);
    let locks = session_lock_bucket(&bus, ttl).await;
    let mut config = test_wake_config(&api.url());
    config.api.request_timeout = Duration::from_secs(5);
    let settings = BusSettings {
        session_lock_ttl: ttl,
        ..Default::default()
    };
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake_with(&bus, settings, config);
    api.hold_posts();
    let id = delegate(
        &bus,
        Delegation::new("answered during a refresh").session("s.refreshing"),
    )
    .await;
    wait_until(WAIT, "the post in flight", || async {
        api.in_flight() == 1
    })
    .await;

    // The bucket's stream stops taking its subjects; this subscriber
    // keeps the writes from failing at once for want of a responder.
    let stream_name = format!("KV_{}", locks.name);
    let mut stream = bus.js.get_stream(&stream_name).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    let mut electing = config.clone();
    electing.subjects = vec![format!("{}.paused.>", bus.subjects.prefix())];
    bus.js.update_stream(&electing).await.unwrap();
    // Made after the change: a write it sees is one no stream stores.
    let mut writes = bus
        .client
        .subscribe(format!("$KV.{}.>", locks.name))
        .await
        .unwrap();
    tokio::time::timeout(WAIT, writes.next())
        .await
        .expect("a lock refresh during the post")
        .unwrap();
    assert_eq!(api.in_flight(), 1, "the post still waits for its answer");
    // Answered while the refresh waits for its ack.
    api.release_posts();
    wait_until(WAIT, "the answer", || async { api.in_flight() == 0 }).await;
    bus.js.update_stream(&config).await.unwrap();
    drop(writes);
    ledger_records_delivery(&bus, &id).await;
    services.stop().await;
    assert_eq!(
        api.all_posts().len(),
        1,
        "the delivered turn was posted again"
    );
}
