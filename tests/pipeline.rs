//! The pipeline end to end: delegate → JetStream → workers → completion → wake → session API.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use futures::StreamExt as _;
use wakebus::delegate::{DelegateResult, Delegation, Delegator, SYNC_NOTE};
use wakebus::protocol::{CompletionEvent, Status, session_token};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn background_delegation_wakes_the_right_session_with_the_exact_headers_and_body() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);

    let session = "sess.42 *> with spaces";
    let result = Delegator::new(bus.clone())
        .delegate(
            Delegation::new("Summarise the logs")
                .session(session)
                .context("last 24h"),
        )
        .await
        .expect("delegate");
    let json = serde_json::to_value(&result).unwrap();
    assert_eq!(json["status"], "dispatched");
    assert_eq!(json["mode"], "background");
    let id = id_of(&result);
    assert_eq!(json["delegation_id"], id.as_str());

    wait_until(WAIT, "one wake", || async { !api.accepted().is_empty() }).await;
    let post = &api.accepted()[0];
    assert_eq!(post.session(), session);
    assert_eq!(
        post.header("authorization").as_deref(),
        Some("Bearer test-key")
    );
    assert_eq!(
        post.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(post.header("idempotency-key"), Some(format!("{id}.0.done")));
    assert!(
        post.header("traceparent")
            .is_some_and(|t| t.starts_with("00-"))
    );
    assert_eq!(post.body["model"], "hermes-agent");
    assert_eq!(post.body["stream"], false);
    assert_eq!(post.body["messages"][0]["role"], "user");
    let text = post.text();
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION COMPLETE — {id}]")),
        "{text}"
    );
    assert!(text.contains("Goal: Summarise the logs"), "{text}");
    assert!(text.contains("Status: completed"), "{text}");
    assert!(text.contains("echo: Summarise the logs"), "{text}");
    services.stop().await;
    assert_eq!(api.all_posts().len(), 1, "exactly one post");
}

#[tokio::test]
async fn wakes_posted_one_after_another_reuse_one_connection_to_the_session_api() {
    // A Hermes answer has a body (the chat completion); a connection whose
    // answer was left unread cannot carry the next post, so every wake would
    // cost a new connection (and a TLS handshake over https).
    let p = Pipeline::start().await;
    p.api.set_answer_size(256 * 1024);
    wake_one_after_another(&p, 5).await;
    assert_eq!(p.api.connections(), 1, "a new connection per wake");
    p.services.stop().await;
}

#[tokio::test]
async fn an_answer_too_large_to_read_costs_its_connection_but_not_its_wake() {
    // Reading an answer stops after 1 MiB: the connection is then closed,
    // and the wake, delivered, is recorded and acked all the same.
    let p = Pipeline::start().await;
    p.api.set_answer_size(2 * 1024 * 1024);
    wake_one_after_another(&p, 3).await;
    assert_eq!(
        p.api.connections(),
        3,
        "a connection reused after a 2 MiB answer"
    );
    let sessions: HashSet<String> = p.api.accepted().iter().map(|t| t.session()).collect();
    assert_eq!(sessions.len(), 3, "each session woken");
    assert_eq!(p.api.accepted().len(), 3, "a session woken twice");
    p.services.stop().await;
}

/// Delegates `count` tasks, each to its own session, one after another:
/// each once the previous one's wake was posted and acked.
async fn wake_one_after_another(p: &Pipeline, count: usize) {
    let delegator = Delegator::new(p.bus.clone());
    for n in 1..=count {
        delegator
            .delegate(Delegation::new("one after another").session(format!("s.next.{n}")))
            .await
            .expect("delegate");
        // Acked once its post returned, which is after its answer was read:
        // only then is the connection free for the next post.
        wait_until(WAIT, "the wake to be acked", || async {
            wake_consumer_info(&p.bus).await.is_some_and(|info| {
                info.delivered.stream_sequence > 0
                    && info.ack_floor.stream_sequence == info.delivered.stream_sequence
                    && p.api.accepted().len() == n
            })
        })
        .await;
    }
}

