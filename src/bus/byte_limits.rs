//! Byte limits of the streams and buckets (`wakebus init --max-bytes`).
//!
//! wakebus sets none by default: a stream at its limit refuses writes
//! (requests, completions) or, for the dead letters, drops its oldest. An
//! account that requires one (`max_bytes_required`, as hosted NATS
//! accounts do) refuses a stream without it, and every stream's limit is
//! reserved from the account's storage, so each part is sized on its own.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::protocol::Subjects;

/// A stream or bucket of a deployment, as `--max-bytes PART=SIZE` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Store {
    /// The requests stream (the task queue).
    Tasks,
    /// The events stream (the history).
    Events,
    /// The dead-letter stream.
    DeadLetters,
    /// The wake ledger bucket.
    WakeLedger,
    /// The cancel bucket.
    Cancels,
    /// The session-lock bucket.
    SessionLocks,
}

impl Store {
    /// Every one, in the order they are listed.
    pub const ALL: [Self; 6] = [
        Self::Tasks,
        Self::Events,
        Self::DeadLetters,
        Self::WakeLedger,
        Self::Cancels,
        Self::SessionLocks,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tasks => "tasks",
            Self::Events => "events",
            Self::DeadLetters => "dead-letters",
            Self::WakeLedger => "wake-ledger",
            Self::Cancels => "cancels",
            Self::SessionLocks => "session-locks",
        }
    }

    /// The JetStream stream that holds it.
    pub fn stream(self, subjects: &Subjects) -> String {
        match self {
            Self::Tasks => subjects.tasks_stream(),
            Self::Events => subjects.events_stream(),
            Self::DeadLetters => subjects.dead_letter_stream(),
            Self::WakeLedger => Subjects::bucket_stream(&subjects.wake_ledger_bucket()),
            Self::Cancels => Subjects::bucket_stream(&subjects.cancel_bucket()),
            Self::SessionLocks => Subjects::bucket_stream(&subjects.session_lock_bucket()),
        }
    }

    /// The one held by `stream`, if any.
    pub fn of_stream(subjects: &Subjects, stream: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|store| store.stream(subjects) == stream)
    }
}

impl fmt::Display for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Store {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|store| store.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|store| store.name()).collect();
                format!("unknown part {name:?}; one of {}", names.join(", "))
            })
    }
}

/// The smallest limit taken: a stream smaller refuses most messages (a
/// bare number is bytes, easily meant as MiB).
const MIN_BYTES: u64 = 1 << 20;

/// The byte limits asked for: one for every part, and some for one part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaxBytes {
    /// For every part not in `each`.
    pub all: Option<u64>,
    /// By part.
    pub each: BTreeMap<Store, u64>,
}

impl MaxBytes {
    /// The limit asked for `store`, as a JetStream config field: 0 when
    /// none was (an existing stream keeps its own; a new one has none).
    pub fn of(&self, store: Store) -> i64 {
        self.each
            .get(&store)
            .copied()
            .or(self.all)
            .map_or(0, |bytes| i64::try_from(bytes).unwrap_or(i64::MAX))
    }

    /// Adds one `--max-bytes` value: `SIZE` or `PART=SIZE` (a later one
    /// for the same part wins).
    pub fn add(&mut self, value: &str) -> Result<(), String> {
        let (store, size) = match value.split_once('=') {
            Some((store, size)) => (Some(store.trim().parse::<Store>()?), size),
            None => (None, value),
        };
        let bytes = size
            .trim()
            .parse::<bytesize::ByteSize>()
            .map_err(|error| format!("bad size {size:?} (e.g. 512MiB, 8GiB): {error}"))?
            .as_u64();
        if bytes == 0 {
            return Err(format!("size {size:?} is zero"));
        }
        if i64::try_from(bytes).is_err() {
            return Err(format!("size {size:?} is larger than JetStream takes"));
        }
        if bytes < MIN_BYTES {
            let size = size.trim();
            let meant = if size.bytes().all(|b| b.is_ascii_digit()) {
                format!("a number without a unit is bytes: {size}MiB?")
            } else {
                "e.g. 64MiB".to_owned()
            };
            return Err(format!(
                "size {size:?} is below 1 MiB, too small for a stream, which would refuse most messages ({meant})"
            ));
        }
        match store {
            Some(store) => {
                self.each.insert(store, bytes);
            }
            None => self.all = Some(bytes),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_for_one_part_overrides_the_size_for_every_part() {
        let mut limits = MaxBytes::default();
        limits.add("1GiB").unwrap();
        limits.add("events=8GiB").unwrap();
        limits.add("session-locks = 2MB").unwrap();
        assert_eq!(limits.of(Store::Tasks), 1 << 30);
        assert_eq!(limits.of(Store::Events), 8 << 30);
        assert_eq!(limits.of(Store::SessionLocks), 2_000_000);
        assert_eq!(MaxBytes::default().of(Store::Tasks), 0);
    }

    #[test]
    fn an_unknown_part_or_a_bad_or_zero_size_is_refused_with_what_would_do() {
        let mut limits = MaxBytes::default();
        let unknown = limits.add("history=1GiB").unwrap_err();
        assert!(
            unknown.contains("one of tasks, events, dead-letters"),
            "{unknown}"
        );
        let bad = limits.add("events=lots").unwrap_err();
        assert!(bad.contains("e.g. 512MiB"), "{bad}");
        assert!(limits.add("0").unwrap_err().contains("zero"));
        assert!(limits.add("16EiB").unwrap_err().contains("larger than"));
        let bare = limits.add("tasks=512").unwrap_err();
        assert!(
            bare.contains("below 1 MiB") && bare.contains("512MiB"),
            "{bare}"
        );
        assert_eq!(limits, MaxBytes::default());
    }

    #[test]
    fn each_part_is_found_by_its_stream() {
        let subjects = Subjects::new("acme").unwrap();
        for store in Store::ALL {
            assert_eq!(
                Store::of_stream(&subjects, &store.stream(&subjects)),
                Some(store)
            );
        }
        assert_eq!(Store::of_stream(&subjects, "OTHER"), None);
    }
}
