//! Keeping the registry current: the cancel bucket's watch (every record,
//! including those written while this worker was away) and the broadcasts
//! (at once, to running tasks), and whether the watch has caught up.
//!
//! The watch is current once it has delivered the bucket's last revision as
//! the stream's leader gave it after the client's latest connect. Checked
//! every second while it is not (after a reconnect, a watch error, or at
//! start): the check's read runs beside the loop, so broadcasts are not held
//! up meanwhile.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::{kv, stream};
use futures::StreamExt;
use time::OffsetDateTime;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{CancelRegistry, Followed, From};
use crate::bus::Bus;
use crate::cancel::{CancelRecord, CancelTarget};

/// How long a starting worker waits for the cancel records that exist.
const LOAD_PATIENCE: Duration = Duration::from_secs(10);

/// How often the watch is checked against the bucket while it is not
/// current (an ended one is started again), and how long one check or
/// restart may take.
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
            client: bus.client.clone(),
            stats: stats.clone(),
        });
        let connects = stats.connects.load(Ordering::Acquire);
        let broadcasts = bus
            .client
            .subscribe(format!("{}.>", bus.subjects.cancel_broadcasts_prefix()))
            .await?;
        let watch = bucket.watch_with_history(">").await?;
        // From the server: the store's own status is what it cached when it
        // was opened.
        let info = bucket.stream.clone().info().await?.clone();
        self.bucket_created(info.created);
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
        let (checked_tx, checked) = mpsc::channel(1);
        let (restarted_tx, restarted) = mpsc::channel(1);
        let mut follower = Follower {
            registry: self.clone(),
            bucket,
            stats,
            client: bus.client.clone(),
            prefix: format!("{}.", bus.subjects.cancel_broadcasts_prefix()),
            watch: Some(watch),
            catching_up: CatchUp {
                connects,
                behind: self.behind_count(),
                last_revision: info.state.last_sequence,
                created: info.created,
                seen: 0,
                said_behind: false,
            },
            checked_tx,
            checking: false,
            restarted_tx,
            restarting: false,
            epoch: 0,
            loaded: Some(loaded_tx),
        };
        if info.state.messages == 0 {
            follower.catching_up.caught_up(self);
            follower.loaded();
        }
        tokio::spawn(follower.run(broadcasts, checked, restarted, stop));
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

/// What a check read: the follower's epoch, the connect count and the
/// registry's behind count when it began, and the stream's info.
type Checked = (u64, u64, u64, Result<stream::Info, String>);

/// A watch started again (`None`: it could not be, and is asked for again at
/// the next tick), with the follower's epoch when it was asked for.
type Restarted = (u64, Option<kv::Watch>);

/// The task applying the watch's records and the broadcasts.
struct Follower {
    /// Where records go.
    registry: Arc<CancelRegistry>,
    /// The cancel bucket: its stream's info tells whether the watch is
    /// behind.
    bucket: kv::Store,
    /// The client's statistics, whose connect count tells a reconnect.
    stats: Arc<async_nats::Statistics>,
    /// The connection: nothing is asked while it is down.
    client: async_nats::Client,
    /// The broadcasts' subject prefix, before the record's key.
    prefix: String,
    /// The bucket's watch; `None` once it ended, until started again.
    watch: Option<kv::Watch>,
    /// Whether the watch has delivered what the bucket holds.
    catching_up: CatchUp,
    /// Where a check sends what it read.
    checked_tx: mpsc::Sender<Checked>,
    /// Whether a check is under way.
    checking: bool,
    /// Where a restart sends the watch it started.
    restarted_tx: mpsc::Sender<Restarted>,
    /// Whether a restart of the watch is under way.
    restarting: bool,
    /// Counts the times the watch fell behind: a check begun before the
    /// latest is stale.
    epoch: u64,
    /// Tells `follow` the records that existed at start are loaded.
    loaded: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Follower {
    /// Applies records until `stop`.
    async fn run(
        mut self,
        mut broadcasts: async_nats::Subscriber,
        mut checked: mpsc::Receiver<Checked>,
        mut restarted: mpsc::Receiver<Restarted>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(CATCH_UP_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                // Every second, not only while behind: a reconnect wakes
                // nothing else here when no record was written meanwhile.
                _ = tick.tick() => self.tick(),
                Some((epoch, connects, behind, info)) = checked.recv() => {
                    self.checking = false;
                    let loaded = self.loaded.is_none();
                    if epoch == self.epoch
                        && self.catching_up.checked(&self.registry, (connects, behind), info, loaded)
                    {
                        // A bucket made anew: the watch would go on after
                        // the old one's revisions and miss the new records.
                        info!("The cancel bucket was created again; watching it from its start.");
                        self.watch = None;
                        self.fell_behind();
                    }
                }
                Some((epoch, watch)) = restarted.recv() => {
                    self.restarting = false;
                    // Stale if the watch fell behind again since it was
                    // asked for (nothing does that while there is no watch
                    // today): asked for again at the next tick.
                    if let Some(watch) = watch
                        && epoch == self.epoch
                        && self.watch.is_none()
                    {
                        info!("Cancel watch started again.");
                        self.watch = Some(watch);
                        self.check();
                    }
                }
                entry = next_entry(&mut self.watch) => self.watched(entry),
                Some(message) = broadcasts.next() => {
                    let key = message.subject.strip_prefix(self.prefix.as_str()).unwrap_or_default();
                    if let Some((target, record)) = decode(key, &message.payload)
                        && self.registry.apply(target, record, From::Broadcast)
                    {
                        // Tasks read their records by key until the watch
                        // has delivered this cancel's (a check within a
                        // second tells).
                        self.fell_behind();
                    }
                }
            }
        }
    }

