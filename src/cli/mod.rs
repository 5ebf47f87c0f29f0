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

use clap::Parser;

pub(crate) use args::Cli;

/// Entry point: parse, set up logging, run the subcommand on a Tokio runtime.
pub(crate) fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    // Tools an operator runs by hand log only problems; services log progress.
    let tool = matches!(
        cli.command,
        args::Command::Events(_) | args::Command::Replay(_) | args::Command::Status(_)
    );
    init_logging(&cli.global.log_format, if tool { "warn" } else { "info" });
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Parses the command line, with `--config FILE` (or `WAKEBUS_CONFIG`)
/// supplying global options not given otherwise.
fn parse() -> anyhow::Result<Cli> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = Cli::parse_from(&args);
    match &cli.global.config {
        Some(path) => Ok(Cli::parse_from(config_file::with_config_file(args, path)?)),
        None => Ok(cli),
    }
}

fn init_logging(format: &args::LogFormat, default_level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        args::LogFormat::Json => builder.json().init(),
        args::LogFormat::Text => builder.init(),
    }
}

/// Completes on SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("Shutdown signal received.");
}