#[tokio::test]
async fn sync_delegation_returns_the_result_inline_and_posts_nothing() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);

    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(Delegation::new("Add 2 and 2"))
        .await
        .expect("delegate");
    let DelegateResult::Completed {
        status,
        mode,
        note,
        result,
        ..
    } = result
    else {
        panic!("expected an inline result, got {result:?}");
    };
    assert_eq!((status.as_str(), mode), ("completed", "sync"));
    assert_eq!(note, SYNC_NOTE);
    let result = result.expect("a single task's result");
    assert_eq!(result.summary.as_deref(), Some("echo: Add 2 and 2"));
    assert_eq!(result.origin_session_id, None);

    // The wake service has seen (and acked) the completion, and posted nothing.
    wake_consumer_settled(&bus).await;
    services.stop().await;
    assert!(
        api.all_posts().is_empty(),
        "a sync delegation must never wake anyone"
    );
}

#[tokio::test]
async fn two_hundred_delegations_from_twenty_sessions_each_wake_only_their_own_session() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);

    let delegator = Delegator::new(bus.clone());
    let submissions = (0..200).map(|i| {
        let delegator = delegator.clone();
        async move {
            let session = format!("session-{}.x", i % 20);
            let result = delegator
                .delegate(Delegation::new(format!("task {i}")).session(session.clone()))
                .await
                .expect("delegate");
            (session, id_of(&result))
        }
    });
    let submitted = futures::future::join_all(submissions).await;
    let mut expected: HashMap<String, HashSet<String>> = HashMap::new();
    for (session, id) in submitted {
        expected.entry(session).or_default().insert(id);
    }

    let woken = || api.woken_delegations();
    wait_until(WAIT, "200 completions woken", || async { woken() >= 200 }).await;
    services.stop().await;

    let mut seen: HashMap<String, Vec<String>> = HashMap::new();
    for post in api.accepted() {
        seen.entry(post.session())
            .or_default()
            .extend(post.delegation_ids());
    }
    assert_eq!(seen.len(), 20);
    for (session, ids) in &seen {
        let unique: HashSet<String> = ids.iter().cloned().collect();
        assert_eq!(
            unique.len(),
            ids.len(),
            "{session} was woken twice for one delegation"
        );
        assert_eq!(
            &unique, &expected[session],
            "{session} got someone else's completions"
        );
    }
}

#[tokio::test]
async fn two_workers_on_one_pool_share_the_work_and_run_nothing_twice() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    for name in ["worker-a", "worker-b"] {
        let mut config = test_worker_config("default");
        config.instance = name.to_owned();
        config.concurrency = 4;
        let command = CommandConfig::new("sh", vec!["-c".into(), "sleep 0.1; echo done".into()]);
        services.worker(
            &bus,
            Executor::Command(CommandExecutor::new(command)),
            config,
        );
    }
    services.wake(&bus, test_wake_config(&api.url()));

    let delegator = Delegator::new(bus.clone());
    for i in 0..40 {
        delegator
            .delegate(Delegation::new(format!("task {i}")).session(format!("s{}", i % 4)))
            .await
            .expect("delegate");
    }
    let woken = || api.woken_delegations();
    wait_until(WAIT, "40 completions woken", || async { woken() >= 40 }).await;
    services.stop().await;

    let events = all_messages(&bus, &bus.subjects.events_stream()).await;
    let mut runs_by_worker: HashMap<String, usize> = HashMap::new();
    let mut done_per_delegation: HashMap<String, usize> = HashMap::new();
    for event in &events {
        let subject = event.subject.as_str();
        if subject.ends_with(".started") {
            let body: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
            *runs_by_worker
                .entry(body["worker"].as_str().unwrap().to_owned())
                .or_default() += 1;
        } else if subject.ends_with(".done") {
            let done = CompletionEvent::decode(&event.payload).unwrap();
            assert_eq!(done.status, Status::Completed);
            assert_eq!(done.summary.as_deref(), Some("done"));
            *done_per_delegation.entry(done.delegation_id).or_default() += 1;
        }
    }
    assert_eq!(
        runs_by_worker.values().sum::<usize>(),
        40,
        "every task started exactly once"
    );
    assert!(
        runs_by_worker["worker-a"] > 0 && runs_by_worker["worker-b"] > 0,
        "{runs_by_worker:?}"
    );
    assert_eq!(done_per_delegation.len(), 40);
    assert!(done_per_delegation.values().all(|&n| n == 1));
}

