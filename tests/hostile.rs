//! Hostile input: oversized requests, bodies that are not UTF-8, session ids
//! of every shape, forged completions and headers no client library would
//! write. Each ends once with a recorded reason and the services go on.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use common::*;
use futures::StreamExt as _;
use wakebus::bus::Bus;
use wakebus::delegate::{DelegateError, Delegation, Delegator, TaskSpec};
use wakebus::protocol::{CompletionEvent, Limits, Status, session_token};
use wakebus::worker::executor::{EchoExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

/// Publishes a raw request body with only an origin session and a delegation id header.
async fn publish_raw(bus: &Bus, session: &str, delegation_id: &str, body: Vec<u8>) {
    let mut headers = HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", session);
    headers.insert("Wakebus-Delegation-Id", delegation_id);
    bus.js
        .publish_with_headers(bus.subjects.task("default"), headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

fn request_body(delegation_id: &str, session: &str, goal: &str, context: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "version": 1,
        "delegation_id": delegation_id,
        "origin_session_id": session,
        "goal": goal,
        "context": context,
        "a_field_from_the_future": {"nested": [1, 2, 3]},
    }))
    .unwrap()
}

fn dead_letter_reasons(messages: &[async_nats::jetstream::message::StreamMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            m.headers
                .get("Wakebus-Dead-Letter-Reason")
                .map(|v| v.to_string())
                .unwrap_or_default()
        })
        .collect()
}

#[tokio::test]
async fn oversized_and_non_utf8_requests_end_once_in_clear_error_wakes_and_the_worker_goes_on() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.limits = Limits {
        max_request_bytes: 4096,
        max_goal_bytes: 100,
        max_context_bytes: 1000,
    };
    services.worker(&bus, Executor::Echo(EchoExecutor), config);
    services.wake(&bus, test_wake_config(&api.url()));

    let cases = [
        (
            "big-goal",
            request_body("big-goal", "s.goal", &"g".repeat(101), ""),
        ),
        (
            "big-context",
            request_body("big-context", "s.context", "ok", &"c".repeat(1001)),
        ),
        (
            "big-body",
            request_body("big-body", "s.body", "ok", &"x".repeat(999)).repeat(5),
        ),
        (
            "not-utf8",
            b"{\"version\":1,\"delegation_id\":\"not-utf8\",\"goal\":\"\xff\xfe\"}".to_vec(),
        ),
        (
            "wrong-type",
            br#"{"version":1,"delegation_id":"wrong-type","goal":"g","task_index":"zero"}"#
                .to_vec(),
        ),
    ];
    let sessions: HashMap<&str, &str> = [
        ("big-goal", "s.goal"),
        ("big-context", "s.context"),
        ("big-body", "s.body"),
        ("not-utf8", "s.utf8"),
        ("wrong-type", "s.type"),
    ]
    .into();
    for (id, body) in &cases {
        publish_raw(&bus, sessions[id], id, body.clone()).await;
    }
    // A request exactly at the limits still runs, and unknown fields are fine.
    publish_raw(
        &bus,
        "s.fine",
        "fine",
        request_body("fine", "s.fine", &"g".repeat(100), &"c".repeat(1000)),
    )
    .await;

    wait_until(WAIT, "six wakes", || async { api.accepted().len() >= 6 }).await;
    let redelivered = drained(&bus, &bus.subjects.tasks_stream(), "worker-default", WAIT).await;
    services.stop().await;

    let texts: HashMap<String, String> = api
        .accepted()
        .iter()
        .map(|p| (p.session(), p.text()))
        .collect();
    let expect = [
        ("s.goal", "goal is 101 bytes; the limit is 100 bytes"),
        (
            "s.context",
            "context is 1001 bytes; the limit is 1000 bytes",
        ),
        ("s.body", "bytes; the limit is 4096 bytes"),
        ("s.utf8", "request body is not valid UTF-8"),
        ("s.type", "invalid type: string \"zero\", expected u32"),
    ];
    assert!(texts["s.body"].contains("request body is "));
    for (session, reason) in expect {
        let text = &texts[session];
        assert!(text.contains("Status: error"), "{session}: {text}");
        assert!(text.contains(reason), "{session}: {text}");
    }
    assert!(texts["s.fine"].contains("Status: completed"), "{texts:?}");
    assert_eq!(redelivered, 0, "each poison request is handled once");

    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert_eq!(dead.len(), 5, "one dead letter per unusable request");
    for (message, reason) in dead.iter().zip(dead_letter_reasons(&dead)) {
        assert!(!reason.is_empty());
        assert!(
            !message.payload.is_empty(),
            "small bodies are kept for replay"
        );
    }
}

#[tokio::test]
async fn a_request_at_the_servers_max_payload_completes_with_its_context_cut_to_fit() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    // The completion repeats goal and context; with a context this large it
    // would not fit in one message unless the worker cuts it.
    let context = "\"".repeat(max_payload / 2 - 1000);
    let body = request_body("near-max", "s.max", "summarise", &context);
    assert!(body.len() < max_payload && body.len() > max_payload - 4096);
    publish_raw(&bus, "s.max", "near-max", body).await;

    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let text = api.accepted()[0].text();
    assert!(text.contains("Status: completed"), "{text}");
    let done = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .find(|m| m.subject.ends_with(".done"))
        .expect("completion");
    let done = CompletionEvent::decode(&done.payload).unwrap();
    assert_eq!(done.status, Status::Completed);
    assert!(
        done.context
            .ends_with("[truncated to fit the NATS max payload]"),
        "context not cut"
    );
}

/// The completions a worker writes without running the task (here: nested
/// too deep) repeat the request's goal and context too: cut to fit as well,
/// or the request would be NAKed every second, forever, and never woken.
#[tokio::test]
async fn a_request_nested_too_deep_at_the_servers_max_payload_still_wakes_its_session_with_the_error()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    let mut body: serde_json::Value =
        serde_json::from_slice(&request_body("too-deep", "s.deep", "g", "")).unwrap();
    body["depth"] = 5.into();
    // As large as the request can be: its completion, with more fields and
    // headers, cannot be as large.
    let overhead = serde_json::to_vec(&body).unwrap().len();
    body["context"] = "c".repeat(max_payload - overhead - 200).into();
    let body = serde_json::to_vec(&body).unwrap();
    assert!(body.len() < max_payload && body.len() > max_payload - 300);
    publish_raw(&bus, "s.deep", "too-deep", body).await;

    wait_until(WAIT, "the error wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    let redelivered = drained(&bus, &bus.subjects.tasks_stream(), "worker-default", WAIT).await;
    services.stop().await;
    let text = api.accepted()[0].text();
    assert!(text.contains("Status: error"), "{text}");
    assert!(text.contains("Delegation depth limit reached"), "{text}");
    assert_eq!(redelivered, 0);
}

#[tokio::test]
async fn completions_too_large_to_combine_into_one_turn_are_each_woken_alone() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    // Each result fits in a completion; two of them do not fit in the one
    // ledger entry a combined turn records before its post.
    let script = format!("head -c {} /dev/zero | tr '\\0' x", max_payload * 3 / 5);
    let mut services = Services::new();
    services.worker(&bus, shell(&script), test_worker_config("default"));
    services.wake(&bus, test_wake_config(&api.url()));
    // Another instance holds the session until both are in the wake, so
    // that they are planned together.
    let (locks, guard) = hold_session_elsewhere(&bus, "s.large").await;
    let mut ids = Vec::new();
    for goal in ["one", "two"] {
        ids.push(delegate(&bus, Delegation::new(goal).session("s.large")).await);
    }
    completions_waiting_in_wake(&bus, 2).await;
    locks.release(guard).await;
    wait_until(WAIT, "both wakes", || async { api.accepted().len() == 2 }).await;
    wake_consumer_settled(&bus).await;
    let info = wake_consumer_info(&bus).await.unwrap();
    services.stop().await;
    assert_eq!(
        info.delivered.consumer_sequence, 2,
        "a completion was redelivered"
    );
    let mut woken: Vec<Vec<String>> = api.all_posts().iter().map(|p| p.delegation_ids()).collect();
    woken.sort();
    ids.sort();
    assert_eq!(woken, [vec![ids[0].clone()], vec![ids[1].clone()]]);
}

