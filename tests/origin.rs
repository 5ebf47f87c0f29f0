//! Forged completions: a worker credential may publish a completion for any
//! session of its prefix, but the server refuses it another prefix's
//! subjects, and a wake that verifies origins refuses completions without
//! a matching `submitted` record from a delegator.

mod common;

use std::path::Path;
use std::time::Duration;

use common::roles::{RoleServer, init, init_prefix};
use common::*;
use tokio_util::sync::CancellationToken;
use wakebus::bus::Bus;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::history::Selection;
use wakebus::protocol::{
    CompletionEvent, EventHeaders, EventKind, HEADER_DEAD_LETTER_REASON, Status, TraceParent,
    new_delegation_id, session_token,
};
use wakebus::replay::{Action, Progress, ReplayItem, ReplayKind, ReplayPlan, Replayer};
use wakebus::worker::executor::{EchoExecutor, Executor};
use wakebus::worker::probe::last_sequence_on;

const WAIT: Duration = Duration::from_secs(30);

/// A server with two tenants: the repository's roles for the prefix
/// `wakebus`, and the same roles for the prefix `acme`, derived from the
/// permissions file by the substitutions docs/OPERATIONS.md gives.
async fn two_tenants() -> RoleServer {
    let dir = tempfile::tempdir().unwrap();
    // The store directory and port come from the harness's flags.
    let permissions =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nats/wakebus-permissions.conf");
    let wakebus = std::fs::read_to_string(&permissions).unwrap();
    let acme = wakebus
        .replace("wakebus.", "acme.")
        .replace("WAKEBUS_", "ACME_")
        .replace("_INBOX_", "_INBOX_acme-");
    std::fs::write(dir.path().join("acme-permissions.conf"), acme).unwrap();
    // `include` paths are relative to the including file.
    std::fs::write(dir.path().join("wakebus-permissions.conf"), &wakebus).unwrap();
    let conf = dir.path().join("nats.conf");
    std::fs::write(
        &conf,
        r#"
include "wakebus-permissions.conf"
include "acme-permissions.conf"
authorization {
  users: [
    { user: dev, password: "dev-only", permissions: $WAKEBUS_OPERATOR }
    { user: operator, password: "operator-dev-only", permissions: $WAKEBUS_OPERATOR }
    { user: delegator, password: "delegator-dev-only", permissions: $WAKEBUS_DELEGATOR }
    { user: worker, password: "worker-dev-only", permissions: $WAKEBUS_WORKER_DEFAULT }
    { user: wake, password: "wake-dev-only", permissions: $WAKEBUS_WAKE }
    { user: acme-operator, password: "acme-operator-dev-only", permissions: $ACME_OPERATOR }
    { user: acme-delegator, password: "acme-delegator-dev-only", permissions: $ACME_DELEGATOR }
    { user: acme-worker, password: "acme-worker-dev-only", permissions: $ACME_WORKER_DEFAULT }
    { user: acme-wake, password: "acme-wake-dev-only", permissions: $ACME_WAKE }
  ]
}
no_auth_user: dev
"#,
    )
    .unwrap();
    RoleServer::start_with_conf(dir, &conf).await
}

/// A completion body and headers for `session`, as a forger would write them.
fn forged(delegation_id: &str, session: &str, summary: &str) -> (Vec<u8>, Vec<u8>) {
    let body = serde_json::json!({
        "type": "async_delegation", "delegation_id": delegation_id,
        "origin_session_id": session, "status": "completed",
        "completed_at": "2026-01-01T00:00:00Z", "exit_reason": "completed",
        "summary": summary,
    });
    let headers = format!("NATS/1.0\r\nWakebus-Origin-Session: {session}\r\n\r\n");
    (serde_json::to_vec(&body).unwrap(), headers.into_bytes())
}

/// Publishes a completion with the worker's credentials through the client
/// library, as a compromised worker would, and waits until it is stored.
async fn publish_as_worker(worker: &Bus, delegation_id: &str, session: &str, summary: &str) {
    let mut event = CompletionEvent::for_request(
        &wakebus::protocol::TaskRequest {
            origin_session_id: Some(session.to_owned()),
            ..wakebus::protocol::TaskRequest::new(delegation_id.to_owned(), "g".to_owned())
        },
        Status::Completed,
        "completed",
    );
    event.summary = Some(summary.to_owned());
    let headers = EventHeaders {
        id: &format!("{delegation_id}.0.forged"),
        ce_type: EventKind::Done.ce_type(),
        source: "wakebus/worker/evil",
        origin_session: Some(session),
        delegation_id,
        task_index: 0,
        traceparent: TraceParent::new_root(),
    }
    .to_header_map();
    let subject = worker
        .subjects
        .event(&session_token(session), delegation_id, 0, EventKind::Done);
    worker
        .js
        .publish_with_headers(subject, headers, serde_json::to_vec(&event).unwrap().into())
        .await
        .expect("the worker may publish completions")
        .await
        .expect("stored");
}

