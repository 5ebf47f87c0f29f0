//! The wake ledger: a durable record, per task, of wakes being posted and
//! delivered. This is the wake service's idempotency mechanism.
//!
//! Written around every post: `posting` (with the `Idempotency-Key`) before
//! the post (created in one write when the task has no entry yet, the common
//! case), `delivered` after a 2xx. A completion whose entry says
//! `delivered` is never posted again; one that says `posting` is re-posted
//! with the same key, so a session API that honours `Idempotency-Key` sees
//! a repeat, not a new turn. (A `replay wakes --force` copy goes by the
//! record like any copy: the replay recorded its key before publishing it.)
//!
//! The wake's writes are conditional: a `posting` mark only over the
//! revision the planner read ([`LedgerEntry`]), a `delivered` record only
//! over the revision the post was planned on (or its own mark's), and
//! either is refused with [`LedgerError::Changed`] if anything was written
//! since (a combined turn's intent goes under a key of its own). A
//! mark that a client queued while disconnected can reach the server long
//! after it was given up; by then another instance may have woken the
//! completion, and an unconditional mark landing over that would make the
//! completion look unposted (or revive a combined turn that covers it). A
//! `delivered` landing over a forced replay's record would have the forced
//! copy acked unposted. The server checks the revision when the write
//! lands, so a late write is refused. `replay wakes --force` is the one
//! writer over anything: it records the forced post's key
//! ([`WakeLedger::record_forced`]) in place of what the entry said.

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// Where a task's wake stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "state")]
pub enum LedgerState {
    /// A post carrying this key was (maybe) sent; its outcome is unknown.
    Posting {
        /// The `Idempotency-Key` of that post.
        idempotency_key: String,
    },
    /// A session API accepted the wake.
    Delivered {
        /// The `Idempotency-Key` of the accepted post.
        idempotency_key: String,
        /// When it was accepted.
        #[serde(with = "time::serde::rfc3339")]
        at: OffsetDateTime,
    },
}

impl LedgerState {
    /// The `Idempotency-Key` the state is recorded under.
    pub fn key(&self) -> &str {
        match self {
            Self::Posting { idempotency_key }
            | Self::Delivered {
                idempotency_key, ..
            } => idempotency_key,
        }
    }
}

/// What a combined post was about to send, recorded before it is sent.
///
/// If the wake service dies mid-post, whichever instance next sees one of
/// the covered completions re-sends exactly this text with the same key, so
/// the session API can tell it is a repeat, and every covered completion is
/// then marked delivered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// The rendered turn.
    pub text: String,
    /// Ledger keys of the completions the turn reports.
    pub covers: Vec<String>,
}

/// A ledger entry as read: its state, and the revision that a write made
/// on the strength of that state must replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The recorded state; `None` if the task has no entry (never had one,
    /// or it was deleted).
    pub state: Option<LedgerState>,
    /// The revision of the key's last write (a deletion too); 0 if the key
    /// was never written (or its history expired).
    pub revision: u64,
}

