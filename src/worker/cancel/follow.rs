//! Keeping the registry current: the cancel bucket's watch (every record,
//! including those written while this worker was away) and the broadcasts
//! (at once, to running tasks), and whether the watch has caught up.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{CancelRegistry, Followed};
use crate::bus::Bus;
use crate::cancel::{CancelRecord, CancelTarget};

/// How long a starting worker waits for the cancel records that exist.
const LOAD_PATIENCE: Duration = Duration::from_secs(10);

/// How often a watch that may be behind is checked against the bucket, and
/// an ended one started again.
const CATCH_UP_CHECK: Duration = Duration::from_secs(1);

impl CancelRegistry {
    /// Follows the cancel bucket and the broadcasts until `stop`; returns
    /// once the records that existed at start are loaded (or after 10 s).
    pub(crate) async fn follow(
        self: &Arc<Self>,
        bus: &Bus,
        bucket: kv::Store,
        stop: CancellationToken,
    ) -> Result<(), async_nats::Error> {
        let stats = bus.client.statistics();
        let _ = self.followed.set(Followed {
            bucket: bucket.clone(),
            stats: stats.clone(),
        });
        let connects = stats.connects.load(Ordering::Acquire);
        let broadcasts = bus
            .client
            .subscribe(format!("{}.>", bus.subjects.cancel_broadcasts_prefix()))
            .await?;
        let watch = bucket.watch_with_history(">").await?;
        // Read from the server: the store's own status is what it cached
        // when it was opened.
        let state = bucket.stream.clone().info().await?.state.clone();
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
        let mut follower = Follower {
            registry: self.clone(),
            bucket,
            stats,
            prefix: format!("{}.", bus.subjects.cancel_broadcasts_prefix()),
            watch: Some(watch),
            catching_up: CatchUp {
                connects,
                last_revision: state.last_sequence,
                seen: 0,
                said_behind: false,
            },
            loaded: Some(loaded_tx),
        };
        if state.messages == 0 {
            follower.catching_up.caught_up(self);
            follower.loaded();
        }
        tokio::spawn(follower.run(broadcasts, stop));
        if tokio::time::timeout(LOAD_PATIENCE, loaded_rx)
            .await
            .is_err()
        {
            // The last record may have expired before it was delivered, so
            // that none comes marked as the last: the rest load as they come.
            warn!("The cancel records are still loading; starting anyway.");
        }
        Ok(())
    }
}

/// The task applying the watch's records and the broadcasts.
struct Follower {
    /// Where records go.
    registry: Arc<CancelRegistry>,
    /// The cancel bucket: its status tells whether the watch is behind.
    bucket: kv::Store,
    /// The client's statistics, whose connect count tells a reconnect.
    stats: Arc<async_nats::Statistics>,
    /// The broadcasts' subject prefix, before the record's key.
    prefix: String,
    /// The bucket's watch; `None` once it ended, until started again.
    watch: Option<kv::Watch>,
    /// Whether the watch has delivered what the bucket holds.
    catching_up: CatchUp,
    /// Tells `follow` the records that existed at start are loaded.
    loaded: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Follower {
    /// Applies records until `stop`.
    async fn run(mut self, mut broadcasts: async_nats::Subscriber, stop: CancellationToken) {
        let mut check = tokio::time::interval(CATCH_UP_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = check.tick(), if self.watch.is_none() || !self.registry.is_current() => {
                    self.check().await;
                }
                entry = next_entry(&mut self.watch) => self.watched(entry),
                Some(message) = broadcasts.next() => {
                    let key = message.subject.strip_prefix(self.prefix.as_str()).unwrap_or_default();
                    if let Some((target, record)) = decode(key, &message.payload) {
                        self.registry.apply(target, record);
                    }
                }
            }
        }
    }