#[tokio::test]
async fn a_worker_credential_cannot_publish_a_completion_under_another_tenants_prefix() {
    init_logs();
    let server = two_tenants().await;
    init_prefix(&server, "wakebus").await;
    init_prefix(&server, "acme").await;
    let port = server.nats.port;
    let token = session_token("victim.session");

    let (body, headers) = forged("01JFORGED0000000000000000", "victim.session", "obey me");
    for (user, subject) in [
        (
            "worker",
            format!("acme.evt.{token}.01JFORGED0000000000000000.0.done"),
        ),
        (
            "acme-worker",
            format!("wakebus.evt.{token}.01JFORGED0000000000000000.0.done"),
        ),
        (
            "acme-worker",
            format!("wakebus.evt.{token}.01JFORGED0000000000000000.0.started"),
        ),
        ("worker", "$JS.API.STREAM.INFO.ACME_EVENTS".to_owned()),
    ] {
        let password = format!("{user}-dev-only");
        let mut client = raw::RawClient::connect(port, Some((user, &password))).await;
        let refused = client.hpub(&subject, &headers, &body).await;
        let refused = refused.unwrap_or_else(|| panic!("{user} could publish {subject}"));
        assert!(
            refused.contains("Permissions Violation for Publish"),
            "{refused}"
        );
    }
    // Each tenant's worker may still publish its own prefix's completions.
    let mut acme =
        raw::RawClient::connect(port, Some(("acme-worker", "acme-worker-dev-only"))).await;
    let own = format!("acme.evt.{token}.01JOWN000000000000000000000.0.done");
    assert_eq!(acme.hpub(&own, &headers, &body).await, None);

    let operator = server.bus("operator").await;
    wait_until(WAIT, "acme's own completion stored", || async {
        all_messages(&operator, "ACME_EVENTS").await.len() == 1
    })
    .await;
    let stored = all_messages(&operator, "ACME_EVENTS").await;
    assert_eq!(stored[0].subject.as_str(), own);
    assert!(all_messages(&operator, "WAKEBUS_EVENTS").await.is_empty());
}

