//! `wakebus replay` against real nats-server processes and the real
//! `wakebus` binary: re-driven wakes (skipped when delivered, `--force`,
//! batches, dead letters), re-queued tasks, copies, and a clean stop on
//! Ctrl-C in the middle of a long replay.

mod common;

use std::time::Duration;

use common::cli::{field, publish_task, wakebus};
use common::*;
use futures::StreamExt as _;
use serde_json::Value;
use wakebus::bus::BusSettings;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::protocol::{HEADER_REPLAY, Status, session_token};
use wakebus::replay::HEADER_FORCED_REPLAY;
use wakebus::wake::ledger::{Intent, LedgerState, WakeLedger};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

/// Stored messages of the events stream that are replay copies.
async fn replay_copies(
    bus: &wakebus::bus::Bus,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .filter(|m| m.headers.get(HEADER_REPLAY).is_some())
        .collect()
}

/// Runs `replay wakes --delegation <id> --force`, checks that its first
/// item was replayed, and returns the forced Idempotency-Key it printed.
async fn forced_wake(nats_url: &str, prefix: &str, id: &str) -> String {
    let forced = wakebus(
        nats_url,
        prefix,
        &["replay", "wakes", "--delegation", id, "--force"],
    )
    .await
    .ok_json();
    assert_eq!(forced[0]["action"], "replayed", "{forced:#?}");
    forced[0]["idempotency_key"].as_str().unwrap().to_owned()
}

/// One delivered wake for `session` (through a [`Pipeline`]'s worker and
/// wake service); returns the delegation id.
async fn delivered_wake(bus: &wakebus::bus::Bus, api: &SessionApiServer, session: &str) -> String {
    let id = delegate(bus, Delegation::new("first run").session(session)).await;
    wait_until(WAIT, "the first wake", || async {
        api.accepted().len() == 1
    })
    .await;
    ledger_records_delivery(bus, &id).await;
    id
}

#[tokio::test]
async fn replay_skips_wakes_that_were_already_delivered() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let session = "s.replay *>";
    let id = delivered_wake(&bus, &api, session).await;

    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--session", session],
    )
    .await
    .ok_json();
    let (items, summary) = lines.split_at(lines.len() - 1);
    assert_eq!(items.len(), 1, "{items:#?}");
    assert_eq!(items[0]["action"], "skipped");
    assert_eq!(items[0]["delegation_id"], id.as_str());
    assert!(
        items[0]["reason"]
            .as_str()
            .unwrap()
            .contains("already delivered"),
        "{items:#?}"
    );
    assert_eq!(summary[0]["summary"]["replayed"], 0);
    assert_eq!(summary[0]["summary"]["skipped"], 1);
    assert!(replay_copies(&bus).await.is_empty(), "a copy was published");
    services.stop().await;
    assert_eq!(api.all_posts().len(), 1);
}

/// `--force` on a completion whose wake is still being posted (the session
/// API failing, the wake retrying): when that post then succeeds, its
/// `delivered` record must not land over the forced key the replay
/// recorded, or the forced copy would be acked as already delivered and
/// never posted.
#[tokio::test]
async fn a_forced_replay_of_a_wake_still_being_posted_is_posted_after_it() {
    let delegation = Delegation::new("posted twice on purpose").session("s.force.busy");
    let (id, forced, keys) = forced_while_being_posted(delegation).await;
    assert!(
        forced.starts_with(&format!("{id}.0.done.replay.")),
        "{forced}"
    );
    assert_eq!(keys, [Some(format!("{id}.0.done")), Some(forced)]);
}

/// Delegates `delegation` through a [`Pipeline`] whose session API fails,
/// forces its wake with `replay wakes --force` while the wake retries, then
/// lets the API recover; returns the delegation id, the forced key, and
/// the keys of the accepted posts once two were accepted.
async fn forced_while_being_posted(
    delegation: Delegation,
) -> (String, String, Vec<Option<String>>) {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    api.fail_always(503);
    let id = delegate(&bus, delegation).await;
    wait_until(WAIT, "the wake to retry", || async {
        api.all_posts().len() >= 2
    })
    .await;
    let key = forced_wake(&nats.url(), &prefix, &id).await;
    // The forced copy reaches the wake before the API recovers.
    wait_until(WAIT, "the forced copy in the wake", || async {
        wake_consumer_info(&bus)
            .await
            .is_some_and(|info| info.num_pending == 0)
    })
    .await;
    api.recover();
    wait_until(WAIT, "the wake and the forced one", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let keys = api
        .accepted()
        .iter()
        .map(|post| post.header("idempotency-key"))
        .collect();
    (id, key, keys)
}

/// The turn recorded in doubt by [`combined_turn_in_doubt`].
const TURN_IN_DOUBT: &str = "wake.01JV3S2D6F8H0K2M4P6R8T0W2Y";

/// Two delegations for `session` whose combined turn ended in doubt (its
/// instance died mid-post: the intent of [`TURN_IN_DOUBT`] and both marks
/// recorded, nothing delivered), their completions stored by an echo
/// worker (left running in `services`). Returns the delegation ids, the
/// ledger and the turn's recorded text.
async fn combined_turn_in_doubt(
    bus: &wakebus::bus::Bus,
    services: &mut Services,
    session: &str,
) -> (Vec<String>, WakeLedger, &'static str) {
    let delegator = Delegator::new(bus.clone());
    let mut ids = Vec::new();
    for goal in ["first", "second"] {
        let delegation = Delegation::new(goal).session(session);
        ids.push(id_of(&delegator.delegate(delegation).await.unwrap()));
    }
    let ledger = ledger_of(bus).await;
    let recorded = "the turn in doubt";
    let covers = vec![WakeLedger::key(&ids[0], 0), WakeLedger::key(&ids[1], 0)];
    let intent = Intent {
        text: recorded.to_owned(),
        covers: covers.clone(),
    };
    ledger.put_intent(TURN_IN_DOUBT, &intent).await.unwrap();
    for covered in &covers {
        ledger
            .mark_posting(covered, TURN_IN_DOUBT, 0)
            .await
            .unwrap();
    }
    services.echo_worker(bus);
    wait_until(WAIT, "both completions", || async {
        done_events(bus).await.len() == 2
    })
    .await;
    (ids, ledger, recorded)
}

/// The Idempotency-Keys of the accepted posts, sorted; checks that the one
/// under [`TURN_IN_DOUBT`] re-sent `recorded`.
fn accepted_keys(api: &SessionApiServer, recorded: &str) -> Vec<String> {
    let posts = api.accepted();
    if let Some(resent) = posts
        .iter()
        .find(|post| post.header("idempotency-key").as_deref() == Some(TURN_IN_DOUBT))
    {
        assert!(resent.text().contains(recorded), "{}", resent.text());
    }
    let mut keys: Vec<String> = posts
        .iter()
        .filter_map(|post| post.header("idempotency-key"))
        .collect();
    keys.sort();
    keys
}

/// A combined turn in doubt, one of whose completions is forced: the wake
/// must not take the turn as never posted (a mark is gone) and wake the
/// other completion again under a new key. It re-sends the turn under its
/// own key, and posts the forced copy on its own.
#[tokio::test]
async fn forcing_one_completion_of_a_combined_turn_in_doubt_does_not_wake_the_other_again() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    let (ids, _, recorded) = combined_turn_in_doubt(&bus, &mut services, "s.doubt").await;
    let forced_key = forced_wake(&nats.url(), &prefix, &ids[0]).await;
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "two wakes", || async { api.accepted().len() >= 2 }).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let mut expected = vec![TURN_IN_DOUBT.to_owned(), forced_key];
    expected.sort();
    assert_eq!(accepted_keys(&api, recorded), expected);
}

/// The same once the forced copy has been woken (its entry `delivered`
/// under its own key) before the other completion comes back: that mark
/// still counts as the turn's, so the turn is re-sent, not the other
/// completion woken again under a new key.
#[tokio::test]
async fn a_combined_turn_in_doubt_is_resent_after_one_of_its_completions_was_forced_and_woken() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let (ids, ledger, recorded) =
        combined_turn_in_doubt(&bus, &mut services, "s.doubt.woken").await;
    let first = WakeLedger::key(&ids[0], 0);
    let revision = ledger.read(&first).await.unwrap().revision;
    let forced_key = format!("{}.0.done.replay.01JV3S2D6F8H0K2M4P6R8T0W30", ids[0]);
    ledger
        .mark_delivered(&first, &forced_key, revision)
        .await
        .unwrap();
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the re-sent turn", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(accepted_keys(&api, recorded), [TURN_IN_DOUBT]);
    // The re-sent turn recorded its delivery for the other completion
    // only, not over the forced wake's record.
    assert!(matches!(
        ledger.get(&first).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == forced_key
    ));
    assert!(matches!(
        ledger.get(&WakeLedger::key(&ids[1], 0)).await.unwrap(),
        Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == TURN_IN_DOUBT
    ));
}

/// A forced replay of a batch whose copy the events stream refuses (here:
/// full, with discard=new) has recorded its key already: it is reported
/// unchecked with that key (exit status 3), the batch's other completion is
/// not forced a second time, and a later replay without `--force`, once
/// there is room, wakes the session under that key.
#[tokio::test]
async fn a_forced_replay_whose_copy_is_refused_reports_its_key_and_a_plain_replay_completes_it() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let goals = ["one", "two"].map(String::from);
    let id = delegate(&bus, Delegation::batch(goals).session("s.force.refused")).await;
    wait_until(WAIT, "the batch wake", || async {
        api.accepted().len() == 1
    })
    .await;
    wake_consumer_settled(&bus).await;
    let mut events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let info = events.info().await.unwrap();
    let config = info.config.clone();
    let mut full = config.clone();
    full.max_messages = i64::try_from(info.state.messages).unwrap();
    full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    bus.js.update_stream(&full).await.unwrap();
    let run = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id, "--force"],
    )
    .await;
    assert_eq!(run.code(), Some(3), "{}", run.stderr());
    let lines = run.json_lines();
    let key = lines[0]["idempotency_key"].as_str().unwrap().to_owned();
    assert!(key.starts_with(&format!("{id}.batch.replay.")), "{key}");
    let reason = lines[0]["reason"].as_str().unwrap();
    assert!(reason.contains(&key), "{reason}");
    assert_eq!(lines[0]["unchecked"], true, "{lines:#?}");
    // The other completion is the same wake, not forced again.
    assert_eq!(lines[1]["action"], "skipped", "{lines:#?}");
    assert!(lines[1]["idempotency_key"].is_null(), "{lines:#?}");
    bus.js.update_stream(&config).await.unwrap();
    let plain = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id],
    )
    .await
    .ok_json();
    assert_eq!(plain[0]["action"], "replayed", "{plain:#?}");
    wait_until(WAIT, "the forced wake", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 2);
    assert_eq!(api.accepted()[1].header("idempotency-key"), Some(key));
}

