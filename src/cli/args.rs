//! Argument definitions (clap derive).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Durable background delegation for AI-agent gateways, on NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "wakebus", version = wakebus::VERSION, about, args_override_self = true)]
pub(crate) struct Cli {
    /// Options every command takes.
    #[command(flatten)]
    pub(crate) global: Global,
    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub(crate) struct Global {
    /// File of global options (`nats-url = ...`, `nkey-file = ...`), one
    /// `name = value` per line; flags and environment variables win over it.
    #[arg(long, env = "WAKEBUS_CONFIG", global = true)]
    pub(crate) config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    pub(crate) nats_url: String,
    /// Subject prefix of the deployment.
    #[arg(long, env = "WAKEBUS_PREFIX", default_value = "wakebus", global = true)]
    pub(crate) prefix: String,
    /// NATS credentials file (JWT).
    #[arg(long, env = "NATS_CREDS", global = true)]
    pub(crate) creds: Option<PathBuf>,
    /// File holding an NKey seed.
    #[arg(long, env = "NATS_NKEY_FILE", global = true)]
    pub(crate) nkey_file: Option<PathBuf>,
    /// File holding a NATS token.
    #[arg(long, env = "NATS_TOKEN_FILE", global = true)]
    pub(crate) token_file: Option<PathBuf>,
    /// NATS user (with --password-file).
    #[arg(long, env = "NATS_USER", global = true)]
    pub(crate) user: Option<String>,
    /// File holding the NATS password.
    #[arg(long, env = "NATS_PASSWORD_FILE", global = true)]
    pub(crate) password_file: Option<PathBuf>,
    /// CA certificate for TLS to NATS.
    #[arg(long, env = "NATS_CA", global = true)]
    pub(crate) tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS.
    #[arg(long, env = "NATS_CERT", global = true)]
    pub(crate) tls_cert: Option<PathBuf>,
    /// Client key for mutual TLS.
    #[arg(long, env = "NATS_KEY", global = true)]
    pub(crate) tls_key: Option<PathBuf>,
    /// Subject prefix of reply inboxes (each role's NATS user may subscribe
    /// only to its own, e.g. _INBOX_worker; see deploy/nats/).
    #[arg(long, env = "NATS_INBOX_PREFIX", global = true)]
    pub(crate) inbox_prefix: Option<String>,
    /// Log format.
    #[arg(long, env = "WAKEBUS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub(crate) log_format: LogFormat,
    /// Export spans over OTLP/HTTP to this collector base URL (like
    /// OTEL_EXPORTER_OTLP_ENDPOINT, which is read when this is not given;
    /// `/v1/traces` is appended). Needs a build with the `otel` feature;
    /// others refuse it rather than run without the traces asked for.
    #[arg(long, global = true)]
    pub(crate) otlp_endpoint: Option<String>,
    /// How long events are kept (e.g. 7d, 12h) [default: 7d, for new
    /// streams]. When given, a service may lengthen an existing history to
    /// it and `init` may also shorten it; without it, an existing history
    /// keeps its age.
    #[arg(long, env = "WAKEBUS_HISTORY", value_parser = at_least_a_second, global = true)]
    pub(crate) history: Option<Duration>,
    /// A wake lock whose holder died expires after this long [default:
    /// 30s, for a new lock bucket]. Changes an existing bucket only when
    /// given, as `--history` does.
    #[arg(long, env = "WAKEBUS_SESSION_LOCK_TTL", value_parser = at_least_a_second, global = true)]
    pub(crate) session_lock_ttl: Option<Duration>,
    /// A worker or wake checks that its consumer exists every this long
    /// (plus up to as much again at random), and creates it again when it
    /// was deleted.
    #[arg(long, env = "WAKEBUS_CONSUMER_CHECK", value_parser = at_least_a_second, default_value = "6s", global = true)]
    pub(crate) consumer_check: Duration,
    /// Replicas of the streams and buckets, 1 to 5; existing ones are
    /// changed to it [default: new ones get 1 on a single server, the
    /// cluster size (at most 3) on a cluster; existing ones keep theirs].
    #[arg(long, env = "WAKEBUS_REPLICAS", value_parser = clap::value_parser!(u64).range(1..=5), global = true)]
    pub(crate) replicas: Option<u64>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for collectors.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create or update the streams, buckets and consumers (idempotent).
    ///
    /// Deletes nothing, except that a --history or --session-lock-ttl
    /// shorter than the deployment's (WAKEBUS_HISTORY and config files
    /// count) shortens it, dropping what is older at once.
    Init(InitArgs),
    /// Delegate a task. With --session it returns at once and the session is
    /// woken later; without, it runs synchronously and prints the result.
    Delegate(DelegateArgs),
    /// Cancel a delegation, or every open delegation of a session.
    Cancel(CancelArgs),
    /// Run a worker for one pool.
    Worker(WorkerArgs),
    /// Run the wake service.
    Wake(WakeArgs),
    /// Run the whole loop on this machine (starts nats-server if none answers).
    Dev(DevArgs),
    /// Read the event history (or dead letters), filtered; --follow to keep streaming.
    Events(super::events::EventsArgs),
    /// Re-drive wakes or dead-lettered tasks, or copy history elsewhere.
    Replay(super::replay::ReplayArgs),
    /// One screen about the deployment: streams and buckets (with their
    /// replicas on a cluster), consumers, dead letters, live instances,
    /// oldest undelivered wakes.
    Status(super::status::StatusArgs),
    /// Ask a worker or wake service on this machine whether it is ready
    /// (its /readyz), for a container health check: exit 0 if it is, 1 if
    /// not or if it does not answer. Needs no NATS.
    Ready(super::ops::ReadyArgs),
}

/// `wakebus init`.
#[derive(Debug, Args)]
pub(crate) struct InitArgs {
    /// Pools whose worker consumers to create; repeat for several (given,
    /// they replace `default`).
    #[arg(long = "pool", default_value = "default")]
    pub(crate) pools: Vec<String>,
    /// Give up, exit 1 and name the likely causes when NATS, its JetStream
    /// leader or the permission to create streams, consumers and buckets
    /// is still missing after this long (the warnings before say which
    /// error kept coming back); long enough for a cluster started with it
    /// to elect its leaders.
    #[arg(long, value_parser = positive_duration, default_value = "2m")]
    pub(crate) timeout: Duration,
    /// A byte limit for the streams and buckets: `SIZE` for every part, or
    /// `PART=SIZE` for one of tasks, events, dead-letters, wake-ledger,
    /// cancels, session-locks (e.g. `--max-bytes 256MiB --max-bytes
    /// events=8GiB`); repeat for several. SIZE has a unit: MiB and GiB
    /// are 1024-based, MB and GB 1000-based; at least 1 MiB. Set on new
    /// and existing ones; init stops, changing nothing, if one already
    /// holds more than asked. A part given none keeps its own (none, when
    /// new). NATS accounts that require limits (max_bytes_required, as
    /// hosted NATS) refuse streams without one.
    #[arg(long = "max-bytes", value_name = "[PART=]SIZE", value_parser = max_bytes_value)]
    pub(crate) max_bytes: Vec<String>,
}

/// A `--max-bytes` value, checked.
fn max_bytes_value(value: &str) -> Result<String, String> {
    wakebus::bus::MaxBytes::default().add(value)?;
    Ok(value.to_owned())
}

/// `wakebus delegate`.
#[derive(Debug, Args)]
pub(crate) struct DelegateArgs {
    /// What the subagent should achieve (one task).
    #[arg(long, conflicts_with = "tasks")]
    pub(crate) goal: Option<String>,
    /// A task of a batch; repeat for several. Without --goal or --task, a
    /// JSON array of goals (strings or {"goal", "context"} objects) is read
    /// from stdin.
    #[arg(long = "task")]
    pub(crate) tasks: Vec<String>,
    /// Background for the subagent(s).
    #[arg(long, default_value = "")]
    pub(crate) context: String,
    /// Wake the session once per task instead of once for the whole batch.
    #[arg(long)]
    pub(crate) independent: bool,
    /// In a batch, send an early notice when a task fails while others run.
    #[arg(long)]
    pub(crate) notify_early_failure: bool,
    /// Largest batch accepted.
    #[arg(long, env = "WAKEBUS_MAX_BATCH", value_parser = at_least_one::<usize>, default_value_t = wakebus::delegate::DEFAULT_MAX_BATCH)]
    pub(crate) max_batch: usize,
    /// The session to wake with the result (omit to run synchronously).
    /// Deliberately not read from WAKEBUS_ORIGIN_SESSION: a subagent's own
    /// delegations must not wake its parent's session by accident.
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Deepest subagent nesting accepted (1: subagents cannot delegate).
    #[arg(long, env = "WAKEBUS_MAX_DEPTH", value_parser = at_least_one::<u32>, default_value_t = wakebus::protocol::DEFAULT_MAX_DEPTH)]
    pub(crate) max_depth: u32,
    /// The pool to run on.
    #[arg(long, default_value = "default")]
    pub(crate) pool: String,
    /// Model preference for the subagent.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// The subagent's role.
    #[arg(long, value_enum, default_value_t = RoleArg::Leaf)]
    pub(crate) role: RoleArg,
    /// A tool set the subagent may use; repeat for several.
    #[arg(long = "toolset")]
    pub(crate) toolsets: Vec<String>,
    /// A JSON Schema every answer must satisfy: inline JSON, or @FILE.
    #[arg(long)]
    pub(crate) output_schema: Option<String>,
    /// Per-task time limit, in seconds.
    #[arg(long, value_parser = at_least_one::<u64>)]
    pub(crate) timeout_seconds: Option<u64>,
    /// Also wait for the completion in background mode and print it.
    #[arg(long)]
    pub(crate) wait: bool,
    /// The delegation's id (a new one by default). Give the id from a
    /// failed call's "was not fully stored" error to store the rest of that
    /// delegation without running any of its tasks twice.
    #[arg(long)]
    pub(crate) delegation_id: Option<String>,
    /// W3C trace context of the caller: the delegation's spans and events
    /// join this trace (a new one is started when absent).
    #[arg(long, env = "TRACEPARENT")]
    pub(crate) traceparent: Option<String>,
    /// Give up waiting (sync mode or --wait) after this long, e.g. 10m.
    #[arg(long, value_parser = positive_duration)]
    pub(crate) wait_timeout: Option<Duration>,
    /// Size limits checked before publishing.
    #[command(flatten)]
    pub(crate) limits: LimitArgs,
    /// How long to wait for NATS.
    #[command(flatten)]
    pub(crate) patience: PatienceArgs,
}

/// How long a command called by a gateway (`delegate`, `cancel`) keeps
/// trying to reach NATS.
#[derive(Debug, Args)]
pub(crate) struct PatienceArgs {
    /// Keep trying to reach NATS this long before failing: long enough to
    /// ride out a NATS restart, shorter than the caller's own timeout. 0s
    /// makes one attempt (of at most 2 s per server).
    #[arg(long, env = "WAKEBUS_CONNECT_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub(crate) connect_timeout: Duration,
}

/// Size limits on requests (the worker refuses larger ones with an `error`
/// completion; the delegate command refuses to send them).
#[derive(Debug, Args)]
pub(crate) struct LimitArgs {
    /// Largest request body, in bytes.
    #[arg(long, env = "WAKEBUS_MAX_REQUEST_BYTES", value_parser = at_least_one::<usize>, default_value_t = wakebus::protocol::DEFAULT_MAX_REQUEST_BYTES)]
    pub(crate) max_request_bytes: usize,
    /// Largest goal, in bytes.
    #[arg(long, env = "WAKEBUS_MAX_GOAL_BYTES", value_parser = at_least_one::<usize>, default_value_t = wakebus::protocol::DEFAULT_MAX_GOAL_BYTES)]
    pub(crate) max_goal_bytes: usize,
    /// Largest context, in bytes.
    #[arg(long, env = "WAKEBUS_MAX_CONTEXT_BYTES", value_parser = at_least_one::<usize>, default_value_t = wakebus::protocol::DEFAULT_MAX_CONTEXT_BYTES)]
    pub(crate) max_context_bytes: usize,
}

impl LimitArgs {
    /// The library's limits.
    pub(crate) fn limits(&self) -> wakebus::protocol::Limits {
        wakebus::protocol::Limits {
            max_request_bytes: self.max_request_bytes,
            max_goal_bytes: self.max_goal_bytes,
            max_context_bytes: self.max_context_bytes,
        }
    }
}

/// `wakebus cancel`.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("target").required(true).args(["delegation_id", "session"]))]
pub(crate) struct CancelArgs {
    /// The delegation to cancel.
    pub(crate) delegation_id: Option<String>,
    /// Cancel every delegation of this session requested before now.
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Do not wake the session with the interrupted results.
    #[arg(long)]
    pub(crate) silent: bool,
    /// How long to wait for NATS.
    #[command(flatten)]
    pub(crate) patience: PatienceArgs,
}

/// `wakebus worker`.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// The pool to serve.
    #[arg(long, env = "WAKEBUS_POOL", default_value = "default")]
    pub(crate) pool: String,
    /// Tasks run at once.
    #[arg(long, env = "WAKEBUS_CONCURRENCY", value_parser = at_least_one::<usize>, default_value_t = 16)]
    pub(crate) concurrency: usize,
    /// What runs the tasks. Required: a worker that guessed `echo` would
    /// complete real tasks with their goal echoed back.
    #[arg(long, value_enum, env = "WAKEBUS_EXECUTOR")]
    pub(crate) executor: ExecutorKind,
    /// AckWait: how soon a dead worker's task goes to another worker (at
    /// least 1s: a running task is kept with an in-progress ack every third
    /// of it, at most every 100 ms).
    #[arg(long, value_parser = at_least_a_second, default_value = "30s")]
    pub(crate) ack_wait: Duration,
    /// Deliveries before a task ends as failed and is dead-lettered.
    #[arg(long, default_value_t = 5, value_parser = at_least_one::<u64>)]
    pub(crate) max_deliver: u64,
    /// First delay before a task that failed transiently (an LLM endpoint
    /// answering 429 or 5xx, a program that could not start) is delivered
    /// again; it doubles with each delivery up to `--retry-max`, and a
    /// Retry-After may ask for longer. With `--max-deliver 5`, the defaults
    /// give a task about 15 s of retries: raise this for endpoints whose
    /// outages last longer.
    #[arg(long, value_parser = positive_duration, default_value = "1s")]
    pub(crate) retry_min: Duration,
    /// Longest delay before a task that failed transiently is delivered
    /// again.
    #[arg(long, value_parser = positive_duration, default_value = "60s")]
    pub(crate) retry_max: Duration,
    /// Time limit for tasks whose request sets none (default: none).
    #[arg(long, value_parser = positive_duration)]
    pub(crate) task_timeout: Option<Duration>,
    /// Deepest subagent nesting this worker runs; deeper requests end in `error`.
    #[arg(long, env = "WAKEBUS_MAX_DEPTH", value_parser = at_least_one::<u32>, default_value_t = wakebus::protocol::DEFAULT_MAX_DEPTH)]
    pub(crate) max_depth: u32,
    /// How long running tasks may finish after SIGTERM.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub(crate) shutdown_grace: Duration,
    /// Write a task's `started` event once it has run this long (or at its
    /// first progress report); quicker tasks go from `submitted` to `done`
    /// with one write fewer. `0s` writes it as every run begins.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub(crate) started_after: Duration,
    /// LLM executor: base URL including the version, e.g. https://api.openai.com/v1.
    #[arg(long, env = "WAKEBUS_LLM_BASE_URL")]
    pub(crate) llm_base_url: Option<String>,
    /// LLM executor: model used when a request names none.
    #[arg(long, env = "WAKEBUS_LLM_MODEL")]
    pub(crate) llm_model: Option<String>,
    /// LLM executor: file holding the API key (or set WAKEBUS_LLM_API_KEY).
    #[arg(long, env = "WAKEBUS_LLM_API_KEY_FILE")]
    pub(crate) llm_api_key_file: Option<PathBuf>,
    /// LLM executor: limit for one model call.
    #[arg(long, value_parser = positive_duration, default_value = "5m")]
    pub(crate) llm_timeout: Duration,
    /// Size limits on requests.
    #[command(flatten)]
    pub(crate) limits: LimitArgs,
    /// Working directory of the command executor.
    #[arg(long)]
    pub(crate) workdir: Option<PathBuf>,
    /// The program and arguments of the command executor (after `--`).
    #[arg(last = true)]
    pub(crate) command: Vec<String>,
    /// Metrics and health endpoints.
    #[command(flatten)]
    pub(crate) ops: super::ops::OpsArgs,
}

