//! `wakebus dev`: the whole loop on one machine, for a first look.
//!
//! Uses the NATS server at the given URL if one answers, otherwise starts a
//! local `nats-server` with the repository's `nats.conf`; then runs a worker
//! (echo executor), the wake service and a small built-in session endpoint
//! that prints every continuation turn it receives.
//!
//! A server it starts runs in a process group of its own, so the Ctrl-C a
//! terminal sends to its foreground job reaches only `wakebus dev`, which
//! stops its services first and the server last. If the server or a
//! service ends by itself, dev mode stops with an error instead of going
//! on half alive.

mod session_sink;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use session_sink::{ReceivedTurn, SessionSink};

use crate::bus::{Bus, BusSettings};
use crate::connect::{ConnectError, NatsConfig};
use crate::delegate::{DelegateError, DelegateResult, Delegation, Delegator};
use crate::protocol::{PrefixError, Subjects};
use crate::wake::session_api::SessionApiConfig;
use crate::wake::{self, WakeConfig};
use crate::worker::executor::{EchoExecutor, Executor, TaskEnv};
use crate::worker::{self, WorkerConfig};

/// Settings of `wakebus dev`.
#[derive(Debug, Clone)]
pub struct DevConfig {
    /// NATS to use if it answers.
    pub nats_url: String,
    /// Subject prefix.
    pub prefix: String,
    /// The `nats-server` binary to start when none answers.
    pub nats_server: PathBuf,
    /// Config file for a started server.
    pub nats_conf: PathBuf,
    /// Store directory for a started server.
    pub data_dir: PathBuf,
    /// Where the built-in session endpoint listens.
    pub session_addr: SocketAddr,
    /// Submit a few delegations, wait for their wakes, then exit.
    pub demo: bool,
}

