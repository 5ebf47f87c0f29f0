//! Per-session locks in a KV bucket, so that at most one wake post is in
//! flight per session across every wake instance.
//!
//! A lock is a key created atomically; its holder refreshes it while it works,
//! and the bucket's max age makes the lock of a holder that died expire.
//!
//! Releasing writes a KV delete marker conditioned on the holder's revision.
//! The marker stays as the key's last message (until the bucket's max age),
//! so a plain KV create of the lock would be refused, read the marker and
//! update over it: three round trips. The instance remembers the revision of
//! each marker its releases wrote, so taking that lock again is a single
//! update conditioned on the marker: it succeeds only if nobody wrote the key
//! since. Other instances, and markers older than the TTL, take the usual
//! create.
//!
//! A lock's value is the instance's name and a ULID that no other take
//! writes. When a write's answer never comes (a timeout, a lost
//! connection) it may still have been applied, and a release that failed
//! or was not sent (the client disconnected; a refresh not sent likewise)
//! leaves the lock in place: either way the key may hold a lock no guard
//! knows of, and every take would see it as busy until the TTL. So a take
//! whose create is refused reads the key, and adopts a lock holding its
//! own value; the instance remembers the values it wrote without a guard
//! as orphans, and its next take of that key writes the orphan's value
//! again, so that whichever of its writes landed can be adopted.
//!
//! Purging the key instead of deleting would leave no marker, but nats-server
//! before 2.9.18 replays a filtered purge on a restarted cluster replica as a
//! purge of the whole stream (nats-io/nats-server#4197): every other
//! session's lock would vanish on that replica. The cluster fault test
//! caught it on 2.9.10.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use ulid::Ulid;

/// Why a lock operation failed (other than the lock being held).
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Taking the lock failed for a reason other than "held".
    #[error("cannot take the session lock: {0}")]
    Take(kv::UpdateError),
    /// Refreshing failed: the lock expired and was maybe taken by another instance.
    #[error("lost the session lock: {0}")]
    Refresh(#[from] kv::UpdateError),
    /// Reading a held lock, to see whether it is one of this instance's
    /// orphans, failed.
    #[error("cannot read the session lock: {0}")]
    Read(#[from] kv::EntryError),
    /// The client is disconnected: nothing was sent (see
    /// [`crate::connect::is_connected`]).
    #[error("NATS is unreachable")]
    Disconnected,
}

/// The lock bucket, from one instance's point of view.
#[derive(Debug, Clone)]
pub struct SessionLocks {
    /// The KV bucket.
    kv: kv::Store,
    /// This instance's name, the first word of every lock value it writes,
    /// for operators.
    owner: String,
    /// The bucket's max age: a lock not refreshed for this long expires.
    ttl: Duration,
    /// Publishes release markers, whose revision the KV delete would not say.
    js: jetstream::Context,
    /// `js`'s client, whose state says whether a write can be sent now
    /// (kept, as `Context::client` clones it on every call).
    client: async_nats::Client,
    /// What this instance wrote and may need again, by key.
    memory: Arc<Mutex<Memory>>,
}

/// Release markers and orphaned lock values, each with when it was
/// written; dropped once older than the TTL (the marker or lock itself is
/// gone by then), so the maps hold at most about the keys written within
/// two TTLs.
#[derive(Debug, Default)]
struct Memory {
    /// Key → (revision of this instance's release marker, written at).
    markers: HashMap<String, (u64, Instant)>,
    /// Key → (a lock value this instance wrote and holds no guard for,
    /// written at): the write went unanswered, or its release failed.
    orphans: HashMap<String, (Bytes, Instant)>,
    /// Size at which expired entries are next swept out.
    sweep_at: usize,
}

/// How a free lock was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Created, or written over a marker this instance did not write.
    Anew,
    /// Written in one update over this instance's own release marker.
    OverOwnMarker,
    /// Found holding a value this instance wrote without a guard: a write
    /// whose answer was lost, or a lock whose release failed.
    Adopted,
}

/// A held lock.
#[derive(Debug)]
pub struct LockGuard {
    /// The key (the session token).
    key: String,
    /// The revision this holder last wrote.
    revision: u64,
    /// The value this holder wrote: the owner's name and a ULID of this take.
    value: Bytes,
    /// When this holder last wrote it (the lock expires a TTL later).
    written_at: tokio::time::Instant,
    /// How it was taken, for the lock metric.
    taken: Taken,
    /// The last refresh failed: the lock may be someone else's now, so this
    /// guard is neither kept past its turn nor released (its revision may
    /// be stale); a later refresh that succeeds proves it held again.
    lost: bool,
}

impl LockGuard {
    /// When the lock was last written by its holder.
    pub fn written_at(&self) -> tokio::time::Instant {
        self.written_at
    }

    /// Whether a refresh failed, so the lock must be taken anew.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// How the lock was taken.
    pub fn taken(&self) -> Taken {
        self.taken
    }
}

