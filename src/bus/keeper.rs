//! Keeping a running service's consumer in place.
//!
//! A service whose consumer is deleted under it (by hand, or lost with a
//! cluster's data) gets nothing and is told nothing: the pull in flight ends
//! with a 409 once, and later pulls go unanswered. So each worker and wake
//! instance checks its consumer every 10 s and creates it again when
//! JetStream says, twice and 2 s apart, that it does not exist (a node that
//! has just restarted or become leader can answer "not found" for a consumer
//! that exists until it has caught up). It creates it with
//! `create_consumer_strict`, which nats-server 2.10 and later refuse for a
//! consumer that exists; 2.9 ignores the action and updates it to the
//! service's settings, as a starting service does.
//!
//! A wake consumer created again starts after the last acknowledged
//! completion the keeper saw, not at the beginning of the events stream:
//! starting there would post again every completion that was acknowledged
//! without a `delivered` ledger entry (those the session API refused, which
//! went to the dead letters) and read the whole history once more. A worker
//! consumer starts at the beginning of the task queue, which holds only what
//! was not acknowledged.

use std::time::Duration;

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
use async_nats::jetstream::stream::ConsumerCreateStrictErrorKind;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Bus, ServiceConsumer};

/// How often a running service checks its consumer.
const CHECK_INTERVAL: Duration = Duration::from_secs(10);

/// How long after a first "not found" the keeper asks again before it
/// believes it.
const CONFIRM_AFTER: Duration = Duration::from_secs(2);

/// What a check found.
#[derive(Debug)]
enum Found {
    /// The consumer exists, as the server describes it.
    Exists(Box<consumer::Info>),
    /// JetStream says it does not exist.
    Missing,
}

/// One service's keeper and what it remembers between checks.
struct Keeper {
    /// The service's connection.
    bus: Bus,
    /// The consumer and the settings the service gives it.
    wanted: ServiceConsumer,
    /// The highest ack floor seen (a stream sequence): everything up to it
    /// was acknowledged. A wake consumer created again starts after it.
    ack_floor: u64,
    /// The consumer's AckWait last warned about, so that one differing
    /// setting is one warning, not one every check.
    warned_ack_wait: Option<Duration>,
}

impl Bus {
    /// Keeps `wanted` in place until `stop` (see the module doc): checks it
    /// at once, then every 10 s while connected.
    pub(crate) async fn keep_consumer(self, wanted: ServiceConsumer, stop: CancellationToken) {
        let mut keeper = Keeper {
            bus: self,
            wanted,
            ack_floor: 0,
            warned_ack_wait: None,
        };
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = keeper.round() => {}
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(CHECK_INTERVAL) => {}
            }
        }
    }
}

impl Keeper {
    /// One check, and what follows from it.
    async fn round(&mut self) {
        if !crate::connect::is_connected(&self.bus.client) {
            return;
        }
        let found = match self.check().await {
            Ok(Found::Missing) => {
                tokio::time::sleep(CONFIRM_AFTER).await;
                self.check().await
            }
            found => found,
        };
        match found {
            Ok(Found::Exists(info)) => self.seen(&info),
            Ok(Found::Missing) => self.create_again().await,
            Err(error) => {
                // Transient (a leader election, NATS unreachable): the pulls
                // show it too. Checked again next round.
                debug!(%error, "Could not check that the consumer exists.");
            }
        }
    }

    /// Asks JetStream for the consumer.
    async fn check(&self) -> Result<Found, ConsumerInfoError> {
        let subjects = &self.bus.subjects;
        let stream = self
            .bus
            .js
            .get_stream_no_info(self.wanted.stream(subjects))
            .await
            .map_err(|_| ConsumerInfoError::new(ConsumerInfoErrorKind::InvalidName))?;
        match stream.consumer_info(self.wanted.name(subjects)).await {
            Ok(info) => Ok(Found::Exists(Box::new(info))),
            Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => Ok(Found::Missing),
            Err(error) => Err(error),
        }
    }

    /// Remembers the consumer's ack floor, and warns once when its AckWait
    /// is not this service's (`wakebus init` or another instance set it).
    fn seen(&mut self, info: &consumer::Info) {
        self.ack_floor = self.ack_floor.max(info.ack_floor.stream_sequence);
        debug!(consumer = %info.name, ack_floor = self.ack_floor, "Consumer checked.");
        let (theirs, ours) = (info.config.ack_wait, self.wanted.ack_wait());
        if theirs == ours {
            self.warned_ack_wait = None;
        } else if self.warned_ack_wait != Some(theirs) {
            self.warned_ack_wait = Some(theirs);
            warn!(consumer = %info.name, consumer_ack_wait = ?theirs, ack_wait = ?ours, "The consumer's AckWait is not this service's --ack-wait: work held longer than the shorter one is redelivered while it runs. Restart the service, or give every instance the same --ack-wait.");
        }
    }

    /// Creates the consumer again with the service's settings; a wake's
    /// starts after the last ack floor seen.
    async fn create_again(&mut self) {
        let subjects = &self.bus.subjects;
        let (stream, name) = (self.wanted.stream(subjects), self.wanted.name(subjects));
        let mut config = self.wanted.config(subjects);
        let from_sequence = match self.wanted {
            ServiceConsumer::Wake { .. } if self.ack_floor > 0 => {
                let start_sequence = self.ack_floor + 1;
                config.deliver_policy = DeliverPolicy::ByStartSequence { start_sequence };
                start_sequence
            }
            _ => 1,
        };
        let handle = match self.bus.js.get_stream_no_info(&stream).await {
            Ok(handle) => handle,
            Err(error) => {
                warn!(consumer = %name, %stream, %error, "The consumer does not exist and could not be created again; trying at the next check.");
                return;
            }
        };
        match handle.create_consumer_strict(config).await {
            Ok(_) => {
                warn!(consumer = %name, %stream, from_sequence, "The consumer did not exist; created it again with this service's settings.");
            }
            Err(error) if error.kind() == ConsumerCreateStrictErrorKind::AlreadyExists => {
                debug!(consumer = %name, %stream, "Another instance created the consumer again first.");
            }
            Err(error) => {
                warn!(consumer = %name, %stream, %error, "The consumer does not exist and could not be created again; trying at the next check.");
            }
        }
    }
}
