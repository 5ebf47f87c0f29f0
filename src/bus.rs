//! Bus provisioning: the streams, KV buckets and durable consumers wakebus
//! uses, created or updated idempotently and never deleted.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use async_nats::{Client, HeaderMap};
use backon::{ExponentialBuilder, Retryable};
use tracing::{info, warn};

use crate::protocol::{HEADER_DEAD_LETTER_REASON, HEADER_MSG_ID, Subjects, header_safe};

/// Settings for the streams and buckets, shared by every service.
#[derive(Debug, Clone)]
pub struct BusSettings {
    /// How long events (the replayable history) are kept.
    pub history_max_age: Duration,
    /// How long dead letters are kept.
    pub dead_letter_max_age: Duration,
    /// JetStream dedupe window for `Nats-Msg-Id`.
    pub duplicate_window: Duration,
    /// Replicas of new streams and buckets; `None` takes them from the
    /// server (1 on a single server, the cluster size up to 3 on a cluster)
    /// and leaves existing streams at the replicas they have.
    pub replicas: Option<usize>,
    /// Time-to-live of a session lock that its holder stops refreshing.
    pub session_lock_ttl: Duration,
    /// Whether provisioning may shorten the max age of an existing stream
    /// or bucket (which deletes at once what is older): `wakebus init` may,
    /// on the operator's word; a starting service never does, so that one
    /// started with a shorter `--history` than the others cannot delete
    /// their history.
    pub shorten_retention: bool,
}

impl Default for BusSettings {
    fn default() -> Self {
        Self {
            history_max_age: default_history_max_age(),
            dead_letter_max_age: Duration::from_secs(30 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            replicas: None,
            session_lock_ttl: Duration::from_secs(30),
            shorten_retention: false,
        }
    }
}

/// Events are kept for 7 days by default.
pub fn default_history_max_age() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}

/// Where a KV bucket's reads may be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direct {
    /// Any replica (fast, possibly a little behind).
    AnyReplica,
    /// The stream leader only (sees every acknowledged write).
    LeaderOnly,
}

/// Why provisioning failed.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// A stream could not be created or updated.
    #[error("cannot create or update stream {name}: {source}")]
    Stream {
        /// The stream.
        name: String,
        /// The JetStream error.
        source: jetstream::context::CreateStreamError,
    },
    /// A KV bucket could not be created or updated.
    #[error("cannot create or update KV bucket {name}: {source}")]
    Bucket {
        /// The bucket.
        name: String,
        /// The JetStream error.
        source: jetstream::context::KeyValueError,
    },
    /// A consumer could not be created or updated.
    #[error("cannot create or update consumer {name} on {stream}: {source}")]
    Consumer {
        /// The consumer.
        name: String,
        /// Its stream.
        stream: String,
        /// The JetStream error.
        source: jetstream::stream::ConsumerError,
    },
    /// Whether a consumer exists could not be read.
    #[error("cannot read consumer {name} on {stream}: {source}")]
    ConsumerInfo {
        /// The consumer.
        name: String,
        /// Its stream.
        stream: String,
        /// The JetStream error.
        source: jetstream::context::ConsumerInfoError,
    },
    /// A stream that should exist could not be read.
    #[error("cannot read stream {name}: {source}")]
    GetStream {
        /// The stream.
        name: String,
        /// The JetStream error.
        source: jetstream::context::GetStreamError,
    },
}

/// A connection to one wakebus deployment: the client, JetStream and names.
#[derive(Debug, Clone)]
pub struct Bus {
    /// The NATS client (cheap to clone).
    pub client: Client,
    /// JetStream on that client.
    pub js: jetstream::Context,
    /// Every name of the deployment.
    pub subjects: Subjects,
}

/// The streams (and the cancel bucket every worker reads), after provisioning.
#[derive(Debug, Clone)]
pub struct Streams {
    /// The events stream (history).
    pub events: stream::Stream,
    /// Cancel records, checked before a task starts.
    pub cancels: kv::Store,
}

/// The wake service's KV buckets, after provisioning.
#[derive(Debug, Clone)]
pub struct WakeState {
    /// Which completions have been woken.
    pub wake_ledger: kv::Store,
    /// Per-session wake locks.
    pub session_locks: kv::Store,
}

