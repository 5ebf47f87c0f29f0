//! TLS setup shared by the HTTP clients.

use std::sync::Once;

/// Installs `ring` as the process's rustls crypto provider (once).
///
/// NATS already brings `ring`; using it for HTTPS too avoids a second crypto
/// library in the build.
pub(crate) fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Fails only if another provider was installed first, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
