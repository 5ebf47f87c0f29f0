//! `wakebus status`: one snapshot of a deployment — streams and buckets
//! (with their replicas on a cluster), consumers, dead letters, live
//! instances, and the sessions whose wakes have waited longest.
//!
//! Everything is read, nothing is changed: stream and consumer info from
//! the JetStream API, per-subject dead-letter counts from the stream's
//! subject details, live instances by a scatter-gather `$SRV.STATS` request
//! (see [`crate::ops::service`]), and undelivered wakes by reading the
//! completions above the wake consumer's acknowledgement floor (through an
//! ordered consumer) and judging each as the wake does (`undelivered.rs`).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::jetstream;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

mod undelivered;

use undelivered::undelivered;

use crate::bus::{Bus, is_stream_not_found};
use crate::ops::service::{ServiceSnapshot, WAKE_SERVICE, WORKER_SERVICE};
use crate::protocol::POISON_TOKEN;

/// How the snapshot is taken.
#[derive(Debug, Clone)]
pub struct StatusOptions {
    /// How long to collect `$SRV.STATS` answers at most.
    pub discovery_timeout: Duration,
    /// Most completions to examine for undelivered wakes.
    pub scan_limit: u64,
    /// How many sessions to list under "oldest undelivered".
    pub top_sessions: usize,
    /// List this session only (if it waits), whatever its age: "is session
    /// S waiting?" must not depend on how many older sessions wait too.
    pub session: Option<String>,
}

impl Default for StatusOptions {
    fn default() -> Self {
        Self {
            discovery_timeout: Duration::from_secs(1),
            scan_limit: 5_000,
            top_sessions: 10,
            session: None,
        }
    }
}

/// The whole snapshot (`wakebus status --json` prints it as is).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    /// The deployment prefix.
    pub prefix: String,
    /// When the snapshot was taken.
    #[serde(with = "time::serde::rfc3339")]
    pub taken_at: OffsetDateTime,
    /// The three streams, then the streams of the three KV buckets
    /// (`KV_<bucket>`: cancel records, the wake ledger, session locks).
    pub streams: Vec<StreamStatus>,
    /// The durable consumers on the task and event streams.
    pub consumers: Vec<ConsumerStatus>,
    /// Dead letters by kind.
    pub dead_letters: DeadLetterCounts,
    /// Requests waiting in the task queue, by pool, and the pools nothing
    /// serves.
    #[serde(default)]
    pub queued: QueuedTasks,
    /// Live workers and wake instances.
    pub services: Vec<ServiceStatus>,
    /// Sessions with undelivered wakes, oldest first.
    pub oldest_undelivered: Vec<UndeliveredSession>,
    /// How the undelivered wakes were counted.
    pub undelivered_scan: ScanInfo,
}

impl StatusReport {
    /// The parts of the snapshot that could not be read: empty when it is
    /// whole. A partial snapshot is still worth printing, most of all
    /// during an election; checks that must not take it for a whole one
    /// look here (`status --strict`).
    pub fn unread(&self) -> Vec<Unread> {
        let streams = self
            .streams
            .iter()
            .filter(|stream| stream.error.is_some())
            .map(|stream| match stream.present {
                Some(true) => Unread::Consumers(stream.name.clone()),
                None | Some(false) => Unread::Stream(stream.name.clone()),
            });
        let dead_letters = self
            .dead_letters
            .error
            .as_ref()
            .map(|_| Unread::DeadLetters);
        let queued = self.queued.error.as_ref().map(|_| Unread::QueuedTasks);
        let scan = self
            .undelivered_scan
            .error
            .as_ref()
            .map(|_| Unread::UndeliveredScan);
        let refused = self
            .undelivered_scan
            .refused_error
            .as_ref()
            .map(|_| Unread::RefusedWakes);
        let beyond = self
            .undelivered_scan
            .inconclusive()
            .then_some(Unread::BeyondScanLimit);
        streams
            .chain(dead_letters)
            .chain(queued)
            .chain(scan)
            .chain(refused)
            .chain(beyond)
            .collect()
    }
}

