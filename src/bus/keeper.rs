//! Keeping a running service's consumer in place.
//!
//! A service whose consumer is deleted under it (by hand, or lost with a
//! cluster's data) gets nothing and is told nothing: the pull in flight ends
//! with a 409 once, and later pulls go unanswered. So each worker and wake
//! instance checks its consumer every `--consumer-check` (6 s by default)
//! plus up to as much again at random (so that instances started together do
//! not ask together), and creates it again when JetStream says, twice and
//! 2 s apart, that it does not exist (a node that has just restarted or become
//! leader can answer "not found" for a consumer that exists until it has
//! caught up). It creates it with `create_consumer_strict`: nats-server 2.10
//! and later refuse it for a consumer that exists with other settings (the
//! same settings are a no-op); 2.9 ignores the action, so it updates one
//! that exists.
//!
//! A wake consumer created again starts right after the ack floor of the one
//! the keeper last saw (the oldest completion not yet acknowledged), not at
//! the beginning of the events stream: starting there would read the whole
//! history again and post again every completion that was acknowledged
//! without a `delivered` ledger entry (those the session API refused, which
//! went to the dead letters). It starts at the beginning when there is no
//! such floor: none was seen, or the floor is not of this stream (the stream
//! is newer than the consumer it was seen on, or does not reach that
//! sequence: made anew, or restored from a backup). A worker consumer starts
//! at the beginning of the task queue, which holds only what was not
//! acknowledged.
//!
//! What the keeper sees also times the service's in-progress acks
//! ([`KeepAliveEvery`]): another instance, or `wakebus init`, may have given
//! the shared consumer a shorter AckWait than this service's `--ack-wait`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
use backon::BackoffBuilder;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, error, info, warn};

use super::{Bus, ServiceConsumer};

/// How long after a first "not found" the keeper asks again before it
/// believes it.
pub(super) const CONFIRM_AFTER: Duration = Duration::from_secs(2);

/// The waits between checks: `every` plus up to as much again at random.
fn check_delays(every: Duration) -> backon::ConstantBackoff {
    backon::ConstantBuilder::default()
        .with_delay(every)
        .with_jitter()
        .without_max_times()
        .build()
}

/// What a check found.
#[derive(Debug)]
enum Found {
    /// The consumer exists, as the server describes it.
    Exists(Box<consumer::Info>),
    /// JetStream says it does not exist.
    Missing,
}

/// Where the consumer the keeper last saw had got to.
#[derive(Debug, Clone, Copy)]
struct Floor {
    /// Its ack floor, a stream sequence: everything up to it was
    /// acknowledged.
    sequence: u64,
    /// When that consumer was created (the server's clock): a stream
    /// created after it is not the stream `sequence` belongs to.
    consumer_created: time::OffsetDateTime,
}

/// How often a service sends in-progress acks for the work it holds: a
/// third of the shorter of its own `--ack-wait` and its consumer's AckWait
/// as the keeper last saw it. Timed by its own setting alone, a service
/// whose consumer another instance (or `init`) gave a shorter AckWait would
/// keep its work alive too late, and a task still running here would be
/// redelivered to another worker and run twice.
#[derive(Debug, Clone)]
pub(crate) struct KeepAliveEvery {
    /// This service's `--ack-wait`.
    ours: Duration,
    /// The consumer's AckWait at the keeper's last check, in nanoseconds
    /// (0 before the first); shared with the keeper, read at every look of
    /// a keep-alive clock (at least once a second).
    seen_nanos: Arc<AtomicU64>,
}

impl KeepAliveEvery {
    /// Timed by `ours` until the keeper has seen the consumer.
    pub(crate) fn new(ours: Duration) -> Self {
        Self {
            ours,
            seen_nanos: Arc::default(),
        }
    }

    /// The time from one keep-alive to the next, as of now.
    pub(crate) fn period(&self) -> Duration {
        (self.ack_wait() / 3).max(Duration::from_millis(100))
    }

