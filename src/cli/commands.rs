//! One function per subcommand; each builds library configs and calls `run`.

use std::process::ExitCode;

use anyhow::{Context, bail};
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::delegate::{Delegation, Delegator};
use wakebus::protocol::Subjects;
use wakebus::wake::session_api::{HttpSecurity, PostShape, SessionApiConfig};
use wakebus::wake::webhook::WebhookSecret;
use wakebus::wake::{self, WakeConfig};
use wakebus::worker::executor::{CommandConfig, CommandExecutor, EchoExecutor, Executor, TaskEnv};
use wakebus::worker::{self, WorkerConfig};

use super::args::{Cli, Command, ExecutorKind, Global};
use super::shutdown_signal;

pub(crate) async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let global = cli.global;
    match cli.command {
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
                shutdown_signal(),
            )
            .await?;
        }
        Command::Init(args) => {
            let bus = connect(&global, "wakebus-init").await?;
            bus.provision(&settings(&global)).await?;
            bus.provision_wake_state(&settings(&global)).await?;
            for pool in &args.pools {
                wakebus::protocol::validate_pool(pool)?;
                bus.worker_consumer(pool, std::time::Duration::from_secs(30))
                    .await?;
            }
            bus.wake_consumer(std::time::Duration::from_secs(30), 10_000)
                .await?;
            println!(
                "{}",
                serde_json::json!({"status": "ok", "prefix": global.prefix})
            );
        }
        Command::Delegate(args) => {
            let bus = connect(&global, "wakebus-delegate").await?;
            let delegator = Delegator::new(bus)
                .with_wait_timeout(args.wait_timeout)
                .with_limits(args.limits.limits());
            let mut delegation = Delegation::new(args.goal)
                .context(args.context)
                .pool(args.pool);
            delegation.origin_session_id = args.session;
            delegation.model = args.model;
            delegation.timeout_seconds = args.timeout_seconds;
            delegation.wait = args.wait;
            inherit_from_parent_task(&mut delegation)?;
            let result = delegator.delegate(delegation).await?;
            println!("{}", serde_json::to_string(&result)?);
        }
        Command::Worker(args) => {
            let executor = match args.executor {
                ExecutorKind::Echo => Executor::Echo(EchoExecutor),
                ExecutorKind::Command => {
                    let Some((program, rest)) = args.command.split_first() else {
                        bail!(
                            "--executor command needs a program: wakebus worker --executor command -- PROGRAM ARGS..."
                        );
                    };
                    let mut config = CommandConfig::new(program, rest.to_vec());
                    config.working_dir = args.workdir;
                    Executor::Command(CommandExecutor::new(config))
                }
            };
            wakebus::protocol::validate_pool(&args.pool)?;
            let bus = connect(&global, "wakebus-worker").await?;
            let mut config = WorkerConfig::new(&args.pool);
            config.concurrency = args.concurrency;
            config.ack_wait = args.ack_wait;
            config.max_deliver = args.max_deliver;
            config.default_timeout = args.task_timeout;
            config.shutdown_grace = args.shutdown_grace;
            config.limits = args.limits.limits();
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
                shutdown_signal(),
            )
            .await?;
            client
                .drain()
                .await
                .context("draining the NATS connection")?;
        }
        Command::Wake(args) => {
            let api_key = match &args.api_key_file {
                Some(path) => Some(
                    std::fs::read_to_string(path)
                        .with_context(|| format!("reading the API key from {}", path.display()))?
                        .trim()
                        .to_owned(),
                ),
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
            config.shape = shape;
            config.http = HttpSecurity {
                allow_insecure_http: args.allow_insecure_http,
                extra_ca: args.api_ca,
            };
            config.coalesce_window = args.coalesce_window;
            config.ack_wait = args.ack_wait;
            config.retry_min = args.retry_min;
            config.retry_max = args.retry_max;
            let client = bus.client.clone();
            wake::run(bus, settings(&global), config, shutdown_signal()).await?;
            client
                .drain()
                .await
                .context("draining the NATS connection")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn settings(global: &Global) -> BusSettings {
    BusSettings {
        history_max_age: global.history,
        replicas: global.replicas,
        session_lock_ttl: global.session_lock_ttl,
        ..BusSettings::default()
    }
}

async fn connect(global: &Global, name: &str) -> anyhow::Result<Bus> {
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
    let client = config.connect().await?;
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

/// Inside a `command` executor, a delegation continues its parent's depth.
fn inherit_from_parent_task(delegation: &mut Delegation) -> anyhow::Result<()> {
    if let Ok(depth) = std::env::var("WAKEBUS_DEPTH") {
        let parent: u32 = depth.parse().context("WAKEBUS_DEPTH is not a number")?;
        delegation.depth = parent + 1;
    }
    Ok(())
}