/// A part of a [`StatusReport`] that could not be read; its `error` field
/// says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unread {
    /// A stream (by name): its row has no counts.
    Stream(String),
    /// A stream's consumers (by the stream's name): its row stands, the
    /// consumer table lacks them.
    Consumers(String),
    /// The dead-letter counts.
    DeadLetters,
    /// The queued requests by pool.
    QueuedTasks,
    /// The scan for undelivered wakes.
    UndeliveredScan,
    /// The wake dead letters the scan reads to tell refused completions
    /// from waiting ones: refused ones are listed as waiting.
    RefusedWakes,
    /// The completions beyond the scan's limit, when the scan found none
    /// waiting before it: whether any waits is not known.
    BeyondScanLimit,
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stream(name) => f.write_str(name),
            Self::Consumers(stream) => write!(f, "{stream}'s consumers"),
            Self::DeadLetters => f.write_str("the dead letters"),
            Self::QueuedTasks => f.write_str("the queued tasks"),
            Self::UndeliveredScan => f.write_str("the undelivered scan"),
            Self::RefusedWakes => f.write_str("the wake dead letters of the undelivered scan"),
            Self::BeyondScanLimit => f.write_str("the completions beyond --scan-limit"),
        }
    }
}

/// One stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamStatus {
    /// Its name.
    pub name: String,
    /// Whether it exists; `null` when it could not be read (see `error`).
    pub present: Option<bool>,
    /// Why it, or the list of its consumers, could not be read (a request
    /// timed out while its leader is elected, or was refused); the counts
    /// are then zero or missing.
    pub error: Option<String>,
    /// Messages stored.
    pub messages: u64,
    /// Bytes stored.
    pub bytes: u64,
    /// Its byte limit (`wakebus init --max-bytes`), `None` when it has
    /// none: at it, a stream refuses new messages (the dead letters drop
    /// their oldest).
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// When the oldest stored message was stored.
    #[serde(with = "time::serde::rfc3339::option")]
    pub first_time: Option<OffsetDateTime>,
    /// When the newest was stored.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_time: Option<OffsetDateTime>,
    /// First sequence still stored.
    pub first_seq: u64,
    /// Last sequence assigned.
    pub last_seq: u64,
    /// Consumers on it (ephemeral readers included).
    pub consumer_count: usize,
    /// Replicas it is configured with.
    pub replicas: usize,
    /// Where its replicas stand; `None` on a single server.
    pub cluster: Option<ReplicaSet>,
}

/// A replicated stream's leader and followers, as the JetStream API reports
/// them: during a rolling restart, the answer to "may the next node go?".
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicaSet {
    /// The server leading it; `None` while a leader is being elected (or
    /// when no quorum is left), and writes to it wait meanwhile.
    pub leader: Option<String>,
    /// The other replicas.
    pub followers: Vec<Follower>,
}

impl ReplicaSet {
    /// Whether it has a leader and every follower is current.
    pub fn healthy(&self) -> bool {
        self.leader.is_some() && self.followers.iter().all(|f| f.current && !f.offline)
    }
}

/// One follower of a replicated stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Follower {
    /// Its server name.
    pub name: String,
    /// Whether it has caught up with the leader.
    pub current: bool,
    /// Whether the group considers it gone.
    pub offline: bool,
    /// Operations it is behind the leader, when known.
    pub lag: Option<u64>,
}

/// One durable consumer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConsumerStatus {
    /// Its stream.
    pub stream: String,
    /// Its name (`worker-<pool>`, `wake`, or another program's durable).
    pub name: String,
    /// Messages not yet delivered.
    pub pending: u64,
    /// Delivered, not yet acknowledged.
    pub ack_pending: usize,
    /// Delivered more than once, not yet acknowledged.
    pub redelivered: usize,
    /// Pull requests waiting for messages (idle workers).
    pub waiting_pulls: usize,
    /// Highest stream sequence acknowledged with everything before it.
    pub ack_floor: u64,
}

