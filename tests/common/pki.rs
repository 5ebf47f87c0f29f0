//! A private CA with a server certificate for 127.0.0.1 and a client
//! certificate, as PEM files, for TLS tests.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as
/// PEM files in `dir`.
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

pub fn pki(dir: &Path) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "wakebus test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>, common_name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) =
        leaf(vec!["127.0.0.1".into(), "localhost".into()], "nats-server");
    let (client_cert, client_key) = leaf(Vec::new(), "wakebus-client");
    Pki {
        ca: write(dir, "ca.pem", &ca_cert.pem()),
        server_cert: write(dir, "server.pem", &server_cert),
        server_key: write(dir, "server-key.pem", &server_key),
        client_cert: write(dir, "client.pem", &client_cert),
        client_key: write(dir, "client-key.pem", &client_key),
    }
}
