//! Subject and stream names under a deployment prefix.

use super::EventKind;

/// Why a subject prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid prefix {prefix:?}: use dot-separated tokens of ASCII letters, digits, '-' and '_'"
)]
pub struct PrefixError {
    /// The refused prefix.
    pub prefix: String,
}

/// The token of `<prefix>.dlq.wake.poison`, where the wake dead-letters
/// completions it cannot use, whatever session they name.
pub const POISON_TOKEN: &str = "poison";

/// The parts of an event subject,
/// `<prefix>.evt.<session-token>.<delegation-id>.<task-index>.<kind>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSubject<'a> {
    /// The session token: `sync`, or the hash of the origin session id.
    pub session_token: &'a str,
    /// The delegation id, as the subject spells it.
    pub delegation_id: &'a str,
    /// The task index: decimal, without a sign or a leading zero.
    pub task_index: u32,
    /// What the event is.
    pub kind: EventKind,
}

/// Every subject, stream, consumer and bucket name of one deployment.
///
/// Several deployments (or test runs) can share one NATS server by using
/// different prefixes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    /// The subject prefix, for example `wakebus`.
    prefix: String,
    /// The prefix as used in stream and bucket names: uppercase, `.` as `_`.
    name_prefix: String,
}

impl Subjects {
    /// Builds the names for `prefix`, refusing prefixes that would break subjects.
    pub fn new(prefix: &str) -> Result<Self, PrefixError> {
        let valid = !prefix.is_empty()
            && prefix.split('.').all(|token| {
                !token.is_empty()
                    && token
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            });
        if !valid {
            return Err(PrefixError {
                prefix: prefix.to_owned(),
            });
        }
        Ok(Self {
            prefix: prefix.to_owned(),
            name_prefix: prefix.replace('.', "_").to_ascii_uppercase(),
        })
    }

    /// The subject prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Where requests for `pool` are published: `<prefix>.task.<pool>`.
    pub fn task(&self, pool: &str) -> String {
        format!("{}.task.{pool}", self.prefix)
    }

    /// All request subjects: `<prefix>.task.>`.
    pub fn tasks_all(&self) -> String {
        format!("{}.task.>", self.prefix)
    }

    /// A lifecycle event: `<prefix>.evt.<session-token>.<delegation-id>.<task-index>.<kind>`.
    pub fn event(
        &self,
        session_token: &str,
        delegation_id: &str,
        task_index: u32,
        kind: EventKind,
    ) -> String {
        format!(
            "{}.evt.{session_token}.{delegation_id}.{task_index}.{}",
            self.prefix,
            kind.as_str()
        )
    }

    /// One kind of event of every task of a delegation, under any session
    /// token: `<prefix>.evt.*.<delegation-id>.*.<kind>`.
    pub fn delegation_events(&self, delegation_id: &str, kind: EventKind) -> String {
        format!("{}.evt.*.{delegation_id}.*.{}", self.prefix, kind.as_str())
    }