impl Bus {
    /// Wraps a connected client.
    pub fn new(client: Client, subjects: Subjects) -> Self {
        let js = jetstream::new(client.clone());
        Self {
            client,
            js,
            subjects,
        }
    }

    /// Replicas for new streams and buckets when none are configured: 1 on a
    /// single server; on a cluster, the number of servers it advertises to
    /// clients, at most 3 (3 when it advertises none).
    pub async fn default_replicas(&self) -> usize {
        // The client may still be connecting (it retries its first
        // connect); the server's INFO is only known once it is connected.
        if let Err(error) = self.client.flush().await {
            warn!(%error, "Could not reach NATS to read its cluster size.");
        }
        let info = self.client.server_info();
        replicas_for_cluster(info.cluster.as_deref(), &info.connect_urls)
    }

    /// The replicas `name` gets: the configured number, else those it
    /// already has (so a node being down at start never scales a stream
    /// down), else [`Self::default_replicas`].
    async fn replicas_for(
        &self,
        settings: &BusSettings,
        name: &str,
    ) -> Result<usize, ProvisionError> {
        if let Some(replicas) = settings.replicas {
            return Ok(replicas);
        }
        let get_error = |source| ProvisionError::GetStream {
            name: name.to_owned(),
            source,
        };
        match self.js.get_stream(name).await {
            Ok(mut stream) => {
                let info = stream.info().await.map_err(|error| {
                    get_error(jetstream::context::GetStreamError::with_source(
                        jetstream::context::GetStreamErrorKind::Request,
                        error,
                    ))
                })?;
                Ok(info.config.num_replicas.max(1))
            }
            Err(error) if is_stream_not_found(&error) => Ok(self.default_replicas().await),
            Err(error) => Err(get_error(error)),
        }
    }

    /// Creates or updates the three streams, retrying while NATS is
    /// unreachable (services may start before the server).
    pub async fn provision(&self, settings: &BusSettings) -> Result<Streams, ProvisionError> {
        let attempt = || self.provision_streams(settings);
        Self::patiently(attempt).await
    }

    /// Creates or updates the wake service's KV buckets (ledger and session
    /// locks). Only the wake service and `init` do this, so that the lock
    /// TTL comes from the wake's own settings.
    pub async fn provision_wake_state(
        &self,
        settings: &BusSettings,
    ) -> Result<WakeState, ProvisionError> {
        let attempt = || self.provision_buckets(settings);
        Self::patiently(attempt).await
    }

    /// What a worker provisions: the streams and the cancel bucket, except
    /// that an existing events stream is left alone. A worker may not read
    /// the events stream's info (with a subject filter it lists every
    /// delegation id), so it only checks, by a probe publish, that the
    /// stream exists; a missing one is created as by [`Bus::provision`].
    /// Returns the cancel bucket.
    pub async fn provision_for_worker(
        &self,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        let attempt = || async {
            let probe = self
                .subjects
                .event("probe", "probe", 0, crate::protocol::EventKind::Done);
            match crate::worker::probe::last_sequence_on(self, &probe).await {
                Ok(_) => self.provision_worker_streams(settings).await,
                Err(crate::worker::probe::ProbeError::NoStream) => {
                    Ok(self.provision_streams(settings).await?.cancels)
                }
                Err(error) => {
                    warn!(%error, "Could not check the events stream; provisioning as usual.");
                    Ok(self.provision_streams(settings).await?.cancels)
                }
            }
        };
        Self::patiently(attempt).await
    }

    async fn patiently<T, F, Fut>(attempt: F) -> Result<T, ProvisionError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ProvisionError>>,
    {
        attempt
            .retry(setup_backoff())
            .when(is_transient)
            .notify(|err, delay| {
                warn!(error = %err, retry_in = ?delay, "Provisioning failed: NATS may not be up yet, or this NATS user may not create what is missing (run `wakebus init` as operator); will retry.");
            })
            .await
    }

