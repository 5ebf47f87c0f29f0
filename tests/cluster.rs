//! A 3-node JetStream cluster: streams and buckets get 3 replicas by
//! default, and delegations survive the crash and restart of the node that
//! leads the events stream, and a rolling restart of every node, each woken
//! exactly once; `wakebus status` shows where each stream's replicas stand.

mod common;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use common::cli::wakebus;
use common::cluster::NatsCluster;
use common::*;
use serde_json::Value;
use wakebus::bus::{Bus, BusSettings};
use wakebus::connect::NatsConfig;
use wakebus::protocol::{Subjects, TaskRequest, new_delegation_id};
use wakebus::wake::lock::SessionLocks;
use wakebus::worker::executor::{EchoExecutor, Executor};

/// Delegations per run: a few thousand, within a minute on two cores.
const N: usize = 2_000;
/// Sessions they come from.
const SESSIONS: usize = 50;

async fn connect(urls: &str, prefix: &str) -> Bus {
    let client = NatsConfig::new(urls).connect().await.expect("connect");
    Bus::new(client, Subjects::new(prefix).expect("prefix"))
}

fn request(i: usize) -> TaskRequest {
    let mut request = TaskRequest::new(new_delegation_id(), format!("task {i}"));
    request.origin_session_id = Some(format!("session.{}", i % SESSIONS));
    request
}

async fn replicas(bus: &Bus, stream: &str) -> usize {
    let mut handle = bus.js.get_stream(stream).await.expect("stream");
    handle.info().await.expect("info").config.num_replicas
}

#[tokio::test]
async fn streams_and_buckets_get_three_replicas_on_a_three_node_cluster_by_default() {
    init_logs();
    let cluster = NatsCluster::start(3).await;
    let api = SessionApiServer::start().await;
    let prefix = unique_prefix();
    let bus = connect(&cluster.urls(), &prefix).await;
    assert_eq!(bus.default_replicas().await, 3);
    let mut services = Services::new();
    services.wake(&bus, test_wake_config(&api.url()));
    let s = &bus.subjects;
    let names = s.all_streams();
    wait_until(
        Duration::from_secs(20),
        "the wake service to provision",
        || async {
            let mut ready = true;
            for name in &names {
                ready &= bus.js.get_stream(name).await.is_ok();
            }
            ready
        },
    )
    .await;
    for name in &names {
        assert_eq!(replicas(&bus, name).await, 3, "{name}");
    }
    services.stop().await;

    // An explicit setting wins; without one, existing streams keep what
    // they have, so a node being down at start never rescales them.
    let other = connect(&cluster.urls(), &unique_prefix()).await;
    let one = BusSettings {
        replicas: Some(1),
        ..BusSettings::default()
    };
    other.provision(&one).await.expect("provision");
    assert_eq!(replicas(&other, &other.subjects.events_stream()).await, 1);
    other
        .provision(&BusSettings::default())
        .await
        .expect("provision");
    assert_eq!(replicas(&other, &other.subjects.events_stream()).await, 1);
}

/// Delegations through a pipeline on a cluster: two workers and a wake
/// service, each with its own connection to the cluster, as separate
/// processes would have, a publisher sending requests in the background,
/// and the session API counting continuations.
struct Flow {
    /// Receives the continuations.
    api: SessionApiServer,
    /// The publisher's connection, also used to inspect the streams.
    publisher: Bus,
    /// The workers and the wake service.
    services: Services,
    /// The [`N`] requests, each published by [`Flow::publish`].
    requests: Arc<Vec<TaskRequest>>,
    /// The session each delegation must wake.
    expected: HashMap<String, String>,
    /// Tasks publishing requests until JetStream stores them.
    publishing: Vec<tokio::task::JoinHandle<()>>,
}

impl Flow {
    async fn start(cluster: &NatsCluster) -> Self {
        let urls = cluster.urls();
        let api = SessionApiServer::start().await;
        let prefix = unique_prefix();
        let publisher = connect(&urls, &prefix).await;
        publisher
            .provision(&BusSettings::default())
            .await
            .expect("provision");
        let worker_bus = connect(&urls, &prefix).await;
        let wake_bus = connect(&urls, &prefix).await;
        let mut services = Services::new();
        for _ in 0..2 {
            services.worker(
                &worker_bus,
                Executor::Echo(EchoExecutor),
                test_worker_config("default"),
            );
        }
        // A lock whose holder lost the answer to its own create in a
        // failover expires soon.
        let settings = BusSettings {
            session_lock_ttl: Duration::from_secs(3),
            ..BusSettings::default()
        };
        services.wake_with(&wake_bus, settings, test_wake_config(&api.url()));

        let requests: Vec<TaskRequest> = (0..N).map(request).collect();
        let expected = requests
            .iter()
            .map(|r| {
                (
                    r.delegation_id.clone(),
                    r.origin_session_id.clone().unwrap(),
                )
            })
            .collect();
        Self {
            api,
            publisher,
            services,
            requests: Arc::new(requests),
            expected,
            publishing: Vec::new(),
        }
    }

