//! A real nats-server process per test: free port, temporary store,
//! readiness by probing, restartable with the same settings, killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// The nats-server binary: `WAKEBUS_NATS_SERVER`, else `nats-server` on PATH.
pub fn server_binary() -> PathBuf {
    std::env::var_os("WAKEBUS_NATS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// Picks a TCP port on 127.0.0.1 that is free now and that nothing else in
/// this run takes while its server is down for a restart: ports come from
/// just below the kernel's ephemeral range, so no outgoing connection and no
/// bind to port 0 gets one, and each is handed out once per test process.
/// Under cargo-nextest, where every test is a process of its own and
/// several run at once, each running test has its own slot
/// (`NEXTEST_TEST_GLOBAL_SLOT`) and takes ports from its own share of the
/// range, so no other test can take a port while its server restarts.
/// Otherwise a start that differs per process keeps processes apart.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static START: OnceLock<u32> = OnceLock::new();
    const RANGE: u32 = 12_000;
    const SLOTS: u32 = 8;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let Some(mut low) = ephemeral_low.checked_sub(RANGE).filter(|low| *low >= 1_024) else {
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
    };
    let slot = std::env::var("NEXTEST_TEST_GLOBAL_SLOT")
        .ok()
        .and_then(|slot| slot.parse::<u32>().ok());
    let span = match slot {
        Some(slot) => {
            low += (slot % SLOTS) * (RANGE / SLOTS);
            RANGE / SLOTS
        }
        None => RANGE,
    };
    let start = *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (std::process::id().wrapping_mul(7_919) ^ nanos) % span
    });
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = u16::try_from(low + offset).expect("a port below the ephemeral range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {low}..{}", low + span);
}

pub struct NatsServer {
    /// Client port.
    pub port: u16,
    /// Extra arguments (cluster flags, config file), kept for restarts.
    pub extra_args: Vec<String>,
    /// The JetStream store; removed on drop.
    pub store: TempDir,
    /// Environment of the server process (a config file may read it).
    pub env: Vec<(String, String)>,
    /// Whether clients need credentials or TLS: readiness is then probed by
    /// the server's INFO line instead of a JetStream request.
    pub secured: bool,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a single server with JetStream.
    pub async fn start() -> Self {
        Self::start_with(Vec::new()).await
    }

    /// Starts a server with extra arguments.
    pub async fn start_with(extra_args: Vec<String>) -> Self {
        Self::start_on(free_port(), extra_args).await
    }

    /// Starts a server with `config` (nats-server configuration text, e.g.
    /// `jetstream { limits { max_ack_pending: 500 } }`) besides the usual
    /// arguments; the directory holding the file lives as long as the
    /// returned one, for restarts.
    pub async fn start_with_config(config: &str) -> (Self, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().join("nats.conf");
        std::fs::write(&conf, config).expect("config");
        let server = Self::start_with(vec!["-c".into(), conf.display().to_string()]).await;
        (server, dir)
    }

    /// Starts a server on `port` (for tests whose clients start first).
    pub async fn start_on(port: u16, extra_args: Vec<String>) -> Self {
        let mut server = Self::launch(port, extra_args);
        server.wait_ready().await;
        server
    }

    /// Starts a server on `port` without waiting for it (a cluster node is
    /// only ready once its peers are up).
    pub fn launch(port: u16, extra_args: Vec<String>) -> Self {
        let mut server = Self {
            port,
            extra_args,
            store: tempfile::tempdir().expect("tempdir"),
            env: Vec::new(),
            secured: false,
            child: None,
        };
        server.spawn();
        server
    }