    async fn provision_streams(&self, settings: &BusSettings) -> Result<Streams, ProvisionError> {
        let s = &self.subjects;
        self.ensure_stream(self.tasks_config(settings).await?, settings)
            .await?;
        let events = self
            .ensure_stream(
                stream::Config {
                    num_replicas: self.replicas_for(settings, &s.events_stream()).await?,
                    name: s.events_stream(),
                    subjects: vec![s.events_all()],
                    retention: stream::RetentionPolicy::Limits,
                    storage: stream::StorageType::File,
                    max_age: settings.history_max_age,
                    duplicate_window: settings.duplicate_window.min(settings.history_max_age),
                    ..Default::default()
                },
                settings,
            )
            .await?;
        self.ensure_stream(self.dead_letters_config(settings).await?, settings)
            .await?;
        let cancels = self.ensure_cancels(settings).await?;
        Ok(Streams { events, cancels })
    }

    /// The requests stream's settings.
    async fn tasks_config(&self, settings: &BusSettings) -> Result<stream::Config, ProvisionError> {
        let s = &self.subjects;
        Ok(stream::Config {
            num_replicas: self.replicas_for(settings, &s.tasks_stream()).await?,
            name: s.tasks_stream(),
            subjects: vec![s.tasks_all()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: settings.duplicate_window,
            ..Default::default()
        })
    }

    /// The dead-letter stream's settings.
    async fn dead_letters_config(
        &self,
        settings: &BusSettings,
    ) -> Result<stream::Config, ProvisionError> {
        let s = &self.subjects;
        Ok(stream::Config {
            num_replicas: self.replicas_for(settings, &s.dead_letter_stream()).await?,
            name: s.dead_letter_stream(),
            subjects: vec![s.dead_letters_all()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_age: settings.dead_letter_max_age,
            duplicate_window: settings.duplicate_window,
            ..Default::default()
        })
    }

    /// The cancel bucket, created or updated.
    async fn ensure_cancels(&self, settings: &BusSettings) -> Result<kv::Store, ProvisionError> {
        let s = &self.subjects;
        self.ensure_bucket(
            kv::Config {
                bucket: s.cancel_bucket(),
                description: "Cancel records: delegations and sessions whose tasks must not run"
                    .to_owned(),
                history: 1,
                max_age: settings.history_max_age,
                storage: stream::StorageType::File,
                num_replicas: self
                    .replicas_for(settings, &format!("KV_{}", s.cancel_bucket()))
                    .await?,
                ..Default::default()
            },
            Direct::AnyReplica,
            settings,
        )
        .await
    }

    /// [`Bus::provision_streams`] without the events stream.
    async fn provision_worker_streams(
        &self,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        self.ensure_stream(self.tasks_config(settings).await?, settings)
            .await?;
        self.ensure_stream(self.dead_letters_config(settings).await?, settings)
            .await?;
        self.ensure_cancels(settings).await
    }

    async fn provision_buckets(&self, settings: &BusSettings) -> Result<WakeState, ProvisionError> {
        let s = &self.subjects;
        let wake_ledger = self
            .ensure_bucket(
                kv::Config {
                    bucket: s.wake_ledger_bucket(),
                    description:
                        "Completions already woken (the wake service's idempotency record)"
                            .to_owned(),
                    history: 1,
                    max_age: settings.history_max_age,
                    storage: stream::StorageType::File,
                    num_replicas: self
                        .replicas_for(settings, &format!("KV_{}", s.wake_ledger_bucket()))
                        .await?,
                    ..Default::default()
                },
                Direct::LeaderOnly,
                settings,
            )
            .await?;
        let session_locks = self
            .ensure_bucket(
                kv::Config {
                    bucket: s.session_lock_bucket(),
                    description: "Per-session wake locks: one wake post in flight per session"
                        .to_owned(),
                    history: 1,
                    max_age: settings.session_lock_ttl,
                    storage: stream::StorageType::File,
                    num_replicas: self
                        .replicas_for(settings, &format!("KV_{}", s.session_lock_bucket()))
                        .await?,
                    ..Default::default()
                },
                Direct::LeaderOnly,
                settings,
            )
            .await?;
        Ok(WakeState {
            wake_ledger,
            session_locks,
        })
    }

    /// Makes sure a stream exists with `config`.
    ///
    /// Reads it first: when it already has these settings (the usual case
    /// once `wakebus init` has run), nothing is written, so a service whose
    /// NATS user may only read stream info starts as well. A stream with
    /// other settings is updated; if that fails (this user may not manage
    /// streams) the stream is used as it is, with a warning. A missing stream
    /// is created; if this user may not, the caller retries until an
    /// operator has run `wakebus init`.
    async fn ensure_stream(
        &self,
        mut config: stream::Config,
        settings: &BusSettings,
    ) -> Result<stream::Stream, ProvisionError> {
        let name = config.name.clone();
        match self.js.get_stream(&name).await {
            Ok(existing) if stream_matches(&existing.cached_info().config, &config) => {
                return Ok(existing);
            }
            Ok(existing) => {
                let kept = existing.cached_info().config.max_age;
                if !settings.shorten_retention && shortens(kept, config.max_age) {
                    warn!(stream = %name, kept = ?kept, asked = ?config.max_age, "This service keeps history for less time than the stream does; the stream keeps its max age, as shortening it deletes what is older at once. Run `wakebus init` with the shorter setting to shorten it on purpose.");
                    config.max_age = kept;
                    if stream_matches(&existing.cached_info().config, &config) {
                        return Ok(existing);
                    }
                }
                let current = &existing.cached_info().config;
                // Which messages the stream takes and when it lets them go:
                // with these different, the service would not work as
                // documented (storage, say, is the operator's choice).
                let unusable =
                    current.subjects != config.subjects || current.retention != config.retention;
                if let Err(source) = self.js.update_stream(managed_update(current, config)).await {
                    if unusable {
                        return Err(ProvisionError::Stream { name, source });
                    }
                    warn!(stream = %name, error = %source, "Stream settings differ from this service's and could not be updated (does this NATS user manage streams? run `wakebus init` as operator); using it as it is.");
                    return Ok(existing);
                }
            }
            Err(error) if is_stream_not_found(&error) => {
                match self.js.create_stream(config).await {
                    Ok(_) => {}
                    // On a cluster, another service may just have created it.
                    Err(error) if is_creation_clash(&error) => {}
                    Err(source) => {
                        return Err(ProvisionError::Stream {
                            name: name.clone(),
                            source,
                        });
                    }
                }
            }
            Err(source) => return Err(ProvisionError::GetStream { name, source }),
        }
        self.js
            .get_stream(&name)
            .await
            .map_err(|source| ProvisionError::GetStream { name, source })
    }

    /// Creates or updates a KV bucket through its backing stream.
    ///
    /// async-nats's own `create_or_update_key_value` first reads the account
    /// info, which it cannot parse from nats-server 2.9; the stream settings
    /// below are the standard KV layout, so any KV client can use the bucket.
    ///
    /// `direct` allows reads from any replica. The wake ledger and the
    /// session locks refuse it: their check-then-act logic needs to read the
    /// latest write, which only the stream leader is sure to have.
    async fn ensure_bucket(
        &self,
        config: kv::Config,
        direct: Direct,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        let name = config.bucket.clone();
        self.ensure_stream(
            stream::Config {
                name: format!("KV_{name}"),
                description: Some(config.description),
                subjects: vec![format!("$KV.{name}.>")],
                max_messages_per_subject: config.history.max(1),
                max_age: config.max_age,
                storage: config.storage,
                allow_rollup: true,
                deny_delete: true,
                deny_purge: false,
                allow_direct: direct == Direct::AnyReplica,
                num_replicas: config.num_replicas.max(1),
                discard: stream::DiscardPolicy::New,
                ..Default::default()
            },
            settings,
        )
        .await?;
        self.js
            .get_key_value(&name)
            .await
            .map_err(|source| ProvisionError::Bucket { name, source })
    }

    /// Creates or updates the durable pull consumer shared by all workers of `pool`.
    pub async fn worker_consumer(
        &self,
        pool: &str,
        ack_wait: Duration,
    ) -> Result<consumer::PullConsumer, ProvisionError> {
        let consumer = self.worker_consumer_with(pool, ack_wait, Existing::Update);
        Ok(consumer.await?.expect("an updated consumer is returned"))
    }

    /// Creates the consumers a deployment needs (the wake service's, and the
    /// workers' of `pools`) where they are missing, with the defaults (30 s
    /// AckWait); existing ones keep their settings, which the running
    /// services chose with `--ack-wait` and `--max-in-flight`.
    pub async fn init_consumers(&self, pools: &[String]) -> Result<(), ProvisionError> {
        let ack_wait = Duration::from_secs(30);
        for pool in pools {
            self.worker_consumer_with(pool, ack_wait, Existing::Keep)
                .await?;
        }
        self.wake_consumer_with(ack_wait, crate::wake::DEFAULT_MAX_IN_FLIGHT, Existing::Keep)
            .await?;
        Ok(())
    }

    async fn worker_consumer_with(
        &self,
        pool: &str,
        ack_wait: Duration,
        existing: Existing,
    ) -> Result<Option<consumer::PullConsumer>, ProvisionError> {
        let stream = self.subjects.tasks_stream();
        let name = self.subjects.worker_consumer(pool);
        self.ensure_consumer(
            existing,
            &stream,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                description: Some(format!("wakebus workers of pool {pool}")),
                filter_subject: self.subjects.task(pool),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait,
                // Unlimited: the worker itself ends a task after its maximum
                // number of attempts, with a `failed` completion. A server-side
                // limit would strand a request silently instead.
                max_deliver: -1,
                max_ack_pending: 100_000,
                ..Default::default()
            },
        )
        .await
    }

    /// Creates or updates the durable pull consumer shared by all wake instances.
    pub async fn wake_consumer(
        &self,
        ack_wait: Duration,
        max_ack_pending: i64,
    ) -> Result<consumer::PullConsumer, ProvisionError> {
        let consumer = self.wake_consumer_with(ack_wait, max_ack_pending, Existing::Update);
        Ok(consumer.await?.expect("an updated consumer is returned"))
    }

    async fn wake_consumer_with(
        &self,
        ack_wait: Duration,
        max_ack_pending: i64,
        existing: Existing,
    ) -> Result<Option<consumer::PullConsumer>, ProvisionError> {
        let stream = self.subjects.events_stream();
        self.ensure_consumer(
            existing,
            &stream,
            consumer::pull::Config {
                durable_name: Some(self.subjects.wake_consumer().to_owned()),
                description: Some("wakebus wake service".to_owned()),
                filter_subject: self.subjects.done_events(),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait,
                max_deliver: -1,
                max_ack_pending,
                ..Default::default()
            },
        )
        .await
    }

    /// The consumer, or `None` when it existed and was kept.
    async fn ensure_consumer(
        &self,
        existing: Existing,
        stream: &str,
        config: consumer::pull::Config,
    ) -> Result<Option<consumer::PullConsumer>, ProvisionError> {
        let name = config.durable_name.clone().unwrap_or_default();
        let attempt = || async {
            let handle =
                self.js
                    .get_stream(stream)
                    .await
                    .map_err(|source| ProvisionError::GetStream {
                        name: stream.to_owned(),
                        source,
                    })?;
            match handle.consumer_info(&name).await {
                Ok(_) if existing == Existing::Keep => {
                    info!(consumer = %name, stream, "Consumer exists; its settings are kept.");
                    return Ok(None);
                }
                Ok(current) if current.config.ack_wait != config.ack_wait => {
                    warn!(consumer = %name, stream, was = ?current.config.ack_wait, now = ?config.ack_wait, "The consumer's AckWait changes: every instance sharing it must run with the same --ack-wait, or work held longer than the shortest one's is redelivered.");
                }
                Err(error)
                    if existing == Existing::Keep
                        && error.kind() != jetstream::context::ConsumerInfoErrorKind::NotFound =>
                {
                    // Not knowing whether it exists, do not overwrite it.
                    return Err(ProvisionError::ConsumerInfo {
                        name: name.clone(),
                        stream: stream.to_owned(),
                        source: error,
                    });
                }
                _ => {}
            }
            let consumer = handle
                .create_consumer(config.clone())
                .await
                .map_err(|source| ProvisionError::Consumer {
                    name: name.clone(),
                    stream: stream.to_owned(),
                    source,
                })?;
            info!(consumer = %name, stream, "Consumer ready.");
            Ok(Some(consumer))
        };
        attempt
            .retry(setup_backoff())
            .when(is_transient)
            .notify(|err, delay| {
                warn!(error = %err, retry_in = ?delay, "Consumer setup failed; will retry.");
            })
            .await
    }
}

/// What provisioning does with a consumer that exists already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    /// Update it to this service's settings (a starting service).
    Update,
    /// Leave it as it is (`wakebus init`).
    Keep,
}

