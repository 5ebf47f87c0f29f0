//! Executors against real counterparts: an OpenAI-compatible model server on
//! 127.0.0.1:0 for `llm`, and a Hermes stand-in behind `command`.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use common::*;
use serde_json::{Value, json};
use wakebus::cancel::Canceller;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::protocol::{CompletionEvent, Status};
use wakebus::worker::WorkerConfig;
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor, LlmConfig, LlmExecutor};

const WAIT: Duration = Duration::from_secs(30);

/// What the model server answers next.
#[derive(Clone)]
enum Reply {
    /// 200 with this content and usage.
    Answer(&'static str),
    /// This status.
    Status(u16),
    /// Never answers (until the client gives up).
    Hang,
    /// 200 with an answer that never ends.
    Endless,
    /// This redirect status, back to the chat-completions path.
    Redirect(u16),
    /// 429 asking to be called again after this many seconds.
    Throttled(u64),
    /// 200 with no content: the model declined, with this refusal.
    Declined(&'static str),
    /// 200 with this content, cut at the token limit.
    CutOff(&'static str),
    /// 200 with this content, after this long.
    Slowly(Duration, &'static str),
}

#[derive(Default)]
struct ModelState {
    replies: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<(HeaderMap, Value)>>,
    /// When each request arrived.
    arrivals: Mutex<Vec<std::time::Instant>>,
    /// Hanging calls whose client went away (their handler was dropped).
    abandoned: std::sync::atomic::AtomicUsize,
}

/// Counts a hanging call as abandoned when its handler is dropped: hyper
/// drops it when the client closes the connection.
struct CountWhenDropped(Arc<ModelState>);

impl Drop for CountWhenDropped {
    fn drop(&mut self) {
        self.0
            .abandoned
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A chat-completions server answering from a script of replies.
struct ModelServer {
    url: String,
    state: Arc<ModelState>,
}

impl ModelServer {
    async fn start(replies: Vec<Reply>) -> Self {
        let state = Arc::new(ModelState::default());
        state.replies.lock().unwrap().extend(replies);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let app = Router::new()
            .route("/v1/chat/completions", post(answer))
            .with_state(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, state }
    }

    fn requests(&self) -> Vec<(HeaderMap, Value)> {
        self.state.requests.lock().unwrap().clone()
    }

    fn arrivals(&self) -> Vec<std::time::Instant> {
        self.state.arrivals.lock().unwrap().clone()
    }

    /// How many hanging calls the client gave up on.
    fn abandoned(&self) -> usize {
        self.state
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn executor(&self) -> Executor {
        Executor::Llm(
            LlmExecutor::new(&LlmConfig {
                base_url: self.url.clone(),
                model: "test-model".into(),
                api_key: Some("sk-test".into()),
                request_timeout: Duration::from_secs(60),
            })
            .unwrap(),
        )
    }
}

async fn answer(
    State(state): State<Arc<ModelState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    state.requests.lock().unwrap().push((headers, body));
    state
        .arrivals
        .lock()
        .unwrap()
        .push(std::time::Instant::now());
    let reply = state
        .replies
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or(Reply::Status(500));
    let completion = |message: Value, finish_reason: &str| {
        Json(json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
        }))
        .into_response()
    };
    match reply {
        Reply::Slowly(after, content) => {
            tokio::time::sleep(after).await;
            completion(json!({"role": "assistant", "content": content}), "stop")
        }
        Reply::Answer(content) => {
            completion(json!({"role": "assistant", "content": content}), "stop")
        }
        Reply::CutOff(content) => {
            completion(json!({"role": "assistant", "content": content}), "length")
        }
        Reply::Declined(refusal) => completion(
            json!({"role": "assistant", "content": null, "refusal": refusal}),
            "stop",
        ),
        Reply::Throttled(seconds) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", seconds.to_string())],
            "slow down",
        )
            .into_response(),
        Reply::Status(code) => {
            (StatusCode::from_u16(code).unwrap(), "model says no").into_response()
        }
        Reply::Redirect(code) => (
            StatusCode::from_u16(code).unwrap(),
            [("location", "/v1/chat/completions")],
        )
            .into_response(),
        Reply::Endless => {
            let endless = futures::stream::repeat_with(|| {
                Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(&[b' '; 65536]))
            });
            (StatusCode::OK, axum::body::Body::from_stream(endless)).into_response()
        }
        Reply::Hang => {
            let _abandoned = CountWhenDropped(state.clone());
            tokio::time::sleep(Duration::from_secs(3600)).await;
            StatusCode::OK.into_response()
        }
    }
}

async fn run_one(
    executor: Executor,
    delegation: Delegation,
) -> (CompletionEvent, wakebus::bus::Bus, NatsServer) {
    run_one_with(executor, test_worker_config("default"), delegation).await
}

/// [`run_one`] with a worker set up as `config` says.
async fn run_one_with(
    executor: Executor,
    config: WorkerConfig,
    delegation: Delegation,
) -> (CompletionEvent, wakebus::bus::Bus, NatsServer) {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(&bus, executor, config);
    let result = Delegator::new(bus.clone())
        .with_wait_timeout(Some(WAIT))
        .delegate(delegation)
        .await
        .unwrap();
    services.stop().await;
    let json = serde_json::to_value(&result).unwrap();
    (
        serde_json::from_value(json["result"].clone()).unwrap(),
        bus,
        nats,
    )
}

/// An endpoint that cannot be reached fails the task with a reason that
/// does not name its URL: the reason goes into the completion, the
/// session's turn and the history, and a URL may carry credentials.
#[tokio::test]
async fn an_unreachable_llm_endpoint_is_reported_without_its_url() {
    init_logs();
    // Port 1: nothing listens there (a port taken and let go could be
    // another test's server by the time it is called).
    let executor = Executor::Llm(
        LlmExecutor::new(&LlmConfig {
            base_url: "http://127.0.0.1:1/v1".to_owned(),
            model: "test-model".into(),
            api_key: None,
            request_timeout: Duration::from_secs(2),
        })
        .unwrap(),
    );
    let (done, _bus, _nats) = run_one(executor, Delegation::new("unreachable")).await;
    let error = done.error.unwrap_or_default();
    assert!(error.contains("LLM endpoint unreachable"), "{error}");
    assert!(!error.contains("127.0.0.1"), "{error}");
}

#[tokio::test]
async fn the_llm_executor_answers_with_the_models_reply_and_counts_calls_and_tokens() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Answer("The answer is 4.")]).await;
    let (done, _bus, _nats) = run_one(
        model.executor(),
        Delegation::new("What is 2+2?").context("arithmetic"),
    )
    .await;
    assert_eq!(done.status, Status::Completed);
    assert_eq!(done.summary.as_deref(), Some("The answer is 4."));
    assert_eq!(done.api_calls, 1);
    assert_eq!(
        (done.prompt_tokens, done.completion_tokens),
        (Some(12), Some(3))
    );
    let (headers, body) = &model.requests()[0];
    assert_eq!(headers["authorization"], "Bearer sk-test");
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["messages"][0]["role"], "system");
    let user = body["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.contains("What is 2+2?") && user.contains("arithmetic"),
        "{user}"
    );
}