    /// The AckWait the work is held under, as far as this service knows:
    /// the shorter of its own and the consumer's.
    fn ack_wait(&self) -> Duration {
        match self.seen_nanos.load(Ordering::Relaxed) {
            0 => self.ours,
            seen => self.ours.min(Duration::from_nanos(seen)),
        }
    }

    /// Records the consumer's AckWait.
    fn saw(&self, ack_wait: Duration) {
        let nanos = u64::try_from(ack_wait.as_nanos()).unwrap_or(u64::MAX);
        self.seen_nanos.store(nanos, Ordering::Relaxed);
    }
}

/// When held work is next due for an in-progress ack: a period after the
/// last one sent (or after the work arrived), the period read again at
/// every look, so that an AckWait the consumer check found shortened since
/// applies to work already held, not only from its next keep-alive on.
#[derive(Debug)]
pub(crate) struct KeepAliveClock {
    /// The period.
    every: KeepAliveEvery,
    /// When the last keep-alive went out (or the work arrived).
    sent: Instant,
    /// Set when the last one was skipped (the client disconnected): when
    /// to try again, sooner than a period.
    retry_at: Option<Instant>,
    /// Whether a gap between keep-alives was ever long enough for the
    /// delivery to have lapsed ([`Self::may_have_lapsed`]): once it went
    /// elsewhere, a keep-alive sent after that does not bring it back.
    lapsed: bool,
}

/// How often a keep-alive clock looks at the period again while it waits.
const PERIOD_RECHECK: Duration = Duration::from_secs(1);

impl KeepAliveClock {
    /// A clock for work that arrived now.
    pub(crate) fn new(every: KeepAliveEvery) -> Self {
        Self {
            every,
            sent: Instant::now(),
            retry_at: None,
            lapsed: false,
        }
    }

    /// When to look again: when the next keep-alive is due, or in a
    /// second if that is later.
    pub(crate) fn look_at(&self) -> Instant {
        self.due().min(Instant::now() + PERIOD_RECHECK)
    }

    /// Whether the next keep-alive is due now.
    pub(crate) fn is_due(&self) -> bool {
        Instant::now() >= self.due()
    }

    /// Records a keep-alive round: `sent` false when it was skipped (the
    /// client disconnected), to be tried again after
    /// [`KEEP_ALIVE_RETRY`](crate::outcome::KEEP_ALIVE_RETRY), so that the
    /// first after a reconnect is not a period late.
    pub(crate) fn went_out(&mut self, sent: bool) {
        if sent {
            self.lapsed |= self.gap_too_long();
            self.sent = Instant::now();
            self.retry_at = None;
        } else {
            self.retry_at = Some(Instant::now() + crate::outcome::KEEP_ALIVE_RETRY);
        }
    }

    fn due(&self) -> Instant {
        self.retry_at
            .unwrap_or_else(|| self.sent + self.every.period())
    }

    /// Whether the work may no longer be this service's: two thirds of
    /// the AckWait or more went by without a keep-alive (or since the work
    /// arrived), now or at any time before, twice the usual gap, as in an
    /// outage or a stall. The server may have delivered it elsewhere, and
    /// a NAK sent for this delivery would settle that other one (the
    /// server checks only the stream sequence), sending a task another
    /// worker runs to a third.
    pub(crate) fn may_have_lapsed(&self) -> bool {
        self.lapsed || self.gap_too_long()
    }

    /// Whether the time since the last keep-alive is long enough for the
    /// delivery to have lapsed.
    fn gap_too_long(&self) -> bool {
        self.sent.elapsed() >= self.every.ack_wait() * 2 / 3
    }
}

/// One service's keeper and what it remembers between checks.
struct Keeper {
    /// The service's connection.
    bus: Bus,
    /// The consumer and the settings the service gives it.
    wanted: ServiceConsumer,
    /// Told the consumer's AckWait at every check that finds it.
    keep_alive: KeepAliveEvery,
    /// Where the consumer had got to at the last check that found it.
    floor: Option<Floor>,
    /// The consumer's AckWait last warned about, so that one differing
    /// setting is one warning, not one every check.
    warned_ack_wait: Option<Duration>,
    /// The settings last found changed under the service and reported,
    /// so that one change is one ERROR, not one every check.
    warned_drift: Vec<&'static str>,
    /// Whether the missing stream was warned about since it was last seen.
    warned_no_stream: bool,
    /// Whether a failed create was warned about since the consumer was
    /// last seen or made.
    warned_create: bool,
    /// Since when checks have failed (not answered: neither found nor
    /// missing), and when that was last warned about.
    failing: Option<(Instant, Option<Instant>)>,
}