/// How set-up steps retry while NATS is not up yet or what they need is
/// missing: from 200 ms up to every 5 s, for as long as it takes.
fn setup_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(5))
        .with_max_times(usize::MAX)
}

/// How a write whose result is already in hand (a worker's completion, a
/// delivered wake's ledger record) is made again until JetStream stores it:
/// from 100 ms, doubling up to 5 s, each delay plus up to as much again in
/// jitter (so waits reach 10 s), for as long as the service runs.
pub(crate) fn until_stored_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

/// How many stored requests [`Bus::is_queued`] reads at most: with more in
/// the queue it assumes the answer is yes.
const QUEUE_SCAN_LIMIT: u64 = 10_000;

impl Bus {
    /// Whether a request of `delegation_id` is in the task queue: waiting,
    /// or running and not yet acknowledged (work-queue retention removes a
    /// request only when it is acked). Also true when the queue is longer
    /// than the scan limit: callers use it to avoid a second copy, and
    /// better a skip too many than a task that runs twice.
    pub(crate) async fn is_queued(&self, delegation_id: &str) -> Result<bool, async_nats::Error> {
        Ok(self.find_queued(delegation_id).await?.unwrap_or(true))
    }

    /// Whether a request of `delegation_id` is in the task queue, or `None`
    /// when the queue is longer than the scan limit and it cannot tell.
    pub(crate) async fn find_queued(
        &self,
        delegation_id: &str,
    ) -> Result<Option<bool>, async_nats::Error> {
        let mut tasks = self.js.get_stream(self.subjects.tasks_stream()).await?;
        let state = tasks.info().await?.state.clone();
        // Counted in stored messages, not sequences: acked requests leave
        // gaps, which the walk below skips in one request each time.
        if state.messages > QUEUE_SCAN_LIMIT {
            return Ok(None);
        }
        let all = self.subjects.tasks_all();
        let mut from = state.first_sequence.max(1);
        for _ in 0..state.messages {
            let next = tasks
                .raw_message_builder()
                .sequence(from)
                .next_by_subject(&all)
                .send()
                .await;
            let message = match next {
                Ok(message) if message.sequence <= state.last_sequence => message,
                Ok(_) => break,
                Err(error) if error.kind() == stream::LastRawMessageErrorKind::NoMessageFound => {
                    break;
                }
                Err(error) => return Err(error.into()),
            };
            let id = message.headers.get(crate::protocol::HEADER_DELEGATION_ID);
            if id.is_some_and(|id| id.as_str() == delegation_id) {
                return Ok(Some(true));
            }
            from = message.sequence + 1;
        }
        Ok(Some(false))
    }

