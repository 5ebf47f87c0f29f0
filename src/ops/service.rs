//! Registration as a NATS micro service.
//!
//! Every worker registers as `wakebus-worker` and every wake instance as
//! `wakebus-wake`, so they answer the standard `$SRV.PING`, `$SRV.INFO` and
//! `$SRV.STATS` requests (`nats micro ls`, `nats micro info wakebus-worker`,
//! `nats micro stats wakebus-worker`). Each instance has one endpoint,
//! `status`, on `<prefix>.status.<service id>`, answering with a
//! [`ServiceSnapshot`]; the same snapshot is the endpoint's `data` in
//! `$SRV.STATS` replies, which is what `wakebus status` reads.

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::service::{Service, ServiceExt};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

/// The micro service name of workers.
pub const WORKER_SERVICE: &str = "wakebus-worker";
/// The micro service name of wake instances.
pub const WAKE_SERVICE: &str = "wakebus-wake";

/// What one live instance reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceSnapshot {
    /// `worker` or `wake`.
    pub kind: String,
    /// The deployment prefix it serves (several deployments may share a server).
    pub prefix: String,
    /// Its instance name (`worker-<host>-<pid>` by default).
    pub instance: String,
    /// The pool it serves (workers only).
    pub pool: Option<String>,
    /// Tasks it runs at once (workers only).
    pub concurrency: Option<usize>,
    /// Tasks in hand, running or held before they start (workers), or wake
    /// posts awaiting an answer (wake).
    pub in_flight: usize,
    /// The wakebus version it runs.
    pub version: String,
}

/// Who is registering.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The micro service name ([`WORKER_SERVICE`] or [`WAKE_SERVICE`]).
    pub service: &'static str,
    /// The fixed part of its snapshot (`in_flight` is filled in on each request).
    pub snapshot: ServiceSnapshot,
}

impl Registration {
    /// A worker of `pool`.
    pub fn worker(prefix: &str, instance: &str, pool: &str, concurrency: usize) -> Self {
        Self {
            service: WORKER_SERVICE,
            snapshot: snapshot("worker", prefix, instance, Some(pool), Some(concurrency)),
        }
    }

    /// A wake instance.
    pub fn wake(prefix: &str, instance: &str) -> Self {
        Self {
            service: WAKE_SERVICE,
            snapshot: snapshot("wake", prefix, instance, None, None),
        }
    }
}

fn snapshot(
    kind: &str,
    prefix: &str,
    instance: &str,
    pool: Option<&str>,
    concurrency: Option<usize>,
) -> ServiceSnapshot {
    ServiceSnapshot {
        kind: kind.to_owned(),
        prefix: prefix.to_owned(),
        instance: instance.to_owned(),
        pool: pool.map(str::to_owned),
        concurrency,
        in_flight: 0,
        version: crate::VERSION.to_owned(),
    }
}

/// A live registration; [`Registered::stop`] removes it.
#[derive(Debug)]
pub struct Registered {
    /// The micro service (answers PING/INFO/STATS).
    service: Service,
    /// Answers the `status` endpoint.
    endpoint: tokio::task::JoinHandle<()>,
}

impl Registered {
    /// Stops answering; the instance disappears from discovery at once.
    pub async fn stop(self) {
        self.endpoint.abort();
        if let Err(error) = self.service.stop().await {
            debug!(%error, "Could not stop the micro service cleanly.");
        }
    }
}

/// Registers an instance. `in_flight` is asked on every status request.
///
/// A registration failure only costs visibility, so it is logged and
/// `None` returned: the service runs on.
pub async fn register(
    client: &async_nats::Client,
    registration: Registration,
    in_flight: impl Fn() -> usize + Send + Sync + 'static,
) -> Option<Registered> {
    let in_flight = Arc::new(in_flight);
    let current = {
        let base = registration.snapshot.clone();
        let in_flight = in_flight.clone();
        move || ServiceSnapshot {
            in_flight: in_flight(),
            ..base.clone()
        }
    };
    let metadata = HashMap::from([
        ("prefix".to_owned(), registration.snapshot.prefix.clone()),
        (
            "instance".to_owned(),
            registration.snapshot.instance.clone(),
        ),
        ("kind".to_owned(), registration.snapshot.kind.clone()),
    ]);
    let stats_snapshot = current.clone();
    let started = client
        .service_builder()
        .description(format!(
            "wakebus {} of deployment {}",
            registration.snapshot.kind, registration.snapshot.prefix
        ))
        .metadata(metadata)
        .stats_handler(move |_endpoint, _stats| {
            serde_json::to_value(stats_snapshot()).unwrap_or_default()
        })
        .start(registration.service, crate::VERSION)
        .await;
    let service = match started {
        Ok(service) => service,
        Err(error) => {
            warn!(%error, "Could not register as a NATS micro service; `wakebus status` will not list this instance.");
            return None;
        }
    };
    let id = service.info().await.id;
    let subject = format!("{}.status.{id}", registration.snapshot.prefix);
    let mut endpoint = match service.endpoint_builder().name("status").add(subject).await {
        Ok(endpoint) => endpoint,
        Err(error) => {
            warn!(%error, "Could not add the micro service status endpoint.");
            let _ = service.stop().await;
            return None;
        }
    };
    let endpoint = tokio::spawn(async move {
        while let Some(request) = endpoint.next().await {
            let body = serde_json::to_vec(&current()).unwrap_or_default();
            if let Err(error) = request.respond(Ok(body.into())).await {
                debug!(%error, "Could not answer a status request.");
            }
        }
    });
    Some(Registered { service, endpoint })
}
