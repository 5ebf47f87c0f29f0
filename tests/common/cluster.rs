//! A JetStream cluster of real nats-server processes: each node has its own
//! client port, cluster port, monitoring port, store directory and server
//! name, and routes to every node. Nodes can be killed and restarted with
//! the same settings.

use std::time::{Duration, Instant};

use super::nats::{NatsServer, free_port};

pub struct NatsCluster {
    /// The nodes; node `i` is named `n{i}`.
    pub nodes: Vec<NatsServer>,
    /// Each node's HTTP monitoring port (`/healthz`).
    monitor_ports: Vec<u16>,
    /// Holds the configuration file every node reads ([`CONFIG`]).
    _config: tempfile::TempDir,
}

/// The nodes' configuration file: lame-duck timings that let a node put in
/// lame-duck mode leave within seconds. The grace period before it starts
/// closing its clients is 1 s (the default is 10 s, as in
/// `deploy/nats-cluster.conf`). It then closes them one by one, spread over
/// `lame_duck_duration` but at most 1 s apart, so with a few clients the
/// duration hardly matters; 30 s is the least the server accepts.
const CONFIG: &str = "lame_duck_grace_period: 1s\nlame_duck_duration: 30s\n";

impl NatsCluster {
    /// Starts `size` nodes and waits until every one answers, sees all its
    /// peers and a JetStream meta leader is elected.
    pub async fn start(size: usize) -> Self {
        let client_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let cluster_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let monitor_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let routes = cluster_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let config = tempfile::tempdir().expect("tempdir");
        let config_file = config.path().join("node.conf");
        std::fs::write(&config_file, CONFIG).expect("write the nodes' configuration");
        let nodes = (0..size)
            .map(|i| {
                let args = vec![
                    "--config".to_owned(),
                    config_file.display().to_string(),
                    "--server_name".to_owned(),
                    format!("n{i}"),
                    "--cluster_name".to_owned(),
                    "wakebus-test".to_owned(),
                    "--cluster".to_owned(),
                    format!("nats://127.0.0.1:{}", cluster_ports[i]),
                    "--routes".to_owned(),
                    routes.clone(),
                    "--http_port".to_owned(),
                    monitor_ports[i].to_string(),
                ];
                NatsServer::launch(client_ports[i], args)
            })
            .collect();
        let mut cluster = Self {
            nodes,
            monitor_ports,
            _config: config,
        };
        cluster.wait_ready().await;
        cluster
    }

    /// Every node's client URL, comma-separated (how clients should connect).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The index of the node named `server_name`.
    pub fn index_of(&self, server_name: &str) -> usize {
        server_name
            .strip_prefix('n')
            .and_then(|i| i.parse().ok())
            .filter(|i| *i < self.nodes.len())
            .unwrap_or_else(|| panic!("no node named {server_name}"))
    }