/// How long checks may fail in a row before it is a warning (a leader
/// election passes sooner), and how often it is said again while they do.
const CHECKS_FAILING_WARN_AFTER: Duration = Duration::from_secs(60);
const CHECKS_FAILING_WARN_EVERY: Duration = Duration::from_secs(600);

impl Bus {
    /// Keeps `wanted` in place (see the module doc) until the returned
    /// guard is dropped: checks it at once, then every `every` to twice
    /// that while connected. Also returns the service's keep-alive period,
    /// which follows the consumer's AckWait as the checks find it.
    pub(crate) fn keep_consumer(
        &self,
        wanted: ServiceConsumer,
        every: Duration,
    ) -> (DropGuard, KeepAliveEvery) {
        let stop = CancellationToken::new();
        let keep_alive = KeepAliveEvery::new(wanted.ack_wait());
        let keeper = Keeper {
            bus: self.clone(),
            wanted,
            keep_alive: keep_alive.clone(),
            floor: None,
            warned_ack_wait: None,
            warned_drift: Vec::new(),
            warned_no_stream: false,
            warned_create: false,
            failing: None,
        };
        tokio::spawn(keeper.keeping(every, stop.clone()));
        (stop.drop_guard(), keep_alive)
    }
}

impl Keeper {
    /// The keeper's loop, until `stop`.
    async fn keeping(mut self, every: Duration, stop: CancellationToken) {
        let mut delays = check_delays(every);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.round() => {}
            }
            let delay = delays.next().unwrap_or(every);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One check, and what follows from it.
    async fn round(&mut self) {
        if !crate::connect::is_connected(&self.bus.client) {
            // An outage is not a consumer that cannot be checked: failures
            // count from when the client is back (a warning given is
            // remembered, for the line saying it is over).
            if let Some((since, _)) = self.failing.as_mut() {
                *since = Instant::now();
            }
            return;
        }
        let found = match self.check().await {
            Ok(Found::Missing) => {
                tokio::time::sleep(CONFIRM_AFTER).await;
                self.check().await
            }
            found => found,
        };
        let consumer = self.wanted.name(&self.bus.subjects);
        if found.is_ok()
            && let Some((since, Some(_))) = self.failing
        {
            info!(%consumer, failed_for = ?since.elapsed(), "The consumer could be checked again.");
        }
        if found.is_ok() {
            self.failing = None;
        }
        match found {
            Ok(Found::Exists(info)) => self.seen(&info),
            Ok(Found::Missing) => self.create_again().await,
            Err(error) if error.kind() == ConsumerInfoErrorKind::StreamNotFound => {
                self.failing = None;
                self.stream_missing();
            }
            Err(error) => {
                // Mostly transient (a leader election), and the pulls show
                // it too; but a consumer without a leader for good (its
                // quorum lost) gets this service no work, and a worker's
                // pulls then just end empty: said once a minute has passed,
                // and every ten while it lasts.
                let now = Instant::now();
                let (since, warned) = self.failing.get_or_insert((now, None));
                let due = now.duration_since(*since) >= CHECKS_FAILING_WARN_AFTER
                    && warned.is_none_or(|at| now.duration_since(at) >= CHECKS_FAILING_WARN_EVERY);
                if due {
                    *warned = Some(now);
                    warn!(%consumer, %error, failing_for = ?now.duration_since(*since), "The consumer could not be checked for a minute or more: if its stream or consumer has no leader, this service gets no work. Check `nats consumer info` and the cluster.");
                } else {
                    debug!(%consumer, %error, "Could not check that the consumer exists.");
                }
            }
        }
    }