#[tokio::test]
async fn invalid_requests_end_in_error_completions_and_the_worker_goes_on() {
    let p = Pipeline::start().await;
    let (api, bus, services) = (p.api, p.bus, p.services);

    let subject = bus.subjects.task("default");
    // Not JSON at all, with the origin session only in the header.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", "victim.session");
    headers.insert("Wakebus-Delegation-Id", "broken-1");
    bus.js
        .publish_with_headers(subject.clone(), headers, "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // Valid JSON without a goal.
    let no_goal = r#"{"version":1,"delegation_id":"nogoal-1","origin_session_id":"other.session"}"#;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Wakebus-Origin-Session", "other.session");
    bus.js
        .publish_with_headers(subject.clone(), headers, no_goal.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // And a good one after them.
    Delegator::new(bus.clone())
        .delegate(Delegation::new("still works").session("good.session"))
        .await
        .unwrap();

    wait_until(WAIT, "three wakes", || async { api.accepted().len() >= 3 }).await;
    services.stop().await;
    let by_session: HashMap<String, String> = api
        .accepted()
        .iter()
        .map(|p| (p.session(), p.text()))
        .collect();
    let broken = &by_session["victim.session"];
    assert!(
        broken.contains("[ASYNC DELEGATION COMPLETE — broken-1]"),
        "{broken}"
    );
    assert!(broken.contains("Status: error"), "{broken}");
    assert!(broken.contains("not a valid task request"), "{broken}");
    let no_goal = &by_session["other.session"];
    assert!(no_goal.contains("missing field `goal`"), "{no_goal}");
    assert!(by_session["good.session"].contains("Status: completed"));

    // Both bad requests are in the dead-letter stream with their reason.
    let dead = all_messages(&bus, &bus.subjects.dead_letter_stream()).await;
    assert_eq!(dead.len(), 2);
    for message in dead {
        let reason = message.headers.get("Wakebus-Dead-Letter-Reason").unwrap();
        assert!(!reason.as_str().is_empty());
    }
}

#[tokio::test]
async fn wake_arrives_once_the_session_api_is_back() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(503);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    let result = Delegator::new(bus.clone())
        .delegate(Delegation::new("patience").session("s.down"))
        .await
        .unwrap();
    wait_until(WAIT, "several refused attempts", || async {
        api.all_posts().len() >= 3
    })
    .await;
    assert!(api.accepted().is_empty());
    api.recover();
    wait_until(WAIT, "the wake after recovery", || async {
        !api.accepted().is_empty()
    })
    .await;
    services.stop().await;
    let accepted = api.accepted();
    assert_eq!(accepted.len(), 1);
    assert_eq!(accepted[0].delegation_ids(), vec![id_of(&result)]);
    assert_eq!(accepted[0].session(), "s.down");
}

#[tokio::test]
async fn a_session_api_that_refuses_with_4xx_gets_the_wake_dead_lettered_not_retried_forever() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(404);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    Delegator::new(bus.clone())
        .delegate(Delegation::new("nobody home").session("gone.session"))
        .await
        .unwrap();
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "a wake dead letter", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    services.stop().await;
    let dead = all_messages(&bus, &dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].subject.as_str(),
        bus.subjects
            .dead_letter_wake(&session_token("gone.session"))
    );
    let reason = dead[0]
        .headers
        .get("Wakebus-Dead-Letter-Reason")
        .unwrap()
        .to_string();
    assert!(reason.contains("404"), "{reason}");
    assert_eq!(api.all_posts().len(), 1, "a 404 is not retried");
}

