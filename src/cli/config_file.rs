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
//! Values may be in double or single quotes, and a ` # comment` may follow
//! one. Flags win over environment variables, which win over the file
//! (for `otlp-endpoint`, the `OTEL_EXPORTER_OTLP_*` variables do); a
//! variable set to nothing counts as unset ([`without_empty_variables`]),
//! but for `nats-url` and `prefix` unless the file sets them
//! ([`EMPTY_IS_AN_ERROR`]).
//! Secrets stay in their own files; this one only names them.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{Context, bail};
use clap::parser::ValueSource;

/// `command` with the arguments `which` names (by long flag) read as if
/// their variable were unset when it is set to nothing (as
/// `VAR: ${UNSET:-}` in a compose file makes): clap would take the empty
/// text for the value, which no path, duration or number is, and refuse
/// the command before a config file is read.
pub(crate) fn without_empty_variables(
    command: clap::Command,
    which: &dyn Fn(&str) -> bool,
) -> clap::Command {
    command
        .mut_args(|arg| {
            let empty = arg.get_long().is_some_and(which)
                && arg.get_env().is_some_and(|name| {
                    std::env::var_os(name).is_some_and(|value| value.is_empty())
                });
            if empty { arg.env(None) } else { arg }
        })
        .mut_subcommands(|sub| without_empty_variables(sub, which))
}

/// Options whose variable set to nothing is an error (their empty value
/// is refused) rather than unset: their defaults, the local server and
/// the `wakebus` deployment, are no safe stand-in for a value left out.
pub(crate) const EMPTY_IS_AN_ERROR: [&str; 2] = ["nats-url", "prefix"];

/// The option names a config file sets (its `name = value` lines; the
/// file is checked line by line by [`with_config_file`]).
pub(crate) fn names_in(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once('=').map(|(name, _)| name.trim().to_owned()))
        .collect())
}

/// The arguments with the file's options inserted before the user's, for
/// the options given neither as a flag (a later flag overrides) nor in the
/// environment, as `matches` (the arguments parsed without the file) say.
pub(crate) fn with_config_file(
    args: Vec<OsString>,
    path: &Path,
    command: &clap::Command,
    matches: &clap::ArgMatches,
) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
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
        let name = name.trim();
        let value = parse_value(value)
            .with_context(|| format!("{} line {}: option {name:?}", path.display(), number + 1))?;
        let Some(arg) = globals.iter().find(|arg| arg.get_long() == Some(name)) else {
            let known: Vec<&str> = globals.iter().filter_map(|a| a.get_long()).collect();
            bail!(
                "{} line {}: unknown option {name:?}; known: {}",
                path.display(),
                number + 1,
                known.join(", ")
            );
        };
        // A flag given wins; its value in the file is not even parsed
        // (one the flag corrects must not stop the command). Asked of the
        // parsed arguments: a task program's own `--user` after `--` is
        // not this one's.
        let given = matches!(
            matches.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if given || overridden_by_otel_variables(name) {
            continue;
        }
        // Checked here, so that the error names the file and line rather
        // than a flag nobody typed.
        let alone = clap::Command::new("wakebus")
            .no_binary_name(true)
            .arg((*arg).clone().global(false).env(None));
        if let Err(error) = alone.try_get_matches_from([format!("--{name}={value}")]) {
            let error = error.to_string();
            let mut lines = error.lines();
            let reason = lines
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ");
            // An option of a few values says which, on the next line.
            let values = lines
                .map(str::trim)
                .find(|line| line.starts_with("[possible values:"))
                .map(|values| format!(" {values}"))
                .unwrap_or_default();
            bail!(
                "{} line {}: option {name:?}: {reason}{values}",
                path.display(),
                number + 1
            );
        }
        // One argument: a value starting with `-` is not taken for a flag.
        from_file.push(OsString::from(format!("--{name}={value}")));
    }
    let mut args = args.into_iter();
    let mut out: Vec<OsString> = args.next().into_iter().collect();
    out.extend(from_file);
    out.extend(args);
    Ok(out)
}

/// A value as written after `=`: in double or single quotes (kept as
/// they are inside), or bare; either may be followed by a ` # comment`.
fn parse_value(raw: &str) -> anyhow::Result<String> {
    let raw = raw.trim();
    let Some(quote) = raw.chars().next().filter(|c| *c == '"' || *c == '\'') else {
        // A bare value ends where a comment starts (`#` after a space).
        let end = raw
            .char_indices()
            .find(|&(i, c)| c == '#' && (i == 0 || raw[..i].ends_with(char::is_whitespace)))
            .map_or(raw.len(), |(i, _)| i);
        let value = raw[..end].trim_end();
        if value.is_empty() {
            bail!("no value (a `#` starts a comment; quote a value that begins with one)");
        }
        return Ok(value.to_owned());
    };
    let rest = &raw[1..];
    let Some(close) = rest.find(quote) else {
        bail!("the value's closing {quote} is missing");
    };
    let after = rest[close + 1..].trim_start();
    if !after.is_empty() && !after.starts_with('#') {
        bail!("unexpected {after:?} after the quoted value");
    }
    Ok(rest[..close].to_owned())
}