    /// Asks JetStream for the consumer.
    async fn check(&self) -> Result<Found, ConsumerInfoError> {
        let subjects = &self.bus.subjects;
        let stream = self
            .bus
            .js
            .get_stream_no_info(self.wanted.stream(subjects))
            .await
            .map_err(|_| ConsumerInfoError::new(ConsumerInfoErrorKind::InvalidName))?;
        match stream.consumer_info(self.wanted.name(subjects)).await {
            Ok(info) => Ok(Found::Exists(Box::new(info))),
            Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => Ok(Found::Missing),
            Err(error) => Err(error),
        }
    }

    /// Remembers where the consumer has got to and its AckWait, and warns
    /// once when that AckWait is not this service's (`wakebus init` or another instance
    /// set it).
    fn seen(&mut self, info: &consumer::Info) {
        self.warned_no_stream = false;
        self.warned_create = false;
        // Never below where the consumer starts, nor below what was seen
        // of the same consumer: nats-server 2.9 answers an ack floor of 0
        // for a consumer made to start after a sequence until it acks
        // something, and a consumer lost again in a quiet period would
        // then be made from the stream's start.
        let mut sequence = info.ack_floor.stream_sequence;
        if let DeliverPolicy::ByStartSequence { start_sequence } = info.config.deliver_policy {
            sequence = sequence.max(start_sequence.saturating_sub(1));
        }
        if let Some(old) = self
            .floor
            .filter(|old| old.consumer_created == info.created)
        {
            sequence = sequence.max(old.sequence);
        }
        self.floor = Some(Floor {
            sequence,
            consumer_created: info.created,
        });
        debug!(consumer = %info.name, ack_floor = info.ack_floor.stream_sequence, "Consumer checked.");
        let (theirs, ours) = (info.config.ack_wait, self.wanted.ack_wait());
        self.keep_alive.saw(theirs);
        if theirs == ours {
            self.warned_ack_wait = None;
        } else if self.warned_ack_wait != Some(theirs) {
            self.warned_ack_wait = Some(theirs);
            warn!(consumer = %info.name, consumer_ack_wait = ?theirs, ack_wait = ?ours, "The consumer's AckWait is not this service's --ack-wait: held work is kept alive by the shorter one, and a stopped instance's work is redelivered after the consumer's. Give every instance the same --ack-wait (a starting instance sets its own).");
        }
        let drift =
            super::consumers::drifted(&info.config, &self.wanted.config(&self.bus.subjects));
        if !drift.is_empty() && drift != self.warned_drift {
            // The server refuses to change an ack policy on an update.
            let fix = if drift.contains(&"ack_policy") {
                "Delete the consumer (`nats consumer rm`): the services make it again with their settings."
            } else {
                "Restart one instance of the service to set them back."
            };
            error!(consumer = %info.name, settings = ?drift, fix, "The consumer's settings were changed under this service, and wakebus's guarantees rest on them (a server-side max_deliver strands a task that keeps failing, with no completion; another filter hands out the wrong tasks).");
        }
        self.warned_drift = drift;
    }

    /// The stream itself is gone: nothing can be created on it. Warned once
    /// until it is seen again.
    fn stream_missing(&mut self) {
        if !self.warned_no_stream {
            self.warned_no_stream = true;
            let subjects = &self.bus.subjects;
            let (stream, consumer) = (self.wanted.stream(subjects), self.wanted.name(subjects));
            warn!(%stream, %consumer, "The stream does not exist: this service gets no work until it is created again (`wakebus init`, or a service restart).");
        }
    }

