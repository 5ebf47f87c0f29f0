//! A tiny session API that records and prints the continuation turns it
//! receives: a stand-in for Hermes in `wakebus dev`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::watch;

/// One received turn.
#[derive(Debug, Clone)]
pub struct ReceivedTurn {
    /// The `X-Hermes-Session-Id` header.
    pub session: String,
    /// The `Idempotency-Key` header.
    pub idempotency_key: String,
    /// The user message text.
    pub text: String,
}

/// A running sink.
#[derive(Debug, Clone)]
pub struct SessionSink {
    /// Where it listens.
    addr: SocketAddr,
    /// Everything received.
    turns: Arc<Mutex<Vec<ReceivedTurn>>>,
    /// Completions received so far (a combined turn counts each).
    completions: watch::Receiver<usize>,
}

#[derive(Clone)]
struct AppState {
    turns: Arc<Mutex<Vec<ReceivedTurn>>>,
    completions: Arc<watch::Sender<usize>>,
    print: bool,
}

impl SessionSink {
    /// Listens on `addr` (port 0 for any); prints turns if `print`.
    pub async fn bind(addr: SocketAddr, print: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let turns = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = watch::channel(0usize);
        let state = AppState {
            turns: turns.clone(),
            completions: Arc::new(tx),
            print,
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(receive))
            .with_state(state);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            turns,
            completions: rx,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Turns received so far.
    pub fn turns(&self) -> Vec<ReceivedTurn> {
        self.turns.lock().expect("sink lock").clone()
    }

    /// Waits until `n` completions have been received or `timeout` passes;
    /// returns how many arrived.
    pub async fn wait_for_completions(&self, n: usize, timeout: Duration) -> usize {
        let mut rx = self.completions.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|count| *count >= n)).await;
        *rx.borrow()
    }
}

/// How many completions a turn reports.
fn completions_in(text: &str) -> usize {
    text.matches("[ASYNC DELEGATION COMPLETE — ").count().max(1)
}

async fn receive(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Json<Value> {
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    let text = body["messages"][0]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let turn = ReceivedTurn {
        session: header("x-hermes-session-id"),
        idempotency_key: header("idempotency-key"),
        text,
    };
    if state.print {
        println!(
            "\n── continuation turn for session {:?} ──\n{}",
            turn.session, turn.text
        );
    }
    let n = completions_in(&turn.text);
    state.turns.lock().expect("sink lock").push(turn);
    state.completions.send_modify(|count| *count += n);
    Json(json!({
        "id": "chatcmpl-wakebus-dev",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }))
}
