//! What taking and releasing a session lock costs, by how it is done.
//!
//! `cargo bench --bench locks` starts its own nats-server and, for each
//! way, takes and releases locks on 1,000 session keys in turn (each key
//! already taken and released once, as a busy wake's keys are), one cycle at
//! a time, reporting wall time and nats-server CPU per cycle:
//!
//! - **KV create + KV delete** (the async-nats calls, what wakebus did
//!   before): the delete marker stays as the key's last message, so the
//!   next create is refused by it, reads it and updates over it.
//! - **`SessionLocks`** (what wakebus does): the same marker, but published
//!   by the lock itself, which remembers its revision, so the next take is
//!   one update conditioned on it.
//! - **purge** (measured, not used): the key is purged below the holder's
//!   revision + 1, so the next take is a single create. nats-server before
//!   2.9.18 replays such a purge on a restarted cluster replica as a purge
//!   of the whole stream (src/wake/lock.rs).
//!
//! The three alternate over `WAKEBUS_BENCH_ROUNDS` (3) rounds of
//! `WAKEBUS_BENCH_CYCLES` (5000) cycles on fresh buckets of one server.

#[path = "pipeline/nats.rs"]
mod nats;
// Only its CPU reading is used here.
#[allow(dead_code)]
#[path = "pipeline/procs.rs"]
mod procs;

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::protocol::Subjects;
use wakebus::wake::lock::SessionLocks;

use nats::NatsServer;

const KEYS: usize = 1_000;

/// How a lock is taken and released.
#[derive(Clone, Copy, Debug)]
enum Release {
    /// `kv::Store::create`, then `delete_expect_revision`.
    KvDelete,
    /// `SessionLocks::try_acquire`, then `release`.
    SessionLocks,
    /// `kv::Store::create`, then a purge below the revision + 1.
    Purge,
}

#[tokio::main]
async fn main() {
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (rounds, cycles) = (
        env("WAKEBUS_BENCH_ROUNDS", 3),
        env("WAKEBUS_BENCH_CYCLES", 5_000),
    );
    let server = NatsServer::start().await;
    println!("wakebus lock bench: {}", server.version);
    println!(
        "{:<14} {:>18} {:>26}",
        "take, release", "wall µs/cycle", "nats-server CPU µs/cycle"
    );
    for round in 0..rounds {
        for how in [Release::KvDelete, Release::SessionLocks, Release::Purge] {
            let (js, kv) = bucket(&server, &format!("lk{round}{how:?}").to_lowercase()).await;
            let locks = SessionLocks::new(js, kv.clone(), "bench", Duration::from_secs(30));
            let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
            for key in &keys {
                cycle(&locks, &kv, key, how).await;
            }
            let (cpu, started) = (procs::cpu_seconds(server.pid()), Instant::now());
            for i in 0..cycles {
                cycle(&locks, &kv, &keys[i % KEYS], how).await;
            }
            let wall = started.elapsed().as_secs_f64();
            let cpu = procs::cpu_seconds(server.pid()) - cpu;
            let per = |s: f64| s * 1e6 / cycles as f64;
            println!(
                "{:<14} {:>18.0} {:>26.0}",
                format!("{how:?}"),
                per(wall),
                per(cpu)
            );
        }
    }
}

/// A JetStream context and a fresh session-lock bucket under `prefix`.
async fn bucket(server: &NatsServer, prefix: &str) -> (jetstream::Context, kv::Store) {
    let client = NatsConfig::new(&server.url)
        .connect()
        .await
        .expect("connect");
    let bus = Bus::new(client, Subjects::new(prefix).expect("prefix"));
    let kv = bus
        .provision_wake_state(&BusSettings::default())
        .await
        .expect("provision")
        .session_locks;
    (bus.js, kv)
}

/// Takes the lock on `key` and releases it.
async fn cycle(locks: &SessionLocks, kv: &kv::Store, key: &str, how: Release) {
    match how {
        Release::KvDelete => {
            let revision = kv.create(key, "bench".into()).await.expect("take");
            kv.delete_expect_revision(key, Some(revision))
                .await
                .expect("release");
        }
        Release::SessionLocks => {
            let guard = locks.try_acquire(key).await.expect("take").expect("free");
            locks.release(guard).await;
        }
        Release::Purge => {
            let revision = kv.create(key, "bench".into()).await.expect("take");
            kv.stream
                .purge()
                .filter(format!("{}{key}", kv.prefix))
                .sequence(revision + 1)
                .await
                .expect("release");
        }
    }
}
