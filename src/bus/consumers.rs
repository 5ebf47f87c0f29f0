//! The durable consumers: one per worker pool, shared by its workers, and
//! the wake service's, each described by a [`ServiceConsumer`].

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use backon::Retryable;
use tracing::{info, warn};

use super::keeper::CONFIRM_AFTER;
use super::provision::{may_pass, setup_backoff};
use super::{Bus, ProvisionError};
use crate::protocol::Subjects;

/// What provisioning does with a consumer that exists already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    /// Update it to this service's settings (a starting service).
    Update,
    /// Leave it as it is (`wakebus init`).
    Keep,
}

/// A consumer a service pulls from, with the settings that service gives it.
#[derive(Debug)]
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

impl ServiceConsumer {
    /// The stream it reads.
    pub(crate) fn stream(&self, subjects: &Subjects) -> String {
        match self {
            Self::Worker { .. } => subjects.tasks_stream(),
            Self::Wake { .. } => subjects.events_stream(),
        }
    }

    /// Its durable name.
    pub(crate) fn name(&self, subjects: &Subjects) -> String {
        match self {
            Self::Worker { pool, .. } => subjects.worker_consumer(pool),
            Self::Wake { .. } => subjects.wake_consumer().to_owned(),
        }
    }

    /// The service's `--ack-wait`.
    pub(crate) fn ack_wait(&self) -> Duration {
        match self {
            Self::Worker { ack_wait, .. } | Self::Wake { ack_wait, .. } => *ack_wait,
        }
    }

    /// Its configuration, delivering from the start of the stream.
    pub(crate) fn config(&self, subjects: &Subjects) -> consumer::pull::Config {
        let common = consumer::pull::Config {
            durable_name: Some(self.name(subjects)),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: self.ack_wait(),
            // Unlimited: the worker itself ends a task after its maximum
            // number of attempts, with a `failed` completion, and the wake
            // never gives a completion up. A server-side limit would strand
            // a message silently instead.
            max_deliver: -1,
            ..Default::default()
        };
        match self {
            Self::Worker { pool, .. } => consumer::pull::Config {
                description: Some(format!("wakebus workers of pool {pool}")),
                filter_subject: subjects.task(pool),
                max_ack_pending: 100_000,
                ..common
            },
            Self::Wake {
                max_ack_pending, ..
            } => consumer::pull::Config {
                description: Some("wakebus wake service".to_owned()),
                filter_subject: subjects.done_events(),
                max_ack_pending: *max_ack_pending,
                ..common
            },
        }
    }
}

/// Creates or updates a consumer with `create`, lowering `config`'s
/// `max_ack_pending` to each limit a refusal names (the server's
/// `jetstream.limits.max_ack_pending`, the account's, the stream's consumer
/// limits: JetStream's error 10121, "consumer max ack pending exceeds
/// system limit of {limit}", the only place the server's limit shows; they
/// are checked in turn, so up to three refusals). `had` is the consumer's
/// own `max_ack_pending` (0 for a new one): lowering to it again at every
/// start is said at INFO, not WARN.
pub(super) async fn within_ack_pending_limits<T, E, F, Fut>(
    config: &mut consumer::pull::Config,
    had: i64,
    refusal: impl Fn(&E) -> Option<jetstream::Error>,
    mut create: F,
) -> Result<T, E>
where
    F: FnMut(consumer::pull::Config) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let asked = config.max_ack_pending;
    let mut tries = 0;
    let created = loop {
        match create(config.clone()).await {
            Err(error) if tries < ACK_PENDING_LIMITS => {
                match ack_pending_limit(refusal(&error), config.max_ack_pending) {
                    Some(limit) => config.max_ack_pending = limit,
                    None => break Err(error),
                }
            }
            done => break done,
        }
        tries += 1;
    };
    let limit = config.max_ack_pending;
    if created.is_ok() && limit < asked {
        let consumer = config.durable_name.as_deref().unwrap_or_default();
        if limit == had {
            info!(
                consumer,
                limit,
                "The consumer keeps the max_ack_pending limit the server, the account or the stream sets."
            );
        } else {
            warn!(
                consumer,
                asked,
                limit,
                "The server, the account or the stream limits a consumer's max_ack_pending below what this service asks for: using the limit, so no more than that many messages are held at once by all the instances sharing the consumer."
            );
        }
    }
    created
}