/// Dead letters, by kind.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeadLetterCounts {
    /// All of them.
    pub total: u64,
    /// Task requests, by pool.
    pub tasks: BTreeMap<String, u64>,
    /// Completions the session API refused.
    pub wakes: u64,
    /// Completions that could not be used at all.
    pub poison: u64,
    /// Why they could not be counted (the counts are then zero).
    pub error: Option<String>,
}

/// Requests in the task queue (queued, or running and not yet acked), by
/// pool: a pool without a consumer or a live worker holds its requests
/// for ever (a mistyped `--pool`, a retired pool), which no other count
/// shows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct QueuedTasks {
    /// All of them.
    pub total: u64,
    /// By pool.
    pub pools: BTreeMap<String, u64>,
    /// Pools with requests but no worker consumer (`worker-<pool>`).
    pub without_consumer: Vec<String>,
    /// Pools with requests but no live worker instance found (a consumer
    /// may exist).
    pub without_worker: Vec<String>,
    /// Why they could not be counted (the counts are then zero).
    pub error: Option<String>,
}

/// One live instance.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// The micro service id.
    pub id: String,
    /// When it started.
    pub started: Option<String>,
    /// What it reports.
    #[serde(flatten)]
    pub snapshot: ServiceSnapshot,
}

/// A session with wakes not yet delivered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UndeliveredSession {
    /// The raw session id.
    pub session: String,
    /// Its subject token.
    pub session_token: String,
    /// Completions waiting.
    pub completions: u64,
    /// When the oldest of them was stored.
    #[serde(with = "time::serde::rfc3339")]
    pub oldest: OffsetDateTime,
    /// How long it has waited, in seconds.
    pub age_seconds: f64,
    /// The oldest one's delegation id.
    pub oldest_delegation_id: String,
}

/// How the undelivered scan went.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScanInfo {
    /// The first sequence examined (the wake consumer's ack floor + 1).
    pub from_seq: u64,
    /// The session the scan was narrowed to (`status --session`): every
    /// count here is then of that session's completions only.
    #[serde(default)]
    pub session: Option<String>,
    /// Completions examined.
    pub scanned: u64,
    /// Whether the scan reached the end (false: the limit cut it short, or
    /// it could not be made).
    pub complete: bool,
    /// Why the scan could not be made, if it could not: the rest of the
    /// snapshot still stands. It reads through a consumer of its own, whose
    /// creation can time out while a cluster elects leaders.
    #[serde(default)]
    pub error: Option<String>,
    /// Sessions with completions waiting (the list shows the oldest
    /// `top_sessions` of them).
    #[serde(default)]
    pub sessions: u64,
    /// Completions waiting, in all those sessions.
    #[serde(default)]
    pub completions: u64,
    /// Completions the wake cannot use (it dead-letters them to
    /// `<prefix>.dlq.wake.poison`): not waiting.
    #[serde(default)]
    pub unusable: u64,
    /// Completions the wake dead-lettered instead of waking them (the
    /// session API refused the turn, or the origin was not verified): not
    /// waiting, but in the wake dead letters.
    #[serde(default)]
    pub refused: u64,
    /// Batch members whose batch still has tasks to end: the batch's turn
    /// waits for them.
    #[serde(default)]
    pub batch_waiting: u64,
    /// Completions whose ledger entry could not be parsed (edited by hand,
    /// or written by a newer wakebus): listed as waiting.
    #[serde(default)]
    pub unreadable_entries: u64,
    /// Why the wake dead letters could not be read, if they could not:
    /// refused completions are then listed as waiting.
    #[serde(default)]
    pub refused_error: Option<String>,
    /// The events stream has no wake consumer (deleted, or no wake ever
    /// started), so there is no acknowledgement floor: the scan started at
    /// the beginning of the history, where completions are mostly long
    /// delivered, and a limited scan may not reach the waiting ones.
    #[serde(default)]
    pub no_wake_consumer: bool,
}

