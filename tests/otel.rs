//! OpenTelemetry export (`cargo test --features otel --test otel`): real
//! `wakebus` processes export to a real OTLP/HTTP receiver, which decodes
//! the protobuf and checks the spans form one trace per delegation.
#![cfg(feature = "otel")]

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use common::cli::tool_args;
use common::process::{Service, wake_args, worker_args};
use common::*;
use nix::sys::signal::Signal;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;
use wakebus::protocol::TraceParent;

const WAIT: Duration = Duration::from_secs(30);

/// One exported span, as the collector decoded it.
#[derive(Debug, Clone)]
struct Exported {
    /// `service.name` of the resource that sent it.
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
}

/// An OTLP/HTTP receiver on 127.0.0.1:0 that keeps every span it is sent.
#[derive(Clone)]
struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Exported>>>,
}

impl Collector {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(spans.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, spans }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Exported> {
        self.spans.lock().unwrap().clone()
    }

    fn named(&self, name: &str) -> Vec<Exported> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }
}

async fn receive(State(spans): State<Arc<Mutex<Vec<Exported>>>>, body: Bytes) -> impl IntoResponse {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new()).into_response();
    };
    let mut received = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
            .map(|value| match value {
                any_value::Value::StringValue(s) => s.clone(),
                other => format!("{other:?}"),
            })
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.push(Exported {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                });
            }
        }
    }
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn otel_env(collector: &Collector, service: &str) -> Vec<(String, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), collector.url()),
        ("OTEL_SERVICE_NAME".into(), service.into()),
    ]
}

#[tokio::test]
async fn a_delegation_exports_one_trace_under_the_callers_traceparent() {
    init_logs();
    let nats = NatsServer::start().await;
    let api = SessionApiServer::start().await;
    let collector = Collector::start().await;
    let prefix = unique_prefix();
    let _bus = bus(&nats.url(), &prefix).await;
    let logs = tempfile::tempdir().unwrap();
    // Worker and wake find the collector through the standard variable...
    let mut worker = Service::spawn_with_env(
        worker_args(&nats.url(), &prefix, "echo traced", &[]),
        logs.path().join("worker.log"),
        otel_env(&collector, "wakebus-worker"),
    );
    let mut wake = Service::spawn_with_env(
        wake_args(&nats.url(), &prefix, &api.url()),
        logs.path().join("wake.log"),
        otel_env(&collector, "wakebus-wake"),
    );

    // ...and delegate through the flag, joining its caller's trace.
    let caller = TraceParent::new_root();
    let mut delegate = tokio::process::Command::new(env!("CARGO_BIN_EXE_wakebus"));
    delegate
        .args(tool_args(
            &nats.url(),
            &prefix,
            &[
                "--otlp-endpoint",
                &collector.url(),
                "delegate",
                "--session",
                "session-otel",
                "--goal",
                "Trace this",
                "--traceparent",
                &caller.to_string(),
            ],
        ))
        .env_remove("NATS_URL")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("TRACEPARENT")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // Bounded here: this file runs under plain `cargo test`, which kills
    // no hung test.
    let output = tokio::time::timeout(Duration::from_secs(60), delegate.output())
        .await
        .expect("wakebus delegate did not finish within 60 s")
        .expect("run wakebus delegate");
    assert!(
        output.status.success(),
        "delegate failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );

    wait_until(WAIT, "the wake post", || async {
        !api.accepted().is_empty()
    })
    .await;
    // The services buffer spans; stopping them must flush what is left.
    assert!(
        worker
            .signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
            .await
            .success()
    );
    assert!(
        wake.signal_and_wait(Signal::SIGTERM, Duration::from_secs(30))
            .await
            .success()
    );
    wait_until(
        Duration::from_secs(5),
        "delegate, task and turn spans",
        || {
            let collector = collector.clone();
            async move {
                ["delegate", "task", "turn"]
                    .iter()
                    .all(|name| !collector.named(name).is_empty())
            }
        },
    )
    .await;

    let trace_id = format!("{:032x}", caller.trace_id);
    let one = |name: &str| {
        let spans = collector.named(name);
        assert_eq!(spans.len(), 1, "one {name} span: {spans:#?}");
        spans[0].clone()
    };
    let (delegate, task, turn) = (one("delegate"), one("task"), one("turn"));
    for span in [&delegate, &task, &turn] {
        assert_eq!(span.trace_id, trace_id, "{span:#?}");
    }
    assert_eq!(delegate.service, "wakebus");
    assert_eq!(task.service, "wakebus-worker");
    assert_eq!(turn.service, "wakebus-wake");
    // Each hop is the child of the traceparent it received.
    assert_eq!(delegate.parent_span_id, format!("{:016x}", caller.span_id));
    assert_eq!(task.parent_span_id, delegate.span_id);
    assert_eq!(turn.parent_span_id, task.span_id);
    // The session API is handed the wake post's own context.
    let post = &api.accepted()[0];
    assert_eq!(
        post.header("traceparent"),
        Some(format!("00-{trace_id}-{}-01", turn.span_id))
    );
    // Every exported span of these processes belongs to that one trace.
    let strays: Vec<_> = collector
        .spans()
        .into_iter()
        .filter(|s| s.trace_id != trace_id)
        .collect();
    assert!(strays.is_empty(), "spans outside the trace: {strays:#?}");
}
