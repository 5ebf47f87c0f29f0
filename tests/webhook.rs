//! Wakes delivered as signed webhooks (Standard Webhooks), verified by a real
//! receiver that checks the signatures itself, with its own HMAC code.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use common::pki::{Pki, pki};
use common::*;
use hmac::{Hmac, Mac};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::Sha256;
use wakebus::delegate::{DelegateResult, Delegation, Delegator};
use wakebus::wake::session_api::{HttpSecurity, PostShape};
use wakebus::wake::webhook::WebhookSecret;

const WAIT: Duration = Duration::from_secs(30);

/// A webhook endpoint as a third party would write it from the spec.
#[derive(Clone)]
struct Receiver {
    url: String,
    /// The keys (decoded `whsec_` secrets) it accepts.
    keys: Arc<Vec<Vec<u8>>>,
    /// Posts it verified.
    verified: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
    /// Posts whose signature did not verify.
    refused: Arc<Mutex<usize>>,
    /// How many more verified posts to answer 503 (unavailable), and the
    /// bodies so answered.
    unavailable: Arc<Mutex<(usize, Vec<Bytes>)>>,
}

impl Receiver {
    fn new(url: String, secrets: &[&str]) -> Self {
        let keys = secrets
            .iter()
            .map(|s| BASE64.decode(s.strip_prefix("whsec_").unwrap()).unwrap())
            .collect();
        Self {
            url,
            keys: Arc::new(keys),
            verified: Arc::default(),
            refused: Arc::default(),
            unavailable: Arc::default(),
        }
    }

    fn app(&self) -> axum::Router {
        axum::Router::new()
            .route("/hooks/wakebus", post(receive))
            .with_state(self.clone())
    }

    async fn start(secrets: &[&str]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hooks/wakebus", listener.local_addr().unwrap());
        let receiver = Self::new(url, secrets);
        let app = receiver.app();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        receiver
    }

    /// The same receiver over HTTPS, with a certificate from `pki`'s CA.
    /// Returns it and the count of failed TLS handshakes.
    async fn start_https(secrets: &[&str], pki: &Pki) -> (Self, Arc<AtomicUsize>) {
        let cert = CertificateDer::from_pem_file(&pki.server_cert).unwrap();
        let key = PrivateKeyDer::from_pem_file(&pki.server_key).unwrap();
        #[expect(deprecated, reason = "ring, as in src/tls.rs")]
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/hooks/wakebus", tcp.local_addr().unwrap());
        let receiver = Self::new(url, secrets);
        let failures = Arc::new(AtomicUsize::new(0));
        let listener = TlsListener {
            tcp,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            failures: failures.clone(),
        };
        let app = receiver.app();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (receiver, failures)
    }

    fn verified(&self) -> Vec<(HeaderMap, Bytes)> {
        self.verified.lock().unwrap().clone()
    }
}

/// A TLS listener for axum that counts failed handshakes.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    failures: Arc<AtomicUsize>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            match self.acceptor.accept(tcp).await {
                Ok(tls) => return (tls, addr),
                Err(_) => {
                    self.failures.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// Verifies per the spec: `v1,` signatures over `id.timestamp.body`, any of
/// them by any known key, and a timestamp within five minutes.
fn verify(keys: &[Vec<u8>], headers: &HeaderMap, body: &[u8]) -> Result<(), &'static str> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .ok_or("missing header")
    };
    let id = header("webhook-id")?;
    let timestamp = header("webhook-timestamp")?;
    let signatures = header("webhook-signature")?;
    let sent: i64 = timestamp.parse().map_err(|_| "bad timestamp")?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    if (now - sent).abs() > 300 {
        return Err("timestamp outside the tolerance");
    }
    for key in keys {
        for signature in signatures.split(' ') {
            let Some(encoded) = signature.strip_prefix("v1,") else {
                continue;
            };
            let Ok(expected) = BASE64.decode(encoded) else {
                continue;
            };
            let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
            mac.update(format!("{id}.{timestamp}.").as_bytes());
            mac.update(body);
            if mac.verify_slice(&expected).is_ok() {
                return Ok(());
            }
        }
    }
    Err("no valid signature")
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    match verify(&receiver.keys, &headers, &body) {
        Ok(()) => {
            let mut unavailable = receiver.unavailable.lock().unwrap();
            if unavailable.0 > 0 {
                unavailable.0 -= 1;
                unavailable.1.push(body);
                return StatusCode::SERVICE_UNAVAILABLE;
            }
            receiver.verified.lock().unwrap().push((headers, body));
            StatusCode::NO_CONTENT
        }
        Err(_) => {
            *receiver.refused.lock().unwrap() += 1;
            StatusCode::UNAUTHORIZED
        }
    }
}