/// A combined turn in doubt one of whose entries was deleted (`nats kv
/// del`, or a forced replay of an earlier release) is re-sent under its
/// key, not taken as never posted and woken again under a new one.
#[tokio::test]
async fn a_combined_turn_in_doubt_with_an_entry_deleted_is_resent_under_its_key() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let (ids, ledger, recorded) =
        combined_turn_in_doubt(&bus, &mut services, "s.doubt.deleted").await;
    let kv = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    let first = WakeLedger::key(&ids[0], 0);
    kv.delete(&first).await.unwrap();
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the re-sent turn", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    // Recorded for both, so a later copy of either is not posted again.
    for covered in [first, WakeLedger::key(&ids[1], 0)] {
        assert!(matches!(
            ledger.get(&covered).await.unwrap(),
            Some(LedgerState::Delivered { idempotency_key, .. }) if idempotency_key == TURN_IN_DOUBT
        ));
    }
    services.stop().await;
    assert_eq!(accepted_keys(&api, recorded), [TURN_IN_DOUBT]);
}

/// Each `--force` posts once: a copy of an earlier forced replay met
/// again (the wake's consumer made anew reads the history again, or a
/// copy's ack was lost) after a later one was delivered is settled by the
/// later one's record, not posted a third time.
#[tokio::test]
async fn an_earlier_forced_copy_met_again_after_a_later_one_is_not_posted_again() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let id = delivered_wake(&bus, &api, "s.force.twice").await;
    for posts in [2, 3] {
        forced_wake(&nats.url(), &prefix, &id).await;
        wait_until(WAIT, "the forced wake", || async {
            api.accepted().len() == posts
        })
        .await;
        wake_consumer_settled(&bus).await;
    }
    let copies = replay_copies(&bus).await;
    let key_of = |copy: &async_nats::jetstream::message::StreamMessage| {
        let ulid = copy.headers.get(HEADER_FORCED_REPLAY).unwrap().as_str();
        format!("{id}.0.done.replay.{ulid}")
    };
    // The first forced copy, published again.
    publish_copy_again(&bus, &copies[0], "the-first-forced-copy-again").await;
    wake_consumer_settled(&bus).await;
    // The second, met again where the ledger records the first run's
    // wake (its ULID taken on a host whose clock ran behind): a delivered
    // forced re-post settles it all the same.
    let ledger = ledger_of(&bus).await;
    let entry = format!("{id}.0");
    let revision = ledger.read(&entry).await.unwrap().revision;
    ledger
        .mark_delivered(&entry, &key_of(&copies[0]), revision)
        .await
        .unwrap();
    publish_copy_again(&bus, &copies[1], "the-second-forced-copy-again").await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 3, "{:?}", api.accepted());
}

/// `replay wakes --force` records its copy's key in the ledger before it
/// publishes the copy. A copy carrying the header that no replay recorded
/// (a worker credential re-publishing a delivered completion with a
/// made-up ULID, or a `replay copy` of a forced copy) was posted under a
/// new Idempotency-Key, which even a session API honouring the key takes
/// as a second turn; for a single task and for a batch.
#[tokio::test]
async fn a_forced_replay_header_that_no_replay_recorded_does_not_wake_a_session_again() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let single = delivered_wake(&bus, &api, "s.forged.force").await;
    let batch = delegate(
        &bus,
        Delegation::batch(["one", "two"].map(String::from)).session("s.forged.batch"),
    )
    .await;
    wait_until(WAIT, "the batch's wake", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    let done: Vec<_> = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .filter(|m| m.subject.ends_with(".done"))
        .collect();
    assert_eq!(done.len(), 3);
    for (n, original) in done.iter().enumerate() {
        let mut copy = original.clone();
        let ulid = ulid::Ulid::new().to_string();
        copy.headers.insert(HEADER_FORCED_REPLAY, ulid.as_str());
        publish_copy_again(&bus, &copy, &format!("made-up-forced-copy-{n}")).await;
    }
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let posted: Vec<String> = api.all_posts().iter().map(|p| p.session()).collect();
    assert_eq!(
        posted,
        ["s.forged.force", "s.forged.batch"],
        "no second turn"
    );
    assert_eq!(api.accepted()[0].delegation_ids(), [single]);
    assert!(api.accepted()[1].text().contains(&batch));
}

/// The provisioned wake ledger of `bus`.
async fn ledger_of(bus: &wakebus::bus::Bus) -> WakeLedger {
    let state = bus
        .provision_wake_state(&BusSettings::default())
        .await
        .unwrap();
    WakeLedger::new(state.wake_ledger)
}

/// A batch's consolidated wake forced while it is still being posted: the
/// forced copy is posted after it, not acked as delivered.
#[tokio::test]
async fn a_forced_replay_of_a_batch_wake_still_being_posted_is_posted_after_it() {
    let goals = ["one", "two"].map(String::from);
    let delegation = Delegation::batch(goals).session("s.force.batch");
    let (id, forced, keys) = forced_while_being_posted(delegation).await;
    assert!(
        forced.starts_with(&format!("{id}.batch.replay.")),
        "{forced}"
    );
    assert_eq!(keys, [Some(format!("{id}.batch")), Some(forced)]);
}

#[tokio::test]
async fn replay_with_force_posts_a_delivered_wake_again_through_the_wake_service() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let session = "s.force";
    let id = delivered_wake(&bus, &api, session).await;

    // A dry run changes nothing.
    let dry = wakebus(
        &nats.url(),
        &prefix,
        &[
            "replay",
            "wakes",
            "--delegation",
            &id,
            "--force",
            "--dry-run",
        ],
    )
    .await
    .ok_json();
    assert_eq!(dry[0]["action"], "would_replay");
    assert_eq!(dry[0]["ledger_cleared"], true);
    assert!(replay_copies(&bus).await.is_empty());

    let forced = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id, "--force"],
    )
    .await
    .ok_json();
    assert_eq!(forced[0]["action"], "replayed", "{forced:#?}");
    assert_eq!(forced[1]["summary"]["replayed"], 1);
    // A new key, derived from the first, so that it is not a repeat.
    let key = forced[0]["idempotency_key"].as_str().unwrap().to_owned();
    let copy_id = key
        .strip_prefix(&format!("{id}.0.done.replay."))
        .unwrap_or_else(|| panic!("{key} is not derived from {id}.0.done"));
    wait_until(WAIT, "the forced second wake", || async {
        api.accepted().len() == 2
    })
    .await;
    let again = &api.accepted()[1];
    assert_eq!(again.session(), session);
    assert_eq!(again.delegation_ids(), [id.as_str()]);
    assert_eq!(again.header("idempotency-key"), Some(key.clone()));
    // A session API that honours Idempotency-Key takes it as a second turn.
    assert_eq!(api.turns().len(), 2);
    // The history records that the copy was forced, the ledger under which
    // key it was delivered.
    let copies = replay_copies(&bus).await;
    assert_eq!(copies.len(), 1);
    let original_seq = forced[0]["source"].as_str().unwrap();
    assert_eq!(
        copies[0].headers.get(HEADER_REPLAY).unwrap().as_str(),
        original_seq
    );
    assert_eq!(
        copies[0]
            .headers
            .get(HEADER_FORCED_REPLAY)
            .map(|v| v.as_str()),
        Some(copy_id)
    );
    assert!(copies[0].headers.get("traceparent").is_some());
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    wait_until(WAIT, "the ledger to record the forced key", || async {
        let entry = ledger.get(format!("{id}.0")).await.ok().flatten();
        entry.is_some_and(|e| {
            let text = String::from_utf8_lossy(&e);
            text.contains("delivered") && text.contains(&key)
        })
    })
    .await;

    // Delivered again, so a plain replay (which now also sees the copy) skips it.
    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id],
    )
    .await
    .ok_json();
    let actions = field(&lines[..lines.len() - 1], "action");
    assert_eq!(actions, ["skipped", "skipped"], "{lines:#?}");
    services.stop().await;
    assert_eq!(api.all_posts().len(), 2);
}

#[tokio::test]
async fn replay_treats_a_batch_as_one_wake() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let goals = ["alpha", "beta", "gamma"].map(String::from);
    let id = delegate(&bus, Delegation::batch(goals).session("s.batch")).await;
    wait_until(WAIT, "the batch wake", || async {
        api.accepted().len() == 1
    })
    .await;
    let batch_key = format!("{id}.batch");
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    wait_until(WAIT, "the ledger to record the batch", || async {
        ledger.get(&batch_key).await.ok().flatten().is_some()
    })
    .await;

    let plain = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id],
    )
    .await
    .ok_json();
    let summary = &plain.last().unwrap()["summary"];
    assert_eq!(
        (summary["selected"].as_u64(), summary["skipped"].as_u64()),
        (Some(3), Some(3))
    );
    assert!(
        plain[0]["reason"]
            .as_str()
            .unwrap()
            .contains("already delivered")
    );
    assert!(plain[1]["reason"].as_str().unwrap().contains("batch"));

    let forced = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "wakes", "--delegation", &id, "--force"],
    )
    .await
    .ok_json();
    let actions = field(&forced[..3], "action");
    assert_eq!(actions, ["replayed", "skipped", "skipped"], "{forced:#?}");
    let key = forced[0]["idempotency_key"].as_str().unwrap().to_owned();
    assert!(
        key.starts_with(&format!("{batch_key}.replay.")),
        "{key} is not derived from {batch_key}"
    );
    wait_until(WAIT, "the batch woken again", || async {
        api.accepted().len() == 2
    })
    .await;
    let again = &api.accepted()[1];
    assert_eq!(again.header("idempotency-key"), Some(key));
    assert_eq!(api.turns().len(), 2, "the forced turn is not a repeat");
    for goal in ["alpha", "beta", "gamma"] {
        assert!(again.text().contains(goal), "{}", again.text());
    }
    services.stop().await;
    assert_eq!(api.all_posts().len(), 2);
}