/// An API that enforces `Idempotency-Key` answers 409 while a post under
/// the same key is still in progress (one whose answer was lost, or a dead
/// instance's): the wake tries again for `--conflict-patience`, and takes
/// only a conflict that lasts longer for a refusal.
#[tokio::test]
async fn a_409_conflict_is_retried_for_the_conflict_patience_before_the_wake_is_dead_lettered() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    let dlq = bus.subjects.dead_letter_stream();

    // In progress for two posts, then the API's stored answer.
    api.fail_next(2, 409);
    Delegator::new(bus.clone())
        .delegate(Delegation::new("settles").session("s.settles"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake delivered", || async {
        api.accepted().len() == 1
    })
    .await;
    assert_eq!(api.all_posts().len(), 3);
    assert!(all_messages(&bus, &dlq).await.is_empty());

    // A conflict that lasts, each answer asking for an hour's wait: the
    // wait is cut to the patience left, not taken whole.
    api.fail_always(409);
    api.set_retry_after(3600);
    Delegator::new(bus.clone())
        .delegate(Delegation::new("conflicts").session("s.conflicts"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake dead-lettered", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    services.stop().await;
    let conflicted: Vec<_> = api
        .all_posts()
        .into_iter()
        .filter(|post| post.session() == "s.conflicts")
        .collect();
    // Retried for the conflict patience (10 s in tests) from the first.
    let retried_for = conflicted.last().unwrap().at - conflicted[0].at;
    assert!(retried_for >= Duration::from_secs(9), "{retried_for:?}");
    let reason = all_messages(&bus, &dlq).await[0]
        .headers
        .get("Wakebus-Dead-Letter-Reason")
        .unwrap()
        .to_string();
    assert!(reason.contains("replay without --force"), "{reason}");
    // Which a forced replay, run for every refused wake after a fix of
    // the API, leaves alone: the turn may have been delivered.
    let forced = common::cli::wakebus(
        &nats.url(),
        bus.subjects.prefix(),
        &["replay", "wakes", "--dead-letters", "--force", "--json"],
    )
    .await
    .ok_json();
    assert_eq!(forced[0]["action"], "skipped", "{forced:#?}");
    let said = forced[0]["reason"].as_str().unwrap();
    assert!(said.contains("without --force"), "{said}");
}

/// An agent's turn often outlasts `--request-timeout`: the wake gives its
/// post up and sends it again under the same key, and an API honouring the
/// key answers 409 until the turn it is running ends, then the stored
/// answer. The wake waits that out (`--conflict-patience`) instead of
/// dead-lettering a turn the API then delivers, which a forced replay
/// would have made a second turn.
#[tokio::test]
async fn a_turn_slower_than_the_request_timeout_is_delivered_once_by_an_api_honouring_its_key() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.honour_keys(Duration::from_secs(6));
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    let mut config = test_wake_config(&api.url());
    config.api.request_timeout = Duration::from_secs(1);
    config.conflict_patience = Duration::from_secs(60);
    services.wake(&bus, config);
    let delegation = Delegator::new(bus.clone())
        .delegate(Delegation::new("a long turn").session("s.long-turn"))
        .await
        .unwrap();
    wait_until(WAIT, "the first post", || async {
        !api.all_posts().is_empty()
    })
    .await;
    ledger_records_delivery(&bus, delegation.delegation_id()).await;
    services.stop().await;
    let posts = api.all_posts();
    assert!(api.conflicts() > 0, "the turn outlasted a post: {posts:?}");
    let keys: HashSet<_> = posts
        .iter()
        .map(|post| post.header("idempotency-key"))
        .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(api.turns().len(), 1);
    let dlq = bus.subjects.dead_letter_stream();
    assert!(all_messages(&bus, &dlq).await.is_empty(), "dead-lettered");
}

/// The patience for 409s counts conflicts in a row: a 409 after a longer
/// stretch of other failures (the API down, then back with the post sent
/// just before still in progress) is retried like a first one, not taken
/// for a conflict that lasted.
#[tokio::test]
async fn a_409_after_an_outage_longer_than_its_patience_is_retried_like_a_first_one() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));
    api.fail_always(409);
    Delegator::new(bus.clone())
        .delegate(Delegation::new("conflict, outage, conflict").session("s.outage"))
        .await
        .unwrap();
    wait_until(WAIT, "the first 409", || async {
        !api.all_posts().is_empty()
    })
    .await;
    api.fail_always(503);
    // Past the conflict patience (10 s in tests) since the first 409.
    wait_until(WAIT, "503s for longer than the 409 patience", || async {
        let posts = api.all_posts();
        posts.last().unwrap().at - posts[0].at > Duration::from_millis(10_500)
    })
    .await;
    // One more conflict, then the API's stored answer.
    api.fail_next(1, 409);
    api.fail_always(0);
    wait_until(WAIT, "the wake delivered", || async {
        api.accepted().len() == 1
    })
    .await;
    services.stop().await;
    let dlq = bus.subjects.dead_letter_stream();
    assert!(all_messages(&bus, &dlq).await.is_empty(), "dead-lettered");
}