    /// The server's max payload, or NATS's default (1 MiB) while it is not
    /// known yet (the client connects in the background).
    pub fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => 1024 * 1024,
            known => known,
        }
    }

    /// Copies `message` to the dead-letter `subject` with `reason`, deduped
    /// by `msg_id`, and waits until JetStream has stored it.
    ///
    /// The copy keeps the original headers and body when they fit in one
    /// message. A message that was already near the server's max payload
    /// would not fit with the added headers, and a dead letter that can never
    /// be stored would make the original come back forever: then the body
    /// (and, if still too large, the original headers) are left out and the
    /// reason says so.
    pub async fn dead_letter(
        &self,
        subject: String,
        message: &jetstream::Message,
        reason: &str,
        msg_id: &str,
    ) -> Result<(), PublishError> {
        let max_payload = self.max_payload();
        let (headers, payload) = dead_letter_parts(
            message.headers.as_ref(),
            &message.payload,
            reason,
            msg_id,
            max_payload,
        );
        self.js
            .publish_with_headers(subject, headers, payload)
            .await?
            .await?;
        Ok(())
    }
}

/// Room kept free below the max payload for the headers a dead letter adds.
const DEAD_LETTER_MARGIN: usize = 4 * 1024;

/// The headers and body of a dead letter that fits in `max_payload`.
fn dead_letter_parts(
    original: Option<&HeaderMap>,
    payload: &bytes::Bytes,
    reason: &str,
    msg_id: &str,
    max_payload: usize,
) -> (HeaderMap, bytes::Bytes) {
    let budget = max_payload.saturating_sub(DEAD_LETTER_MARGIN);
    let header_bytes = original.map_or(0, |headers| {
        headers
            .iter()
            .map(|(name, values)| {
                values
                    .iter()
                    .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + 4)
                    .sum::<usize>()
            })
            .sum()
    });
    let mut reason = reason.to_owned();
    let (mut headers, payload) = if header_bytes + payload.len() <= budget {
        (original.cloned().unwrap_or_default(), payload.clone())
    } else if header_bytes <= budget {
        reason.push_str(&format!(
            " (body of {} bytes left out: too large to store again)",
            payload.len()
        ));
        (original.cloned().unwrap_or_default(), bytes::Bytes::new())
    } else {
        reason.push_str(&format!(
            " (body of {} bytes and headers of {header_bytes} bytes left out: too large to store again)",
            payload.len()
        ));
        (HeaderMap::new(), bytes::Bytes::new())
    };
    headers.insert(HEADER_DEAD_LETTER_REASON, header_safe(&reason).as_str());
    headers.insert(HEADER_MSG_ID, msg_id);
    (headers, payload)
}

