//! Test harness: real nats-server processes, a real HTTP session API, and
//! helpers to run the services in-process or as `wakebus` processes.
#![allow(dead_code, unreachable_pub, missing_docs, unused_imports)]

pub mod cli;
pub mod cluster;
pub mod nats;
pub mod pki;
pub mod process;
pub mod proxy;
pub mod raw;
pub mod roles;
pub mod session_api;

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::protocol::Subjects;
use wakebus::wake::session_api::SessionApiConfig;
use wakebus::wake::{self, WakeConfig};
use wakebus::worker::executor::{EchoExecutor, Executor, TaskEnv};
use wakebus::worker::{self, WorkerConfig};

pub use nats::NatsServer;
pub use session_api::SessionApiServer;

/// Installs a log subscriber once (RUST_LOG=wakebus=debug to see service logs).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A plain HTTP GET: the status and body, or `None` when nothing answered.
pub async fn http_get(url: &str) -> Option<(u16, String)> {
    // reqwest is built without a default TLS provider; plain HTTP still
    // needs one installed to build a client.
    #[expect(deprecated, reason = "ring, as in src/tls.rs")]
    let _ = rustls::crypto::ring::default_provider().install_default();
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// Polls `condition` until it holds or `timeout` passes; panics with `what` then.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to `timeout` until the consumer `name` on `stream` has nothing
/// pending or unacknowledged, and returns how many deliveries were
/// redeliveries. Once it holds, nothing more is delivered to the consumer's
/// subscribers, redeliveries after AckWait included.
pub async fn drained(bus: &Bus, stream: &str, name: &str, timeout: Duration) -> u64 {
    eventually(timeout, &format!("consumer {name} to drain"), || async {
        let mut consumer = bus
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                name, stream,
            )
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        (info.num_ack_pending == 0 && info.num_pending == 0).then_some(info.num_redelivered as u64)
    })
    .await
}

/// Polls `attempt` until it yields a value or `timeout` passes; panics
/// with `what` then.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = attempt().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A unique subject prefix, so a test never sees another test's data.
pub fn unique_prefix() -> String {
    format!("t{}", ulid::Ulid::new().to_string().to_ascii_lowercase())
}

/// Connects a `Bus` to `url` under `prefix` and provisions its streams (as
/// `wakebus init` would), so tests can publish before services are up.
pub async fn bus(url: &str, prefix: &str) -> Bus {
    let client = NatsConfig::new(url).connect().await.expect("connect");
    let bus = Bus::new(client, Subjects::new(prefix).expect("prefix"));
    bus.provision(&BusSettings::default())
        .await
        .expect("provision");
    bus
}

/// What most pipeline tests start from: a server, a session API, a bus on
/// a fresh prefix, an echo worker and a wake service posting to the API.
pub struct Pipeline {
    /// The test's own nats-server.
    pub nats: NatsServer,
    /// The session API the wake posts to.
    pub api: SessionApiServer,
    /// The bus's prefix.
    pub prefix: String,
    /// Connected and provisioned.
    pub bus: Bus,
    /// The echo worker and the wake service, stopped with `services.stop()`.
    pub services: Services,
}

impl Pipeline {
    /// Starts everything, with `test_wake_config`.
    pub async fn start() -> Self {
        Self::started(true).await
    }

    /// Starts everything but the worker: for tests that run their own (a
    /// broken one, one with other limits) or none.
    pub async fn wake_only() -> Self {
        Self::started(false).await
    }

    async fn started(echo_worker: bool) -> Self {
        init_logs();
        let nats = NatsServer::start().await;
        let api = SessionApiServer::start().await;
        let prefix = unique_prefix();
        let bus = bus(&nats.url(), &prefix).await;
        let mut services = Services::new();
        if echo_worker {
            services.echo_worker(&bus);
        }
        services.wake(&bus, test_wake_config(&api.url()));
        Self {
            nats,
            api,
            prefix,
            bus,
            services,
        }
    }
}

/// Services running in-process, stopped (gracefully) on drop or `stop`.
pub struct Services {
    pub stop: CancellationToken,
    handles: Vec<tokio::task::JoinHandle<()>>,
}

impl Services {
    pub fn new() -> Self {
        Self {
            stop: CancellationToken::new(),
            handles: Vec::new(),
        }
    }

    /// Starts a worker with `executor`.
    pub fn worker(&mut self, bus: &Bus, executor: Executor, config: WorkerConfig) {
        self.worker_with_env(bus, executor, config, "");
    }