/// Why dev mode failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DevError {
    /// The prefix is invalid.
    #[error(transparent)]
    Prefix(#[from] PrefixError),
    /// NATS could not be reached or started.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// `nats-server` could not be started.
    #[error("no NATS server answers at {url} and `{bin}` could not be started: {source}")]
    StartServer {
        /// The URL tried.
        url: String,
        /// The binary.
        bin: String,
        /// The spawn error.
        source: std::io::Error,
    },
    /// The session endpoint could not listen.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Workers or wake services of a deployment under dev's prefix run on
    /// the server dev found.
    #[error(
        "{live} wakebus worker or wake instance(s) of prefix {prefix:?} answer on {url}: dev mode would take that deployment's tasks and answer its sessions' wakes itself; give dev a prefix of its own (--prefix wakebus-dev) or another --nats-url"
    )]
    DeploymentRunning {
        /// The server.
        url: String,
        /// The prefix.
        prefix: String,
        /// How many instances answered.
        live: usize,
    },
    /// Whether a deployment runs under dev's prefix could not be told.
    #[error("cannot tell whether a deployment runs under dev's prefix: {0}")]
    Discovery(String),
    /// Streams, buckets or consumers could not be set up.
    #[error(transparent)]
    Provision(#[from] crate::bus::ProvisionError),
    /// A demo delegation failed.
    #[error("demo delegation failed: {0}")]
    Delegate(#[from] DelegateError),
    /// A service failed, or ended by itself.
    #[error("a service failed: {0}")]
    Service(String),
    /// The `nats-server` dev mode started exited while it ran.
    #[error("the nats-server that dev mode started exited ({0}); see its output above")]
    ServerExited(String),
    /// The demo was stopped (Ctrl-C) before its wakes arrived.
    #[error("the demo was stopped before its wakes arrived")]
    DemoInterrupted,
    /// The demo's wakes did not all arrive in time.
    #[error("only {received} of {expected} demo wakes arrived within {timeout:?}")]
    DemoIncomplete {
        /// Wakes received.
        received: usize,
        /// Wakes expected.
        expected: usize,
        /// How long we waited.
        timeout: Duration,
    },
}

/// How long dev waits for the services of a deployment already running
/// under its prefix to answer, on a server it did not start.
const DISCOVERY_WINDOW: Duration = Duration::from_secs(1);

/// How long the services get to stop before the server is stopped anyway.
const SERVICES_STOP_GRACE: Duration = Duration::from_secs(20);

/// How long a started server gets to exit after SIGTERM before it is killed.
const SERVER_STOP_GRACE: Duration = Duration::from_secs(10);

/// Runs dev mode until `shutdown` (or, with `demo`, until the demo is done),
/// or until the server it started or one of its services ends by itself.
pub async fn run(
    config: DevConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DevError> {
    // Awaited from the start, so that its signal handlers are in place
    // while the server starts: a Ctrl-C then, which no longer reaches the
    // server, would otherwise end this process and leave the server running.
    tokio::pin!(shutdown);
    let subjects = Subjects::new(&config.prefix)?;
    let settings = BusSettings::default();
    let setup = async {
        let (client, server) = connect_or_start(&config).await?;
        let bus = Bus::new(client, subjects);
        if server.is_none() {
            // A server dev did not start may carry a deployment under the
            // same prefix: dev's echo worker would take its tasks, and its
            // wake would answer its sessions' wakes into dev's endpoint,
            // recorded as delivered.
            let live = crate::status::live_instances(&bus, DISCOVERY_WINDOW)
                .await
                .map_err(|error| DevError::Discovery(error.to_string()))?;
            if live > 0 {
                return Err(DevError::DeploymentRunning {
                    url: config.nats_url.clone(),
                    prefix: config.prefix.clone(),
                    live,
                });
            }
        }
        let sink = SessionSink::bind(config.session_addr, true)
            .await
            .map_err(|source| DevError::Listen {
                addr: config.session_addr,
                source,
            })?;
        // Everything exists before anything uses it: the worker provisions
        // only what a worker needs, and the demo's first delegation must
        // not race the wake service creating the events stream.
        bus.provision(&settings).await?;
        Ok::<_, DevError>((bus, server, sink))
    };
    let (bus, mut server, sink) = tokio::select! {
        setup = setup => setup?,
        // A server started is killed with the setup (`kill_on_drop`).
        () = &mut shutdown => {
            return if config.demo {
                Err(DevError::DemoInterrupted)
            } else {
                Ok(())
            };
        }
    };
    // Bound to every address (`0.0.0.0`, to be reached from elsewhere),
    // it is posted to on loopback: plain http goes to loopback only.
    let mut own = sink.local_addr();
    if own.ip().is_unspecified() {
        own.set_ip(match own {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let api_url = format!("http://{own}");
    info!(url = %api_url, "Built-in session endpoint listening; continuation turns are printed below.");
    let stop = CancellationToken::new();
    let mut services = JoinSet::new();
    let worker = worker::run(
        bus.clone(),
        settings.clone(),
        Executor::Echo(EchoExecutor),
        TaskEnv {
            nats_url: config.nats_url.clone(),
            prefix: config.prefix.clone(),
            pool: "default".to_owned(),
        },
        WorkerConfig::new("default"),
        stop.clone().cancelled_owned(),
    );
    services.spawn(async move { ("worker", worker.await.map_err(|e| e.to_string())) });
    let wake = wake::run(
        bus.clone(),
        settings,
        WakeConfig::new(SessionApiConfig {
            base_url: api_url,
            api_key: None,
            model: "hermes-agent".to_owned(),
            request_timeout: Duration::from_secs(10),
        }),
        stop.clone().cancelled_owned(),
    );
    services.spawn(async move { ("wake service", wake.await.map_err(|e| e.to_string())) });

    let until_stopped = async {
        if config.demo {
            tokio::select! {
                outcome = demo(&bus, &sink) => outcome,
                () = &mut shutdown => Err(DevError::DemoInterrupted),
            }
        } else {
            (&mut shutdown).await;
            Ok(())
        }
    };
    let mut outcome = tokio::select! {
        outcome = until_stopped => outcome,
        Some(joined) = services.join_next() => Err(DevError::Service(match joined {
            Ok((name, Ok(()))) => format!("the {name} stopped by itself"),
            Ok((name, Err(error))) => format!("the {name} failed: {error}"),
            Err(error) => error.to_string(),
        })),
        status = exited(server.as_mut()) => Err(DevError::ServerExited(status)),
    };
    stop.cancel();
    let stopped = tokio::time::timeout(SERVICES_STOP_GRACE, async {
        while let Some(joined) = services.join_next().await {
            let failure = match joined {
                Ok((_, Ok(()))) => continue,
                Ok((name, Err(error))) => format!("the {name} failed: {error}"),
                Err(error) => error.to_string(),
            };
            if outcome.is_ok() {
                outcome = Err(DevError::Service(failure));
            }
        }
    })
    .await;
    if stopped.is_err() {
        warn!(grace = ?SERVICES_STOP_GRACE, "The services did not stop in time; stopping them now.");
        services.shutdown().await;
    }
    // Closed before the server is stopped, which it would otherwise
    // report as a lost connection.
    let _ = crate::connect::close(&bus.client).await;
    if let Some(child) = server.as_mut() {
        stop_server(child).await;
    }
    outcome
}

/// Completes when the started server exits, with its exit status; never
/// when there is none.
async fn exited(server: Option<&mut Child>) -> String {
    match server {
        Some(child) => match child.wait().await {
            Ok(status) => status.to_string(),
            Err(error) => error.to_string(),
        },
        None => std::future::pending().await,
    }
}

/// Stops a started server as its own Ctrl-C would (SIGTERM: it closes its
/// store cleanly), and kills it if it has not exited in time.
async fn stop_server(child: &mut Child) {
    let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
        return; // Already exited and reaped.
    };
    if kill(Pid::from_raw(pid), Signal::SIGTERM).is_ok()
        && tokio::time::timeout(SERVER_STOP_GRACE, child.wait())
            .await
            .is_ok()
    {
        return;
    }
    warn!(grace = ?SERVER_STOP_GRACE, "nats-server did not stop on SIGTERM in time; killing it.");
    let _ = child.kill().await;
}

async fn connect_or_start(
    config: &DevConfig,
) -> Result<(async_nats::Client, Option<Child>), DevError> {
    // Read as every other command reads it: set to nothing (or to only
    // commas) is an error, never the default server on port 4222.
    NatsConfig::new(config.nats_url.as_str()).servers()?;
    let probe = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(1))
        .connect(config.nats_url.as_str())
        .await;
    if let Ok(client) = probe {
        info!(url = %config.nats_url, "Using the NATS server that answers.");
        return Ok((client, None));
    }
    let port = config
        .nats_url
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse::<u16>().ok())
        .unwrap_or(4222);
    info!(bin = %config.nats_server.display(), port, data_dir = %config.data_dir.display(), "No NATS server answers; starting one.");
    let _ = std::fs::create_dir_all(&config.data_dir);
    let mut command = Command::new(&config.nats_server);
    if config.nats_conf.exists() {
        command.arg("-c").arg(&config.nats_conf);
    } else {
        warn!(conf = %config.nats_conf.display(), "nats.conf not found; starting with defaults.");
    }
    let mut child = command
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(&config.data_dir)
        // Out of the terminal's foreground job: a Ctrl-C would stop the
        // server under the services still using it.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| DevError::StartServer {
            url: config.nats_url.clone(),
            bin: config.nats_server.display().to_string(),
            source,
        })?;
    let url = format!("nats://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(DevError::StartServer {
                url,
                bin: config.nats_server.display().to_string(),
                source: std::io::Error::other(format!(
                    "nats-server exited at start ({status}); see its output above"
                )),
            });
        }
        let attempt = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_millis(500))
            .connect(url.as_str())
            .await;
        if attempt.is_ok() {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(DevError::StartServer {
                url,
                bin: config.nats_server.display().to_string(),
                source: std::io::Error::other("nats-server did not accept connections within 15s"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = NatsConfig::new(url).connect().await?;
    Ok((client, Some(child)))
}

async fn demo(bus: &Bus, sink: &SessionSink) -> Result<(), DevError> {
    let delegator = Delegator::new(bus.clone()).with_wait_timeout(Some(Duration::from_secs(30)));
    let background = [
        ("demo-session-alice", "Summarise the design doc"),
        ("demo-session-alice", "List open questions"),
        ("demo-session.bob *>", "Check the release notes"),
    ];
    let mut ids = Vec::with_capacity(background.len());
    for (session, goal) in background {
        let result = delegator
            .delegate(Delegation::new(goal).session(session).context("demo"))
            .await?;
        if let DelegateResult::Dispatched { delegation_id, .. } = &result {
            ids.push(delegation_id.clone());
        }
        println!(
            "delegate (session {session:?}): {}",
            serde_json::to_string(&result).unwrap_or_default()
        );
    }
    let result = delegator.delegate(Delegation::new("Add 2 and 2")).await?;
    println!(
        "delegate (no session): {}",
        serde_json::to_string(&result).unwrap_or_default()
    );

    let timeout = Duration::from_secs(30);
    let expected = background.len();
    // Bursts for one session may be combined into one turn: counted by the
    // delegations the turns name.
    let received = sink.wait_for_delegations(&ids, timeout).await;
    if received < expected {
        return Err(DevError::DemoIncomplete {
            received,
            expected,
            timeout,
        });
    }
    println!(
        "demo: all {expected} background delegations were woken; the sync one returned inline."
    );
    Ok(())
}