/// A combined turn the session API refuses as too large (413: a proxy's
/// body limit) is not dead-lettered: each of its completions, which fits,
/// is posted alone, under its own key.
#[tokio::test]
async fn a_combined_turn_refused_as_too_large_is_posted_one_completion_at_a_time() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // Each result fits in a turn of its own; two in one turn do not.
    api.refuse_turns_over(3_000);
    let mut services = Services::new();
    services.worker(
        &bus,
        shell("head -c 2000 /dev/zero | tr '\\0' x"),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    // Another instance holds the session until both are in the wake, so
    // that they are planned together.
    let (locks, guard) = hold_session_elsewhere(&bus, "s.split").await;
    let mut ids = Vec::new();
    for goal in ["one", "two"] {
        ids.push(delegate(&bus, Delegation::new(goal).session("s.split")).await);
    }
    completions_waiting_in_wake(&bus, 2).await;
    locks.release(guard).await;
    wait_until(WAIT, "both wakes", || async { api.accepted().len() == 2 }).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 3, "the combined turn, then one each");
    assert_eq!(posts[0].delegation_ids().len(), 2);
    let mut woken: Vec<(Vec<String>, String)> = api
        .accepted()
        .iter()
        .map(|p| (p.delegation_ids(), p.header("idempotency-key").unwrap()))
        .collect();
    woken.sort();
    ids.sort();
    let expected: Vec<_> = ids
        .iter()
        .map(|id| (vec![id.clone()], format!("{id}.0.done")))
        .collect();
    assert_eq!(woken, expected);
    let dlq = bus.subjects.dead_letter_stream();
    assert!(
        all_messages(&bus, &dlq).await.is_empty(),
        "a wake was dead-lettered"
    );
}

/// A batch's results longer together than the server's max payload are
/// cut to fit one turn, at one length that spares the short ones: the
/// turn is bounded (it is held in memory, and posted as one message), the
/// long results share what the short one leaves, and the turn says where
/// each is whole.
#[tokio::test]
async fn a_batch_whose_results_exceed_one_turn_is_woken_with_the_long_ones_cut_evenly() {
    init_logs();
    let (nats, _conf) = NatsServer::start_with_config("max_payload: 65536\n").await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(
            r#"input=$(cat); case "$input" in *long*) head -c 40000 /dev/zero | tr '\0' x;; *) echo short result;; esac"#,
        ),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let goals = ["long one", "short", "long two"].map(String::from);
    let id = delegate(&bus, Delegation::batch(goals).session("s.cut")).await;
    wait_until(WAIT, "the batch's wake", || async {
        api.accepted().len() == 1
    })
    .await;
    let text = api.accepted()[0].text();
    assert!(text.len() <= 65536, "a turn of {} bytes", text.len());
    let sections: Vec<&str> = text.split("\nTask ").skip(1).collect();
    assert_eq!(sections.len(), 3, "{text}");
    for long in [sections[0], sections[2]] {
        let kept = long.matches('x').count();
        // An even third of the budget would be under 22,000.
        assert!((30_000..40_000).contains(&kept), "{kept} kept: {long:.200}");
        assert!(long.contains("bytes cut]"), "{long:.200}");
    }
    assert!(
        sections[1].contains("Result:\nshort result") && !sections[1].contains("bytes cut"),
        "{}",
        sections[1]
    );
    assert!(
        text.contains(&format!("`wakebus events --delegation {id}`")),
        "{text:.300}"
    );

    // All long, with long goals: what the goals take leaves each result
    // less than an even share of the budget, and the turn still fits.
    let goals = ["one", "two", "three"].map(|n| format!("long {n} {}", "g".repeat(1000)));
    delegate(&bus, Delegation::batch(goals).session("s.cut.all")).await;
    wait_until(WAIT, "the second batch's wake", || async {
        api.accepted().len() == 2
    })
    .await;
    services.stop().await;
    let text = api.accepted()[1].text();
    assert!(text.len() <= 65536, "a turn of {} bytes", text.len());
    assert_eq!(text.matches("bytes cut]").count(), 3, "{text:.300}");
}

/// A task program: goals containing `first` or `second` end once the file
/// of that name appears in `gates`; anything else at once.
fn gated_script(gates: &std::path::Path) -> String {
    format!(
        r#"input=$(cat); case "$input" in *first*) g='{0}/first';; *second*) g='{0}/second';; *) echo fine; exit 0;; esac; while [ ! -f "$g" ]; do sleep 0.05; done; echo done"#,
        gates.display()
    )
}

/// Checks that `text` is the turn of batch `id` with both its tasks completed.
fn assert_both_tasks_reported(text: &str, id: &str) {
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]")),
        "{text}"
    );
    assert!(text.contains("2 completed, 0 not completed"), "{text}");
}

/// Waits for the batch's wake, stops `services` once the wake consumer has
/// settled, and checks that this turn, with both tasks completed, was the
/// only post.
async fn batch_woken_once(bus: &Bus, api: &SessionApiServer, services: Services, id: &str) {
    wait_until(WAIT, "the batch's wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(bus).await;
    services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 1);
    assert_both_tasks_reported(&posts[0].text(), id);
}

/// Publishes garbage on the `done` subject of task `index` of delegation
/// `id`, and waits until the wake has dead-lettered it.
async fn publish_garbled_completion(bus: &Bus, session: &str, id: &str, index: u32) {
    let mut headers = HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", session);
    let garbage = "\u{0}garbage".into();
    publish_refused_completion(bus, session, id, index, headers, garbage).await;
}

/// Publishes `payload` with `headers` on the `done` subject of task
/// `index` of delegation `id`, and waits until the wake has dead-lettered
/// it.
async fn publish_refused_completion(
    bus: &Bus,
    session: &str,
    id: &str,
    index: u32,
    headers: HeaderMap,
    payload: bytes::Bytes,
) {
    let dlq = bus.subjects.dead_letter_stream();
    let before = all_messages(bus, &dlq).await.len();
    let subject = bus.subjects.event(
        &session_token(session),
        id,
        index,
        wakebus::protocol::EventKind::Done,
    );
    bus.js
        .publish_with_headers(subject, headers, payload)
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until(
        WAIT,
        "the refused completion to be dead-lettered",
        || async { all_messages(bus, &dlq).await.len() > before },
    )
    .await;
}

/// A deployment whose worker runs each of a two-task batch's tasks until
/// its gate file (`first`, `second`) appears in `gates`, and that batch,
/// delegated for `session`.
struct GatedBatch {
    /// Runs while the test does.
    _nats: NatsServer,
    api: SessionApiServer,
    bus: Bus,
    gates: tempfile::TempDir,
    services: Services,
    id: String,
}

impl GatedBatch {
    async fn start(session: &str) -> Self {
        init_logs();
        let nats = NatsServer::start().await;
        let api = SessionApiServer::start().await;
        let bus = bus(&nats.url(), &unique_prefix()).await;
        let gates = tempfile::tempdir().unwrap();
        let mut services = Services::new();
        let script = gated_script(gates.path());
        services.worker(&bus, shell(&script), test_worker_config("default"));
        services.wake(&bus, test_wake_config(&api.url()));
        let goals = ["first task", "second task"].map(String::from);
        let id = delegate(&bus, Delegation::batch(goals).session(session)).await;
        Self {
            _nats: nats,
            api,
            bus,
            gates,
            services,
            id,
        }
    }