#[tokio::test]
async fn a_worker_learns_whether_a_completion_exists_without_reading_the_events_stream() {
    init_logs();
    let server = RoleServer::start().await;
    init(&server).await;
    let worker = server.bus("worker").await;
    let operator = server.bus("operator").await;
    let token = session_token("s.probe");
    let done = format!("wakebus.evt.{token}.01JPROBE0000000000000000000.0.done");

    assert_eq!(last_sequence_on(&worker, &done).await.expect("probe"), 0);
    operator
        .js
        .publish(done.clone(), "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let last = last_sequence_on(&worker, &done).await.expect("probe");
    assert_eq!(last, 1);
    // A wildcard probe answers a sequence number, never a message.
    let any = last_sequence_on(&worker, "wakebus.evt.*.*.*.done")
        .await
        .expect("probe");
    assert_eq!(any, 1);
    assert_eq!(
        all_messages(&operator, "WAKEBUS_EVENTS").await.len(),
        1,
        "probes store nothing"
    );
    assert_eq!(server.violations(), Vec::<String>::new());
}

/// The repository's roles with `init` run, a session API, the operator's
/// and the worker's buses, and a wake that verifies origins (no worker
/// yet: [`echo_worker`]).
async fn verifying_deployment() -> (RoleServer, SessionApiServer, Bus, Bus, Services) {
    init_logs();
    let server = RoleServer::start().await;
    let api = SessionApiServer::start().await;
    init(&server).await;
    let operator = server.bus("operator").await;
    let worker_bus = server.bus("worker").await;
    let mut services = Services::new();
    let mut wake_config = test_wake_config(&api.url());
    wake_config.verify_origin = true;
    services.wake(&server.bus("wake").await, wake_config);
    (server, api, operator, worker_bus, services)
}

/// An echo worker of pool `default`, with the worker's credentials.
fn echo_worker(services: &mut Services, worker_bus: &Bus) {
    services.worker(
        worker_bus,
        Executor::Echo(EchoExecutor),
        test_worker_config("default"),
    );
}

#[tokio::test]
async fn a_verifying_wake_dead_letters_forged_completions_and_wakes_the_genuine_one_once() {
    let (server, api, operator, worker_bus, mut services) = verifying_deployment().await;
    echo_worker(&mut services, &worker_bus);

    let delegator = Delegator::new(server.bus("delegator").await);
    let genuine = delegator
        .delegate(Delegation::new("genuine work").session("s.real"))
        .await
        .expect("delegation");
    let genuine_id = genuine.delegation_id().to_owned();
    // A delegation nobody submitted, for a session the worker never served.
    let invented = new_delegation_id();
    publish_as_worker(&worker_bus, &invented, "s.victim", "FORGED-INVENTED").await;
    // A real delegation the worker was given, claimed for another session.
    publish_as_worker(&worker_bus, &genuine_id, "s.victim", "FORGED-REDIRECTED").await;

    wait_until(WAIT, "two forged completions dead-lettered", || async {
        all_messages(&operator, "WAKEBUS_DLQ").await.len() >= 2
    })
    .await;
    wait_until(WAIT, "the genuine wake", || async {
        api.accepted()
            .iter()
            .any(|p| p.delegation_ids().contains(&genuine_id))
    })
    .await;
    wake_consumer_settled(&operator).await;
    services.stop().await;

    let posted = api.accepted();
    assert_eq!(posted.len(), 1, "only the genuine wake was posted");
    assert_eq!(posted[0].delegation_ids(), vec![genuine_id.clone()]);
    assert!(posted.iter().all(|p| !p.text().contains("FORGED")));
    let dead = all_messages(&operator, "WAKEBUS_DLQ").await;
    assert_eq!(dead.len(), 2);
    let victim = format!("wakebus.dlq.wake.{}", session_token("s.victim"));
    let mut refused = Vec::new();
    for message in &dead {
        assert_eq!(message.subject.as_str(), victim);
        let reason = message
            .headers
            .get(HEADER_DEAD_LETTER_REASON)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        assert!(
            reason.starts_with("origin not verified: no submitted record"),
            "{reason}"
        );
        refused.push(
            CompletionEvent::decode(&message.payload)
                .unwrap()
                .delegation_id,
        );
    }
    refused.sort();
    let mut expected = vec![invented, genuine_id];
    expected.sort();
    assert_eq!(refused, expected);
    // The genuine delegation's own records: submitted by the delegator, then
    // started and done by the worker.
    let kinds: Vec<String> = all_messages(&operator, "WAKEBUS_EVENTS")
        .await
        .iter()
        .map(|m| m.subject.to_string())
        .filter(|s| s.starts_with(&format!("wakebus.evt.{}.", session_token("s.real"))))
        .map(|s| s.rsplit('.').next().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["submitted", "started", "done"]);
    assert_eq!(server.violations(), Vec::<String>::new());
}

/// Runs a `replay wakes` as the operator and returns what it did with
/// each record.
async fn replay_as_operator(
    server: &RoleServer,
    kind: ReplayKind,
    selection: Selection,
    force: bool,
) -> Vec<ReplayItem> {
    let plan = ReplayPlan {
        kind,
        selection,
        force,
        tasks: Default::default(),
        dry_run: false,
    };
    let replayer = Replayer::new(server.bus("operator").await, plan)
        .await
        .expect("replayer");
    let mut items = Vec::new();
    wakebus::replay::run(replayer, CancellationToken::new(), |progress| {
        if let Progress::Item(item) = progress {
            items.push(item.clone());
        }
    })
    .await
    .expect("replay");
    items
}

/// The forged copy shares its ledger key with the genuine completion it
/// copied: forced (from the dead letters or from the history), it would
/// have replaced that delivery's entry with a forced key, and a later
/// replay of the genuine completion would have woken its session a second
/// time under that key.
#[tokio::test]
async fn a_forced_replay_of_a_forged_dead_letter_leaves_the_genuine_delivery_on_record() {
    let (server, api, operator, worker_bus, mut services) = verifying_deployment().await;
    echo_worker(&mut services, &worker_bus);
    let genuine = Delegator::new(server.bus("delegator").await)
        .delegate(Delegation::new("genuine work").session("s.real"))
        .await
        .expect("delegation");
    let id = genuine.delegation_id().to_owned();
    ledger_records_delivery(&operator, &id).await;
    publish_as_worker(&worker_bus, &id, "s.victim", "FORGED-REDIRECTED").await;
    wait_until(WAIT, "the forged completion dead-lettered", || async {
        all_messages(&operator, "WAKEBUS_DLQ").await.len() == 1
    })
    .await;

    let victim = Selection {
        session: Some("s.victim".to_owned()),
        ..Selection::default()
    };
    // Its dead letter, and its copy in the history.
    for kind in [ReplayKind::WakeDeadLetters, ReplayKind::Wakes] {
        let forced = replay_as_operator(&server, kind, victim.clone(), true).await;
        assert_eq!(forced.len(), 1, "{forced:#?}");
        assert_eq!(forced[0].action, Action::Skipped, "{forced:#?}");
        let reason = forced[0].reason.as_deref().unwrap_or_default();
        assert!(reason.contains("not forced"), "{reason}");
        assert!(!forced[0].ledger_cleared);
    }
    // Still on record as delivered: a plain replay of the delegation's
    // completions (the genuine one, then the forged one the worker
    // published) leaves them alone.
    let delegation = Selection {
        delegation: Some(id.clone()),
        ..Selection::default()
    };
    let plain = replay_as_operator(&server, ReplayKind::Wakes, delegation, false).await;
    assert_eq!(plain.len(), 2, "{plain:#?}");
    assert!(
        plain.iter().all(|item| item.action == Action::Skipped),
        "{plain:#?}"
    );
    let reason = plain[0].reason.as_deref().unwrap_or_default();
    assert!(reason.starts_with("already delivered"), "{reason}");
    wake_consumer_settled(&operator).await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 1, "only the genuine wake was posted");
    assert_eq!(server.violations(), Vec::<String>::new());
}