impl ScanInfo {
    /// Whether the scan stopped at its limit without finding a waiting
    /// completion: it cannot tell whether any waits.
    pub fn inconclusive(&self) -> bool {
        self.error.is_none() && !self.complete && self.sessions == 0
    }
}

/// Why the snapshot could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// A JetStream request failed.
    #[error("cannot read {what}: {reason}")]
    Read {
        /// What was being read.
        what: String,
        /// The error.
        reason: String,
    },
}

fn read_error(what: impl Into<String>, error: impl std::fmt::Display) -> StatusError {
    StatusError::Read {
        what: what.into(),
        reason: error.to_string(),
    }
}

/// Takes the snapshot.
pub async fn collect(bus: &Bus, options: &StatusOptions) -> Result<StatusReport, StatusError> {
    let s = &bus.subjects;
    // All at once: during an election each stream that cannot be read
    // takes a request timeout, and one after the other they would add up.
    let names = s.all_streams();
    let read = futures::future::join_all(names.iter().map(|name| stream_status(bus, name))).await;
    let mut streams = Vec::new();
    let mut consumers = Vec::new();
    for (status, durables) in read {
        streams.push(status);
        consumers.extend(durables);
    }
    let dead_letter_stream = streams
        .iter()
        .find(|stream| stream.name == s.dead_letter_stream());
    let dead_letters = match dead_letter_stream {
        // Reading it again would only wait for the same failure.
        Some(stream) if stream.present.is_none() => DeadLetterCounts {
            error: stream.error.clone(),
            ..DeadLetterCounts::default()
        },
        _ => dead_letter_counts(bus)
            .await
            .unwrap_or_else(|error| DeadLetterCounts {
                error: Some(error.to_string()),
                ..DeadLetterCounts::default()
            }),
    };
    let (workers, wakes) = tokio::join!(
        discover(bus, WORKER_SERVICE, options.discovery_timeout),
        discover(bus, WAKE_SERVICE, options.discovery_timeout),
    );
    let mut services = workers?;
    services.extend(wakes?);
    let tasks_stream = streams
        .iter()
        .find(|stream| stream.name == s.tasks_stream());
    let queued = match tasks_stream {
        Some(stream) if stream.present == Some(false) => QueuedTasks::default(),
        Some(stream) if stream.present.is_none() => QueuedTasks {
            error: stream.error.clone(),
            ..QueuedTasks::default()
        },
        None => QueuedTasks::default(),
        // Its consumers not read: no pool can be said to lack one.
        Some(stream) => queued_tasks(
            bus,
            stream.error.is_none().then_some(&consumers[..]),
            &services,
        )
        .await
        .unwrap_or_else(|error| QueuedTasks {
            error: Some(error.to_string()),
            ..QueuedTasks::default()
        }),
    };
    services.sort_by(|a, b| {
        (&a.snapshot.kind, &a.snapshot.pool, &a.snapshot.instance).cmp(&(
            &b.snapshot.kind,
            &b.snapshot.pool,
            &b.snapshot.instance,
        ))
    });
    let wake_floor = consumers
        .iter()
        .find(|c| c.stream == s.events_stream() && c.name == s.wake_consumer())
        .map(|c| c.ack_floor);
    let from_seq = wake_floor.unwrap_or(0) + 1;
    let events = streams
        .iter()
        .find(|stream| stream.name == s.events_stream());
    // Without the wake consumer's floor the scan would start at the
    // beginning of the stream; when the stream itself was not read, what it
    // would read is what just failed.
    let unscannable = match events {
        Some(events) if events.present.is_none() => Some(format!("{} was not read", events.name)),
        Some(events) if events.error.is_some() => Some(format!(
            "the consumers of {} were not read, so the wake's ack floor is unknown",
            events.name
        )),
        _ => None,
    };
    let scanned = match unscannable {
        Some(why) => Err(read_error("completions", why)),
        None => undelivered(bus, from_seq, options).await,
    };
    let (oldest_undelivered, undelivered_scan) = match scanned {
        Ok((list, mut scan)) => {
            scan.no_wake_consumer =
                wake_floor.is_none() && events.is_some_and(|e| e.present == Some(true));
            (list, scan)
        }
        Err(error) => {
            let scan = ScanInfo {
                from_seq,
                session: options.session.clone(),
                error: Some(error.to_string()),
                ..ScanInfo::default()
            };
            (Vec::new(), scan)
        }
    };
    Ok(StatusReport {
        prefix: s.prefix().to_owned(),
        taken_at: OffsetDateTime::now_utc(),
        streams,
        consumers,
        dead_letters,
        queued,
        services,
        oldest_undelivered,
        undelivered_scan,
    })
}

