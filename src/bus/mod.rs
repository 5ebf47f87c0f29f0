//! The bus: one connection to a wakebus deployment ([`Bus`]), and what
//! every part of the flow does with it.
//!
//! - `mod.rs` (this file): [`Bus`], the settings shared by every service
//!   ([`BusSettings`]) and the errors of provisioning and publishing;
//! - `provision.rs`: the streams and KV buckets, created or updated
//!   idempotently and never deleted;
//! - `consumers.rs`: the durable consumers of the workers and the wake;
//! - `keeper.rs`: creating a service's consumer again if it is deleted
//!   while the service runs, and timing the service's keep-alives by the
//!   consumer's AckWait;
//! - `pulls.rs`: pacing a service's pull requests while they fail;
//! - `queue.rs`: whether a delegation's request is still in the task queue;
//! - `publish.rs`: publishing until JetStream confirms the message stored;
//! - `dead_letter.rs`: copying an unusable message to the dead letters;
//! - `byte_limits.rs`: the byte limits an operator gives the streams and
//!   buckets (`wakebus init --max-bytes`).

mod byte_limits;
mod consumers;
mod dead_letter;
mod keeper;
mod provision;
mod publish;
mod pulls;
mod queue;

use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::{self, kv, stream};

use crate::protocol::Subjects;

pub use byte_limits::{MaxBytes, Store};
pub(crate) use consumers::ServiceConsumer;
pub(crate) use dead_letter::dead_letter_parts;
pub(crate) use keeper::{KeepAliveClock, KeepAliveEvery};
pub(crate) use provision::{is_bucket_missing, is_stream_not_found, is_transient, setup_backoff};
pub(crate) use publish::confirm_stored;
pub(crate) use pulls::{PullRetry, pull_size};

/// Settings for the streams and buckets, shared by every service.
#[derive(Debug, Clone)]
pub struct BusSettings {
    /// How long events (the replayable history) are kept; an existing
    /// stream's is changed as `history_change` allows.
    pub history_max_age: Duration,
    /// How long dead letters are kept by a new dead-letter stream (an
    /// existing one keeps its own).
    pub dead_letter_max_age: Duration,
    /// JetStream dedupe window for `Nats-Msg-Id`.
    pub duplicate_window: Duration,
    /// Replicas of new streams and buckets; `None` takes them from the
    /// server (1 on a single server, the cluster size up to 3 on a cluster)
    /// and leaves existing streams at the replicas they have.
    pub replicas: Option<usize>,
    /// Time-to-live of a session lock that its holder stops refreshing.
    pub session_lock_ttl: Duration,
    /// Byte limits of the streams and buckets (`wakebus init
    /// --max-bytes`): a new one gets its part's, an existing one is set to
    /// it unless it holds more; a part given none gets no limit when new
    /// and keeps its own when it exists.
    pub max_bytes: MaxBytes,
    /// What provisioning may do to the max age of the existing events
    /// stream, wake ledger and cancel bucket: a value nobody gave (the
    /// default) must not replace the deployment's, and only `wakebus init`
    /// given `--history` may shorten it (which deletes at once what is
    /// older), so that a service started with a shorter `--history` than
    /// the others cannot delete their history.
    pub history_change: AgeChange,
    /// The same for the session-lock bucket and `session_lock_ttl` (a
    /// shorter TTL under running wakes lets locks expire between their
    /// refreshes).
    pub session_lock_ttl_change: AgeChange,
    /// Whether a stream or bucket whose settings differ and cannot be
    /// updated is an error: for `wakebus init`, which exists to make them
    /// right, so that it does not report success having changed nothing. A
    /// service uses it as it is, with a warning.
    pub require_update: bool,
    /// Whether an account's refusal of a stream without a byte limit
    /// (`max_bytes_required`) is waited out, for `wakebus init
    /// --max-bytes` to make it: for the worker and wake services, which a
    /// deployment may start beside `init`. Others (`init`, `dev`, a
    /// library caller) get the error.
    pub wait_for_byte_limits: bool,
    /// How often a running worker or wake checks that its durable consumer
    /// still exists (plus up to as much again at random), to create it
    /// again when it was deleted under it.
    pub consumer_check: Duration,
}

