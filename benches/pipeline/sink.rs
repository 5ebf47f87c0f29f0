//! The session endpoint wakes are posted to: a real HTTP server on
//! 127.0.0.1:0 that notes when each delegation's continuation arrived.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// What the endpoint has seen.
#[derive(Default)]
struct Seen {
    /// First arrival of each delegation's continuation.
    arrivals: HashMap<String, Instant>,
    /// Posts received (a combined turn is one post).
    posts: usize,
    /// Continuations of a delegation already seen under another key.
    duplicates: usize,
    /// The idempotency key each delegation first arrived with.
    keys: HashMap<String, String>,
}

/// The shared state behind the endpoint.
#[derive(Default)]
struct Inner {
    /// What arrived.
    seen: Mutex<Seen>,
    /// Woken on every arrival.
    changed: Notify,
}

/// A running endpoint.
#[derive(Clone)]
pub(crate) struct Sink {
    /// Where it listens.
    addr: SocketAddr,
    /// Its state.
    inner: Arc<Inner>,
}

impl Sink {
    /// Starts the endpoint on the current runtime.
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let inner = Arc::new(Inner::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(receive))
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, inner }
    }

    /// The base URL for `wakebus wake --api-url`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many distinct delegations have been woken.
    pub(crate) fn woken(&self) -> usize {
        self.inner.seen.lock().unwrap().arrivals.len()
    }

    /// Waits until `n` distinct delegations have been woken.
    pub(crate) async fn wait_for(&self, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.inner.changed.notified();
            if self.woken() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.woken() >= n;
            }
        }
    }

    /// Arrival times by delegation id, posts, and wakes of a delegation
    /// under a second idempotency key (which would be a real duplicate).
    pub(crate) fn snapshot(&self) -> (HashMap<String, Instant>, usize, usize) {
        let seen = self.inner.seen.lock().unwrap();
        (seen.arrivals.clone(), seen.posts, seen.duplicates)
    }
}

async fn receive(
    State(inner): State<Arc<Inner>>,
    headers: axum::http::HeaderMap,
    Json(body): Json<Value>,
) -> Json<Value> {
    let now = Instant::now();
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = body["messages"][0]["content"].as_str().unwrap_or_default();
    {
        let mut seen = inner.seen.lock().unwrap();
        seen.posts += 1;
        for id in text
            .split("[ASYNC DELEGATION COMPLETE — ")
            .skip(1)
            .filter_map(|rest| rest.split(']').next())
        {
            match seen.keys.get(id) {
                Some(first) if *first != key => seen.duplicates += 1,
                Some(_) => {}
                None => {
                    seen.keys.insert(id.to_owned(), key.clone());
                    seen.arrivals.insert(id.to_owned(), now);
                }
            }
        }
    }
    inner.changed.notify_waiters();
    Json(json!({
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }))
}
