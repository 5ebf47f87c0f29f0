//! The durable consumers: one per worker pool, shared by its workers, and
//! the wake service's; and keeping a service's consumer in place while it
//! runs ([`Bus::keep_consumer`]).

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use backon::Retryable;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::provision::{is_transient, setup_backoff};
use super::{Bus, ProvisionError};

/// What provisioning does with a consumer that exists already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    /// Update it to this service's settings (a starting service).
    Update,
    /// Leave it as it is (`wakebus init`).
    Keep,
}

impl Bus {
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

/// How often a running service checks that its consumer still exists.
const CONSUMER_CHECK_INTERVAL: Duration = Duration::from_secs(10);

/// The consumer a running service pulls from, with the settings it gives it.
#[derive(Debug, Clone)]
pub(crate) enum ServiceConsumer {
    /// The consumer shared by the workers of a pool.
    Worker {
        /// The pool.
        pool: String,
        /// The worker's `--ack-wait`.
        ack_wait: Duration,
    },
    /// The consumer shared by the wake instances.
    Wake {
        /// The wake's `--ack-wait`.
        ack_wait: Duration,
        /// The wake's `--max-in-flight`.
        max_ack_pending: i64,
    },
}

impl Bus {
    /// Keeps `consumer` in place until `stop`: every 10 s, while connected,
    /// asks JetStream whether it exists, and creates it again, as the
    /// service did when it started, when JetStream says it does not (deleted
    /// by hand, or lost with a cluster's data). A service pulling from a
    /// consumer that is gone gets nothing, and nothing tells it: pulls to a
    /// missing consumer go unanswered (a request in flight when it was
    /// deleted ends with a 409 once), so without this it would wait idle
    /// until restarted.
    pub(crate) async fn keep_consumer(self, consumer: ServiceConsumer, stop: CancellationToken) {
        let mut every = tokio::time::interval(CONSUMER_CHECK_INTERVAL);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once, and the service has just made it.
        every.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => {}
            }
            if !crate::connect::is_connected(&self.client) {
                continue;
            }
            let restored = tokio::select! {
                () = stop.cancelled() => return,
                restored = self.restore_consumer(&consumer) => restored,
            };
            match restored {
                Ok(false) => {}
                Ok(true) => {
                    let (stream, name) = self.stream_and_name(&consumer);
                    warn!(consumer = %name, %stream, "The consumer no longer existed (deleted, or lost with the cluster's data); created it again with this service's settings. It delivers from the start of the stream.");
                }
                Err(error) => {
                    debug!(%error, "Could not check that the consumer exists; checking again later.");
                }
            }
        }
    }

    /// Creates `consumer` again, with its service's settings, if JetStream
    /// says it does not exist; returns whether it did.
    pub(crate) async fn restore_consumer(
        &self,
        consumer: &ServiceConsumer,
    ) -> Result<bool, ProvisionError> {
        let (stream, name) = self.stream_and_name(consumer);
        let handle =
            self.js
                .get_stream(&stream)
                .await
                .map_err(|source| ProvisionError::GetStream {
                    name: stream.clone(),
                    source,
                })?;
        match handle.consumer_info(&name).await {
            Ok(_) => return Ok(false),
            Err(error) if error.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => {}
            Err(source) => {
                return Err(ProvisionError::ConsumerInfo {
                    name,
                    stream,
                    source,
                });
            }
        }
        match consumer {
            ServiceConsumer::Worker { pool, ack_wait } => {
                self.worker_consumer(pool, *ack_wait).await?;
            }
            ServiceConsumer::Wake {
                ack_wait,
                max_ack_pending,
            } => {
                self.wake_consumer(*ack_wait, *max_ack_pending).await?;
            }
        }
        Ok(true)
    }

    /// The stream `consumer` reads and its name.
    fn stream_and_name(&self, consumer: &ServiceConsumer) -> (String, String) {
        match consumer {
            ServiceConsumer::Worker { pool, .. } => (
                self.subjects.tasks_stream(),
                self.subjects.worker_consumer(pool),
            ),
            ServiceConsumer::Wake { .. } => (
                self.subjects.events_stream(),
                self.subjects.wake_consumer().to_owned(),
            ),
        }
    }
}