const OLD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NEW: &str = "whsec_c2VjcmV0LWtleS1mb3ItdGhlLW5ldy1yb3RhdGlvbg==";

fn webhook_wake_config(url: &str, secrets: &[&str]) -> wakebus::wake::WakeConfig {
    let mut config = test_wake_config(url);
    config.shape = PostShape::Webhook {
        secrets: secrets
            .iter()
            .map(|s| s.parse::<WebhookSecret>().unwrap())
            .collect(),
    };
    config
}

#[tokio::test]
async fn a_wake_posted_as_a_webhook_carries_signatures_a_receiver_verifies() {
    init_logs();
    let nats = NatsServer::start().await;
    let receiver = Receiver::start(&[NEW]).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    // Mid-rotation: the wake signs with both secrets; this receiver already
    // knows only the new one.
    services.wake(&bus, webhook_wake_config(&receiver.url, &[OLD, NEW]));

    let result = Delegator::new(bus.clone())
        .delegate(Delegation::new("Summarise the logs").session("sess.hook *>"))
        .await
        .unwrap();
    let DelegateResult::Dispatched { delegation_id, .. } = result else {
        panic!("expected a dispatched delegation");
    };
    wait_until(WAIT, "a verified webhook", || async {
        !receiver.verified().is_empty()
    })
    .await;
    services.stop().await;

    let (headers, raw) = &receiver.verified()[0];
    // A receiver still on the old secret accepts the same post too.
    let old_key = BASE64.decode(OLD.strip_prefix("whsec_").unwrap()).unwrap();
    assert_eq!(verify(&[old_key], headers, raw), Ok(()));
    assert_eq!(
        verify(&[b"another key".to_vec()], headers, raw),
        Err("no valid signature")
    );
    let body: serde_json::Value = serde_json::from_slice(raw).unwrap();
    let id = format!("{delegation_id}.0.done");
    assert_eq!(headers["webhook-id"], id.as_str());
    assert_eq!(headers["idempotency-key"], id.as_str());
    assert_eq!(headers["content-type"], "application/json");
    let signatures: Vec<&str> = headers["webhook-signature"]
        .to_str()
        .unwrap()
        .split(' ')
        .collect();
    assert_eq!(signatures.len(), 2, "one signature per secret");
    assert_eq!(body["type"], "wakebus.wake");
    let data = &body["data"];
    assert_eq!(data["session_id"], "sess.hook *>");
    assert_eq!(data["idempotency_key"], id.as_str());
    assert_eq!(
        data["completions"],
        serde_json::json!([format!("{delegation_id}.0")])
    );
    assert_eq!(data["events"][0]["delegation_id"], delegation_id.as_str());
    assert_eq!(data["events"][0]["summary"], "echo: Summarise the logs");
    let text = data["text"].as_str().unwrap();
    assert!(
        text.starts_with(&format!("[ASYNC DELEGATION COMPLETE — {delegation_id}]")),
        "{text}"
    );
    assert_eq!(*receiver.refused.lock().unwrap(), 0);
}

