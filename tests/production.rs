//! The production NATS configuration (`deploy/nats-prod.conf`): mutual TLS
//! with a private CA, one NKey user per role. The pipeline runs against it
//! with every service authenticated as its role, in-process and as
//! `wakebus` processes configured through flags and environment variables.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

use common::pki::{Pki, pki, write};
use common::*;
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::delegate::{DelegateResult, Delegation, Delegator};
use wakebus::protocol::Subjects;
use wakebus::worker::executor::{EchoExecutor, Executor};

const WAIT: Duration = Duration::from_secs(30);

/// Runs a `wakebus` command to its end within a deadline, so that a
/// command that hangs fails its test with a message instead of holding it
/// until the harness kills it (the child is killed with the future).
trait OutputWithin {
    async fn output_within(&mut self, deadline: Duration) -> std::process::Output;
}

impl OutputWithin for Command {
    async fn output_within(&mut self, deadline: Duration) -> std::process::Output {
        self.kill_on_drop(true);
        tokio::time::timeout(deadline, self.output())
            .await
            .unwrap_or_else(|_| panic!("{self:?} did not finish within {deadline:?}"))
            .expect("run the command")
    }
}
const ROLES: [&str; 4] = ["operator", "delegator", "worker", "wake"];

struct Deployment {
    nats: NatsServer,
    pki: Pki,
    dir: tempfile::TempDir,
}

impl Deployment {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = pki(dir.path());
        let mut env = vec![
            (
                "WAKEBUS_TLS_CERT".to_owned(),
                pki.server_cert.display().to_string(),
            ),
            (
                "WAKEBUS_TLS_KEY".to_owned(),
                pki.server_key.display().to_string(),
            ),
            ("WAKEBUS_TLS_CA".to_owned(), pki.ca.display().to_string()),
        ];
        for role in ROLES {
            let pair = nkeys::KeyPair::new_user();
            write(dir.path(), &format!("{role}.nk"), &pair.seed().unwrap());
            env.push((
                format!("WAKEBUS_{}_NKEY", role.to_ascii_uppercase()),
                pair.public_key(),
            ));
        }
        let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nats-prod.conf");
        let nats =
            NatsServer::start_secured(vec!["-c".into(), conf.display().to_string()], env).await;
        Self { nats, pki, dir }
    }

    fn seed_file(&self, role: &str) -> PathBuf {
        self.dir.path().join(format!("{role}.nk"))
    }

    fn config(&self, role: &str) -> NatsConfig {
        NatsConfig {
            nkey_file: Some(self.seed_file(role)),
            tls_ca: Some(self.pki.ca.clone()),
            tls_cert: Some(self.pki.client_cert.clone()),
            tls_key: Some(self.pki.client_key.clone()),
            inbox_prefix: (role != "operator").then(|| format!("_INBOX_{role}")),
            ..NatsConfig::new(self.nats.url())
        }
    }

    async fn bus(&self, role: &str) -> Bus {
        let client = self.config(role).connect().await.expect("connect");
        Bus::new(client, Subjects::new("wakebus").unwrap())
    }

    /// `wakebus` with a role's credentials in environment variables.
    fn command(&self, role: &str) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_wakebus"));
        command
            .env_clear()
            .env("NATS_URL", self.nats.url())
            .env("NATS_NKEY_FILE", self.seed_file(role))
            .env("NATS_CA", &self.pki.ca)
            .env("NATS_CERT", &self.pki.client_cert)
            .env("NATS_KEY", &self.pki.client_key)
            .env("NATS_INBOX_PREFIX", format!("_INBOX_{role}"))
            .env("RUST_LOG", "wakebus=info");
        command
    }
}