/// Why the ledger could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Reading failed.
    #[error("cannot read the wake ledger: {0}")]
    Read(#[from] kv::EntryError),
    /// Writing failed.
    #[error("cannot write the wake ledger: {0}")]
    Write(#[from] kv::PutError),
    /// A conditional write or a deletion (the same operation to the
    /// client library) failed for a reason other than a changed entry.
    #[error("cannot write the wake ledger: {0}")]
    Update(#[from] kv::UpdateError),
    /// A conditional write was refused: the entry was written (or deleted)
    /// after it was read, by another instance or a replay.
    #[error("wake ledger entry {key} changed after it was read")]
    Changed {
        /// The entry's key in the bucket.
        key: String,
    },
    /// An entry is not ledger JSON (edited by hand, or written by a newer
    /// wakebus).
    #[error("wake ledger entry {key} is corrupt: {source}")]
    Corrupt {
        /// The entry's key in the bucket.
        key: String,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// A state could not be encoded (never, for these types).
    #[error("cannot encode a wake ledger entry: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The ledger bucket.
#[derive(Debug, Clone)]
pub struct WakeLedger {
    /// The KV bucket.
    kv: kv::Store,
}

impl WakeLedger {
    /// Wraps the provisioned bucket.
    pub fn new(kv: kv::Store) -> Self {
        Self { kv }
    }

    /// The ledger key of a task.
    pub fn key(delegation_id: &str, task_index: u32) -> String {
        format!("{delegation_id}.{task_index}")
    }

    /// The ledger key of a batch's consolidated wake.
    pub fn batch_key(delegation_id: &str) -> String {
        format!("{delegation_id}.batch")
    }

    /// The state of a task's wake, if any was recorded.
    pub async fn get(&self, key: &str) -> Result<Option<LedgerState>, LedgerError> {
        Ok(self.read(key).await?.state)
    }

    /// A task's entry with its revision, for a conditional mark.
    pub async fn read(&self, key: &str) -> Result<LedgerEntry, LedgerError> {
        Ok(match self.kv.entry(key).await? {
            Some(entry) => LedgerEntry {
                state: match entry.operation {
                    kv::Operation::Put => Some(parse(key, &entry.value)?),
                    kv::Operation::Delete | kv::Operation::Purge => None,
                },
                revision: entry.revision,
            },
            None => LedgerEntry {
                state: None,
                revision: 0,
            },
        })
    }

    /// Records that a post with `idempotency_key` is about to be sent, if
    /// the entry is still at `revision` (as read; 0: never written). Fails
    /// with [`LedgerError::Changed`] if it is not, even when the write
    /// reaches the server late.
    /// Returns the entry's new revision.
    pub async fn mark_posting(
        &self,
        key: &str,
        idempotency_key: &str,
        revision: u64,
    ) -> Result<u64, LedgerError> {
        let state = LedgerState::Posting {
            idempotency_key: idempotency_key.to_owned(),
        };
        self.update(key, &state, revision).await
    }

    /// Records `posting` for a task whose key was never written, in one
    /// round trip, returning the entry's revision; `None` (nothing
    /// written) if it was, which the caller then reads. The common case, a
    /// completion seen for the first time, so costs one write instead of a
    /// read and a write.
    pub async fn mark_posting_if_new(
        &self,
        key: &str,
        idempotency_key: &str,
    ) -> Result<Option<u64>, LedgerError> {
        match self.mark_posting(key, idempotency_key, 0).await {
            Ok(revision) => Ok(Some(revision)),
            Err(LedgerError::Changed { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Records that the wake was accepted, if the entry is still at
    /// `revision` (the one the post was planned on, or its `posting` mark).
    /// Fails with [`LedgerError::Changed`] if it is not: a `replay wakes
    /// --force` recorded its key meanwhile (a `delivered` over that would
    /// make the forced copy be acked unposted), or this instance's own
    /// earlier write of the record, whose answer was lost, landed.
    pub async fn mark_delivered(
        &self,
        key: &str,
        idempotency_key: &str,
        revision: u64,
    ) -> Result<(), LedgerError> {
        let state = LedgerState::Delivered {
            idempotency_key: idempotency_key.to_owned(),
            at: OffsetDateTime::now_utc(),
        };
        self.update(key, &state, revision).await.map(|_| ())
    }

    /// Records the intent of a combined post under its idempotency key.
    pub async fn put_intent(
        &self,
        idempotency_key: &str,
        intent: &Intent,
    ) -> Result<(), LedgerError> {
        self.kv
            .put(
                intent_key(idempotency_key),
                serde_json::to_vec(intent)?.into(),
            )
            .await?;
        Ok(())
    }

    /// The intent recorded under `idempotency_key`, if any.
    pub async fn intent(&self, idempotency_key: &str) -> Result<Option<Intent>, LedgerError> {
        let key = intent_key(idempotency_key);
        match self.kv.get(&key).await? {
            Some(bytes) => parse(&key, &bytes).map(Some),
            None => Ok(None),
        }
    }

    /// Records a forced re-post (`wakebus replay wakes --force`) before its
    /// copy is published: `posting` under `forced_key`, over whatever the
    /// entry says (a corrupt value included, and without reading it, which
    /// the replay's user may not). Every copy of the completion then wakes
    /// under that key (the forced copy as any other: it finds its own key
    /// recorded), and a post still being made under the old key cannot
    /// record its delivery over it. The one unconditional write of a
    /// `posting`: the operator's, meant to replace what is there.
    pub async fn record_forced(&self, key: &str, forced_key: &str) -> Result<(), LedgerError> {
        let state = LedgerState::Posting {
            idempotency_key: forced_key.to_owned(),
        };
        self.kv.put(key, serde_json::to_vec(&state)?.into()).await?;
        Ok(())
    }

    /// Writes `state` if the entry is at `revision`; its new revision.
    async fn update(
        &self,
        key: &str,
        state: &LedgerState,
        revision: u64,
    ) -> Result<u64, LedgerError> {
        match self
            .kv
            .update(key, serde_json::to_vec(state)?.into(), revision)
            .await
        {
            Ok(revision) => Ok(revision),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(LedgerError::Changed {
                    key: key.to_owned(),
                })
            }
            Err(error) => Err(error.into()),
        }
    }
}

/// An entry's value, read as `T`.
fn parse<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, LedgerError> {
    serde_json::from_slice(bytes).map_err(|source| LedgerError::Corrupt {
        key: key.to_owned(),
        source,
    })
}

fn intent_key(idempotency_key: &str) -> String {
    format!("intent.{idempotency_key}")
}
