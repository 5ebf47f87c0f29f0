//! The nats-server the benchmark runs against: started here on a free port
//! with a temporary store, killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// A running nats-server with JetStream.
pub(crate) struct NatsServer {
    /// Its client URL.
    pub(crate) url: String,
    /// `nats-server --version`.
    pub(crate) version: String,
    /// The JetStream store, removed on drop.
    _store: TempDir,
    /// The process.
    child: Child,
}

/// The nats-server binary: `WAKEBUS_NATS_SERVER`, else `nats-server` on PATH.
pub(crate) fn server_binary() -> PathBuf {
    std::env::var_os("WAKEBUS_NATS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// A free TCP port on 127.0.0.1.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl NatsServer {
    /// Starts a server and waits until JetStream answers.
    pub(crate) async fn start() -> Self {
        let port = free_port();
        let store = tempfile::tempdir().expect("tempdir");
        let version = Command::new(server_binary())
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        let child = Command::new(server_binary())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server_binary().display()));
        let server = Self {
            url: format!("nats://127.0.0.1:{port}"),
            version,
            _store: store,
            child,
        };
        server.wait_ready().await;
        server
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = async_nats::connect(&self.url).await {
                let reply = tokio::time::timeout(
                    Duration::from_secs(1),
                    client.request("$JS.API.INFO", "".into()),
                )
                .await;
                if matches!(reply, Ok(Ok(r)) if !String::from_utf8_lossy(&r.payload).contains("\"error\""))
                {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "nats-server not ready in 20s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The server's process id (for its RSS).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