/// One stream's row and its durable consumers. A stream that cannot be read
/// is reported so (`present: null` and the error), not as absent: that would
/// send an operator to re-create what is there. Only a stream the server
/// says does not exist is absent.
async fn stream_status(bus: &Bus, name: &str) -> (StreamStatus, Vec<ConsumerStatus>) {
    let unread = |present: Option<bool>, error: Option<String>| StreamStatus {
        name: name.to_owned(),
        present,
        error,
        messages: 0,
        bytes: 0,
        max_bytes: None,
        first_time: None,
        last_time: None,
        first_seq: 0,
        last_seq: 0,
        consumer_count: 0,
        replicas: 0,
        cluster: None,
    };
    let mut stream = match bus.js.get_stream(name).await {
        Ok(stream) => stream,
        Err(error) if is_stream_not_found(&error) => {
            return (unread(Some(false), None), Vec::new());
        }
        Err(error) => {
            let error = read_error(name, error).to_string();
            return (unread(None, Some(error)), Vec::new());
        }
    };
    let info = match stream.info().await {
        Ok(info) => info,
        Err(error) => {
            let error = read_error(name, error).to_string();
            return (unread(None, Some(error)), Vec::new());
        }
    };
    let state = &info.state;
    let stored = state.messages > 0;
    let mut status = StreamStatus {
        name: name.to_owned(),
        present: Some(true),
        error: None,
        messages: state.messages,
        bytes: state.bytes,
        max_bytes: u64::try_from(info.config.max_bytes)
            .ok()
            .filter(|limit| *limit > 0),
        first_time: stored.then_some(state.first_timestamp),
        last_time: stored.then_some(state.last_timestamp),
        first_seq: state.first_sequence,
        last_seq: state.last_sequence,
        consumer_count: state.consumer_count,
        replicas: info.config.num_replicas,
        // A single server names itself as leader but no cluster.
        cluster: info
            .cluster
            .as_ref()
            .filter(|cluster| cluster.name.is_some())
            .map(replica_set),
    };
    let mut durables = Vec::new();
    let mut listed = stream.consumers();
    loop {
        let info = match listed.try_next().await {
            Ok(Some(info)) => info,
            Ok(None) => break,
            Err(error) => {
                let error = read_error(format!("consumers of {name}"), error).to_string();
                status.error = Some(error);
                break;
            }
        };
        if info.config.durable_name.is_none() {
            continue;
        }
        durables.push(ConsumerStatus {
            stream: name.to_owned(),
            name: info.name.clone(),
            pending: info.num_pending,
            ack_pending: info.num_ack_pending,
            redelivered: info.num_redelivered,
            waiting_pulls: info.num_waiting,
            ack_floor: info.ack_floor.stream_sequence,
        });
    }
    durables.sort_by(|a, b| a.name.cmp(&b.name));
    (status, durables)
}

/// The replica set of a clustered stream from its cluster info.
fn replica_set(cluster: &async_nats::jetstream::stream::ClusterInfo) -> ReplicaSet {
    ReplicaSet {
        leader: cluster.leader.clone(),
        followers: cluster
            .replicas
            .iter()
            .map(|peer| Follower {
                name: peer.name.clone(),
                current: peer.current,
                offline: peer.offline,
                lag: peer.lag,
            })
            .collect(),
    }
}