/// A refused wake whose dead letter cannot be stored yet (here: the
/// dead-letter stream is full and refuses writes) is kept until it can be,
/// and never posted again meanwhile: the refusal was the API's answer.
#[tokio::test]
async fn a_refused_wake_is_not_posted_again_while_its_dead_letter_is_refused() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    api.fail_always(422);
    let bus = bus(&nats.url(), &unique_prefix()).await;
    // A dead-letter stream holding one message and taking no more.
    let dlq = bus.subjects.dead_letter_stream();
    let dlq_subject = bus.subjects.dead_letter_wake("filler");
    bus.js
        .publish(dlq_subject, "filler".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut stream = bus.js.get_stream(&dlq).await.unwrap();
    let open = stream.info().await.unwrap().config.clone();
    let mut full = open.clone();
    full.max_messages = 1;
    full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    bus.js.update_stream(&full).await.unwrap();
    // Every dead-letter attempt, stored or not.
    let mut attempts = bus
        .client
        .subscribe(format!("{}.dlq.wake.>", bus.subjects.prefix()))
        .await
        .unwrap();
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, test_wake_config(&api.url()));

    Delegator::new(bus.clone())
        .delegate(Delegation::new("refused").session("s.refused"))
        .await
        .unwrap();
    for attempt in 1..=3 {
        let message = tokio::time::timeout(WAIT, attempts.next())
            .await
            .unwrap_or_else(|_| panic!("dead-letter attempt {attempt}"))
            .unwrap();
        assert!(message.subject.ends_with(&session_token("s.refused")));
    }
    assert_eq!(
        api.all_posts().len(),
        1,
        "the refused wake was posted again"
    );

    // Room again: the dead letter is stored and the completion settled.
    bus.js.update_stream(&open).await.unwrap();
    wait_until(WAIT, "the wake's dead letter", || async {
        all_messages(&bus, &dlq).await.len() == 2
    })
    .await;
    wait_until(WAIT, "the completion acked", || async {
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = bus
            .js
            .get_consumer_from_stream(bus.subjects.wake_consumer(), bus.subjects.events_stream())
            .await
            .unwrap();
        let info = consumer.info().await.unwrap();
        info.num_ack_pending == 0 && info.num_pending == 0
    })
    .await;
    services.stop().await;
    assert_eq!(
        api.all_posts().len(),
        1,
        "the refused wake was posted again"
    );
}

#[tokio::test]
async fn dev_demo_runs_the_whole_loop_on_a_running_server_and_exits_zero() {
    init_logs();
    let nats = NatsServer::start().await;
    // `dev` uses the server that answers at --nats-url; the demo exits
    // non-zero unless every demo delegation's wake arrives. Its endpoint
    // bound to every address, its wake posts to it on loopback (plain http
    // to `0.0.0.0` would be refused).
    let run = common::cli::wakebus(
        &nats.url(),
        &unique_prefix(),
        &["dev", "--demo", "--session-addr", "0.0.0.0:0"],
    )
    .await;
    assert!(
        run.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        run.code(),
        run.stdout(),
        run.stderr()
    );
    let stdout = run.stdout();
    assert_eq!(stdout.matches("delegate (session").count(), 3, "{stdout}");
    assert!(stdout.contains("delegate (no session)"), "{stdout}");
}

