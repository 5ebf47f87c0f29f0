//! Command-line interface: argument parsing, logging setup, signal handling.

mod args;
mod commands;
mod config_file;
mod events;
mod filters;
mod ops;
mod replay;
mod status;

use std::process::ExitCode;

pub(crate) use args::Cli;

/// Entry point: parse, set up logging, run the subcommand on a Tokio runtime.
pub(crate) fn main() -> ExitCode {
    // Before any signal handler replaces what the process inherited.
    HANGUP_IGNORED.get_or_init(hangup_ignored);
    let cli = match parse() {
        Ok(cli) => cli,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    #[cfg(not(feature = "otel"))]
    if cli.global.otlp_endpoint.is_some() {
        eprintln!(
            "error: --otlp-endpoint: this wakebus was built without OpenTelemetry export; \
             build it with `--features otel` (an image: `--build-arg FEATURES=otel`), \
             or leave the option out"
        );
        return ExitCode::FAILURE;
    }
    // Tools run by hand (or by a gateway, for delegate and cancel) log only
    // problems; services log progress. The NATS client's own INFO lines
    // repeat what connect.rs logs of its events (every 4 s while the server
    // is away), so they are left out.
    let tool = matches!(
        cli.command,
        args::Command::Events(_)
            | args::Command::Replay(_)
            | args::Command::Status(_)
            | args::Command::Delegate(_)
            | args::Command::Cancel(_)
            | args::Command::Ready(_)
    );
    let default_level = if tool { "warn" } else { "info,async_nats=warn" };
    #[cfg_attr(not(feature = "otel"), allow(clippy::let_unit_value))]
    let telemetry = init_logging(&cli.global, default_level);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", error_report(&error));
            ExitCode::FAILURE
        }
    };
    drop(runtime);
    // Spans still buffered are sent now, outside the runtime (blocking).
    #[cfg(feature = "otel")]
    if let Some(otlp) = telemetry {
        otlp.shutdown();
    }
    #[cfg(not(feature = "otel"))]
    let () = telemetry;
    code
}

/// Parses the command line, with `--config FILE` (or `WAKEBUS_CONFIG`)
/// supplying global options not given otherwise.
fn parse() -> anyhow::Result<Cli> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let parse = |command: &clap::Command, args: &[std::ffi::OsString]| {
        let matches = command.clone().get_matches_from(args);
        let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
        (cli, matches)
    };
    // A variable set to nothing counts as unset, but for the server URL
    // and the prefix, whose defaults it must not stand for (an empty
    // `NATS_URL` is no order to use the default server) unless the file
    // gives them. Read leniently first, to find the file.
    let lenient = config_file::without_empty_variables(Cli::command(), &|_| true);
    let (cli, _) = parse(&lenient, &args);
    let set = match &cli.global.config {
        Some(path) => config_file::names_in(path)?,
        None => Vec::new(),
    };
    let command = config_file::without_empty_variables(Cli::command(), &|long| {
        !config_file::EMPTY_IS_AN_ERROR.contains(&long) || set.iter().any(|name| name == long)
    });
    let (cli, matches) = parse(&command, &args);
    match &cli.global.config {
        Some(path) => {
            let args = config_file::with_config_file(args, path, &command, &matches)?;
            Ok(parse(&command, &args).0)
        }
        None => Ok(cli),
    }
}

/// What must outlive the command for its telemetry to be complete: the OTLP
/// exporter, flushed at the end (`otel` feature, endpoint set).
#[cfg(feature = "otel")]
type Telemetry = Option<wakebus::telemetry::otlp::OtlpGuard>;
/// Nothing to keep without the `otel` feature.
#[cfg(not(feature = "otel"))]
type Telemetry = ();

/// Logs to stderr (text or JSON, filtered by `RUST_LOG`, else
/// `default_level`) and, with the `otel` feature and an OTLP endpoint,
/// exports spans as well.
fn init_logging(global: &args::Global, default_level: &str) -> Telemetry {
    use std::io::IsTerminal as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colours only for a person at a terminal: a collector reading a pipe
    // (journald, `docker logs`) would get escape codes in every line.
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = match global.log_format {
        args::LogFormat::Json => fmt.json().boxed(),
        args::LogFormat::Text => fmt.boxed(),
    };
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    #[cfg(feature = "otel")]
    {
        let config = wakebus::telemetry::otlp::OtlpConfig {
            endpoint: global.otlp_endpoint.clone(),
        };
        let (layer, otlp) = match wakebus::telemetry::otlp::layer(&config) {
            Ok(Some((layer, guard))) => (Some(layer), Some(guard)),
            Ok(None) => (None, None),
            Err(error) => {
                eprintln!("warning: spans are not exported: {error}");
                (None, None)
            }
        };
        registry.with(layer).init();
        otlp
    }
    #[cfg(not(feature = "otel"))]
    {
        registry.init();
        // Set for the whole host or pod (as collectors' auto-configuration
        // does), these are not refused like `--otlp-endpoint`, which asks
        // this command for traces; but nobody should wait for them in vain.
        for name in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ] {
            if std::env::var_os(name).is_some_and(|value| !value.is_empty()) {
                tracing::warn!(
                    variable = name,
                    "This wakebus was built without OpenTelemetry export, so no spans are sent; \
                     build it with `--features otel` (an image: `--build-arg FEATURES=otel`)."
                );
            }
        }
    }
}