async fn dead_letter_counts(bus: &Bus) -> Result<DeadLetterCounts, StatusError> {
    let s = &bus.subjects;
    let name = s.dead_letter_stream();
    let stream = match bus.js.get_stream(&name).await {
        Ok(stream) => stream,
        Err(error) if is_stream_not_found(&error) => return Ok(DeadLetterCounts::default()),
        Err(error) => return Err(read_error(&name, error)),
    };
    let mut counts = DeadLetterCounts::default();
    // `<prefix>.dlq.task.`, the pool follows.
    let task_prefix = s.dead_letter_task("");
    let poison = s.dead_letter_wake(POISON_TOKEN);
    for (subject, count) in subject_counts(&stream, &name, s.dead_letters_all()).await? {
        counts.total += count;
        if subject == poison {
            counts.poison += count;
        } else if let Some(pool) = subject.strip_prefix(task_prefix.as_str()) {
            *counts.tasks.entry(pool.to_owned()).or_default() += count;
        } else {
            counts.wakes += count;
        }
    }
    Ok(counts)
}

/// How many messages `stream` (named `name`) holds on each subject that
/// `filter` matches.
async fn subject_counts(
    stream: &async_nats::jetstream::stream::Stream,
    name: &str,
    filter: String,
) -> Result<Vec<(String, u64)>, StatusError> {
    let unread = |e: &dyn std::fmt::Display| read_error(format!("subjects of {name}"), e);
    let mut subjects = stream
        .info_with_subjects(filter)
        .await
        .map_err(|e| unread(&e))?;
    let mut counts = Vec::new();
    while let Some((subject, count)) = subjects.try_next().await.map_err(|e| unread(&e))? {
        counts.push((subject, count as u64));
    }
    Ok(counts)
}

/// The task queue's requests by pool, and the pools with requests that no
/// consumer, or no live worker, serves. Without the task stream's
/// consumers (`None`: not read), no pool is said to lack one.
async fn queued_tasks(
    bus: &Bus,
    consumers: Option<&[ConsumerStatus]>,
    services: &[ServiceStatus],
) -> Result<QueuedTasks, StatusError> {
    let s = &bus.subjects;
    let name = s.tasks_stream();
    let stream = bus
        .js
        .get_stream(&name)
        .await
        .map_err(|e| read_error(&name, e))?;
    let mut queued = QueuedTasks::default();
    // `<prefix>.task.`, the pool follows.
    let task_prefix = s.task("");
    for (subject, count) in subject_counts(&stream, &name, s.tasks_all()).await? {
        let Some(pool) = subject.strip_prefix(task_prefix.as_str()) else {
            continue;
        };
        queued.total += count;
        *queued.pools.entry(pool.to_owned()).or_default() += count;
    }
    for (pool, _) in queued.pools.iter().filter(|(_, count)| **count > 0) {
        let consumer = s.worker_consumer(pool);
        let has_consumer = |consumers: &[ConsumerStatus]| {
            consumers
                .iter()
                .any(|c| c.stream == name && c.name == consumer)
        };
        if consumers.is_some_and(|consumers| !has_consumer(consumers)) {
            queued.without_consumer.push(pool.clone());
        }
        let served = services.iter().any(|service| {
            service.snapshot.kind == "worker" && service.snapshot.pool.as_deref() == Some(pool)
        });
        if !served {
            queued.without_worker.push(pool.clone());
        }
    }
    Ok(queued)
}

/// A `$SRV.STATS` reply, as far as status needs it.
#[derive(Debug, Deserialize)]
struct StatsReply {
    /// The instance's service id.
    id: String,
    /// When it started.
    #[serde(default)]
    started: Option<String>,
    /// Its endpoints; the status endpoint's `data` is the snapshot.
    #[serde(default)]
    endpoints: Vec<EndpointStats>,
}

