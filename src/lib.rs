//! # wakebus
//!
//! Durable, horizontally scaled background delegation for AI-agent gateways,
//! on NATS JetStream.
//!
//! An agent session delegates a task; the request is published to
//! `<prefix>.task.<pool>`; any number of workers share the pool's durable
//! consumer, run the subagent and publish a completion event carrying the
//! origin session; the wake service consumes completions and posts a
//! continuation turn to the originating session. Everything is recorded in
//! JetStream.
//!
//! ```text
//! delegate ──► <prefix>.task.<pool> ──► workers ──► <prefix>.evt.<session>.<delegation>.<task>.done ──► wake ──► POST /v1/chat/completions
//!             (TASKS, work queue)                   (EVENTS, history)                                   (ledger + session locks in KV)
//! ```
//!
//! ## Layout
//!
//! - [`protocol`]: the wire contract: subjects, headers, request and event bodies.
//! - [`connect`]: connecting and authenticating to NATS (`tls_probe`: naming
//!   why a TLS handshake with it fails).
//! - [`bus`]: the connection to a deployment; provisioning streams, KV buckets
//!   and consumers; the queue check and dead letters.
//! - [`delegate`]: submitting delegations ([`delegate::Delegator`]).
//! - [`cancel`]: cancelling delegations and sessions (record and broadcast).
//! - [`worker`]: the worker loop, one-task handler and [`worker::executor`]s.
//! - [`wake`]: the wake service: session API client, ledger, locks, turn text.
//! - [`dev`]: `wakebus dev`, the whole loop on one machine.
//! - [`outcome`]: a message's disposition (ack, nak, term) as a value.
//! - [`history`]: filtered, ordered reads of the event and dead-letter history.
//! - [`replay`]: re-driving wakes and dead-lettered tasks; copying history.
//! - [`status`]: a one-screen snapshot of a deployment.
//! - [`ops`]: metrics, health endpoints and micro-service registration.
//! - [`quarantine`]: removing messages the NATS client cannot read.
//! - [`telemetry`]: trace context across hops; OTLP export (`otel` feature).
//! - `http_client` (private): what the HTTP clients share: the TLS
//!   provider, the plain-http rule, bounded reads of answers.
//!
//! The `wakebus` binary (`src/main.rs`, `src/cli/`) only parses arguments and
//! calls `run(config, shutdown)` functions from here.

pub mod bus;
pub mod cancel;
pub mod connect;
pub mod delegate;
pub mod dev;
pub mod history;
mod http_client;
pub mod ops;
pub mod outcome;
pub mod protocol;
pub mod quarantine;
pub mod replay;
pub mod status;
pub mod telemetry;
pub mod wake;
pub mod worker;

/// The version this build reports (`--version`, the NATS micro service,
/// `wakebus status`): the package's, with the commit it was built from as
/// semver build metadata (`0.1.0+g1a2b3c4d5e6f`) when known (`build.rs`).
pub const VERSION: &str = env!("WAKEBUS_VERSION");
