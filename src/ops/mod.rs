//! Running a service in production: Prometheus metrics ([`metrics`]),
//! health and readiness endpoints ([`http`]), and registration as a NATS
//! micro service ([`service`]) so that `wakebus status` and the standard
//! `nats micro` tooling can see every live worker and wake instance.

pub mod http;
pub mod metrics;
pub mod service;