/// The limit `refused` names, if it refused a `max_ack_pending` of
/// `asked` for exceeding one below it.
fn ack_pending_limit(refused: Option<jetstream::Error>, asked: i64) -> Option<i64> {
    let refused = refused
        .filter(|e| e.error_code() == jetstream::ErrorCode::CONSUMER_MAX_PENDING_ACK_EXCESS)?;
    let text = refused.to_string();
    let (_, after) = text.split_once("limit of ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse::<i64>()
        .ok()
        .filter(|limit| *limit > 0 && *limit < asked)
}

/// How many limits a consumer's `max_ack_pending` can meet, each named by
/// its own refusal: the server's, the account's and the stream's.
const ACK_PENDING_LIMITS: usize = 3;

/// The JetStream refusal behind a failed consumer create or update.
fn refusal(error: &ProvisionError) -> Option<jetstream::Error> {
    match error {
        ProvisionError::Consumer { source, .. } => match source.kind() {
            jetstream::stream::ConsumerErrorKind::JetStream(refused) => Some(refused),
            _ => None,
        },
        ProvisionError::CreateConsumer { source, .. } => strict_refusal(source),
        _ => None,
    }
}

/// The JetStream refusal behind a failed strict create.
pub(super) fn strict_refusal(
    error: &jetstream::stream::ConsumerCreateStrictError,
) -> Option<jetstream::Error> {
    match error.kind() {
        jetstream::stream::ConsumerCreateStrictErrorKind::JetStream(refused) => Some(refused),
        _ => None,
    }
}

/// What an existing consumer is updated to: its own settings, with those
/// the service's guarantees rest on (`ours`) written over them. The rest
/// an operator may have set (`max_waiting`, which the server refuses to
/// change, so that rebuilding the config from defaults made every start
/// fail; replicas, storage, `max_batch`, metadata, a pause) are kept, and
/// so is where it delivers from (the server refuses to change that too).
fn updated(current: consumer::Config, ours: consumer::pull::Config) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: ours.durable_name,
        description: ours.description,
        ack_policy: ours.ack_policy,
        ack_wait: ours.ack_wait,
        max_deliver: ours.max_deliver,
        filter_subject: ours.filter_subject,
        filter_subjects: ours.filter_subjects,
        max_ack_pending: ours.max_ack_pending,
        // A consumer delivering headers only would hand out empty tasks.
        headers_only: ours.headers_only,
        // A backoff takes the place of AckWait (a shorter step would hand
        // a running task to another worker); an inactive threshold deletes
        // even a durable consumer, and a wake's made again reads the
        // history from its start; a `max_expires` under the wake's 30 s
        // has every pull of it refused.
        backoff: ours.backoff,
        inactive_threshold: ours.inactive_threshold,
        max_expires: ours.max_expires,
        name: current.name,
        deliver_policy: current.deliver_policy,
        replay_policy: current.replay_policy,
        rate_limit: current.rate_limit,
        sample_frequency: current.sample_frequency,
        max_waiting: current.max_waiting,
        max_batch: current.max_batch,
        max_bytes: current.max_bytes,
        num_replicas: current.num_replicas,
        memory_storage: current.memory_storage,
        metadata: current.metadata,
        priority_policy: current.priority_policy,
        priority_groups: current.priority_groups,
        priority_timeout: current.priority_timeout,
        pause_until: current.pause_until,
    }
}

/// Which of the settings [`updated`] writes over, AckWait and
/// `max_ack_pending` aside (instances may differ in those, and AckWait is
/// watched on its own), the consumer no longer has: changed on the server
/// under running services, each breaks a guarantee (a server-side
/// `max_deliver` strands a task that keeps failing, with no completion; a
/// filter that is not the pool's hands out other pools' tasks or none; a
/// consumer delivering headers only hands out empty tasks).
pub(crate) fn drifted(
    current: &consumer::Config,
    ours: &consumer::pull::Config,
) -> Vec<&'static str> {
    let mut drifted = Vec::new();
    if current.ack_policy != ours.ack_policy {
        drifted.push("ack_policy");
    }
    if current.max_deliver != ours.max_deliver
        && !(current.max_deliver <= 0 && ours.max_deliver <= 0)
    {
        drifted.push("max_deliver");
    }
    if current.filter_subject != ours.filter_subject
        || current.filter_subjects != ours.filter_subjects
    {
        drifted.push("filter_subject");
    }
    if current.headers_only != ours.headers_only {
        drifted.push("headers_only");
    }
    drifted
}

impl Bus {
    /// Creates or updates the durable pull consumer shared by all workers of `pool`.
    pub async fn worker_consumer(
        &self,
        pool: &str,
        ack_wait: Duration,
    ) -> Result<consumer::PullConsumer, ProvisionError> {
        let wanted = ServiceConsumer::Worker {
            pool: pool.to_owned(),
            ack_wait,
        };
        let consumer = self.ensure_consumer(&wanted, Existing::Update).await?;
        Ok(consumer.expect("an updated consumer is returned"))
    }