/// One endpoint of a `$SRV.STATS` reply.
#[derive(Debug, Deserialize)]
struct EndpointStats {
    /// The stats handler's output.
    #[serde(default)]
    data: Option<serde_json::Value>,
}

/// How long discovery waits for NATS to confirm that its request went out
/// (at least; the discovery window if longer), as long as a JetStream
/// request may take.
const FLUSH_PATIENCE: Duration = Duration::from_secs(5);

/// How many workers and wake services of `bus`'s deployment answer within
/// `timeout`.
pub(crate) async fn live_instances(bus: &Bus, timeout: Duration) -> Result<usize, StatusError> {
    let (workers, wakes) = tokio::join!(
        discover(bus, WORKER_SERVICE, timeout),
        discover(bus, WAKE_SERVICE, timeout),
    );
    Ok(workers?.len() + wakes?.len())
}

/// Whether anything takes the requests of a worker pool, as a caller
/// waiting for a result wants to know: a request to a pool nothing serves
/// waits for ever, silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolService {
    /// No consumer for the pool: no worker of it ever started, or its
    /// name is mistyped.
    NoConsumer,
    /// A consumer, but no worker pulling from it and nothing in hand, at
    /// two looks `apart`: its workers are down.
    NoWorker,
    /// No worker pulling, at two looks `apart`, but tasks in hand: every
    /// worker is busy, or stopped with them (they stay in hand until
    /// another worker pulls).
    Busy {
        /// Tasks delivered and not yet acknowledged.
        in_hand: u64,
    },
    /// A worker is pulling.
    Served,
}

/// Whether `pool` has a consumer and a worker pulling from it, read from
/// the consumer alone (which a delegator may read; live-instance
/// discovery is the operator's): a pull waiting at one of two looks
/// `apart` (an idle worker renews its pull between the two).
pub async fn pool_service(
    bus: &Bus,
    pool: &str,
    apart: Duration,
) -> Result<PoolService, StatusError> {
    let s = &bus.subjects;
    let name = s.worker_consumer(pool);
    let consumer = bus
        .js
        .get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>(
            &name,
            s.tasks_stream(),
        )
        .await;
    let mut consumer = match consumer {
        Ok(consumer) => consumer,
        Err(error) if is_consumer_not_found(&error) => return Ok(PoolService::NoConsumer),
        Err(error) => return Err(read_error(name, error)),
    };
    if consumer.cached_info().num_waiting > 0 {
        return Ok(PoolService::Served);
    }
    tokio::time::sleep(apart).await;
    let info = consumer
        .info()
        .await
        .map_err(|error| read_error(name, error))?;
    Ok(match (info.num_waiting, info.num_ack_pending) {
        (0, 0) => PoolService::NoWorker,
        (0, in_hand) => PoolService::Busy {
            in_hand: u64::try_from(in_hand).unwrap_or(u64::MAX),
        },
        _ => PoolService::Served,
    })
}

/// Whether a consumer lookup failed because it (or its stream) does not
/// exist.
fn is_consumer_not_found(error: &jetstream::stream::ConsumerError) -> bool {
    use jetstream::stream::ConsumerErrorKind;
    match error.kind() {
        ConsumerErrorKind::JetStream(error) => matches!(
            error.error_code(),
            jetstream::ErrorCode::CONSUMER_NOT_FOUND | jetstream::ErrorCode::STREAM_NOT_FOUND
        ),
        _ => false,
    }
}