#[tokio::test]
async fn an_answer_that_misses_the_output_schema_gets_one_correction_attempt() {
    init_logs();
    let model = ModelServer::start(vec![
        Reply::Answer("four"),
        Reply::Answer(r#"{"answer": 4}"#),
    ])
    .await;
    let mut delegation = Delegation::new("What is 2+2?");
    delegation.output_schema = Some(json!({
        "type": "object",
        "required": ["answer"],
        "properties": {"answer": {"type": "integer"}}
    }));
    let (done, _bus, _nats) = run_one(model.executor(), delegation).await;
    assert_eq!(done.status, Status::Completed);
    assert_eq!(done.summary.as_deref(), Some(r#"{"answer": 4}"#));
    assert_eq!(done.api_calls, 2);
    assert_eq!(done.prompt_tokens, Some(24));
    let correction = model.requests()[1].1["messages"][3]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        correction.contains("does not match the required JSON Schema"),
        "{correction}"
    );
}

#[tokio::test]
async fn an_answer_that_misses_the_schema_twice_fails_with_the_reason() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Answer("four"), Reply::Answer("still four")]).await;
    let mut delegation = Delegation::new("What is 2+2?");
    delegation.output_schema = Some(json!({"type": "object"}));
    let (done, _bus, _nats) = run_one(model.executor(), delegation).await;
    assert_eq!(done.status, Status::Failed);
    assert_eq!(done.exit_reason, "schema_mismatch");
    assert!(done.error.unwrap().contains("not JSON"));
}