#[tokio::test]
async fn replay_of_wake_dead_letters_delivers_them_once_the_session_api_recovers() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    api.fail_always(403);
    let session = "s.refused";
    let url = nats.url();
    let replay_dead_letters = || async {
        let args = ["replay", "wakes", "--dead-letters", "--session", session];
        wakebus(&url, &prefix, &args).await.ok_json()
    };
    let id = delegate(&bus, Delegation::new("refused at first").session(session)).await;
    wait_until(WAIT, "the wake dead letter", || async {
        !all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .is_empty()
    })
    .await;
    let listed = wakebus(&nats.url(), &prefix, &["events", "--dead-letters", "wake"])
        .await
        .ok_json();
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0]["dead_letter_reason"]
            .as_str()
            .unwrap()
            .contains("403"),
        "{listed:#?}"
    );
    // Replayed while the session API still refuses: refused again, and
    // recorded again (not dropped as a duplicate of the first dead letter).
    let early = replay_dead_letters().await;
    assert_eq!(early[0]["action"], "replayed", "{early:#?}");
    wait_until(WAIT, "the second wake dead letter", || async {
        all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .len()
            == 2
    })
    .await;
    api.recover();

    let lines = replay_dead_letters().await;
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    wait_until(WAIT, "the re-driven wake", || async {
        api.accepted().len() == 1
    })
    .await;
    assert_eq!(api.accepted()[0].delegation_ids(), [id.as_str()]);
    // Never delivered before: a plain replay keeps the usual key.
    assert_eq!(
        api.accepted()[0].header("idempotency-key"),
        Some(format!("{id}.0.done"))
    );
    assert!(lines[0].get("idempotency_key").is_none(), "{lines:#?}");
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    wait_until(WAIT, "the ledger to record the delivery", || async {
        ledger.get(format!("{id}.0")).await.ok().flatten().is_some()
    })
    .await;
    let again = replay_dead_letters().await;
    assert_eq!(again[0]["action"], "skipped", "{again:#?}");

    // Dead letters outlive ledger entries (30 days against 7 by default).
    // Once the entry has expired, nothing says the wake was delivered: the
    // replay says so instead of posting it a second time.
    let name = wakebus::protocol::Subjects::bucket_stream(&bus.subjects.wake_ledger_bucket());
    let mut config = bus
        .js
        .get_stream(&name)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_age = Duration::from_secs(1);
    config.duplicate_window = config.max_age;
    bus.js.update_stream(&config).await.unwrap();
    wait_until(WAIT, "the ledger entry to expire", || async {
        ledger.get(format!("{id}.0")).await.ok().flatten().is_none()
    })
    .await;
    let expired = replay_dead_letters().await;
    assert_eq!(expired[0]["action"], "skipped", "{expired:#?}");
    let reason = expired[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("wake ledger entries are kept 1s"),
        "{reason}"
    );
    services.stop().await;
    assert_eq!(api.accepted().len(), 1);
}

/// A refused post leaves its ledger entry at `posting`: a forced replay must
/// clear that too, or the wake would send the copy under the old key (the
/// one an API that stores answers per key refused) while the replay prints
/// another.
#[tokio::test]
async fn replay_with_force_of_a_refused_wake_posts_it_under_the_key_it_prints() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    api.fail_always(403);
    let session = "s.refused.forced";
    let id = delegate(&bus, Delegation::new("refused at first").session(session)).await;
    wait_until(WAIT, "the wake dead letter", || async {
        !all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .is_empty()
    })
    .await;
    api.recover();

    let args = [
        "replay",
        "wakes",
        "--dead-letters",
        "--session",
        session,
        "--force",
    ];
    let lines = wakebus(&nats.url(), &prefix, &args).await.ok_json();
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    assert_eq!(lines[0]["ledger_cleared"], true, "{lines:#?}");
    let key = lines[0]["idempotency_key"].as_str().unwrap().to_owned();
    assert!(key.starts_with(&format!("{id}.0.done.replay.")), "{key}");
    wait_until(WAIT, "the forced wake", || async {
        api.accepted().len() == 1
    })
    .await;
    services.stop().await;
    assert_eq!(api.accepted()[0].delegation_ids(), [id.as_str()]);
    assert_eq!(api.accepted()[0].header("idempotency-key"), Some(key));
}

/// A turn refused (a 404), replayed once the API was fixed, then given up
/// after 409s may have been delivered under its key. A forced replay of
/// the wake dead letters leaves alone every dead letter of that
/// completion, not only the 409 one: it would meet the 404's first and
/// force it into a second turn. Another completion, only refused, is
/// forced as asked.
#[tokio::test]
async fn a_forced_dead_letter_replay_leaves_alone_a_completion_later_given_up_after_409s() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    api.fail_always(404);
    let given_up = delegate(&bus, Delegation::new("refused, then 409s").session("s.409")).await;
    let refused = delegate(&bus, Delegation::new("only refused").session("s.404")).await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "both wake dead letters", || async {
        all_messages(&bus, &dlq).await.len() == 2
    })
    .await;
    services.stop().await;
    // The give-up after 409s of the first one's replayed copy, as the wake
    // records it.
    let first = all_messages(&bus, &dlq)
        .await
        .into_iter()
        .find(|m| {
            wakebus::protocol::CompletionEvent::decode(&m.payload)
                .is_ok_and(|event| event.delegation_id == given_up)
        })
        .expect("the first dead letter");
    let mut headers = first.headers.clone();
    headers.insert(
        "Wakebus-Dead-Letter-Reason",
        format!(
            "{}; replay without --force",
            wakebus::wake::CONFLICT_REFUSAL
        )
        .as_str(),
    );
    headers.insert(
        "Nats-Msg-Id",
        format!("dlq.wake.{given_up}.0.done.99").as_str(),
    );
    // Its body says another status (as another member of a batch given up
    // in the same turn would): a `--status` filter must not hide it.
    let mut body: Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(body["status"], "completed", "{body}");
    body["status"] = "failed".into();
    bus.js
        .publish_with_headers(
            first.subject.to_string(),
            headers,
            serde_json::to_vec(&body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let forced = |extra: Vec<String>| {
        let (url, prefix) = (nats.url(), prefix.clone());
        async move {
            let mut args = vec!["replay", "wakes", "--dead-letters", "--force", "--dry-run"];
            args.extend(extra.iter().map(String::as_str));
            wakebus(&url, &prefix, &args).await.ok_json()
        }
    };
    // The whole selection; up to the first dead letter only, the give-up
    // stored after it still read; and only the completed ones.
    let to_first = vec!["--to-seq".to_owned(), first.sequence.to_string()];
    let completed = vec!["--status".to_owned(), "completed".to_owned()];
    for (whole, lines) in [
        (true, forced(Vec::new()).await),
        (false, forced(to_first).await),
        (true, forced(completed).await),
    ] {
        let action_of = |id: &str| {
            lines
                .iter()
                .find(|line| line["delegation_id"] == id)
                .cloned()
        };
        let left = action_of(&given_up).unwrap_or_else(|| panic!("{lines:#?}"));
        assert_eq!(left["action"], "skipped", "{lines:#?}");
        assert!(
            left["reason"]
                .as_str()
                .is_some_and(|reason| reason.contains("replay it without --force")),
            "{lines:#?}"
        );
        if whole {
            let other = action_of(&refused).unwrap_or_else(|| panic!("{lines:#?}"));
            assert_eq!(other["action"], "would_replay", "{lines:#?}");
        }
    }
}

/// A forced replay of the wake dead letters first reads them all for
/// turns given up after 409s, before it forces any: that pass reports its
/// progress too (a large dead-letter stream left the operator looking at
/// nothing for as long as it took). A plain replay makes no such pass.
#[tokio::test]
async fn a_forced_dead_letter_replay_reports_its_first_pass_over_the_dead_letters() {
    use wakebus::replay::{Progress, ReplayKind, ReplayPlan, Replayer};
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    api.fail_always(404);
    for session in ["s.one", "s.two"] {
        delegate(&bus, Delegation::new("refused").session(session)).await;
    }
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "both wake dead letters", || async {
        all_messages(&bus, &dlq).await.len() == 2
    })
    .await;
    services.stop().await;
    let mut runs = Vec::new();
    for force in [true, false] {
        let plan = ReplayPlan {
            kind: ReplayKind::WakeDeadLetters,
            selection: wakebus::history::Selection::default(),
            force,
            tasks: Default::default(),
            dry_run: true,
        };
        let replayer = Replayer::new(bus.clone(), plan).await.unwrap();
        let mut steps = Vec::new();
        let cancel = tokio_util::sync::CancellationToken::new();
        wakebus::replay::run(replayer, cancel, |progress| {
            steps.push(match progress {
                Progress::Prereading { total } => format!("prereading {total}"),
                Progress::Preread => "preread".to_owned(),
                Progress::Opened { total } => format!("opened {total}"),
                Progress::Item(_) => "item".to_owned(),
            });
        })
        .await
        .unwrap();
        runs.push(steps);
    }
    let forced = [
        "prereading 2",
        "preread",
        "preread",
        "opened 2",
        "item",
        "item",
    ];
    assert_eq!(runs[0], forced);
    assert_eq!(runs[1], ["opened 2", "item", "item"]);
}

/// A worker of the default pool that cannot start its program and gives
/// every task up at once, dead-lettering it.
fn broken_worker(bus: &wakebus::bus::Bus) -> Services {
    let mut broken = Services::new();
    let mut config = test_worker_config("default");
    config.max_deliver = 1;
    let missing = CommandConfig::new("/nonexistent/subagent", Vec::new());
    broken.worker(
        bus,
        Executor::Command(CommandExecutor::new(missing)),
        config,
    );
    broken
}

/// Delegates one task for `session` to a worker that cannot start its
/// program and gives up at once; returns the delegation id once the
/// failure has woken the session (a wake service must be running) and the
/// request is dead-lettered.
async fn dead_letter_a_task(
    bus: &wakebus::bus::Bus,
    api: &SessionApiServer,
    session: &str,
) -> String {
    let delegation = Delegation::new("needs a working worker").session(session);
    dead_letter_delegation(bus, api, delegation).await
}

/// Delegates `delegation` to a worker that cannot start its program and
/// gives up at once; returns its id once its failure has woken its session
/// (a wake service must be running: one turn, for a batch too) and its
/// requests are dead-lettered.
async fn dead_letter_delegation(
    bus: &wakebus::bus::Bus,
    api: &SessionApiServer,
    delegation: Delegation,
) -> String {
    let broken = broken_worker(bus);
    let id = delegate(bus, delegation).await;
    // The turn names the delegation (a batch's lists no task ids).
    let of_it = |post: &common::session_api::Recorded| post.text().contains(&id);
    wait_until(WAIT, "the failure wake", || async {
        api.accepted().iter().any(of_it)
    })
    .await;
    let post = api.accepted().into_iter().find(of_it).unwrap();
    assert!(post.text().contains("failed"), "{}", post.text());
    broken.stop().await;
    id
}