/// A forced replay of a delegation whose forged completion is stored
/// before its genuine one: the forged one is not forced, and the genuine
/// one still is (not skipped as a copy already handled).
#[tokio::test]
async fn a_forced_replay_forces_the_genuine_completion_stored_after_a_forged_one() {
    let (server, api, operator, worker_bus, mut services) = verifying_deployment().await;
    let genuine = Delegator::new(server.bus("delegator").await)
        .delegate(Delegation::new("genuine work").session("s.real"))
        .await
        .expect("delegation");
    let id = genuine.delegation_id().to_owned();
    // Forged before any worker runs the task.
    publish_as_worker(&worker_bus, &id, "s.victim", "FORGED-FIRST").await;
    echo_worker(&mut services, &worker_bus);
    ledger_records_delivery(&operator, &id).await;

    let delegation = Selection {
        delegation: Some(id.clone()),
        ..Selection::default()
    };
    let forced = replay_as_operator(&server, ReplayKind::Wakes, delegation, true).await;
    let actions: Vec<_> = forced.iter().map(|item| item.action).collect();
    assert_eq!(actions, [Action::Skipped, Action::Replayed], "{forced:#?}");
    assert_eq!(forced[1].origin_session.as_deref(), Some("s.real"));
    wait_until(WAIT, "the forced wake", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&operator).await;
    services.stop().await;
    assert!(api.accepted().iter().all(|p| p.session() == "s.real"));
}

/// A replay handled one completion per task, so a forged completion met
/// first (its dead letter stored before the genuine one's) made the
/// genuine one, refused by its session API, look handled: the run
/// reported success and the session was never woken. Plain, both are
/// re-driven (the verifying wake refuses the forged copy again); forced,
/// the forged one is skipped and the genuine one forced.
#[tokio::test]
async fn a_forged_dead_letter_stored_first_does_not_hide_the_genuine_refused_one_from_a_replay() {
    let (server, api, operator, worker_bus, mut services) = verifying_deployment().await;
    let genuine = Delegator::new(server.bus("delegator").await)
        .delegate(Delegation::new("genuine work").session("s.real"))
        .await
        .expect("delegation");
    let id = genuine.delegation_id().to_owned();
    publish_as_worker(&worker_bus, &id, "s.victim", "FORGED-FIRST").await;
    let dead_letters = |count: usize| {
        let operator = &operator;
        async move { all_messages(operator, "WAKEBUS_DLQ").await.len() == count }
    };
    wait_until(WAIT, "the forged completion dead-lettered", || {
        dead_letters(1)
    })
    .await;
    api.fail_always(400);
    echo_worker(&mut services, &worker_bus);
    wait_until(WAIT, "the genuine completion refused", || dead_letters(2)).await;
    api.recover();

    let delegation = Selection {
        delegation: Some(id.clone()),
        ..Selection::default()
    };
    let replayed_for = |items: &[ReplayItem], session: &str| {
        items
            .iter()
            .filter(|item| item.origin_session.as_deref() == Some(session))
            .map(|item| item.action)
            .collect::<Vec<_>>()
    };
    let plain = replay_as_operator(
        &server,
        ReplayKind::WakeDeadLetters,
        delegation.clone(),
        false,
    )
    .await;
    assert_eq!(
        replayed_for(&plain, "s.real"),
        [Action::Replayed],
        "{plain:#?}"
    );
    wait_until(WAIT, "the genuine wake", || async {
        api.accepted().len() == 1
    })
    .await;
    // The forged copy, refused again.
    wait_until(WAIT, "the forged copy dead-lettered again", || {
        dead_letters(3)
    })
    .await;

    let forced = replay_as_operator(&server, ReplayKind::WakeDeadLetters, delegation, true).await;
    assert_eq!(
        replayed_for(&forced, "s.real"),
        [Action::Replayed],
        "{forced:#?}"
    );
    let victim = replayed_for(&forced, "s.victim");
    assert!(
        !victim.is_empty() && victim.iter().all(|action| *action == Action::Skipped),
        "{forced:#?}"
    );
    wait_until(WAIT, "the forced wake", || async {
        api.accepted().len() == 2
    })
    .await;
    wake_consumer_settled(&operator).await;
    services.stop().await;
    assert!(api.accepted().iter().all(|p| p.session() == "s.real"));
    assert_eq!(server.violations(), Vec::<String>::new());
}

