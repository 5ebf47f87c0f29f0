//! Per-session locks in a KV bucket, so that at most one wake post is in
//! flight per session across every wake instance.
//!
//! A lock is a key created atomically; its holder refreshes it while it works,
//! and the bucket's max age makes the lock of a holder that died expire.
//!
//! Releasing purges the key's message up to the holder's revision instead of
//! writing a KV delete marker. A marker would stay as the key's last message,
//! and the next take of the lock would then cost three round trips (a create
//! refused because of the marker, a read of the marker, an update over it)
//! plus the marker's own write. After a purge the key has no message, so the
//! next take is a single create, and a release stores nothing. A wake whose
//! NATS user may not purge (a permissions file older than this) falls back
//! to the delete marker after its first refused purge, and says so once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use tracing::warn;

/// Why a lock operation failed (other than the lock being held).
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Creating the lock failed for a reason other than "held".
    #[error("cannot take the session lock: {0}")]
    Create(#[from] kv::CreateError),
    /// Refreshing failed: the lock expired and was maybe taken by another instance.
    #[error("lost the session lock: {0}")]
    Refresh(#[from] kv::UpdateError),
    /// Releasing failed; the lock expires by itself after the bucket's TTL.
    #[error("cannot release the session lock: {0}")]
    Release(#[source] kv::DeleteError),
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
    /// Set after a purge failed: releases then write a KV delete marker,
    /// which a NATS user without the purge permission may still do.
    purge_refused: Arc<AtomicBool>,
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
            purge_refused: Arc::default(),
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

    /// Releases the lock, unless it already expired and was taken by someone
    /// else. A failure leaves the lock to expire after the TTL; meanwhile the
    /// session waits, which is why the caller may want to log it.
    pub async fn release(&self, guard: LockGuard) -> Result<(), LockError> {
        if guard.lost {
            return Ok(());
        }
        if !self.purge_refused.load(Ordering::Relaxed) {
            // Purge the key's messages below revision + 1: this holder's
            // lock (or nothing, if it expired), never a newer lock another
            // instance took after it expired.
            let purged = self
                .kv
                .stream
                .purge()
                .filter(format!("{}{}", self.kv.prefix, guard.key))
                .sequence(guard.revision + 1)
                .await;
            match purged {
                Ok(_) => return Ok(()),
                Err(error) => {
                    if !self.purge_refused.swap(true, Ordering::Relaxed) {
                        warn!(%error, stream = %self.kv.stream_name, "Could not release a session lock by purging its key; releasing locks with KV delete markers from now on, which costs two more round trips per lock taken. Allow this wake's NATS user $JS.API.STREAM.PURGE on the stream (deploy/nats/wakebus-permissions.conf).");
                    }
                }
            }
        }
        self.kv
            .delete_expect_revision(&guard.key, Some(guard.revision))
            .await
            .map_err(LockError::Release)
    }
}