/// The first answer is work the task paid for: a correction call that
/// fails, whether refused (a longer prompt over the context limit) or
/// transiently, ends the task with it, not with a retry that pays for it
/// again or a failure that drops it.
#[tokio::test]
async fn a_failed_correction_call_ends_the_task_with_the_first_answer() {
    init_logs();
    for failure in [400, 503] {
        let model = ModelServer::start(vec![Reply::Answer("four"), Reply::Status(failure)]).await;
        let mut delegation = Delegation::new("What is 2+2?");
        delegation.output_schema = Some(json!({"type": "object"}));
        let (done, _bus, _nats) = run_one(model.executor(), delegation).await;
        assert_eq!(
            (done.status, done.exit_reason.as_str()),
            (Status::Failed, "schema_mismatch"),
            "{failure}: {done:?}"
        );
        assert_eq!(done.summary.as_deref(), Some("four"), "{failure}");
        let error = done.error.unwrap();
        assert!(
            error.contains("not JSON")
                && error.contains("correction call failed")
                && error.contains(&failure.to_string()),
            "{failure}: {error}"
        );
        assert_eq!(done.api_calls, 2, "{failure}");
        assert_eq!(model.requests().len(), 2, "{failure}: no retry");
    }
}

/// A key refused on the correction call (revoked between the two calls)
/// is the worker's failure, as on the first call: the task goes back for a
/// worker whose key works, rather than ending `schema_mismatch` on a
/// failure that is not the task's.
#[tokio::test]
async fn a_key_refused_on_the_correction_call_sends_the_task_back() {
    init_logs();
    let model = ModelServer::start(vec![
        Reply::Answer("four"),
        Reply::Status(401),
        Reply::Answer(r#"{"answer": 4}"#),
    ])
    .await;
    let mut config = test_worker_config("default");
    config.refused_pause = Duration::from_millis(100);
    let mut delegation = Delegation::new("What is 2+2?");
    delegation.output_schema = Some(json!({"type": "object"}));
    let (done, _bus, _nats) = run_one_with(model.executor(), config, delegation).await;
    assert_eq!(
        (done.status, done.summary.as_deref()),
        (Status::Completed, Some(r#"{"answer": 4}"#)),
        "{done:?}"
    );
    assert_eq!(model.requests().len(), 3);
}

/// A rate-limited endpoint says when to call again: the retry waits that
/// long, instead of using up the task's deliveries within seconds.
#[tokio::test]
async fn a_throttled_model_call_is_retried_no_sooner_than_its_retry_after() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Throttled(3), Reply::Answer("in time")]).await;
    let (done, _bus, _nats) = run_one(model.executor(), Delegation::new("busy")).await;
    assert_eq!(done.summary.as_deref(), Some("in time"), "{done:?}");
    let arrivals = model.arrivals();
    assert_eq!(arrivals.len(), 2);
    let waited = arrivals[1] - arrivals[0];
    assert!(waited >= Duration::from_secs(3), "retried after {waited:?}");
}