    /// The node currently leading `stream` (from its stream info).
    pub async fn stream_leader(&self, client: &async_nats::Client, stream: &str) -> usize {
        let js = async_nats::jetstream::new(client.clone());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut handle) = js.get_stream(stream).await
                && let Ok(info) = handle.info().await
                && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            {
                return self.index_of(&leader);
            }
            assert!(
                Instant::now() < deadline,
                "stream {stream} has no leader after 20s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILLs node `i` (a crash); its store stays.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// SIGKILLs node `i` (if it is running), starts it again with its port,
    /// store and cluster settings, and waits until the whole cluster is
    /// ready again.
    pub async fn restart(&mut self, i: usize) {
        self.nodes[i].kill();
        self.start_again(i).await;
    }

    /// Stops node `i` with SIGTERM, as for an upgrade, waiting for it to
    /// exit, starts it again with its port, store and cluster settings, and
    /// waits until the whole cluster is ready and every node's `/healthz`
    /// says its streams and consumers are current: the check a rolling
    /// restart makes before it takes the next node down.
    pub async fn restart_gracefully(&mut self, i: usize) {
        self.nodes[i].terminate().await;
        self.start_again(i).await;
        self.wait_healthy().await;
    }

    /// Puts node `i` in lame-duck mode, as `nats-server --signal ldm` does
    /// before an upgrade, waits for it to hand over its leaderships, close
    /// its clients and exit, then starts it again and waits as
    /// [`Self::restart_gracefully`] does. Returns how many clients the node
    /// had when it was told: each was closed by the lame-duck node (which
    /// is checked) and had to reconnect to another.
    pub async fn restart_after_lame_duck(&mut self, i: usize) -> usize {
        let clients = self.clients(i).await;
        let closed_clients = self.nodes[i].lame_duck().await;
        assert_eq!(
            closed_clients,
            clients > 0,
            "n{i} had {clients} client(s) when it entered lame-duck mode"
        );
        self.start_again(i).await;
        self.wait_healthy().await;
        clients
    }

    /// The client connections node `i` has (its `/connz`).
    async fn clients(&self, i: usize) -> usize {
        let url = format!("http://127.0.0.1:{}/connz", self.monitor_ports[i]);
        let (status, body) = super::http_get(&url).await.expect("/connz answers");
        assert_eq!(status, 200, "{body}");
        let connz: serde_json::Value = serde_json::from_str(&body).expect("/connz is JSON");
        connz["num_connections"]
            .as_u64()
            .map(|n| n as usize)
            .unwrap_or_else(|| panic!("no num_connections in {body}"))
    }

    async fn start_again(&mut self, i: usize) {
        self.nodes[i].spawn();
        self.wait_ready().await;
    }

    /// Waits until `/healthz` answers 200 on every node in one round: with
    /// JetStream on, nats-server answers so only once the node has a meta
    /// leader and its streams and consumers have caught up with their
    /// leaders.
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut unhealthy = Vec::new();
            for port in &self.monitor_ports {
                let url = format!("http://127.0.0.1:{port}/healthz");
                match super::http_get(&url).await {
                    Some((200, _)) => {}
                    answer => unhealthy.push(format!("{url}: {answer:?}")),
                }
            }
            if unhealthy.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not every node healthy within 60s:\n{}",
                unhealthy.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every node answers a JetStream request that needs the
    /// meta leader and advertises every node as a peer; panics if a node
    /// has exited (all are expected to run).
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for i in 0..self.nodes.len() {
                if !self.nodes[i].is_running() {
                    let stderr = self.nodes[i].store.path().join("server.stderr");
                    let output = std::fs::read_to_string(&stderr).unwrap_or_default();
                    let tail: Vec<&str> = output.lines().rev().take(15).collect();
                    panic!(
                        "nats-server node n{i} exited during start; its last lines:\n{}",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
            }
            let mut ready = true;
            for node in &self.nodes {
                if !node_ready(&node.url(), self.nodes.len()).await {
                    ready = false;
                    break;
                }
            }
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nats cluster not ready within 30s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Whether the node at `url` sees `peers` servers (itself included) and
/// answers `$JS.API.STREAM.NAMES`, which only the meta leader can serve.
async fn node_ready(url: &str, peers: usize) -> bool {
    let Ok(client) = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_millis(500))
        .connect(url)
        .await
    else {
        return false;
    };
    if client.server_info().connect_urls.len() < peers {
        return false;
    }
    let reply = tokio::time::timeout(
        Duration::from_secs(1),
        client.request("$JS.API.STREAM.NAMES", "{}".into()),
    )
    .await;
    matches!(reply, Ok(Ok(reply)) if !String::from_utf8_lossy(&reply.payload).contains("\"error\""))
}

/// Waits until `stream` has a leader and `replicas - 1` followers, each
/// current and online, and returns the nodes holding it, leader first. A
/// stream's info lists a follower that is down too, so counting them would
/// not tell whether the stream has caught up.
pub async fn wait_replicas_current(
    js: &async_nats::jetstream::Context,
    stream: &str,
    replicas: usize,
) -> Vec<String> {
    wait_replicas(js, stream, replicas, true).await
}

/// Waits until `stream` has a leader and `replicas - 1` followers online,
/// current or not: nats-server 2.9 can leave a follower of a stream that
/// no longer gets writes reporting a small lag (seen after a rolling
/// restart under load: a lag of 3 for over a minute).
pub async fn wait_replicas_online(
    js: &async_nats::jetstream::Context,
    stream: &str,
    replicas: usize,
) -> Vec<String> {
    wait_replicas(js, stream, replicas, false).await
}

/// [`wait_replicas_current`], or [`wait_replicas_online`] when not
/// `current`.
async fn wait_replicas(
    js: &async_nats::jetstream::Context,
    stream: &str,
    replicas: usize,
    current: bool,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let cluster = match js.get_stream(stream).await {
            Ok(mut handle) => handle
                .info()
                .await
                .ok()
                .and_then(|info| info.cluster.clone()),
            Err(_) => None,
        };
        if let Some(cluster) = &cluster
            && let Some(leader) = &cluster.leader
            && cluster.replicas.len() + 1 == replicas
            && cluster
                .replicas
                .iter()
                .all(|r| (r.current || !current) && !r.offline)
        {
            let followers = cluster.replicas.iter().map(|r| r.name.clone());
            return std::iter::once(leader.clone()).chain(followers).collect();
        }
        assert!(
            Instant::now() < deadline,
            "{stream} not on {replicas} replicas (current: {current}) within 60s: {cluster:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