    /// Lets the task `name` (`first`, `second`) end.
    fn open(&self, name: &str) {
        std::fs::write(self.gates.path().join(name), "").unwrap();
    }
}

#[tokio::test]
async fn a_garbled_completion_of_a_batch_task_neither_wakes_the_batch_early_nor_holds_up_the_session()
 {
    let batch = GatedBatch::start("s.garbled").await;
    let (bus, api, id) = (&batch.bus, &batch.api, &batch.id);
    // Garbage where the second task's completion is read from, while it runs.
    publish_garbled_completion(bus, "s.garbled", id, 1).await;

    // The first task ends: the batch is not complete, and says nothing yet.
    batch.open("first");
    wait_until(WAIT, "the first task's completion", || async {
        all_messages(bus, &bus.subjects.events_stream())
            .await
            .iter()
            .filter(|m| m.subject.ends_with(".0.done"))
            .count()
            == 1
    })
    .await;
    // The session's other work is not held up meanwhile.
    let single = delegate(bus, Delegation::new("single").session("s.garbled")).await;
    wait_until(WAIT, "the single task's wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    wake_consumer_settled(bus).await;
    assert_eq!(api.all_posts().len(), 1, "the batch was woken early");
    assert_eq!(api.all_posts()[0].delegation_ids(), [single]);

    // The second task's real completion ends the batch.
    batch.open("second");
    wait_until(WAIT, "the batch's wake", || async {
        api.accepted().len() == 2
    })
    .await;
    batch.services.stop().await;
    let posts = api.all_posts();
    assert_eq!(posts.len(), 2);
    assert_both_tasks_reported(&posts[1].text(), id);
}

/// A readable completion of a batch task that the wake refuses (here one
/// without its `Wakebus-Origin-Session` header), stored while the task
/// runs, does not end the batch: the session would be woken with its text,
/// and the task's real completion, arriving later, would find the batch
/// delivered and never be posted.
#[tokio::test]
async fn a_completion_the_wake_refused_does_not_end_its_batch_before_the_real_one() {
    let batch = GatedBatch::start("s.refused").await;
    let (bus, api, id) = (&batch.bus, &batch.api, &batch.id);
    let impostor = serde_json::json!({
        "type": "async_delegation", "delegation_id": id, "task_index": 1,
        "task_count": 2, "wake_mode": "batch", "origin_session_id": "s.refused",
        "status": "completed", "completed_at": "2026-01-01T00:00:00Z",
        "exit_reason": "completed", "summary": "NOT THE REAL RESULT",
    });
    let impostor = serde_json::to_vec(&impostor).unwrap().into();
    publish_refused_completion(bus, "s.refused", id, 1, HeaderMap::new(), impostor).await;

    // The first task ends: with the impostor counted, the batch would be
    // woken now.
    batch.open("first");
    wait_until(WAIT, "the first task's completion", || async {
        done_events(bus).await.len() == 2
    })
    .await;
    wake_consumer_settled(bus).await;
    assert!(api.all_posts().is_empty(), "the batch was woken early");

    batch.open("second");
    batch_woken_once(bus, api, batch.services, id).await;
    let text = api.all_posts()[0].text();
    assert!(!text.contains("NOT THE REAL RESULT"), "{text}");
}

#[tokio::test]
async fn garbage_stored_after_a_batch_completion_the_wake_has_in_hand_does_not_keep_the_batch_unwoken()
 {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    // Another instance holds the session: both completions wait in hand.
    let (locks, guard) = hold_session_elsewhere(&bus, "s.after").await;
    let goals = ["first", "second"].map(String::from);
    let id = delegate(&bus, Delegation::batch(goals).session("s.after")).await;
    completions_waiting_in_wake(&bus, 2).await;
    // Garbage on the second task's subject, stored after its completion.
    publish_garbled_completion(&bus, "s.after", &id, 1).await;

    locks.release(guard).await;
    batch_woken_once(&bus, &api, services, &id).await;
}

#[tokio::test]
async fn garbage_stored_after_a_batch_completion_already_acked_is_read_past() {
    let batch = GatedBatch::start("s.past").await;
    let (bus, api, id) = (&batch.bus, &batch.api, &batch.id);
    // The second task ends first; the wake acks it, as the batch is not done.
    batch.open("second");
    wait_until(WAIT, "the second task's completion", || async {
        done_events(bus).await.len() == 1
    })
    .await;
    wake_consumer_settled(bus).await;
    // Garbage on its subject, stored after its completion.
    publish_garbled_completion(bus, "s.past", id, 1).await;

    batch.open("first");
    batch_woken_once(bus, api, batch.services, id).await;
}

#[tokio::test]
async fn a_rejected_request_too_large_to_store_again_is_dead_lettered_without_its_body() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.limits.max_request_bytes = 1024;
    services.worker(&bus, Executor::Echo(EchoExecutor), config);
    services.wake(&bus, test_wake_config(&api.url()));

    let body = request_body("huge", "s.huge", "g", &"x".repeat(max_payload - 300));
    publish_raw(&bus, "s.huge", "huge", body.clone()).await;
    wait_until(WAIT, "the error wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    let redelivered = drained(&bus, &bus.subjects.tasks_stream(), "worker-default", WAIT).await;
    services.stop().await;

    assert!(api.accepted()[0].text().contains("Status: error"));
    assert_eq!(redelivered, 0);
    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert_eq!(dead.len(), 1);
    assert!(dead[0].payload.is_empty());
    let reason = &dead_letter_reasons(&dead)[0];
    assert!(reason.contains("the limit is 1024 bytes"), "{reason}");
    assert!(
        reason.contains(&format!("body of {} bytes left out", body.len())),
        "{reason}"
    );
}

#[tokio::test]
async fn session_ids_of_any_shape_reach_the_session_api_unchanged() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);

    let ten_kb: String = "sess.*.>. ünï会话 \"quoted\" {{x}} \\ ;,: "
        .chars()
        .cycle()
        .take(9000)
        .collect::<String>()
        .trim()
        .to_owned();
    assert!(ten_kb.len() >= 10 * 1024, "{}", ten_kb.len());
    let sessions = [
        "a.b.c".to_owned(),
        "*".to_owned(),
        ">".to_owned(),
        "wakebus.evt.*.*.*.done".to_owned(),
        "with  inner   spaces".to_owned(),
        "ünïcödé 会话 🦀".to_owned(),
        "Idempotency-Key: forged".to_owned(),
        ten_kb,
    ];
    let delegator = Delegator::new(bus.clone());
    for session in &sessions {
        delegator
            .delegate(Delegation::new("shape test").session(session.clone()))
            .await
            .expect("delegate");
    }
    wait_until(WAIT, "one wake per session", || async {
        api.accepted().len() >= sessions.len()
    })
    .await;
    services.stop().await;
    let mut woken: Vec<String> = api.accepted().iter().map(|p| p.session()).collect();
    woken.sort();
    let mut expected = sessions.to_vec();
    expected.sort();
    assert_eq!(woken, expected);
    for post in api.accepted() {
        assert!(post.text().contains("Status: completed"));
    }
}