#[tokio::test]
async fn the_pipeline_runs_over_mutual_tls_with_an_nkey_per_role() {
    init_logs();
    let deployment = Deployment::start().await;
    let api = SessionApiServer::start().await;

    // `wakebus init` as the operator, configured by flags.
    let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .env_clear()
        .args(["--nats-url", &deployment.nats.url(), "--nkey-file"])
        .arg(deployment.seed_file("operator"))
        .arg("--tls-ca")
        .arg(&deployment.pki.ca)
        .arg("--tls-cert")
        .arg(&deployment.pki.client_cert)
        .arg("--tls-key")
        .arg(&deployment.pki.client_key)
        .arg("init")
        .output_within(WAIT)
        .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains(r#""status":"ok""#));

    let mut services = Services::new();
    services.worker(
        &deployment.bus("worker").await,
        Executor::Echo(EchoExecutor),
        test_worker_config("default"),
    );
    services.wake(&deployment.bus("wake").await, test_wake_config(&api.url()));

    // A delegation from the library and one from the CLI (environment).
    let result = Delegator::new(deployment.bus("delegator").await)
        .delegate(Delegation::new("over TLS").session("sess.tls"))
        .await
        .expect("delegate");
    let DelegateResult::Dispatched { delegation_id, .. } = result else {
        panic!("expected a dispatched delegation");
    };
    let output = deployment
        .command("delegator")
        .args([
            "delegate",
            "--goal",
            "sync over TLS",
            "--wait-timeout",
            "30s",
        ])
        .output_within(WAIT)
        .await;

    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains(r#""mode":"sync""#), "{stdout}");
    assert!(stdout.contains("echo: sync over TLS"), "{stdout}");

    wait_until(WAIT, "the background wake", || async {
        !api.accepted().is_empty()
    })
    .await;
    services.stop().await;
    assert_eq!(api.accepted()[0].delegation_ids(), vec![delegation_id]);
}

#[tokio::test]
async fn a_client_without_the_right_key_or_certificate_is_refused_and_no_secret_is_printed() {
    init_logs();
    let deployment = Deployment::start().await;
    let stranger = nkeys::KeyPair::new_user();
    let stranger_seed = stranger.seed().unwrap();
    let seed_file = write(deployment.dir.path(), "stranger.nk", &stranger_seed);

    let output = deployment
        .command("delegator")
        .env("NATS_NKEY_FILE", &seed_file)
        .args([
            "delegate",
            "--goal",
            "g",
            "--session",
            "s",
            "--wait-timeout",
            "5s",
        ])
        .output_within(WAIT)
        .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr
            .to_ascii_lowercase()
            .contains("authorization violation"),
        "{stderr}"
    );
    assert!(!stderr.contains(&stranger_seed), "the seed was printed");

    // The right key without a client certificate: the server ends the TLS
    // handshake, and the client gets nowhere.
    let mut config = deployment.config("delegator");
    config.tls_cert = None;
    config.tls_key = None;
    let client = config.connect().await.expect("client");
    let bus = Bus::new(client, Subjects::new("wakebus").unwrap());
    let attempt = tokio::spawn(async move { bus.provision(&BusSettings::default()).await });
    let log = deployment.nats.store.path().join("server.stderr");
    wait_until(
        WAIT,
        "the server to refuse the certificate-less client",
        || async {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("didn't provide a certificate")
        },
    )
    .await;
    if attempt.is_finished() {
        let result = attempt.await.unwrap();
        assert!(
            result.is_err(),
            "a client without a certificate got through"
        );
    } else {
        attempt.abort();
    }
}

/// A failed TLS handshake reaches async-nats as an I/O error, like a
/// server that is down; the handshake a service then makes itself names
/// the cause: a CA that did not sign the server's certificate, a client
/// certificate the server refuses, or no server at all.
#[tokio::test]
async fn the_tls_probe_names_why_a_handshake_with_nats_fails() {
    use wakebus::connect::{TlsProbeError, TlsProbeOutcome};
    init_logs();
    let deployment = Deployment::start().await;
    let good = deployment.config("worker");
    assert_eq!(
        good.probe_tls()
            .await
            .expect("the deployment's own files work"),
        TlsProbeOutcome::Handshake
    );

    let other = tempfile::tempdir().unwrap();
    let other_ca = pki(other.path()).ca;
    let wrong_ca = NatsConfig {
        tls_ca: Some(other_ca),
        ..good.clone()
    };
    let error = wrong_ca.probe_tls().await.expect_err("another CA");
    assert!(
        matches!(&error, TlsProbeError::Handshake { reason, .. } if reason.contains("invalid peer certificate")),
        "{error}"
    );

    let no_certificate = NatsConfig {
        tls_cert: None,
        tls_key: None,
        ..good.clone()
    };
    let error = no_certificate
        .probe_tls()
        .await
        .expect_err("no client certificate");
    assert!(matches!(error, TlsProbeError::Refused { .. }), "{error}");

    let nobody = NatsConfig {
        url: format!("tls://127.0.0.1:{}", common::nats::free_port()),
        ..good.clone()
    };
    let error = nobody.probe_tls().await.expect_err("no server");
    assert!(
        matches!(error, TlsProbeError::Unreachable { .. }),
        "{error}"
    );

    // Given no TLS settings, the client upgrades because the server's INFO
    // requires TLS, with the system's roots, which do not know the
    // deployment's CA (or with none, on a machine without any).
    let no_tls = NatsConfig {
        tls_ca: None,
        tls_cert: None,
        tls_key: None,
        ..good.clone()
    };
    let error = no_tls
        .probe_tls()
        .await
        .expect_err("a server that requires TLS of a client without its CA");
    assert!(
        matches!(&error, TlsProbeError::Handshake { reason, .. } if reason.contains("invalid peer certificate"))
            || matches!(&error, TlsProbeError::Config(reason) if reason.starts_with("the server requires TLS")),
        "{error}"
    );
}

/// A service given no TLS settings, whose server requires TLS with a
/// certificate from a private CA, fails every connect as a bare I/O error;
/// its own handshake names the cause, at ERROR, pointing at --tls-ca.
#[tokio::test]
async fn a_service_given_no_ca_for_a_server_requiring_tls_says_so_at_error() {
    init_logs();
    let deployment = Deployment::start().await;
    let log = deployment.dir.path().join("worker.log");
    let _worker = common::process::Service::spawn(
        vec![
            "--nats-url".into(),
            deployment.nats.url(),
            "--nkey-file".into(),
            deployment.seed_file("worker").display().to_string(),
            "worker".into(),
            "--executor".into(),
            "echo".into(),
        ],
        log.clone(),
    );
    wait_until(WAIT, "the worker to say why it cannot connect", || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("The NATS server requires TLS")
    })
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|line| line.contains("The NATS server requires TLS"))
        .unwrap();
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("--tls-ca"), "{line}");
}

