//! Running a service in production: Prometheus metrics ([`metrics`]),
//! health and readiness endpoints ([`http`]) and a client that asks them
//! ([`ready`]), and registration as a NATS
//! micro service ([`service`]) so that `wakebus status` and the standard
//! `nats micro` tooling can see every live worker and wake instance.

pub mod http;
pub mod metrics;
pub mod ready;
pub mod service;

/// Whether a service has started: set once its setup is done and it takes
/// work (pulls tasks, or completions), which its `/readyz` waits for. A
/// service whose setup retries without end (a cancel watch its NATS user
/// may not create, a stream it waits for) is not ready meanwhile.
#[derive(Debug, Clone, Default)]
pub struct Started(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Started {
    /// Marks the service started.
    pub fn mark(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the service has started.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}