/// On a server it did not start, dev would join a deployment running
/// under its prefix: its echo worker would take that deployment's tasks,
/// and its wake would answer its sessions' wakes into dev's own endpoint.
#[tokio::test]
async fn dev_refuses_a_prefix_whose_services_run_on_the_server_it_found() {
    init_logs();
    let nats = NatsServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    wait_until(WAIT, "the worker to answer discovery", || async {
        let options = wakebus::status::StatusOptions::default();
        wakebus::status::collect(&bus, &options)
            .await
            .is_ok_and(|report| report.services.iter().any(|s| s.snapshot.kind == "worker"))
    })
    .await;
    let run = common::cli::wakebus(
        &nats.url(),
        &prefix,
        &["dev", "--demo", "--session-addr", "127.0.0.1:0"],
    )
    .await;
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("instance(s) of prefix") && stderr.contains("--prefix wakebus-dev"),
        "{stderr}"
    );
    assert!(
        !run.stdout().contains("delegate (session"),
        "{}",
        run.stdout()
    );
    services.stop().await;
}

#[tokio::test]
async fn dev_demo_starts_a_server_of_its_own_when_none_answers_and_stops_it_quietly() {
    init_logs();
    let port = common::nats::free_port();
    let data = tempfile::tempdir().unwrap();
    let server = common::nats::server_binary();
    let run = common::cli::wakebus(
        &format!("nats://127.0.0.1:{port}"),
        "wakebus",
        &[
            "dev",
            "--demo",
            "--session-addr",
            "127.0.0.1:0",
            "--nats-server",
            server.to_str().unwrap(),
            "--nats-conf",
            concat!(env!("CARGO_MANIFEST_DIR"), "/nats.conf"),
            "--data-dir",
            data.path().to_str().unwrap(),
        ],
    )
    .await;
    let stderr = run.stderr();
    assert!(
        run.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{stderr}",
        run.code(),
        run.stdout(),
    );
    assert!(
        stderr.contains("No NATS server answers; starting one."),
        "{stderr}"
    );
    // Its connection is closed before its server is stopped, so nothing
    // reports a lost connection at the end.
    assert!(!stderr.contains("Disconnected from NATS"), "{stderr}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "its server still runs"
    );
}

/// `wakebus dev` starting a nats-server of its own, as a terminal's
/// foreground job, once its worker and wake service have started; and the
/// server's pid.
async fn dev_with_a_server_of_its_own(
    logs: &tempfile::TempDir,
    data: &tempfile::TempDir,
) -> (common::process::Service, u32) {
    let port = common::nats::free_port();
    let mut args = common::process::base_args(&format!("nats://127.0.0.1:{port}"), "wakebus");
    for arg in [
        "dev",
        "--session-addr",
        "127.0.0.1:0",
        "--nats-server",
        common::nats::server_binary().to_str().unwrap(),
        "--nats-conf",
        concat!(env!("CARGO_MANIFEST_DIR"), "/nats.conf"),
        "--data-dir",
        data.path().to_str().unwrap(),
    ] {
        args.push(arg.to_owned());
    }
    let dev = common::process::Service::spawn_as_terminal_job(args, logs.path().join("dev.log"));
    wait_until(WAIT, "the worker and the wake service to start", || async {
        std::fs::read_to_string(&dev.log).is_ok_and(|log| {
            log.contains("Worker started.") && log.contains("Wake service started.")
        })
    })
    .await;
    let children = dev.children();
    assert_eq!(
        children.len(),
        1,
        "dev started one nats-server: {children:?}"
    );
    (dev, children[0])
}

/// Whether a process with this pid exists (a zombie counts: not reaped).
fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test]
async fn ctrl_c_stops_devs_services_before_the_nats_server_it_started() {
    init_logs();
    let (logs, data) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut dev, server) = dev_with_a_server_of_its_own(&logs, &data).await;
    // A terminal sends Ctrl-C to every process of its foreground job.
    dev.signal_group(nix::sys::signal::Signal::SIGINT);
    let status = dev.wait_exit(WAIT, "after Ctrl-C").await;
    let log = std::fs::read_to_string(&dev.log).unwrap();
    assert!(status.success(), "exit {status}\n{log}");
    // (2.9 does not log the signals it traps; 2.15 does.)
    assert!(
        !log.contains("Trapped \"interrupt\" signal"),
        "the Ctrl-C reached the server:\n{log}"
    );
    let (Some(wake_stopped), Some(worker_stopped), Some(server_stopped)) = (
        log.find("Wake service stopped."),
        log.find("Worker stopped."),
        log.find("Server Exiting.."),
    ) else {
        panic!("a service or the server did not stop gracefully:\n{log}");
    };
    assert!(
        wake_stopped < server_stopped && worker_stopped < server_stopped,
        "the server stopped before the services:\n{log}"
    );
    assert!(!log.contains("Disconnected from NATS"), "{log}");
    assert!(!process_exists(server), "its server still runs");
}