    /// Applies what the watch delivered.
    fn watched(&mut self, entry: Option<Result<kv::Entry, kv::WatcherError>>) {
        match entry {
            Some(Ok(entry)) => {
                // Applied before the watch can count as current with it.
                if entry.operation == kv::Operation::Put
                    && let Some((target, mut record)) = decode(&entry.key, &entry.value)
                {
                    // The server's clock, like the requests' stored times.
                    record.at = entry.created;
                    let revision = entry.revision;
                    self.registry
                        .apply(target, record, From::Stored { revision });
                }
                self.catching_up.saw(&self.registry, entry.revision);
                if entry.delta == 0 {
                    self.loaded();
                }
            }
            // The client recreates the watch's consumer after the last
            // revision it delivered; what was written meanwhile comes later.
            Some(Err(error)) => {
                warn!(%error, "Cancel watch error; each task reads its own cancel records until the watch has caught up.");
                self.fell_behind();
            }
            None => {
                warn!(
                    "Cancel watch ended; each task reads its own cancel records until it is started again."
                );
                self.loaded();
                self.watch = None;
                self.fell_behind();
            }
        }
    }

    /// Once a second: starts an ended watch again, or checks a watch that
    /// is not current against the bucket. Both run beside the loop, which
    /// goes on applying broadcasts meanwhile.
    fn tick(&mut self) {
        // A request made while the client reconnects is only queued, and a
        // long outage would fill its queue with them.
        if !crate::connect::is_connected(&self.client) {
            return;
        }
        if self.watch.is_some() {
            self.check();
        } else if !self.restarting {
            self.restarting = true;
            let (epoch, bucket) = (self.epoch, self.bucket.clone());
            let restarted_tx = self.restarted_tx.clone();
            tokio::spawn(async move {
                let restart = bucket.watch_with_history(">");
                let watch = tokio::time::timeout(CATCH_UP_CHECK, restart).await;
                let _ = restarted_tx
                    .send((epoch, watch.ok().and_then(Result::ok)))
                    .await;
            });
        }
    }

    /// Checks a watch that is not current against the bucket.
    fn check(&mut self) {
        if self.checking || self.registry.is_current() {
            return;
        }
        self.checking = true;
        let (epoch, connects) = (self.epoch, self.stats.connects.load(Ordering::Acquire));
        let behind = self.registry.behind_count();
        let mut stream = self.bucket.stream.clone();
        let checked_tx = self.checked_tx.clone();
        tokio::spawn(async move {
            let info = match tokio::time::timeout(CATCH_UP_CHECK, stream.info()).await {
                Ok(Ok(info)) => Ok(info.clone()),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("no answer".to_owned()),
            };
            let _ = checked_tx.send((epoch, connects, behind, info)).await;
        });
    }