#[tokio::test]
async fn the_delegator_refuses_oversized_or_unsafe_input_before_publishing() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    let delegator = Delegator::new(bus.clone()).with_limits(Limits {
        max_request_bytes: 10 * 1024 * 1024,
        max_goal_bytes: 10,
        max_context_bytes: 10 * 1024 * 1024,
    });
    let cases: Vec<(Delegation, &str)> = vec![
        (
            Delegation::new("x".repeat(11)).session("s"),
            "goal is 11 bytes; the limit is 10 bytes",
        ),
        (
            Delegation::new("g")
                .session("s")
                .context("c".repeat(max_payload)),
            "max_payload",
        ),
        (
            Delegation::new("g").session("s\r\nX-Injected: 1"),
            "origin session id contains '\\r'",
        ),
        (
            Delegation::new("g").session(" padded "),
            "must not start or end with whitespace",
        ),
        (
            Delegation::new("g").session("x".repeat(16 * 1024 + 1)),
            "origin session id is 16385 bytes long; the limit is 16384",
        ),
        (
            Delegation::new("g").session("s").pool("a.b"),
            "pool contains '.'",
        ),
        (
            Delegation::new("   ").session("s"),
            "goal of task 0 must not be empty",
        ),
        // A batch is refused whole: the first task is fine, but nothing of
        // it is published (checked below) because the second has no goal.
        (
            {
                let mut batch = Delegation::new("fine").session("s");
                batch.tasks.push(TaskSpec {
                    goal: "\t\n".to_owned(),
                    context: String::new(),
                });
                batch
            },
            "goal of task 1 must not be empty",
        ),
        (
            {
                let mut zero = Delegation::new("g").session("s");
                zero.timeout_seconds = Some(0);
                zero
            },
            "timeout_seconds must be at least 1",
        ),
        (
            {
                let mut zero = Delegation::new("g").session("s");
                zero.depth = 0;
                zero
            },
            "depth must be at least 1",
        ),
    ];
    for (delegation, expected) in cases {
        let err = delegator.delegate(delegation).await.unwrap_err();
        assert!(
            matches!(
                err,
                DelegateError::TooLarge(_)
                    | DelegateError::InvalidId(_)
                    | DelegateError::EmptyGoal(_)
                    | DelegateError::ZeroTimeout
                    | DelegateError::ZeroDepth
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains(expected), "{err}");
    }
    let mut stream = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        0,
        "nothing was published"
    );
}

#[tokio::test]
async fn forged_and_inconsistent_completions_are_dead_lettered_once_and_real_wakes_go_on() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let max_payload = bus.client.server_info().max_payload;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    let victim = "s.victim";
    let token = session_token(victim);
    let completion = |id: &str, extra: serde_json::Value| {
        let mut body = serde_json::json!({
            "type": "async_delegation",
            "delegation_id": id,
            "origin_session_id": victim,
            "status": "completed",
            "completed_at": "2026-01-01T00:00:00Z",
            "exit_reason": "completed",
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::to_vec(&body).unwrap()
    };
    let with_origin = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("Wakebus-Origin-Session", value);
        headers
    };
    let poison: Vec<(&str, HeaderMap, Vec<u8>)> = vec![
        // An event id that would become a forged Idempotency-Key header.
        (
            "evid",
            with_origin(victim),
            completion(
                "evid",
                serde_json::json!({"event_id": "evid.0.done\r\nX-Evil: 1"}),
            ),
        ),
        // The origin header names another session than the body.
        (
            "forged",
            with_origin("s.other"),
            completion("forged", serde_json::json!({})),
        ),
        // No origin header at all.
        (
            "noheader",
            HeaderMap::new(),
            completion("noheader", serde_json::json!({})),
        ),
        // Not UTF-8.
        ("utf8", with_origin(victim), b"{\"type\":\"\xff\"}".to_vec()),
        // A wrong type.
        (
            "wrongtype",
            with_origin(victim),
            completion("wrongtype", serde_json::json!({"task_index": "zero"})),
        ),
        // Another kind of event on a completion subject.
        (
            "kind",
            with_origin(victim),
            completion("kind", serde_json::json!({"type": "delegation_started"})),
        ),
        // A later protocol version, which may mean something else by the
        // same fields.
        (
            "later",
            with_origin(victim),
            completion("later", serde_json::json!({"version": 2})),
        ),
        // A task index the delegation does not have.
        (
            "index",
            with_origin(victim),
            completion(
                "index",
                serde_json::json!({"task_index": 2, "task_count": 2}),
            ),
        ),
        // A task count no delegation may have: a batch's wake would size
        // itself by it.
        (
            "count",
            with_origin(victim),
            completion(
                "count",
                serde_json::json!({"task_count": 4_294_967_295_u32}),
            ),
        ),
        // Headers the server acts on, which held for the events stream but
        // would make its dead letter be refused (and the completion come
        // back) forever.
        (
            "expects",
            {
                let mut headers = with_origin("s.other");
                headers.insert(
                    "Nats-Expected-Stream",
                    bus.subjects.events_stream().as_str(),
                );
                headers
            },
            completion("expects", serde_json::json!({})),
        ),
        // So large that its dead letter cannot carry the body.
        (
            "huge",
            with_origin(victim),
            completion(
                "huge",
                serde_json::json!({"status": "bogus", "summary": "y".repeat(max_payload - 400)}),
            ),
        ),
    ];
    for (id, headers, body) in &poison {
        bus.js
            .publish_with_headers(
                format!("{}.evt.{token}.{id}.0.done", bus.subjects.prefix()),
                headers.clone(),
                body.clone().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    Delegator::new(bus.clone())
        .delegate(Delegation::new("after the poison").session(victim))
        .await
        .unwrap();
    wait_until(WAIT, "the real wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "one dead letter per poison completion", || async {
        all_messages(&bus, &dlq).await.len() >= poison.len()
    })
    .await;
    let redelivered = drained(&bus, &bus.subjects.events_stream(), "wake", WAIT).await;
    services.stop().await;

    assert_eq!(
        api.all_posts().len(),
        1,
        "only the real completion is woken"
    );
    assert_eq!(redelivered, 0, "each poison completion is handled once");
    let dead = all_messages(&bus, &dlq).await;
    assert_eq!(dead.len(), poison.len());
    let reasons = dead_letter_reasons(&dead).join("\n");
    for expected in [
        "event_id is not \"evid.0.done\"",
        "does not match",
        "no Wakebus-Origin-Session header",
        "completion is not valid",
        "invalid type: string \"zero\"",
        "type is \"delegation_started\", not \"async_delegation\"",
        "version 2 is not supported",
        "task_index 2 is not below its task_count 2",
        "task_count 4294967295 is above the limit of 1000",
        "left out: too large to store again",
    ] {
        assert!(
            reasons.contains(expected),
            "{expected:?} not in:\n{reasons}"
        );
    }
}

/// async-nats drops the connection whenever it receives a message whose
/// headers are not UTF-8 (nats-server stores them without checking), so no
/// handler ever sees it. After the reconnect the service finds it through the
/// JetStream API, dead-letters and deletes it, and goes on.
#[tokio::test]
async fn a_message_whose_headers_the_client_cannot_read_is_removed_and_the_services_go_on() {
    let p = Pipeline::start().await;
    let (nats, api, bus, services) = (p.nats, p.api, p.bus, p.services);
    let unreadable = b"NATS/1.0\r\nWakebus-Origin-Session: \xff\xfe\r\n\r\n";
    let refused = raw::hpub(
        nats.port,
        &bus.subjects.task("default"),
        unreadable,
        &request_body("rawhdr", "s.raw", "g", ""),
    )
    .await;
    assert_eq!(refused, None, "nats-server stores it without complaint");
    // And a completion the wake service cannot read, so large that its
    // dead letter cannot carry its body as well as the reason.
    let token = session_token("s.raw");
    let max_payload = bus.client.server_info().max_payload;
    let refused = raw::hpub(
        nats.port,
        &format!("{}.evt.{token}.rawdone.0.done", bus.subjects.prefix()),
        unreadable,
        &vec![b'x'; max_payload - unreadable.len() - 100],
    )
    .await;
    assert_eq!(refused, None);
    Delegator::new(bus.clone())
        .delegate(Delegation::new("after").session("s.after"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake of the good request", || async {
        api.accepted().iter().any(|p| p.session() == "s.after")
    })
    .await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "both unreadable messages dead-lettered", || async {
        all_messages(&bus, &dlq).await.len() >= 2
    })
    .await;
    services.stop().await;

    let dead = all_messages(&bus, &dlq).await;
    let subjects: Vec<&str> = dead.iter().map(|m| m.subject.as_str()).collect();
    assert!(
        subjects.contains(&bus.subjects.dead_letter_task("default").as_str()),
        "{subjects:?}"
    );
    assert!(
        subjects.contains(&bus.subjects.dead_letter_wake("poison").as_str()),
        "{subjects:?}"
    );
    for reason in dead_letter_reasons(&dead) {
        assert!(reason.contains("headers are not valid UTF-8"), "{reason}");
    }
    let large = dead
        .iter()
        .find(|m| m.subject.as_str() == bus.subjects.dead_letter_wake("poison"))
        .unwrap();
    assert!(large.payload.is_empty());
    assert!(
        dead_letter_reasons(std::slice::from_ref(large))[0].starts_with("(body of "),
        "{:?}",
        large.headers
    );
    assert!(api.accepted().iter().all(|p| p.session() != "s.raw"));
    assert_eq!(
        stored_messages(&bus, &bus.subjects.tasks_stream()).await,
        0,
        "the unreadable request is gone from the work queue"
    );
}