/// Subagent roles.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum RoleArg {
    /// Does the task itself.
    Leaf,
    /// May plan and delegate (within the depth limit).
    Orchestrator,
}

/// Executors.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ExecutorKind {
    /// Complete at once with the goal echoed.
    Echo,
    /// Run a program per task, request JSON on stdin.
    Command,
    /// Ask an OpenAI-compatible chat-completions endpoint.
    Llm,
}

/// `wakebus wake`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["api_url", "webhook_url"])))]
pub(crate) struct WakeArgs {
    /// Base URL of the session API, without /v1 (Hermes:
    /// http://127.0.0.1:8642); required unless --webhook-url is given.
    #[arg(long, env = "WAKEBUS_API_URL")]
    pub(crate) api_url: Option<String>,
    /// Instead of Hermes: post each wake to this URL as a signed webhook
    /// (Standard Webhooks).
    #[arg(long, env = "WAKEBUS_WEBHOOK_URL")]
    pub(crate) webhook_url: Option<String>,
    /// File holding webhook signing secrets (`whsec_...`), one per line;
    /// repeat the flag (or separate files with commas) or add lines during
    /// a key rotation: each secret signs every post. Only with
    /// --webhook-url.
    #[arg(
        long = "webhook-secret-file",
        env = "WAKEBUS_WEBHOOK_SECRET_FILE",
        value_delimiter = ',',
        requires = "webhook_url",
        conflicts_with = "api_url"
    )]
    pub(crate) webhook_secret_files: Vec<PathBuf>,
    /// Allow plain http:// to hosts other than this machine (turns, API
    /// keys and signatures then cross the network unencrypted). In the
    /// environment: true/false, 1/0, yes/no, on/off.
    #[arg(long, env = "WAKEBUS_ALLOW_INSECURE_HTTP", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub(crate) allow_insecure_http: bool,
    /// Allow plain http:// to these hosts only (comma-separated or
    /// repeated), e.g. `host.docker.internal` for an API on the Docker
    /// host: a URL changed to point elsewhere is then still refused.
    #[arg(
        long = "allow-insecure-http-host",
        env = "WAKEBUS_ALLOW_INSECURE_HTTP_HOSTS",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    pub(crate) allow_insecure_http_hosts: Vec<String>,
    /// A CA certificate (PEM) to trust besides the system's, for a session
    /// API or webhook endpoint whose certificate a private CA signed.
    #[arg(long, env = "WAKEBUS_API_CA")]
    pub(crate) api_ca: Option<PathBuf>,
    /// File holding the API key (sent as a bearer token).
    #[arg(long, env = "WAKEBUS_API_KEY_FILE")]
    pub(crate) api_key_file: Option<PathBuf>,
    /// The `model` field of posted turns.
    #[arg(long, env = "WAKEBUS_MODEL", default_value = "hermes-agent")]
    pub(crate) model: String,
    /// Timeout of one post.
    #[arg(long, value_parser = positive_duration, default_value = "30s")]
    pub(crate) request_timeout: Duration,
    /// Completions for one session within this window become one turn.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms")]
    pub(crate) coalesce_window: Duration,
    /// How long a session's lock is kept after its turn for the session's
    /// next completion (0s: release at once).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "250ms")]
    pub(crate) lock_linger: Duration,
    /// AckWait of the wake consumer (at least 1s: held completions are
    /// kept with an in-progress ack every third of it, at most every 100 ms).
    #[arg(long, value_parser = at_least_a_second, default_value = "30s")]
    pub(crate) ack_wait: Duration,
    /// Most completions held unacknowledged at once, across every wake
    /// instance (the consumer's MaxAckPending): a larger backlog waits in
    /// JetStream, not in the wake's memory.
    #[arg(long, default_value_t = wakebus::wake::DEFAULT_MAX_IN_FLIGHT, value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) max_in_flight: i64,
    /// First delay before re-posting a failed wake (at most half of
    /// `--retry-max`); it doubles up to half of `--retry-max`, and jitter
    /// adds up to as much again to each wait.
    #[arg(long, value_parser = positive_duration, default_value = "500ms")]
    pub(crate) retry_min: Duration,
    /// Longest delay between wake posts, jitter included (a Retry-After may
    /// ask for longer).
    #[arg(long, value_parser = positive_duration, default_value = "30s")]
    pub(crate) retry_max: Duration,
    /// How long 409 Conflict answers in a row are retried before the wake
    /// is dead-lettered: an API honouring Idempotency-Key answers 409
    /// while the turn under the key still runs (a post given up after
    /// `--request-timeout`), so make it longer than the longest turn
    /// [default: 10m, or twice `--request-timeout` if that is longer].
    #[arg(long, value_parser = positive_duration)]
    pub(crate) conflict_patience: Option<Duration>,
    /// Act on a completion only if its delegator's `submitted` record exists
    /// and names the same origin session; dead-letter it otherwise (a
    /// forged completion). Needs every publisher of tasks to write the
    /// records (`wakebus delegate` and the library do). In the
    /// environment: true/false, 1/0, yes/no, on/off.
    #[arg(long, env = "WAKEBUS_VERIFY_ORIGIN", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub(crate) verify_origin: bool,
    /// Metrics and health endpoints.
    #[command(flatten)]
    pub(crate) ops: super::ops::OpsArgs,
}