/// A task given up twice (its `failed` completion not stored before its
/// worker stopped, the next worker giving it up again once the dead
/// letters' duplicate window had passed) has two dead letters: replayed
/// together, they run the task once. So does a dead letter an earlier
/// release re-queued under the id it derived from the dead letter's
/// sequence.
#[tokio::test]
async fn a_task_dead_lettered_twice_is_requeued_once() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let id = dead_letter_a_task(&bus, &api, "s.twice").await;
    let dlq = bus.subjects.dead_letter_stream();
    let first = all_messages(&bus, &dlq).await.remove(0);
    // The second give-up's dead letter: the same request and reason,
    // stored after the window (under another message id).
    let mut headers = first.headers.clone();
    headers.insert("Nats-Msg-Id", "dlq.task.second-give-up");
    bus.js
        .publish_with_headers(first.subject.to_string(), headers, first.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    let lines = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    let items: Vec<_> = lines.iter().filter(|l| l.get("action").is_some()).collect();
    assert_eq!(items.len(), 2, "{lines:#?}");
    assert_eq!(items[0]["action"], "replayed", "{lines:#?}");
    assert_eq!(items[0]["new_delegation_id"], format!("{id}-rt0"));
    assert_eq!(items[1]["action"], "skipped", "{lines:#?}");
    assert_eq!(
        items[1]["reason"],
        "another dead letter of this task was already handled in this run"
    );
    // A later run finds the re-queue in the history, for each of them.
    let again = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    let reason = again[0]["reason"].as_str().unwrap();
    assert!(reason.contains(&format!("{id}-rt0")), "{reason}");
    // Forced, the task is re-queued once more: once, not once for each
    // of its dead letters.
    let forced = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--force"])
        .await
        .ok_json();
    let actions: Vec<_> = forced.iter().filter_map(|l| l.get("action")).collect();
    assert_eq!(actions, ["replayed", "skipped"], "{forced:#?}");
    let requests = all_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(
        requests.len(),
        2,
        "the re-queue and the forced one, nothing more (no worker runs them)"
    );

    // Another task, re-queued and run by an earlier release under
    // `<id>-r<dead-letter sequence>` (its completion is what says so).
    let old = dead_letter_a_task(&bus, &api, "s.old-release").await;
    let letter = all_messages(&bus, &dlq)
        .await
        .into_iter()
        .find(|m| String::from_utf8_lossy(&m.payload).contains(&old))
        .unwrap();
    let legacy = format!("{old}-r{}", letter.sequence);
    services.stop().await;
    bus.js
        .publish(
            bus.subjects.event(
                &session_token("s.old-release"),
                &legacy,
                0,
                wakebus::protocol::EventKind::Done,
            ),
            "{}".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--session", "s.old-release", "--dry-run"],
    )
    .await
    .ok_json();
    assert_eq!(lines[0]["action"], "skipped", "{lines:#?}");
    let reason = lines[0]["reason"].as_str().unwrap();
    assert!(reason.contains(&legacy), "{reason}");
}

/// Stores a dead letter of task 0 of `delegation_id` in pool `default`, as
/// a worker that gave it up would, for `session` (`None`: sync mode).
async fn publish_task_dead_letter(
    bus: &wakebus::bus::Bus,
    delegation_id: &str,
    session: Option<&str>,
) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("dlq.task.{delegation_id}").as_str());
    let mut body = serde_json::json!({"version": 1, "delegation_id": delegation_id, "goal": "g"});
    if let Some(session) = session {
        headers.insert("Wakebus-Origin-Session", session);
        body["origin_session_id"] = session.into();
    }
    bus.js
        .publish_with_headers(
            bus.subjects.dead_letter_task("default"),
            headers,
            serde_json::to_vec(&body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// A re-queued copy that JetStream refuses for a moment (a leader
/// election, a stream at a limit) is published again, and the replay goes
/// on, rather than stopping at the first refusal.
#[tokio::test]
async fn a_copy_refused_for_a_moment_is_published_again() {
    use tokio::io::AsyncBufReadExt as _;
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    publish_task_dead_letter(&bus, "m1", Some("s.moment")).await;
    // The task queue takes nothing until the replay has been refused.
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    let config = tasks.info().await.unwrap().config.clone();
    let mut full = config.clone();
    full.max_bytes = 1;
    bus.js.update_stream(&full).await.unwrap();
    let mut replay = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            &nats.url(),
            &prefix,
            &["replay", "tasks", "--json"],
        ))
        .env("RUST_LOG", "wakebus=warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = tokio::io::BufReader::new(replay.stderr.take().unwrap()).lines();
    tokio::time::timeout(WAIT, async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            if line.contains("Could not store the copy; trying again.") {
                return;
            }
        }
        panic!("the replay ended without trying again");
    })
    .await
    .expect("a refused copy to be tried again");
    bus.js.update_stream(&config).await.unwrap();
    let output = tokio::time::timeout(WAIT, replay.wait_with_output())
        .await
        .expect("the replay to end")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    let queued = all_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(queued.len(), 1, "the copy is stored once");
}

/// A sync-mode task's dead letter is re-queued only when asked: its caller
/// had the failure as its result, and a re-run's would reach nobody.
#[tokio::test]
async fn a_sync_tasks_dead_letter_is_requeued_only_with_include_sync() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    publish_task_dead_letter(&bus, "sync1", None).await;
    let skipped = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    assert_eq!(skipped[0]["action"], "skipped", "{skipped:#?}");
    let reason = skipped[0]["reason"].as_str().unwrap();
    assert!(reason.starts_with("sync mode: "), "{reason}");
    let asked = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--dry-run", "--include-sync"],
    )
    .await
    .ok_json();
    assert_eq!(asked[0]["action"], "would_replay", "{asked:#?}");
    assert_eq!(asked[0]["new_delegation_id"], "sync1-rt0");
}

/// Runs `replay tasks --force --dry-run` over the one task dead letter,
/// and checks that it would be re-queued under a new id, not `derived`
/// (already used).
async fn forced_again_takes_a_new_id(url: &str, prefix: &str, derived: &str) {
    let forced = wakebus(url, prefix, &["replay", "tasks", "--force", "--dry-run"])
        .await
        .ok_json();
    assert_eq!(forced[0]["action"], "would_replay", "{forced:#?}");
    assert_ne!(forced[0]["new_delegation_id"], derived, "{forced:#?}");
}

/// A first replay made with `--force` re-queues under the derived id, as
/// a plain one would: a plain replay after it finds that re-queue and does
/// not run the task a second time. Only a forced replay of a task already
/// re-queued takes a new id.
#[tokio::test]
async fn a_plain_replay_after_a_forced_one_does_not_run_the_task_again() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, mut services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let id = dead_letter_a_task(&bus, &api, "s.forced-first").await;
    let derived = format!("{id}-rt0");

    let forced = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--force"])
        .await
        .ok_json();
    assert_eq!(forced[0]["action"], "replayed", "{forced:#?}");
    assert_eq!(forced[0]["new_delegation_id"], derived.as_str());
    services.echo_worker(&bus);
    wait_until(WAIT, "the forced re-run's wake", || async {
        api.accepted().len() == 2
    })
    .await;

    let plain = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(plain[0]["action"], "skipped", "{plain:#?}");
    assert!(
        plain[0]["reason"].as_str().unwrap().contains(&derived),
        "{plain:#?}"
    );
    forced_again_takes_a_new_id(&nats.url(), &prefix, &derived).await;
    let reruns = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .filter(|m| m.subject.ends_with(".done") && m.subject.contains("-rt0."))
        .count();
    assert_eq!(reruns, 1, "the task ran once after its dead letter");
    assert_eq!(api.accepted().len(), 2);
}

#[tokio::test]
async fn replay_requeues_a_dead_lettered_task_under_a_derived_id_and_wakes_its_session() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let session = "s.requeue";
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    let id = dead_letter_a_task(&bus, &api, session).await;

    let dry = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    assert_eq!(dry[0]["action"], "would_replay", "{dry:#?}");
    let derived = dry[0]["new_delegation_id"].as_str().unwrap().to_owned();
    assert!(derived.starts_with(&format!("{id}-r")), "{derived}");

    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--session", session],
    )
    .await
    .ok_json();
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    assert_eq!(lines[0]["new_delegation_id"], derived.as_str());
    assert_eq!(lines[0]["target_subject"], bus.subjects.task("default"));
    // Queued, not yet run: a second replay already knows it (by the
    // re-queue's submitted record) and queues no second copy.
    let queued = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(queued[0]["action"], "skipped", "{queued:#?}");
    services.echo_worker(&bus);
    wait_until(WAIT, "the re-run's wake", || async {
        api.accepted().len() == 2
    })
    .await;
    let rerun = &api.accepted()[1];
    assert_eq!(rerun.session(), session);
    assert_eq!(rerun.delegation_ids(), [derived.as_str()]);
    assert!(
        rerun.text().contains("Status: completed"),
        "{}",
        rerun.text()
    );
    assert!(rerun.text().contains("echo: needs a working worker"));

    // Already re-queued: skipped, unless forced (then under a fresh id).
    let again = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(again[0]["action"], "skipped", "{again:#?}");
    assert!(again[0]["reason"].as_str().unwrap().contains(&derived));
    forced_again_takes_a_new_id(&nats.url(), &prefix, &derived).await;

    // Dead letters outlive the history (30 days against 7 by default).
    // Once the re-queue's events have expired, nothing says it ran: the
    // replay says so instead of running it a second time.
    services.stop().await;
    let mut config = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_age = Duration::from_secs(1);
    config.duplicate_window = config.max_age;
    bus.js.update_stream(&config).await.unwrap();
    wait_until(WAIT, "the history to expire", || async {
        all_messages(&bus, &bus.subjects.events_stream())
            .await
            .is_empty()
    })
    .await;
    let expired = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(expired[0]["action"], "skipped", "{expired:#?}");
    let reason = expired[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("a re-queue's events are kept 1s"),
        "{reason}"
    );
    // Forced, it runs once more, under a new id: the derived one may have
    // been used (here it was), and its wake's key with it.
    forced_again_takes_a_new_id(&nats.url(), &prefix, &derived).await;
    assert_eq!(api.accepted().len(), 2, "the re-queued task ran once");
    assert_eq!(api.all_posts().len(), 2);
}