/// Whether `existing` already has every setting wakebus asks for in `wanted`.
fn stream_matches(existing: &stream::Config, wanted: &stream::Config) -> bool {
    existing.subjects == wanted.subjects
        && existing.retention == wanted.retention
        && existing.storage == wanted.storage
        && existing.max_age == wanted.max_age
        && existing.num_replicas.max(1) == wanted.num_replicas.max(1)
        && unlimited_as_minus_one(existing.max_messages_per_subject)
            == unlimited_as_minus_one(wanted.max_messages_per_subject)
        && existing.discard == wanted.discard
        && existing.allow_rollup == wanted.allow_rollup
        && existing.deny_delete == wanted.deny_delete
        && existing.allow_direct == wanted.allow_direct
        // Zero means "server default", which the server fills in.
        && (wanted.duplicate_window.is_zero()
            || existing.duplicate_window == wanted.duplicate_window)
}

/// `wanted`'s settings on top of the stream's `current` ones: the fields
/// wakebus manages (those [`stream_matches`] compares, and the description)
/// from `wanted`, every other one (limits an operator set by hand, such as
/// `max_bytes` or `max_msgs`) as it is.
fn managed_update(current: &stream::Config, wanted: stream::Config) -> stream::Config {
    stream::Config {
        name: wanted.name,
        description: wanted.description,
        subjects: wanted.subjects,
        retention: wanted.retention,
        storage: wanted.storage,
        max_age: wanted.max_age,
        num_replicas: wanted.num_replicas,
        max_messages_per_subject: wanted.max_messages_per_subject,
        discard: wanted.discard,
        allow_rollup: wanted.allow_rollup,
        deny_delete: wanted.deny_delete,
        deny_purge: wanted.deny_purge,
        allow_direct: wanted.allow_direct,
        duplicate_window: if wanted.duplicate_window.is_zero() {
            current.duplicate_window
        } else {
            wanted.duplicate_window
        },
        ..current.clone()
    }
}

