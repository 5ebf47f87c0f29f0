//! The worker's view of cancellations: records (from the KV bucket, live)
//! and the tasks running here, under one lock so no cancel slips between a
//! task's check and its start.
//!
//! The watch is the fast path, and it can fall behind: cancels written
//! while this worker was cut off from NATS reach it only once the watch has
//! caught up after the reconnect (its broadcasts are lost for good), which
//! can take seconds when the server lost the watch's consumer, while tasks
//! arrive at once. Until the watch has delivered everything the bucket held
//! after the latest (re)connect, each task reads its own two records
//! directly before it starts.
//!
//! - `mod.rs`: the registry, and the checks a task makes before it starts;
//! - `follow.rs`: keeping the registry current from the bucket's watch and
//!   the broadcasts, and telling when the watch is behind.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use async_nats::jetstream::stream::{LastRawMessageError, LastRawMessageErrorKind};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::cancel::{CancelRecord, CancelTarget};

mod follow;

/// Where a cancel record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum From {
    /// The bucket (its watch, or a read by key): as stored, with the
    /// server's time.
    Stored {
        /// The bucket's revision (its stream's sequence) of the write.
        revision: u64,
    },
    /// A broadcast: with the server's time as the canceller read it back,
    /// or, when it could not, the canceller's own.
    Broadcast,
}

/// Why a run was stopped before it ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopReason {
    /// Its time limit passed.
    Timeout,
    /// It was cancelled; `silent` spares the session the results.
    Cancelled {
        /// Do not wake the session.
        silent: bool,
    },
}

/// A task running on this worker.
#[derive(Debug)]
struct Running {
    /// Its delegation.
    delegation_id: String,
    /// Its session's subject token.
    session_token: String,
    /// When JetStream stored its request.
    stored_at: OffsetDateTime,
    /// Stops the run.
    stop: CancellationToken,
    /// Why it was stopped, set by whoever stops it.
    reason: Arc<OnceLock<StopReason>>,
}

/// What the registry's lock guards.
#[derive(Debug, Default)]
struct Inner {
    /// Every cancel record known, younger than `keep`, and where it came
    /// from.
    records: HashMap<CancelTarget, (CancelRecord, From)>,
    /// How long a record is kept: as long as the cancel bucket keeps it
    /// (its max age), after which no request it could stop is still queued.
    keep: Duration,
    /// Runs in progress, by a local id.
    running: HashMap<u64, Running>,
    /// Next local id.
    next_id: u64,
    /// When the cancel bucket was created, the latest the follower or a
    /// task's read by key found:
    /// a bucket created again numbers its revisions from 1 anew, so of two
    /// stored records on either side of this time the later is the newer
    /// write, whatever their revisions. `None` until known.
    bucket_created: Option<OffsetDateTime>,
    /// When records older than `keep` were last forgotten: once a
    /// [`PRUNE_EVERY`], not at every record, which made loading a bucket
    /// of N records at start N²/2 steps under the lock.
    pruned_at: Option<std::time::Instant>,
}

/// How often a registry forgets records older than it keeps them.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

impl Inner {
    /// The record that cancels a task: two lookups, not a scan of every
    /// record, as this runs for every task.
    fn cancelling(
        &self,
        delegation_id: &str,
        session_token: &str,
        stored_at: OffsetDateTime,
    ) -> Option<&CancelRecord> {
        let by_delegation = self
            .records
            .get(&CancelTarget::Delegation(delegation_id.to_owned()))
            .map(|(record, _)| record);
        let by_session = self
            .records
            .get(&CancelTarget::Session(session_token.to_owned()))
            .map(|(record, _)| record)
            .filter(|record| stored_at <= record.at);
        by_delegation.or(by_session)
    }

    /// Whether a stored write (`at`, `revision`) is older than the stored
    /// one kept: written in the bucket before it was created again, or
    /// earlier (a lower revision) in the same bucket. Revisions, not times,
    /// order one bucket's writes: the leader's clock may differ from the
    /// last leader's.
    fn written_before(
        &self,
        (at, revision): (OffsetDateTime, u64),
        (kept_at, kept_revision): (OffsetDateTime, u64),
    ) -> bool {
        match self.bucket_created {
            Some(created) if (at < created) != (kept_at < created) => at < created,
            _ => revision < kept_revision,
        }
    }
}