#[tokio::test]
async fn dev_stops_with_an_error_when_the_nats_server_it_started_dies() {
    init_logs();
    let (logs, data) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut dev, server) = dev_with_a_server_of_its_own(&logs, &data).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let status = dev.wait_exit(WAIT, "after its server died").await;
    let log = std::fs::read_to_string(&dev.log).unwrap();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("error: the nats-server that dev mode started exited (signal: 9"),
        "{log}"
    );
    assert!(!process_exists(server), "its server was not reaped");
}

/// The kinds of `delegation_id`'s stored events, in stream order, with the
/// messages.
async fn history_of(
    bus: &wakebus::bus::Bus,
    delegation_id: &str,
) -> Vec<(String, async_nats::jetstream::message::StreamMessage)> {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .filter(|m| m.subject.contains(&format!(".{delegation_id}.")))
        .map(|m| (m.subject.rsplit('.').next().unwrap().to_owned(), m))
        .collect()
}

#[tokio::test]
async fn a_task_quicker_than_started_after_writes_no_started_event_and_a_slower_one_writes_it_late()
{
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    // The slow task runs until the test has seen its `started` event.
    let gates = tempfile::tempdir().unwrap();
    let gate = gates.path().join("slow");
    let script = format!(
        r#"read -r request
case "$request" in
  *slow*) while [ ! -e '{}' ]; do sleep 0.05; done ;;
  *chatty*) echo '{{"progress": "at once"}}' ;;
esac
echo finished"#,
        gate.display()
    );
    let executor = Executor::Command(CommandExecutor::new(CommandConfig::new(
        "sh",
        vec!["-c".to_owned(), script],
    )));
    let mut config = test_worker_config("default");
    // Long enough for a quick task to end well before it on a busy machine.
    let started_after = Duration::from_secs(3);
    config.started_after = started_after;
    services.worker(&bus, executor, config);
    services.wake(&bus, test_wake_config(&api.url()));

    let delegator = Delegator::new(bus.clone());
    let mut ids = Vec::new();
    for goal in ["quick", "slow", "chatty"] {
        let result = delegator
            .delegate(Delegation::new(goal).session(format!("s.{goal}")))
            .await
            .unwrap();
        ids.push(id_of(&result));
    }
    wait_until(WAIT, "the slow task's started event", || async {
        history_of(&bus, &ids[1])
            .await
            .iter()
            .any(|(kind, _)| kind == "started")
    })
    .await;
    std::fs::write(&gate, "").unwrap();
    wait_until(WAIT, "all three delegations woken", || async {
        api.accepted().len() == 3
    })
    .await;
    let kinds = |history: &[(String, async_nats::jetstream::message::StreamMessage)]| {
        history
            .iter()
            .map(|(kind, _)| kind.clone())
            .collect::<Vec<_>>()
    };

    let quick = history_of(&bus, &ids[0]).await;
    assert_eq!(kinds(&quick), ["submitted", "done"]);
    assert!(
        quick[1]
            .1
            .headers
            .get("ce-source")
            .is_some_and(|s| s.as_str().starts_with("wakebus/worker/")),
        "the completion names the worker that ran the task"
    );

    // Written by the timer alone (the task reports no progress),
    // `started_after` into the run, with the time the run began.
    let slow = history_of(&bus, &ids[1]).await;
    assert_eq!(kinds(&slow), ["submitted", "started", "done"]);
    let started: wakebus::protocol::StartedEvent =
        serde_json::from_slice(&slow[1].1.payload).unwrap();
    let written_after = slow[1].1.time - started.started_at;
    assert!(
        written_after >= started_after,
        "started written {written_after} into the run"
    );

    // A progress report before `started_after` brings `started` forward:
    // a history never shows progress without a start.
    let chatty = history_of(&bus, &ids[2]).await;
    assert_eq!(kinds(&chatty), ["submitted", "started", "progress", "done"]);
    services.stop().await;
}
