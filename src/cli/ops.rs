//! `--metrics-addr` for long-running services, and `wakebus ready`, which
//! asks one of them from the outside.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

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

/// `wakebus ready`.
#[derive(Debug, Args)]
pub(crate) struct ReadyArgs {
    /// The service's readiness URL [default: /readyz at its
    /// WAKEBUS_METRICS_ADDR, an unspecified address (0.0.0.0) asked on
    /// loopback].
    #[arg(long)]
    pub(crate) url: Option<String>,
    /// The address the service serves its endpoints on, as given to it.
    #[arg(long, env = "WAKEBUS_METRICS_ADDR")]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// How long to wait for its answer.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub(crate) timeout: Duration,
}

/// Asks the service; prints its answer, and exits 1 when it is not ready.
pub(crate) async fn ready(args: ReadyArgs) -> anyhow::Result<ExitCode> {
    let url = match (args.url, args.metrics_addr) {
        (Some(url), _) => url,
        (None, Some(addr)) => wakebus::ops::ready::readyz_url(addr),
        (None, None) => anyhow::bail!(
            "no service to ask: give --url, or --metrics-addr (WAKEBUS_METRICS_ADDR) as the service has it"
        ),
    };
    match wakebus::ops::ready::ask(&url, args.timeout).await {
        Ok(answer) => {
            println!("{answer}");
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("error: {error}");
            Ok(ExitCode::FAILURE)
        }
    }
}