/// A post tried again is the same body: its `timestamp` is when the
/// completion ended, not when the post was sent (the signed
/// `webhook-timestamp` header is that), so a receiver that compares the
/// bodies it gets under one key finds the same one. One that differed
/// would be refused by a receiver following the IETF Idempotency-Key
/// draft (422), and the wake dead-lettered.
#[tokio::test]
async fn a_webhook_post_tried_again_is_the_same_body() {
    init_logs();
    let nats = NatsServer::start().await;
    let receiver = Receiver::start(&[NEW]).await;
    receiver.unavailable.lock().unwrap().0 = 2;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, webhook_wake_config(&receiver.url, &[NEW]));
    Delegator::new(bus.clone())
        .delegate(Delegation::new("again").session("sess.again"))
        .await
        .unwrap();
    wait_until(WAIT, "the post accepted", || async {
        !receiver.verified().is_empty()
    })
    .await;
    services.stop().await;
    let refused = receiver.unavailable.lock().unwrap().1.clone();
    assert_eq!(refused.len(), 2);
    let accepted = &receiver.verified()[0].1;
    for earlier in &refused {
        assert_eq!(earlier, accepted, "a retry sent another body");
    }
    let body: serde_json::Value = serde_json::from_slice(accepted).unwrap();
    assert_eq!(
        body["timestamp"], body["data"]["events"][0]["completed_at"],
        "{body}"
    );
}

/// A batch's consolidated turn and an early failure notice have ledger
/// keys of their own (`<id>.batch`, `<id>.<task>.early`), which the
/// webhook's `completions` listed in place of the completions the turn
/// reports: a receiver could not tell which tasks a batch turn reported.
#[tokio::test]
async fn a_webhook_lists_every_task_a_batch_turn_or_an_early_notice_reports() {
    init_logs();
    let nats = NatsServer::start().await;
    let receiver = Receiver::start(&[NEW]).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("early-notice-seen");
    let mut services = Services::new();
    // Task 1 fails at once; task 0 ends once its early notice is in.
    services.worker(
        &bus,
        shell(&format!(
            "if [ \"$WAKEBUS_TASK_INDEX\" = 1 ]; then exit 3; fi; while [ ! -e {m} ]; do sleep 0.05; done; echo ok",
            m = mark.display()
        )),
        test_worker_config("default"),
    );
    services.wake(&bus, webhook_wake_config(&receiver.url, &[NEW]));
    let mut delegation = Delegation::batch(["slow", "fails"].map(String::from)).session("s.hooks");
    delegation.notify_early_failure = true;
    let result = Delegator::new(bus.clone())
        .delegate(delegation)
        .await
        .unwrap();
    let id = result.delegation_id().to_owned();
    wait_until(WAIT, "the early notice", || async {
        receiver.verified().len() == 1
    })
    .await;
    std::fs::write(&mark, "").unwrap();
    wait_until(WAIT, "the batch's turn", || async {
        receiver.verified().len() == 2
    })
    .await;
    services.stop().await;
    let completions: Vec<serde_json::Value> = receiver
        .verified()
        .iter()
        .map(|(_, raw)| {
            serde_json::from_slice::<serde_json::Value>(raw).unwrap()["data"]["completions"].clone()
        })
        .collect();
    assert_eq!(
        completions,
        [
            serde_json::json!([format!("{id}.1")]),
            serde_json::json!([format!("{id}.0"), format!("{id}.1")]),
        ]
    );
}

#[tokio::test]
async fn https_certificates_are_verified_and_a_private_ca_can_be_trusted() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let nats = NatsServer::start().await;
    let (receiver, failed_handshakes) = Receiver::start_https(&[NEW], &pki).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;

    // Without the private CA, the wake refuses the receiver's certificate and
    // keeps the wake for later.
    let mut services = Services::new();
    services.echo_worker(&bus);
    services.wake(&bus, webhook_wake_config(&receiver.url, &[NEW]));
    Delegator::new(bus.clone())
        .delegate(Delegation::new("over https").session("sess.tls"))
        .await
        .unwrap();
    wait_until(WAIT, "refused TLS handshakes", || async {
        failed_handshakes.load(Ordering::SeqCst) >= 2
    })
    .await;
    services.stop().await;
    assert!(receiver.verified().is_empty());

    // Trusting the CA, the held wake is delivered.
    let mut services = Services::new();
    let mut config = webhook_wake_config(&receiver.url, &[NEW]);
    config.http = HttpSecurity {
        extra_ca: Some(pki.ca.clone()),
        ..HttpSecurity::default()
    };
    services.wake(&bus, config);
    wait_until(WAIT, "the wake over verified https", || async {
        !receiver.verified().is_empty()
    })
    .await;
    services.stop().await;
    let (_, raw) = &receiver.verified()[0];
    let body: serde_json::Value = serde_json::from_slice(raw).unwrap();
    assert_eq!(body["data"]["session_id"], "sess.tls");
}