/// A service's graceful stop: completes on the first SIGINT, SIGTERM or
/// SIGHUP. A second SIGINT or SIGTERM kills the task programs still
/// running and ends the process at once (exit 130), as operators expect of
/// a second Ctrl-C, for a stop that waits on what may not come: a task in
/// its `--shutdown-grace`, or NATS taking the last acks while unreachable.
/// What was not acknowledged then is redelivered after its ack wait, as
/// after a crash. A second SIGHUP does not: a closing SSH session's shell
/// and then the kernel each send one.
pub(crate) fn service_shutdown() -> impl std::future::Future<Output = ()> {
    let first = tokio_util::sync::CancellationToken::new();
    let stop = first.clone().cancelled_owned();
    tokio::spawn(async move {
        shutdown_signal().await;
        first.cancel();
        second_interrupt().await;
        tracing::warn!(
            "Second shutdown signal: stopping task programs and exiting now; work not acknowledged yet is redelivered after its ack wait."
        );
        wakebus::worker::executor::kill_running_programs();
        std::process::exit(130);
    });
    stop
}

/// `error` and its causes, each said once: many errors already end their
/// own message with their cause, and `{:#}` would repeat it.
fn error_report(error: &anyhow::Error) -> String {
    let mut report = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if report == text || report.ends_with(&format!(": {text}")) {
            continue;
        }
        if !report.is_empty() {
            report.push_str(": ");
        }
        report.push_str(&text);
    }
    report
}

/// Completes on SIGINT, SIGTERM or SIGHUP. A hangup (the terminal or SSH
/// session that started the process closed) stops it as gracefully as a
/// SIGTERM: left to its default, it would end the process at once, with
/// running tasks only redelivered after their ack wait and their programs,
/// in process groups of their own, left running. Unless the process was
/// started with hangups ignored (`nohup`): then it runs on, as asked.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    let hangup = async {
        if *HANGUP_IGNORED.get_or_init(hangup_ignored) {
            return std::future::pending().await;
        }
        match signal(SignalKind::hangup()) {
            Ok(mut hangup) => hangup.recv().await,
            Err(_) => std::future::pending().await,
        }
    };
    let name = tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
        _ = hangup => "SIGHUP",
    };
    tracing::info!(signal = name, "Shutdown signal received.");
}

/// Whether the process started with SIGHUP ignored, read once before any
/// handler of ours replaces that.
static HANGUP_IGNORED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Whether SIGHUP is ignored now (`nohup`, `setsid -f` after `trap "" HUP`),
/// from the `SigIgn` mask in `/proc/self/status` (Linux; elsewhere: no).
fn hangup_ignored() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        // Signal n is bit n - 1; SIGHUP is 1.
        .is_some_and(|mask| mask & 1 != 0)
}

/// Completes on a SIGINT or SIGTERM (not a SIGHUP): the operator's second
/// signal, once a stop is under way, to stop waiting for it.
pub(crate) async fn second_interrupt() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("publish was not acknowledged: {0}")]
    struct Publish(#[source] std::io::Error);

    #[test]
    fn an_error_report_says_each_cause_once() {
        let cause = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
        let error = anyhow::Error::new(Publish(cause)).context("the request was not accepted");
        assert_eq!(
            error_report(&error),
            "the request was not accepted: publish was not acknowledged: timed out"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_report(&plain), "outer: inner");
        let said_elsewhere = anyhow::anyhow!("timed out").context("the ack timed out twice");
        assert_eq!(
            error_report(&said_elsewhere),
            "the ack timed out twice: timed out"
        );
        let a_word_of_it = anyhow::anyhow!("out").context("timed out");
        assert_eq!(error_report(&a_word_of_it), "timed out: out");
    }
}