    /// Starts a worker with bus `settings` (e.g. a short duplicate window).
    pub fn worker_with_settings(
        &mut self,
        bus: &Bus,
        settings: BusSettings,
        executor: Executor,
        config: WorkerConfig,
    ) {
        self.spawn_worker(bus, settings, executor, config, "");
    }

    /// Starts a worker that tells its tasks to reach NATS at `nats_url`.
    pub fn worker_with_env(
        &mut self,
        bus: &Bus,
        executor: Executor,
        config: WorkerConfig,
        nats_url: &str,
    ) {
        self.spawn_worker(bus, BusSettings::default(), executor, config, nats_url);
    }

    fn spawn_worker(
        &mut self,
        bus: &Bus,
        settings: BusSettings,
        executor: Executor,
        config: WorkerConfig,
        nats_url: &str,
    ) {
        let env = TaskEnv {
            nats_url: nats_url.to_owned(),
            prefix: bus.subjects.prefix().to_owned(),
            pool: config.pool.clone(),
        };
        let run = worker::run(
            bus.clone(),
            settings,
            executor,
            env,
            config,
            self.stop.clone().cancelled_owned(),
        );
        self.handles.push(tokio::spawn(async move {
            run.await.expect("worker failed");
        }));
    }

    /// Starts an echo worker on the default pool.
    pub fn echo_worker(&mut self, bus: &Bus) {
        self.worker(
            bus,
            Executor::Echo(EchoExecutor),
            test_worker_config("default"),
        );
    }

    /// Starts the wake service posting to `api_url`.
    pub fn wake(&mut self, bus: &Bus, config: WakeConfig) {
        self.wake_with(bus, BusSettings::default(), config);
    }

    /// Starts the wake service with bus `settings` (e.g. a short lock TTL).
    pub fn wake_with(&mut self, bus: &Bus, settings: BusSettings, config: WakeConfig) {
        let run = wake::run(
            bus.clone(),
            settings,
            config,
            self.stop.clone().cancelled_owned(),
        );
        self.handles.push(tokio::spawn(async move {
            run.await.expect("wake failed");
        }));
    }

    /// Stops everything and waits for it.
    pub async fn stop(mut self) {
        self.stop.cancel();
        // Far beyond a graceful stop's own bounds (a worker's grace period
        // in tests, a wake's request timeout plus its last writes), so a
        // stop that hangs fails here, naming the service, instead of at
        // the harness's anonymous kill.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        for (index, handle) in self.handles.drain(..).enumerate() {
            tokio::time::timeout_at(deadline, handle)
                .await
                .unwrap_or_else(|_| panic!("service {index} (in start order) did not stop"))
                .expect("service panicked");
        }
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Worker settings for tests: short waits, quick retries, and a `started`
/// event for every run (many tests count attempts by them; the deferred
/// default has its own test).
pub fn test_worker_config(pool: &str) -> WorkerConfig {
    let mut config = WorkerConfig::new(pool);
    config.started_after = Duration::ZERO;
    config.ack_wait = Duration::from_secs(5);
    config.retry_base = Duration::from_millis(100);
    config.retry_max = Duration::from_millis(500);
    config.shutdown_grace = Duration::from_secs(5);
    config
}

/// Wake settings for tests posting to `api_url`.
pub fn test_wake_config(api_url: &str) -> WakeConfig {
    let mut config = WakeConfig::new(SessionApiConfig {
        base_url: api_url.to_owned(),
        api_key: Some("test-key".to_owned()),
        model: "hermes-agent".to_owned(),
        request_timeout: Duration::from_secs(5),
    });
    config.coalesce_window = Duration::from_millis(20);
    config.ack_wait = Duration::from_secs(5);
    config.retry_min = Duration::from_millis(50);
    config.retry_max = Duration::from_millis(300);
    config.conflict_patience = Duration::from_secs(10);
    config
}

/// Every message of `stream` (for assertions on history). A message the
/// client cannot read (headers that are not UTF-8) fails the test rather
/// than go unseen: count such messages with [`stored_messages`].
pub async fn all_messages(
    bus: &Bus,
    stream: &str,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    use async_nats::jetstream::stream::RawMessageErrorKind;
    let mut handle = bus.js.get_stream(stream).await.expect("stream");
    let info = handle.info().await.expect("info").clone();
    let mut out = Vec::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if seq == 0 {
            continue;
        }
        match handle.get_raw_message(seq).await {
            Ok(message) => out.push(message),
            // Deleted: an acked request of a work queue, a swept message.
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {}
            Err(error) => panic!("message {seq} of {stream} cannot be read: {error}"),
        }
    }
    out
}

