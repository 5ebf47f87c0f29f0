//! `--config FILE`: the global options (NATS connection, authentication,
//! prefix...) from a file, one `name = value` per line, names as the long
//! flags without `--`:
//!
//! ```text
//! # /etc/wakebus/worker.conf
//! nats-url = "tls://nats.internal:4222"
//! nkey-file = "/etc/wakebus/worker.nk"
//! tls-ca = "/etc/wakebus/ca.pem"
//! inbox-prefix = "_INBOX_worker"
//! ```
//!
//! Flags win over environment variables, which win over the file. Secrets
//! stay in their own files; this one only names them.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{Context, bail};
use clap::CommandFactory;

use super::args::Cli;

/// The arguments with the file's options inserted before the user's, for
/// the options given neither as a flag (a later flag overrides) nor in the
/// environment.
pub(crate) fn with_config_file(args: Vec<OsString>, path: &Path) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let command = Cli::command();
    let globals: Vec<&clap::Arg> = command
        .get_arguments()
        .filter(|arg| arg.is_global_set() && arg.get_long().is_some_and(|l| l != "config"))
        .collect();
    let mut from_file = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once('=') else {
            bail!(
                "{} line {}: expected `name = value`",
                path.display(),
                number + 1
            );
        };
        let (name, value) = (name.trim(), unquote(value.trim()));
        let Some(arg) = globals.iter().find(|arg| arg.get_long() == Some(name)) else {
            let known: Vec<&str> = globals.iter().filter_map(|a| a.get_long()).collect();
            bail!(
                "{} line {}: unknown option {name:?}; known: {}",
                path.display(),
                number + 1,
                known.join(", ")
            );
        };
        if arg
            .get_env()
            .is_some_and(|env| std::env::var_os(env).is_some())
        {
            continue;
        }
        from_file.push(OsString::from(format!("--{name}")));
        from_file.push(OsString::from(value));
    }
    let mut args = args.into_iter();
    let mut out: Vec<OsString> = args.next().into_iter().collect();
    out.extend(from_file);
    out.extend(args);
    Ok(out)
}

fn unquote(value: &str) -> &str {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
}