impl Default for BusSettings {
    fn default() -> Self {
        Self {
            history_max_age: default_history_max_age(),
            dead_letter_max_age: Duration::from_secs(30 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            replicas: None,
            session_lock_ttl: default_session_lock_ttl(),
            max_bytes: MaxBytes::default(),
            history_change: AgeChange::default(),
            session_lock_ttl_change: AgeChange::default(),
            require_update: false,
            wait_for_byte_limits: false,
            consumer_check: default_consumer_check(),
        }
    }
}

/// What provisioning may do to the max age of an existing stream or bucket
/// when it differs from the one in [`BusSettings`]. A new one always gets
/// the setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AgeChange {
    /// Leave it as it is: the setting is a default, not anyone's word, and
    /// the deployment's own value (set by `wakebus init`) wins.
    #[default]
    Keep,
    /// Lengthen it to the setting, never shorten it: a service given the
    /// setting keeps at least what it needs, and cannot delete what other
    /// services still keep.
    Lengthen,
    /// Set it to the setting, shortening included: `wakebus init` given
    /// the setting, on the operator's word.
    Set,
}

/// A service checks its consumer every 6 s (plus up to 6 s at random): one
/// small request, soon enough that a deleted consumer costs seconds of work.
pub fn default_consumer_check() -> Duration {
    Duration::from_secs(6)
}

/// A session lock whose holder stops refreshing it expires after 30 s by
/// default.
pub fn default_session_lock_ttl() -> Duration {
    Duration::from_secs(30)
}

/// Events are kept for 7 days by default.
pub fn default_history_max_age() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}

/// Why provisioning failed.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// A stream could not be created or updated.
    #[error("cannot create or update stream {name}: {source}")]
    Stream {
        /// The stream.
        name: String,
        /// The JetStream error.
        source: jetstream::context::CreateStreamError,
    },
    /// A KV bucket could not be created or updated.
    #[error("cannot create or update KV bucket {name}: {source}")]
    Bucket {
        /// The bucket.
        name: String,
        /// The JetStream error.
        source: jetstream::context::KeyValueError,
    },
    /// A consumer could not be created or updated.
    #[error("cannot create or update consumer {name} on {stream}: {source}")]
    Consumer {
        /// The consumer.
        name: String,
        /// Its stream.
        stream: String,
        /// The JetStream error.
        source: jetstream::stream::ConsumerError,
    },
    /// A consumer believed missing could not be created.
    #[error("cannot create consumer {name} on {stream}: {source}")]
    CreateConsumer {
        /// The consumer.
        name: String,
        /// Its stream.
        stream: String,
        /// The JetStream error (`AlreadyExists`: it exists after all).
        source: jetstream::stream::ConsumerCreateStrictError,
    },
    /// Whether a consumer exists could not be read.
    #[error("cannot read consumer {name} on {stream}: {source}")]
    ConsumerInfo {
        /// The consumer.
        name: String,
        /// Its stream.
        stream: String,
        /// The JetStream error.
        source: jetstream::context::ConsumerInfoError,
    },
    /// `wakebus init` could not update a stream whose settings differ: it
    /// exists to make them right, so this is its failure (a service uses
    /// the stream as it is, with a warning).
    #[error(
        "cannot update stream {name}: {source} (a timeout here usually means this NATS user may not update streams: run init as the operator)"
    )]
    Update {
        /// The stream.
        name: String,
        /// The JetStream error.
        source: jetstream::context::UpdateStreamError,
    },
    /// Another stream takes this stream's subjects (an archive on
    /// `<prefix>.>`, a deployment with a nested prefix), so it cannot be
    /// created.
    #[error(
        "cannot create stream {name}: its subjects {subjects:?} overlap those of stream {owner}; remove that stream or give this deployment another prefix"
    )]
    SubjectsOverlap {
        /// The stream.
        name: String,
        /// Its subjects.
        subjects: Vec<String>,
        /// The stream that takes them.
        owner: String,
    },
    /// A stream of this name exists but takes other subjects: another
    /// deployment's (two prefixes can map to one stream name) or one made
    /// by hand. Changing its subjects would take it from its owner.
    #[error(
        "stream {name} exists but takes {existing:?}, not {wanted:?}: another deployment whose prefix maps to the same stream names (`acme.prod` and `acme_prod` both do) or a stream made by hand; use another prefix, or remove or rename that stream"
    )]
    SubjectsTaken {
        /// The stream.
        name: String,
        /// Its subjects.
        existing: Vec<String>,
        /// This deployment's.
        wanted: Vec<String>,
    },
    /// The account requires every stream to have a byte limit (hosted
    /// NATS accounts do), and none was given for this one.
    #[error(
        "the NATS account requires every stream and bucket to have a byte limit (max_bytes_required), and stream {name} (part {part}) was given none: run `wakebus init --max-bytes SIZE`, which gives one to every part, adding `--max-bytes PART=SIZE` for a part sized apart (see OPERATIONS.md, \"Byte limits\")"
    )]
    MaxBytesRequired {
        /// The stream.
        name: String,
        /// The part of the deployment it holds, as `--max-bytes` names it.
        part: String,
    },
    /// A byte limit below what the stream already holds: the server would
    /// refuse every write to it (or drop its oldest messages). Checked for
    /// every part before anything is changed.
    #[error(
        "stream {name} (part {part}) holds {}, more than the {} asked for it: at that limit it would refuse every new message (the dead letters would drop their oldest) until it holds less; nothing was changed. Give `--max-bytes {part}=SIZE` above what it holds",
        bytesize::ByteSize(*holds),
        bytesize::ByteSize(u64::try_from(*asked).unwrap_or_default())
    )]
    MaxBytesBelowSize {
        /// The stream.
        name: String,
        /// The part of the deployment it holds, as `--max-bytes` names it.
        part: String,
        /// What it holds now.
        holds: u64,
        /// The limit asked for.
        asked: i64,
    },
    /// A stream that should exist could not be read.
    #[error("cannot read stream {name}: {source}")]
    GetStream {
        /// The stream.
        name: String,
        /// The JetStream error.
        source: jetstream::context::GetStreamError,
    },
}