/// How many messages `stream` holds, read from its state (nothing is
/// decoded, so unreadable messages count too).
pub async fn stored_messages(bus: &Bus, stream: &str) -> u64 {
    let mut handle = bus.js.get_stream(stream).await.expect("stream");
    handle.info().await.expect("info").state.messages
}

/// The wake consumer's state, or `None` while it does not exist yet.
pub async fn wake_consumer_info(bus: &Bus) -> Option<async_nats::jetstream::consumer::Info> {
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = bus
        .js
        .get_consumer_from_stream(bus.subjects.wake_consumer(), bus.subjects.events_stream())
        .await
        .ok()?;
    consumer.info().await.ok().cloned()
}

/// Waits until the wake service has handled (acked) every completion.
pub async fn wake_consumer_settled(bus: &Bus) {
    wait_until(
        Duration::from_secs(30),
        "the wake consumer to ack every completion",
        || async {
            wake_consumer_info(bus).await.is_some_and(|info| {
                info.ack_floor.stream_sequence > 0
                    && info.num_ack_pending == 0
                    && info.num_pending == 0
            })
        },
    )
    .await;
}

/// Waits until the wake ledger says that task 0 of delegation `id` was
/// delivered.
pub async fn ledger_records_delivery(bus: &Bus, id: &str) {
    let ledger = bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(30),
        "the ledger to record the delivery",
        || async {
            let entry = ledger.get(format!("{id}.0")).await.ok().flatten();
            entry.is_some_and(|e| String::from_utf8_lossy(&e).contains("delivered"))
        },
    )
    .await;
}

/// Waits until `n` completions are in the history and the wake service has
/// all of them in hand, unacknowledged, with none left to deliver.
pub async fn completions_waiting_in_wake(bus: &Bus, n: usize) {
    wait_until(
        Duration::from_secs(30),
        "the completions to wait in the wake",
        || async {
            done_events(bus).await.len() == n
                && wake_consumer_info(bus)
                    .await
                    .is_some_and(|info| info.num_ack_pending == n && info.num_pending == 0)
        },
    )
    .await;
}

/// Publishes the stored completion again under a new `Nats-Msg-Id`, as a
/// worker that crashed after publishing it and ran the task again after
/// the dedupe window would, and waits until the wake has settled it.
pub async fn publish_completion_again(bus: &Bus) {
    republish_completion(bus).await;
    wake_consumer_settled(bus).await;
}

/// Publishes the stored completion again under a new `Nats-Msg-Id`, as
/// [`publish_completion_again`] does, without waiting for the wake.
pub async fn republish_completion(bus: &Bus) {
    let stored = all_messages(bus, &bus.subjects.events_stream())
        .await
        .into_iter()
        .find(|m| m.subject.ends_with(".done"))
        .expect("a stored completion");
    publish_copy_again(bus, &stored, "a-later-rerun").await;
}

