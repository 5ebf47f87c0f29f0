//! Per-session locks in a KV bucket, so that at most one wake post is in
//! flight per session across every wake instance.
//!
//! A lock is a key created atomically; its holder refreshes it while it works,
//! and the bucket's max age makes the lock of a holder that died expire.
//!
//! Releasing writes a KV delete marker conditioned on the holder's revision.
//! Purging the key instead would save the next take two round trips
//! (`cargo bench --bench locks`), but nats-server before 2.9.18 replays a
//! filtered purge on a restarted cluster replica as a purge of the whole
//! stream (nats-io/nats-server#4197): every other session's lock would
//! vanish on that replica. The cluster fault test caught it on 2.9.10.

use std::time::Duration;

use async_nats::jetstream::kv;
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
}

impl SessionLocks {
    /// Wraps the provisioned bucket.
    pub fn new(kv: kv::Store, owner: &str, ttl: Duration) -> Self {
        Self {
            kv,
            owner: Bytes::copy_from_slice(owner.as_bytes()),
            ttl,
        }
    }

    /// How often a holder should refresh.
    pub fn refresh_interval(&self) -> Duration {
        self.ttl / 3
    }

    /// Takes the lock for `session_token`, or `None` if another holder has it.
    pub async fn try_acquire(&self, session_token: &str) -> Result<Option<LockGuard>, LockError> {
        match self.kv.create(session_token, self.owner.clone()).await {
            Ok(revision) => Ok(Some(LockGuard {
                key: session_token.to_owned(),
                revision,
                written_at: tokio::time::Instant::now(),
                lost: false,
            })),
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
        // Failure leaves the lock to expire by itself.
        let _ = self
            .kv
            .delete_expect_revision(&guard.key, Some(guard.revision))
            .await;
    }
}
