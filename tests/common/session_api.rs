//! A real HTTP session API on 127.0.0.1:0 that records every post, and can
//! be told to fail for a while.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{ConnectInfo, State};
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
    /// When the post arrived.
    pub at: std::time::Instant,
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
    /// Hold each post this many milliseconds before answering.
    delay_ms: AtomicU64,
    /// Hold each post, unanswered, until released.
    held: std::sync::atomic::AtomicBool,
    /// Posts in flight per session, and the most ever seen at once.
    in_flight: Mutex<HashMap<String, usize>>,
    max_in_flight_per_session: AtomicUsize,
    /// `Retry-After` seconds sent with refusals, plus one (0: none).
    retry_after: AtomicU64,
    /// Roughly how long the assistant's answer in a 2xx is, in bytes.
    answer_size: AtomicUsize,
    /// The client address of every post: one per TCP connection.
    peers: Mutex<HashSet<SocketAddr>>,
    /// Honour `Idempotency-Key` as such APIs do, each turn taking this many
    /// milliseconds, plus one (0: off).
    honour_keys_ms: AtomicU64,
    /// Keys seen in that mode: `false` while the turn runs, `true` once its
    /// answer is stored.
    keys: Mutex<HashMap<String, bool>>,
    /// 409 answers given in that mode.
    conflicts: AtomicUsize,
    /// Answer 413 to a turn whose text is longer than this (0: off), as a
    /// proxy's body limit does.
    max_turn_bytes: AtomicUsize,
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
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
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

    /// Hold every post for `delay` before answering.
    pub fn set_delay(&self, delay: Duration) {
        self.inner
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Hold every post unanswered until [`Self::release_posts`]: a post
    /// in flight for as long as the test needs, whatever the machine's
    /// speed.
    pub fn hold_posts(&self) {
        self.inner.held.store(true, Ordering::SeqCst);
    }

    /// Answers the held posts, and those to come.
    pub fn release_posts(&self) {
        self.inner.held.store(false, Ordering::SeqCst);
    }

    /// Send `Retry-After: seconds` with refusals.
    pub fn set_retry_after(&self, seconds: u64) {
        self.inner.retry_after.store(seconds + 1, Ordering::SeqCst);
    }

    /// Honour `Idempotency-Key` as such an API does: the first post under
    /// a key starts a turn that runs for `turn` whether or not its client
    /// waits for the answer; another post under the key is answered 409
    /// while the turn runs, then with its stored answer (not a new turn).
    pub fn honour_keys(&self, turn: Duration) {
        self.inner
            .honour_keys_ms
            .store(turn.as_millis() as u64 + 1, Ordering::SeqCst);
    }

    /// Answer 413 Payload Too Large to every turn whose text is longer
    /// than `bytes`.
    pub fn refuse_turns_over(&self, bytes: usize) {
        self.inner.max_turn_bytes.store(bytes, Ordering::SeqCst);
    }

    /// How many 409s were answered to posts under a key whose turn ran.
    pub fn conflicts(&self) -> usize {
        self.inner.conflicts.load(Ordering::SeqCst)
    }

    /// Posts received and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.lock().unwrap().values().sum()
    }

    /// The most posts ever in flight at once for one session.
    pub fn max_in_flight_per_session(&self) -> usize {
        self.inner.max_in_flight_per_session.load(Ordering::SeqCst)
    }

    /// Accepted posts as a session API honouring `Idempotency-Key` sees
    /// them: repeats of an accepted key are not new turns.
    pub fn turns(&self) -> Vec<Recorded> {
        let mut seen = HashSet::new();
        self.accepted()
            .into_iter()
            .filter(|p| seen.insert(p.header("idempotency-key").unwrap_or_default()))
            .collect()
    }

    /// Answer each accepted post with an assistant reply of about `bytes`.
    pub fn set_answer_size(&self, bytes: usize) {
        self.inner.answer_size.store(bytes, Ordering::SeqCst);
    }

    /// How many TCP connections posts came over.
    pub fn connections(&self) -> usize {
        self.inner.peers.lock().unwrap().len()
    }

    /// Posts answered with 2xx.
    pub fn accepted(&self) -> Vec<Recorded> {
        self.inner.accepted.lock().unwrap().clone()
    }

    /// How many delegations the accepted posts reported, a combined turn
    /// counting each of its own.
    pub fn woken_delegations(&self) -> usize {
        self.accepted()
            .iter()
            .map(|post| post.delegation_ids().len())
            .sum()
    }

    /// Delegations whose accepted posts carried more than one
    /// `Idempotency-Key`. A post repeated in doubt repeats its key, so a
    /// session API honouring the key shows one turn; a second key would be
    /// a second turn.
    pub fn delegations_under_two_keys(&self) -> Vec<String> {
        let mut keys: HashMap<String, HashSet<String>> = HashMap::new();
        for post in self.accepted() {
            let key = post.header("idempotency-key").unwrap_or_default();
            for id in post.delegation_ids() {
                keys.entry(id).or_default().insert(key.clone());
            }
        }
        keys.into_iter()
            .filter(|(_, keys)| keys.len() > 1)
            .map(|(id, _)| id)
            .collect()
    }

    /// Every post received, refused ones included.
    pub fn all_posts(&self) -> Vec<Recorded> {
        self.inner.all.lock().unwrap().clone()
    }
}