/// How long a task waits for its cancel records read by key: an answer
/// comes in milliseconds, or not at all (no leader, or a role that may not
/// read them).
const READ_PATIENCE: Duration = Duration::from_secs(5);

/// Why a task's cancel records could not be read by key.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    /// No answer in time.
    #[error("no answer within {READ_PATIENCE:?}")]
    TimedOut,
    /// The stream refused or failed the read.
    #[error(transparent)]
    Get(#[from] LastRawMessageError),
    /// The stream's info, which tells when the bucket was created, could
    /// not be read.
    #[error("cannot read the cancel bucket's info: {0}")]
    Info(#[from] async_nats::jetstream::stream::InfoError),
}

/// Cancel records and running tasks.
#[derive(Debug, Default)]
pub(crate) struct CancelRegistry {
    /// Everything, under one lock (never held across an await).
    inner: Mutex<Inner>,
    /// What is followed, once `follow` has started.
    followed: OnceLock<Followed>,
    /// The client's connect count as of which the watch has delivered every
    /// record the bucket held; 0 before that is known (the client counts
    /// its first connect as 1).
    current_as_of: AtomicU64,
    /// How many times the watch was found behind: a task that checked its
    /// cancels at one count is registered only at the same count (else it
    /// checks again), so a watch found behind in between is not missed.
    behind_count: AtomicU64,
}

/// Why a run was not registered.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// A record cancels it.
    Cancelled(CancelRecord),
    /// The watch was found behind since the task checked its cancels: it
    /// checks them again.
    Behind,
}

/// The bucket a registry follows and the connection it follows it on.
#[derive(Debug)]
struct Followed {
    /// The cancel bucket, read directly while the watch may be behind.
    bucket: kv::Store,
    /// The connection: while it is down, nothing says the watch is current.
    client: async_nats::Client,
    /// The client's statistics, whose connect count tells a reconnect.
    stats: Arc<async_nats::Statistics>,
}

/// Unregisters a run when dropped.
pub(crate) struct RunGuard {
    /// The registry.
    registry: Arc<CancelRegistry>,
    /// The run's local id.
    id: u64,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.registry
            .inner
            .lock()
            .expect("cancel registry")
            .running
            .remove(&self.id);
    }
}

fn matches(
    target: &CancelTarget,
    record: &CancelRecord,
    delegation_id: &str,
    session_token: &str,
    stored_at: OffsetDateTime,
) -> bool {
    match target {
        CancelTarget::Delegation(id) => id == delegation_id,
        CancelTarget::Session(token) => token == session_token && stored_at <= record.at,
    }
}

