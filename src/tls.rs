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
        #[expect(
            deprecated,
            reason = "rustls 0.23.48 deprecates ring for lacking post-quantum key exchange; \
                      ring is the provider async-nats's TLS to NATS uses, and aws-lc-rs \
                      would add a C library to every build"
        )]
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
