//! Connecting to NATS: URL, every client authentication NATS offers, and
//! patience when the server is not up yet.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use tracing::{error, info, warn};

mod tls_probe;

pub use tls_probe::{TlsProbeError, TlsProbeOutcome};

/// How to reach and authenticate to NATS. Secrets are read from files so that
/// they never appear in process listings or logs.
#[derive(Debug, Clone, Default)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// Client name shown in the server's connection list.
    pub name: Option<String>,
    /// JWT credentials file (`.creds`).
    pub creds_file: Option<PathBuf>,
    /// File holding an NKey seed.
    pub nkey_file: Option<PathBuf>,
    /// File holding a token.
    pub token_file: Option<PathBuf>,
    /// User name for user/password auth.
    pub user: Option<String>,
    /// File holding the password for `user`.
    pub password_file: Option<PathBuf>,
    /// CA certificate to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    /// Client key for mutual TLS.
    pub tls_key: Option<PathBuf>,
    /// Subject prefix of this client's reply inboxes (default `_INBOX`).
    /// With NATS permissions, each role subscribes only to its own prefix,
    /// so no role can read replies meant for another (tasks pulled by
    /// workers, say).
    pub inbox_prefix: Option<String>,
}

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A secret file could not be read.
    #[error("cannot read {what} from {path}: {source}")]
    SecretFile {
        /// Which secret.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `user` was given without a password file, or the other way round.
    #[error(
        "user/password authentication needs both --user (NATS_USER) and --password-file \
         (NATS_PASSWORD_FILE), and only one is set: check the environment and --config"
    )]
    IncompleteUserPassword,
    /// `tls_cert` was given without `tls_key`, or the other way round.
    #[error("a TLS client certificate needs both --tls-cert and --tls-key")]
    IncompleteClientCertificate,
    /// A TLS file (`--tls-ca`, `--tls-cert`, `--tls-key`) cannot be read or
    /// holds no PEM certificate or key. Checked at start: the NATS client
    /// reads these files only at each connect attempt and reports a failure
    /// there as a bare "TLS error", so a missing file would otherwise show
    /// as that, at every reconnect, for ever.
    #[error("cannot use {what} file {path}: {reason}")]
    TlsFile {
        /// Which file (`--tls-ca`, …).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A server URL cannot be parsed.
    #[error("invalid NATS server URL {url:?}: {source}")]
    InvalidUrl {
        /// The URL.
        url: String,
        /// Why it is invalid.
        source: std::io::Error,
    },
    /// No server URL was given (an empty `--nats-url` or
    /// `NATS_URL`): connecting to a default instead could reach
    /// another deployment's server.
    #[error("no NATS server URL given (--nats-url or NATS_URL is empty)")]
    NoUrl,
    /// The inbox prefix is not a subject replies can be sent to: empty,
    /// with a wildcard, a blank or an empty token. No JetStream answer
    /// would ever reach the client, and every request would time out.
    #[error(
        "invalid inbox prefix {prefix:?} (--inbox-prefix or NATS_INBOX_PREFIX): use dot-separated tokens without wildcards or blanks, e.g. _INBOX_worker"
    )]
    InvalidInboxPrefix {
        /// The prefix as given.
        prefix: String,
    },
    /// The server refused this client's credentials: retrying will not help.
    #[error(
        "NATS at {url} refused this client ({source}): check the credentials (--user/--password-file, --nkey-file, --creds, --token-file) and TLS client certificate"
    )]
    Refused {
        /// The URL.
        url: String,
        /// The client error.
        source: async_nats::ConnectError,
    },
    /// The NATS client refused the options or could not connect.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        /// The URL.
        url: String,
        /// The client error.
        source: async_nats::ConnectError,
    },
}

/// Refuses an inbox prefix no reply could be sent to.
fn check_inbox_prefix(prefix: &str) -> Result<(), ConnectError> {
    let usable = prefix.split('.').all(|token| {
        !token.is_empty()
            && !token
                .chars()
                .any(|c| c.is_whitespace() || c == '*' || c == '>')
    });
    if usable {
        Ok(())
    } else {
        Err(ConnectError::InvalidInboxPrefix {
            prefix: prefix.to_owned(),
        })
    }
}

