//! Naming the cause of a failed TLS handshake with NATS.
//!
//! async-nats reports a handshake that fails (a CA that did not sign the
//! server's certificate, a client certificate the server refuses, a server
//! without TLS) as an I/O error, like a server that is down, and logs the
//! cause only at debug level. [`NatsConfig::probe_tls`] makes the handshake
//! itself, with the same files, and says what went wrong: a service runs it
//! when its connects keep failing. A client given no TLS settings makes the
//! handshake too when the server's INFO requires TLS (async-nats then
//! upgrades with the system's root certificates, which do not know a
//! private CA).

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::net::TcpStream;

use super::NatsConfig;

/// How long each step of the probe waits: the connect, the server's INFO,
/// the handshake.
const STEP: Duration = Duration::from_secs(3);

/// Most bytes of the server's INFO line the probe reads (nats-server's is
/// a few hundred).
const INFO_MAX: u64 = 64 * 1024;

/// How long the probe waits after the handshake for the server to refuse
/// the client's certificate (TLS 1.3 says so only after the handshake).
const REFUSAL_WAIT: Duration = Duration::from_millis(500);

/// What a probe found when nothing failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsProbeOutcome {
    /// A TLS handshake with a server succeeded.
    Handshake,
    /// The server does not require TLS and this config does not use it:
    /// no handshake was made, and TLS is not why a connect fails.
    NoTls,
    /// Every server is a websocket one, which the probe does not speak to.
    NotProbed,
}

/// Why a probe's handshake did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum TlsProbeError {
    /// The TLS files, the system's roots or the server URL cannot be used.
    #[error("{0}")]
    Config(String),
    /// No TCP connection to the server: it is down or unreachable.
    #[error("cannot reach {addr}: {reason}")]
    Unreachable {
        /// `host:port`.
        addr: String,
        /// What the connect said.
        reason: String,
    },
    /// The handshake failed on the client's side: most often a CA that did
    /// not sign the server's certificate, or a certificate for another
    /// name.
    #[error("TLS handshake with {addr} failed: {reason}")]
    Handshake {
        /// `host:port`.
        addr: String,
        /// What rustls said.
        reason: String,
    },
    /// The server ended the connection right after the handshake: it
    /// refused the client's certificate (none, expired, another CA's).
    #[error("{addr} refused the client certificate: {reason}")]
    Refused {
        /// `host:port`.
        addr: String,
        /// What the server's alert or the closed connection said.
        reason: String,
    },
}

impl NatsConfig {
    /// Makes a TLS handshake with each server in the URL, with this
    /// config's CA and client certificate, and returns the first failure
    /// that is the handshake's (or, if no server could be reached, that).
    /// No handshake is made with a server that sends no INFO line (the
    /// NATS client waits for one before any TLS), nor, for a config
    /// without TLS settings, with one whose INFO does not require TLS;
    /// websocket servers are left out. `Ok` when a handshake with one of
    /// them succeeded, no server required one of a config without TLS, or
    /// there was no server to probe.
    pub async fn probe_tls(&self) -> Result<TlsProbeOutcome, TlsProbeError> {
        let uses_tls = self.uses_tls();
        // A client without TLS settings needs the system's roots only if a
        // server requires TLS: not finding any is that server's failure.
        let tls = match self.probe_client_config() {
            Ok(config) => Ok(Arc::new(config)),
            Err(error) if uses_tls => return Err(error),
            Err(error) => Err(error.to_string()),
        };
        let servers = self
            .servers()
            .map_err(|error| TlsProbeError::Config(error.to_string()))?;
        let mut unreachable = None;
        // A websocket port answers HTTP, not INFO, and the client makes no
        // TLS upgrade of its own there.
        for server in servers.into_iter().filter(|server| !server.is_websocket()) {
            match probe_one(&tls, uses_tls, server.host(), server.port()).await {
                Ok(outcome) => return Ok(outcome),
                Err(error @ TlsProbeError::Unreachable { .. }) => {
                    unreachable.get_or_insert(error);
                }
                Err(error) => return Err(error),
            }
        }
        // Only websocket servers: nothing was probed.
        unreachable.map_or(Ok(TlsProbeOutcome::NotProbed), Err)
    }

    /// Whether this config asks for TLS itself: a CA, a client certificate
    /// or a `tls://` URL (without them, the client upgrades only when the
    /// server requires it).
    pub(super) fn uses_tls(&self) -> bool {
        let tls_url = self
            .url
            .split(',')
            .any(|url| url.trim().to_ascii_lowercase().starts_with("tls://"));
        tls_url || self.tls_ca.is_some() || self.tls_cert.is_some()
    }