    /// The parts of `subject` if it is one of this deployment's event
    /// subjects, as [`Self::event`] builds them; `None` for anything else
    /// (another prefix, another layout, an index written another way).
    pub fn parse_event<'a>(&self, subject: &'a str) -> Option<EventSubject<'a>> {
        let local = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".evt.")?;
        let mut tokens = local.split('.');
        let (Some(session_token), Some(delegation_id), Some(index), Some(kind), None) = (
            tokens.next(),
            tokens.next(),
            tokens.next(),
            tokens.next(),
            tokens.next(),
        ) else {
            return None;
        };
        let canonical =
            index == "0" || (!index.starts_with('0') && index.bytes().all(|b| b.is_ascii_digit()));
        if session_token.is_empty() || delegation_id.is_empty() || !canonical {
            return None;
        }
        Some(EventSubject {
            session_token,
            delegation_id,
            task_index: index.parse().ok()?,
            kind: EventKind::from_token(kind)?,
        })
    }

    /// All event subjects: `<prefix>.evt.>`.
    pub fn events_all(&self) -> String {
        format!("{}.evt.>", self.prefix)
    }

    /// Every completion event: `<prefix>.evt.*.*.*.done`.
    pub fn done_events(&self) -> String {
        format!("{}.evt.*.*.*.{}", self.prefix, EventKind::Done.as_str())
    }

    /// The `submitted` record of a delegation's task:
    /// `<prefix>.evt.<session-token>.<delegation-id>.<task-index>.submitted`.
    pub fn submitted(&self, session_token: &str, delegation_id: &str, task_index: u32) -> String {
        self.event(
            session_token,
            delegation_id,
            task_index,
            EventKind::Submitted,
        )
    }

    /// Where requests that could not be run are dead-lettered: `<prefix>.dlq.task.<pool>`.
    pub fn dead_letter_task(&self, pool: &str) -> String {
        format!("{}.dlq.task.{pool}", self.prefix)
    }

    /// Where completions that could not be woken are dead-lettered:
    /// `<prefix>.dlq.wake.<session-token>`.
    pub fn dead_letter_wake(&self, session_token: &str) -> String {
        format!("{}.dlq.wake.{session_token}", self.prefix)
    }

    /// All dead-letter subjects: `<prefix>.dlq.>`.
    pub fn dead_letters_all(&self) -> String {
        format!("{}.dlq.>", self.prefix)
    }

    /// Where cancel broadcasts go: `<prefix>.ctl.cancel`, followed by
    /// `.dlg.<delegation-id>` or `.ses.<session-token>`.
    pub fn cancel_broadcasts_prefix(&self) -> String {
        format!("{}.ctl.cancel", self.prefix)
    }

    /// The stream of requests (work-queue retention).
    pub fn tasks_stream(&self) -> String {
        format!("{}_TASKS", self.name_prefix)
    }

    /// The stream of lifecycle events (the history replay tools read).
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.name_prefix)
    }

    /// The stream of dead letters.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}_DLQ", self.name_prefix)
    }

    /// The durable consumer shared by all workers of `pool`.
    pub fn worker_consumer(&self, pool: &str) -> String {
        format!("worker-{pool}")
    }

    /// The durable consumer shared by all wake service instances.
    pub fn wake_consumer(&self) -> &'static str {
        "wake"
    }

    /// The KV bucket recording which completions have been woken.
    pub fn wake_ledger_bucket(&self) -> String {
        format!("{}_WAKES", self.name_prefix)
    }

    /// The KV bucket of cancel records (checked before a task starts).
    pub fn cancel_bucket(&self) -> String {
        format!("{}_CANCELS", self.name_prefix)
    }

    /// The KV bucket holding per-session wake locks.
    pub fn session_lock_bucket(&self) -> String {
        format!("{}_SESSION_LOCKS", self.name_prefix)
    }

    /// The stream JetStream keeps a KV `bucket` in: `KV_<bucket>`.
    pub fn bucket_stream(bucket: &str) -> String {
        format!("KV_{bucket}")
    }

    /// Every stream of the deployment: tasks, events and dead letters, then
    /// the streams of the cancel, wake-ledger and session-lock buckets.
    pub fn all_streams(&self) -> [String; 6] {
        [
            self.tasks_stream(),
            self.events_stream(),
            self.dead_letter_stream(),
            Self::bucket_stream(&self.cancel_bucket()),
            Self::bucket_stream(&self.wake_ledger_bucket()),
            Self::bucket_stream(&self.session_lock_bucket()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_follow_the_documented_layout() {
        let s = Subjects::new("acme.prod").unwrap();
        assert_eq!(s.task("gpu"), "acme.prod.task.gpu");
        assert_eq!(
            s.event("ab12", "01H", 3, EventKind::Done),
            "acme.prod.evt.ab12.01H.3.done"
        );
        assert_eq!(s.done_events(), "acme.prod.evt.*.*.*.done");
        assert_eq!(s.tasks_stream(), "ACME_PROD_TASKS");
        assert_eq!(s.wake_ledger_bucket(), "ACME_PROD_WAKES");
    }

    #[test]
    fn an_event_subject_is_parsed_back_into_the_parts_it_was_built_from() {
        let s = Subjects::new("acme.prod").unwrap();
        let built = s.event("ab12", "01H", 30, EventKind::Submitted);
        assert_eq!(
            s.parse_event(&built),
            Some(EventSubject {
                session_token: "ab12",
                delegation_id: "01H",
                task_index: 30,
                kind: EventKind::Submitted,
            })
        );
        assert_eq!(
            s.parse_event("acme.prod.evt.ab12.01H.0.done")
                .map(|e| e.task_index),
            Some(0)
        );
        for other in [
            "acme.evt.ab12.01H.0.done",
            "acme.prod.task.default",
            "acme.prodx.evt.ab12.01H.0.done",
            "acme.prod.evt.ab12.01H.0",
            "acme.prod.evt.ab12.01H.0.done.more",
            "acme.prod.evt..01H.0.done",
            "acme.prod.evt.ab12.01H.01.done",
            "acme.prod.evt.ab12.01H.+1.done",
            "acme.prod.evt.ab12.01H.4294967296.done",
            "acme.prod.evt.ab12.01H.0.finished",
        ] {
            assert_eq!(s.parse_event(other), None, "{other}");
        }
    }

    #[test]
    fn prefixes_with_wildcards_or_empty_tokens_are_refused() {
        for bad in ["", "a..b", "a.*", "a>", "a b", ".a", "a."] {
            assert!(Subjects::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