/// A connection to one wakebus deployment: the client, JetStream and names.
#[derive(Debug, Clone)]
pub struct Bus {
    /// The NATS client (cheap to clone).
    pub client: Client,
    /// JetStream on that client.
    pub js: jetstream::Context,
    /// Every name of the deployment.
    pub subjects: Subjects,
}

/// The streams (and the cancel bucket every worker reads), after provisioning.
#[derive(Debug, Clone)]
pub struct Streams {
    /// The events stream (history).
    pub events: stream::Stream,
    /// Cancel records, checked before a task starts.
    pub cancels: kv::Store,
}

/// The wake service's KV buckets, after provisioning.
#[derive(Debug, Clone)]
pub struct WakeState {
    /// Which completions have been woken.
    pub wake_ledger: kv::Store,
    /// Per-session wake locks.
    pub session_locks: kv::Store,
}

impl Bus {
    /// Wraps a connected client.
    pub fn new(client: Client, subjects: Subjects) -> Self {
        let js = jetstream::new(client.clone());
        Self {
            client,
            js,
            subjects,
        }
    }

    /// The server's max payload, or NATS's default (1 MiB) while it is not
    /// known yet (the client connects in the background).
    pub fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => 1024 * 1024,
            known => known,
        }
    }
}

/// How a write whose result is already in hand (a worker's completion, a
/// delivered wake's ledger record) is made again until JetStream stores it:
/// from 100 ms, doubling up to 5 s, each delay plus up to as much again in
/// jitter (so waits reach 10 s), for as long as the service runs.
pub(crate) fn until_stored_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Why a publish to JetStream did not get a stored acknowledgement.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The body could not be encoded.
    #[error("cannot encode the message body: {0}")]
    Encode(#[from] serde_json::Error),
    /// The publish was not acknowledged (server down, timeout, no stream...).
    #[error("publish was not acknowledged by JetStream: {0}")]
    Publish(#[from] jetstream::context::PublishError),
    /// JetStream dropped it as a duplicate of a copy not stored yet (see
    /// [`confirm_stored`]): that copy may still be stored, or never be.
    #[error(
        "{stream} acknowledged the message as a duplicate of a copy it has not stored yet (one still being stored, or, with nats-server before 2.10.25, one lost in a leader election); it may not be stored: publish it again with the same message id, which is stored once, at the latest once the duplicate window has passed"
    )]
    DuplicateOfUnstored {
        /// The stream that answered.
        stream: String,
    },
}

impl PublishError {
    /// Whether the message was refused for its size: over the server's max
    /// payload (the client's own check), or over the stream's max message
    /// size or header size (`10054`, `10097`), which an operator may set
    /// below the server's max payload. The same bytes would be refused on
    /// every try; a smaller copy may be taken.
    pub fn is_too_large(&self) -> bool {
        use async_nats::jetstream::context::PublishErrorKind;
        use async_nats::jetstream::{Error, ErrorCode};
        let Self::Publish(error) = self else {
            return false;
        };
        if error.kind() == PublishErrorKind::MaxPayloadExceeded {
            return true;
        }
        std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<Error>())
            .is_some_and(|error| {
                matches!(
                    error.error_code(),
                    ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                        | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
                )
            })
    }
}