/// A task that waits or runs longer than the history outlives its
/// `submitted` record. Its completion cannot be verified and is refused,
/// but as what it is: an expired record, said at ERROR with the history to
/// lengthen, not a forged completion that points at a worker.
#[tokio::test]
async fn a_completion_whose_submitted_record_expired_is_refused_as_expired_not_as_forged() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut events = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .unwrap();
    let mut config = events.info().await.unwrap().config.clone();
    config.max_age = Duration::from_secs(1);
    config.duplicate_window = config.max_age;
    bus.js.update_stream(&config).await.unwrap();
    // The task ends once the test has seen its record expire.
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("open");
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(&format!(
            "while [ ! -e {} ]; do sleep 0.05; done; echo late",
            gate.display()
        )),
        test_worker_config("default"),
    );
    let mut wake_config = test_wake_config(&api.url());
    wake_config.verify_origin = true;
    services.wake(&bus, wake_config);
    let id = delegate(
        &bus,
        Delegation::new("outlives its record").session("s.long"),
    )
    .await;
    let record = bus
        .subjects
        .event(&session_token("s.long"), &id, 0, EventKind::Submitted);
    wait_until(WAIT, "the submitted record to expire", || async {
        matches!(
            events.get_last_raw_message_by_subject(&record).await,
            Err(error) if error.kind()
                == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
        )
    })
    .await;
    std::fs::write(&gate, "").unwrap();

    let dead_letters = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "the completion refused", || async {
        !all_messages(&bus, &dead_letters).await.is_empty()
    })
    .await;
    services.stop().await;
    let dead = all_messages(&bus, &dead_letters).await;
    let reason = dead[0]
        .headers
        .get(HEADER_DEAD_LETTER_REASON)
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    assert!(
        reason.contains("may have been removed by the history's limits"),
        "{reason}"
    );
    assert!(api.accepted().is_empty());
}

/// The record that cannot be read now (a leader election, a permission
/// missing) is no proof of a forgery: the completion is handed back and
/// asked about again, never dead-lettered, and no session is woken
/// unverified meanwhile.
#[tokio::test]
async fn a_completion_whose_submitted_record_cannot_be_read_is_retried_not_refused() {
    init_logs();
    let prefix = unique_prefix();
    let events = wakebus::protocol::Subjects::new(&prefix)
        .unwrap()
        .events_stream();
    let server =
        common::nats::LimitedUserServer::start(&common::nats::message_reads_of(&events)).await;
    let api = SessionApiServer::start().await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let client = server.limited_config().connect().await.unwrap();
    let wake_bus = Bus::new(client, wakebus::protocol::Subjects::new(&prefix).unwrap());
    let mut services = Services::new();
    echo_worker(&mut services, &bus);
    let mut wake_config = test_wake_config(&api.url());
    wake_config.verify_origin = true;
    services.wake(&wake_bus, wake_config);
    delegate(&bus, Delegation::new("checked later").session("s.unread")).await;

    wait_until(WAIT, "the completion asked about again", || async {
        wake_consumer_info(&bus)
            .await
            .is_some_and(|info| info.num_redelivered > 0)
    })
    .await;
    services.stop().await;
    assert!(
        all_messages(&bus, &bus.subjects.dead_letter_stream())
            .await
            .is_empty(),
        "a completion it could not check was dead-lettered"
    );
    assert!(api.all_posts().is_empty(), "woken unverified");
}
