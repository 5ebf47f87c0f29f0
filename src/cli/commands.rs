//! One function per subcommand; each builds library configs and calls `run`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use wakebus::bus::{AgeChange, Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::delegate::{DelegateError, Delegation, Delegator};
use wakebus::ops::http::Probe;
use wakebus::protocol::{Subjects, bounded};
use wakebus::wake::session_api::{HttpSecurity, PostShape, SessionApiConfig};
use wakebus::wake::webhook::WebhookSecret;
use wakebus::wake::{self, WakeConfig};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, EchoExecutor, Executor, TaskEnv};
use wakebus::worker::{self, WorkerConfig};

use super::args::{Cli, Command, ExecutorKind, Global, WorkerArgs};
use super::service_shutdown;

/// `delegate`'s exit status when the delegation was stored, wholly or in
/// part, and the call failed after that (not every request confirmed, or
/// the wait for its completions): it runs. Delegating it again is safe
/// only with the same `--delegation-id`. Any other failure (1, or 2 for
/// a command line refused as it was parsed) stored nothing.
const STORED: u8 = 4;

pub(crate) async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let global = cli.global;
    match cli.command {
        Command::Events(args) => return super::events::run(&global, args).await,
        Command::Replay(args) => return super::replay::run(&global, args).await,
        Command::Status(args) => return super::status::run(&global, args).await,
        Command::Ready(args) => return super::ops::ready(args).await,
        Command::Dev(args) => {
            wakebus::dev::run(
                wakebus::dev::DevConfig {
                    nats_url: global.nats_url,
                    prefix: global.prefix,
                    nats_server: args.nats_server,
                    nats_conf: args.nats_conf,
                    data_dir: args.data_dir,
                    session_addr: args.session_addr,
                    demo: args.demo,
                },
                // Not service_shutdown(): a second Ctrl-C exits at once, and
                // the nats-server dev started, in a process group of its
                // own, would be left running. Dev mode bounds its own stop.
                super::shutdown_signal(),
            )
            .await?;
        }
        Command::Init(args) => {
            // Bad input fails at once, not after waiting for NATS.
            for pool in &args.pools {
                wakebus::protocol::validate_pool(pool)
                    .with_context(|| format!("--pool {pool:?}"))?;
            }
            let mut max_bytes = wakebus::bus::MaxBytes::default();
            for value in &args.max_bytes {
                max_bytes
                    .add(value)
                    .map_err(|error| anyhow::anyhow!("--max-bytes {value:?}: {error}"))?;
            }
            let run = init(&global, &args.pools, max_bytes);
            let Ok(done) = tokio::time::timeout(args.timeout, run).await else {
                bail!(
                    "init did not finish within {}: NATS is not reachable, has no JetStream leader yet, has fewer JetStream servers up than --replicas asks for (or less free storage than --max-bytes asks for), or this NATS user may not create streams, consumers and buckets (init needs the operator's permissions); the warnings above name the error that kept coming back",
                    humantime::format_duration(args.timeout)
                );
            };
            done?;
            println!(
                "{}",
                serde_json::json!({"status": "ok", "prefix": global.prefix})
            );
        }
        Command::Delegate(args) => {
            let mut delegation = Delegation::default().pool(&args.pool);
            delegation.tasks = tasks_from(&args)?;
            for task in delegation.tasks.iter_mut().filter(|t| t.context.is_empty()) {
                task.context.clone_from(&args.context);
            }
            if args.independent {
                delegation.wake_mode = wakebus::protocol::WakeMode::Independent;
            }
            delegation.notify_early_failure = args.notify_early_failure;
            delegation.origin_session_id = args.session;
            delegation.model = args.model.clone();
            delegation.role = match args.role {
                super::args::RoleArg::Leaf => wakebus::protocol::Role::Leaf,
                super::args::RoleArg::Orchestrator => wakebus::protocol::Role::Orchestrator,
            };
            delegation.toolsets = args.toolsets.clone();
            delegation.output_schema = match &args.output_schema {
                Some(text) => Some(read_json_arg(text).context("--output-schema")?),
                None => None,
            };
            delegation.timeout_seconds = args.timeout_seconds;
            delegation.wait = args.wait;
            delegation.delegation_id = args.delegation_id;
            delegation.traceparent = match args.traceparent.as_deref() {
                Some(value) => match wakebus::protocol::TraceParent::parse(value) {
                    Some(parent) => Some(parent),
                    // Inherited, not typed: like one in a message header,
                    // it starts a new trace rather than refuse the work.
                    None if std::env::var("TRACEPARENT").is_ok_and(|env| env == value) => {
                        tracing::warn!(traceparent = %bounded(value, 100), "TRACEPARENT is not a W3C traceparent; starting a new trace.");
                        None
                    }
                    None => bail!("--traceparent {value:?} is not a W3C traceparent"),
                },
                None => None,
            };
            inherit_from_parent_task(&mut delegation)?;
            // Connected only once the arguments are checked: with NATS
            // away, a mistake in them is reported at once, not as `cannot
            // connect` after the connect timeout (a gateway would retry
            // what can never work).
            let limits = args.limits.limits();
            wakebus::delegate::check(&delegation, args.max_batch, args.max_depth, &limits)?;
            let patience = args.patience.connect_timeout;
            let bus = connect_within(&global, "wakebus-delegate", patience).await?;
            // A caller waiting for the result of a pool nothing serves
            // would wait for ever without a word.
            let waits = delegation.wait || delegation.origin_session_id.is_none();
            let unserved =
                waits.then(|| tokio::spawn(warn_if_unserved(bus.clone(), delegation.pool.clone())));
            let delegator = Delegator::new(bus)
                .with_wait_timeout(args.wait_timeout)
                .with_max_depth(args.max_depth)
                .with_max_batch(args.max_batch)
                .with_limits(limits);
            let result = delegator.delegate(delegation).await;
            if let Some(unserved) = unserved {
                unserved.abort();
            }
            let result = match result {
                Ok(result) => result,
                // Stored, wholly or in part: a caller that delegates again
                // on any failure must know not to, or only under this id.
                Err(
                    error @ (DelegateError::NotStored { .. }
                    | DelegateError::Wait { .. }
                    | DelegateError::WaitTimeout { .. }),
                ) => {
                    eprintln!("error: {error}");
                    return Ok(ExitCode::from(STORED));
                }
                Err(error) => return Err(error.into()),
            };
            println!("{}", serde_json::to_string(&result)?);
        }
        Command::Cancel(args) => {
            // Checked before connecting, as `delegate`'s arguments are.
            if let Some(id) = &args.delegation_id {
                wakebus::protocol::validate_delegation_id(id)
                    .with_context(|| format!("delegation id {:?}", bounded(id, 100)))?;
            }
            if let Some(session) = &args.session {
                wakebus::protocol::validate_session_id(session)
                    .with_context(|| format!("--session {:?}", bounded(session, 100)))?;
            }
            let patience = args.patience.connect_timeout;
            let bus = connect_within(&global, "wakebus-cancel", patience).await?;
            let canceller = wakebus::cancel::Canceller::new(bus);
            let report = match (&args.delegation_id, &args.session) {
                (Some(id), _) => canceller.cancel_delegation(id, args.silent).await?,
                (None, Some(session)) => canceller.cancel_session(session, args.silent).await?,
                (None, None) => bail!("give a delegation id or --session"),
            };
            println!("{}", serde_json::to_string(&report)?);
        }
        Command::Worker(args) => {
            // A program given to another executor would be ignored, and
            // every real task answered by that executor instead.
            if !matches!(args.executor, ExecutorKind::Command)
                && (!args.command.is_empty() || args.workdir.is_some())
            {
                let executor = clap::ValueEnum::to_possible_value(&args.executor)
                    .map(|value| value.get_name().to_owned())
                    .unwrap_or_default();
                bail!(
                    "a task program (after --) or --workdir is given, but the executor is {executor}: use --executor command to run the program, or leave them out"
                );
            }
            if args.retry_min > args.retry_max {
                bail!(
                    "--retry-min ({}) is above --retry-max ({}): the first retry's delay would be cut to the longest",
                    humantime::format_duration(args.retry_min),
                    humantime::format_duration(args.retry_max)
                );
            }
            let executor = match args.executor {
                ExecutorKind::Echo => Executor::Echo(EchoExecutor),
                ExecutorKind::Command => {
                    let Some((program, rest)) = args.command.split_first() else {
                        bail!(
                            "--executor command needs a program: wakebus worker --executor command -- PROGRAM ARGS..."
                        );
                    };
                    let mut config = CommandConfig::new(program, rest.to_vec());
                    config.working_dir = args.workdir.clone();
                    config.check()?;
                    Executor::Command(CommandExecutor::new(config))
                }
                ExecutorKind::Llm => Executor::Llm(llm_executor(&args)?),
            };
            wakebus::protocol::validate_pool(&args.pool)
                .with_context(|| format!("--pool {:?}", bounded(&args.pool, 100)))?;
            let bus = connect(&global, "wakebus-worker").await?;
            let config = worker_config(&args);
            let probe = Probe::worker(&bus, &args.pool, config.started.clone());
            let _ops = super::ops::start(&args.ops, probe).await?;
            let env = TaskEnv {
                nats_url: global.nats_url.clone(),
                prefix: global.prefix.clone(),
                pool: args.pool,
            };
            let client = bus.client.clone();
            worker::run(
                bus,
                settings(&global),
                executor,
                env,
                config,
                service_shutdown(),
            )
            .await?;
            close_after_stop(&client).await;
        }
        Command::Wake(args) => {
            let api_key = match &args.api_key_file {
                Some(path) => Some(read_key_file(path, "the API key")?),
                None => None,
            };
            let (base_url, shape) = match (args.api_url, args.webhook_url) {
                (_, Some(url)) => (
                    url,
                    PostShape::Webhook {
                        secrets: webhook_secrets(&args.webhook_secret_files)?,
                    },
                ),
                (Some(url), None) => (url, PostShape::Hermes),
                (None, None) => bail!("either --api-url or --webhook-url is needed"),
            };
            let bus = connect(&global, "wakebus-wake").await?;
            let mut config = WakeConfig::new(SessionApiConfig {
                base_url,
                api_key,
                model: args.model,
                request_timeout: args.request_timeout,
            });
            let _ops =
                super::ops::start(&args.ops, Probe::wake(&bus, config.started.clone())).await?;
            config.shape = shape;
            config.http = HttpSecurity {
                allow_insecure_http: args.allow_insecure_http,
                insecure_http_hosts: args.allow_insecure_http_hosts,
                extra_ca: args.api_ca,
            };
            config.coalesce_window = args.coalesce_window;
            config.lock_linger = args.lock_linger;
            config.ack_wait = args.ack_wait;
            config.max_in_flight = args.max_in_flight;
            config.retry_min = args.retry_min;
            config.retry_max = args.retry_max;
            // A deployment that raised --request-timeout for long turns
            // keeps at least the two request timeouts of patience it had.
            config.conflict_patience = args
                .conflict_patience
                .unwrap_or(wakebus::wake::DEFAULT_CONFLICT_PATIENCE.max(2 * args.request_timeout));
            config.verify_origin = args.verify_origin;
            let client = bus.client.clone();
            wake::run(bus, settings(&global), config, service_shutdown()).await?;
            close_after_stop(&client).await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The worker's settings from its flags.
fn worker_config(args: &WorkerArgs) -> WorkerConfig {
    let mut config = WorkerConfig::new(&args.pool);
    config.concurrency = args.concurrency;
    config.ack_wait = args.ack_wait;
    config.max_deliver = args.max_deliver;
    config.retry_base = args.retry_min;
    config.retry_max = args.retry_max;
    config.default_timeout = args.task_timeout;
    config.shutdown_grace = args.shutdown_grace;
    config.started_after = args.started_after;
    config.max_depth = args.max_depth;
    config.limits = args.limits.limits();
    config
}

/// Closes a stopped service's connection. The service has stopped cleanly
/// (its work acknowledged or handed back, and flushed): a close that fails
/// (the connection's task already ended) is worth a warning, not an exit
/// status that a supervisor would take for a crash.
async fn close_after_stop(client: &async_nats::Client) {
    if let Err(error) = wakebus::connect::close(client).await {
        tracing::warn!(%error, "Could not close the NATS connection cleanly after the service stopped.");
    }
}

/// `what` (an API key) from the file at `path`, trimmed. An empty file is
/// refused: its key would be sent as an empty bearer token, and every call
/// refused (each wake dead-lettered, each task failed).
fn read_key_file(path: &std::path::Path, what: &str) -> anyhow::Result<String> {
    let key = std::fs::read_to_string(path)
        .with_context(|| format!("reading {what} from {}", path.display()))?
        .trim()
        .to_owned();
    if key.is_empty() {
        bail!(
            "{} is empty: put {what} in it, or leave the option out if the endpoint needs none",
            path.display()
        );
    }
    Ok(key)
}

/// Inline JSON, or the JSON in a file given as `@PATH`.
fn read_json_arg(text: &str) -> anyhow::Result<serde_json::Value> {
    let json = match text.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
        None => text.to_owned(),
    };
    serde_json::from_str(&json).context("not valid JSON")
}

/// The `llm` executor from flags, environment or a key file.
fn llm_executor(
    args: &super::args::WorkerArgs,
) -> anyhow::Result<wakebus::worker::executor::LlmExecutor> {
    use wakebus::worker::executor::{LlmConfig, LlmExecutor};
    let Some(base_url) = args.llm_base_url.clone() else {
        bail!("--executor llm needs --llm-base-url (or WAKEBUS_LLM_BASE_URL)");
    };
    let Some(model) = args.llm_model.clone() else {
        bail!("--executor llm needs --llm-model (or WAKEBUS_LLM_MODEL)");
    };
    let api_key = match &args.llm_api_key_file {
        Some(path) => Some(read_key_file(path, "the LLM API key")?),
        // Set but empty (`${VAR:-}` in a compose file) is as good as unset.
        None => std::env::var("WAKEBUS_LLM_API_KEY")
            .ok()
            .filter(|key| !key.trim().is_empty()),
    };
    Ok(LlmExecutor::new(&LlmConfig {
        base_url,
        model,
        api_key,
        request_timeout: args.llm_timeout,
    })?)
}

/// The tasks of `wakebus delegate`: --goal, --task..., or a JSON array on stdin.
fn tasks_from(
    args: &super::args::DelegateArgs,
) -> anyhow::Result<Vec<wakebus::delegate::TaskSpec>> {
    use std::io::{IsTerminal, Read};
    use wakebus::delegate::TaskSpec;
    let spec = |goal: &String| TaskSpec {
        goal: goal.clone(),
        context: String::new(),
    };
    if let Some(goal) = &args.goal {
        return Ok(vec![spec(goal)]);
    }
    if !args.tasks.is_empty() {
        return Ok(args.tasks.iter().map(spec).collect());
    }
    if std::io::stdin().is_terminal() {
        bail!("give --goal, one or more --task, or a JSON array of tasks on stdin");
    }
    /// One task as read from stdin.
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Item {
        /// Just a goal.
        Goal(String),
        /// A goal with its own context.
        Task {
            /// The goal.
            goal: String,
            /// The context.
            #[serde(default)]
            context: String,
        },
    }
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading tasks from stdin")?;
    let items: Vec<Item> = serde_json::from_str(&input).context(
        "stdin must be a JSON array of goals (strings) or {\"goal\", \"context\"} objects",
    )?;
    Ok(items
        .into_iter()
        .map(|item| match item {
            Item::Goal(goal) => TaskSpec {
                goal,
                context: String::new(),
            },
            Item::Task { goal, context } => TaskSpec { goal, context },
        })
        .collect())
}

/// How long a waiting `delegate` waits before it checks that its pool is
/// served: most answers come sooner, and need no check.
const UNSERVED_CHECK_AFTER: Duration = Duration::from_secs(2);

/// Warns when the pool a caller waits on has no consumer or no worker
/// using it: its request waits until a worker of the pool starts.
async fn warn_if_unserved(bus: Bus, pool: String) {
    use wakebus::status::PoolService;
    tokio::time::sleep(UNSERVED_CHECK_AFTER).await;
    match wakebus::status::pool_service(&bus, &pool, Duration::from_secs(1)).await {
        Ok(PoolService::Served) => tracing::debug!(%pool, "The pool is served."),
        Ok(PoolService::NoConsumer) => {
            tracing::warn!(%pool, "No worker has ever served this pool (it has no consumer): the request waits until one starts; a mistyped --pool?");
        }
        Ok(PoolService::NoWorker) => {
            tracing::warn!(%pool, "No worker of this pool is pulling tasks or running one: the request waits until one starts (`wakebus status` shows the pools).");
        }
        Ok(PoolService::Busy { in_hand }) => {
            tracing::warn!(%pool, in_hand, "No worker of this pool is pulling tasks: all are busy, or stopped with tasks in hand; the request waits its turn (`wakebus status` shows the live workers).");
        }
        // A delegating user may not read consumers; nothing to say then.
        Err(error) => tracing::debug!(%error, "Could not check that the pool is served."),
    }
}

/// A service's settings: a value it was given may lengthen what the
/// deployment keeps, a default changes nothing.
fn settings(global: &Global) -> BusSettings {
    let given = |value: Option<Duration>| value.map_or(AgeChange::Keep, |_| AgeChange::Lengthen);
    BusSettings {
        history_change: given(global.history),
        session_lock_ttl_change: given(global.session_lock_ttl),
        history_max_age: global
            .history
            .unwrap_or_else(wakebus::bus::default_history_max_age),
        replicas: global.replicas.map(|replicas| replicas as usize),
        session_lock_ttl: global
            .session_lock_ttl
            .unwrap_or_else(wakebus::bus::default_session_lock_ttl),
        consumer_check: global.consumer_check,
        wait_for_byte_limits: true,
        ..BusSettings::default()
    }
}

/// `wakebus init`: the streams, buckets and consumers of `pools`, with
/// the operator's settings, retried while that may pass.
async fn init(
    global: &Global,
    pools: &[String],
    max_bytes: wakebus::bus::MaxBytes,
) -> anyhow::Result<()> {
    let window = BusSettings::default().duplicate_window;
    if let Some(history) = global.history.filter(|history| *history < window) {
        tracing::warn!(?history, duplicate_window = ?window, "A history shorter than the duplicate window shortens the events stream's window to it: a completion published again after that long is stored again, and the records that keep a task from running twice or a completion from waking twice (its completion, its ledger entry) are gone with the history (docs/GUARANTEES.md, \"The duplicate window is finite\").");
    }
    let bus = connect(global, "wakebus-init").await?;
    // The operator's word: init may shorten what streams keep to what it
    // was given, and changes nothing for a default.
    let given = |value: Option<Duration>| value.map_or(AgeChange::Keep, |_| AgeChange::Set);
    let settings = BusSettings {
        history_change: given(global.history),
        session_lock_ttl_change: given(global.session_lock_ttl),
        require_update: true,
        wait_for_byte_limits: false,
        max_bytes,
        ..settings(global)
    };
    bus.check_max_bytes(&settings).await?;
    bus.provision(&settings).await?;
    bus.provision_wake_state(&settings).await?;
    bus.init_consumers(pools).await?;
    Ok(())
}

/// Connects a service, or `init`: they wait for NATS to come up.
pub(crate) async fn connect(global: &Global, name: &str) -> anyhow::Result<Bus> {
    connect_with(global, name, None).await
}

/// Connects a command run by hand or by a gateway: it fails, naming the
/// URL, when no NATS server answers within `patience`.
pub(crate) async fn connect_within(
    global: &Global,
    name: &str,
    patience: Duration,
) -> anyhow::Result<Bus> {
    connect_with(global, name, Some(patience)).await
}

/// `None`: wait for the server as long as it takes.
async fn connect_with(
    global: &Global,
    name: &str,
    patience: Option<Duration>,
) -> anyhow::Result<Bus> {
    let subjects = Subjects::new(&global.prefix)?;
    let config = NatsConfig {
        url: global.nats_url.clone(),
        name: Some(name.to_owned()),
        creds_file: global.creds.clone(),
        nkey_file: global.nkey_file.clone(),
        token_file: global.token_file.clone(),
        user: global.user.clone(),
        password_file: global.password_file.clone(),
        tls_ca: global.tls_ca.clone(),
        tls_cert: global.tls_cert.clone(),
        tls_key: global.tls_key.clone(),
        inbox_prefix: global.inbox_prefix.clone(),
    };
    let client = match patience {
        None => config.connect().await?,
        Some(patience) => config.connect_within(patience).await?,
    };
    Ok(Bus::new(client, subjects))
}

/// Reads webhook secrets, one per non-empty line of each file. Errors name
/// the file and line, never the secret.
fn webhook_secrets(files: &[std::path::PathBuf]) -> anyhow::Result<Vec<WebhookSecret>> {
    let mut secrets = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading webhook secrets from {}", path.display()))?;
        for (number, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let secret = line
                .parse()
                .with_context(|| format!("{} line {}", path.display(), number + 1))?;
            secrets.push(secret);
        }
    }
    if secrets.is_empty() {
        bail!(
            "--webhook-url needs at least one secret: --webhook-secret-file FILE (whsec_... per line)"
        );
    }
    Ok(secrets)
}

