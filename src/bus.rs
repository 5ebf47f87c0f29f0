//! Bus provisioning: the streams, KV buckets and durable consumers wakebus
//! uses, created or updated idempotently and never deleted.

use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::{self, consumer, kv, stream};
use backon::{ExponentialBuilder, Retryable};
use tracing::{info, warn};

use crate::protocol::Subjects;

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
}

impl Default for BusSettings {
    fn default() -> Self {
        Self {
            history_max_age: default_history_max_age(),
            dead_letter_max_age: Duration::from_secs(30 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            replicas: None,
            session_lock_ttl: Duration::from_secs(30),
        }
    }
}

/// Events are kept for 7 days by default.
pub fn default_history_max_age() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
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

    async fn patiently<T, F, Fut>(attempt: F) -> Result<T, ProvisionError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ProvisionError>>,
    {
        attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(usize::MAX),
            )
            .when(is_transient)
            .notify(|err, delay| {
                warn!(error = %err, retry_in = ?delay, "Provisioning failed, NATS may not be up yet; will retry.");
            })
            .await
    }

    async fn provision_streams(&self, settings: &BusSettings) -> Result<Streams, ProvisionError> {
        let s = &self.subjects;
        self.ensure_stream(stream::Config {
            num_replicas: self.replicas_for(settings, &s.tasks_stream()).await?,
            name: s.tasks_stream(),
            subjects: vec![s.tasks_all()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: settings.duplicate_window,
            ..Default::default()
        })
        .await?;
        let events = self
            .ensure_stream(stream::Config {
                num_replicas: self.replicas_for(settings, &s.events_stream()).await?,
                name: s.events_stream(),
                subjects: vec![s.events_all()],
                retention: stream::RetentionPolicy::Limits,
                storage: stream::StorageType::File,
                max_age: settings.history_max_age,
                duplicate_window: settings.duplicate_window.min(settings.history_max_age),
                ..Default::default()
            })
            .await?;
        self.ensure_stream(stream::Config {
            num_replicas: self.replicas_for(settings, &s.dead_letter_stream()).await?,
            name: s.dead_letter_stream(),
            subjects: vec![s.dead_letters_all()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_age: settings.dead_letter_max_age,
            duplicate_window: settings.duplicate_window,
            ..Default::default()
        })
        .await?;
        let cancels = self
            .ensure_bucket(kv::Config {
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
            })
            .await?;
        Ok(Streams { events, cancels })
    }

    async fn provision_buckets(&self, settings: &BusSettings) -> Result<WakeState, ProvisionError> {
        let s = &self.subjects;
        let wake_ledger = self
            .ensure_bucket(kv::Config {
                bucket: s.wake_ledger_bucket(),
                description: "Completions already woken (the wake service's idempotency record)"
                    .to_owned(),
                history: 1,
                max_age: settings.history_max_age,
                storage: stream::StorageType::File,
                num_replicas: self
                    .replicas_for(settings, &format!("KV_{}", s.wake_ledger_bucket()))
                    .await?,
                ..Default::default()
            })
            .await?;
        let session_locks = self
            .ensure_bucket(kv::Config {
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
            })
            .await?;
        Ok(WakeState {
            wake_ledger,
            session_locks,
        })
    }

    async fn ensure_stream(
        &self,
        config: stream::Config,
    ) -> Result<stream::Stream, ProvisionError> {
        let name = config.name.clone();
        let created = match self.js.create_or_update_stream(config.clone()).await {
            // On a cluster, a stream another service has just created may
            // not be visible yet: creating it again then fails as a name or
            // subject clash. Once it is visible, updating it is what we want.
            Err(error) if is_creation_clash(&error) && self.js.get_stream(&name).await.is_ok() => {
                self.js.create_or_update_stream(config).await
            }
            other => other,
        };
        created.map_err(|source| ProvisionError::Stream {
            name: name.clone(),
            source,
        })?;
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
    async fn ensure_bucket(&self, config: kv::Config) -> Result<kv::Store, ProvisionError> {
        let name = config.bucket.clone();
        self.ensure_stream(stream::Config {
            name: format!("KV_{name}"),
            description: Some(config.description),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: config.history.max(1),
            max_age: config.max_age,
            storage: config.storage,
            allow_rollup: true,
            deny_delete: true,
            deny_purge: false,
            allow_direct: true,
            num_replicas: config.num_replicas.max(1),
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        })
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
        let stream = self.subjects.tasks_stream();
        let name = self.subjects.worker_consumer(pool);
        self.ensure_consumer(
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
        let stream = self.subjects.events_stream();
        self.ensure_consumer(
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

    async fn ensure_consumer(
        &self,
        stream: &str,
        config: consumer::pull::Config,
    ) -> Result<consumer::PullConsumer, ProvisionError> {
        let name = config.durable_name.clone().unwrap_or_default();
        let attempt =
            || async {
                let handle = self.js.get_stream(stream).await.map_err(|source| {
                    ProvisionError::GetStream {
                        name: stream.to_owned(),
                        source,
                    }
                })?;
                let consumer = handle
                    .create_consumer(config.clone())
                    .await
                    .map_err(|source| ProvisionError::Consumer {
                        name: name.clone(),
                        stream: stream.to_owned(),
                        source,
                    })?;
                info!(consumer = %name, stream, "Consumer ready.");
                Ok(consumer)
            };
        attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(usize::MAX),
            )
            .when(is_transient)
            .notify(|err, delay| {
                warn!(error = %err, retry_in = ?delay, "Consumer setup failed; will retry.");
            })
            .await
    }
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
fn is_stream_not_found(error: &jetstream::context::GetStreamError) -> bool {
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