    /// Starts a server that requires credentials or TLS, with a config
    /// file reading `env`.
    pub async fn start_secured(extra_args: Vec<String>, env: Vec<(String, String)>) -> Self {
        let mut server = Self {
            port: free_port(),
            extra_args,
            store: tempfile::tempdir().expect("tempdir"),
            env,
            secured: true,
            child: None,
        };
        server.spawn();
        server.wait_ready().await;
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the process (again) with the same port, store and arguments.
    pub fn spawn(&mut self) {
        let child = Command::new(server_binary())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store.path())
            .args(&self.extra_args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(self.store.path().join("server.stderr"))
                    .map(Stdio::from)
                    .unwrap_or_else(|_| Stdio::null()),
            )
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server_binary().display()));
        self.child = Some(child);
    }

    /// Waits until the server answers a JetStream API request.
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let stderr = std::fs::read_to_string(self.store.path().join("server.stderr"))
                    .unwrap_or_default();
                panic!("nats-server exited during start: {status}\n{stderr}");
            }
            if self.secured {
                if self.info_line().await {
                    return;
                }
            } else if let Ok(client) = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_millis(500))
                .connect(self.url())
                .await
            {
                let ready = tokio::time::timeout(
                    Duration::from_secs(1),
                    client.request("$JS.API.INFO", "".into()),
                )
                .await;
                if let Ok(Ok(reply)) = ready
                    && !String::from_utf8_lossy(&reply.payload).contains("\"error\"")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "nats-server not ready within 20s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the server accepts TCP connections and greets with INFO (it
    /// starts JetStream before it listens).
    async fn info_line(&self) -> bool {
        use tokio::io::AsyncBufReadExt;
        let Ok(Ok(stream)) = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(("127.0.0.1", self.port)),
        )
        .await
        else {
            return false;
        };
        let mut line = String::new();
        let mut reader = tokio::io::BufReader::new(stream);
        matches!(
            tokio::time::timeout(Duration::from_millis(500), reader.read_line(&mut line)).await,
            Ok(Ok(_)) if line.starts_with("INFO ")
        )
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// SIGKILL (a crash).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal`. After SIGSTOP it returns once every thread of the
    /// server has stopped: it then still accepts bytes into its socket
    /// buffers but answers nothing until SIGCONT.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.as_ref().expect("running").id();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .expect("signal nats-server");
        if signal != nix::sys::signal::Signal::SIGSTOP {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            assert!(Instant::now() < deadline, "nats-server did not stop in 10s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGTERM, and wait for exit (a clean stop). It waits without
    /// blocking the runtime, so that the test's own tasks (services run in
    /// the test process) keep running while the server shuts down.
    pub async fn terminate(&mut self) {
        self.stop_with(nix::sys::signal::Signal::SIGTERM, Duration::from_secs(30))
            .await;
    }

    /// Puts the server in lame-duck mode (SIGUSR2, what `nats-server
    /// --signal ldm` sends) and waits for it to exit: it stops taking new
    /// clients, hands its JetStream leaderships over, closes its clients
    /// one by one after its grace period and exits. Returns whether it had
    /// clients left to close (a server without any exits at once, as on
    /// SIGTERM).
    pub async fn lame_duck(&mut self) -> bool {
        self.stop_with(nix::sys::signal::Signal::SIGUSR2, Duration::from_secs(60))
            .await;
        let log = std::fs::read_to_string(self.store.path().join("server.stderr"))
            .expect("read the server's log");
        assert!(
            log.contains("Entering lame duck mode"),
            "nats-server exited without entering lame-duck mode:\n{log}"
        );
        log.contains("Closing existing clients")
    }

    /// Sends `signal` and waits up to `patience` for the process to exit,
    /// without blocking the runtime.
    async fn stop_with(&mut self, signal: nix::sys::signal::Signal, patience: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, signal);
        let deadline = Instant::now() + patience;
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("nats-server did not exit within {patience:?} of {signal}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, then start again with the same port, store and arguments.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn();
        self.wait_ready().await;
    }

    /// SIGTERM (a clean stop), then start again with the same settings.
    pub async fn restart_gracefully(&mut self) {
        self.terminate().await;
        self.spawn();
        self.wait_ready().await;
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in
/// `/proc/<pid>/task/<tid>/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                // The state follows the command name, which is in parentheses.
                let after = &stat[stat.rfind(')')? + 1..];
                after.split_whitespace().next().map(|state| state == "T")
            })
            .unwrap_or(false)
    })
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A server on which an anonymous client may do everything and the user
/// `limited` everything but publish to some subjects (JetStream API
/// requests, say), as a role without a permission would be.
pub struct LimitedUserServer {
    pub nats: NatsServer,
    /// Holds the configuration and the password file.
    dir: TempDir,
}

/// The API subjects that read `stream`'s messages (by sequence or subject,
/// from any replica or the leader), for a [`LimitedUserServer`] to deny.
pub fn message_reads_of(stream: &str) -> Vec<String> {
    vec![
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
    ]
}

impl LimitedUserServer {
    /// Starts one whose user `limited` may not publish to `denied`.
    pub async fn start(denied: &[String]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let denied = serde_json::to_string(denied).expect("subjects");
        let conf = dir.path().join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                r#"authorization {{
  users: [
    {{ user: all, password: "all-pw" }}
    {{ user: limited, password: "limited-pw", permissions: {{
        publish: {{ allow: [">"], deny: {denied} }}
        subscribe: {{ allow: [">"] }} }} }}
  ]
}}
no_auth_user: all
"#
            ),
        )
        .expect("config");
        std::fs::write(dir.path().join("limited.password"), "limited-pw").expect("password");
        let nats = NatsServer::start_with(vec!["-c".into(), conf.display().to_string()]).await;
        Self { nats, dir }
    }

    /// The global `wakebus` arguments that authenticate as `limited`.
    pub fn limited_args(&self) -> Vec<String> {
        let password = self.dir.path().join("limited.password");
        vec![
            "--user".into(),
            "limited".into(),
            "--password-file".into(),
            password.display().to_string(),
        ]
    }

    /// Connection settings for `limited`, as a service would use them.
    pub fn limited_config(&self) -> wakebus::connect::NatsConfig {
        wakebus::connect::NatsConfig {
            user: Some("limited".to_owned()),
            password_file: Some(self.dir.path().join("limited.password")),
            ..wakebus::connect::NatsConfig::new(self.nats.url())
        }
    }

    /// Runs `wakebus <args>` under `prefix`, authenticated as `limited`.
    pub async fn wakebus_as_limited(&self, prefix: &str, args: &[&str]) -> super::cli::Run {
        let mut all = self.limited_args();
        all.extend(args.iter().map(|a| a.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        super::cli::wakebus(&self.nats.url(), prefix, &all).await
    }
}
