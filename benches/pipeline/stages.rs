//! Where a delegation's latency goes, stage by stage, read back from the
//! history after a run: the server's store timestamps of each task's
//! `submitted` and `done` events, between the bench's own submit and
//! arrival times.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use serde::Serialize;
use wakebus::bus::Bus;

use crate::report::Latency;

/// The latency of each stage, over the delegations of one run (`None` for
/// a stage with no samples).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Stages {
    /// Submit → `submitted` record stored: the delegator's first write.
    pub(crate) record: Option<Latency>,
    /// `submitted` stored → `done` stored: the task request's write,
    /// queueing, the worker's pull, running the (echo) executor and storing
    /// the completion. (A quick task writes no `started` event to split it
    /// at.)
    pub(crate) worker: Option<Latency>,
    /// `done` stored → continuation received: the wake's pull, lock,
    /// ledger and HTTP post.
    pub(crate) wake: Option<Latency>,
}

/// Store times of one task's events.
#[derive(Default)]
struct Stored {
    /// When the delegator's `submitted` record was stored.
    submitted: Option<SystemTime>,
    /// When the worker's completion was stored.
    done: Option<SystemTime>,
}

/// Reads every event of the run and splits each delegation's latency into
/// stages. `at` converts the bench's `Instant`s to wall-clock time.
pub(crate) async fn measure(
    bus: &Bus,
    submitted: &HashMap<String, Instant>,
    arrivals: &HashMap<String, Instant>,
    at: impl Fn(Instant) -> SystemTime,
) -> Stages {
    let mut stream = bus
        .js
        .get_stream(bus.subjects.events_stream())
        .await
        .expect("events stream");
    let last = stream
        .info()
        .await
        .expect("events info")
        .state
        .last_sequence;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: bus.subjects.events_all(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("ordered consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut stored: HashMap<String, Stored> = HashMap::with_capacity(submitted.len());
    while let Some(message) = messages.next().await {
        let message = message.expect("event");
        let info = message.info().expect("info");
        let sequence = info.stream_sequence;
        let when = SystemTime::from(info.published);
        let parts: Vec<&str> = message.subject.split('.').collect();
        if let [.., delegation, _task, kind] = parts.as_slice()
            && submitted.contains_key(*delegation)
        {
            let entry = stored.entry((*delegation).to_owned()).or_default();
            match *kind {
                "submitted" => entry.submitted = Some(when),
                "done" => entry.done = Some(when),
                _ => {}
            }
        }
        if sequence >= last {
            break;
        }
    }
    let gap = |from: SystemTime, to: SystemTime| to.duration_since(from).unwrap_or(Duration::ZERO);
    let (mut record, mut worker, mut wake) = (vec![], vec![], vec![]);
    for (id, submit) in submitted {
        let (Some(times), Some(arrived)) = (stored.get(id), arrivals.get(id)) else {
            continue;
        };
        let (submit, arrived) = (at(*submit), at(*arrived));
        if let Some(s) = times.submitted {
            record.push(gap(submit, s));
        }
        if let (Some(s), Some(d)) = (times.submitted, times.done) {
            worker.push(gap(s, d));
        }
        if let Some(d) = times.done {
            wake.push(gap(d, arrived));
        }
    }
    let of = |samples: Vec<Duration>| (!samples.is_empty()).then(|| Latency::of(samples));
    Stages {
        record: of(record),
        worker: of(worker),
        wake: of(wake),
    }
}