async fn receive(
    State(inner): State<Arc<Inner>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    inner.peers.lock().unwrap().insert(peer);
    let recorded = Recorded {
        headers,
        body,
        at: std::time::Instant::now(),
    };
    let session = recorded.session();
    // Read before the post counts as in flight: a test that changes it
    // once it sees the post does so for the next one.
    let delay = inner.delay_ms.load(Ordering::SeqCst);
    {
        let mut in_flight = inner.in_flight.lock().unwrap();
        let n = in_flight.entry(session.clone()).or_default();
        *n += 1;
        inner
            .max_in_flight_per_session
            .fetch_max(*n, Ordering::SeqCst);
    }
    // No longer in flight once answered, or once the client gave up.
    struct Landed<'a>(&'a Inner, String);
    impl Drop for Landed<'_> {
        fn drop(&mut self) {
            *self.0.in_flight.lock().unwrap().get_mut(&self.1).unwrap() -= 1;
        }
    }
    let _landed = Landed(&inner, session);
    let honour = inner.honour_keys_ms.load(Ordering::SeqCst);
    if honour > 0 {
        return honouring_keys(&inner, recorded, Duration::from_millis(honour - 1)).await;
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    while inner.held.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    answer(&inner, recorded)
}

/// A post to an API honouring `Idempotency-Key`.
async fn honouring_keys(inner: &Arc<Inner>, recorded: Recorded, turn: Duration) -> Response {
    inner.all.lock().unwrap().push(recorded.clone());
    let key = recorded.header("idempotency-key").unwrap_or_default();
    let seen = inner.keys.lock().unwrap().insert(key.clone(), false);
    match seen {
        Some(true) => {
            inner.keys.lock().unwrap().insert(key, true);
            return accepted_answer(inner);
        }
        Some(false) => {
            inner.conflicts.fetch_add(1, Ordering::SeqCst);
            return (
                StatusCode::CONFLICT,
                "a request with this Idempotency-Key is in progress",
            )
                .into_response();
        }
        None => {}
    }
    // The turn runs on when the client stops waiting, as an agent's does.
    let (done, answered) = tokio::sync::oneshot::channel();
    let running = inner.clone();
    tokio::spawn(async move {
        tokio::time::sleep(turn).await;
        running.accepted.lock().unwrap().push(recorded);
        running.keys.lock().unwrap().insert(key, true);
        let _ = done.send(());
    });
    let _ = answered.await;
    accepted_answer(inner)
}

fn answer(inner: &Inner, recorded: Recorded) -> Response {
    inner.all.lock().unwrap().push(recorded.clone());
    let retry_after = inner.retry_after.load(Ordering::SeqCst);
    let refuse = |status: u16| {
        let mut response = (
            StatusCode::from_u16(status).unwrap(),
            "session API unavailable",
        )
            .into_response();
        if retry_after > 0 {
            let seconds = retry_after - 1;
            response
                .headers_mut()
                .insert("retry-after", seconds.to_string().parse().unwrap());
        }
        response
    };
    let max_turn = inner.max_turn_bytes.load(Ordering::SeqCst);
    if max_turn > 0 && recorded.text().len() > max_turn {
        return (StatusCode::PAYLOAD_TOO_LARGE, "request entity too large").into_response();
    }
    let always = inner.always_status.load(Ordering::SeqCst);
    if always != 0 {
        return refuse(always);
    }
    if inner
        .fail_remaining
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return refuse(inner.fail_status.load(Ordering::SeqCst));
    }
    inner.accepted.lock().unwrap().push(recorded);
    accepted_answer(inner)
}

/// A 2xx with the assistant's reply.
fn accepted_answer(inner: &Inner) -> Response {
    Json(json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok".repeat(inner.answer_size.load(Ordering::SeqCst) / 2 + 1)}, "finish_reason": "stop"}],
    }))
    .into_response()
}
