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
//! Every task, record, completion and ledger entry is a copy of one stored
//! under the saturation run's prefix (`sample.rs`): the same payload and headers
//! (CloudEvents attributes, trace context, origin). The names are as long
//! as the pipeline's too: a prefix like a bench run's, 26-character
//! delegation ids, session tokens made as the pipeline makes them, the
//! pipeline's `Nats-Msg-Id`s and ledger keys. The lock value has the
//! pipeline's shape (`<instance> <ULID>`). Every header map is built before
//! the clock starts, so the client costs as little as it can. It leaves out
//! JSON, checks, executors, the HTTP post, and the order the pipeline keeps
//! (one post in flight per session). Writes are not conditional where the
//! pipeline's are; a condition is a header the server compares, not
//! another write.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use futures::StreamExt;
use wakebus::bus::{Bus, BusSettings, WakeState};
use wakebus::protocol::{CompletionEvent, EventKind, Subjects, SubmittedRecord, session_token};
use wakebus::wake::ledger::WakeLedger;

use crate::sample::Messages;

/// Delegations submitted at once, as the bench's delegator.
const DELEGATOR_WINDOW: usize = 512;
/// Tasks in flight, as a worker's default `--concurrency`.
const WORKER_WINDOW: usize = 64;
/// Completions in flight, as the wake's default `--max-in-flight`.
const WAKE_WINDOW: usize = 1000;
/// Messages per pull request.
const BATCH: usize = 512;

/// Publishes `payload` to `subject` with `headers` and waits until it is
/// stored.
async fn store(js: &jetstream::Context, subject: String, headers: HeaderMap, payload: Bytes) {
    js.publish_with_headers(subject, headers, payload)
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

/// What the delegator stores for one delegation, built in advance.
struct Submission {
    /// The `submitted` record's subject.
    subject: String,
    /// The record's headers.
    record: HeaderMap,
    /// The task's headers.
    task: HeaderMap,
}

/// A same-work run, connected and provisioned, not yet started.
pub(crate) struct SameWork {
    /// Delegations to run.
    n: usize,
    /// Share of delegations that take and release their session's lock.
    lock_share: f64,
    /// What each delegation stores.
    messages: Messages,
    /// Delegation `i`'s record and task.
    submissions: Vec<Submission>,
    /// Delegation `i`'s `done` event subject and headers, taken by the
    /// worker when it runs the task.
    completions: Vec<Option<(String, HeaderMap)>>,
    /// The value of a session's lock.
    lock_value: Bytes,
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
    /// connects the three roles, creates their consumers and builds every
    /// message's headers. `lock_share` of the delegations take their
    /// session's lock, as many as in the pipeline's saturation run (the
    /// rest keep it from their session's previous turn there).
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
        let tokens: Vec<String> = (0..config.sessions)
            .map(|i| session_token(&format!("bench.s{i}")))
            .collect();
        let (mut submissions, mut completions) = (Vec::new(), Vec::new());
        for i in 0..config.n {
            let (id, token) = (format!("{i:026}"), &tokens[i % config.sessions]);
            submissions.push(Submission {
                subject: s.submitted(token, &id, 0),
                record: messages
                    .submitted
                    .headers_with_id(&SubmittedRecord::id_for(&id, 0)),
                task: messages.task.headers_with_id(&format!("{id}.0")),
            });
            completions.push(Some((
                s.event(token, &id, 0, EventKind::Done),
                messages
                    .done
                    .headers_with_id(&CompletionEvent::id_for(&id, 0)),
            )));
        }
        let lock_value = format!("wake-bench-{} {}", std::process::id(), ulid::Ulid::new());
        Self {
            n: config.n,
            lock_share,
            messages,
            submissions,
            completions,
            lock_value: lock_value.into(),
            delegator,
            worker: (worker, tasks),
            wake: (wake, done, state),
        }
    }

    /// Delegations per second through the same durable work.
    pub(crate) async fn run(self) -> f64 {
        let Self {
            n,
            lock_share,
            messages,
            submissions,
            mut completions,
            lock_value,
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
        let begun = Instant::now();
        let delegator = tokio::spawn(async move {
            let task_subject = delegator.subjects.task("default");
            futures::stream::iter(submissions)
                .map(|submission| {
                    let (js, record, task) =
                        (&delegator.js, record.payload.clone(), task.payload.clone());
                    let task_subject = task_subject.clone();
                    async move {
                        store(js, submission.subject, submission.record, record).await;
                        store(js, task_subject, submission.task, task).await;
                    }
                })
                .buffer_unordered(DELEGATOR_WINDOW)
                .for_each(|()| std::future::ready(()))
                .await;
        });
        let worker = tokio::spawn(async move {
            let (bus, tasks) = worker;
            let messages = tasks.stream().max_messages_per_batch(BATCH).messages();
            let messages = messages.await.expect("pull");
            messages
                .take(n)
                .map(|message| {
                    let message = message.expect("task");
                    // The task's subject names no delegation; its stream
                    // sequence stands in for the id here.
                    let i = message.info().expect("info").stream_sequence as usize - 1;
                    let (subject, headers) = completions[i].take().expect("one run per task");
                    let (js, payload) = (&bus.js, completion.payload.clone());
                    async move {
                        store(js, subject, headers, payload).await;
                        message.ack().await.expect("ack");
                    }
                })
                .buffer_unordered(WORKER_WINDOW)
                .for_each(|()| std::future::ready(()))
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
                    let lock_value = lock_value.clone();
                    async move {
                        let message = message.expect("completion");
                        // `<prefix>.evt.<session>.<delegation>.<index>.done`
                        let mut tokens = message.subject.split('.').skip(2);
                        let (session, id) = (tokens.next().unwrap(), tokens.next().unwrap());
                        let key = WakeLedger::key(id, 0);
                        let lock = takes_lock(i, lock_share);
                        if lock {
                            locks.put(session, lock_value).await.expect("lock taken");
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
                .for_each(|()| std::future::ready(()))
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
