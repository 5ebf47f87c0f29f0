//! A tiny session API that records and prints the continuation turns it
//! receives: a stand-in for Hermes in `wakebus dev`.

use std::collections::{HashSet, VecDeque};
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

/// How many of the last turns a sink keeps: `wakebus dev` runs for as
/// long as a developer likes, and each turn may be up to the max payload.
const KEPT_TURNS: usize = 100;

/// How many delegation ids named by turns a sink remembers before it
/// forgets them all and starts again.
const KEPT_IDS: usize = 100_000;

/// A running sink.
#[derive(Debug, Clone)]
pub struct SessionSink {
    /// Where it listens.
    addr: SocketAddr,
    /// The last [`KEPT_TURNS`] turns received.
    turns: Arc<Mutex<VecDeque<ReceivedTurn>>>,
    /// The delegations the turns received named (up to [`KEPT_IDS`]).
    named: Arc<Mutex<HashSet<String>>>,
    /// Turns received so far, for waiters to look again.
    received: watch::Receiver<usize>,
}

#[derive(Clone)]
struct AppState {
    turns: Arc<Mutex<VecDeque<ReceivedTurn>>>,
    named: Arc<Mutex<HashSet<String>>>,
    received: Arc<watch::Sender<usize>>,
    print: bool,
}

impl SessionSink {
    /// Listens on `addr` (port 0 for any); prints turns if `print`.
    pub async fn bind(addr: SocketAddr, print: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let turns = Arc::new(Mutex::new(VecDeque::new()));
        let named = Arc::new(Mutex::new(HashSet::new()));
        let (tx, rx) = watch::channel(0usize);
        let state = AppState {
            turns: turns.clone(),
            named: named.clone(),
            received: Arc::new(tx),
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
            named,
            received: rx,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The last turns received (at most 100).
    pub fn turns(&self) -> Vec<ReceivedTurn> {
        self.turns
            .lock()
            .expect("sink lock")
            .iter()
            .cloned()
            .collect()
    }

    /// Waits until turns have named each of `delegation_ids`, or `timeout`
    /// passes; returns how many were named. Counted by id, not by turn: a
    /// post sent again, or a turn left over from an earlier run on the same
    /// server, is not taken for one of them.
    pub async fn wait_for_delegations(
        &self,
        delegation_ids: &[String],
        timeout: Duration,
    ) -> usize {
        let named = || {
            let named = self.named.lock().expect("sink lock");
            delegation_ids
                .iter()
                .filter(|id| named.contains(*id))
                .count()
        };
        let mut rx = self.received.clone();
        let all = async {
            while named() < delegation_ids.len() {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, all).await;
        named()
    }
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
    {
        let mut named = state.named.lock().expect("sink lock");
        if named.len() >= KEPT_IDS {
            named.clear();
        }
        named.extend(named_delegations(&turn.text).map(str::to_owned));
    }
    {
        let mut turns = state.turns.lock().expect("sink lock");
        if turns.len() == KEPT_TURNS {
            turns.pop_front();
        }
        turns.push_back(turn);
    }
    state.received.send_modify(|count| *count += 1);
    Json(json!({
        "id": "chatcmpl-wakebus-dev",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }))
}

/// The delegations a turn reports: each completion's header names its own,
/// a batch's names the batch.
fn named_delegations(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter_map(|line| {
        let rest = line
            .strip_prefix("[ASYNC DELEGATION COMPLETE — ")
            .or_else(|| line.strip_prefix("[ASYNC DELEGATION BATCH COMPLETE — "))?;
        rest.strip_suffix(']')
    })
}
