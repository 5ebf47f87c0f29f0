//! Delegation semantics: depth limits, nested delegation from a subagent.

mod common;

use std::time::Duration;

use common::*;
use wakebus::delegate::{DelegateError, Delegation, Delegator};
use wakebus::protocol::{CompletionEvent, Status};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_delegation_deeper_than_the_limit_is_refused_before_publishing() {
    let nats = NatsServer::start().await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut nested = Delegation::new("grandchild work").session("s");
    nested.depth = 2;
    let err = Delegator::new(bus.clone())
        .delegate(nested)
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        DelegateError::DepthLimit { depth: 2, max: 1 }
    ));
    assert!(
        err.to_string()
            .starts_with("Delegation depth limit reached"),
        "{err}"
    );
    let mut tasks = bus
        .js
        .get_stream(bus.subjects.tasks_stream())
        .await
        .unwrap();
    assert_eq!(
        tasks.info().await.unwrap().state.messages,
        0,
        "nothing was published"
    );
}

#[tokio::test]
async fn a_subagent_delegating_through_the_cli_nests_one_level_and_is_refused_past_the_limit() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = bus(&nats.url(), &prefix).await;
    // The subagent tries to delegate again with the same CLI a real one would use.
    let script = format!(
        "{bin} --nats-url \"$NATS_URL\" --prefix \"$WAKEBUS_PREFIX\" delegate --goal nested 2>&1; echo \"depth=$WAKEBUS_DEPTH\"",
        bin = env!("CARGO_BIN_EXE_wakebus")
    );
    let command = CommandConfig::new("sh", vec!["-c".into(), script]);
    let mut services = Services::new();
    let mut config = test_worker_config("default");
    config.instance = "w".into();
    let env_bus = bus.clone();
    services.worker_with_env(
        &env_bus,
        Executor::Command(CommandExecutor::new(command)),
        config,
        &nats.url(),
    );
    services.wake(&bus, test_wake_config(&api.url()));
    Delegator::new(bus.clone())
        .delegate(Delegation::new("try to nest").session("s.nest"))
        .await
        .unwrap();
    wait_until(WAIT, "the wake", || async { !api.accepted().is_empty() }).await;
    services.stop().await;
    let text = api.accepted()[0].text();
    assert!(
        text.contains("Delegation depth limit reached: depth 2 is above the maximum of 1"),
        "{text}"
    );
    assert!(text.contains("depth=1"), "{text}");
    // No second request ever reached the bus.
    let dones: Vec<CompletionEvent> = all_messages(&bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.ends_with(".done"))
        .map(|m| CompletionEvent::decode(&m.payload).unwrap())
        .collect();
    assert_eq!(dones.len(), 1);
    assert_eq!(dones[0].status, Status::Completed);
}