/// Whether a stream keeping messages for `kept` would lose some with a max
/// age of `asked` (zero is unlimited).
fn shortens(kept: Duration, asked: Duration) -> bool {
    !asked.is_zero() && (kept.is_zero() || asked < kept)
}

/// Limits of 0 (client default) and -1 (server's "unlimited") mean the same.
fn unlimited_as_minus_one(limit: i64) -> i64 {
    if limit <= 0 { -1 } else { limit }
}

/// Replicas for a server in `cluster` advertising `connect_urls` (its own
/// client URL and its peers'); see [`Bus::default_replicas`].
fn replicas_for_cluster(cluster: Option<&str>, connect_urls: &[String]) -> usize {
    if cluster.is_none() {
        return 1;
    }
    let mut servers: Vec<&str> = connect_urls.iter().map(String::as_str).collect();
    servers.sort_unstable();
    servers.dedup();
    match servers.len() {
        0 => 3,
        n => n.min(3),
    }
}

/// Whether creating a stream failed because one with that name or those
/// subjects already exists.
fn is_creation_clash(error: &jetstream::context::CreateStreamError) -> bool {
    match error.kind() {
        jetstream::context::CreateStreamErrorKind::JetStream(error) => matches!(
            error.error_code(),
            jetstream::ErrorCode::STREAM_NAME_EXIST | jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP
        ),
        _ => false,
    }
}

