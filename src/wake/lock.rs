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

/// Why a lock operation failed (other than the lock being held).
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Creating the lock failed for a reason other than "held".
    #[error("cannot take the session lock: {0}")]
    Create(#[from] kv::CreateError),
    /// Refreshing failed: the lock expired and was maybe taken by another instance.
    #[error("lost the session lock: {0}")]
    Refresh(#[from] kv::UpdateError),
}

/// The lock bucket, from one instance's point of view.
#[derive(Debug, Clone)]
pub struct SessionLocks {
    /// The KV bucket.
    kv: kv::Store,
    /// This instance's name, stored as the lock value for operators.
    owner: Bytes,
    /// The bucket's max age: a lock not refreshed for this long expires.
    ttl: Duration,
    /// Publishes release markers, whose revision the KV delete would not say.
    js: jetstream::Context,
    /// The delete markers this instance's releases left, by key.
    released: Arc<Mutex<Markers>>,
}

/// Revisions of release markers, each with when it was written; dropped
/// once older than the TTL (the marker itself is gone by then), so the map
/// holds at most about the locks released within two TTLs.
#[derive(Debug, Default)]
struct Markers {
    /// Key → (marker revision, written at).
    by_key: HashMap<String, (u64, Instant)>,
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
}

/// A held lock.
#[derive(Debug)]
pub struct LockGuard {
    /// The key (the session token).
    key: String,
    /// The revision this holder last wrote.
    revision: u64,
    /// When this holder last wrote it (the lock expires a TTL later).
    written_at: tokio::time::Instant,
    /// How it was taken, for the lock metric.
    taken: Taken,
    /// A refresh failed: the lock may be someone else's now, so this guard
    /// must not be used again (nor released: its revision is stale).
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
            owner: Bytes::copy_from_slice(owner.as_bytes()),
            ttl,
            js,
            released: Arc::default(),
        }
    }

    /// How often a holder should refresh.
    pub fn refresh_interval(&self) -> Duration {
        self.ttl / 3
    }

    /// Takes the lock for `session_token`, or `None` if another holder has it.
    pub async fn try_acquire(&self, session_token: &str) -> Result<Option<LockGuard>, LockError> {
        let guard = |revision, taken| LockGuard {
            key: session_token.to_owned(),
            revision,
            written_at: tokio::time::Instant::now(),
            taken,
            lost: false,
        };
        // Over this instance's own release marker, if nobody wrote since.
        if let Some(marker) = self.take_marker(session_token)
            && let Ok(revision) = self
                .kv
                .update(session_token, self.owner.clone(), marker)
                .await
        {
            return Ok(Some(guard(revision, Taken::OverOwnMarker)));
        }
        match self.kv.create(session_token, self.owner.clone()).await {
            Ok(revision) => Ok(Some(guard(revision, Taken::Anew))),
            Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(err) => Err(err.into()),
        }
    }

    /// Extends the lock's life.
    pub async fn refresh(&self, guard: &mut LockGuard) -> Result<(), LockError> {
        let started = tokio::time::Instant::now();
        match self
            .kv
            .update(&guard.key, self.owner.clone(), guard.revision)
            .await
        {
            Ok(revision) => {
                guard.revision = revision;
                guard.written_at = started;
                Ok(())
            }
            Err(error) => {
                guard.lost = true;
                Err(error.into())
            }
        }
    }

    /// Releases the lock, unless it already expired and was taken by someone else.
    pub async fn release(&self, guard: LockGuard) {
        if guard.lost {
            return;
        }
        // The KV delete marker, published here to learn its revision. A
        // bucket reached through a JetStream API prefix takes the client's
        // own delete (and the next take the usual create).
        if self.kv.use_jetstream_prefix {
            let _ = self
                .kv
                .delete_expect_revision(&guard.key, Some(guard.revision))
                .await;
            return;
        }
        let prefix = self.kv.put_prefix.as_deref().unwrap_or(&self.kv.prefix);
        let mut headers = HeaderMap::new();
        headers.insert("KV-Operation", "DEL");
        headers.insert(
            "Nats-Expected-Last-Subject-Sequence",
            guard.revision.to_string().as_str(),
        );
        let published = self
            .js
            .publish_with_headers(format!("{prefix}{}", guard.key), headers, Bytes::new())
            .await;
        // Failure leaves the lock to expire by itself.
        if let Ok(ack) = published
            && let Ok(ack) = ack.await
        {
            self.remember_marker(guard.key, ack.sequence);
        }
    }

    fn remember_marker(&self, key: String, revision: u64) {
        let mut markers = self.released.lock().unwrap_or_else(|p| p.into_inner());
        markers.by_key.insert(key, (revision, Instant::now()));
        if markers.by_key.len() >= markers.sweep_at {
            let ttl = self.ttl;
            markers.by_key.retain(|_, (_, at)| at.elapsed() < ttl);
            markers.sweep_at = (markers.by_key.len() * 2).max(1024);
        }
    }

    /// The revision of this instance's release marker on `key`, if one was
    /// written within the TTL (forgotten either way: a failed update means
    /// someone else wrote the key since).
    fn take_marker(&self, key: &str) -> Option<u64> {
        let mut markers = self.released.lock().unwrap_or_else(|p| p.into_inner());
        let (revision, at) = markers.by_key.remove(key)?;
        (at.elapsed() < self.ttl).then_some(revision)
    }
}