#[tokio::test]
async fn a_receiver_that_refuses_the_signature_gets_the_wake_dead_lettered_once() {
    init_logs();
    let nats = NatsServer::start().await;
    let receiver = Receiver::start(&[NEW]).await;
    let bus = bus(&nats.url(), &unique_prefix()).await;
    let mut services = Services::new();
    services.echo_worker(&bus);
    // Signs with the old secret only: the receiver refuses with 401.
    services.wake(&bus, webhook_wake_config(&receiver.url, &[OLD]));

    Delegator::new(bus.clone())
        .delegate(Delegation::new("g").session("sess.hook"))
        .await
        .unwrap();
    let dlq = bus.subjects.dead_letter_stream();
    wait_until(WAIT, "the wake dead letter", || async {
        !all_messages(&bus, &dlq).await.is_empty()
    })
    .await;
    services.stop().await;
    assert!(receiver.verified().is_empty());
    assert_eq!(*receiver.refused.lock().unwrap(), 1, "a 401 is not retried");
    let dead = all_messages(&bus, &dlq).await;
    let reason = dead[0].headers.get("Wakebus-Dead-Letter-Reason").unwrap();
    assert!(reason.as_str().contains("401"), "{reason}");
}

#[tokio::test]
async fn the_wake_command_refuses_plain_http_to_another_host_and_bad_secrets_without_showing_them()
{
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    std::fs::write(&good, format!("{OLD}\n{NEW}\n")).unwrap();
    let bad = dir.path().join("bad");
    let leaked = "whsec_this is not base64 and must not be printed";
    std::fs::write(&bad, leaked).unwrap();
    let blank = dir.path().join("blank");
    std::fs::write(&blank, "\n  \n").unwrap();
    let prefix = unique_prefix();
    let wake = async |url: &str, secrets: &std::path::Path, extra: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"));
        command
            .env_clear()
            // Nothing listens there: the command must fail before using NATS.
            .args(["--nats-url", "nats://127.0.0.1:1", "--prefix", &prefix])
            .args(["wake", "--webhook-url", url])
            .arg("--webhook-secret-file")
            .arg(secrets)
            .args(extra)
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(30), command.output())
            .await
            .expect("the wake command stops within the wait")
            .unwrap()
    };

    let output = wake("http://10.255.255.1:9000/hook", &good, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("plain http://"), "{stderr}");
    assert!(
        stderr.contains("--allow-insecure-http-host 10.255.255.1"),
        "{stderr}"
    );

    let output = wake("https://hooks.example.com/x", &bad, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("line 1"), "{stderr}");
    assert!(stderr.contains("not base64"), "{stderr}");
    assert!(!stderr.contains("must not be printed"), "{stderr}");

    // A file with no secret in it would sign nothing a receiver accepts.
    let output = wake("https://hooks.example.com/x", &blank, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("--webhook-url needs at least one secret"),
        "{stderr}"
    );

    // A CA file that cannot be read, or holds no certificate, is named.
    let not_pem = dir.path().join("not-pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    for ca in ["/nonexistent/ca.pem", not_pem.to_str().unwrap()] {
        let output = wake("https://hooks.example.com/x", &good, &["--api-ca", ca]).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{ca}");
        assert!(stderr.contains(ca), "{ca}: {stderr}");
    }
}