    /// Applies what the watch delivered.
    fn watched(&mut self, entry: Option<Result<kv::Entry, kv::WatcherError>>) {
        match entry {
            Some(Ok(entry)) => {
                self.catching_up.saw(&self.registry, entry.revision);
                if entry.operation == kv::Operation::Put
                    && let Some((target, mut record)) = decode(&entry.key, &entry.value)
                {
                    // The server's clock, like the requests' stored times.
                    record.at = entry.created;
                    self.registry.apply(target, record);
                }
                if entry.delta == 0 {
                    self.loaded();
                }
            }
            Some(Err(error)) => warn!(%error, "Cancel watch error."),
            None => {
                warn!(
                    "Cancel watch ended; each task reads its own cancel records until it is started again."
                );
                self.loaded();
                self.watch = None;
                self.registry.fell_behind();
            }
        }
    }

    /// Starts an ended watch again, then tells whether it is behind.
    async fn check(&mut self) {
        if self.watch.is_none() {
            match tokio::time::timeout(CATCH_UP_CHECK, self.bucket.watch_with_history(">")).await {
                Ok(Ok(watch)) => {
                    info!("Cancel watch started again.");
                    self.watch = Some(watch);
                }
                _ => return,
            }
        }
        self.catching_up
            .check(&self.registry, &self.bucket, &self.stats)
            .await;
    }

    /// The records that existed at start are loaded (or never will be).
    fn loaded(&mut self) {
        if let Some(loaded) = self.loaded.take() {
            let _ = loaded.send(());
        }
    }
}

/// The watch's next entry; never, while there is no watch.
async fn next_entry(watch: &mut Option<kv::Watch>) -> Option<Result<kv::Entry, kv::WatcherError>> {
    match watch {
        Some(watch) => watch.next().await,
        None => std::future::pending().await,
    }
}

/// How far the watch is from holding what the bucket held after a connect.
#[derive(Debug)]
struct CatchUp {
    /// The connect count the bucket was last read after.
    connects: u64,
    /// The bucket's last revision then: the watch has caught up once it has
    /// delivered it.
    last_revision: u64,
    /// The highest revision the watch has delivered.
    seen: u64,
    /// Whether the log says the watch is behind.
    said_behind: bool,
}

impl CatchUp {
    /// The watch delivered `revision`.
    fn saw(&mut self, registry: &CancelRegistry, revision: u64) {
        self.seen = self.seen.max(revision);
        if self.seen >= self.last_revision {
            self.caught_up(registry);
        }
    }

    /// Reads the bucket's last revision after the latest connect; the watch
    /// has caught up if it delivered that one already, or if the bucket is
    /// empty (its last record expired before the watch delivered it).
    async fn check(
        &mut self,
        registry: &CancelRegistry,
        bucket: &kv::Store,
        stats: &async_nats::Statistics,
    ) {
        let connects = stats.connects.load(Ordering::Acquire);
        let mut stream = bucket.stream.clone();
        let Ok(Ok(info)) = tokio::time::timeout(CATCH_UP_CHECK, stream.info()).await else {
            return;
        };
        (self.connects, self.last_revision) = (connects, info.state.last_sequence);
        if info.state.messages == 0 || self.seen >= self.last_revision {
            self.caught_up(registry);
        } else if !self.said_behind {
            self.said_behind = true;
            info!(
                behind = self.last_revision - self.seen,
                "The cancel watch is behind the bucket after a reconnect; each task reads its own cancel records until it catches up."
            );
        }
    }

    /// Marks the registry current as of the connect the bucket was read after.
    fn caught_up(&mut self, registry: &CancelRegistry) {
        registry.caught_up(self.connects);
        if std::mem::take(&mut self.said_behind) {
            info!("The cancel watch has caught up; tasks check cancels from it again.");
        }
    }
}

/// A cancel record from its key and body; `None` if either is malformed.
fn decode(key: &str, body: &[u8]) -> Option<(CancelTarget, CancelRecord)> {
    Some((
        CancelTarget::from_key(key)?,
        serde_json::from_slice(body).ok()?,
    ))
}