/// A task that keeps failing: its re-queue fails too, and is dead-lettered
/// with the request's mark of the dead letter it came from. Running the
/// same replay again re-queues neither (the first is re-queued already, the
/// second is a re-queue that failed again), forced or not, unless told to
/// run the re-queue once more: a cron job replaying the last hours does not
/// run a failing task again at every run.
#[tokio::test]
async fn running_a_task_replay_again_does_not_requeue_a_requeue_that_failed_again() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let id = dead_letter_a_task(&bus, &api, "s.keeps.failing").await;
    let replay = |args: &'static [&'static str]| {
        let (url, prefix) = (nats.url(), prefix.clone());
        async move { wakebus(&url, &prefix, args).await.ok_json() }
    };
    let first = replay(&["replay", "tasks"]).await;
    assert_eq!(first[0]["action"], "replayed", "{first:#?}");
    let derived = first[0]["new_delegation_id"].as_str().unwrap().to_owned();
    let broken = broken_worker(&bus);
    wait_until(WAIT, "the re-queue's failure wake", || async {
        api.accepted()
            .iter()
            .any(|post| post.delegation_ids() == [derived.as_str()])
    })
    .await;
    wait_until(WAIT, "the re-queue's dead letter", || async {
        all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .len()
            == 2
    })
    .await;
    broken.stop().await;

    for args in [
        &["replay", "tasks"][..],
        &["replay", "tasks", "--force", "--dry-run"],
    ] {
        let lines = replay(args).await;
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert_eq!(lines[1]["action"], "skipped", "{args:?}: {lines:#?}");
        assert_eq!(lines[1]["delegation_id"], derived.as_str());
        let reason = lines[1]["reason"].as_str().unwrap();
        assert!(
            reason.contains("failed again") && reason.contains("--include-requeued"),
            "{reason}"
        );
    }
    let included = replay(&["replay", "tasks", "--include-requeued", "--dry-run"]).await;
    assert_eq!(included[0]["action"], "skipped", "{included:#?}");
    assert_eq!(included[1]["action"], "would_replay", "{included:#?}");
    assert_eq!(
        included[1]["new_delegation_id"],
        format!("{derived}-rt0").as_str()
    );
    services.stop().await;
    assert!(id != derived);
}

/// `replay tasks` checked requests against the default size limits, not
/// the workers': a request the workers refused for theirs was re-queued,
/// to be refused again and wake its session with the same error a second
/// time (and one within larger limits was skipped as unable to run).
#[tokio::test]
async fn replay_tasks_checks_requests_against_the_size_limits_it_is_given() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.limits.max_goal_bytes = 100;
    services.worker(
        &bus,
        Executor::Echo(wakebus::worker::executor::EchoExecutor),
        config,
    );
    services.wake(&bus, test_wake_config(&api.url()));
    delegate(&bus, Delegation::new("g".repeat(200)).session("s.limits")).await;
    wait_until(WAIT, "the refusal's wake and dead letter", || async {
        api.accepted().len() == 1
            && stored_messages(&bus, &bus.subjects.dead_letter_stream()).await == 1
    })
    .await;
    services.stop().await;

    let args = ["replay", "tasks", "--dry-run", "--max-goal-bytes", "100"];
    let limited = wakebus(&nats.url(), &prefix, &args).await.ok_json();
    assert_eq!(limited[0]["action"], "skipped", "{limited:#?}");
    let reason = limited[0]["reason"].as_str().unwrap();
    assert!(reason.contains("the limit is 100 bytes"), "{reason}");
    let defaults = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    assert_eq!(defaults[0]["action"], "would_replay", "{defaults:#?}");
}

/// A batch member re-queued under its batch's task count left the derived
/// delegation looking unfinished for ever: a cancel of it, once it had
/// ended, counted siblings that never existed as running, recorded a
/// cancel and reported it `cancelled`.
#[tokio::test]
async fn a_replayed_batch_member_is_a_delegation_of_its_own_that_a_cancel_finds_finished() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, mut services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let goals = ["first", "second"].map(String::from);
    let id =
        dead_letter_delegation(&bus, &api, Delegation::batch(goals).session("s.members")).await;

    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--delegation", &id],
    )
    .await
    .ok_json();
    let derived: Vec<String> = lines
        .iter()
        .filter(|line| line.get("action").is_some())
        .map(|line| {
            assert_eq!(line["action"], "replayed", "{lines:#?}");
            line["new_delegation_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(derived.len(), 2, "{lines:#?}");
    services.echo_worker(&bus);
    // Woken on their own (together, as one session's wakes may be).
    wait_until(WAIT, "each member's own wake", || async {
        let woken: Vec<String> = api
            .accepted()
            .iter()
            .flat_map(|post| post.delegation_ids())
            .collect();
        derived.iter().all(|id| woken.contains(id))
    })
    .await;
    services.stop().await;
    let canceller = wakebus::cancel::Canceller::new(bus.clone());
    for derived in &derived {
        let report = canceller.cancel_delegation(derived, false).await.unwrap();
        assert_eq!(
            report.state,
            Some(wakebus::cancel::DelegationState::Finished),
            "{report:?}"
        );
        assert_eq!(report.status, "nothing_to_cancel");
    }
}

/// An earlier release re-queued a batch member under its own index, and
/// its task write failed, leaving only that record. Sent now as task 0,
/// the task needs a record at index 0, or a wake that verifies origins
/// refuses its completion and the session is never woken.
#[tokio::test]
async fn a_member_half_requeued_by_an_earlier_release_is_sent_with_a_record_a_verifying_wake_accepts()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    let mut wake_config = test_wake_config(&api.url());
    wake_config.verify_origin = true;
    services.wake(&bus, wake_config);
    let session = "s.old-half";
    let goals = ["first", "second"].map(String::from);
    let id = dead_letter_delegation(&bus, &api, Delegation::batch(goals).session(session)).await;

    let dry = wakebus(&nats.url(), &prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    let member = dry
        .iter()
        .find(|line| line["task_index"] == 1)
        .unwrap_or_else(|| panic!("{dry:#?}"));
    let derived = member["new_delegation_id"].as_str().unwrap().to_owned();
    // What the earlier release stored before its task write failed.
    let mut request = wakebus::protocol::TaskRequest::new(derived.clone(), "second");
    request.origin_session_id = Some(session.to_owned());
    request.task_index = 1;
    request.task_count = 2;
    let old = wakebus::protocol::SubmittedRecord::for_request(&request, "default", None);
    let subject = bus.subjects.submitted(&session_token(session), &derived, 1);
    let body = serde_json::to_vec(&old).unwrap();
    bus.js
        .publish(subject, body.into())
        .await
        .unwrap()
        .await
        .unwrap();

    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--delegation", &id],
    )
    .await
    .ok_json();
    let replayed: Vec<&str> = lines
        .iter()
        .filter(|line| line["action"] == "replayed")
        .filter_map(|line| line["new_delegation_id"].as_str())
        .collect();
    assert!(replayed.contains(&derived.as_str()), "{lines:#?}");
    services.echo_worker(&bus);
    wait_until(WAIT, "the member's own wake", || async {
        api.accepted()
            .iter()
            .any(|post| post.delegation_ids().contains(&derived))
    })
    .await;
    services.stop().await;
    assert!(
        all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .iter()
            .all(|m| !m.subject.contains(".wake.")),
        "a completion was refused"
    );
}

/// A task whose delegation, or whose session, was cancelled after it was
/// given up is not run again by a replay: the re-queued copy, a new
/// delegation stored after the cancel, would escape both records. Nor is
/// one whose re-run a user cancelled, by a forced replay, which would give
/// it a new id.
#[tokio::test]
async fn replay_does_not_requeue_a_task_whose_delegation_or_session_was_cancelled() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let stopped = dead_letter_a_task(&bus, &api, "s.stopped").await;
    let (session, other) = ("s.session", "s.other");
    let in_session = dead_letter_a_task(&bus, &api, session).await;
    let kept = dead_letter_a_task(&bus, &api, other).await;
    let rerun_stopped = dead_letter_a_task(&bus, &api, "s.rerun").await;
    let legacy_stopped = dead_letter_a_task(&bus, &api, "s.legacy").await;
    // The delegation was cancelled while it still ran (a batch whose other
    // tasks had not ended): its record is there. (A cancel of a finished
    // delegation records nothing.)
    let cancels = bus
        .js
        .get_key_value(bus.subjects.cancel_bucket())
        .await
        .unwrap();
    let record = wakebus::cancel::CancelRecord {
        at: time::OffsetDateTime::now_utc(),
        silent: true,
    };
    // So was the re-run a plain replay made of another one, and the one
    // an earlier release made of a third (`<id>-r<dead letter sequence>`).
    let rerun = wakebus::replay::derived_delegation_id(&rerun_stopped, 0);
    let legacy_sequence = all_messages(&bus, &bus.subjects.dead_letter_stream())
        .await
        .into_iter()
        .find(|m| {
            serde_json::from_slice::<Value>(&m.payload)
                .is_ok_and(|body| body["delegation_id"] == legacy_stopped.as_str())
        })
        .expect("the third one's dead letter")
        .sequence;
    let legacy = format!("{legacy_stopped}-r{legacy_sequence}");
    for id in [&stopped, &rerun, &legacy] {
        let key = wakebus::cancel::CancelTarget::Delegation(id.clone()).key();
        cancels
            .put(key, serde_json::to_vec(&record).unwrap().into())
            .await
            .unwrap();
    }
    wakebus::cancel::Canceller::new(bus.clone())
        .cancel_session(session, true)
        .await
        .unwrap();

    // `--force` (past earlier re-queues) still leaves cancelled tasks out.
    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--dry-run", "--force"],
    )
    .await
    .ok_json();
    let action_of = |id: &str| {
        lines
            .iter()
            .find(|line| line["delegation_id"] == id)
            .unwrap_or_else(|| panic!("no line for {id}: {lines:#?}"))
            .clone()
    };
    let by_delegation = action_of(&stopped);
    assert_eq!(by_delegation["action"], "skipped", "{lines:#?}");
    assert!(
        by_delegation["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("delegation {stopped} was cancelled")),
        "{by_delegation}"
    );
    let by_session = action_of(&in_session);
    assert_eq!(by_session["action"], "skipped", "{lines:#?}");
    assert!(
        by_session["reason"]
            .as_str()
            .unwrap()
            .contains("its session was cancelled"),
        "{by_session}"
    );
    for (original, rerun) in [(&rerun_stopped, &rerun), (&legacy_stopped, &legacy)] {
        let by_rerun = action_of(original);
        assert_eq!(by_rerun["action"], "skipped", "{lines:#?}");
        assert!(
            by_rerun["reason"]
                .as_str()
                .unwrap()
                .contains(&format!("its re-run, delegation {rerun}, was cancelled")),
            "{by_rerun}"
        );
    }
    assert_eq!(action_of(&kept)["action"], "would_replay", "{lines:#?}");
    let lines = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "tasks", "--dry-run", "--include-cancelled"],
    )
    .await
    .ok_json();
    services.stop().await;
    let actions: Vec<_> = lines
        .iter()
        .filter_map(|line| line["action"].as_str())
        .collect();
    assert_eq!(actions, ["would_replay"; 5], "{lines:#?}");
    let untouched = lines
        .iter()
        .find(|line| line["delegation_id"] == kept.as_str())
        .unwrap();
    assert!(
        untouched["new_delegation_id"]
            .as_str()
            .unwrap()
            .starts_with(&kept)
    );
}