    /// The rustls client configuration the NATS client would use: this
    /// config's CA as the only root (the system's roots without one), and
    /// its client certificate if any.
    fn probe_client_config(&self) -> Result<rustls::ClientConfig, TlsProbeError> {
        let config_error = |error: String| TlsProbeError::Config(error);
        let mut roots = rustls::RootCertStore::empty();
        if let Some(ca) = &self.tls_ca {
            for certificate in
                CertificateDer::pem_file_iter(ca).map_err(|e| config_error(e.to_string()))?
            {
                let certificate = certificate.map_err(|e| config_error(e.to_string()))?;
                roots
                    .add(certificate)
                    .map_err(|e| config_error(e.to_string()))?;
            }
        } else {
            let (added, _) =
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if added == 0 {
                return Err(config_error(
                    "no --tls-ca given and no system root certificate found".to_owned(),
                ));
            }
        }
        // The provider the NATS client uses too.
        crate::http_client::install_crypto_provider();
        let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| config_error(e.to_string()))?;
                let key =
                    PrivateKeyDer::from_pem_file(key).map_err(|e| config_error(e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| config_error(e.to_string()))
            }
            _ => Ok(builder.with_no_client_auth()),
        }
    }
}

/// One server: connect, read its INFO (sent before the TLS upgrade), make
/// the handshake (without TLS settings, only if the INFO requires TLS), and
/// wait a moment for a refusal of the client's certificate. `tls` is the rustls configuration, or why none
/// could be made.
async fn probe_one(
    tls: &Result<Arc<rustls::ClientConfig>, String>,
    uses_tls: bool,
    host: &str,
    port: u16,
) -> Result<TlsProbeOutcome, TlsProbeError> {
    let addr = format!("{host}:{port}");
    let unreachable = |reason: String| TlsProbeError::Unreachable {
        addr: addr.clone(),
        reason,
    };
    let tcp = tokio::time::timeout(STEP, TcpStream::connect((host, port)))
        .await
        .map_err(|_| unreachable("no answer".to_owned()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let mut reader = BufReader::new(tcp);
    let mut info = String::new();
    // Bounded: what answers may not be a NATS server.
    let mut first_line = (&mut reader).take(INFO_MAX);
    let read = tokio::time::timeout(STEP, first_line.read_line(&mut info)).await;
    // The NATS client waits for the server's INFO before any TLS (wakebus
    // does not ask for the handshake first): without one, TLS is not what
    // fails. A proxy with no server behind it accepts and closes (or
    // resets) at once.
    let no_info = match read {
        Ok(Ok(0)) => Some("it closed the connection before sending its INFO".to_owned()),
        Ok(Err(error)) => Some(format!("the connection failed before its INFO: {error}")),
        Err(_) if info.is_empty() => {
            Some(format!("no INFO came within {STEP:?}: not a NATS server?"))
        }
        // Another service's banner (SSH, SMTP) on a wrong port.
        _ if !info.starts_with("INFO") => Some(format!(
            "not a NATS server: it said {:?}",
            info.chars().take(80).collect::<String>()
        )),
        _ => None,
    };
    if let Some(reason) = no_info {
        return Err(unreachable(reason));
    }
    // Without TLS settings the client upgrades only for an INFO that
    // requires it: no handshake of ours can tell anything about another.
    if !uses_tls && !requires_tls(&info) {
        return Ok(TlsProbeOutcome::NoTls);
    }
    let tls = tls
        .as_ref()
        .map_err(|error| TlsProbeError::Config(format!("the server requires TLS, and {error}")))?;
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| TlsProbeError::Config(format!("server name {host}: {e}")))?;
    let handshake =
        tokio_rustls::TlsConnector::from(tls.clone()).connect(name, reader.into_inner());
    let handshake_failed = |reason: String| TlsProbeError::Handshake {
        addr: addr.clone(),
        reason,
    };
    let mut stream = tokio::time::timeout(STEP, handshake)
        .await
        .map_err(|_| handshake_failed("no answer".to_owned()))?
        .map_err(|e| handshake_failed(e.to_string()))?;
    let refused = |reason: String| TlsProbeError::Refused {
        addr: addr.clone(),
        reason,
    };
    let mut byte = [0u8; 1];
    match tokio::time::timeout(REFUSAL_WAIT, stream.read(&mut byte)).await {
        // The server waits for the client's CONNECT: the handshake held.
        Err(_) | Ok(Ok(1..)) => Ok(TlsProbeOutcome::Handshake),
        Ok(Ok(0)) => Err(refused("it closed the connection".to_owned())),
        Ok(Err(e)) => Err(refused(e.to_string())),
    }
}

/// Whether a server's INFO line requires TLS (`"tls_required":true`). A
/// line that is not INFO does not: the client would not upgrade for it.
fn requires_tls(info: &str) -> bool {
    info.strip_prefix("INFO")
        .and_then(|json| serde_json::from_str::<serde_json::Value>(json.trim()).ok())
        .and_then(|info| {
            info.get("tls_required")
                .and_then(serde_json::Value::as_bool)
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_info_line_that_says_so_requires_tls() {
        assert!(requires_tls(
            "INFO {\"server_id\":\"x\",\"tls_required\":true,\"port\":4222}\r\n"
        ));
        for line in [
            "INFO {\"server_id\":\"x\",\"tls_required\":false}\r\n",
            "INFO {\"server_id\":\"x\"}\r\n",
            "INFO not json\r\n",
            "HTTP/1.1 400 Bad Request\r\n",
            "",
        ] {
            assert!(!requires_tls(line), "{line:?}");
        }
    }
}