    /// Creates or updates the durable pull consumer shared by all wake instances.
    pub async fn wake_consumer(
        &self,
        ack_wait: Duration,
        max_ack_pending: i64,
    ) -> Result<consumer::PullConsumer, ProvisionError> {
        let wanted = ServiceConsumer::Wake {
            ack_wait,
            max_ack_pending,
        };
        let consumer = self.ensure_consumer(&wanted, Existing::Update).await?;
        Ok(consumer.expect("an updated consumer is returned"))
    }

    /// Creates the consumers a deployment needs (the wake service's, and the
    /// workers' of `pools`) where they are missing, with the defaults (30 s
    /// AckWait); existing ones keep their settings, which the running
    /// services chose with `--ack-wait` and `--max-in-flight`.
    pub async fn init_consumers(&self, pools: &[String]) -> Result<(), ProvisionError> {
        let ack_wait = Duration::from_secs(30);
        for pool in pools {
            let wanted = ServiceConsumer::Worker {
                pool: pool.clone(),
                ack_wait,
            };
            self.ensure_consumer(&wanted, Existing::Keep).await?;
        }
        let wanted = ServiceConsumer::Wake {
            ack_wait,
            max_ack_pending: crate::wake::DEFAULT_MAX_IN_FLIGHT,
        };
        self.ensure_consumer(&wanted, Existing::Keep).await?;
        Ok(())
    }

    /// The consumer, or `None` when it existed and was kept. An existing
    /// consumer keeps where it delivers from (the server refuses to change
    /// it): one a running service created again after it was deleted starts
    /// after what had been acknowledged (see `keeper.rs`).
    async fn ensure_consumer(
        &self,
        wanted: &ServiceConsumer,
        existing: Existing,
    ) -> Result<Option<consumer::PullConsumer>, ProvisionError> {
        let (stream, name) = (wanted.stream(&self.subjects), wanted.name(&self.subjects));
        let stream = stream.as_str();
        let attempt = || async {
            let mut config = wanted.config(&self.subjects);
            let handle =
                self.js
                    .get_stream(stream)
                    .await
                    .map_err(|source| ProvisionError::GetStream {
                        name: stream.to_owned(),
                        source,
                    })?;
            let mut made_anew = false;
            // Its own, to tell a limit met again from one met anew.
            let mut had_ack_pending = 0;
            match self.find_consumer(&handle, &name).await {
                Ok(Some(_)) if existing == Existing::Keep => {
                    info!(consumer = %name, stream, "Consumer exists; its settings are kept.");
                    return Ok(None);
                }
                Ok(Some(current)) => {
                    had_ack_pending = current.config.max_ack_pending;
                    config = updated(current.config.clone(), config);
                    let (theirs, ours) = (current.config.ack_wait, config.ack_wait);
                    if ours < theirs && current.num_ack_pending > 0 {
                        // The server would measure the work other instances
                        // hold, kept alive by the longer AckWait, against
                        // this one at once, and redeliver it while it runs.
                        warn!(consumer = %name, stream, consumer_ack_wait = ?theirs, ack_wait = ?ours, held = current.num_ack_pending, "This service's --ack-wait is shorter than its consumer's, and other instances hold work now: keeping the consumer's (this service keeps its own work alive by the shorter one). Start it again once nothing is held to shorten it, or give every instance the same --ack-wait.");
                        config.ack_wait = theirs;
                    } else if ours != theirs {
                        warn!(consumer = %name, stream, was = ?theirs, now = ?ours, "The consumer's AckWait changes: every instance sharing it should run with the same --ack-wait.");
                    }
                }
                Err(error) => {
                    // Not knowing whether it exists, do not overwrite it: a
                    // create with the default start would be refused by one
                    // the keeper made again from a later sequence (or undo a
                    // kept one's settings). A timeout is retried.
                    return Err(ProvisionError::ConsumerInfo {
                        name: name.clone(),
                        stream: stream.to_owned(),
                        source: error,
                    });
                }
                Ok(None) => made_anew = true,
            }
            // Believed missing, it is created strictly: nats-server 2.10
            // and later refuse the create if it exists after all (with
            // other settings), and the next attempt reads it.
            let create = |config: consumer::pull::Config| async {
                if made_anew {
                    handle
                        .create_consumer_strict(config)
                        .await
                        .map_err(|source| ProvisionError::CreateConsumer {
                            name: name.clone(),
                            stream: stream.to_owned(),
                            source,
                        })
                } else {
                    handle.create_consumer(config).await.map_err(|source| {
                        ProvisionError::Consumer {
                            name: name.clone(),
                            stream: stream.to_owned(),
                            source,
                        }
                    })
                }
            };
            let consumer =
                within_ack_pending_limits(&mut config, had_ack_pending, refusal, create).await?;
            // One that existed after all (the same settings, which the
            // strict create takes) has delivered something.
            let made_anew = made_anew && consumer.cached_info().delivered.stream_sequence == 0;
            // Made anew, the wake's reads the whole history again: a
            // completion its ledger does not record delivered (one the
            // session API refused, dead-lettered) is posted again. The
            // running wake's keeper starts it after the floor it saw; a
            // start or `init` knows of none.
            let completions = consumer.cached_info().num_pending;
            let rereads =
                made_anew && matches!(wanted, ServiceConsumer::Wake { .. }) && completions > 0;
            if rereads && self.no_wake_ever_recorded().await {
                // Most likely the deployment's first wake, started after
                // its workers: nothing was woken that could be again.
                info!(consumer = %name, stream, completions, "No wake has taken a session lock or written the wake ledger here (a new deployment whose workers ran first, or its buckets emptied): the wake consumer is made over the completions stored, and they are woken now. Had the wake ledger been deleted, those already woken would be posted again.");
            } else if rereads {
                warn!(consumer = %name, stream, completions, "The wake consumer was missing and is made anew from the start of the history: every completion in it is read again, and one the wake ledger does not record delivered (a wake the session API refused) is posted again. If it was deleted by mistake, see OPERATIONS.md, \"Consumers deleted under running services\".");
            }
            info!(consumer = %name, stream, "Consumer ready.");
            Ok(Some(consumer))
        };
        attempt
            .retry(setup_backoff())
            .when(may_pass)
            .notify(|err, delay| {
                warn!(error = %err, retry_in = ?delay, "Consumer setup failed; will retry.");
            })
            .await
    }

