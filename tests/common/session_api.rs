//! A real HTTP session API on 127.0.0.1:0 that records every post, and can
//! be told to fail for a while.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

/// One received post.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub headers: HeaderMap,
    pub body: Value,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    pub fn session(&self) -> String {
        self.header("x-hermes-session-id").unwrap_or_default()
    }

    pub fn text(&self) -> String {
        self.body["messages"][0]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Delegation ids named in the turn text.
    pub fn delegation_ids(&self) -> Vec<String> {
        self.text()
            .split("[ASYNC DELEGATION COMPLETE — ")
            .skip(1)
            .filter_map(|rest| rest.split(']').next().map(str::to_owned))
            .collect()
    }
}

#[derive(Default)]
struct Inner {
    /// Accepted posts (2xx answered).
    accepted: Mutex<Vec<Recorded>>,
    /// Every post, including refused ones.
    all: Mutex<Vec<Recorded>>,
    /// Answer this status to the next `fail_remaining` posts.
    fail_status: AtomicU16,
    fail_remaining: AtomicUsize,
    /// Answer this status forever (0: off).
    always_status: AtomicU16,
}

#[derive(Clone)]
pub struct SessionApiServer {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl SessionApiServer {
    pub async fn start() -> Self {
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

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answer `status` to the next `count` posts.
    pub fn fail_next(&self, count: usize, status: u16) {
        self.inner.fail_status.store(status, Ordering::SeqCst);
        self.inner.fail_remaining.store(count, Ordering::SeqCst);
    }

    /// Answer `status` to every post until `recover`.
    pub fn fail_always(&self, status: u16) {
        self.inner.always_status.store(status, Ordering::SeqCst);
    }

    pub fn recover(&self) {
        self.inner.always_status.store(0, Ordering::SeqCst);
        self.inner.fail_remaining.store(0, Ordering::SeqCst);
    }

    /// Posts answered with 2xx.
    pub fn accepted(&self) -> Vec<Recorded> {
        self.inner.accepted.lock().unwrap().clone()
    }

    /// Every post received, refused ones included.
    pub fn all_posts(&self) -> Vec<Recorded> {
        self.inner.all.lock().unwrap().clone()
    }
}

async fn receive(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let recorded = Recorded { headers, body };
    inner.all.lock().unwrap().push(recorded.clone());
    let always = inner.always_status.load(Ordering::SeqCst);
    if always != 0 {
        return (
            StatusCode::from_u16(always).unwrap(),
            "session API unavailable",
        )
            .into_response();
    }
    if inner
        .fail_remaining
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        let status = inner.fail_status.load(Ordering::SeqCst);
        return (StatusCode::from_u16(status).unwrap(), "refused").into_response();
    }
    inner.accepted.lock().unwrap().push(recorded);
    Json(json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }))
    .into_response()
}