/// Publishes `count` completions of delegations run synchronously (no
/// session to wake: the wake acks them at once), and waits until they are
/// stored.
async fn publish_sync_completions(bus: &Bus, count: usize) {
    let events = bus.subjects.events_stream();
    let last = || async {
        let mut stream = bus.js.get_stream(&events).await.unwrap();
        stream.info().await.unwrap().state.last_sequence
    };
    let before = last().await;
    for _ in 0..count {
        let id = wakebus::protocol::new_delegation_id();
        let body = serde_json::json!({
            "type": "async_delegation", "delegation_id": id, "status": "completed",
            "completed_at": "2026-01-01T00:00:00Z", "exit_reason": "completed",
        });
        let subject = format!("{}.evt.sync.{id}.0.done", bus.subjects.prefix());
        // Acks awaited below, all at once.
        drop(
            bus.js
                .publish(subject, body.to_string().into())
                .await
                .unwrap(),
        );
    }
    // By sequence, not by count: a sweep may delete a message meanwhile.
    wait_until(WAIT, "the completions stored", || async {
        last().await >= before + count as u64
    })
    .await;
}

/// The sweep for unreadable messages reads a window of the consumer's
/// messages after its ack floor. With the floor held back (here by a
/// session whose completion waits for a lock another instance holds) and
/// more of the consumer's messages between it and the culprit than that
/// window holds, the sweep still finds it, walking back from the last
/// delivered message.
#[tokio::test]
async fn an_unreadable_completion_far_past_a_held_back_ack_floor_is_removed_too() {
    let p = Pipeline::start().await;
    let (nats, api, bus, services) = (p.nats, p.api, p.bus, p.services);
    let (_locks, _guard) = hold_session_elsewhere(&bus, "s.held").await;
    delegate(&bus, Delegation::new("held back").session("s.held")).await;
    completions_waiting_in_wake(&bus, 1).await;
    publish_sync_completions(&bus, 5_000).await;
    let unreadable = b"NATS/1.0\r\nWakebus-Origin-Session: \xff\xfe\r\n\r\n";
    let token = session_token("s.raw");
    let subject = format!("{}.evt.{token}.rawdone.0.done", bus.subjects.prefix());
    let refused = raw::hpub(nats.port, &subject, unreadable, b"{}").await;
    assert_eq!(refused, None);
    delegate(&bus, Delegation::new("after").session("s.after")).await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "the unreadable completion dead-lettered", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    wait_until(WAIT, "the wake of the session after it", || async {
        api.accepted().iter().any(|p| p.session() == "s.after")
    })
    .await;
    services.stop().await;
    let dead = all_messages(&bus, &dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].subject.as_str(),
        bus.subjects.dead_letter_wake("poison")
    );
    assert!(api.accepted().iter().all(|p| p.session() != "s.held"));
}

#[tokio::test]
async fn a_completion_whose_subject_is_not_utf8_is_removed_and_the_wake_goes_on() {
    let p = Pipeline::start().await;
    let (nats, api, bus, services) = (p.nats, p.api, p.bus, p.services);
    let token = session_token("s.rawsubj");
    let mut subject = format!("{}.evt.{token}.", bus.subjects.prefix()).into_bytes();
    subject.extend_from_slice(b"d\xff\xfe.0.done");
    let refused = raw::RawClient::connect(nats.port, None)
        .await
        .pub_bytes(&subject, b"{}")
        .await;
    assert_eq!(refused, None, "nats-server stores it without complaint");
    Delegator::new(bus.clone())
        .delegate(Delegation::new("after").session("s.after"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake after it", || async {
        api.accepted().iter().any(|p| p.session() == "s.after")
    })
    .await;
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "the unreadable completion dead-lettered", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    wake_consumer_settled(&bus).await;
    services.stop().await;

    let dead = all_messages(&bus, &dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].subject.as_str(),
        bus.subjects.dead_letter_wake("poison")
    );
    let reason = &dead_letter_reasons(&dead)[0];
    assert!(reason.contains("subject is not valid UTF-8"), "{reason}");
    // Gone from the events stream: what is left there is every readable event.
    let events = bus.subjects.events_stream();
    let readable = all_messages(&bus, &events).await;
    assert!(
        readable
            .iter()
            .all(|m| !m.subject.contains(char::REPLACEMENT_CHARACTER)),
        "the completion is still in the events stream"
    );
    assert_eq!(stored_messages(&bus, &events).await, readable.len() as u64);
}

/// The sweep reads a consumer's range of unacknowledged stream sequences,
/// which also holds other consumers' messages: a worker of pool `a` must
/// leave alone an unreadable request of pool `b` (whose own workers would
/// remove it, to their own dead letters).
#[tokio::test]
async fn a_sweep_removes_only_unreadable_messages_of_its_own_consumer() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let consumer = bus
        .worker_consumer("a", Duration::from_secs(30))
        .await
        .unwrap();
    let publish = |pool: &str| {
        let body = request_body(&format!("in{pool}"), "s.sweep", "g", "");
        bus.js.publish(bus.subjects.task(pool), body.into())
    };
    publish("a").await.unwrap().await.unwrap();
    let unreadable = b"NATS/1.0\r\nWakebus-Origin-Session: \xff\xfe\r\n\r\n";
    let body = request_body("inb", "s.sweep", "g", "");
    let refused = raw::hpub(nats.port, &bus.subjects.task("b"), unreadable, &body).await;
    assert_eq!(refused, None);
    publish("a").await.unwrap().await.unwrap();
    // Pool a's first request acked, its second delivered and unacked: the
    // sweep's range is pool b's message and pool a's second.
    let mut delivered = two_delivered(&consumer).await;
    let first = delivered.next().await.unwrap().unwrap();
    first.ack().await.unwrap();
    let second = delivered.next().await.unwrap().unwrap();
    assert_eq!(second.info().unwrap().stream_sequence, 3);

    let tasks = bus.subjects.tasks_stream();
    let removed = wakebus::quarantine::sweep(
        &bus,
        &tasks,
        &bus.subjects.worker_consumer("a"),
        &bus.subjects.dead_letter_task("a"),
    )
    .await
    .unwrap();
    assert_eq!(removed, 0);
    let stream = bus.js.get_stream(&tasks).await.unwrap();
    let left = stream
        .get_last_raw_message_by_subject(&bus.subjects.task("b"))
        .await;
    // Still there (async-nats cannot parse what it reads back, hence no Ok).
    assert!(
        left.is_err_and(
            |e| e.kind() != async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
        ),
        "pool b's message was removed"
    );
}

