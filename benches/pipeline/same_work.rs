//! The same-work ceiling: the stored writes and consumes of the pipeline's
//! delegations, made with bare JetStream calls and no pipeline logic, on
//! streams and buckets provisioned exactly as the pipeline's are.
//!
//! The raw ceiling (`raw.rs`) is two writes and two pull+acks per message; a
//! delegation is five to seven writes and two pull+acks (BENCHMARKS.md,
//! "Where the time goes"). This measures what the broker itself does with
//! that much durable work, so that the pipeline's distance from it is the
//! cost of the rest:
//!
//! - a delegator: the `submitted` record, its ack awaited, then the task
//!   (both with a `Nats-Msg-Id`), 512 delegations in flight;
//! - a worker: pull a task, store its `done` event (ack awaited), ack the
//!   task, 64 in flight;
//! - a wake: pull a `done` event, take the session's lock (a put), create the
//!   ledger entry (`posting`), put it again (`delivered`), release the lock
//!   (a delete marker), ack, 1,000 in flight. The lock steps are made for
//!   the share of delegations whose turn took the lock in the pipeline's
//!   saturation run (the others kept it from their session's last turn).
//!
//! Each message is a copy of one the saturation run stored ([`Messages`]):
//! the same payload and the same headers (CloudEvents attributes, trace
//! context, origin), so the server stores and delivers as many bytes as for
//! the pipeline. It leaves out JSON, checks, executors, the HTTP post, and
//! the order the pipeline keeps (one post in flight per session). Writes are
//! not conditional where the pipeline's are; a condition is a header the
//! server compares, not another write.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, message::StreamMessage};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use wakebus::bus::{Bus, BusSettings, WakeState};
use wakebus::delegate::Delegator;
use wakebus::protocol::{CompletionEvent, EventKind, Subjects};
use wakebus::wake::ledger::{LedgerState, WakeLedger};

/// Delegations submitted at once, as the bench's delegator.
const DELEGATOR_WINDOW: usize = 512;
/// Tasks in flight, as a worker's default `--concurrency`.
const WORKER_WINDOW: usize = 64;
/// Completions in flight, as the wake's default `--max-in-flight`.
const WAKE_WINDOW: usize = 1000;
/// Messages per pull request.
const BATCH: usize = 512;

/// A message as the pipeline stored it: its headers and payload.
#[derive(Debug, Clone)]
struct Copied {
    /// Its headers, without any `Nats-Expected-*` condition (which names
    /// the run's own stream or sequence).
    headers: HeaderMap,
    /// Its payload.
    payload: Bytes,
}

impl Copied {
    fn of(message: StreamMessage) -> Self {
        let mut headers = HeaderMap::new();
        for (name, values) in message.headers.iter() {
            let text: &str = name.as_ref();
            if !text.starts_with("Nats-Expected") {
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        Self {
            headers,
            payload: message.payload,
        }
    }

    /// Payload and headers (`Name: value` and its line end), in bytes.
    fn len(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, values)| {
                let name: &str = name.as_ref();
                values
                    .iter()
                    .map(|v| name.len() + v.as_str().len() + 4)
                    .sum::<usize>()
            })
            .sum();
        self.payload.len() + headers
    }
}

/// One of each message a delegation stores, copied from the saturation
/// run, for the same-work ceiling to store the same bytes.
#[derive(Debug, Clone)]
pub(crate) struct Messages {
    /// A `submitted` record.
    submitted: Copied,
    /// A task request.
    task: Copied,
    /// A `done` event.
    done: Copied,
    /// A wake ledger `posting` entry.
    posting: Bytes,
    /// A wake ledger `delivered` entry.
    delivered: Bytes,
}

/// Bytes per message of each kind (payload and headers), as stored.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MessageBytes {
    /// A `submitted` record.
    pub(crate) submitted: usize,
    /// A task request.
    pub(crate) task: usize,
    /// A `done` event.
    pub(crate) done: usize,
    /// A `posting` ledger entry.
    pub(crate) posting: usize,
    /// A `delivered` ledger entry.
    pub(crate) delivered: usize,
}