    /// Publishes the requests in `range`, one after another, in the
    /// background.
    fn publish(&mut self, range: Range<usize>) {
        let bus = self.publisher.clone();
        let requests = self.requests.clone();
        self.publishing.push(tokio::spawn(async move {
            for request in &requests[range] {
                publish_until_stored(&bus, request).await;
            }
        }));
    }

    /// How many delegations have woken their session so far.
    fn woken(&self) -> usize {
        let ids: HashSet<String> = self
            .api
            .turns()
            .iter()
            .flat_map(|t| t.delegation_ids())
            .collect();
        ids.len()
    }

    /// Waits until at least `count` delegations have woken their session.
    async fn wait_woken(&self, count: usize) -> usize {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let n = self.woken();
            if n >= count {
                return n;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "stuck with {n} of {count} woken"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the services and checks that each delegation woke its own
    /// session in exactly one turn, a repeated post (a post in doubt) only
    /// ever under the key of the first.
    async fn finish(self) {
        for publishing in self.publishing {
            publishing.await.unwrap();
        }
        self.services.stop().await;
        let mut turns_per_delegation: HashMap<String, usize> = HashMap::new();
        for turn in self.api.turns() {
            for id in turn.delegation_ids() {
                assert_eq!(
                    self.expected[&id],
                    turn.session(),
                    "{id} woke the wrong session"
                );
                *turns_per_delegation.entry(id).or_default() += 1;
            }
        }
        assert_eq!(turns_per_delegation.len(), N, "some delegation never woke");
        let doubled: Vec<_> = turns_per_delegation
            .iter()
            .filter(|(_, n)| **n > 1)
            .collect();
        if !doubled.is_empty() {
            let events = self.publisher.subjects.events_stream();
            let mut report = String::new();
            for (id, _) in &doubled {
                for post in self.api.accepted() {
                    let ids = post.delegation_ids();
                    if ids.contains(id) {
                        report.push_str(&format!(
                            "\n{id}: key {:?} with {} completion(s)",
                            post.header("idempotency-key"),
                            ids.len()
                        ));
                    }
                }
                let copies = all_messages(&self.publisher, &events)
                    .await
                    .into_iter()
                    .filter(|m| m.subject.contains(id.as_str()) && m.subject.ends_with(".done"))
                    .count();
                report.push_str(&format!("\n{id}: {copies} done event(s) in the stream"));
            }
            panic!("woken more than once:{report}");
        }
        assert_eq!(self.api.delegations_under_two_keys(), Vec::<String>::new());
    }

    /// The nodes holding a replica of `stream`, its leader included.
    async fn members(&self, stream: &str) -> HashSet<String> {
        let mut stream = self.publisher.js.get_stream(stream).await.expect("stream");
        let info = stream.info().await.expect("info");
        let cluster = info.cluster.as_ref().expect("clustered stream");
        cluster
            .leader
            .iter()
            .cloned()
            .chain(cluster.replicas.iter().map(|r| r.name.clone()))
            .collect()
    }
}

#[tokio::test]
async fn every_delegation_wakes_exactly_once_when_the_events_stream_leader_crashes_and_returns() {
    init_logs();
    let mut cluster = NatsCluster::start(3).await;
    let mut flow = Flow::start(&cluster).await;
    let events = flow.publisher.subjects.events_stream();
    let client = flow.publisher.client.clone();
    flow.publish(0..N);
    flow.wait_woken(N / 4).await;
    let victim = cluster.stream_leader(&client, &events).await;
    cluster.kill(victim);
    flow.wait_woken(N / 2).await;
    let leader = cluster.stream_leader(&client, &events).await;
    assert_ne!(leader, victim, "a surviving node took over the stream");
    cluster.restart(victim).await;
    flow.wait_woken(N).await;
    // The restarted node is back in the stream's replica set.
    let members = flow.members(&events).await;
    assert!(
        members.contains(&format!("n{victim}")),
        "n{victim} is not back among {members:?}"
    );
    flow.finish().await;
}

#[tokio::test]
async fn every_delegation_wakes_exactly_once_through_a_rolling_restart_of_every_node() {
    init_logs();
    let mut cluster = NatsCluster::start(3).await;
    let mut flow = Flow::start(&cluster).await;
    // As for an upgrade: one node at a time, each stopped with SIGTERM
    // while a quarter of the delegations is on its way and started again,
    // the next only once /healthz says every node is current. Every stream,
    // bucket and consumer loses its leader on the way, whichever node led
    // it. The last quarter goes through the cluster after all three.
    let quarter = N / 4;
    for node in 0..3 {
        flow.publish(node * quarter..(node + 1) * quarter);
        let woken = flow.wait_woken(node * quarter + 1).await;
        assert!(
            woken < (node + 1) * quarter,
            "n{node}'s quarter was all woken before n{node} was stopped"
        );
        cluster.restart_gracefully(node).await;
    }
    flow.publish(3 * quarter..N);
    flow.wait_woken(N).await;
    let s = &flow.publisher.subjects;
    for stream in s.all_streams() {
        assert_eq!(flow.members(&stream).await.len(), 3, "{stream}");
    }
    flow.finish().await;
}

#[tokio::test]
async fn releasing_one_session_lock_keeps_every_other_lock_on_every_replica() {
    init_logs();
    let mut cluster = NatsCluster::start(3).await;
    let bus = connect(&cluster.urls(), &unique_prefix()).await;
    // Locks that outlive the three failovers below.
    let settings = BusSettings {
        session_lock_ttl: Duration::from_secs(600),
        ..BusSettings::default()
    };
    let kv = bus
        .provision_wake_state(&settings)
        .await
        .expect("provision")
        .session_locks;
    let stream = Subjects::bucket_stream(&bus.subjects.session_lock_bucket());
    let locks = SessionLocks::new(
        bus.js.clone(),
        kv.clone(),
        "wake-a",
        settings.session_lock_ttl,
    );
    let _held = locks
        .try_acquire("held")
        .await
        .unwrap()
        .expect("a free lock");
    let released = locks
        .try_acquire("released")
        .await
        .unwrap()
        .expect("a free lock");
    locks.release(released).await;
    // Each replica in turn leads the bucket's stream: none of them lost the
    // lock that was not released, or kept the one that was.
    for round in 0..3 {
        let leader = cluster.stream_leader(&bus.client, &stream).await;
        cluster.kill(leader);
        let next = cluster.stream_leader(&bus.client, &stream).await;
        assert_ne!(next, leader);
        wait_until(
            Duration::from_secs(20),
            "the new leader to answer",
            || async { kv.get("held").await.is_ok() },
        )
        .await;
        assert!(
            kv.get("held").await.unwrap().is_some(),
            "n{next} lost a held lock (failover {round})"
        );
        assert!(
            kv.get("released").await.unwrap().is_none(),
            "n{next} kept a released lock (failover {round})"
        );
        cluster.restart(leader).await;
        wait_until(Duration::from_secs(30), "every replica current", || async {
            let Ok(mut handle) = bus.js.get_stream(&stream).await else {
                return false;
            };
            let Ok(info) = handle.info().await else {
                return false;
            };
            info.cluster.as_ref().is_some_and(|c| {
                c.leader.is_some() && c.replicas.len() == 2 && c.replicas.iter().all(|r| r.current)
            })
        })
        .await;
    }
}

#[tokio::test]
async fn status_names_each_streams_leader_and_the_replicas_that_are_not_current() {
    init_logs();
    let mut cluster = NatsCluster::start(3).await;
    let prefix = unique_prefix();
    let bus = connect(&cluster.urls(), &prefix).await;
    bus.provision(&BusSettings::default())
        .await
        .expect("provision");
    bus.provision_wake_state(&BusSettings::default())
        .await
        .expect("provision");
    let s = &bus.subjects;
    let names = s.all_streams();
    // Any node answers for the whole cluster; n0 stays up.
    let n0 = cluster.nodes[0].url();
    // The snapshot, or `None` while a request of it times out (a stream
    // or consumer whose leader was lost answers only once another is
    // elected).
    let status = async |args: &[&str]| {
        let run = wakebus(&n0, &prefix, args).await;
        (run.code() == Some(0)).then(|| run.stdout())
    };
    let streams = async || -> Option<Vec<Value>> {
        let report: Value = serde_json::from_str(&status(&["status", "--json"]).await?).unwrap();
        Some(report["streams"].as_array().unwrap().clone())
    };
    for stream in streams().await.expect("status") {
        assert_eq!(stream["replicas"], 3, "{stream}");
        let set = &stream["cluster"];
        assert!(set["leader"].is_string(), "{stream}");
        assert_eq!(set["followers"].as_array().unwrap().len(), 2, "{stream}");
    }

    // n2 goes away. Wherever it led, another node takes over, and every
    // stream names it among the followers that are not current.
    cluster.kill(2);
    let reported = eventually(Duration::from_secs(30), "n2 reported behind", || async {
        let reported = streams().await?;
        reported
            .iter()
            .all(|stream| {
                let set = &stream["cluster"];
                set["leader"].is_string()
                    && set["leader"] != "n2"
                    && set["followers"].as_array().unwrap().iter().any(|f| {
                        f["name"] == "n2" && (f["current"] == false || f["offline"] == true)
                    })
            })
            .then_some(reported)
    })
    .await;
    let listed: Vec<&str> = reported
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(listed, names.iter().map(String::as_str).collect::<Vec<_>>());
    let text = status(&["status"]).await.expect("status");
    let events_row = text
        .lines()
        .find(|line| line.contains(&s.events_stream()))
        .expect("a row for the events stream");
    assert!(events_row.contains("n2 "), "{text}");
    assert!(
        text.contains("restart no other NATS node before they are"),
        "{text}"
    );

    // Back and caught up: nothing left to report.
    cluster.restart(2).await;
    cluster.wait_healthy().await;
    eventually(Duration::from_secs(30), "every replica current", || async {
        let text = status(&["status"]).await?;
        (!text.contains("restart no other NATS node")).then_some(())
    })
    .await;
}