/// Asks every instance of `service` for its stats; keeps this deployment's.
async fn discover(
    bus: &Bus,
    service: &str,
    timeout: Duration,
) -> Result<Vec<ServiceStatus>, StatusError> {
    let client = &bus.client;
    let inbox = client.new_inbox();
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| read_error("service discovery", e))?;
    client
        .publish_with_reply(format!("$SRV.STATS.{service}"), inbox, "".into())
        .await
        .map_err(|e| read_error("service discovery", e))?;
    // Bounded: with the server gone it would wait for ever.
    crate::connect::flush_within(client, timeout.max(FLUSH_PATIENCE))
        .await
        .map_err(|e| read_error("service discovery", e))?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut found: HashMap<String, ServiceStatus> = HashMap::new();
    // Wait the whole window: there is no telling how many will answer.
    while let Ok(Some(reply)) = tokio::time::timeout_at(deadline, replies.next()).await {
        let Ok(stats) = serde_json::from_slice::<StatsReply>(&reply.payload) else {
            continue;
        };
        let snapshot = stats
            .endpoints
            .iter()
            .filter_map(|e| e.data.clone())
            .find_map(|data| serde_json::from_value::<ServiceSnapshot>(data).ok());
        if let Some(snapshot) = snapshot.filter(|s| s.prefix == bus.subjects.prefix()) {
            found.insert(
                stats.id.clone(),
                ServiceStatus {
                    id: stats.id,
                    started: stats.started,
                    snapshot,
                },
            );
        }
    }
    Ok(found.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot of one deployment whose every part was read, as JSON.
    fn whole() -> serde_json::Value {
        let stream = |name: &str| {
            serde_json::json!({
                "name": name, "present": true, "error": null, "messages": 0,
                "bytes": 0, "first_time": null, "last_time": null, "first_seq": 0,
                "last_seq": 0, "consumer_count": 0, "replicas": 1, "cluster": null
            })
        };
        serde_json::json!({
            "prefix": "wakebus",
            "taken_at": "2026-12-05T12:00:00Z",
            "streams": [stream("WAKEBUS_TASKS"), stream("WAKEBUS_EVENTS"), stream("WAKEBUS_DLQ")],
            "consumers": [],
            "dead_letters": {"total": 0, "tasks": {}, "wakes": 0, "poison": 0, "error": null},
            "services": [],
            "oldest_undelivered": [],
            "undelivered_scan": {"from_seq": 1, "scanned": 0, "complete": true, "error": null}
        })
    }

    fn unread(report: serde_json::Value) -> Vec<Unread> {
        serde_json::from_value::<StatusReport>(report)
            .expect("a report")
            .unread()
    }

    #[test]
    fn a_whole_snapshot_has_nothing_unread() {
        assert_eq!(unread(whole()), Vec::new());
    }

    #[test]
    fn unread_names_streams_consumers_dead_letters_and_the_scan_in_order() {
        let mut report = whole();
        report["streams"][0]["present"] = serde_json::Value::Null;
        report["streams"][0]["error"] = "timed out".into();
        report["streams"][1]["error"] = "cannot read the consumers".into();
        report["dead_letters"]["error"] = "refused".into();
        report["queued"] = serde_json::json!({"total": 0, "pools": {}, "without_consumer": [], "without_worker": [], "error": "timed out"});
        report["undelivered_scan"]["error"] = "no consumer".into();
        report["undelivered_scan"]["refused_error"] = "timed out".into();
        let parts = unread(report);
        assert_eq!(
            parts,
            vec![
                Unread::Stream("WAKEBUS_TASKS".to_owned()),
                Unread::Consumers("WAKEBUS_EVENTS".to_owned()),
                Unread::DeadLetters,
                Unread::QueuedTasks,
                Unread::UndeliveredScan,
                Unread::RefusedWakes,
            ]
        );
        let text: Vec<String> = parts.iter().map(ToString::to_string).collect();
        assert_eq!(
            text.join(", "),
            "WAKEBUS_TASKS, WAKEBUS_EVENTS's consumers, the dead letters, the queued tasks, the undelivered scan, the wake dead letters of the undelivered scan"
        );
    }

    #[test]
    fn a_stream_reported_absent_with_an_error_is_named_as_the_stream() {
        let mut report = whole();
        report["streams"][2]["present"] = false.into();
        report["streams"][2]["error"] = "odd".into();
        assert_eq!(
            unread(report),
            vec![Unread::Stream("WAKEBUS_DLQ".to_owned())]
        );
    }
}