/// `otlp-endpoint` has no variable of its own: the OpenTelemetry ones
/// stand for it, and win over the file as variables do.
fn overridden_by_otel_variables(name: &str) -> bool {
    name == "otlp-endpoint"
        && [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]
        .iter()
        .any(|variable| is_set(std::ffi::OsStr::new(variable)))
}

/// Whether an environment variable has a value: one set to nothing (as
/// `VAR: ${UNSET:-}` in a compose file makes) does not hide the file's.
fn is_set(variable: &std::ffi::OsStr) -> bool {
    std::env::var_os(variable).is_some_and(|value| !value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file value is one argument, whatever it starts with; a flag on
    /// the command line wins, and the file's value for it is left out.
    #[test]
    fn file_values_are_single_arguments_and_flags_given_win() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wakebus.conf");
        std::fs::write(&path, "inbox-prefix = -worker\nhistory = 0s\n").unwrap();
        let out = with_file(&["wakebus", "--history=7d", "status"], &path).unwrap();
        assert_eq!(
            out,
            [
                "wakebus",
                "--inbox-prefix=-worker",
                "--history=7d",
                "status"
            ]
        );
    }

    /// What the user's arguments hold, as a flag or not, is clap's to say.
    fn with_file(args: &[&str], path: &Path) -> anyhow::Result<Vec<String>> {
        use clap::CommandFactory as _;
        let command = without_empty_variables(super::super::args::Cli::command(), &|_| true);
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let matches = command.clone().try_get_matches_from(&args)?;
        let out = with_config_file(args, path, &command, &matches)?;
        Ok(out
            .into_iter()
            .map(|arg| arg.into_string().unwrap())
            .collect())
    }

    /// A task program's own flags, after `--`, are not this command's: the
    /// file's value for an option of the same name is used all the same.
    #[test]
    fn a_task_programs_own_flag_does_not_hide_the_files_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.conf");
        std::fs::write(&path, "user = worker\nprefix = prod\n").unwrap();
        let args = [
            "wakebus",
            "worker",
            "--executor",
            "command",
            "--",
            "agent",
            "--user",
            "bob",
            "--prefix=x",
        ];
        let out = with_file(&args, &path).unwrap();
        assert_eq!(out[1..3], ["--user=worker", "--prefix=prod"], "{out:?}");
        // Given to wakebus itself, the flag wins.
        let args = ["wakebus", "worker", "--user", "alice", "--executor", "echo"];
        let out = with_file(&args, &path).unwrap();
        assert!(!out.contains(&"--user=worker".to_owned()), "{out:?}");
    }

    /// A value clap would refuse is refused here, naming the file and line
    /// rather than a flag nobody typed.
    #[test]
    fn a_bad_value_in_the_file_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wakebus.conf");
        std::fs::write(&path, "# comment\nhistory = soon\n").unwrap();
        let error = with_file(&["wakebus", "status"], &path).unwrap_err();
        let error = error.to_string();
        assert!(error.contains("wakebus.conf line 2"), "{error}");
        assert!(
            error.contains("history") && error.contains("soon"),
            "{error}"
        );
        // Given on the command line, the file's value is not even read.
        assert!(with_file(&["wakebus", "--history=1d", "status"], &path).is_ok());
    }

    #[test]
    fn values_may_be_quoted_either_way_and_followed_by_a_comment() {
        let cases = [
            (r#""tls://n:4222""#, "tls://n:4222"),
            (r#""tls://n:4222" # prod"#, "tls://n:4222"),
            ("'/etc/wakebus/worker.nk'", "/etc/wakebus/worker.nk"),
            (
                "/etc/wakebus/worker.nk   # worker role",
                "/etc/wakebus/worker.nk",
            ),
            ("_INBOX_worker#1", "_INBOX_worker#1"),
            (r#""a # in quotes""#, "a # in quotes"),
            ("  plain  ", "plain"),
        ];
        for (raw, value) in cases {
            assert_eq!(parse_value(raw).unwrap(), value, "{raw}");
        }
    }

    #[test]
    fn a_quoted_value_that_is_not_closed_or_has_text_after_it_is_an_error() {
        let open = parse_value(r#""tls://n:4222"#).unwrap_err();
        assert!(open.to_string().contains("closing"), "{open}");
        let empty = parse_value("# set per host").unwrap_err();
        assert!(empty.to_string().contains("no value"), "{empty}");
        assert_eq!(parse_value("'# not a comment'").unwrap(), "# not a comment");
        let after = parse_value(r#""a" b"#).unwrap_err();
        assert!(
            after.to_string().contains("after the quoted value"),
            "{after}"
        );
    }
}