impl SessionLocks {
    /// Wraps the provisioned bucket; `js` is the JetStream context the
    /// bucket was opened with.
    pub fn new(js: jetstream::Context, kv: kv::Store, owner: &str, ttl: Duration) -> Self {
        Self {
            kv,
            owner: owner.to_owned(),
            ttl,
            client: js.client(),
            js,
            memory: Arc::default(),
        }
    }

    /// How often a holder should refresh.
    pub fn refresh_interval(&self) -> Duration {
        self.ttl / 3
    }

    /// Takes the lock for `session_token`, or `None` if another holder has it.
    pub async fn try_acquire(&self, session_token: &str) -> Result<Option<LockGuard>, LockError> {
        if !self.connected() {
            return Err(LockError::Disconnected);
        }
        // An orphan's value is written again, so that whichever unanswered
        // write was applied, the key holds the one value to adopt.
        let value = self
            .take_orphan(session_token)
            .unwrap_or_else(|| Bytes::from(format!("{} {}", self.owner, Ulid::new())));
        // Before any write: the server times the lock from when it stores
        // it, so a time taken after a slow answer would overstate its life.
        let started = tokio::time::Instant::now();
        let guard = |revision, value, taken| LockGuard {
            key: session_token.to_owned(),
            revision,
            value,
            written_at: started,
            taken,
            lost: false,
        };
        // Over this instance's own release marker, if nobody wrote since.
        if let Some(marker) = self.take_marker(session_token)
            && let Ok(revision) = self.kv.update(session_token, value.clone(), marker).await
        {
            return Ok(Some(guard(revision, value, Taken::OverOwnMarker)));
        }
        // A create: the key must hold nothing. (Not `kv::Store::create`,
        // which reports a lost answer whose write was applied as held.)
        let refused = match self.kv.update(session_token, value.clone(), 0).await {
            Ok(revision) => return Ok(Some(guard(revision, value, Taken::Anew))),
            Err(error) => error,
        };
        // Held, released, or unanswered and maybe applied: the key says which.
        let entry = match self.kv.entry(session_token).await {
            Ok(entry) => entry,
            Err(error) => {
                self.remember_orphan(session_token, value);
                return Err(error.into());
            }
        };
        match entry {
            Some(entry) if entry.operation == kv::Operation::Put && entry.value == value => {
                // This instance's own write. Its age is unknown: a refresh
                // makes it live a full TTL from now.
                let mut adopted = guard(entry.revision, value, Taken::Adopted);
                self.refresh(&mut adopted).await?;
                Ok(Some(adopted))
            }
            // Another holder's: a write of this value still on its way is
            // conditioned on an older revision, so it cannot land.
            Some(entry) if entry.operation == kv::Operation::Put => Ok(None),
            // A release marker: the lock is free.
            Some(entry) => match self
                .kv
                .update(session_token, value.clone(), entry.revision)
                .await
            {
                Ok(revision) => Ok(Some(guard(revision, value, Taken::Anew))),
                Err(error) => {
                    self.remember_orphan(session_token, value);
                    match error.kind() {
                        kv::UpdateErrorKind::WrongLastRevision => Ok(None),
                        _ => Err(LockError::Take(error)),
                    }
                }
            },
            // Nothing there: held a moment ago and expired since, or the
            // create is unanswered and may still land.
            None => {
                self.remember_orphan(session_token, value);
                match refused.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => Ok(None),
                    _ => Err(LockError::Take(refused)),
                }
            }
        }
    }

    /// Extends the lock's life.
    pub async fn refresh(&self, guard: &mut LockGuard) -> Result<(), LockError> {
        if !self.connected() {
            // Unsent: the key keeps this guard's write until it expires, or
            // until this instance's next take adopts it.
            guard.lost = true;
            self.remember_orphan(&guard.key, guard.value.clone());
            return Err(LockError::Disconnected);
        }
        let started = tokio::time::Instant::now();
        match self
            .kv
            .update(&guard.key, guard.value.clone(), guard.revision)
            .await
        {
            Ok(revision) => {
                guard.revision = revision;
                guard.written_at = started;
                // A refresh after one that went unanswered: conditioned on
                // the guard's revision, its success proves the lock is held.
                if guard.lost {
                    guard.lost = false;
                    self.take_orphan(&guard.key);
                }
                Ok(())
            }
            Err(error) => {
                // Taken by another instance since, or unanswered and maybe
                // applied: then the key still holds this value.
                guard.lost = true;
                self.remember_orphan(&guard.key, guard.value.clone());
                // An earlier refresh whose answer was lost but which was
                // applied left this value at a newer revision: no other take
                // writes it, so the lock is still this guard's to refresh.
                if error.kind() == kv::UpdateErrorKind::WrongLastRevision
                    && let Ok(Some(entry)) = self.kv.entry(&guard.key).await
                    && entry.operation == kv::Operation::Put
                    && entry.value == guard.value
                    && entry.revision != guard.revision
                {
                    let started = tokio::time::Instant::now();
                    if let Ok(revision) = self
                        .kv
                        .update(&guard.key, guard.value.clone(), entry.revision)
                        .await
                    {
                        guard.revision = revision;
                        guard.written_at = started;
                        guard.lost = false;
                        self.take_orphan(&guard.key);
                        return Ok(());
                    }
                }
                Err(error.into())
            }
        }
    }

    /// Runs `work` while keeping the lock alive: refreshed whenever due
    /// (at once if already due), and every second after a refresh failed
    /// (the guard then says it is lost, so nothing is posted under it
    /// until a refresh succeeds). For work not bounded by the lock's TTL,
    /// such as planning a large batch's turn over a slow link: a lock left
    /// to lapse meanwhile has the work done again under a new lock, as
    /// slowly, for ever.
    pub async fn keep_during<F: std::future::Future>(
        &self,
        guard: &mut LockGuard,
        work: F,
    ) -> F::Output {
        tokio::pin!(work);
        let mut due = guard.written_at + self.refresh_interval();
        loop {
            tokio::select! {
                output = &mut work => return output,
                () = tokio::time::sleep_until(due) => {
                    due = match self.refresh(guard).await {
                        Ok(()) => guard.written_at + self.refresh_interval(),
                        Err(error) => {
                            tracing::debug!(%error, "Session lock refresh failed while planning; trying again in a second.");
                            tokio::time::Instant::now() + Duration::from_secs(1)
                        }
                    };
                }
            }
        }
    }

    /// Releases the lock, unless it already expired and was taken by someone else.
    pub async fn release(&self, guard: LockGuard) {
        if guard.lost {
            return;
        }
        if !self.connected() {
            // Unsent: the lock expires by itself, or this instance's next
            // take of it adopts it.
            self.remember_orphan(&guard.key, guard.value);
            return;
        }
        // The KV delete marker, published here to learn its revision. A
        // bucket reached through a JetStream API prefix takes the client's
        // own delete (and the next take the usual create).
        if self.kv.use_jetstream_prefix {
            if self
                .kv
                .delete_expect_revision(&guard.key, Some(guard.revision))
                .await
                .is_err()
            {
                self.remember_orphan(&guard.key, guard.value);
            }
            return;
        }
        let prefix = self.kv.put_prefix.as_deref().unwrap_or(&self.kv.prefix);
        let mut headers = HeaderMap::new();
        headers.insert("KV-Operation", "DEL");
        headers.insert(
            crate::protocol::HEADER_EXPECTED_LAST_SUBJECT_SEQUENCE,
            guard.revision.to_string().as_str(),
        );
        let published = self
            .js
            .publish_with_headers(format!("{prefix}{}", guard.key), headers, Bytes::new())
            .await;
        // A failed release leaves the lock to expire by itself, or to be
        // adopted by this instance's next take of it.
        match published {
            Ok(ack) => match ack.await {
                Ok(ack) => self.remember_marker(guard.key, ack.sequence),
                Err(_) => self.remember_orphan(&guard.key, guard.value),
            },
            Err(_) => self.remember_orphan(&guard.key, guard.value),
        }
    }

    /// Whether a lock write can be sent now; while NATS is unreachable it
    /// would only wait in the client's queue.
    fn connected(&self) -> bool {
        crate::connect::is_connected(&self.client)
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remember_marker(&self, key: String, revision: u64) {
        let mut memory = self.memory();
        memory.orphans.remove(&key);
        memory.markers.insert(key, (revision, Instant::now()));
        memory.sweep(self.ttl);
    }

    fn remember_orphan(&self, key: &str, value: Bytes) {
        let mut memory = self.memory();
        memory
            .orphans
            .insert(key.to_owned(), (value, Instant::now()));
        memory.sweep(self.ttl);
    }

    /// The revision of this instance's release marker on `key`, if one was
    /// written within the TTL (forgotten either way: a failed update means
    /// someone else wrote the key since).
    fn take_marker(&self, key: &str) -> Option<u64> {
        let (revision, at) = self.memory().markers.remove(key)?;
        (at.elapsed() < self.ttl).then_some(revision)
    }

    /// The value of this instance's orphaned lock on `key`, if any.
    fn take_orphan(&self, key: &str) -> Option<Bytes> {
        self.memory().orphans.remove(key).map(|(value, _)| value)
    }
}

impl Memory {
    /// Drops entries older than `ttl` once the maps have doubled.
    fn sweep(&mut self, ttl: Duration) {
        if self.markers.len() + self.orphans.len() >= self.sweep_at {
            self.markers.retain(|_, (_, at)| at.elapsed() < ttl);
            self.orphans.retain(|_, (_, at)| at.elapsed() < ttl);
            self.sweep_at = ((self.markers.len() + self.orphans.len()) * 2).max(1024);
        }
    }
}