#[tokio::test]
async fn replay_does_not_requeue_a_request_that_can_never_run() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let ack = bus
        .js
        .publish(
            bus.subjects.task("default"),
            r#"{"version":1,"delegation_id":"nogoal"}"#.into(),
        )
        .await
        .unwrap();
    ack.await.unwrap();
    wait_until(WAIT, "the dead letter", || async {
        !all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .is_empty()
    })
    .await;
    let lines = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(lines[0]["action"], "skipped");
    assert!(
        lines[0]["reason"]
            .as_str()
            .unwrap()
            .contains("missing field `goal`"),
        "{lines:#?}"
    );
    services.stop().await;
}

/// A dead-lettered request whose body reads as a request but not as JSON
/// (a lone surrogate escape in a field wakebus does not know, which reading
/// the request skips) is not re-queued: its copy, edited as JSON, would
/// have kept nothing but its new delegation id.
#[tokio::test]
async fn replay_skips_a_request_it_cannot_copy_with_all_its_fields() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let body = r#"{"version":1,"delegation_id":"surrogate","goal":"g","x-note":"\ud83d"}"#;
    wakebus::protocol::TaskRequest::decode(body.as_bytes()).expect("reads as a request");
    let ack = bus
        .js
        .publish(bus.subjects.dead_letter_task("default"), body.into())
        .await
        .unwrap();
    ack.await.unwrap();
    let lines = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(lines[0]["action"], "skipped", "{lines:#?}");
    let reason = lines[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("cannot be copied with all its fields"),
        "{reason}"
    );
    assert_eq!(lines[1]["summary"]["selected"], 1, "{lines:#?}");
    let queued = stored_messages(&bus, &bus.subjects.tasks_stream()).await;
    assert_eq!(queued, 0, "a copy was queued");
}

/// `replay copy --to-prefix` of `session`'s history from `prefix` to
/// `target`'s deployment, which must report and store `count` copies;
/// returns them.
async fn copied_session(
    nats: &NatsServer,
    prefix: &str,
    target: &wakebus::bus::Bus,
    session: &str,
    count: usize,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let args = [
        "replay",
        "copy",
        "--to-prefix",
        target.subjects.prefix(),
        "--session",
        session,
    ];
    let lines = wakebus(&nats.url(), prefix, &args).await.ok_json();
    assert_eq!(
        lines.last().unwrap()["summary"]["replayed"],
        count,
        "{lines:#?}"
    );
    let copies = all_messages(target, &target.subjects.events_stream()).await;
    assert_eq!(copies.len(), count);
    copies
}

#[tokio::test]
async fn replay_copy_republishes_history_under_another_prefix_with_headers_and_a_replay_mark() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let target_prefix = unique_prefix();
    let target = common::bus(&nats.url(), &target_prefix).await;
    let (req, _, done_seq) = publish_task(&bus, Some("s.copy *>"), Status::Failed).await;
    publish_task(&bus, Some("s.other"), Status::Completed).await;

    let copies = copied_session(&nats, &prefix, &target, "s.copy *>", 2).await;
    let originals = all_messages(&bus, &bus.subjects.events_stream()).await;
    let done_copy = copies
        .iter()
        .find(|m| m.subject.ends_with(".done"))
        .unwrap();
    let done_original = originals.iter().find(|m| m.sequence == done_seq).unwrap();
    assert_eq!(
        done_copy.subject.as_str(),
        done_original
            .subject
            .replacen(&prefix, &target_prefix, 1)
            .as_str()
    );
    assert_eq!(done_copy.payload, done_original.payload);
    for name in [
        "Nats-Msg-Id",
        "traceparent",
        "Wakebus-Origin-Session",
        "Wakebus-Delegation-Id",
        "ce-type",
    ] {
        assert_eq!(
            done_copy.headers.get(name).map(|v| v.as_str()),
            done_original.headers.get(name).map(|v| v.as_str()),
            "{name}"
        );
    }
    assert_eq!(
        done_copy.headers.get(HEADER_REPLAY).unwrap().as_str(),
        format!("{}:{done_seq}", bus.subjects.events_stream())
    );
    assert!(done_copy.subject.contains(&req.delegation_id));

    // Refused: the deployment's own prefix; one subject under it, where
    // the workers take copies for tasks (a mistyped --to-subject); and a
    // prefix its task queue captures. (Another deployment's prefix nested
    // in it, such as `<prefix>.staging`, is not refused.)
    let task_queue = format!("{prefix}.task.default");
    let nested = format!("{prefix}.task");
    for (flag, refused) in [
        ("--to-prefix", prefix.as_str()),
        ("--to-subject", task_queue.as_str()),
        ("--to-prefix", nested.as_str()),
    ] {
        let run = wakebus(&nats.url(), &prefix, &["replay", "copy", flag, refused]).await;
        assert_eq!(run.code(), Some(1), "{flag} {refused}");
        assert!(run.stderr().contains("own prefix"), "{}", run.stderr());
    }
    // Copied again within the target's duplicate window, every copy is
    // dropped there as a duplicate, and said to be.
    let args = [
        "replay",
        "copy",
        "--to-prefix",
        target.subjects.prefix(),
        "--session",
        "s.copy *>",
    ];
    let again = wakebus(&nats.url(), &prefix, &args).await.ok_json();
    let summary = &again.last().unwrap()["summary"];
    assert_eq!(summary["replayed"], 0, "{again:#?}");
    assert_eq!(summary["skipped"], 2, "{again:#?}");
    let reason = again[0]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("not stored: ")
            && reason.contains("already holds a message with its Nats-Msg-Id"),
        "{reason}"
    );
    assert_eq!(
        all_messages(&target, &target.subjects.events_stream())
            .await
            .len(),
        2
    );
    let nowhere = wakebus(
        &nats.url(),
        &prefix,
        &["replay", "copy", "--to-prefix", "nostreams"],
    )
    .await;
    assert_eq!(nowhere.code(), Some(1));
    assert!(
        nowhere.stderr().contains("cannot publish"),
        "{}",
        nowhere.stderr()
    );
}

/// A replay stopped by an error part-way still ends its output with its
/// summary, the error in it: a script reading the last line learns what
/// was replayed before the stop.
#[tokio::test]
async fn a_replay_stopped_by_an_error_still_reports_what_it_replayed() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let target = common::bus(&nats.url(), &unique_prefix()).await;
    publish_task(&bus, Some("s.stops"), Status::Completed).await;
    // The target takes one message and refuses the next.
    let events = target.subjects.events_stream();
    let mut full = target
        .js
        .get_stream(&events)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    full.max_messages = 1;
    full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    target.js.update_stream(&full).await.unwrap();
    let run = wakebus(
        &nats.url(),
        &prefix,
        &[
            "replay",
            "copy",
            "--to-prefix",
            target.subjects.prefix(),
            "--json",
        ],
    )
    .await;
    assert_eq!(run.code(), Some(1), "{}", run.stderr());
    let last: Value = serde_json::from_str(run.stdout().lines().last().unwrap()).unwrap();
    assert_eq!(last["summary"]["replayed"], 1, "{}", run.stdout());
    assert!(
        last["error"].as_str().unwrap().contains("cannot publish"),
        "{last}"
    );
}

/// A dry run of a copy said every record would be copied when no stream
/// took the target, where the real run fails at its first copy: it skips
/// those records, saying why and what to do.
#[tokio::test]
async fn replay_copy_dry_run_tells_a_target_no_stream_takes() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    publish_task(&bus, Some("s.dry"), Status::Completed).await;
    let target = unique_prefix();
    let nowhere = format!("{target}.analysis");
    for (flag, to, what) in [
        ("--to-prefix", target.as_str(), format!("{target}.evt.>")),
        ("--to-subject", nowhere.as_str(), nowhere.clone()),
    ] {
        let args = ["replay", "copy", flag, to, "--dry-run"];
        let run = wakebus(&nats.url(), &prefix, &args).await;
        assert!(run.success(), "{}", run.stderr());
        let lines = run.json_lines();
        let items: Vec<&Value> = lines.iter().filter(|l| l.get("action").is_some()).collect();
        assert_eq!(items.len(), 2, "{lines:#?}");
        for item in items {
            assert_eq!(item["action"], "skipped", "{item}");
            let reason = item["reason"].as_str().unwrap();
            assert!(
                reason.contains(&format!("no stream of this account takes {what}")),
                "{reason}"
            );
        }
    }
    let init = wakebus(&nats.url(), &target, &["init"]).await;
    assert!(init.success(), "{}", init.stderr());
    let args = ["replay", "copy", "--to-prefix", &target, "--dry-run"];
    let run = wakebus(&nats.url(), &prefix, &args).await;
    assert!(run.success(), "{}", run.stderr());
    let summary = run.json_lines().pop().unwrap();
    assert_eq!(summary["summary"]["would_replay"], 2, "{summary}");
}

/// Headers nats-server acts on held where the original was stored, not
/// where its copy goes: `Nats-Expected-Stream` would have the copy
/// refused. A copy leaves them out, but for `Nats-Msg-Id`, which lets the
/// target drop a second copy.
#[tokio::test]
async fn replay_copy_leaves_out_the_headers_the_server_acts_on_but_the_message_id() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let target_prefix = unique_prefix();
    let target = common::bus(&nats.url(), &target_prefix).await;
    let request = common::cli::request(Some("s.expects"), "synthetic");
    let done = wakebus::protocol::CompletionEvent::for_request(&request, Status::Completed, "ok");
    let id = wakebus::protocol::CompletionEvent::id_for(&request.delegation_id, 0);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    headers.insert(
        "Nats-Expected-Stream",
        bus.subjects.events_stream().as_str(),
    );
    headers.insert("Wakebus-Origin-Session", "s.expects");
    let subject = bus.subjects.event(
        &session_token("s.expects"),
        &request.delegation_id,
        0,
        wakebus::protocol::EventKind::Done,
    );
    bus.js
        .publish_with_headers(subject, headers, serde_json::to_vec(&done).unwrap().into())
        .await
        .unwrap()
        .await
        .expect("the original is stored");

    let copies = copied_session(&nats, &prefix, &target, "s.expects", 1).await;
    let copy = &copies[0].headers;
    assert!(copy.get("Nats-Expected-Stream").is_none(), "{copy:?}");
    assert_eq!(
        copy.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some(id.as_str())
    );
    assert_eq!(
        copy.get("Wakebus-Origin-Session").map(|v| v.as_str()),
        Some("s.expects")
    );
}

#[tokio::test]
async fn replay_of_wakes_without_a_wake_ledger_says_so() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    publish_task(&bus, Some("s1"), Status::Completed).await;
    let run = wakebus(&nats.url(), &prefix, &["replay", "wakes"]).await;
    assert_eq!(run.code(), Some(1));
    assert!(run.stderr().contains("wake ledger"), "{}", run.stderr());
}

// ---------------------------------------------------------------- Ctrl-C