/// Inside a `command` executor (WAKEBUS_DEPTH is set), a delegation nests
/// one level below its parent task and records the parent's session.
fn inherit_from_parent_task(delegation: &mut Delegation) -> anyhow::Result<()> {
    // Set to nothing counts as unset, as for every option's variable.
    if let Ok(depth) = std::env::var("WAKEBUS_DEPTH").map(|depth| depth.trim().to_owned())
        && !depth.is_empty()
    {
        let parent: u32 = depth
            .parse()
            .with_context(|| format!("WAKEBUS_DEPTH {:?} is not a number", bounded(&depth, 100)))?;
        delegation.depth = parent
            .checked_add(1)
            .context("WAKEBUS_DEPTH is at the largest depth there is")?;
        if delegation.parent_session_id.is_none() {
            delegation.parent_session_id = std::env::var("WAKEBUS_ORIGIN_SESSION").ok();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn a_workers_retry_delays_come_from_its_flags() {
        let worker = |extra: &[&str]| {
            let args = ["wakebus", "worker", "--executor", "echo"]
                .iter()
                .chain(extra);
            match Cli::try_parse_from(args).unwrap().command {
                Command::Worker(args) => worker_config(&args),
                _ => unreachable!("a worker command"),
            }
        };
        let default = worker(&[]);
        assert_eq!(
            (default.retry_base, default.retry_max),
            (Duration::from_secs(1), Duration::from_secs(60))
        );
        let patient = worker(&["--retry-min", "10s", "--retry-max", "2m"]);
        assert_eq!(
            (patient.retry_base, patient.retry_max),
            (Duration::from_secs(10), Duration::from_secs(120))
        );
    }
}