impl Messages {
    /// Copies one message of each kind from the run under `prefix`, once
    /// its services have stopped: a completion and its ledger entry from
    /// the run, and the `submitted` record and task of one more delegation
    /// made for this, which no worker takes.
    pub(crate) async fn sample(url: &str, prefix: &str) -> Self {
        let bus = connect(url, prefix).await;
        let s = bus.subjects.clone();
        let delegator = Delegator::new(bus.clone());
        crate::submit(&delegator, "bench.s0".to_owned(), &Default::default()).await;
        let last = |stream: String| {
            let js = bus.js.clone();
            async move {
                let stream = js.get_stream(stream).await.expect("stream");
                let last = stream.get_info().await.expect("info").state.last_sequence;
                Copied::of(stream.get_raw_message(last).await.expect("last message"))
            }
        };
        let task = last(s.tasks_stream()).await;
        let submitted = last(s.events_stream()).await;
        let events = bus.js.get_stream(s.events_stream()).await.expect("events");
        let done = events
            .raw_message_builder()
            .sequence(1)
            .next_by_subject(s.done_events())
            .send()
            .await
            .map(Copied::of)
            .expect("a completion");
        let event = CompletionEvent::decode(&done.payload).expect("a completion");
        let state = bus
            .provision_wake_state(&BusSettings::default())
            .await
            .expect("buckets");
        let key = WakeLedger::key(&event.delegation_id, event.task_index);
        let delivered = state
            .wake_ledger
            .get(&key)
            .await
            .expect("ledger")
            .expect("a delivered entry");
        let Ok(LedgerState::Delivered {
            idempotency_key, ..
        }) = serde_json::from_slice(&delivered)
        else {
            panic!("{key} is not delivered");
        };
        let posting = serde_json::to_vec(&LedgerState::Posting { idempotency_key })
            .expect("json")
            .into();
        Self {
            submitted,
            task,
            done,
            posting,
            delivered,
        }
    }

    /// Their sizes.
    pub(crate) fn bytes(&self) -> MessageBytes {
        MessageBytes {
            submitted: self.submitted.len(),
            task: self.task.len(),
            done: self.done.len(),
            posting: self.posting.len(),
            delivered: self.delivered.len(),
        }
    }
}

/// Publishes a copy of `message` to `subject` under `id` and waits until it
/// is stored.
async fn store(js: &jetstream::Context, subject: String, id: String, message: &Copied) {
    let mut headers = message.headers.clone();
    headers.insert("Nats-Msg-Id", id.as_str());
    js.publish_with_headers(subject, headers, message.payload.clone())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

/// A pull consumer on `stream` for `filter`, acked one by one.
async fn pull(js: &jetstream::Context, stream: &str, filter: String) -> consumer::PullConsumer {
    js.get_stream(stream)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config {
            durable_name: Some("same-work".to_owned()),
            filter_subject: filter,
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 100_000,
            ..Default::default()
        })
        .await
        .expect("consumer")
}

async fn connect(url: &str, prefix: &str) -> Bus {
    let client = async_nats::connect(url).await.expect("connect");
    Bus::new(client, Subjects::new(prefix).expect("prefix"))
}

/// Whether delegation `i` of a run takes and releases its session's lock,
/// for `share` of them, spread evenly.
fn takes_lock(i: usize, share: f64) -> bool {
    (i as f64 * share).floor() != ((i + 1) as f64 * share).floor()
}

/// A same-work run, connected and provisioned, not yet started.
pub(crate) struct SameWork {
    /// Delegations to run.
    n: usize,
    /// Distinct origin sessions, round robin.
    sessions: usize,
    /// Share of delegations that take and release their session's lock.
    lock_share: f64,
    /// What each of them stores.
    messages: Messages,
    /// The delegator's connection.
    delegator: Bus,
    /// The worker's connection and its consumer on the tasks stream.
    worker: (Bus, consumer::PullConsumer),
    /// The wake's connection, its consumer on the completions, the lock
    /// and ledger buckets.
    wake: (Bus, consumer::PullConsumer, WakeState),
}

impl SameWork {
    /// Provisions streams and buckets under `prefix` as the pipeline does,
    /// connects the three roles and creates their consumers. `lock_share`
    /// of the delegations take their session's lock, as many as in the
    /// pipeline's saturation run (the rest keep it from their session's
    /// previous turn there).
    pub(crate) async fn prepare(
        url: &str,
        prefix: &str,
        config: &crate::Config,
        lock_share: f64,
        messages: Messages,
    ) -> Self {
        let settings = BusSettings::default();
        let delegator = connect(url, prefix).await;
        delegator.provision(&settings).await.expect("streams");
        let s = delegator.subjects.clone();
        let worker = connect(url, prefix).await;
        let tasks = pull(&worker.js, &s.tasks_stream(), s.tasks_all()).await;
        let wake = connect(url, prefix).await;
        let state = wake.provision_wake_state(&settings).await.expect("buckets");
        let done = pull(&wake.js, &s.events_stream(), s.done_events()).await;
        Self {
            n: config.n,
            sessions: config.sessions,
            lock_share,
            messages,
            delegator,
            worker: (worker, tasks),
            wake: (wake, done, state),
        }
    }