/// Publishes a stored `copy` again under a new `Nats-Msg-Id`.
pub async fn publish_copy_again(
    bus: &Bus,
    copy: &async_nats::jetstream::message::StreamMessage,
    msg_id: &str,
) {
    let mut headers = copy.headers.clone();
    headers.insert("Nats-Msg-Id", msg_id);
    bus.js
        .publish_with_headers(copy.subject.to_string(), headers, copy.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Takes `session`'s lock as another wake instance would, so that the wake
/// under test collects what arrives for the session until it is released.
pub async fn hold_session_elsewhere(
    bus: &Bus,
    session: &str,
) -> (
    wakebus::wake::lock::SessionLocks,
    wakebus::wake::lock::LockGuard,
) {
    let ttl = Duration::from_secs(30);
    let locks = wakebus::wake::lock::SessionLocks::new(
        bus.js.clone(),
        session_lock_bucket(bus, ttl).await,
        "another-wake",
        ttl,
    );
    let token = wakebus::protocol::session_token(session);
    let guard = locks
        .try_acquire(&token)
        .await
        .unwrap()
        .expect("a free lock");
    (locks, guard)
}

/// A one-task request for `session`, as any publisher would build it.
pub fn request(session: &str, goal: &str) -> wakebus::protocol::TaskRequest {
    let mut request =
        wakebus::protocol::TaskRequest::new(wakebus::protocol::new_delegation_id(), goal);
    request.origin_session_id = Some(session.to_owned());
    request
}

/// Makes the events stream take other subjects, so that nobody answers on
/// its own, as while its stream elects a leader; returns its config, for
/// `bus.js.update_stream(&config)` to put back.
pub async fn events_stream_unanswered(bus: &Bus) -> async_nats::jetstream::stream::Config {
    let events = bus.subjects.events_stream();
    let mut stream = bus.js.get_stream(&events).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    let mut electing = config.clone();
    electing.subjects = vec![format!("{}.paused.>", bus.subjects.prefix())];
    bus.js.update_stream(&electing).await.unwrap();
    config
}

/// Publishes `request` to the default pool until JetStream acknowledges it,
/// always with the same `Nats-Msg-Id`, so a publish whose ack was lost (a
/// restart, a failover) is stored once.
pub async fn publish_until_stored(bus: &Bus, request: &wakebus::protocol::TaskRequest) {
    publish_until(bus, request, true).await;
}

/// Publishes `request` as [`publish_until_stored`] does until JetStream
/// stores it as a new message, not as a duplicate of an earlier copy: once
/// the duplicate window of that copy has passed.
pub async fn publish_until_stored_anew(bus: &Bus, request: &wakebus::protocol::TaskRequest) {
    publish_until(bus, request, false).await;
}

async fn publish_until(
    bus: &Bus,
    request: &wakebus::protocol::TaskRequest,
    duplicate_will_do: bool,
) {
    let msg_id = format!("{}.{}", request.delegation_id, request.task_index);
    let headers = wakebus::protocol::EventHeaders {
        id: &msg_id,
        ce_type: "io.wakebus.task.requested",
        source: "test",
        origin_session: request.origin_session_id.as_deref(),
        delegation_id: &request.delegation_id,
        task_index: request.task_index,
        traceparent: wakebus::protocol::TraceParent::new_root(),
    }
    .to_header_map();
    let payload: bytes::Bytes = serde_json::to_vec(request).expect("encode").into();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let sent = bus
            .js
            .publish_with_headers(
                bus.subjects.task("default"),
                headers.clone(),
                payload.clone(),
            )
            .await;
        if let Ok(ack) = sent
            && let Ok(ack) = ack.await
            && (duplicate_will_do || !ack.duplicate)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request never stored (anew: {})",
            !duplicate_will_do
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The delegation id of a delegate result.
pub fn id_of(result: &wakebus::delegate::DelegateResult) -> String {
    result.delegation_id().to_owned()
}

/// Submits `delegation` on `bus` (the library's `Delegator`); returns its id.
pub async fn delegate(bus: &Bus, delegation: wakebus::delegate::Delegation) -> String {
    let result = wakebus::delegate::Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .expect("delegate");
    id_of(&result)
}

/// An executor running `script` with `sh -c`.
pub fn shell(script: &str) -> Executor {
    Executor::Command(wakebus::worker::executor::CommandExecutor::new(
        wakebus::worker::executor::CommandConfig::new("sh", vec!["-c".into(), script.into()]),
    ))
}

/// How many `started` events the history holds.
pub async fn started(bus: &Bus) -> usize {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.ends_with(".started"))
        .count()
}

/// Waits until a worker of `pool` has a pull waiting on its consumer: it
/// has started (set its streams as it wants them) and takes work.
pub async fn worker_pulling(bus: &Bus, pool: &str) {
    wait_until(Duration::from_secs(30), "the worker's pull", || async {
        let consumer = bus
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                bus.subjects.worker_consumer(pool),
                bus.subjects.tasks_stream(),
            )
            .await;
        match consumer {
            Ok(mut consumer) => consumer.info().await.is_ok_and(|info| info.num_waiting > 0),
            Err(_) => false,
        }
    })
    .await;
}

/// Every completion in the history, in stream order.
pub async fn done_events(bus: &Bus) -> Vec<wakebus::protocol::CompletionEvent> {
    all_messages(bus, &bus.subjects.events_stream())
        .await
        .iter()
        .filter(|m| m.subject.ends_with(".done"))
        .map(|m| wakebus::protocol::CompletionEvent::decode(&m.payload).expect("completion"))
        .collect()
}

/// The session-lock bucket provisioned as a wake with `ttl` finds it, for
/// tests that hold or inspect locks as another instance would.
pub async fn session_lock_bucket(bus: &Bus, ttl: Duration) -> async_nats::jetstream::kv::Store {
    let settings = wakebus::bus::BusSettings {
        session_lock_ttl: ttl,
        ..Default::default()
    };
    bus.provision_wake_state(&settings)
        .await
        .expect("provision the wake's buckets")
        .session_locks
}
