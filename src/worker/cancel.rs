//! The worker's view of cancellations: records (from the KV bucket, live)
//! and the tasks running here, under one lock so no cancel slips between a
//! task's check and its start.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::bus::Bus;
use crate::cancel::{CancelRecord, CancelTarget};

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

#[derive(Debug, Default)]
struct Inner {
    /// Every cancel record known, younger than `keep`.
    records: HashMap<CancelTarget, CancelRecord>,
    /// How long a record is kept: as long as the cancel bucket keeps it
    /// (its max age), after which no request it could stop is still queued.
    keep: Duration,
    /// Runs in progress, by a local id.
    running: HashMap<u64, Running>,
    /// Next local id.
    next_id: u64,
}

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
            .get(&CancelTarget::Delegation(delegation_id.to_owned()));
        let by_session = self
            .records
            .get(&CancelTarget::Session(session_token.to_owned()))
            .filter(|record| stored_at <= record.at);
        by_delegation.or(by_session)
    }
}

/// Cancel records and running tasks.
#[derive(Debug, Default)]
pub(crate) struct CancelRegistry {
    /// Everything, under one lock (never held across an await).
    inner: Mutex<Inner>,
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

/// How long a starting worker waits for the cancel records that exist.
const LOAD_PATIENCE: Duration = Duration::from_secs(10);

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
        }
    }

    /// Records a cancel and stops every matching run.
    pub(crate) fn apply(&self, target: CancelTarget, record: CancelRecord) {
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
        // The newer record wins: the watch and the broadcast may bring a
        // session's two cancels in either order, and an older one kept
        // would let requests stored between the two start.
        match inner.records.get(&target) {
            Some(kept) if kept.at > record.at => {}
            _ => {
                inner.records.insert(target, record);
            }
        }
        let cutoff = OffsetDateTime::now_utc() - inner.keep;
        inner.records.retain(|_, record| record.at >= cutoff);
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

    /// Registers a run about to start, or returns the record that cancels it.
    pub(crate) fn register(
        self: &Arc<Self>,
        delegation_id: &str,
        session_token: &str,
        stored_at: OffsetDateTime,
        stop: CancellationToken,
        reason: Arc<OnceLock<StopReason>>,
    ) -> Result<RunGuard, CancelRecord> {
        let mut inner = self.inner.lock().expect("cancel registry");
        if let Some(record) = inner.cancelling(delegation_id, session_token, stored_at) {
            return Err(record.clone());
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

    /// Follows the cancel bucket and the broadcasts until `stop`; returns
    /// once the records that existed at start are loaded (or after 10 s).
    pub(crate) async fn follow(
        self: &Arc<Self>,
        bus: &Bus,
        bucket: kv::Store,
        stop: CancellationToken,
    ) -> Result<(), async_nats::Error> {
        let broadcasts = bus
            .client
            .subscribe(format!("{}.>", bus.subjects.cancel_broadcasts_prefix()))
            .await?;
        let mut watch = bucket.watch_with_history(">").await?;
        let existing = bucket.status().await?.values();
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
        let mut loaded_tx = Some(loaded_tx);
        if existing == 0 {
            let _ = loaded_tx.take().map(|tx| tx.send(()));
        }
        let registry = self.clone();
        let prefix = format!("{}.", bus.subjects.cancel_broadcasts_prefix());
        tokio::spawn(async move {
            let mut broadcasts = broadcasts;
            let mut watching = true;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    entry = watch.next(), if watching => match entry {
                        Some(Ok(entry)) => {
                            if entry.operation == kv::Operation::Put
                                && let Some((target, mut record)) = decode(&entry.key, &entry.value)
                            {
                                // The server's clock, like the requests' stored times.
                                record.at = entry.created;
                                registry.apply(target, record);
                            }
                            if entry.delta == 0 {
                                let _ = loaded_tx.take().map(|tx| tx.send(()));
                            }
                        }
                        Some(Err(error)) => warn!(%error, "Cancel watch error."),
                        None => {
                            warn!("Cancel watch ended; relying on broadcasts.");
                            let _ = loaded_tx.take().map(|tx| tx.send(()));
                            watching = false;
                        }
                    },
                    Some(message) = broadcasts.next() => {
                        let key = message.subject.strip_prefix(prefix.as_str()).unwrap_or_default();
                        if let Some((target, record)) = decode(key, &message.payload) {
                            registry.apply(target, record);
                        }
                    }
                }
            }
        });
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

/// A cancel record from its key and body; `None` if either is malformed.
fn decode(key: &str, body: &[u8]) -> Option<(CancelTarget, CancelRecord)> {
    Some((
        CancelTarget::from_key(key)?,
        serde_json::from_slice(body).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(age: Duration) -> CancelRecord {
        CancelRecord {
            at: OffsetDateTime::now_utc() - age,
            silent: false,
        }
    }

    #[test]
    fn an_older_session_cancel_arriving_late_does_not_replace_a_newer_one() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        let session = || CancelTarget::Session("tok".to_owned());
        registry.apply(session(), record(Duration::ZERO));
        registry.apply(session(), record(Duration::from_secs(60)));
        // Stored 30 s ago: before the newer cancel, after the older one.
        let refused = registry.register(
            "d1",
            "tok",
            OffsetDateTime::now_utc() - Duration::from_secs(30),
            CancellationToken::new(),
            Arc::new(OnceLock::new()),
        );
        assert!(refused.is_err(), "the newer cancel was replaced");
    }

    #[test]
    fn records_older_than_the_bucket_keeps_them_are_forgotten() {
        let registry = CancelRegistry::new(Duration::from_secs(3600));
        for i in 0..10 {
            registry.apply(
                CancelTarget::Delegation(format!("old{i}")),
                record(Duration::from_secs(7200)),
            );
        }
        registry.apply(
            CancelTarget::Delegation("new".to_owned()),
            record(Duration::from_secs(1)),
        );
        assert_eq!(registry.records(), 1);
    }

    #[test]
    fn a_run_is_refused_by_its_delegation_or_an_older_session_cancel_only() {
        let registry = Arc::new(CancelRegistry::new(Duration::from_secs(3600)));
        registry.apply(
            CancelTarget::Delegation("d1".to_owned()),
            record(Duration::ZERO),
        );
        registry.apply(
            CancelTarget::Session("tok".to_owned()),
            record(Duration::from_secs(60)),
        );
        let run = |delegation: &str, token: &str, stored_ago: u64| {
            registry
                .register(
                    delegation,
                    token,
                    OffsetDateTime::now_utc() - Duration::from_secs(stored_ago),
                    CancellationToken::new(),
                    Arc::new(OnceLock::new()),
                )
                .is_err()
        };
        assert!(run("d1", "other", 0), "its delegation was cancelled");
        assert!(run("d2", "tok", 120), "queued before the session cancel");
        assert!(!run("d3", "tok", 0), "queued after the session cancel");
        assert!(!run("d4", "other", 0), "nothing cancels it");
    }
}