/// A model that declines (no content, a refusal) did not complete the
/// task; one cut at its token limit did, with its answer flagged.
#[tokio::test]
async fn a_declined_answer_fails_the_task_and_a_cut_off_one_is_flagged_truncated() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Declined("I can't help with that.")]).await;
    let (done, _bus, _nats) = run_one(model.executor(), Delegation::new("refuse")).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "llm_no_answer"),
        "{done:?}"
    );
    assert!(
        done.error
            .as_deref()
            .is_some_and(|e| e.contains("I can't help with that.")),
        "{done:?}"
    );

    // With an output schema too: there is nothing to correct.
    let model = ModelServer::start(vec![Reply::Declined("No.")]).await;
    let mut delegation = Delegation::new("refuse in JSON");
    delegation.output_schema = Some(json!({"type": "object"}));
    let (done, _bus, _nats) = run_one(model.executor(), delegation).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str(), done.api_calls),
        (Status::Failed, "llm_no_answer", 1),
        "{done:?}"
    );
    assert_eq!(model.requests().len(), 1);

    let model = ModelServer::start(vec![Reply::CutOff("The first half")]).await;
    let (done, _bus, _nats) = run_one(model.executor(), Delegation::new("ramble")).await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert_eq!(done.summary.as_deref(), Some("The first half"));
    assert!(done.truncated, "{done:?}");
}

/// A structured answer is JSON a reader can parse: the Markdown fence a
/// model puts around it is not part of the result.
#[tokio::test]
async fn a_structured_answer_is_returned_without_its_code_fence() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Answer("```json\n{\"answer\": 4}\n```")]).await;
    let mut delegation = Delegation::new("What is 2+2?");
    delegation.output_schema = Some(json!({"type": "object"}));
    let (done, _bus, _nats) = run_one(model.executor(), delegation).await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert_eq!(done.summary.as_deref(), Some(r#"{"answer": 4}"#));
    assert_eq!(done.api_calls, 1);
}

#[tokio::test]
async fn an_llm_endpoint_answering_5xx_is_retried_and_a_4xx_is_not() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Status(503), Reply::Answer("fine now")]).await;
    let (done, bus, _nats) = run_one(model.executor(), Delegation::new("flaky")).await;
    assert_eq!(done.summary.as_deref(), Some("fine now"));
    let started = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.ends_with(".started"))
        .count();
    assert_eq!(started, 2, "the 503 attempt was NAKed and delivered again");

    let refusing = ModelServer::start(vec![Reply::Status(400)]).await;
    let (done, _bus, _nats) = run_one(refusing.executor(), Delegation::new("bad call")).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "llm_refused")
    );
    assert!(done.error.unwrap().contains("400"));
    assert_eq!(refusing.requests().len(), 1);
}

/// A 401, 403 or 407 refuses the worker's key, not the task: the task goes
/// back to the queue for a worker whose key works (here the same worker,
/// its key fixed in between), and fails only once its deliveries run out.
#[tokio::test]
async fn an_llm_endpoint_refusing_the_workers_key_sends_the_task_back_rather_than_failing_it() {
    init_logs();
    let model = ModelServer::start(vec![
        Reply::Status(401),
        Reply::Status(403),
        Reply::Status(407),
        Reply::Answer("key fixed"),
    ])
    .await;
    // Refused, the worker takes no task for a moment: here the pool's
    // only worker takes its task back after it.
    let mut config = test_worker_config("default");
    config.refused_pause = Duration::from_millis(100);
    let (done, _bus, _nats) = run_one_with(
        model.executor(),
        config.clone(),
        Delegation::new("rotated key"),
    )
    .await;
    assert_eq!(
        (done.status, done.summary.as_deref()),
        (Status::Completed, Some("key fixed"))
    );
    assert_eq!(model.requests().len(), 4);

    let locked_out = ModelServer::start(vec![Reply::Status(401); 5]).await;
    let (done, _bus, _nats) =
        run_one_with(locked_out.executor(), config, Delegation::new("no key")).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "max_attempts_exceeded")
    );
    let error = done.error.unwrap();
    assert!(error.contains("401"), "{error}");
    assert_eq!(locked_out.requests().len(), 5, "one call per delivery");

    // A model the task names may be one no key may use: that refusal is
    // the task's, which fails at once.
    let no_access = ModelServer::start(vec![Reply::Status(403)]).await;
    let mut elsewhere = Delegation::new("a model this key may not use");
    elsewhere.model = Some("forbidden-model".to_owned());
    let (done, _bus, _nats) = run_one(no_access.executor(), elsewhere).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "llm_refused")
    );
    assert_eq!(no_access.requests().len(), 1);
}

