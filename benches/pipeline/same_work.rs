//! The same-work ceiling: the stored writes and consumes of one delegation,
//! made with bare JetStream calls and no pipeline logic, on streams and
//! buckets provisioned exactly as the pipeline's are.
//!
//! The raw ceiling (`raw.rs`) is two writes and two pull+acks per message; a
//! delegation is seven writes and two pull+acks (BENCHMARKS.md, "Where the
//! time goes"). This measures what the broker itself does with that much
//! durable work, so that the pipeline's distance from it is our code's cost
//! and not the amount of work:
//!
//! - a delegator: the `submitted` record, its ack awaited, then the task
//!   (both with a `Nats-Msg-Id`), 512 delegations in flight;
//! - a worker: pull a task, store its `done` event (ack awaited), ack the
//!   task, 64 in flight;
//! - a wake: pull a `done` event, take the session's lock (a put), create the
//!   ledger entry (`posting`), put it again (`delivered`), release the lock
//!   (a delete marker), ack, 1,000 in flight.
//!
//! It leaves out what is not the broker's: JSON, checks, executors and the
//! HTTP post. Every lock step is made, as when no session's lock is kept
//! from its previous turn (the most a delegation costs). Writes are not
//! conditional where the pipeline's are; a condition is a header the server
//! compares, not another write.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use futures::StreamExt;
use wakebus::bus::BusSettings;
use wakebus::protocol::{EventKind, Subjects};

/// Delegations submitted at once, as the bench's delegator.
const DELEGATOR_WINDOW: usize = 512;
/// Tasks in flight, as a worker's default `--concurrency`.
const WORKER_WINDOW: usize = 64;
/// Completions in flight, as the wake's default `--max-in-flight`.
const WAKE_WINDOW: usize = 1000;
/// Messages per pull request.
const BATCH: usize = 512;

/// A payload of `len` bytes.
fn payload(len: usize) -> Bytes {
    Bytes::from(vec![b'x'; len])
}

/// Publishes `body` to `subject` under `id` and waits until it is stored.
async fn store(js: &jetstream::Context, subject: String, id: String, body: Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    js.publish_with_headers(subject, headers, body)
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

async fn connect(url: &str, prefix: &str) -> wakebus::bus::Bus {
    let client = async_nats::connect(url).await.expect("connect");
    wakebus::bus::Bus::new(client, Subjects::new(prefix).expect("prefix"))
}

/// Delegations per second through the same durable work, for `n`
/// delegations over `sessions` origin sessions.
pub(crate) async fn ceiling(url: &str, prefix: &str, n: usize, sessions: usize) -> f64 {
    let admin = connect(url, prefix).await;
    let settings = BusSettings::default();
    admin.provision(&settings).await.expect("streams");
    admin
        .provision_wake_state(&settings)
        .await
        .expect("buckets");
    let subjects = admin.subjects.clone();
    let tasks = pull(&admin.js, &subjects.tasks_stream(), subjects.tasks_all()).await;
    let done = pull(&admin.js, &subjects.events_stream(), subjects.done_events()).await;
    let session = move |i: usize| format!("s{}", i % sessions);

    let begun = Instant::now();
    let delegator = {
        let bus = connect(url, prefix).await;
        tokio::spawn(async move {
            let (record, task) = (payload(512), payload(512));
            futures::stream::iter(0..n)
                .map(|i| {
                    let (bus, record, task) = (&bus, record.clone(), task.clone());
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
        })
    };
    let worker = {
        let bus = connect(url, prefix).await;
        tokio::spawn(async move {
            let body = payload(512);
            let messages = tasks.stream().max_messages_per_batch(BATCH).messages();
            let messages = messages.await.expect("pull");
            messages
                .take(n)
                .map(|message| {
                    let (bus, body) = (&bus, body.clone());
                    async move {
                        let message = message.expect("task");
                        // The task's subject names no delegation; its
                        // stream sequence stands in for the id here.
                        let i = message.info().expect("info").stream_sequence as usize - 1;
                        let id = format!("d{i}");
                        let subject = bus.subjects.event(&session(i), &id, 0, EventKind::Done);
                        store(&bus.js, subject, format!("{id}.done"), body).await;
                        message.ack().await.expect("ack");
                    }
                })
                .buffer_unordered(WORKER_WINDOW)
                .collect::<()>()
                .await;
        })
    };
    let wake = {
        let bus = connect(url, prefix).await;
        tokio::spawn(async move {
            let state = bus.provision_wake_state(&settings).await.expect("buckets");
            let (locks, ledger) = (state.session_locks, state.wake_ledger);
            let messages = done.stream().max_messages_per_batch(BATCH).messages();
            let messages = messages.await.expect("pull");
            messages
                .take(n)
                .map(|message| {
                    let (locks, ledger) = (&locks, &ledger);
                    async move {
                        let message = message.expect("completion");
                        // `<prefix>.evt.<session>.<delegation>.<index>.done`
                        let mut tokens = message.subject.split('.').skip(2);
                        let (session, id) = (tokens.next().unwrap(), tokens.next().unwrap());
                        let key = format!("{id}.0");
                        locks
                            .put(session, Bytes::from_static(b"01JF0000000000000000000000"))
                            .await
                            .expect("lock taken");
                        ledger
                            .create(&key, Bytes::from_static(b"{\"state\":\"posting\"}"))
                            .await
                            .expect("posting");
                        ledger
                            .put(&key, Bytes::from_static(b"{\"state\":\"delivered\"}"))
                            .await
                            .expect("delivered");
                        locks.delete(session).await.expect("lock released");
                        message.ack().await.expect("ack");
                    }
                })
                .buffer_unordered(WAKE_WINDOW)
                .collect::<()>()
                .await;
        })
    };
    tokio::time::timeout(Duration::from_secs(600), async {
        delegator.await.expect("delegator");
        worker.await.expect("worker");
        wake.await.expect("wake");
    })
    .await
    .expect("same-work run finished");
    let elapsed = begun.elapsed();
    for stream in subjects.all_streams() {
        let _ = admin.js.delete_stream(stream).await;
    }
    n as f64 / elapsed.as_secs_f64()
}