/// A client without TLS settings, whose server does not require TLS,
/// makes no handshake: TLS is not why its connects fail.
#[tokio::test]
async fn the_tls_probe_of_a_client_without_tls_makes_no_handshake_with_a_plain_server() {
    use wakebus::connect::{TlsProbeError, TlsProbeOutcome};
    init_logs();
    let nats = NatsServer::start().await;
    let plain = NatsConfig::new(nats.url());
    assert_eq!(plain.probe_tls().await.unwrap(), TlsProbeOutcome::NoTls);
    // A websocket port answers HTTP: it is not probed.
    let websocket = NatsConfig::new(format!("ws://127.0.0.1:{}", common::nats::free_port()));
    assert_eq!(
        websocket.probe_tls().await.unwrap(),
        TlsProbeOutcome::NotProbed
    );

    let nobody = NatsConfig::new(format!("nats://127.0.0.1:{}", common::nats::free_port()));
    let error = nobody.probe_tls().await.expect_err("no server");
    assert!(
        matches!(error, TlsProbeError::Unreachable { .. }),
        "{error}"
    );

    // What answers is not a NATS server: a proxy with nothing behind it,
    // which accepts and closes, and a port that never says anything. No
    // handshake is made, for a client with TLS settings or without.
    // And another service's banner on a wrong port.
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let banner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let urls = [&closing, &silent, &banner]
        .map(|listener| format!("nats://{}", listener.local_addr().unwrap()));
    let _answering = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        let mut held = Vec::new();
        loop {
            tokio::select! {
                Ok((stream, _)) = closing.accept() => drop(stream),
                Ok((stream, _)) = silent.accept() => held.push(stream),
                Ok((mut stream, _)) = banner.accept() => {
                    let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await;
                    held.push(stream);
                }
            }
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    for url in &urls {
        let plain = NatsConfig::new(url.clone());
        let with_ca = NatsConfig {
            tls_ca: Some(pki.ca.clone()),
            ..NatsConfig::new(url.clone())
        };
        let error = plain.probe_tls().await.expect_err(url);
        assert!(
            matches!(error, TlsProbeError::Unreachable { .. }),
            "{url}: {error}"
        );
        let error = with_ca.probe_tls().await.expect_err(url);
        assert!(
            matches!(error, TlsProbeError::Unreachable { .. }),
            "{url}: {error}"
        );
    }
}

#[tokio::test]
async fn the_cli_authenticates_with_a_token_or_password_file_from_flags_environment_or_config_file()
{
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let token = "s3cret-token-value";
    let token_file = write(dir.path(), "token", &format!("{token}\n"));
    let nats = NatsServer::start_secured(vec!["--auth".into(), token.into()], Vec::new()).await;
    let init = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_wakebus"));
        command
            .env_clear()
            .args(["--nats-url", &nats.url()])
            .args(args)
            .arg("init");
        command
    };
    let output = init(&["--token-file", token_file.to_str().unwrap()])
        .output_within(WAIT)
        .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // A user and password file from the environment, against nats.conf.
    let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("nats.conf");
    let roles = NatsServer::start_with(vec!["-c".into(), conf.display().to_string()]).await;
    let password_file = write(dir.path(), "password", "operator-dev-only\n");
    let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .env_clear()
        .env("NATS_URL", roles.url())
        .env("NATS_USER", "operator")
        .env("NATS_PASSWORD_FILE", &password_file)
        .arg("init")
        .output_within(WAIT)
        .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // The same from a config file (WAKEBUS_CONFIG), with a comment; a
    // variable set to nothing (`NATS_URL: ${UNSET:-}` in a compose file)
    // counts as unset, whatever its option takes (text, a path, a
    // duration, a number), and does not hide the file's value.
    let config = write(
        dir.path(),
        "wakebus.conf",
        &format!(
            "# connection\nnats-url = \"{}\"\ntoken-file = {}\nhistory = 2d\nreplicas = 1\n",
            nats.url(),
            token_file.display()
        ),
    );
    let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
        .env_clear()
        .env("WAKEBUS_CONFIG", &config)
        .env("NATS_URL", "")
        .env("NATS_TOKEN_FILE", "")
        .env("WAKEBUS_HISTORY", "")
        .env("WAKEBUS_REPLICAS", "")
        .env("NATS_NKEY_FILE", "")
        .env("WAKEBUS_LOG_FORMAT", "")
        .arg("init")
        .output_within(WAIT)
        .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // An empty URL is an error, not the default server: without a config
    // file, and with one that does not set the URL.
    let no_url = write(
        dir.path(),
        "no-url.conf",
        &format!("token-file = {}\n", token_file.display()),
    );
    // A prefix of its own, so that if the refusal ever regressed into the
    // default server, nothing of a real deployment there would be touched.
    let prefix = unique_prefix();
    for config in [None, Some(&no_url)] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_wakebus"));
        command.env_clear().env("NATS_URL", "");
        if let Some(config) = config {
            command.env("WAKEBUS_CONFIG", config);
        }
        let output = command
            .args(["--prefix", &prefix])
            .args(["cancel", "--session", "s1", "--connect-timeout", "0s"])
            .output_within(WAIT)
            .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{config:?}");
        assert!(
            stderr.contains("no NATS server URL given"),
            "{config:?}: {stderr}"
        );
    }
    // `dev` too, which would otherwise start or use a server on port 4222
    // (and is given nothing it could start one with, should that regress).
    let data_dir = tempfile::tempdir().unwrap();
    for url in ["", ","] {
        let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .env_clear()
            .env("NATS_URL", url)
            .args(["--prefix", &prefix, "dev", "--nats-server", "/nonexistent"])
            .arg("--data-dir")
            .arg(data_dir.path())
            .output_within(WAIT)
            .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{url:?}");
        assert!(
            stderr.contains("no NATS server URL given"),
            "{url:?}: {stderr}"
        );
    }
    // An unknown name, or a value its option does not take (with the values
    // it does): the file and line named.
    let cases: [(&str, &str, &[&str]); 2] = [
        (
            "bad.conf",
            "nats-ur1 = x\n",
            &["line 1: unknown option \"nats-ur1\""],
        ),
        (
            "bad-value.conf",
            "log-format = jsn\n",
            &[
                "line 1: option \"log-format\": invalid value 'jsn'",
                "[possible values: text, json]",
            ],
        ),
    ];
    for (name, content, expected) in cases {
        let bad = write(dir.path(), name, content);
        let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .env_clear()
            .args(["--config", bad.to_str().unwrap()])
            .args([
                "--nats-url",
                "nats://127.0.0.1:1",
                "--prefix",
                &prefix,
                "init",
            ])
            .output_within(WAIT)
            .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{name}");
        for part in expected {
            assert!(stderr.contains(part), "{name}: {stderr}");
        }
    }

    // A missing secret file is a clear error naming the file.
    let output = init(&["--token-file", "/nonexistent/token"])
        .output_within(WAIT)
        .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("cannot read token from /nonexistent/token"),
        "{stderr}"
    );
}