impl CancelRegistry {
    /// A registry forgetting records older than `keep` (the cancel bucket's
    /// max age), so a long-lived worker's memory does not grow with every
    /// cancel ever issued.
    pub(crate) fn new(keep: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                keep,
                ..Inner::default()
            }),
            ..Self::default()
        }
    }

    /// Records a cancel and stops every matching run. Returns whether it is
    /// a broadcast later than the stored record kept for its target: most
    /// often a second cancel whose record the watch has not delivered yet,
    /// which the stored record keeps out, so the caller must not take the
    /// watch for current until it has (a task checked meanwhile would be
    /// judged by the first cancel alone).
    pub(crate) fn apply(&self, target: CancelTarget, record: CancelRecord, from: From) -> bool {
        let mut inner = self.inner.lock().expect("cancel registry");
        for run in inner.running.values() {
            if matches(
                &target,
                &record,
                &run.delegation_id,
                &run.session_token,
                run.stored_at,
            ) {
                info!(delegation_id = %run.delegation_id, silent = record.silent, "Cancel received; interrupting the task.");
                let _ = run.reason.set(StopReason::Cancelled {
                    silent: record.silent,
                });
                run.stop.cancel();
            }
        }
        // A stored record, with the server's time, replaces what a
        // broadcast brought, whose time may be the canceller's clock, and
        // no broadcast replaces it, whichever comes first (the watch usually
        // does). Otherwise the later write wins: a watch behind may deliver
        // a key's older write after a read by key brought its latest, and
        // broadcasts may bring a session's two cancels in either order; an
        // older one kept would let requests stored between the two start.
        let mut ahead_of_watch = false;
        match (inner.records.get(&target), from) {
            (Some((kept, From::Stored { .. })), From::Broadcast) => {
                ahead_of_watch = record.at > kept.at;
                if ahead_of_watch {
                    // Under the lock registering takes: a task checked
                    // before this is not registered on the old record.
                    self.fell_behind_locked();
                }
            }
            (Some((kept, From::Broadcast)), From::Broadcast) if kept.at > record.at => {}
            // A later broadcast replaced by an earlier stored record: most
            // often a read by key that raced the session's second cancel.
            // That cancel is not kept until the watch delivers its record,
            // so tasks read theirs by key meanwhile (one check more when
            // the broadcast was only timed by a canceller's clock ahead).
            (Some((kept, From::Broadcast)), From::Stored { .. }) if kept.at > record.at => {
                self.fell_behind_locked();
                inner.records.insert(target, (record, from));
            }
            (Some((kept, From::Stored { revision: theirs })), From::Stored { revision })
                if inner.written_before((record.at, revision), (kept.at, *theirs)) => {}
            // Older than the bucket keeps records: nothing it could stop
            // is still queued (and the bucket has let it go).
            _ if record.at < OffsetDateTime::now_utc() - inner.keep => {}
            _ => {
                inner.records.insert(target, (record, from));
            }
        }
        if inner.pruned_at.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
            inner.pruned_at = Some(std::time::Instant::now());
            let cutoff = OffsetDateTime::now_utc() - inner.keep;
            inner.records.retain(|_, (record, _)| record.at >= cutoff);
        }
        ahead_of_watch
    }

    /// Records when the cancel bucket was created (at start, and once it
    /// is found created again).
    fn bucket_created(&self, at: OffsetDateTime) {
        // The latest: a read that began before the follower found the
        // bucket created again may bring the old time back.
        let mut inner = self.inner.lock().expect("cancel registry");
        inner.bucket_created = inner.bucket_created.max(Some(at));
    }

    /// How many cancel records are held.
    #[cfg(test)]
    fn records(&self) -> usize {
        self.inner.lock().expect("cancel registry").records.len()
    }

    /// The record that cancels a task, if one is known.
    pub(crate) fn cancelled(
        &self,
        delegation_id: &str,
        session_token: &str,
        stored_at: OffsetDateTime,
    ) -> Option<CancelRecord> {
        self.inner
            .lock()
            .expect("cancel registry")
            .cancelling(delegation_id, session_token, stored_at)
            .cloned()
    }

    /// Whether the watch is known to hold every record the bucket does: it
    /// caught up after the client's latest (re)connect, and the client is
    /// connected. A registry that follows nothing has nothing to catch up
    /// with.
    pub(crate) fn is_current(&self) -> bool {
        self.followed.get().is_none_or(|followed| {
            self.current_as_of.load(Ordering::Acquire)
                == followed.stats.connects.load(Ordering::Acquire)
                && followed.client.connection_state() == async_nats::connection::State::Connected
        })
    }

    /// Completes once the watch is current (looked at every 100 ms).
    pub(crate) async fn until_current(&self) {
        while !self.is_current() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Reads the records that could cancel one task (its delegation's and
    /// its session's) from the stream's leader, which has every record
    /// stored (a replica may lag), and applies them, for a task about to
    /// start while the watch may be behind.
    pub(crate) async fn read_directly(
        &self,
        delegation_id: &str,
        session_token: &str,
    ) -> Result<(), ReadError> {
        let Some(followed) = self.followed.get() else {
            return Ok(());
        };
        let read = |target: CancelTarget| async move {
            let subject = format!("{}{}", followed.bucket.prefix, target.key());
            match followed
                .bucket
                .stream
                .get_last_raw_message_by_subject(&subject)
                .await
            {
                Ok(message) => Ok(Some((target, message))),
                Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(error) => Err(ReadError::Get(error)),
            }
        };
        let both = futures::future::try_join(
            read(CancelTarget::Delegation(delegation_id.to_owned())),
            read(CancelTarget::Session(session_token.to_owned())),
        );
        let (by_delegation, by_session, created) = tokio::time::timeout(READ_PATIENCE, async {
            let both = both.await?;
            // Read after the records: a bucket created again before they
            // were read is known here, and its records order by it (the
            // follower finds it later, at its next check).
            let info = followed.bucket.stream.get_info().await?;
            Ok::<_, ReadError>((both.0, both.1, info.created))
        })
        .await
        .map_err(|_| ReadError::TimedOut)??;
        self.bucket_created(created);
        // A delete or purge marker has an empty body, which is no record.
        for (target, message) in [by_delegation, by_session].into_iter().flatten() {
            if let Ok(mut record) = serde_json::from_slice::<CancelRecord>(&message.payload) {
                record.at = message.time;
                let revision = message.sequence;
                self.apply(target, record, From::Stored { revision });
            }
        }
        Ok(())
    }

    /// Marks the watch current as of connect `connects`, unless it was
    /// found behind since the behind count was `behind` (then a later check
    /// decides). Under the lock that finding it behind takes, so that the
    /// two cannot interleave between the comparison and the mark.
    fn mark_current(&self, connects: u64, behind: u64) -> bool {
        let _inner = self.inner.lock().expect("cancel registry");
        let current = self.behind_count.load(Ordering::Acquire) == behind;
        if current {
            self.current_as_of.store(connects, Ordering::Release);
        }
        current
    }

    /// Marks the watch behind, whatever the connection does.
    fn fell_behind(&self) {
        let _inner = self.inner.lock().expect("cancel registry");
        self.fell_behind_locked();
    }

    /// [`Self::fell_behind`] for a caller that holds the registry's lock.
    fn fell_behind_locked(&self) {
        self.current_as_of.store(0, Ordering::Release);
        self.behind_count.fetch_add(1, Ordering::AcqRel);
    }

    /// How many times the watch was found behind so far: taken before a
    /// task checks its cancels, and given to [`Self::register`].
    pub(crate) fn behind_count(&self) -> u64 {
        self.behind_count.load(Ordering::Acquire)
    }

    /// Registers a run about to start whose cancels were checked when the
    /// watch had been found behind `checked_at` times ([`Self::behind_count`]),
    /// or says why not: the record that cancels it, or that the watch was
    /// found behind since (check again).
    pub(crate) fn register(
        self: &Arc<Self>,
        delegation_id: &str,
        session_token: &str,
        stored_at: OffsetDateTime,
        run: (CancellationToken, Arc<OnceLock<StopReason>>),
        checked_at: u64,
    ) -> Result<RunGuard, Refusal> {
        let (stop, reason) = run;
        let mut inner = self.inner.lock().expect("cancel registry");
        if let Some(record) = inner.cancelling(delegation_id, session_token, stored_at) {
            return Err(Refusal::Cancelled(record.clone()));
        }
        if self.behind_count() != checked_at {
            return Err(Refusal::Behind);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.running.insert(
            id,
            Running {
                delegation_id: delegation_id.to_owned(),
                session_token: session_token.to_owned(),
                stored_at,
                stop,
                reason,
            },
        );
        Ok(RunGuard {
            registry: self.clone(),
            id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a run of `delegation` for session `token`, its request stored
    /// `stored_ago` seconds ago, is refused.
    fn refused(
        registry: &Arc<CancelRegistry>,
        delegation: &str,
        token: &str,
        stored_ago: u64,
    ) -> bool {
        registry
            .register(
                delegation,
                token,
                OffsetDateTime::now_utc() - Duration::from_secs(stored_ago),
                (CancellationToken::new(), Arc::new(OnceLock::new())),
                registry.behind_count(),
            )
            .is_err()
    }

    fn record(age: Duration) -> CancelRecord {
        CancelRecord {
            at: OffsetDateTime::now_utc() - age,
            silent: false,
        }
    }

    #[test]
    fn an_older_session_cancel_broadcast_late_does_not_replace_a_newer_one() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        let session = || CancelTarget::Session("tok".to_owned());
        registry.apply(session(), record(Duration::ZERO), From::Broadcast);
        registry.apply(session(), record(Duration::from_secs(60)), From::Broadcast);
        // Stored 30 s ago: before the newer cancel, after the older one.
        assert!(
            refused(&registry, "d1", "tok", 30),
            "the newer cancel was replaced"
        );
    }

    /// A canceller that cannot read its record back broadcasts it with its
    /// own clock; one running ahead would otherwise cancel the session's
    /// next requests too, until the record expired.
    #[test]
    fn the_stored_record_replaces_a_broadcast_one_timed_by_the_cancellers_clock() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        let session = || CancelTarget::Session("tok".to_owned());
        let ahead = CancelRecord {
            at: OffsetDateTime::now_utc() + Duration::from_secs(60),
            silent: false,
        };
        registry.apply(session(), ahead.clone(), From::Broadcast);
        let stored = From::Stored { revision: 1 };
        registry.apply(session(), record(Duration::from_secs(60)), stored);
        // Stored 30 s ago: after the cancel as the server stored it.
        assert!(
            !refused(&registry, "d1", "tok", 30),
            "refused by the canceller's clock"
        );
        // The usual order: the watch first, the broadcast after.
        registry.apply(session(), ahead, From::Broadcast);
        assert!(
            !refused(&registry, "d2", "tok", 30),
            "replaced by the broadcast"
        );
    }

    /// A session cancelled again: its second broadcast, come before the
    /// watch delivers the second record, is kept out by the first, stored,
    /// record; so the registry says it is ahead of the watch, for tasks to
    /// read their records by key meanwhile, rather than start a request
    /// stored between the two cancels. The first cancel's own broadcast,
    /// timed as its record, is not.
    #[test]
    fn a_later_broadcast_than_the_stored_record_says_the_watch_is_behind() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        let session = || CancelTarget::Session("tok".to_owned());
        let first = record(Duration::from_secs(60));
        let stored = From::Stored { revision: 1 };
        assert!(!registry.apply(session(), first.clone(), stored));
        assert!(!registry.apply(session(), first, From::Broadcast));
        // A task that checked its cancels before the second broadcast
        // came is not registered on the first record alone: it checks
        // again (reading its records by key, the watch being behind).
        let checked_at = registry.behind_count();
        assert!(registry.apply(session(), record(Duration::ZERO), From::Broadcast));
        let run = (CancellationToken::new(), Arc::new(OnceLock::new()));
        let stored_at = OffsetDateTime::now_utc() - Duration::from_secs(30);
        let registered = registry.register("d1", "tok", stored_at, run, checked_at);
        assert!(matches!(registered, Err(Refusal::Behind)));
    }

    /// A task's read by key brings the session's first cancel just after
    /// the second's broadcast came: the stored record replaces the
    /// broadcast, so the registry says the watch is behind, and a task
    /// stored between the two cancels checks again (and finds the second
    /// by key) rather than start on the first alone.
    #[test]
    fn an_earlier_stored_record_replacing_a_later_broadcast_says_the_watch_is_behind() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        let session = || CancelTarget::Session("tok".to_owned());
        registry.apply(session(), record(Duration::ZERO), From::Broadcast);
        let checked_at = registry.behind_count();
        let first = record(Duration::from_secs(60));
        registry.apply(session(), first, From::Stored { revision: 1 });
        let run = (CancellationToken::new(), Arc::new(OnceLock::new()));
        let stored_at = OffsetDateTime::now_utc() - Duration::from_secs(30);
        let registered = registry.register("d1", "tok", stored_at, run, checked_at);
        assert!(matches!(registered, Err(Refusal::Behind)));
    }

    /// A session cancel stored `ago` seconds ago, as revision `revision`.
    fn stored(registry: &CancelRegistry, ago: u64, revision: u64) {
        let record = record(Duration::from_secs(ago));
        let session = CancelTarget::Session("tok".to_owned());
        registry.apply(session, record, From::Stored { revision });
    }

    /// A watch behind delivers a session's older cancel after a task read
    /// the newer one by key: kept, the older would let the requests stored
    /// between the two start. Revisions tell which is newer, not times: a
    /// new leader's clock may be behind the last one's.
    #[test]
    fn of_two_stored_records_the_later_write_wins_whichever_comes_first() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        stored(&registry, 20, 7);
        stored(&registry, 60, 3);
        // Stored 30 s ago: before the newer cancel, after the older one.
        assert!(refused(&registry, "d1", "tok", 30), "revision 3 won");
        // Revision 9, timed by a leader whose clock is behind.
        stored(&registry, 60, 9);
        assert!(!refused(&registry, "d2", "tok", 30), "revision 9 lost");
    }

    /// A bucket deleted and created again numbers its revisions from 1:
    /// its records are newer than the old bucket's, whatever their
    /// revisions, and a read of the old bucket that comes late (it began
    /// before the delete) does not replace them.
    #[test]
    fn a_record_of_a_bucket_created_again_wins_over_the_old_buckets() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        stored(&registry, 20, 7);
        registry.bucket_created(OffsetDateTime::now_utc() - Duration::from_secs(10));
        stored(&registry, 5, 1);
        // Stored 7 s ago: before the new bucket's cancel.
        assert!(refused(&registry, "d1", "tok", 7), "the new bucket's lost");
        stored(&registry, 15, 9);
        assert!(refused(&registry, "d2", "tok", 7), "the old bucket's won");
    }

    #[test]
    fn records_older_than_the_bucket_keeps_them_are_forgotten() {
        let registry = CancelRegistry::new(Duration::from_secs(3600));
        for i in 0..10 {
            registry.apply(
                CancelTarget::Delegation(format!("old{i}")),
                record(Duration::from_secs(7200)),
                From::Stored { revision: i + 1 },
            );
        }
        registry.apply(
            CancelTarget::Delegation("new".to_owned()),
            record(Duration::from_secs(1)),
            From::Stored { revision: 1 },
        );
        assert_eq!(registry.records(), 1);
    }

    #[test]
    fn records_that_grow_older_than_the_bucket_keeps_them_are_forgotten_at_most_once_a_minute() {
        let registry = CancelRegistry::new(Duration::from_secs(3600));
        let stored = |id: &str, age: u64| {
            registry.apply(
                CancelTarget::Delegation(id.to_owned()),
                record(Duration::from_secs(age)),
                From::Stored { revision: 1 },
            );
        };
        stored("aging", 1800);
        assert_eq!(registry.records(), 1);
        // The bucket now keeps records for less than that one's age.
        registry.inner.lock().unwrap().keep = Duration::from_secs(900);
        stored("new", 1);
        assert_eq!(registry.records(), 2, "pruned again within the minute");
        // A minute later, as it were.
        registry.inner.lock().unwrap().pruned_at = None;
        stored("newer", 1);
        assert_eq!(registry.records(), 2, "the aged record was not forgotten");
        assert!(
            registry
                .inner
                .lock()
                .unwrap()
                .records
                .contains_key(&CancelTarget::Delegation("newer".to_owned()))
        );
    }

    #[test]
    fn a_run_is_refused_by_its_delegation_or_an_older_session_cancel_only() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        registry.apply(
            CancelTarget::Delegation("d1".to_owned()),
            record(Duration::ZERO),
            From::Stored { revision: 1 },
        );
        registry.apply(
            CancelTarget::Session("tok".to_owned()),
            record(Duration::from_secs(60)),
            From::Stored { revision: 1 },
        );
        let run = |delegation: &str, token: &str, stored_ago: u64| {
            refused(&registry, delegation, token, stored_ago)
        };
        assert!(run("d1", "other", 0), "its delegation was cancelled");
        assert!(run("d2", "tok", 120), "queued before the session cancel");
        assert!(!run("d3", "tok", 0), "queued after the session cancel");
        assert!(!run("d4", "other", 0), "nothing cancels it");
    }
}