/// Completions of `count` tasks over `sessions` sessions whose wakes were
/// lost: stored in the history, acknowledged by the wake consumer, never
/// posted (as after a wake service that acked without delivering).
async fn lost_wakes(bus: &wakebus::bus::Bus, count: usize, sessions: usize) {
    use wakebus::protocol::{CompletionEvent, EventKind};
    for i in 0..count {
        let request = common::cli::request(Some(&format!("s.lost.{}", i % sessions)), "lost");
        let mut done = CompletionEvent::for_request(&request, Status::Completed, "completed");
        done.summary = Some(format!("result {i}"));
        common::cli::publish_event(bus, &request, EventKind::Done, &done).await;
    }
    let consumer = bus
        .wake_consumer(Duration::from_secs(30), 10_000)
        .await
        .expect("wake consumer");
    let mut acked = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while acked < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {acked} of {count} completions came to be acked"
        );
        let mut batch = consumer
            .fetch()
            .max_messages(500)
            .messages()
            .await
            .expect("fetch");
        while let Some(message) = batch.next().await {
            message.expect("message").ack().await.expect("ack");
            acked += 1;
        }
    }
    wait_until(WAIT, "the lost completions to be acknowledged", || async {
        wake_consumer_info(bus)
            .await
            .is_some_and(|info| info.num_pending == 0 && info.num_ack_pending == 0)
    })
    .await;
}

