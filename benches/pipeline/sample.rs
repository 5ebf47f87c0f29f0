//! One message of each kind a delegation stores, copied from the saturation
//! run, so that the same-work ceiling (`same_work.rs`) stores the same bytes.

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use bytes::Bytes;
use serde::Serialize;
use wakebus::bus::{Bus, BusSettings};
use wakebus::delegate::Delegator;
use wakebus::protocol::{CompletionEvent, HEADER_DELEGATION_ID, session_token};
use wakebus::wake::ledger::{LedgerState, WakeLedger};

/// A stored message: its headers and payload.
#[derive(Debug, Clone)]
pub(crate) struct Copied {
    /// Its headers, as stored (a copy's `Nats-Msg-Id` is replaced).
    pub(crate) headers: HeaderMap,
    /// Its payload.
    pub(crate) payload: Bytes,
}

impl Copied {
    /// The headers and payload of `message`.
    fn of(message: StreamMessage) -> Self {
        Self {
            headers: message.headers,
            payload: message.payload,
        }
    }

    /// The payload and the header lines (`Name: value` and the line end),
    /// in bytes.
    fn len(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, values)| {
                let name: &str = name.as_ref();
                values
                    .iter()
                    .map(|value| name.len() + value.as_str().len() + 4)
                    .sum::<usize>()
            })
            .sum();
        self.payload.len() + headers
    }

    /// A header map like this one's, with `id` as its `Nats-Msg-Id`.
    pub(crate) fn headers_with_id(&self, id: &str) -> HeaderMap {
        let mut headers = self.headers.clone();
        headers.insert("Nats-Msg-Id", id);
        headers
    }
}

/// One of each message a delegation stores, from the saturation run.
#[derive(Debug, Clone)]
pub(crate) struct Messages {
    /// A `submitted` record.
    pub(crate) submitted: Copied,
    /// A task request.
    pub(crate) task: Copied,
    /// A `done` event.
    pub(crate) done: Copied,
    /// A wake ledger `posting` entry (made from the `delivered` one's key,
    /// as the wake writes it).
    pub(crate) posting: Bytes,
    /// A wake ledger `delivered` entry.
    pub(crate) delivered: Bytes,
}

/// Bytes per message of each kind (payload and header lines), as the
/// saturation run stored them.
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
    /// Copies one message of each kind from the run under `prefix`, whose
    /// services have stopped: the stream's first completion (a warm-up
    /// delegation's) and its ledger entry, and the `submitted` record and
    /// task of one more delegation made for this, which no worker takes.
    pub(crate) async fn sample(bus: &Bus) -> Self {
        let s = &bus.subjects;
        let session = "bench.s0";
        let id = crate::submit(
            &Delegator::new(bus.clone()),
            session.to_owned(),
            &Default::default(),
        )
        .await;
        let of_this_delegation = |message: StreamMessage| {
            let header = message
                .headers
                .get(HEADER_DELEGATION_ID)
                .map(|v| v.as_str());
            assert_eq!(header, Some(id.as_str()), "a message of another delegation");
            Copied::of(message)
        };
        let events = bus.js.get_stream(s.events_stream()).await.expect("events");
        let submitted = events
            .get_last_raw_message_by_subject(&s.submitted(&session_token(session), &id, 0))
            .await
            .map(of_this_delegation)
            .expect("its submitted record");
        let tasks = bus.js.get_stream(s.tasks_stream()).await.expect("tasks");
        let task = tasks
            .get_last_raw_message_by_subject(&s.task("default"))
            .await
            .map(of_this_delegation)
            .expect("its task, which no worker took");
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