/// `wakebus dev`.
#[derive(Debug, Args)]
pub(crate) struct DevArgs {
    /// Submit a few delegations, show them woken, then exit.
    #[arg(long)]
    pub(crate) demo: bool,
    /// The nats-server binary to start if none answers.
    #[arg(long, env = "WAKEBUS_NATS_SERVER", default_value = "nats-server")]
    pub(crate) nats_server: PathBuf,
    /// Config for a started nats-server.
    #[arg(long, default_value = "nats.conf")]
    pub(crate) nats_conf: PathBuf,
    /// Store directory for a started nats-server.
    #[arg(long, default_value = ".wakebus/data")]
    pub(crate) data_dir: PathBuf,
    /// Where the built-in session endpoint listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) session_addr: SocketAddr,
}

/// A count that must be 1 or more: 0 would refuse or give up every task.
fn at_least_one<T>(text: &str) -> Result<T, String>
where
    T: std::str::FromStr + From<u8> + PartialOrd,
    T::Err: std::fmt::Display,
{
    let value: T = text
        .trim()
        .parse()
        .map_err(|error: T::Err| error.to_string())?;
    if value < T::from(1) {
        return Err("must be at least 1".to_owned());
    }
    Ok(value)
}

/// At least a second: the server refuses a max age under 100 ms, a lock
/// refreshed every third of a shorter TTL is a stream of writes, an
/// AckWait that short cannot be kept with in-progress acks (sent at most
/// every 100 ms), and a consumer checked more often floods the server.
fn at_least_a_second(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(duration) if duration < Duration::from_secs(1) => Err("must be at least 1s".to_owned()),
        Ok(duration) => Ok(duration),
        Err(error) => Err(error.to_string()),
    }
}

/// A duration like `humantime` reads it, more than zero (a zero interval
/// would make a loop of what should be a wait, a zero timeout a failure).
pub(super) fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(duration) if duration.is_zero() => Err("must be more than 0".to_owned()),
        Ok(duration) => Ok(duration),
        Err(error) => Err(error.to_string()),
    }
}