#[tokio::test]
async fn replay_stopped_by_ctrl_c_reports_exactly_the_wakes_it_redrove_and_leaves_no_consumer() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    const LOST: usize = 4_000;
    lost_wakes(&bus, LOST, 40).await;
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    wait_until(WAIT, "the wake ledger", || async {
        bus.js
            .get_key_value(bus.subjects.wake_ledger_bucket())
            .await
            .is_ok()
    })
    .await;

    let mut replay = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .args(common::cli::tool_args(
            &nats.url(),
            &prefix,
            &["replay", "wakes"],
        ))
        .env_remove("NATS_URL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn wakebus replay");
    let mut stdout = BufReader::new(replay.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    // Interrupt once it has made progress, well before the end.
    while lines.len() < 20 {
        let line = tokio::time::timeout(WAIT, stdout.next_line())
            .await
            .expect("replay progress")
            .expect("read")
            .expect("replay ended before it was interrupted");
        lines.push(line);
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(replay.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    while let Some(line) = tokio::time::timeout(WAIT, stdout.next_line())
        .await
        .expect("replay to stop after Ctrl-C")
        .expect("read")
    {
        lines.push(line);
    }
    let status = tokio::time::timeout(WAIT, replay.wait())
        .await
        .expect("replay to exit")
        .expect("wait");
    assert_eq!(status.code(), Some(130), "exit status after Ctrl-C");

    // Right away, the read's consumer is gone: only the wake service's remains.
    let mut events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let consumers: Vec<String> = events
        .consumer_names()
        .map(|name| name.unwrap())
        .collect::<Vec<_>>()
        .await;
    assert_eq!(consumers, [bus.subjects.wake_consumer()], "consumers left");
    assert_eq!(events.info().await.unwrap().state.consumer_count, 1);

    let json: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let (items, summary) = json.split_at(json.len() - 1);
    let summary = &summary[0]["summary"];
    assert_eq!(summary["interrupted"], true, "{summary}");
    let replayed: Vec<String> = items
        .iter()
        .filter(|item| item["action"] == "replayed")
        .map(|item| item["delegation_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(replayed.len(), items.len(), "nothing here was delivered");
    assert_eq!(summary["replayed"], replayed.len());
    assert_eq!(summary["selected"], items.len());
    assert!(
        replayed.len() < LOST,
        "the replay finished before Ctrl-C: the history is too short"
    );

    // The wake service posts exactly what was reported, once each.
    wait_until(WAIT, "the re-driven wakes", || async {
        api.woken_delegations() >= replayed.len()
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let mut received: Vec<String> = api
        .accepted()
        .iter()
        .flat_map(|p| p.delegation_ids())
        .collect();
    let total = received.len();
    received.sort();
    received.dedup();
    assert_eq!(total, received.len(), "a wake was posted twice");
    let mut reported = replayed.clone();
    reported.sort();
    assert_eq!(received, reported, "posted and reported differ");
}

/// Dead-letters a task of `session`, then leaves what an earlier `replay
/// tasks` leaves when it stored its `submitted` record and failed to store
/// the task. Returns the derived delegation id.
async fn half_requeue_a_dead_letter(
    url: &str,
    prefix: &str,
    bus: &wakebus::bus::Bus,
    api: &SessionApiServer,
    session: &str,
) -> String {
    dead_letter_a_task(bus, api, session).await;
    let dry = wakebus(url, prefix, &["replay", "tasks", "--dry-run"])
        .await
        .ok_json();
    let derived = dry[0]["new_delegation_id"].as_str().unwrap().to_owned();
    let record = bus.subjects.submitted(&session_token(session), &derived, 0);
    bus.js
        .publish(record, r#"{"note": "half a re-queue"}"#.into())
        .await
        .unwrap()
        .await
        .unwrap();
    derived
}

/// Starts a worker and waits for the re-queued task's wake, the session's
/// second (after the failure's).
async fn run_the_requeued_task(
    services: &mut Services,
    bus: &wakebus::bus::Bus,
    api: &SessionApiServer,
    derived: &str,
) {
    services.echo_worker(bus);
    wait_until(WAIT, "the re-run's wake", || async {
        api.accepted().len() == 2
    })
    .await;
    assert_eq!(api.accepted()[1].delegation_ids(), [derived]);
}

#[tokio::test]
async fn replay_sends_the_task_again_when_an_earlier_requeue_stored_only_its_record() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let session = "s.half-requeued";
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    let derived = half_requeue_a_dead_letter(&nats.url(), &prefix, &bus, &api, session).await;

    let lines = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    assert_eq!(lines[0]["new_delegation_id"], derived.as_str());
    // Queued now: the next replay leaves it alone.
    let again = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(again[0]["action"], "skipped", "{again:#?}");
    run_the_requeued_task(&mut services, &bus, &api, &derived).await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 2, "the task ran once");
}

#[tokio::test]
async fn replay_skips_a_task_it_cannot_check_against_the_queue_and_can_send_it_later() {
    // A user who may not read the task stream's state: `replay tasks`
    // cannot tell whether an earlier re-queue's task waits.
    replay_tasks_as_a_user_denied(
        |subjects| format!("$JS.API.STREAM.INFO.{}", subjects.tasks_stream()),
        |derived| format!("cannot tell whether delegation {derived} is queued"),
    )
    .await;
}

#[tokio::test]
async fn replay_skips_a_task_it_cannot_check_against_the_history_and_can_send_it_later() {
    // A user who may not read single events: `replay tasks` cannot tell
    // whether an earlier re-queue's task ran.
    replay_tasks_as_a_user_denied(
        |subjects| format!("$JS.API.STREAM.MSG.GET.{}", subjects.events_stream()),
        |derived| format!("cannot tell whether delegation {derived} is queued"),
    )
    .await;
}

#[tokio::test]
async fn replay_skips_a_task_it_cannot_check_against_the_cancels_and_can_send_it_later() {
    // A user who may not open the cancel bucket: `replay tasks` cannot tell
    // whether the task's delegation or session was cancelled.
    replay_tasks_as_a_user_denied(
        |subjects| {
            format!(
                "$JS.API.STREAM.INFO.{}",
                wakebus::protocol::Subjects::bucket_stream(&subjects.cancel_bucket())
            )
        },
        |_| "cannot tell whether it was cancelled".to_owned(),
    )
    .await;
}

/// Half re-queues a dead letter, then runs `replay tasks` as a user who may
/// do everything except publish to the API subject `denied` returns; the
/// task must be skipped, not sent on a guess, and sent by a later replay
/// with a user who may.
async fn replay_tasks_as_a_user_denied(
    denied: impl Fn(&wakebus::protocol::Subjects) -> String,
    said: impl Fn(&str) -> String,
) {
    init_logs();
    let prefix = unique_prefix();
    let denied = denied(&wakebus::protocol::Subjects::new(&prefix).unwrap());
    let server = common::nats::LimitedUserServer::start(&[denied]).await;
    let nats = &server.nats;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &prefix).await;
    let session = "s.unreadable-queue";
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    let derived = half_requeue_a_dead_letter(&nats.url(), &prefix, &bus, &api, session).await;

    let run = server
        .wakebus_as_limited(&prefix, &["replay", "tasks"])
        .await;
    assert_eq!(run.code(), Some(3), "left unchecked: {}", run.stderr());
    let lines = run.json_lines();
    assert_eq!(lines[0]["action"], "skipped", "{lines:#?}");
    assert_eq!(lines[0]["unchecked"], true, "{lines:#?}");
    let reason = lines[0]["reason"].as_str().unwrap();
    assert!(reason.contains(&said(&derived)), "{reason}");
    let queued = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(queued, 0, "nothing was sent on a guess");

    // The dead letter is still there: with a user who can read the queue,
    // the replay sends the task.
    let lines = wakebus(&nats.url(), &prefix, &["replay", "tasks"])
        .await
        .ok_json();
    assert_eq!(lines[0]["action"], "replayed", "{lines:#?}");
    run_the_requeued_task(&mut services, &bus, &api, &derived).await;
    services.stop().await;
}

#[tokio::test]
async fn replay_does_not_redrive_a_dead_lettered_completion_the_wake_service_cannot_use() {
    let p = Pipeline::wake_only().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    // A delegation id with a dot: a copy on its subject would have a token
    // too many for the wake consumer's filter, and never be woken.
    let mut request = wakebus::protocol::TaskRequest::new("bad.id".to_owned(), "g");
    request.origin_session_id = Some("s.bad".to_owned());
    let event = wakebus::protocol::CompletionEvent::for_request(&request, Status::Completed, "ok");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", "s.bad");
    let subject = format!(
        "{}.evt.{}.badid.0.done",
        bus.subjects.prefix(),
        session_token("s.bad")
    );
    let body = serde_json::to_vec(&event).unwrap();
    let ack = bus.js.publish_with_headers(subject, headers, body.into());
    ack.await.unwrap().await.unwrap();
    wait_until(WAIT, "the dead letter", || async {
        !all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .is_empty()
    })
    .await;
    services.stop().await;

    let lines = wakebus(&nats.url(), &prefix, &["replay", "wakes", "--dead-letters"])
        .await
        .ok_json();
    assert_eq!(lines[0]["action"], "skipped", "{lines:#?}");
    let reason = lines[0]["reason"].as_str().unwrap();
    assert!(reason.contains("invalid delegation id"), "{reason}");
    assert!(replay_copies(&bus).await.is_empty());
    assert!(api.all_posts().is_empty());
}

/// Stores a dead letter on `subject` whose body was left out (too large to
/// store again with `reason`), as the services write one, and returns the
/// reason `wakebus <args>` gives for skipping it.
async fn skip_reason_for_a_dead_letter_without_its_body(
    args: &[&str],
    subject: impl Fn(&wakebus::protocol::Subjects) -> String,
    reason: &str,
) -> String {
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let init = wakebus(&nats.url(), &prefix, &["init"]).await;
    assert!(init.success(), "{}", init.stderr());
    let mut headers = async_nats::HeaderMap::new();
    let reason = format!("(body of 1048000 bytes left out: too large to store again) {reason}");
    headers.insert("Wakebus-Dead-Letter-Reason", reason.as_str());
    headers.insert("Wakebus-Delegation-Id", "d-large");
    headers.insert("Wakebus-Origin-Session", "s.large");
    let ack = bus
        .js
        .publish_with_headers(subject(&bus.subjects), headers, Vec::new().into());
    ack.await.unwrap().await.unwrap();

    let lines = wakebus(&nats.url(), &prefix, args).await.ok_json();
    assert!(replay_copies(&bus).await.is_empty());
    assert_eq!(lines[0]["action"], "skipped", "{lines:#?}");
    lines[0]["reason"].as_str().unwrap().to_owned()
}

/// A completion near the max payload is dead-lettered without its body:
/// the replay names where it is whole (the history) instead of calling it
/// one the wake service cannot use.
#[tokio::test]
async fn a_wake_dead_letter_without_its_body_is_sent_to_the_history_not_called_unusable() {
    let reason = skip_reason_for_a_dead_letter_without_its_body(
        &["replay", "wakes", "--dead-letters"],
        |subjects| subjects.dead_letter_wake(&session_token("s.large")),
        "the session API answered 400",
    )
    .await;
    assert!(
        reason.contains("whole in the history")
            && reason.contains("wakebus replay wakes --delegation d-large"),
        "{reason}"
    );
}

/// A task dead letter stored without its body (too large to store again
/// with its reason) is skipped saying that no copy of the request is left,
/// rather than with a JSON error and advice to fix a body that is gone.
#[tokio::test]
async fn a_task_dead_letter_without_its_body_says_that_no_copy_of_the_request_is_left() {
    let reason = skip_reason_for_a_dead_letter_without_its_body(
        &["replay", "tasks"],
        |subjects| subjects.dead_letter_task("default"),
        "request of 1048000 bytes is over the limit",
    )
    .await;
    assert!(
        reason.contains("too large to keep in the dead letter")
            && reason.contains("publish the request again"),
        "{reason}"
    );
}

/// The wake's ledger entry deleted (`nats kv del`, or by a forced replay
/// of an earlier release): a `--force` run must still post a second turn,
/// not a repeat the session API drops.
#[tokio::test]
async fn replay_with_force_posts_a_second_turn_even_when_the_ledger_entry_was_deleted() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let id = delivered_wake(&bus, &api, "s.forced.twice").await;
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    ledger.delete(format!("{id}.0")).await.unwrap();

    let key = forced_wake(&nats.url(), &prefix, &id).await;
    assert!(key.starts_with(&format!("{id}.0.done.replay.")), "{key}");
    wait_until(WAIT, "the forced second wake", || async {
        api.accepted().len() == 2
    })
    .await;
    services.stop().await;
    assert_eq!(api.accepted()[1].header("idempotency-key"), Some(key));
    assert_eq!(api.turns().len(), 2, "a second turn, not a repeat");
}

/// A forced replay copy held together with an ordinary copy of the same
/// completion (one published again, arrived first) is posted under the
/// forced copy's new key: under the old one, an API that honours
/// Idempotency-Key would drop the deliberate second turn as a repeat.
#[tokio::test]
async fn a_forced_replay_keeps_its_new_key_when_an_ordinary_copy_is_held_with_it() {
    let p = Pipeline::start().await;
    let (nats, api, prefix, bus, services) = (p.nats, p.api, p.prefix, p.bus, p.services);
    let session = "s.force.both";
    let id = delivered_wake(&bus, &api, session).await;
    // Another instance holds the session, so both copies wait together.
    let ttl = Duration::from_secs(30);
    let locks = wakebus::wake::lock::SessionLocks::new(
        bus.js.clone(),
        session_lock_bucket(&bus, ttl).await,
        "another-wake",
        ttl,
    );
    let token = session_token(session);
    let guard = eventually(WAIT, "the session's lock to be free", || async {
        locks.try_acquire(&token).await.ok().flatten()
    })
    .await;
    republish_completion(&bus).await;
    let held = |n: usize| {
        let bus = bus.clone();
        async move {
            wait_until(WAIT, "the copies to wait in the wake", || async {
                wake_consumer_info(&bus)
                    .await
                    .is_some_and(|info| info.num_ack_pending == n && info.num_pending == 0)
            })
            .await;
        }
    };
    held(1).await;
    let key = forced_wake(&nats.url(), &prefix, &id).await;
    held(2).await;
    locks.release(guard).await;
    wait_until(WAIT, "the forced second turn", || async {
        api.turns().len() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let posts = api.accepted();
    assert_eq!(posts.len(), 2, "{posts:?}");
    assert_eq!(posts[1].header("idempotency-key"), Some(key));
}

/// `replay wakes` that cannot read a completion's ledger entry (here: a
/// user that may not, as during a leader election) skips that completion
/// with the reason and goes on, instead of stopping the whole replay; a
/// later run sends it.
#[tokio::test]
async fn replay_wakes_skips_a_completion_it_cannot_check_against_the_ledger_and_goes_on() {
    init_logs();
    let prefix = unique_prefix();
    let subjects = wakebus::protocol::Subjects::new(&prefix).unwrap();
    let ledger_stream = wakebus::protocol::Subjects::bucket_stream(&subjects.wake_ledger_bucket());
    let server = common::nats::LimitedUserServer::start(&[format!(
        "$JS.API.STREAM.MSG.GET.{ledger_stream}"
    )])
    .await;
    let nats = &server.nats;
    let bus = bus(&nats.url(), &prefix).await;
    bus.provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let (first, ..) = publish_task(&bus, Some("s.unchecked"), Status::Completed).await;
    let (second, ..) = publish_task(&bus, Some("s.unchecked"), Status::Completed).await;

    let run = server
        .wakebus_as_limited(&prefix, &["replay", "wakes"])
        .await;
    assert_eq!(run.code(), Some(3), "left unchecked: {}", run.stderr());
    let lines = run.json_lines();
    let (items, summary) = lines.split_at(lines.len() - 1);
    assert_eq!(items.len(), 2, "{lines:#?}");
    for item in items {
        assert_eq!(item["action"], "skipped", "{item}");
        assert!(
            item["reason"]
                .as_str()
                .is_some_and(|r| r.contains("cannot tell whether it was delivered")),
            "{item}"
        );
    }
    assert_eq!(summary[0]["summary"]["skipped"], 2, "{lines:#?}");
    assert_eq!(summary[0]["summary"]["unchecked"], 2, "{lines:#?}");

    let again = wakebus(&nats.url(), &prefix, &["replay", "wakes"])
        .await
        .ok_json();
    let replayed: Vec<&str> = again
        .iter()
        .filter(|line| line["action"] == "replayed")
        .filter_map(|line| line["delegation_id"].as_str())
        .collect();
    assert_eq!(
        replayed,
        [first.delegation_id.as_str(), second.delegation_id.as_str()]
    );
    // Forced, the entry goes whatever it says, so it need not be read.
    let forced = server
        .wakebus_as_limited(&prefix, &["replay", "wakes", "--force"])
        .await
        .ok_json();
    let summary = &forced.last().unwrap()["summary"];
    assert_eq!(summary["replayed"], 2, "{forced:#?}");
    assert_eq!(summary["unchecked"], 0, "{forced:#?}");
}

/// A wake replay that cannot open the wake ledger says what to look at:
/// whether the wake service ever ran, when the bucket does not exist; the
/// server or the user's permission, when it exists but cannot be read
/// (asking whether the wake ever ran would send the operator the wrong
/// way).
#[tokio::test]
async fn a_wake_replay_that_cannot_open_the_ledger_says_what_to_look_at() {
    init_logs();
    let prefix = unique_prefix();
    let ledger_stream = format!(
        "KV_{}",
        wakebus::protocol::Subjects::new(&prefix)
            .unwrap()
            .wake_ledger_bucket()
    );
    let server =
        common::nats::LimitedUserServer::start(&[format!("$JS.API.STREAM.INFO.{ledger_stream}")])
            .await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let never_ran = wakebus(&server.nats.url(), &prefix, &["replay", "wakes"]).await;
    assert!(!never_ran.success(), "{}", never_ran.stdout());
    assert!(
        never_ran
            .stderr()
            .contains("has the wake service of this deployment ever run?"),
        "{}",
        never_ran.stderr()
    );

    bus.provision_wake_state(&BusSettings::default())
        .await
        .unwrap();
    let refused = server
        .wakebus_as_limited(&prefix, &["replay", "wakes"])
        .await;
    assert!(!refused.success(), "{}", refused.stdout());
    let said = refused.stderr();
    assert!(said.contains("the user's permission"), "{said}");
    assert!(!said.contains("ever run"), "{said}");
}

/// A Ctrl-C that comes while the last record is handled stops nothing:
/// the run is whole and says so (a script re-running an "interrupted"
/// forced replay would wake every session a second time). One that comes
/// before the last record interrupts the run.
#[tokio::test]
async fn a_replay_cancelled_while_its_last_record_is_handled_is_not_reported_interrupted() {
    use wakebus::replay::{Progress, ReplayKind, ReplayPlan, Replayer};
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    for session in ["s.one", "s.two"] {
        delegate(&bus, Delegation::new("woken").session(session)).await;
    }
    wait_until(WAIT, "both wakes", || async { api.accepted().len() == 2 }).await;
    services.stop().await;
    for (cancel_after, interrupted) in [(2, false), (1, true)] {
        let plan = ReplayPlan {
            kind: ReplayKind::Wakes,
            selection: wakebus::history::Selection::default(),
            force: false,
            tasks: Default::default(),
            dry_run: true,
        };
        let replayer = Replayer::new(bus.clone(), plan).await.unwrap();
        let cancel = tokio_util::sync::CancellationToken::new();
        let mut items = 0;
        let summary = wakebus::replay::run(replayer, cancel.clone(), |progress| {
            if let Progress::Item(_) = progress {
                items += 1;
                if items == cancel_after {
                    cancel.cancel();
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(items, cancel_after);
        assert_eq!(summary.interrupted, interrupted, "cancelled after {items}");
    }
}
