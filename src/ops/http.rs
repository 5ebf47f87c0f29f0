//! The operations HTTP server: `/metrics` (Prometheus text format),
//! `/healthz` (the process is alive) and `/readyz` (started, connected to
//! NATS, and the streams and buckets the service works with and its
//! consumer exist).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::metrics::{
    CONSUMER_ACK_PENDING, CONSUMER_PENDING, CONSUMER_REDELIVERED, NATS_CONNECTED,
};
use crate::bus::Bus;

/// How long a readiness or lag check may take before it counts as failed.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the endpoints look at.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The service's connection.
    pub bus: Bus,
    /// Streams that must exist for the service to be ready.
    pub streams: Vec<String>,
    /// Consumers whose lag `/metrics` reports: `(stream, consumer)`.
    pub consumers: Vec<(String, String)>,
    /// A `done` subject to probe (a worker's check that the events stream
    /// takes its completions, which it may not read the info of).
    pub completions_probe: Option<String>,
    /// Set by the service once it takes work: not ready before.
    pub started: super::Started,
}

impl Probe {
    /// The probe of a worker of `pool`, ready once `started` is set.
    pub fn worker(bus: &Bus, pool: &str, started: super::Started) -> Self {
        let s = &bus.subjects;
        Self {
            bus: bus.clone(),
            // Not the events stream: a worker may not read its info (with a
            // subject filter it would list every delegation id). It is
            // probed instead, as at start. The cancel bucket: without it,
            // each task taken is held until its cancel records are known.
            streams: vec![
                s.tasks_stream(),
                s.dead_letter_stream(),
                crate::protocol::Subjects::bucket_stream(&s.cancel_bucket()),
            ],
            consumers: vec![(s.tasks_stream(), s.worker_consumer(pool))],
            completions_probe: Some(s.event("probe", "probe", 0, crate::protocol::EventKind::Done)),
            started,
        }
    }

    /// The probe of a wake instance, ready once `started` is set.
    pub fn wake(bus: &Bus, started: super::Started) -> Self {
        let s = &bus.subjects;
        Self {
            bus: bus.clone(),
            // The ledger and the locks too: no turn is planned without them.
            streams: vec![
                s.events_stream(),
                s.dead_letter_stream(),
                crate::protocol::Subjects::bucket_stream(&s.wake_ledger_bucket()),
                crate::protocol::Subjects::bucket_stream(&s.session_lock_bucket()),
            ],
            consumers: vec![(s.events_stream(), s.wake_consumer().to_owned())],
            completions_probe: None,
            started,
        }
    }

    /// `Ok` when connected and every stream and the service's consumer
    /// exist, else why not. (A service whose consumer cannot be created,
    /// say a pool its NATS user may not use, retries without end: it is
    /// not ready while it does.) The checks are made at once, each within
    /// [`CHECK_TIMEOUT`], so that an answer comes within it too (`wakebus
    /// ready` waits 5 s), and the first failure in their order is named.
    pub async fn ready(&self) -> Result<(), String> {
        let state = self.bus.client.connection_state();
        if state != async_nats::connection::State::Connected {
            return Err(format!("not connected to NATS ({state:?})"));
        }
        let streams = self.streams.iter().map(|stream| async move {
            match tokio::time::timeout(CHECK_TIMEOUT, self.bus.js.get_stream(stream)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(error)) => Err(format!("stream {stream}: {error}")),
                Err(_) => Err(format!(
                    "stream {stream}: no answer within {CHECK_TIMEOUT:?}"
                )),
            }
        });
        let completions = async {
            let Some(subject) = &self.completions_probe else {
                return Ok(());
            };
            let probe = crate::worker::probe::last_sequence_on(&self.bus, subject);
            match tokio::time::timeout(CHECK_TIMEOUT, probe).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(crate::worker::probe::ProbeError::NoStream)) => {
                    Err("no stream takes completions (the events stream is gone)".to_owned())
                }
                Ok(Err(error)) => Err(format!("completions: {error}")),
                Err(_) => Err(format!("completions: no answer within {CHECK_TIMEOUT:?}")),
            }
        };
        let consumers = self.consumers.iter().map(|(stream, consumer)| async move {
            let info = async {
                let handle = self
                    .bus
                    .js
                    .get_stream(stream)
                    .await
                    .map_err(|e| e.to_string())?;
                handle
                    .consumer_info(consumer)
                    .await
                    .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(CHECK_TIMEOUT, info).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(error)) => Err(format!("consumer {consumer}: {error}")),
                Err(_) => Err(format!(
                    "consumer {consumer}: no answer within {CHECK_TIMEOUT:?}"
                )),
            }
        });
        let (streams, completions, consumers) = tokio::join!(
            futures::future::join_all(streams),
            completions,
            futures::future::join_all(consumers)
        );
        streams.into_iter().collect::<Result<(), _>>()?;
        completions?;
        consumers.into_iter().collect::<Result<(), _>>()?;
        // Last, so that a missing stream or consumer is named when it is
        // what the setup waits for.
        if !self.started.is_set() {
            return Err(
                "starting: not taking work yet (its log says what it waits for)".to_owned(),
            );
        }
        Ok(())
    }

    /// Sets the connection gauge, and the consumer lag gauges from the
    /// server's consumer info (left as they were when it cannot be read).
    async fn refresh(&self) {
        let connected = crate::connect::is_connected(&self.bus.client);
        metrics::gauge!(NATS_CONNECTED).set(if connected { 1.0 } else { 0.0 });
        if !connected {
            // Each read would wait out its timeout in a scrape.
            return;
        }
        for (stream, consumer) in &self.consumers {
            let info = async {
                let handle = self.bus.js.get_stream(stream).await.ok()?;
                handle.consumer_info(consumer).await.ok()
            };
            let Ok(Some(info)) = tokio::time::timeout(CHECK_TIMEOUT, info).await else {
                continue;
            };
            let labels = [("stream", stream.clone()), ("consumer", consumer.clone())];
            metrics::gauge!(CONSUMER_PENDING, &labels).set(info.num_pending as f64);
            metrics::gauge!(CONSUMER_ACK_PENDING, &labels).set(info.num_ack_pending as f64);
            metrics::gauge!(CONSUMER_REDELIVERED, &labels).set(info.num_redelivered as f64);
        }
    }
}

/// Shared by the handlers.
#[derive(Debug)]
struct Ops {
    /// Renders the metrics.
    metrics: PrometheusHandle,
    /// Readiness and lag.
    probe: Probe,
}

/// Listens on `addr` and serves until `shutdown`; returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    probe: Probe,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let state = Arc::new(Ops { metrics, probe });
    // Histograms need periodic upkeep even when nobody scrapes.
    let upkeep = state.metrics.clone();
    let upkeep_stop = shutdown.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                () = upkeep_stop.cancelled() => return,
                _ = every.tick() => upkeep.run_upkeep(),
            }
        }
    });
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state);
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(error) = served {
            warn!(%error, "Operations HTTP server stopped.");
        }
    });
    info!(addr = %bound, "Serving /metrics, /healthz and /readyz.");
    Ok(bound)
}

async fn metrics_text(State(ops): State<Arc<Ops>>) -> Response {
    ops.probe.refresh().await;
    ops.metrics.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        ops.metrics.render(),
    )
        .into_response()
}

async fn readyz(State(ops): State<Arc<Ops>>) -> Response {
    match ops.probe.ready().await {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
    }
}