/// A server on 127.0.0.1 that answers every request with `answer` and
/// counts them; returns its address.
async fn counting_server(
    answer: impl Fn() -> axum::response::Response + Clone + Send + Sync + 'static,
    hits: Arc<AtomicUsize>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move || {
        let answer = answer.clone();
        let hits = hits.clone();
        async move {
            hits.fetch_add(1, Ordering::SeqCst);
            answer()
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn only_redirects_that_keep_the_turn_and_meet_the_http_rule_are_followed() {
    use axum::response::IntoResponse;
    use wakebus::wake::session_api::{Post, PostResult, SessionApi, SessionApiConfig};

    let landed = Arc::new(AtomicUsize::new(0));
    let target = counting_server(|| StatusCode::OK.into_response(), landed.clone()).await;
    let api = |status: StatusCode, redirect_to: String| async move {
        let answer = move || (status, [("location", redirect_to.clone())]).into_response();
        let redirector = counting_server(answer, Arc::default()).await;
        SessionApi::new(
            &SessionApiConfig {
                base_url: format!("http://{redirector}"),
                api_key: Some("sk-test".into()),
                model: "hermes".into(),
                request_timeout: Duration::from_secs(5),
            },
            &PostShape::Hermes,
            &HttpSecurity::default(),
        )
        .unwrap()
    };
    let post = Post {
        session: "s1",
        text: "the turn",
        idempotency_key: "k1",
        traceparent: None,
        reports: &[],
        events: &[],
    };

    // 0.0.0.0 reaches this machine's listeners, but it is not loopback:
    // plain http to it is refused, so the turn must not be sent there.
    let elsewhere = api(
        StatusCode::TEMPORARY_REDIRECT,
        format!("http://0.0.0.0:{}/", target.port()),
    )
    .await;
    match elsewhere.post(post).await {
        PostResult::Retry { reason, .. } => {
            assert!(reason.contains("plain http://"), "{reason}");
        }
        other => panic!("a refused redirect ended as {other:?}"),
    }
    assert_eq!(landed.load(Ordering::SeqCst), 0, "the turn was re-sent");

    // 301, 302 and 303 would be followed with a GET without the turn: a
    // 2xx to it must not count as delivered.
    for status in [
        StatusCode::MOVED_PERMANENTLY,
        StatusCode::FOUND,
        StatusCode::SEE_OTHER,
    ] {
        let dropping = api(status, format!("http://{target}/")).await;
        match dropping.post(post).await {
            PostResult::Rejected { status: got, .. } => assert_eq!(got, status.as_u16()),
            other => panic!("a {status} ended as {other:?}"),
        }
    }
    assert_eq!(
        landed.load(Ordering::SeqCst),
        0,
        "followed without the turn"
    );

    let here = api(StatusCode::PERMANENT_REDIRECT, format!("http://{target}/")).await;
    assert!(matches!(here.post(post).await, PostResult::Delivered));
    assert_eq!(landed.load(Ordering::SeqCst), 1);
}

/// A server that answers its first `hops` requests with a 307 to a new
/// path of its own, then 200.
async fn redirect_chain(hops: usize) -> std::net::SocketAddr {
    use axum::response::IntoResponse;
    let seen = Arc::new(AtomicUsize::new(0));
    let answer = move || {
        let hop = seen.fetch_add(1, Ordering::SeqCst) + 1;
        if hop <= hops {
            let next = format!("/hop/{hop}");
            (StatusCode::TEMPORARY_REDIRECT, [("location", next)]).into_response()
        } else {
            StatusCode::OK.into_response()
        }
    };
    counting_server(answer, Arc::default()).await
}

/// PROTOCOL 8.5: 307 and 308 are followed at most 10 times.
#[tokio::test]
async fn a_post_follows_ten_redirects_and_not_an_eleventh() {
    use wakebus::wake::session_api::{Post, PostResult, SessionApi, SessionApiConfig};
    let post = Post {
        session: "s1",
        text: "the turn",
        idempotency_key: "k1",
        traceparent: None,
        reports: &[],
        events: &[],
    };
    for (hops, delivered) in [(10, true), (11, false)] {
        let api = SessionApi::new(
            &SessionApiConfig {
                base_url: format!("http://{}", redirect_chain(hops).await),
                api_key: Some("sk-test".into()),
                model: "hermes".into(),
                request_timeout: Duration::from_secs(5),
            },
            &PostShape::Hermes,
            &HttpSecurity::default(),
        )
        .unwrap();
        let result = api.post(post).await;
        assert_eq!(
            matches!(result, PostResult::Delivered),
            delivered,
            "{hops} redirects: {result:?}"
        );
    }
}