    /// The watch may have missed records: not current until a check has
    /// read the bucket again and the watch has delivered its last revision.
    fn fell_behind(&mut self) {
        self.epoch += 1;
        self.catching_up.last_revision = u64::MAX;
        self.registry.fell_behind();
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
    /// The registry's behind count then ([`CancelRegistry::behind_count`]):
    /// the registry found behind since (a record read by key replacing a
    /// later broadcast) is not current by that read.
    behind: u64,
    /// The bucket's last revision then: the watch has caught up once it has
    /// delivered it.
    last_revision: u64,
    /// When the bucket's stream was created: one created again numbers its
    /// revisions from 1.
    created: OffsetDateTime,
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

    /// What a check read after connect `connects` (and behind count `behind`,
    /// `read_after`): the watch has caught up
    /// if it delivered the bucket's last revision already, or if the bucket
    /// is empty (its last record expired before the watch delivered it).
    /// `loaded`: the start's records are in, so a watch behind is news.
    /// Returns whether the bucket is a new one since the last check.
    fn checked(
        &mut self,
        registry: &CancelRegistry,
        read_after: (u64, u64),
        info: Result<stream::Info, String>,
        loaded: bool,
    ) -> bool {
        let (connects, behind) = read_after;
        let Ok(info) = info else {
            return false;
        };
        if info.created != self.created {
            (self.created, self.seen) = (info.created, 0);
            registry.bucket_created(info.created);
            return true;
        }
        (self.connects, self.behind, self.last_revision) =
            (connects, behind, info.state.last_sequence);
        if info.state.messages == 0 || self.seen >= self.last_revision {
            self.caught_up(registry);
        } else if loaded && !self.said_behind {
            self.said_behind = true;
            info!(
                seen = self.seen,
                last = self.last_revision,
                "The cancel watch is behind the bucket; each task reads its own cancel records until it catches up."
            );
        }
        false
    }

    /// Marks the registry current as of the connect the bucket was read
    /// after, unless it was found behind since: the next check decides.
    fn caught_up(&mut self, registry: &CancelRegistry) {
        if !registry.mark_current(self.connects, self.behind) {
            return;
        }
        if std::mem::take(&mut self.said_behind) {
            info!("The cancel watch has caught up; tasks check cancels from it again.");
        }
    }
}

/// A cancel record from its key and body; `None` if either is malformed.
pub(super) fn decode(key: &str, body: &[u8]) -> Option<(CancelTarget, CancelRecord)> {
    Some((
        CancelTarget::from_key(key)?,
        serde_json::from_slice(body).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cancel::{CancelRecord, CancelTarget};

    /// A read by key brings a session's first cancel after the second's
    /// broadcast: the registry is behind, and the watch delivering what it
    /// had seen already (the first cancel's revision) must not make it
    /// current again with the first cancel alone; only a check of the
    /// bucket made since can.
    #[test]
    fn a_registry_found_behind_by_a_read_is_not_made_current_by_an_earlier_check() {
        let registry = CancelRegistry::new(std::time::Duration::from_secs(3600));
        let mut catching_up = CatchUp {
            connects: 1,
            behind: registry.behind_count(),
            last_revision: 3,
            created: OffsetDateTime::UNIX_EPOCH,
            seen: 3,
            said_behind: false,
        };
        catching_up.caught_up(&registry);
        assert_eq!(registry.current_as_of.load(Ordering::Acquire), 1);
        let session = || CancelTarget::Session("tok".to_owned());
        let at = |ago: u64| CancelRecord {
            at: OffsetDateTime::now_utc() - std::time::Duration::from_secs(ago),
            silent: false,
        };
        registry.apply(session(), at(0), From::Broadcast);
        registry.apply(session(), at(60), From::Stored { revision: 3 });
        catching_up.saw(&registry, 3);
        assert_eq!(
            registry.current_as_of.load(Ordering::Acquire),
            0,
            "made current"
        );
        // As a check of the bucket made since leaves it: current once the
        // watch has delivered the revision it read.
        (catching_up.behind, catching_up.last_revision) = (registry.behind_count(), 4);
        catching_up.saw(&registry, 4);
        assert_eq!(registry.current_as_of.load(Ordering::Acquire), 1);
    }
}
