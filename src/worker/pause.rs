//! A worker whose executor refuses it (an LLM endpoint rejecting its API
//! key) takes no task for a while, so that the pool's other workers run
//! them. Asking for tasks it could only hand back, it would take most of
//! them (it is the worker always free), and each task would use up its
//! deliveries there and fail, however many healthy workers the pool has.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How long a refused worker takes no task by default: long enough for the pool's
/// other workers to take what it handed back, short enough that a key
/// fixed at the endpoint is in use again soon.
pub(crate) const REFUSED_PAUSE: Duration = Duration::from_secs(30);

/// Until when the worker takes no task.
#[derive(Debug, Default)]
pub(crate) struct TakingPause {
    /// The end of the pause under way, if any.
    until: Mutex<Option<Instant>>,
}

impl TakingPause {
    /// Takes no task for `pause` from now; true if no pause was under way
    /// (one refusal of many tasks at once is one pause, and one warning).
    pub(crate) fn begin(&self, pause: Duration) -> bool {
        let now = Instant::now();
        let mut until = self.until.lock().expect("pause lock");
        let began = until.is_none_or(|end| end <= now);
        *until = Some(until.map_or(now + pause, |end| end.max(now + pause)));
        began
    }

    /// When taking tasks may resume, while a pause is under way.
    pub(crate) fn until(&self) -> Option<Instant> {
        let until = *self.until.lock().expect("pause lock");
        until.filter(|end| *end > Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_begins_once_and_a_new_one_after_it_ended() {
        let pause = TakingPause::default();
        assert_eq!(pause.until(), None);
        assert!(pause.begin(Duration::from_secs(30)));
        assert!(!pause.begin(Duration::from_secs(30)), "already under way");
        assert!(pause.until().is_some());

        let ended = TakingPause::default();
        assert!(ended.begin(Duration::ZERO));
        assert_eq!(ended.until(), None, "over at once");
        assert!(ended.begin(Duration::from_secs(30)), "a new one");
    }
}