    /// Delegations per second through the same durable work.
    pub(crate) async fn run(self) -> f64 {
        let Self {
            n,
            sessions,
            lock_share,
            messages,
            delegator,
            worker,
            wake,
        } = self;
        let Messages {
            submitted: record,
            task,
            done: completion,
            posting,
            delivered,
        } = messages;
        let session = move |i: usize| format!("s{}", i % sessions);
        let begun = Instant::now();
        let delegator = tokio::spawn(async move {
            futures::stream::iter(0..n)
                .map(|i| {
                    let (bus, record, task) = (&delegator, &record, &task);
                    async move {
                        let s = &bus.subjects;
                        let id = format!("d{i}");
                        let subject = s.submitted(&session(i), &id, 0);
                        store(&bus.js, subject, format!("{id}.submitted"), record).await;
                        store(&bus.js, s.task("default"), format!("{id}.task"), task).await;
                    }
                })
                .buffer_unordered(DELEGATOR_WINDOW)
                .collect::<()>()
                .await;
        });
        let worker = tokio::spawn(async move {
            let (bus, tasks) = worker;
            let messages = tasks.stream().max_messages_per_batch(BATCH).messages();
            let messages = messages.await.expect("pull");
            messages
                .take(n)
                .map(|message| {
                    let (bus, completion) = (&bus, &completion);
                    async move {
                        let message = message.expect("task");
                        // The task's subject names no delegation; its
                        // stream sequence stands in for the id here.
                        let i = message.info().expect("info").stream_sequence as usize - 1;
                        let id = format!("d{i}");
                        let subject = bus.subjects.event(&session(i), &id, 0, EventKind::Done);
                        store(&bus.js, subject, format!("{id}.done"), completion).await;
                        message.ack().await.expect("ack");
                    }
                })
                .buffer_unordered(WORKER_WINDOW)
                .collect::<()>()
                .await;
        });
        let wake = tokio::spawn(async move {
            let (_bus, done, state) = wake;
            let (locks, ledger) = (&state.session_locks, &state.wake_ledger);
            let messages = done.stream().max_messages_per_batch(BATCH).messages();
            let messages = messages.await.expect("pull");
            messages
                .take(n)
                .enumerate()
                .map(|(i, message)| {
                    let (posting, delivered) = (posting.clone(), delivered.clone());
                    async move {
                        let message = message.expect("completion");
                        // `<prefix>.evt.<session>.<delegation>.<index>.done`
                        let mut tokens = message.subject.split('.').skip(2);
                        let (session, id) = (tokens.next().unwrap(), tokens.next().unwrap());
                        let key = format!("{id}.0");
                        let lock = takes_lock(i, lock_share);
                        if lock {
                            locks
                                .put(session, Bytes::from_static(b"01JF0000000000000000000000"))
                                .await
                                .expect("lock taken");
                        }
                        ledger.create(&key, posting).await.expect("posting");
                        ledger.put(&key, delivered).await.expect("delivered");
                        if lock {
                            locks.delete(session).await.expect("lock released");
                        }
                        message.ack().await.expect("ack");
                    }
                })
                .buffer_unordered(WAKE_WINDOW)
                .collect::<()>()
                .await;
        });
        tokio::time::timeout(Duration::from_secs(600), async {
            delegator.await.expect("delegator");
            worker.await.expect("worker");
            wake.await.expect("wake");
        })
        .await
        .expect("same-work run finished");
        n as f64 / begun.elapsed().as_secs_f64()
    }

    /// Deletes the streams and buckets of a run under `prefix`; returns
    /// what they had stored (see [`crate::stored`]).
    pub(crate) async fn clean_up(url: &str, prefix: &str) -> [u64; 4] {
        let bus = connect(url, prefix).await;
        let stored = crate::stored(&bus).await;
        for stream in bus.subjects.all_streams() {
            let _ = bus.js.delete_stream(stream).await;
        }
        stored
    }
}