/// A copy of a real task whose origin header contradicts its body is
/// refused, and its `error` completion gets an id of its own: stored under
/// the real task's completion id, it would take the real completion's
/// place (JetStream drops the later one as a duplicate), and the real
/// session would never hear its result.
#[tokio::test]
async fn a_copy_of_a_task_with_a_mismatched_origin_cannot_take_the_real_completions_place() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    let real = request("s.real", "the real work");
    let forged_id = format!("{}.0.forged", real.delegation_id);
    let headers = wakebus::protocol::EventHeaders {
        id: &forged_id,
        ce_type: "io.wakebus.task.requested",
        source: "test",
        origin_session: Some("s.other"),
        delegation_id: &real.delegation_id,
        task_index: 0,
        traceparent: wakebus::protocol::TraceParent::new_root(),
    }
    .to_header_map();
    bus.js
        .publish_with_headers(
            bus.subjects.task("default"),
            headers,
            serde_json::to_vec(&real).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until(WAIT, "the forged copy's error completion", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    let refused = &done_events(&bus).await[0];
    assert_eq!(refused.status, Status::Error);
    assert_ne!(refused.delegation_id, real.delegation_id);

    publish_until_stored(&bus, &real).await;
    wait_until(WAIT, "the real session's wake", || async {
        api.accepted().iter().any(|post| post.session() == "s.real")
    })
    .await;
    services.stop().await;
    let woken = api.accepted();
    assert_eq!(woken.len(), 1, "only the real session is woken");
    assert!(
        woken[0].text().contains("Status: completed"),
        "{}",
        woken[0].text()
    );
}

/// Unusable completions whose dead letters the DLQ does not answer (here:
/// a wake whose user may not publish them, so each waits out the
/// JetStream timeout, as during a DLQ leader election) do not hold up the
/// real wakes that arrive behind them.
#[tokio::test]
async fn unusable_completions_whose_dead_letters_hang_do_not_hold_up_real_wakes() {
    init_logs();
    let prefix = unique_prefix();
    let subjects = wakebus::protocol::Subjects::new(&prefix).unwrap();
    let server =
        common::nats::LimitedUserServer::start(&[subjects.dead_letter_wake("poison")]).await;
    let api = SessionApiServer::start().await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let client = server.limited_config().connect().await.unwrap();
    let wake_bus = Bus::new(client, subjects);
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&wake_bus, test_wake_config(&api.url()));
    let token = session_token("s.behind");
    for i in 0..5 {
        bus.js
            .publish(
                format!("{prefix}.evt.{token}.poison{i}.0.done"),
                "not a completion".into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    Delegator::new(bus.clone())
        .delegate(Delegation::new("behind the poison").session("s.behind"))
        .await
        .unwrap();
    // Well before the five dead letters, one after another, could have
    // timed out (5 s each).
    wait_until(Duration::from_secs(10), "the real wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    services.stop().await;
    assert_eq!(api.accepted().len(), 1);
}

/// A sweep by a user that may not read messages (a least-privileged worker)
/// cannot find an unreadable one itself; its error names the sequences an
/// operator should look at and the commands to do it with.
#[tokio::test]
async fn a_sweep_that_may_not_read_messages_names_the_range_to_inspect() {
    init_logs();
    let prefix = unique_prefix();
    let server =
        common::nats::LimitedUserServer::start(&["$JS.API.STREAM.MSG.GET.>".to_owned()]).await;
    let bus = bus(&server.nats.url(), &prefix).await;
    let consumer = bus
        .worker_consumer("a", Duration::from_secs(30))
        .await
        .unwrap();
    for _ in 0..3 {
        let body = request_body(&unique_prefix(), "s.range", "g", "");
        bus.js
            .publish(bus.subjects.task("a"), body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    // The first acked, the second delivered and left unacknowledged.
    let mut delivered = two_delivered(&consumer).await;
    delivered
        .next()
        .await
        .unwrap()
        .unwrap()
        .ack()
        .await
        .unwrap();
    delivered.next().await.unwrap().unwrap();

    let limited = Bus::new(
        server.limited_config().connect().await.unwrap(),
        wakebus::protocol::Subjects::new(&prefix).unwrap(),
    );
    let tasks = bus.subjects.tasks_stream();
    let error = wakebus::quarantine::sweep(
        &limited,
        &tasks,
        &bus.subjects.worker_consumer("a"),
        &bus.subjects.dead_letter_task("a"),
    )
    .await
    .expect_err("it may not read the messages");
    assert!(
        matches!(
            error,
            wakebus::quarantine::SweepError::Unread { from: 2, to: 3, .. }
        ),
        "{error}"
    );
    let said = error.to_string();
    assert!(
        said.contains(&format!("nats stream rmm {tasks} <SEQ>")),
        "{said}"
    );
}

/// The next two messages of `consumer`, as they come: a batch, not a
/// fetch, which answers at once and may come before the consumer counts a
/// message just stored.
async fn two_delivered(
    consumer: &async_nats::jetstream::consumer::Consumer<
        async_nats::jetstream::consumer::pull::Config,
    >,
) -> async_nats::jetstream::consumer::pull::Batch {
    consumer
        .batch()
        .max_messages(2)
        .expires(WAIT)
        .messages()
        .await
        .unwrap()
}

/// Publishes task `index` of a batch of three of delegation `id` as a
/// publisher in another language would, with `body` as its body.
async fn publish_member(bus: &Bus, session: Option<&str>, id: &str, index: u32, body: Vec<u8>) {
    let mut headers = HeaderMap::new();
    if let Some(session) = session {
        headers.insert("Wakebus-Origin-Session", session);
    }
    headers.insert("Wakebus-Delegation-Id", id);
    headers.insert("Wakebus-Task-Index", index.to_string().as_str());
    headers.insert("Nats-Msg-Id", format!("{id}.{index}").as_str());
    bus.js
        .publish_with_headers(bus.subjects.task("default"), headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

/// Tasks `indexes` of a batch of three of delegation `id`, whose task
/// `unreadable` has a body no worker can read; the others' goals are
/// `<goal> <index>`.
async fn publish_members(
    bus: &Bus,
    session: Option<&str>,
    id: &str,
    unreadable: u32,
    goal: &str,
    indexes: impl IntoIterator<Item = u32>,
) {
    for index in indexes {
        let body = if index == unreadable {
            b"not JSON at all".to_vec()
        } else {
            serde_json::to_vec(&serde_json::json!({
                "version": 1, "delegation_id": id, "goal": format!("{goal} {index}"),
                "task_index": index, "task_count": 3, "wake_mode": "batch",
                "origin_session_id": session,
            }))
            .unwrap()
        };
        publish_member(bus, session, id, index, body).await;
    }
}

/// The texts of every turn posted so far, one after the other.
fn all_texts(api: &SessionApiServer) -> String {
    api.accepted().iter().map(|post| post.text()).collect()
}

/// Waits for the turn of batch `id` of three tasks, `readable` of them
/// readable, and checks that it is the only one of the batch and reports
/// those.
async fn unreadable_batch_woken(api: &SessionApiServer, id: &str, goal: &str, readable: usize) {
    let header = format!("[ASYNC DELEGATION BATCH COMPLETE — {id}]");
    wait_until(WAIT, "the batch's turn", || async {
        all_texts(api).contains(&header)
    })
    .await;
    let all = all_texts(api);
    assert_eq!(all.matches(&header).count(), 1, "{all}");
    let batch = &all[all.find(&header).unwrap()..];
    let counts = format!("{readable} completed, {} not completed", 3 - readable);
    assert!(batch.contains(&counts), "{batch}");
    assert_eq!(
        ["0", "1", "2"]
            .iter()
            .filter(|index| batch.contains(&format!("Goal: {goal} {index}")))
            .count(),
        readable,
        "{batch}"
    );
}

/// A batch member whose body cannot be read gets an `error` completion
/// that cannot name its batch (`task_count: index + 1`). It still ends its
/// task: whether it is stored before the batch's other tasks end (they
/// find it), or after (the wake reads another task's completion and takes
/// it into their batch), and whatever its index, the batch's turn comes
/// once with the other two results; and a sync caller waiting for the
/// batch gets it as that task's result instead of waiting for ever.
#[tokio::test]
async fn a_batch_member_whose_body_cannot_be_read_still_ends_its_batch() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // Tasks whose goal says `first` end once the test opens that gate.
    let gates = tempfile::tempdir().unwrap();
    let mut services = Services::new();
    services.worker(
        &bus,
        shell(&gated_script(gates.path())),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    let stored = |id: String, index: u32| {
        let bus = bus.clone();
        async move {
            done_events(&bus)
                .await
                .iter()
                .any(|done| done.delegation_id == id && done.task_index == index)
        }
    };

    // The unreadable task's error first, its siblings' completions after:
    // it also wakes its session on its own.
    let first = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.first"), &first, 1, "first", 0..3).await;
    let alone = format!("[ASYNC DELEGATION COMPLETE — {first}]\nTask: 1\n");
    wait_until(WAIT, "the unreadable task's own wake", || async {
        all_texts(&api).contains(&alone)
    })
    .await;
    std::fs::write(gates.path().join("first"), "").unwrap();
    unreadable_batch_woken(&api, &first, "first", 2).await;

    // Task 0's error last, once the other two have ended: taken into their
    // batch, it ends it, and is not posted on its own.
    let last = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.last"), &last, 0, "member", 1..3).await;
    wait_until(WAIT, "the other tasks' completions", || async {
        stored(last.clone(), 1).await && stored(last.clone(), 2).await
    })
    .await;
    publish_members(&bus, Some("s.last"), &last, 0, "member", [0]).await;
    unreadable_batch_woken(&api, &last, "member", 2).await;
    wake_consumer_settled(&bus).await;
    assert!(
        !all_texts(&api).contains(&format!("[ASYNC DELEGATION COMPLETE — {last}]")),
        "{}",
        all_texts(&api)
    );
    // Replayed, it is known delivered with its batch's turn; forced, it is
    // left to that turn, which a member of the batch posts again.
    for force in [false, true] {
        let mut args = vec!["replay", "wakes", "--delegation", &last];
        if force {
            args.push("--force");
        }
        let lines = common::cli::wakebus(&nats.url(), bus.subjects.prefix(), &args)
            .await
            .ok_json();
        task_0_skipped(&lines, "reported in its batch's turn");
    }
    let header = format!("[ASYNC DELEGATION BATCH COMPLETE — {last}]");
    wait_until(WAIT, "the batch's turn posted again", || async {
        all_texts(&api).matches(&header).count() == 2
    })
    .await;
    wake_consumer_settled(&bus).await;
    assert!(
        !all_texts(&api).contains(&format!("[ASYNC DELEGATION COMPLETE — {last}]")),
        "the error posted alone: {}",
        all_texts(&api)
    );

    // Two unreadable tasks, the last one's error stored once the readable
    // task has ended: it is taken into the batch by that task's completion,
    // found past the other unreadable one's.
    let two = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.two"), &two, 0, "two", [0, 1]).await;
    wait_until(WAIT, "the readable task's completion", || {
        stored(two.clone(), 1)
    })
    .await;
    publish_members(&bus, Some("s.two"), &two, 2, "two", [2]).await;
    unreadable_batch_woken(&api, &two, "two", 1).await;

    // Garbage stored on the other tasks' subjects after their completions
    // (acked when they came): the completions before it place the error,
    // which was posted alone, and the batch never woken.
    let past = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.past"), &past, 0, "past", 1..3).await;
    wait_until(WAIT, "the other tasks' completions", || async {
        stored(past.clone(), 1).await && stored(past.clone(), 2).await
    })
    .await;
    wake_consumer_settled(&bus).await;
    for index in 1..3 {
        publish_garbled_completion(&bus, "s.past", &past, index).await;
    }
    publish_members(&bus, Some("s.past"), &past, 0, "past", [0]).await;
    unreadable_batch_woken(&api, &past, "past", 2).await;
    wake_consumer_settled(&bus).await;
    assert!(
        !all_texts(&api).contains(&format!("[ASYNC DELEGATION COMPLETE — {past}]")),
        "the error posted alone: {}",
        all_texts(&api)
    );

    // In sync mode: the same batch, waited for under its id (everything
    // has ended, so nothing is sent again).
    let sync = wakebus::protocol::new_delegation_id();
    publish_members(&bus, None, &sync, 1, "member", 0..3).await;
    let mut again = Delegation::batch((0..3).map(|index| format!("member {index}")));
    again.delegation_id = Some(sync.clone());
    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(again)
        .await
        .expect("the batch's results");
    services.stop().await;
    let wakebus::delegate::DelegateResult::Completed {
        status, results, ..
    } = result
    else {
        panic!("not a sync result: {result:?}");
    };
    assert_eq!(status, "partial");
    let statuses: Vec<Status> = results.iter().map(|done| done.status).collect();
    assert_eq!(
        statuses,
        [Status::Completed, Status::Error, Status::Completed]
    );
    assert_eq!(results[1].exit_reason, "invalid_request");
}

/// The error of an unreadable member whose own wake may already have been
/// posted (its ledger entry says `posting`: a wake instance that posted it
/// alone stopped before recording the answer) is posted again under its
/// own key, as a post in doubt is, not taken into its batch, whose turn
/// would report it a second time.
#[tokio::test]
async fn an_unreadable_members_error_whose_own_post_is_in_doubt_is_repeated_under_its_key() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let id = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.doubt"), &id, 1, "member", [0]).await;
    wait_until(WAIT, "task 0's completion", || async {
        done_events(&bus)
            .await
            .iter()
            .any(|done| done.delegation_id == id)
    })
    .await;
    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let key = format!("{id}.1.done");
    let in_doubt = wakebus::wake::ledger::LedgerState::Posting {
        idempotency_key: key.clone(),
    };
    state
        .wake_ledger
        .put(
            &format!("{id}.1"),
            serde_json::to_vec(&in_doubt).unwrap().into(),
        )
        .await
        .unwrap();

    publish_members(&bus, Some("s.doubt"), &id, 1, "member", [1]).await;
    wait_until(WAIT, "the error posted again under its key", || async {
        api.accepted()
            .iter()
            .any(|post| post.header("Idempotency-Key").as_deref() == Some(key.as_str()))
    })
    .await;
    services.stop().await;
}

/// Waits until both readable tasks (1 and 2) of batch `id` have ended and
/// the wake has settled their completions: the batch then waits for task 0
/// alone, whose error, stored after, must be taken into it.
async fn others_ended(bus: &Bus, id: &str) {
    let events = bus.subjects.events_stream();
    let stored = || async {
        all_messages(bus, &events)
            .await
            .into_iter()
            .filter(|m| m.subject.ends_with(".done") && m.subject.contains(id))
            .map(|m| m.sequence)
            .collect::<Vec<u64>>()
    };
    wait_until(WAIT, "tasks 1 and 2's completions", || async {
        stored().await.len() == 2
    })
    .await;
    let last = stored().await.into_iter().max().unwrap_or_default();
    wait_until(WAIT, "the wake to ack both", || async {
        wake_consumer_info(bus)
            .await
            .is_some_and(|info| info.ack_floor.stream_sequence >= last && info.num_ack_pending == 0)
    })
    .await;
}

/// Checks that a replay's `lines` skip task 0 for a reason saying `why`.
fn task_0_skipped(lines: &[serde_json::Value], why: &str) {
    let error = lines
        .iter()
        .find(|item| item["task_index"] == 0)
        .unwrap_or_else(|| panic!("task 0 in {lines:#?}"));
    assert_eq!(error["action"], "skipped", "{lines:#?}");
    assert!(
        error["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains(why)),
        "{lines:#?}"
    );
}

/// Checks that the error of task 0 of batch `id` was not posted on its own.
fn not_posted_alone(api: &SessionApiServer, id: &str) {
    let all = all_texts(api);
    assert!(
        !all.contains(&format!("[ASYNC DELEGATION COMPLETE — {id}]")),
        "the error posted alone: {all}"
    );
}

/// A wake that cannot read the other tasks' completions (a permission
/// missing, a stream between leaders) cannot tell whether an unreadable
/// member's error belongs to a batch: it hands the error back and asks
/// again, rather than post it alone while its batch waits for it; once the
/// reads work, the error ends its batch.
#[tokio::test]
async fn an_unreadable_members_error_is_asked_about_again_while_its_batch_cannot_be_read() {
    init_logs();
    let prefix = unique_prefix();
    let subjects = || wakebus::protocol::Subjects::new(&prefix).unwrap();
    let id = wakebus::protocol::new_delegation_id();
    let events = subjects().events_stream();
    let server =
        common::nats::LimitedUserServer::start(&common::nats::message_reads_of(&events)).await;
    let api = SessionApiServer::start().await;
    let bus = bus(&server.nats.url(), &prefix).await;
    // Tasks 1 and 2 end under a wake of its own connection, closed once
    // it stops, so that no pull request of its outlives it.
    let first = wakebus::bus::Bus::new(
        wakebus::connect::NatsConfig::new(server.nats.url())
            .connect()
            .await
            .unwrap(),
        subjects(),
    );
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&first, test_wake_config(&api.url()));
    publish_members(&bus, Some("s.unread"), &id, 0, "member", 1..3).await;
    others_ended(&bus, &id).await;
    services.stop().await;
    first.client.drain().await.unwrap();

    // Task 0's error reaches a wake that may not read the events stream's
    // messages: it is handed back (a NAK, as the server receives it).
    let mut acks = bus
        .client
        .subscribe(format!("$JS.ACK.{events}.wake.>"))
        .await
        .unwrap();
    bus.client.flush().await.unwrap();
    let limited = Bus::new(server.limited_config().connect().await.unwrap(), subjects());
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&limited, test_wake_config(&api.url()));
    publish_members(&bus, Some("s.unread"), &id, 0, "member", [0]).await;
    tokio::time::timeout(WAIT, async {
        while let Some(ack) = acks.next().await {
            if ack.payload.starts_with(b"-NAK") {
                return;
            }
        }
    })
    .await
    .expect("the error handed back within 30 s");
    services.stop().await;
    assert!(
        api.all_posts().is_empty(),
        "posted while its batch could not be read: {}",
        all_texts(&api)
    );

    // Readable again: it ends its batch.
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    unreadable_batch_woken(&api, &id, "member", 2).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    not_posted_alone(&api, &id);
}

/// An unreadable member's error whose own ledger entry is corrupt (edited
/// by hand) cannot tell whether a post of it alone was made: it is held,
/// not posted past the entry, and once an operator deletes the entry it
/// ends its batch, whose other tasks had ended before it (posted alone
/// then, the batch would never be woken).
#[tokio::test]
async fn an_unreadable_members_error_behind_a_corrupt_entry_of_its_own_ends_its_batch_once_the_entry_is_deleted()
 {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let id = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.corrupt"), &id, 0, "member", 1..3).await;
    others_ended(&bus, &id).await;
    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let key = wakebus::wake::ledger::WakeLedger::key(&id, 0);
    state
        .wake_ledger
        .put(&key, "not ledger json".into())
        .await
        .unwrap();

    publish_members(&bus, Some("s.corrupt"), &id, 0, "member", [0]).await;
    wait_until(WAIT, "the error held and asked about again", || async {
        wake_consumer_info(&bus)
            .await
            .is_some_and(|info| info.num_redelivered > 0)
    })
    .await;
    assert!(
        api.all_posts().is_empty(),
        "posted past a corrupt entry: {}",
        all_texts(&api)
    );
    state.wake_ledger.delete(&key).await.unwrap();
    unreadable_batch_woken(&api, &id, "member", 2).await;
    wake_consumer_settled(&bus).await;
    services.stop().await;
    not_posted_alone(&api, &id);
}

/// The error of an unreadable member, delivered with its batch's turn, is
/// not posted again on its own by a forced copy: one carrying a forced
/// replay header that no replay recorded (a publisher's own, a `replay
/// copy` of a forced copy) makes no second turn, as for any completion; and
/// a forced replay that cannot read the batch's ledger entry, so cannot
/// tell whether the batch's turn reported the error, leaves it for a later
/// run.
#[tokio::test]
async fn an_unreadable_members_error_delivered_with_its_batch_is_not_forced_out_on_its_own() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);
    let id = wakebus::protocol::new_delegation_id();
    publish_members(&bus, Some("s.forced"), &id, 0, "member", 1..3).await;
    others_ended(&bus, &id).await;
    publish_members(&bus, Some("s.forced"), &id, 0, "member", [0]).await;
    unreadable_batch_woken(&api, &id, "member", 2).await;
    wake_consumer_settled(&bus).await;

    let error = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .find(|m| m.subject.ends_with(&format!(".{id}.0.done")))
        .expect("the error completion");
    let mut forced = error.clone();
    let replay = ulid::Ulid::new().to_string();
    forced
        .headers
        .insert("Wakebus-Forced-Replay", replay.as_str());
    publish_copy_again(&bus, &forced, "a-forced-header").await;
    wake_consumer_settled(&bus).await;

    let state = bus
        .provision_wake_state(&wakebus::bus::BusSettings::default())
        .await
        .unwrap();
    let batch = wakebus::wake::ledger::WakeLedger::batch_key(&id);
    state
        .wake_ledger
        .put(&batch, "not ledger json".into())
        .await
        .unwrap();
    let args = [
        "replay",
        "wakes",
        "--delegation",
        &id,
        "--status",
        "error",
        "--force",
    ];
    let run = common::cli::wakebus(&p.nats.url(), &p.prefix, &args).await;
    assert_eq!(run.code(), Some(3), "{}", run.stderr());
    task_0_skipped(
        &run.json_lines(),
        "cannot tell whether it was reported in its batch's turn",
    );
    wake_consumer_settled(&bus).await;
    services.stop().await;
    let keys: Vec<String> = api
        .all_posts()
        .iter()
        .filter_map(|post| post.header("Idempotency-Key"))
        .collect();
    assert_eq!(keys, [format!("{id}.batch")], "{}", all_texts(&api));
}