    /// Creates the consumer again with the service's settings: a wake's
    /// starts after the last ack floor seen, if that floor belongs to this
    /// stream.
    async fn create_again(&mut self) {
        let subjects = &self.bus.subjects;
        let (stream, name) = (self.wanted.stream(subjects), self.wanted.name(subjects));
        let handle = match self.bus.js.get_stream(&stream).await {
            Ok(handle) => handle,
            Err(error) => {
                if super::is_stream_not_found(&error) {
                    self.stream_missing();
                } else {
                    warn!(consumer = %name, %stream, %error, "The consumer does not exist, and its stream could not be read to create it again; trying at the next check.");
                }
                return;
            }
        };
        let mut config = self.wanted.config(subjects);
        // Everything before this was acknowledged on the old consumer.
        let mut start_after = None;
        if let (ServiceConsumer::Wake { .. }, Some(floor)) = (&self.wanted, self.floor) {
            let stream_info = handle.cached_info();
            // The floor is of this stream only if the stream is not newer
            // than the consumer it came from, and holds that sequence (a
            // stream restored from a backup keeps its creation time).
            if floor.sequence > 0
                && stream_info.created <= floor.consumer_created
                && floor.sequence <= stream_info.state.last_sequence
            {
                let start_sequence = floor.sequence + 1;
                config.deliver_policy = DeliverPolicy::ByStartSequence { start_sequence };
                start_after = Some(floor.sequence);
            }
        }
        let create = |config| handle.create_consumer_strict(config);
        let refusal = super::consumers::strict_refusal;
        let created =
            super::consumers::within_ack_pending_limits(&mut config, 0, refusal, create).await;
        match created {
            Ok(created) => {
                self.warned_create = false;
                // Where the new consumer starts, until the next check. (The
                // start asked for is within the stream, so the server keeps
                // it; nats-server 2.9 answers an ack floor of 0 for it.)
                let info = created.cached_info();
                let sequence = start_after.unwrap_or(info.ack_floor.stream_sequence);
                self.floor = Some(Floor {
                    sequence,
                    consumer_created: info.created,
                });
                let from_sequence = sequence + 1;
                warn!(consumer = %name, %stream, from_sequence, "The consumer did not exist; it was created again with this service's settings.");
            }
            Err(error) => match self.check().await {
                Ok(Found::Exists(info)) => {
                    // Another instance was first (nats-server 2.10 and later
                    // refuse a create with other settings; 2.9 an update
                    // that changes the start).
                    debug!(consumer = %name, %stream, %error, "The consumer exists again.");
                    self.seen(&info);
                }
                Err(check) if check.kind() == ConsumerInfoErrorKind::StreamNotFound => {
                    self.stream_missing();
                }
                _ if self.warned_create => {
                    debug!(consumer = %name, %stream, %error, "The consumer could still not be created again.");
                }
                _ => {
                    // Once per streak: a refusal that lasts (a consumer
                    // limit, a rejected setting) would warn every check.
                    self.warned_create = true;
                    warn!(consumer = %name, %stream, %error, "The consumer could not be created again, and it could not be found after; trying at each check.");
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock whose last keep-alive went out `ago`.
    fn sent_ago(every: &KeepAliveEvery, ago: Duration) -> KeepAliveClock {
        let mut clock = KeepAliveClock::new(every.clone());
        clock.sent = Instant::now().checked_sub(ago).expect("a past instant");
        clock
    }

    #[test]
    fn a_delivery_may_have_lapsed_once_two_thirds_of_the_shorter_ack_wait_passed_unkept() {
        let every = KeepAliveEvery::new(Duration::from_secs(30));
        assert!(!KeepAliveClock::new(every.clone()).may_have_lapsed());
        assert!(!sent_ago(&every, Duration::from_secs(15)).may_have_lapsed());
        assert!(sent_ago(&every, Duration::from_secs(21)).may_have_lapsed());
        // A keep-alive skipped (disconnected) does not renew it, nor does
        // one sent after the gap: the delivery may be elsewhere by then.
        let mut clock = sent_ago(&every, Duration::from_secs(21));
        clock.went_out(false);
        assert!(clock.may_have_lapsed());
        clock.went_out(true);
        assert!(clock.may_have_lapsed());
        // Keep-alives in time keep it.
        let mut clock = sent_ago(&every, Duration::from_secs(10));
        clock.went_out(true);
        assert!(!clock.may_have_lapsed());
        // The consumer's shorter AckWait counts.
        every.saw(Duration::from_secs(9));
        assert!(sent_ago(&every, Duration::from_secs(7)).may_have_lapsed());
        assert!(!sent_ago(&every, Duration::from_secs(5)).may_have_lapsed());
    }
}