/// A worker whose key the endpoint refuses takes no task for a while once
/// refused, so the pool's healthy worker runs them all. Without the pause
/// it took nearly every task (always free, each refusal instant) until
/// its deliveries ran out, and they failed however many healthy workers
/// the pool had.
#[tokio::test]
async fn a_worker_whose_key_is_refused_leaves_the_pools_tasks_to_the_others() {
    init_logs();
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let refusing = ModelServer::start(vec![Reply::Status(401); 200]).await;
    let answers = (0..10).map(|_| Reply::Slowly(Duration::from_millis(200), "done"));
    let healthy = ModelServer::start(answers.collect()).await;
    let mut services = Services::new();
    services.worker(&bus, refusing.executor(), test_worker_config("default"));
    let mut one_at_a_time = test_worker_config("default");
    one_at_a_time.concurrency = 1;
    services.worker(&bus, healthy.executor(), one_at_a_time);
    for i in 0..10 {
        let session = format!("s.pool.{i}");
        delegate(&bus, Delegation::new(format!("task {i}")).session(&session)).await;
    }
    wait_until(WAIT, "every task's completion", || async {
        done_events(&bus).await.len() == 10
    })
    .await;
    services.stop().await;
    let done = done_events(&bus).await;
    assert!(
        done.iter().all(|done| done.status == Status::Completed),
        "{:?}",
        done.iter()
            .map(|d| (&d.status, &d.error))
            .collect::<Vec<_>>()
    );
    assert_eq!(healthy.requests().len(), 10);
}

/// Only redirects that keep the prompt (307, 308) are followed: a client
/// follows 301, 302 and 303 with a GET without it, and the task would fail
/// with that GET's answer (here a 405) instead of naming the redirect.
#[tokio::test]
async fn an_llm_endpoint_redirect_is_followed_only_when_it_keeps_the_prompt() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Redirect(307), Reply::Answer("redirected")]).await;
    let (done, _bus, _nats) = run_one(model.executor(), Delegation::new("307")).await;
    assert_eq!(done.summary.as_deref(), Some("redirected"));
    assert_eq!(
        model.requests().len(),
        2,
        "the prompt went with the redirect"
    );

    let moved = ModelServer::start(vec![Reply::Redirect(303), Reply::Answer("unreached")]).await;
    let (done, _bus, _nats) = run_one(moved.executor(), Delegation::new("303")).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "llm_refused")
    );
    let error = done.error.unwrap();
    assert!(error.contains("303"), "{error}");
    assert_eq!(moved.requests().len(), 1);
}

/// Delegates `delegation` to an llm worker, cancels it (silently) once the
/// model has received `calls` requests (the last of which hangs), checks
/// that the hanging call was abandoned, and returns its completion.
async fn cancel_after_model_calls(
    model: &ModelServer,
    delegation: Delegation,
    calls: usize,
) -> CompletionEvent {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(&bus, model.executor(), test_worker_config("default"));
    let result = Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .unwrap();
    wait_until(WAIT, "the model calls", || async {
        model.requests().len() == calls
    })
    .await;
    Canceller::new(bus.clone())
        .cancel_delegation(result.delegation_id(), true)
        .await
        .unwrap();
    wait_until(WAIT, "the interrupted completion", || async {
        !done_events(&bus).await.is_empty()
    })
    .await;
    // The hanging call itself was given up, by the cancel, not left
    // running in the worker until it stops.
    wait_until(WAIT, "the model call to be abandoned", || async {
        model.abandoned() == 1
    })
    .await;
    services.stop().await;
    done_events(&bus).await.remove(0)
}

#[tokio::test]
async fn cancelling_a_running_llm_task_aborts_the_model_call() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Hang]).await;
    let delegation = Delegation::new("think forever").session("s.llm");
    let done = cancel_after_model_calls(&model, delegation, 1).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Interrupted, "cancelled")
    );
}