    /// Whether no wake of this deployment has ever taken a session lock or
    /// recorded a wake in its ledger (both streams' last sequence is 0, or
    /// they do not exist yet): every post takes its session's lock first,
    /// so nothing was posted that a consumer made now could post again.
    /// Unknown (the streams cannot be read) counts as recorded.
    async fn no_wake_ever_recorded(&self) -> bool {
        let s = &self.subjects;
        for bucket in [s.session_lock_bucket(), s.wake_ledger_bucket()] {
            match self.js.get_stream(Subjects::bucket_stream(&bucket)).await {
                Ok(stream) if stream.cached_info().state.last_sequence == 0 => {}
                Err(error) if super::is_stream_not_found(&error) => {}
                _ => return false,
            }
        }
        true
    }

    /// The consumer's info, or `None` when JetStream says it does not
    /// exist. A node that has just restarted or become leader can say so of
    /// a consumer that exists (see `keeper.rs`): nats-server 2.10 and later
    /// then refuse the strict create that follows if its settings differ,
    /// but 2.9 ignores its action and would update the consumer (shortening
    /// the AckWait of work other instances hold, or undoing `init`'s
    /// keeping). A cluster being upgraded may have its meta leader, which
    /// handles the create, on 2.9 whatever the node this client talks to
    /// runs, so on a stream that has consumers a "not found" is asked again
    /// after [`CONFIRM_AFTER`] whatever the version.
    async fn find_consumer(
        &self,
        handle: &jetstream::stream::Stream,
        name: &str,
    ) -> Result<Option<consumer::Info>, jetstream::context::ConsumerInfoError> {
        use jetstream::context::ConsumerInfoErrorKind::NotFound;
        match handle.consumer_info(name).await {
            Ok(info) => return Ok(Some(info)),
            Err(error) if error.kind() != NotFound => return Err(error),
            Err(_) => {}
        }
        if handle.cached_info().state.consumer_count == 0 {
            return Ok(None);
        }
        tokio::time::sleep(CONFIRM_AFTER).await;
        match handle.consumer_info(name).await {
            Ok(info) => Ok(Some(info)),
            Err(error) if error.kind() == NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JetStream refusal as the server sends it.
    fn refusal(err_code: u64, description: &str) -> Option<jetstream::Error> {
        let body =
            serde_json::json!({"code": 400, "err_code": err_code, "description": description});
        Some(serde_json::from_value(body).expect("a JetStream error"))
    }

    #[test]
    fn the_limit_a_max_ack_pending_refusal_names_is_read_only_when_below_what_was_asked() {
        let said = "consumer max ack pending exceeds system limit of 500";
        assert_eq!(ack_pending_limit(refusal(10121, said), 100_000), Some(500));
        assert_eq!(ack_pending_limit(refusal(10121, said), 500), None);
        assert_eq!(
            ack_pending_limit(refusal(10121, "something else"), 100_000),
            None
        );
        assert_eq!(ack_pending_limit(refusal(10052, said), 100_000), None);
        assert_eq!(ack_pending_limit(None, 100_000), None);
    }
}
