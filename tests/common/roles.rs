//! A NATS server with per-role users and the repository's permissions.

use std::path::{Path, PathBuf};
use std::time::Duration;

use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::protocol::Subjects;

use super::NatsServer;

/// A NATS server with per-role users (by default the repository's
/// `nats.conf`), logging to a file so tests can read its permission
/// violations. Every user's password is `<user>-dev-only`.
pub struct RoleServer {
    pub nats: NatsServer,
    pub log: PathBuf,
    /// Holds the password files and any generated configuration.
    pub dir: tempfile::TempDir,
}

impl RoleServer {
    /// With the repository's `nats.conf`.
    pub async fn start() -> Self {
        let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("nats.conf");
        Self::start_with_conf(tempfile::tempdir().unwrap(), &conf).await
    }

    /// With the configuration `conf` (which may live in `dir`).
    pub async fn start_with_conf(dir: tempfile::TempDir, conf: &Path) -> Self {
        let log = dir.path().join("nats-server.log");
        let nats = NatsServer::start_with(vec![
            "-c".into(),
            conf.display().to_string(),
            "-l".into(),
            log.display().to_string(),
        ])
        .await;
        Self { nats, log, dir }
    }

    /// Connection settings for `user`, as a service would use them; every
    /// role but the operator has the inbox prefix `_INBOX_<user>`.
    pub fn config(&self, user: &str) -> NatsConfig {
        let password = self.dir.path().join(format!("{user}.password"));
        std::fs::write(&password, format!("{user}-dev-only\n")).unwrap();
        NatsConfig {
            user: Some(user.to_owned()),
            password_file: Some(password),
            inbox_prefix: (user != "operator").then(|| format!("_INBOX_{user}")),
            ..NatsConfig::new(self.nats.url())
        }
    }

    /// A bus for `user` under the prefix `wakebus`.
    pub async fn bus(&self, user: &str) -> Bus {
        self.bus_with_prefix(user, "wakebus").await
    }

    /// A bus for `user` under `prefix`.
    pub async fn bus_with_prefix(&self, user: &str, prefix: &str) -> Bus {
        let client = self.config(user).connect().await.expect("connect");
        Bus::new(client, Subjects::new(prefix).unwrap())
    }

    /// Permission violations the server logged so far.
    pub fn violations(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("Violation"))
            .map(str::to_owned)
            .collect()
    }
}

/// What `wakebus init` does, as the operator, for the prefix `wakebus`.
pub async fn init(server: &RoleServer) {
    init_prefix(server, "wakebus").await;
}

/// What `wakebus init --prefix <prefix>` does, as the operator.
pub async fn init_prefix(server: &RoleServer, prefix: &str) {
    let bus = server.bus_with_prefix("operator", prefix).await;
    let settings = BusSettings::default();
    bus.provision(&settings).await.expect("streams");
    bus.provision_wake_state(&settings).await.expect("buckets");
    bus.worker_consumer("default", Duration::from_secs(5))
        .await
        .expect("worker consumer");
    bus.wake_consumer(Duration::from_secs(5), 10_000)
        .await
        .expect("wake consumer");
}
