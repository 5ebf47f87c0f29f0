//! The raw JetStream ceiling: the same number of 512-byte messages through
//! publish → pull+ack → publish → pull+ack, with no pipeline logic, on the
//! same server. Publishes keep a window of acks in flight.

use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{StreamExt, TryStreamExt};

/// Publish acks in flight per publisher.
const WINDOW: usize = 1024;
/// Messages per pull request.
const BATCH: usize = 512;

async fn context(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.expect("connect"))
}

/// Publishes `payload` to `subject` `n` times, keeping `WINDOW` acks in flight.
async fn publish_all(js: &jetstream::Context, subject: &str, n: usize, payload: Bytes) {
    let mut acks: FuturesUnordered<<PublishAckFuture as IntoFuture>::IntoFuture> =
        FuturesUnordered::new();
    for _ in 0..n {
        if acks.len() >= WINDOW {
            acks.next().await.expect("ack").expect("stored");
        }
        let ack = js
            .publish(subject.to_owned(), payload.clone())
            .await
            .expect("publish");
        acks.push(ack.into_future());
    }
    while let Some(ack) = acks.next().await {
        ack.expect("stored");
    }
}

async fn pull_consumer(js: &jetstream::Context, stream: &str) -> consumer::PullConsumer {
    js.get_stream(stream)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config {
            durable_name: Some("raw".to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 100_000,
            ..Default::default()
        })
        .await
        .expect("consumer")
}

/// Messages per second through both hops, for `n` messages.
pub(crate) async fn ceiling(url: &str, prefix: &str, n: usize) -> f64 {
    let admin = context(url).await;
    let first = format!("{prefix}_RAW_A");
    let second = format!("{prefix}_RAW_B");
    for (name, retention) in [
        (&first, stream::RetentionPolicy::WorkQueue),
        (&second, stream::RetentionPolicy::Limits),
    ] {
        admin
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                retention,
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .expect("stream");
    }
    let hop_one = pull_consumer(&admin, &first).await;
    let hop_two = pull_consumer(&admin, &second).await;
    let payload = Bytes::from(vec![b'x'; 512]);
    // Connected before the clock starts, as the pipeline's processes are.
    let (publishing, relaying) = (context(url).await, context(url).await);

    let begun = Instant::now();
    let publisher = {
        let js = publishing;
        let subject = format!("{first}.in");
        tokio::spawn(async move { publish_all(&js, &subject, n, payload).await })
    };
    let relay = {
        let js = relaying;
        let subject = format!("{second}.out");
        tokio::spawn(async move {
            let mut messages = hop_one
                .stream()
                .max_messages_per_batch(BATCH)
                .messages()
                .await
                .expect("pull");
            let mut acks: FuturesUnordered<<PublishAckFuture as IntoFuture>::IntoFuture> =
                FuturesUnordered::new();
            for _ in 0..n {
                let message = messages.try_next().await.expect("message").expect("more");
                if acks.len() >= WINDOW {
                    acks.next().await.expect("ack").expect("stored");
                }
                let ack = js
                    .publish(subject.clone(), message.payload.clone())
                    .await
                    .expect("publish");
                acks.push(ack.into_future());
                message.ack().await.expect("ack");
            }
            while let Some(ack) = acks.next().await {
                ack.expect("stored");
            }
        })
    };
    let sink = tokio::spawn(async move {
        let mut messages = hop_two
            .stream()
            .max_messages_per_batch(BATCH)
            .messages()
            .await
            .expect("pull");
        for _ in 0..n {
            let message = messages.try_next().await.expect("message").expect("more");
            message.ack().await.expect("ack");
        }
    });
    let timeout = Duration::from_secs(600);
    tokio::time::timeout(timeout, async {
        publisher.await.expect("publisher");
        relay.await.expect("relay");
        sink.await.expect("sink");
    })
    .await
    .expect("raw pipeline finished");
    let elapsed = begun.elapsed();
    for name in [&first, &second] {
        let _ = admin.delete_stream(name).await;
    }
    n as f64 / elapsed.as_secs_f64()
}