fn read_secret(what: &'static str, path: &PathBuf) -> Result<String, ConnectError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| ConnectError::SecretFile {
            what,
            path: path.clone(),
            source,
        })
}

/// Checks that `path` holds at least one PEM certificate, as the NATS
/// client will read it.
fn check_certificates(what: &'static str, path: &PathBuf) -> Result<(), ConnectError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let fail = |reason: String| ConnectError::TlsFile {
        what,
        path: path.clone(),
        reason,
    };
    let mut found = 0usize;
    for certificate in CertificateDer::pem_file_iter(path).map_err(|e| fail(e.to_string()))? {
        certificate.map_err(|e| fail(e.to_string()))?;
        found += 1;
    }
    if found == 0 {
        return Err(fail("no PEM certificate in it".to_owned()));
    }
    Ok(())
}

/// Checks that `path` holds a PEM private key, as the NATS client will read
/// it.
fn check_private_key(path: &PathBuf) -> Result<(), ConnectError> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject as _;
    PrivateKeyDer::from_pem_file(path)
        .map(drop)
        .map_err(|e| ConnectError::TlsFile {
            what: "--tls-key",
            path: path.clone(),
            reason: e.to_string(),
        })
}

impl NatsConfig {
    /// A config for `url` with no authentication.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    async fn options(
        &self,
        wait_for_server: bool,
        per_server: Duration,
    ) -> Result<ConnectOptions, ConnectError> {
        let mut options = if let Some(path) = &self.creds_file {
            ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|source| ConnectError::SecretFile {
                    what: "credentials",
                    path: path.clone(),
                    source,
                })?
        } else if let Some(path) = &self.nkey_file {
            ConnectOptions::with_nkey(read_secret("nkey seed", path)?)
        } else if let Some(path) = &self.token_file {
            ConnectOptions::with_token(read_secret("token", path)?)
        } else {
            match (&self.user, &self.password_file) {
                (Some(user), Some(path)) => ConnectOptions::with_user_and_password(
                    user.clone(),
                    read_secret("password", path)?,
                ),
                (None, None) => ConnectOptions::new(),
                _ => return Err(ConnectError::IncompleteUserPassword),
            }
        };
        if let Some(ca) = &self.tls_ca {
            check_certificates("--tls-ca", ca)?;
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                check_certificates("--tls-cert", cert)?;
                check_private_key(key)?;
                // A client certificate is only ever sent over TLS.
                options = options
                    .add_client_certificate(cert.clone(), key.clone())
                    .require_tls(true);
            }
            (None, None) => {}
            _ => return Err(ConnectError::IncompleteClientCertificate),
        }
        if let Some(name) = &self.name {
            options = options.name(name);
        }
        if let Some(prefix) = &self.inbox_prefix {
            check_inbox_prefix(prefix)?;
            options = options.custom_inbox_prefix(prefix);
        }
        if wait_for_server {
            options = options.retry_on_initial_connect();
        }
        // What a failed connect probes with.
        let probe = std::sync::Arc::new(self.clone());
        Ok(options
            .max_reconnects(None)
            .ping_interval(PING_INTERVAL)
            .connection_timeout(per_server)
            .event_callback(move |event| {
                let probe = probe.clone();
                async move {
                match event {
                    Event::Connected => info!("Connected to NATS."),
                    // Once per connection lost (a failed reconnect attempt
                    // is a client error event, not another disconnect).
                    Event::Disconnected => {
                        crate::ops::metrics::nats_disconnected();
                        warn!("Disconnected from NATS, reconnecting.");
                    }
                    // A restart or upgrade: the server closes this connection
                    // within its `lame_duck_duration` and the client moves on.
                    Event::LameDuckMode => info!(
                        "The NATS server is in lame-duck mode; it will close this connection, and the client will reconnect (to another node, or to this server once it is back)."
                    ),
                    // Needs an operator: retrying will not help.
                    other if is_refusal(&other) => error!(
                        event = %other,
                        "NATS refused this client: check the credentials (--user/--password-file, --nkey-file, --creds, --token-file) and TLS client certificate."
                    ),
                    // The files were read at start: the client's TLS setup
                    // fails now only if one was replaced by a file it cannot
                    // use, which retrying will not mend. Its event names
                    // only the kind; said at most once a minute.
                    other if is_tls_failure(&other) => {
                        if once_a_minute(&TLS_FAILURE_SAID) {
                            error!(event = %other, "The NATS client cannot set up TLS: check the files of --tls-ca, --tls-cert and --tls-key (replaced since the start?); the client's debug log (RUST_LOG=async_nats=debug) has the cause.");
                        }
                    }
                    // A failed handshake (a CA that did not sign the
                    // server's certificate, a client certificate the server
                    // refuses, a server without TLS, a server requiring TLS
                    // of a client given no CA) reaches the client as a
                    // closed connection, like a server that is down: a
                    // handshake of our own tells which, at most once a
                    // minute.
                    other if is_io_failure(&other) && once_a_minute(&TLS_IO_SAID) => {
                        tokio::spawn(say_why_tls_fails(probe, other.to_string()));
                    }
                    // A subscription the service needs (its replies, the
                    // cancel broadcasts): without it, it cannot work.
                    other if is_denial(&other) && other.to_string().to_ascii_lowercase().contains("violation for subscription") => error!(
                        event = %other,
                        "NATS denied this user a subscription the service needs: check this user's permissions."
                    ),
                    // One request a least-privileged role may not make: some
                    // are expected and optional (the poison sweep's reads,
                    // updates of stream settings), and what needs them says
                    // so in its own log line.
                    other if is_denial(&other) => warn!(
                        event = %other,
                        "NATS denied a request to this user; expected for optional steps of a least-privileged role, otherwise check this user's permissions."
                    ),
                    // Raised for every message dropped, so said at most once
                    // a minute: a pull's come back after AckWait, a core
                    // subscription's are lost.
                    Event::SlowConsumer(sid) if once_a_minute(&SLOW_CONSUMER_SAID) => warn!(sid, "A subscription of this client fell behind and the client dropped messages for it (said at most once a minute)."),
                    Event::SlowConsumer(_) => {}
                    other => info!(event = %other, "NATS client event."),
                }
                }
            }))
    }

    /// The authentication methods given, in the order of precedence.
    fn authentication_methods(&self) -> Vec<&'static str> {
        [
            (self.creds_file.is_some(), "--creds"),
            (self.nkey_file.is_some(), "--nkey-file"),
            (self.token_file.is_some(), "--token-file"),
            (
                self.user.is_some() || self.password_file.is_some(),
                "--user/--password-file",
            ),
        ]
        .into_iter()
        .filter_map(|(given, name)| given.then_some(name))
        .collect()
    }

    /// The server addresses in `url`: one URL, or several separated by
    /// commas (the nodes of a cluster; the client fails over between them).
    pub fn servers(&self) -> Result<Vec<ServerAddr>, ConnectError> {
        let servers: Vec<ServerAddr> = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(|url| {
                url.parse::<ServerAddr>()
                    .map_err(|source| ConnectError::InvalidUrl {
                        url: url.to_owned(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        if servers.is_empty() {
            return Err(ConnectError::NoUrl);
        }
        Ok(servers)
    }

    /// Connects, waiting for the server if it is not up yet.
    ///
    /// The client reconnects by itself forever after a disconnect; requests
    /// made while it is disconnected fail with timeouts and are retried by
    /// their callers.
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        self.warn_of_several_methods();
        self.connect_with(true, SERVER_TIMEOUT).await
    }

    /// Warns, once per connect, when more than one authentication method is
    /// given: only the first is used, which surprises an operator in the
    /// middle of a credential migration.
    fn warn_of_several_methods(&self) {
        let given = self.authentication_methods();
        if given.len() > 1 {
            warn!(given = %given.join(", "), using = given[0], "Several NATS authentication methods are given; only the first is used (in this order: credentials, NKey, token, user and password).");
        }
    }

    /// Connects to a server that answers within `patience`, or fails saying
    /// why: for commands run by hand, whose operator should hear soon that
    /// NATS is unreachable rather than watch them wait (`Duration::ZERO`:
    /// one attempt). Refused credentials fail at once. An attempt is cut
    /// off at the deadline (given at least [`MIN_ATTEMPT`] per server), so
    /// a host that drops packets does not stretch the wait; the client
    /// tries the servers one after another, so each gets its share of the
    /// attempt, and one that does not answer cannot use it all up before
    /// the others are tried. Once connected, the client reconnects like
    /// any other.
    pub async fn connect_within(&self, patience: Duration) -> Result<Client, ConnectError> {
        self.warn_of_several_methods();
        let servers = u32::try_from(self.servers()?.len())
            .unwrap_or(u32::MAX)
            .max(1);
        let deadline = tokio::time::Instant::now() + patience;
        let mut delay = Duration::from_millis(100);
        loop {
            let left = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .max(MIN_ATTEMPT.saturating_mul(servers));
            let per_server = (left / servers).min(SERVER_TIMEOUT);
            let attempt = tokio::time::timeout(left, self.connect_with(false, per_server))
                .await
                .unwrap_or_else(|_| {
                    Err(ConnectError::Connect {
                        url: self.url.clone(),
                        source: async_nats::ConnectErrorKind::TimedOut.into(),
                    })
                });
            match attempt {
                Err(ConnectError::Connect { source, .. })
                    // A name that does not resolve is a server restarting
                    // too (a container whose DNS record goes with it).
                    if matches!(
                        source.kind(),
                        async_nats::ConnectErrorKind::Io
                            | async_nats::ConnectErrorKind::TimedOut
                            | async_nats::ConnectErrorKind::Dns
                    ) && tokio::time::Instant::now() + delay < deadline =>
                {
                    info!(url = %self.url, error = %source, retry_in = ?delay, "NATS did not answer; trying again.");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
                result => return result,
            }
        }
    }

    async fn connect_with(
        &self,
        wait_for_server: bool,
        per_server: Duration,
    ) -> Result<Client, ConnectError> {
        let servers = self.servers()?;
        let options = self.options(wait_for_server, per_server).await?;
        options.connect(servers).await.map_err(|source| {
            let url = self.url.clone();
            match source.kind() {
                async_nats::ConnectErrorKind::Authentication
                | async_nats::ConnectErrorKind::AuthorizationViolation => {
                    ConnectError::Refused { url, source }
                }
                _ => ConnectError::Connect { url, source },
            }
        })
    }
}

/// Whether `client` can send now. async-nats does not drain its command
/// queue while it reconnects: a send made while disconnected only queues,
/// and once that queue (2,048 commands) is full every later send waits for
/// the server, a stopping service's hand-backs included. Sends that are
/// retried anyway, or worthless after an outage, are skipped while this is
/// false, so an outage cannot fill the queue.
pub fn is_connected(client: &Client) -> bool {
    client.connection_state() == State::Connected
}

/// How often [`connected`] looks at the client's state.
const CONNECTED_CHECK: Duration = Duration::from_millis(100);

/// Completes once `client` is connected (at once if it is). A consumer
/// loop waits here before it asks for messages again: a pull request made
/// while the client reconnects is only queued (see [`is_connected`]), so
/// re-pulling through an outage would fill that queue, three commands a
/// pull, and on the reconnect send the server a pull request for every
/// inbox given up meanwhile. It looks every 100 ms, and only while
/// disconnected: simpler than carrying the state the client's event
/// callback sees ([`NatsConfig::connect`]) to every consumer loop.
pub async fn connected(client: &Client) {
    while !is_connected(client) {
        tokio::time::sleep(CONNECTED_CHECK).await;
    }
}

/// How often [`connection_ended`] checks the client.
const CONNECTION_CHECK: Duration = Duration::from_secs(2);

/// Completes once `client` has stopped working for good: its connection
/// task has ended, so it will never reconnect and every request fails at
/// once. That task ends when it panics (async-nats 0.51 did on a header
/// value holding a carriage return; 0.52 reads one as a space) or when the
/// client is drained. A long-running service must then exit with an error,
/// so that it is restarted with a new client (which first removes what it
/// cannot read from its consumer: [`crate::quarantine`]), instead of
/// running on with requests that all fail. Checks with a flush every
/// `CONNECTION_CHECK` (2 s): a flush fails only once that task is gone, and
/// only waits while the client reconnects.
pub async fn connection_ended(client: &Client) {
    let mut every = tokio::time::interval(CONNECTION_CHECK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if client.flush().await.is_err() {
            return;
        }
    }
}

/// A service's stop signal, which also fires when its NATS client stops
/// working for good ([`connection_ended`]): the service then stops as it
/// would on a signal, and [`ConnectionLoss::check`] tells it to fail.
pub fn stop_or_connection_loss(
    client: &Client,
    shutdown: impl Future<Output = ()>,
) -> (impl Future<Output = ()>, ConnectionLoss) {
    let lost = ConnectionLoss::default();
    let (client, flag) = (client.clone(), lost.clone());
    let stop = async move {
        tokio::select! {
            () = shutdown => {}
            () = connection_ended(&client) => {
                error!("The NATS client stopped working for good and cannot reconnect; stopping, so that the process is restarted with a new client. See docs/OPERATIONS.md, \"Poison messages\".");
                flag.0.store(true, std::sync::atomic::Ordering::Release);
            }
        }
    };
    (stop, lost)
}

/// Whether a service stopped because its NATS client stopped working.
#[derive(Debug, Clone, Default)]
pub struct ConnectionLoss(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// A service's NATS client stopped working for good; restart the process.
#[derive(Debug, thiserror::Error)]
#[error(
    "the NATS client stopped working for good and cannot reconnect; restart the process (see docs/OPERATIONS.md, \"Poison messages\")"
)]
pub struct ConnectionLost;

impl ConnectionLoss {
    /// `Err` if the client stopped working: the service must exit with an
    /// error rather than report a clean stop.
    pub fn check(&self) -> Result<(), ConnectionLost> {
        if self.happened() {
            Err(ConnectionLost)
        } else {
            Ok(())
        }
    }

    /// Whether the client stopped working (nothing can be sent any more).
    pub fn happened(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The shortest time [`NatsConfig::connect_within`] gives each server in
/// one attempt, so that even no patience at all tries every server once.
/// It also bounds each server's connect on every later reconnect of that
/// client (async-nats keeps it), so it leaves room for a TLS handshake with
/// a distant server.
pub const MIN_ATTEMPT: Duration = Duration::from_secs(2);

/// The longest the client waits for one server to answer a connect
/// (TCP, TLS, the NATS handshake) before it tries the next.
const SERVER_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the client pings a server that has sent nothing meanwhile.
/// A connection whose server stopped answering without closing it (a host
/// that lost power, a partition, a frozen VM) is given up at the third
/// ping in a row without an answer: two to three intervals after the
/// server last sent anything, 20 to 30 s with this, where the client's
/// own default, 60 s, took up to three minutes. Not shorter: every stall
/// of a server past two intervals (a VM paused, a disk that hangs) would
/// cost every client its connection, its pulls and its ordered reads,
/// which CI runs of a few seconds' freezes showed to be costly. Work a
/// worker holds on such a node may still outlive the default AckWait
/// (30 s) and run twice (docs/GUARANTEES.md).
pub const PING_INTERVAL: Duration = Duration::from_secs(10);

/// How long a stopping service waits for NATS: to take what it still has
/// to send, then to close the connection. While the server is unreachable
/// both would wait for it to come back, and a stopping service must not.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends what `client` still holds (acks, hand-backs, ledger writes),
/// waiting at most [`STOP_TIMEOUT`].
pub async fn flush_before_stop(client: &Client) {
    match flush_within(client, STOP_TIMEOUT).await {
        Ok(()) => {}
        Err(error @ FlushError::Failed(_)) => {
            warn!(%error, "Could not flush the NATS connection.");
        }
        Err(FlushError::TimedOut(timeout)) => warn!(
            ?timeout,
            "NATS is unreachable while stopping; messages whose ack was not sent will be redelivered after their ack wait."
        ),
    }
}

/// Why a bounded flush did not complete.
#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// The client could not flush (its connection is closed).
    #[error("could not flush the NATS connection: {0}")]
    Failed(String),
    /// Not done within the time given.
    #[error("NATS did not take what was sent within {0:?}")]
    TimedOut(Duration),
}

/// Flushes `client` within `patience`. async-nats completes a flush only
/// once its connection handler has written it out: with the server gone,
/// a flush waits for the reconnect for ever.
pub async fn flush_within(client: &Client, patience: Duration) -> Result<(), FlushError> {
    match tokio::time::timeout(patience, client.flush()).await {
        Ok(flushed) => flushed.map_err(|error| FlushError::Failed(error.to_string())),
        Err(_) => Err(FlushError::TimedOut(patience)),
    }
}

/// Drains `client` (its subscriptions and what it still has to send) and
/// waits, at most [`STOP_TIMEOUT`] in all, until the connection has closed:
/// [`Client::drain`] only asks for that. A process that exits right after
/// would cut the connection instead, and a server stopped right after (as
/// dev mode stops its own) would be reported as a lost connection. Does
/// not wait for the close when the client is not connected: nothing can be
/// drained then.
pub async fn close(client: &Client) -> Result<(), async_nats::client::DrainError> {
    let connected = is_connected(client);
    let closing = async {
        // Even asking can wait: for room in the client's command queue.
        client.drain().await?;
        // Flushing fails once the connection's task has ended.
        while connected && client.flush().await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    };
    match tokio::time::timeout(STOP_TIMEOUT, closing).await {
        Ok(result) => result,
        Err(_) => {
            warn!(timeout = ?STOP_TIMEOUT, "The NATS connection did not close in time; leaving it.");
            Ok(())
        }
    }
}

/// When a slow-consumer event was last logged, in seconds on
/// [`process_seconds`]'s clock (0: never).
static SLOW_CONSUMER_SAID: AtomicU64 = AtomicU64::new(0);

/// When a client last said it cannot set up TLS (process seconds).
static TLS_FAILURE_SAID: AtomicU64 = AtomicU64::new(0);

/// When a client last probed why it cannot connect (process seconds).
static TLS_IO_SAID: AtomicU64 = AtomicU64::new(0);

/// Whether a minute has passed since `last` (then set to now).
pub(crate) fn once_a_minute(last: &AtomicU64) -> bool {
    once_a_minute_at(last, process_seconds())
}

/// Seconds on a monotonic clock that reads at least 60 at its first use,
/// so that the first event is always said, and that a wall clock set back
/// cannot silence the warning until it catches up.
fn process_seconds() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
        + 60
}

/// [`once_a_minute`] at `now` seconds.
fn once_a_minute_at(last: &AtomicU64, now: u64) -> bool {
    let before = last.load(Ordering::Relaxed);
    now.saturating_sub(before) >= 60
        && last
            .compare_exchange(before, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Whether a client event means the server refused the credentials (as
/// opposed to a network hiccup or one denied request).
fn is_refusal(event: &Event) -> bool {
    let text = event.to_string().to_ascii_lowercase();
    text.contains("authorization violation") || text.contains("authentication")
}

/// Probes the TLS handshake after a failed connect, and says what it
/// found: the handshake's own failure is an ERROR (an operator must fix a
/// certificate, or give a CA), a server out of reach a WARN.
async fn say_why_tls_fails(config: std::sync::Arc<NatsConfig>, event: String) {
    match config.probe_tls().await {
        Ok(TlsProbeOutcome::Handshake) => {
            warn!(%event, "Cannot connect to NATS, though a TLS handshake with the server works: it is restarting, or refused this client for another reason (its log says which; checked at most once a minute).")
        }
        Ok(TlsProbeOutcome::NotProbed) => {
            info!(%event, "NATS client event.");
        }
        Ok(TlsProbeOutcome::NoTls) => {
            warn!(%event, "Cannot connect to NATS, though the server answers: it is restarting, or refused this client for another reason (its log says which; checked at most once a minute).")
        }
        Err(error @ TlsProbeError::Unreachable { .. }) => {
            warn!(%event, %error, "Cannot connect to NATS: the server is down or unreachable (checked at most once a minute).")
        }
        Err(error) if config.uses_tls() => {
            error!(%event, %error, "The TLS handshake with NATS fails: check --tls-ca (the CA of the server's certificate), --tls-cert and --tls-key (a certificate the server accepts, not expired) and the server's TLS settings (checked at most once a minute).")
        }
        Err(error) => {
            error!(%event, %error, "The NATS server requires TLS and the handshake with the system's root certificates fails: give --tls-ca (the CA of the server's certificate), and --tls-cert and --tls-key if the server asks for a client certificate (checked at most once a minute).")
        }
    }
}

/// Whether a client event is a failed TLS setup (reading the files).
fn is_tls_failure(event: &Event) -> bool {
    event.to_string().to_ascii_lowercase().contains("tls error")
}

/// Whether a client event is a failed connect on the socket: a server down
/// or unreachable, or a TLS handshake that failed.
fn is_io_failure(event: &Event) -> bool {
    event.to_string().to_ascii_lowercase().contains("io error")
}

/// Whether a client event is the server denying one publish or
/// subscription to this user.
fn is_denial(event: &Event) -> bool {
    event
        .to_string()
        .to_ascii_lowercase()
        .contains("permissions violation")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frequent_event_is_said_once_a_minute() {
        let last = AtomicU64::new(0);
        assert!(once_a_minute(&last));
        assert!(!once_a_minute(&last));
        let last = AtomicU64::new(0);
        assert!(once_a_minute_at(&last, 60), "the first is said");
        assert!(!once_a_minute_at(&last, 119));
        assert!(once_a_minute_at(&last, 120));
        assert!(!once_a_minute_at(&last, 150));
    }

    #[test]
    fn a_denied_request_is_told_apart_from_refused_credentials() {
        use async_nats::ServerError;
        let denied = Event::ServerError(ServerError::Other(
            "permissions violation for publish to \"$JS.API.STREAM.MSG.GET.X\"".to_owned(),
        ));
        assert!(is_denial(&denied) && !is_refusal(&denied));
        let refused = Event::ServerError(ServerError::AuthorizationViolation);
        assert!(is_refusal(&refused) && !is_denial(&refused));
        assert!(!is_refusal(&Event::Disconnected) && !is_denial(&Event::Disconnected));
    }

    #[test]
    fn a_tls_failure_is_told_apart_from_other_client_errors() {
        use async_nats::ClientError;
        let tls = Event::ClientError(ClientError::Other("TLS error".to_owned()));
        assert!(is_tls_failure(&tls) && !is_refusal(&tls));
        let io = Event::ClientError(ClientError::Other("IO error".to_owned()));
        assert!(!is_tls_failure(&io) && is_io_failure(&io));
    }

    #[tokio::test]
    async fn tls_files_that_cannot_be_used_stop_the_start_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let generated = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let ca = write("ca.pem", &generated.cert.pem());
        let key = write("key.pem", &generated.signing_key.serialize_pem());
        let not_pem = write("notes.txt", "not a certificate");
        let missing = dir.path().join("missing.pem");
        let refused =
            |tls_ca: Option<&PathBuf>, tls_cert: Option<&PathBuf>, tls_key: Option<&PathBuf>| {
                let config = NatsConfig {
                    tls_ca: tls_ca.cloned(),
                    tls_cert: tls_cert.cloned(),
                    tls_key: tls_key.cloned(),
                    ..NatsConfig::new("tls://127.0.0.1:1")
                };
                async move { config.options(false, SERVER_TIMEOUT).await.err() }
            };
        for (case, error, what, path) in [
            (
                "a missing CA",
                refused(Some(&missing), None, None).await,
                "--tls-ca",
                &missing,
            ),
            (
                "a CA file without a certificate",
                refused(Some(&not_pem), None, None).await,
                "--tls-ca",
                &not_pem,
            ),
            (
                "a certificate file without one",
                refused(Some(&ca), Some(&not_pem), Some(&key)).await,
                "--tls-cert",
                &not_pem,
            ),
            (
                "a key file without a key",
                refused(Some(&ca), Some(&ca), Some(&not_pem)).await,
                "--tls-key",
                &not_pem,
            ),
            (
                "a missing key",
                refused(None, Some(&ca), Some(&missing)).await,
                "--tls-key",
                &missing,
            ),
        ] {
            let Some(ConnectError::TlsFile {
                what: said,
                path: named,
                ..
            }) = &error
            else {
                panic!("{case}: {error:?}");
            };
            assert_eq!((*said, named), (what, path), "{case}");
            assert!(
                error
                    .unwrap()
                    .to_string()
                    .contains(&path.display().to_string()),
                "{case}"
            );
        }
        assert!(
            refused(Some(&ca), Some(&ca), Some(&key)).await.is_none(),
            "usable files refused"
        );
    }

    #[test]
    fn comma_separated_urls_are_every_node_of_a_cluster() {
        let config = NatsConfig::new("nats://10.0.0.1:4222, nats://10.0.0.2:4223,");
        let servers = config.servers().expect("valid");
        let ports: Vec<u16> = servers.iter().map(ServerAddr::port).collect();
        assert_eq!(ports, vec![4222, 4223]);
    }

    #[tokio::test]
    async fn half_a_client_certificate_is_a_clear_error() {
        for (cert, key) in [(Some("client.pem"), None), (None, Some("client-key.pem"))] {
            let config = NatsConfig {
                tls_cert: cert.map(PathBuf::from),
                tls_key: key.map(PathBuf::from),
                ..NatsConfig::new("nats://127.0.0.1:1")
            };
            let error = config
                .options(false, SERVER_TIMEOUT)
                .await
                .expect_err("refused");
            assert!(
                matches!(error, ConnectError::IncompleteClientCertificate),
                "{error}"
            );
        }
    }

    #[test]
    fn authentication_methods_are_listed_in_the_order_they_are_used() {
        let config = NatsConfig {
            token_file: Some("token".into()),
            creds_file: Some("user.creds".into()),
            user: Some("u".into()),
            ..NatsConfig::new("nats://127.0.0.1:4222")
        };
        assert_eq!(
            config.authentication_methods(),
            ["--creds", "--token-file", "--user/--password-file"]
        );
        assert!(
            NatsConfig::new("nats://127.0.0.1:4222")
                .authentication_methods()
                .is_empty()
        );
    }

    #[test]
    fn an_empty_url_is_an_error_not_a_default_server() {
        for url in ["", " ", ","] {
            let error = NatsConfig::new(url).servers().expect_err("no server");
            assert!(matches!(error, ConnectError::NoUrl), "{url:?}: {error}");
        }
    }

    #[test]
    fn an_inbox_prefix_no_reply_could_reach_is_refused() {
        for bad in [
            "",
            " ",
            "_INBOX.*",
            "_INBOX.>",
            "_INBOX..w",
            "_INBOX.",
            "my inbox",
        ] {
            assert!(
                matches!(
                    check_inbox_prefix(bad),
                    Err(ConnectError::InvalidInboxPrefix { .. })
                ),
                "{bad:?}"
            );
        }
        for good in ["_INBOX_worker", "_INBOX.wake", "acme.prod._INBOX"] {
            assert!(check_inbox_prefix(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn a_malformed_url_is_a_clear_error() {
        let error = NatsConfig::new("nats://10.0.0.1:4222,nats://host:notaport")
            .servers()
            .expect_err("invalid");
        assert!(
            error.to_string().contains("nats://host:notaport"),
            "{error}"
        );
    }
}