#[tokio::test]
async fn a_cancelled_llm_task_reports_the_calls_and_tokens_it_had_used() {
    init_logs();
    // The first answer misses the schema; the correction call never returns.
    let model = ModelServer::start(vec![Reply::Answer("not json"), Reply::Hang]).await;
    let mut delegation = Delegation::new("answer in JSON").session("s.llm.usage");
    delegation.output_schema = Some(json!({"type": "object"}));
    let done = cancel_after_model_calls(&model, delegation, 2).await;
    assert_eq!(done.status, Status::Interrupted);
    assert_eq!(done.api_calls, 2, "both calls were made");
    assert_eq!(
        (done.prompt_tokens, done.completion_tokens),
        (Some(12), Some(3)),
        "the answered call's usage is kept"
    );
    assert_eq!(
        done.summary.as_deref(),
        Some("not json"),
        "the first answer is the partial output"
    );
}

#[tokio::test]
async fn a_hermes_agent_runs_as_the_subagent_through_the_command_executor() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    // Stands in for `hermes`: checks it is called as `hermes chat -q PROMPT`.
    let standin = dir.path().join("hermes");
    std::fs::write(
        &standin,
        "#!/bin/sh\n[ \"$1\" = chat ] && [ \"$2\" = -q ] || { echo \"bad args: $*\" >&2; exit 2; }\nprintf 'hermes answered: %s (session %s, depth %s)\\n' \"$3\" \"$WAKEBUS_ORIGIN_SESSION\" \"$WAKEBUS_DEPTH\"\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &standin,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/hermes-subagent.sh");
    let command = CommandConfig::new("sh", vec![script.into(), standin.display().to_string()]);
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.worker(
        &bus,
        Executor::Command(CommandExecutor::new(command)),
        test_worker_config("default"),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    Delegator::new(bus.clone())
        .delegate(
            Delegation::new("Summarise INC-2291")
                .context("gateway logs")
                .session("hermes-session-1"),
        )
        .await
        .unwrap();
    // A context too large for a variable comes from stdin, through a file.
    Delegator::new(bus.clone())
        .delegate(
            Delegation::new("Read the dump")
                .context("y".repeat(70_000))
                .session("hermes-session-2"),
        )
        .await
        .unwrap();
    wait_until(WAIT, "the wakes", || async { api.accepted().len() == 2 }).await;
    services.stop().await;
    let text_for = |session: &str| {
        api.accepted()
            .into_iter()
            .find(|post| post.session() == session)
            .unwrap()
            .text()
    };
    let text = text_for("hermes-session-1");
    assert!(text.contains("Status: completed"), "{text}");
    assert!(
        text.contains("hermes answered: Summarise INC-2291\n\nContext:\ngateway logs (session hermes-session-1, depth 1)"),
        "{text}"
    );
    let text = text_for("hermes-session-2");
    assert!(text.contains("Status: completed"), "{text}");
    assert!(
        text.contains("hermes answered: Read the dump\n\nContext: in the file ")
            && text.contains(" (70000 bytes); read it."),
        "{text}"
    );
}

/// A program reports its result as a JSON object of known fields; a JSON
/// object with none of them (a structured answer) is the result itself,
/// not an empty report.
#[tokio::test]
async fn a_program_reports_its_result_as_json_and_a_structured_answer_is_kept_whole() {
    init_logs();
    let report =
        r#"{"summary": "half done", "status": "failed", "error": "quota", "api_calls": 3}"#;
    let config = CommandConfig::new("sh", vec!["-c".into(), format!("echo '{report}'")]);
    let (done, _bus, _nats) = run_one(
        Executor::Command(CommandExecutor::new(config)),
        Delegation::new("report"),
    )
    .await;
    assert_eq!(done.status, Status::Failed);
    assert_eq!(done.summary.as_deref(), Some("half done"));
    assert_eq!(done.error.as_deref(), Some("quota"));
    assert_eq!(done.api_calls, 3);

    let answer = r#"{"verdict": "green", "checked": 9}"#;
    let config = CommandConfig::new("sh", vec!["-c".into(), format!("echo '{answer}'")]);
    let (done, _bus, _nats) = run_one(
        Executor::Command(CommandExecutor::new(config)),
        Delegation::new("answer"),
    )
    .await;
    assert_eq!(done.status, Status::Completed);
    assert_eq!(done.summary.as_deref(), Some(answer));
}

