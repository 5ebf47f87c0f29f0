//! Pacing the pull requests of a service whose pulls keep failing, and
//! sizing them to the consumer's limit.

use std::time::{Duration, Instant};

use tracing::{info, warn};

/// The most messages one pull of `consumer` asks for, `wanted` at most:
/// its `max_batch`, where one is set (the server gives a consumer the
/// limit its `max_request_batch` sets, and refuses a larger pull whole, so
/// a service asking for more never got a message).
pub(crate) fn pull_size(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
    wanted: usize,
) -> usize {
    match usize::try_from(consumer.cached_info().config.max_batch) {
        Ok(most) if most > 0 => wanted.min(most),
        _ => wanted,
    }
}

/// How long after a failed pull another failure starts a new streak.
const NEW_STREAK_AFTER: Duration = Duration::from_secs(30);

/// How often a streak that goes on is logged again as a warning.
const WARN_AGAIN_AFTER: Duration = Duration::from_secs(60);

/// Paces a consumer's pull requests while they keep ending in an error.
///
/// A pull that ends early (503 No Responders while the consumer elects a
/// leader, a heartbeat gone missing when the node holding the request went
/// away, a request that could not be sent) is asked again after 50 ms, but
/// an error that repeats would otherwise have the service pull, and log, a
/// few thousand times a second until JetStream answers again. The first
/// failure of a streak is a warning, and so is one a minute while it lasts
/// (with the count); the rest are debug lines, and the end of a streak is
/// logged with its length.
pub(crate) struct PullRetry {
    /// Which consumer pulls, for the log lines.
    consumer: &'static str,
    /// Failed pulls in a row; 0 while pulls work.
    failures: u32,
    /// When the last pull failed: a failure long after it starts a new
    /// streak (an idle consumer shows no pull that worked in between).
    last_failure: Option<Instant>,
    /// When the streak was last logged as a warning.
    last_warning: Option<Instant>,
    /// Delays before each next pull while they fail: from 50 ms, doubling
    /// up to 2 s, plus up to as much again in jitter.
    backoff: backon::ExponentialBackoff,
}

/// How a failed pull is logged.
#[derive(Debug, PartialEq, Eq)]
enum FailureLog {
    /// The first of a streak.
    Warn,
    /// The streak has lasted another `WARN_AGAIN_AFTER`.
    WarnAgain,
    /// Debug level.
    Quiet,
}

impl PullRetry {
    /// Pacing for the pulls of `consumer` (`"tasks"`, `"completions"`).
    pub(crate) fn new(consumer: &'static str) -> Self {
        Self {
            consumer,
            failures: 0,
            last_failure: None,
            last_warning: None,
            backoff: Self::backoff(),
        }
    }

    /// The delays between failed pulls, from the start of a streak.
    fn backoff() -> backon::ExponentialBackoff {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(2))
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// Records a pull that ended in `error`; returns how long to wait
    /// before the next one.
    pub(crate) fn failed(&mut self, error: &dyn std::fmt::Display) -> Duration {
        let consumer = self.consumer;
        crate::ops::metrics::pull_failed(consumer);
        match self.record_failure(Instant::now()) {
            FailureLog::Warn => {
                warn!(consumer, %error, "Pull ended with an error; pulling again.");
            }
            FailureLog::WarnAgain => {
                let failed_pulls = self.failures;
                warn!(consumer, %error, failed_pulls, "Pulls still end with an error; pulling again.");
            }
            FailureLog::Quiet => {
                let failures = self.failures;
                tracing::debug!(consumer, %error, failures, "Pull ended with an error again.");
            }
        }
        self.backoff.next().unwrap_or(Duration::from_secs(2))
    }

    /// Counts a failure at `now` and says how to log it.
    fn record_failure(&mut self, now: Instant) -> FailureLog {
        let long_after =
            |at: Option<Instant>, gap| at.is_some_and(|at| now.saturating_duration_since(at) > gap);
        if long_after(self.last_failure, NEW_STREAK_AFTER) {
            self.end_streak();
        }
        self.last_failure = Some(now);
        self.failures += 1;
        if self.failures == 1 {
            self.last_warning = Some(now);
            FailureLog::Warn
        } else if long_after(self.last_warning, WARN_AGAIN_AFTER) {
            self.last_warning = Some(now);
            FailureLog::WarnAgain
        } else {
            FailureLog::Quiet
        }
    }

    /// Records a pull that worked (it delivered, or expired with nothing to
    /// deliver).
    pub(crate) fn worked(&mut self) {
        if self.failures > 1 {
            info!(
                consumer = self.consumer,
                failed_pulls = self.failures,
                "Pulls work again."
            );
        }
        self.end_streak();
    }

    /// Forgets the streak: the next failure is the first of a new one.
    fn end_streak(&mut self) {
        if self.failures > 0 {
            self.failures = 0;
            self.last_warning = None;
            self.backoff = Self::backoff();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_that_keep_failing_are_spaced_out_and_the_first_that_works_resets_the_pace() {
        let mut pulls = PullRetry::new("tasks");
        let delays: Vec<Duration> = (0..10).map(|_| pulls.failed(&"503")).collect();
        assert_eq!(pulls.failures, 10);
        // From 50 ms up to 2 s, each plus up to as much again in jitter.
        assert!(delays[0] >= Duration::from_millis(50) && delays[0] < Duration::from_millis(100));
        assert!(delays[9] >= Duration::from_secs(2) && delays[9] <= Duration::from_secs(4));
        pulls.worked();
        assert_eq!(pulls.failures, 0);
        assert!(pulls.failed(&"409") < Duration::from_millis(100));
    }

    #[test]
    fn a_streak_warns_at_its_start_and_again_each_minute_it_lasts() {
        let mut pulls = PullRetry::new("completions");
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        assert_eq!(pulls.record_failure(at(0)), FailureLog::Warn);
        // A failure every 4 s (two missed heartbeats), for three minutes.
        let logged: Vec<(u64, FailureLog)> = (1..=45)
            .map(|i| (i * 4, pulls.record_failure(at(i * 4))))
            .filter(|(_, log)| *log != FailureLog::Quiet)
            .collect();
        assert_eq!(
            logged,
            [(64, FailureLog::WarnAgain), (128, FailureLog::WarnAgain)]
        );
        assert_eq!(pulls.failures, 46);
    }

    #[test]
    fn a_failure_long_after_the_last_starts_a_new_streak() {
        let mut pulls = PullRetry::new("completions");
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        assert_eq!(pulls.record_failure(at(0)), FailureLog::Warn);
        assert_eq!(pulls.record_failure(at(20)), FailureLog::Quiet);
        // An idle consumer: no pull worked in between, but 31 s passed.
        assert_eq!(pulls.record_failure(at(51)), FailureLog::Warn);
        assert_eq!(pulls.failures, 1);
    }
}
