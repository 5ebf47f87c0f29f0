//! `--metrics-addr` for long-running services.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;
use tokio_util::sync::{CancellationToken, DropGuard};
use wakebus::ops::http::{Probe, serve};

/// Operations endpoints of a service.
#[derive(Debug, Args)]
pub(crate) struct OpsArgs {
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address,
    /// e.g. 127.0.0.1:9464 (off unless given).
    #[arg(long, env = "WAKEBUS_METRICS_ADDR")]
    pub(crate) metrics_addr: Option<SocketAddr>,
}

/// Starts the endpoints if asked; they stop when the guard is dropped.
pub(crate) async fn start(args: &OpsArgs, probe: Probe) -> anyhow::Result<Option<DropGuard>> {
    let Some(addr) = args.metrics_addr else {
        return Ok(None);
    };
    let metrics = wakebus::ops::metrics::recorder().context("installing the metrics recorder")?;
    let stop = CancellationToken::new();
    serve(addr, metrics, probe, stop.clone())
        .await
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    Ok(Some(stop.drop_guard()))
}