#[tokio::test]
async fn command_output_beyond_the_cap_is_cut_and_flagged_truncated() {
    init_logs();
    let mut config = CommandConfig::new("sh", vec!["-c".into(), "printf '%05000d' 0".into()]);
    config.max_output_bytes = 100;
    let (done, _bus, _nats) = run_one(
        Executor::Command(CommandExecutor::new(config)),
        Delegation::new("talk a lot"),
    )
    .await;
    assert_eq!(done.status, Status::Completed);
    assert!(done.truncated);
    let summary = done.summary.unwrap();
    assert!(
        summary.starts_with(&"0".repeat(100)) && summary.ends_with("[output truncated]"),
        "{summary}"
    );
    assert!(summary.len() < 200);
}

#[tokio::test]
async fn the_partial_output_of_a_timed_out_command_beyond_the_cap_is_flagged_truncated() {
    init_logs();
    let script = "printf '%05000d' 0; sleep 60";
    let mut config = CommandConfig::new("sh", vec!["-c".into(), script.into()]);
    config.max_output_bytes = 100;
    let mut delegation = Delegation::new("talk a lot, then hang");
    delegation.timeout_seconds = Some(1);
    let (done, _bus, _nats) =
        run_one(Executor::Command(CommandExecutor::new(config)), delegation).await;
    assert_eq!(done.status, Status::Timeout);
    assert!(done.truncated);
    let summary = done.summary.unwrap();
    assert!(
        summary.starts_with(&"0".repeat(100)) && summary.ends_with("[output truncated]"),
        "{summary}"
    );
    // The limit, not the time it took to stop the program as well.
    assert_eq!(done.error.as_deref(), Some("timed out after 1s"));
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which is in parentheses.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// The pid a task program printed first.
fn printed_pid(done: &CompletionEvent) -> u32 {
    let summary = done.summary.as_deref().unwrap_or_default();
    summary
        .split_whitespace()
        .next()
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {summary:?}"))
}

#[tokio::test]
async fn a_program_that_exits_leaving_a_process_on_its_output_completes_and_that_process_is_stopped()
 {
    init_logs();
    // The helper inherits stdout, so the output never ends by itself.
    let done = run_leaving_a_helper(
        "sleep 600 & echo $!",
        Duration::from_millis(500),
        Delegation::new("leave a helper behind"),
    )
    .await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
}

/// Runs `script`, which prints the pid of a helper it leaves behind, as
/// the task of `delegation` with `kill_grace`; returns its completion once
/// that helper is stopped too.
async fn run_leaving_a_helper(
    script: &str,
    kill_grace: Duration,
    delegation: Delegation,
) -> CompletionEvent {
    let mut config = CommandConfig::new("sh", vec!["-c".into(), script.into()]);
    config.kill_grace = kill_grace;
    let (done, _bus, _nats) =
        run_one(Executor::Command(CommandExecutor::new(config)), delegation).await;
    let helper = printed_pid(&done);
    wait_until(WAIT, "the helper to be stopped", || async {
        !running(helper)
    })
    .await;
    done
}

/// A program that ended in time is not reported as timed out because its
/// time limit passed while a process it left behind held its output: the
/// limit ends that wait, and the program's result stands.
#[tokio::test]
async fn a_time_limit_passing_while_a_finished_programs_helper_holds_its_output_does_not_time_it_out()
 {
    init_logs();
    let mut delegation = Delegation::new("finish, then leave a helper past the limit");
    delegation.timeout_seconds = Some(1);
    // The wait for the helper to let go of the output outlasts the limit.
    let done =
        run_leaving_a_helper("sleep 600 & echo $!", Duration::from_secs(20), delegation).await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
}

/// A program that does not read its input is fine, even when the input
/// fills the pipe and a process it leaves behind keeps that pipe open: the
/// unread input is given up when the program exits, and its whole output is
/// its result, not one cut short.
#[tokio::test]
async fn input_left_unread_by_a_program_whose_helper_holds_its_stdin_does_not_cut_its_result() {
    init_logs();
    // The helper's stdin is the task's (fd 3, as a background job's own
    // stdin is /dev/null); its stdout is not.
    let script = "exec 3<&0; sleep 600 <&3 >/dev/null 2>&1 & echo $!";
    // Far more than a pipe holds.
    let delegation = Delegation::new("leave the input unread").context("x".repeat(256 * 1024));
    let done = run_leaving_a_helper(script, Duration::from_secs(20), delegation).await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert!(!done.truncated, "{done:?}");
    let helper = printed_pid(&done);
    assert_eq!(done.summary, Some(helper.to_string()), "{done:?}");
}

#[tokio::test]
async fn a_timed_out_program_whose_helper_ignores_sigterm_is_killed_with_its_whole_group() {
    init_logs();
    // The program dies on SIGTERM; the helper it started ignores it and
    // holds the output open.
    let script = "(trap '' TERM; exec sleep 600) & echo $!; wait";
    let mut delegation = Delegation::new("time out with a stubborn helper");
    delegation.timeout_seconds = Some(1);
    let done = run_leaving_a_helper(script, Duration::from_millis(500), delegation).await;
    assert_eq!(done.status, Status::Timeout, "{done:?}");
}

#[tokio::test]
async fn a_goal_the_environment_cannot_hold_is_given_on_stdin_only_and_the_task_runs() {
    init_logs();
    // An environment string cannot hold a NUL character: passing this goal
    // there would fail every start of the program.
    let script =
        r#"[ -z "${WAKEBUS_GOAL+set}" ] && echo "no goal in the environment"; cat >/dev/null"#;
    let config = CommandConfig::new("sh", vec!["-c".into(), script.into()]);
    let (done, _bus, _nats) = run_one(
        Executor::Command(CommandExecutor::new(config)),
        Delegation::new("before\u{0}after"),
    )
    .await;
    assert_eq!(done.status, Status::Completed, "{done:?}");
    assert_eq!(done.summary.as_deref(), Some("no goal in the environment"));
}

#[tokio::test]
async fn a_process_that_left_the_group_holding_the_output_does_not_hold_the_task_or_lose_its_result()
 {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("escaped.pid");
    // `setsid` puts the helper out of the process group the worker stops;
    // it keeps stdout open.
    let script = format!(
        "setsid sh -c 'echo $$ > {}; exec sleep 600' & printf started",
        pid_file.display()
    );
    let mut config = CommandConfig::new("sh", vec!["-c".into(), script]);
    config.kill_grace = Duration::from_millis(500);
    let (done, _bus, _nats) = run_one(
        Executor::Command(CommandExecutor::new(config)),
        Delegation::new("escape the group"),
    )
    .await;
    let escaped: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(escaped),
        nix::sys::signal::Signal::SIGKILL,
    );
    assert_eq!(done.status, Status::Completed, "{done:?}");
    // What the program printed before it exited (a last line without a
    // newline included) is its result; only what the escaped process
    // might still have written is lost, and said so.
    assert!(
        done.summary
            .as_deref()
            .is_some_and(|s| s.starts_with("started")),
        "{done:?}"
    );
    assert!(done.truncated, "the lost output is flagged: {done:?}");
    assert!(
        done.error
            .as_deref()
            .is_some_and(|e| e.contains("the end of the output was lost")),
        "{done:?}"
    );
}

/// An endpoint whose answer never ends (a misbehaving proxy) fails the
/// task once the answer passes 16 MiB, instead of filling the worker's
/// memory until the call times out.
#[tokio::test]
async fn an_llm_answer_that_never_ends_fails_the_task_at_a_bounded_size() {
    init_logs();
    let model = ModelServer::start(vec![Reply::Endless]).await;
    let (done, _bus, _nats) = run_one(model.executor(), Delegation::new("talk forever")).await;
    assert_eq!(
        (done.status, done.exit_reason.as_str()),
        (Status::Failed, "llm_refused")
    );
    assert!(
        done.error
            .as_deref()
            .is_some_and(|e| e.contains("larger than 16777216 bytes")),
        "{done:?}"
    );
}