/// Asked for traces it cannot export, a build without the `otel` feature
/// stops with the reason, whether the endpoint came as a flag or from a
/// config file shared with builds that have it.
#[cfg(not(feature = "otel"))]
#[tokio::test]
async fn a_build_without_otel_refuses_an_otlp_endpoint_instead_of_dropping_the_traces() {
    let dir = tempfile::tempdir().unwrap();
    let shared = write(
        dir.path(),
        "shared.conf",
        "otlp-endpoint = http://127.0.0.1:4318\n",
    );
    // Nowhere to connect to and a prefix of its own, should the refusal
    // ever regress into a run against the default server.
    let prefix = unique_prefix();
    let elsewhere = ["--nats-url", "nats://127.0.0.1:1", "--prefix", &prefix];
    let flag = ["--otlp-endpoint", "http://127.0.0.1:4318", "status"];
    let file = ["--config", shared.to_str().unwrap(), "status"];
    for args in [&flag, &file] {
        let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .env_clear()
            .args(elsewhere)
            .args(args)
            .output_within(WAIT)
            .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}");
        assert!(
            stderr.contains("built without OpenTelemetry export"),
            "{args:?}: {stderr}"
        );
    }
    // The standard variables, often set for a whole host, are not refused,
    // but the command says that no spans will come.
    for name in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_wakebus"))
            .env_clear()
            .env(name, "http://127.0.0.1:4318")
            .args(["--nats-url", "nats://127.0.0.1:1", "--prefix", &prefix])
            .arg("status")
            .output_within(WAIT)
            .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("built without OpenTelemetry export, so no spans are sent")
                && stderr.contains(name),
            "{name}: {stderr}"
        );
        assert!(
            stderr.contains("cannot connect to NATS"),
            "{name}: {stderr}"
        );
    }
}