/// Whether a stream lookup failed only because the stream does not exist yet.
pub(crate) fn is_stream_not_found(error: &jetstream::context::GetStreamError) -> bool {
    match error.kind() {
        jetstream::context::GetStreamErrorKind::JetStream(error) => {
            error.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
        }
        _ => false,
    }
}

/// Whether an error may go away by itself (server not up, leader election,
/// timeouts) as opposed to a configuration conflict an operator must fix.
fn is_transient(err: &ProvisionError) -> bool {
    let text = err.to_string();
    let lower = text.to_ascii_lowercase();
    [
        "timed out",
        "timeout",
        "no responders",
        "not connected",
        "connection",
        "leader",
        "unavailable",
        "temporarily",
        // A cluster still forming: not every peer is known yet.
        "peers",
        "insufficient resources",
    ]
    .iter()
    .any(|needle| lower.contains(needle))
}

/// Why a publish to JetStream did not get a stored acknowledgement.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The body could not be encoded.
    #[error("cannot encode the message body: {0}")]
    Encode(#[from] serde_json::Error),
    /// The publish was not acknowledged (server down, timeout, no stream...).
    #[error("publish was not acknowledged by JetStream: {0}")]
    Publish(#[from] jetstream::context::PublishError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_keeps_the_original_when_it_fits() {
        let mut original = HeaderMap::new();
        original.insert("Wakebus-Delegation-Id", "d1");
        let body = bytes::Bytes::from_static(b"{}");
        let (headers, payload) =
            dead_letter_parts(Some(&original), &body, "bad\nthing", "dlq.1", 1 << 20);
        assert_eq!(payload, body);
        assert_eq!(headers.get("Wakebus-Delegation-Id").unwrap().as_str(), "d1");
        assert_eq!(
            headers.get(HEADER_DEAD_LETTER_REASON).unwrap().as_str(),
            "bad thing"
        );
        assert_eq!(headers.get(HEADER_MSG_ID).unwrap().as_str(), "dlq.1");
    }

    #[test]
    fn a_dead_letter_too_large_to_store_again_leaves_the_body_out_and_says_so() {
        let body = bytes::Bytes::from(vec![b'x'; 1 << 20]);
        let (headers, payload) = dead_letter_parts(None, &body, "too big", "dlq.2", 1 << 20);
        assert!(payload.is_empty());
        let reason = headers.get(HEADER_DEAD_LETTER_REASON).unwrap().as_str();
        assert!(
            reason.starts_with("too big (body of 1048576 bytes left out"),
            "{reason}"
        );

        let mut huge = HeaderMap::new();
        huge.insert("X-Big", "y".repeat(1 << 20).as_str());
        let (headers, _) = dead_letter_parts(Some(&huge), &body, "too big", "dlq.3", 1 << 20);
        assert!(headers.get("X-Big").is_none());
        assert_eq!(headers.get(HEADER_MSG_ID).unwrap().as_str(), "dlq.3");
    }

    fn urls(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:4222")).collect()
    }

    #[test]
    fn a_single_server_gets_one_replica() {
        assert_eq!(replicas_for_cluster(None, &[]), 1);
        assert_eq!(replicas_for_cluster(None, &urls(1)), 1);
    }

    #[test]
    fn a_cluster_gets_its_size_in_replicas_at_most_three() {
        assert_eq!(replicas_for_cluster(Some("c"), &urls(2)), 2);
        assert_eq!(replicas_for_cluster(Some("c"), &urls(3)), 3);
        assert_eq!(replicas_for_cluster(Some("c"), &urls(5)), 3);
    }

    #[test]
    fn a_cluster_that_advertises_no_urls_gets_three_replicas() {
        assert_eq!(replicas_for_cluster(Some("c"), &[]), 3);
    }

    #[test]
    fn a_url_advertised_twice_counts_once() {
        let twice = vec!["10.0.0.1:4222".to_owned(), "10.0.0.1:4222".to_owned()];
        assert_eq!(replicas_for_cluster(Some("c"), &twice), 1);
    }
}
