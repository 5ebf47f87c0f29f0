//! Origin verification (`verify_origin`): the wake acts on a completion only
//! if the delegator's `submitted` record for that task exists and names the
//! same origin session.
//!
//! Workers may publish completions for any session (NATS permissions are
//! static subjects), but only delegators may write `submitted` records, and
//! a worker cannot list the events stream. So a worker can only name a
//! delegation it was given (its id has 80 random bits), for the session that
//! delegation belongs to. A completion failing the check is dead-lettered
//! once with the reason, and the wake carries on with the rest.
//!
//! The record is read from the stream leader by subject (one read, never a
//! stale replica: a genuine completion must not be refused because a
//! follower lags). Verified delegations are remembered, so a batch costs one
//! read, not one per task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use tokio_util::task::TaskTracker;
use tracing::{error, warn};

use super::Shared;
use super::session::{Pending, Router};
use super::stand_in::PlacementError;
use crate::outcome::Outcome;
use crate::protocol::{EventKind, SubmittedRecord, bounded, session_token};

/// When the wake last said at ERROR that an unreadable member's error is
/// held behind a corrupt ledger entry (process seconds).
static CORRUPT_ENTRY_SAID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Verified delegations remembered at most; the memory is emptied when full
/// (a batch whose entry is dropped is read once more).
const REMEMBERED: usize = 4096;

/// Routes completions to their sessions, verifying their origin first when
/// configured to.
#[derive(Debug)]
pub(crate) struct OriginGate {
    /// Whether to verify (`verify_origin`); when off, completions are routed at once.
    enabled: bool,
    /// What the checks read from and dead-letter to.
    shared: Arc<Shared>,
    /// Verified delegations: origin session and task count, by delegation id.
    verified: Mutex<HashMap<String, (String, u32)>>,
    /// Checks run as tasks, so one slow read does not hold up the intake.
    tracker: TaskTracker,
}

/// Why a completion was not verified.
#[derive(Debug)]
enum Refusal {
    /// It does not match a `submitted` record: dead-letter it.
    Forged(String),
    /// The record could not be read now: deliver the completion again later.
    Unavailable(String),
}

impl OriginGate {
    pub(crate) fn new(enabled: bool, shared: Arc<Shared>, tracker: TaskTracker) -> Arc<Self> {
        Arc::new(Self {
            enabled,
            shared,
            verified: Mutex::new(HashMap::new()),
            tracker,
        })
    }

    /// Hands `pending` to `router`, after checking its origin if enabled
    /// (and placing an unreadable batch member's error in its batch:
    /// [`super::stand_in`]).
    pub(crate) fn route(self: &Arc<Self>, mut pending: Pending, router: &Arc<Router>) {
        let stand_in = pending.event.is_of_an_unreadable_batch();
        if !self.enabled && !stand_in {
            return router.route(pending);
        }
        let (gate, router) = (self.clone(), router.clone());
        self.tracker.spawn(async move {
            if stand_in
                && let Err(error) =
                    super::stand_in::place_in_batch(&gate.shared, &mut pending).await
            {
                let (id, index) = (&pending.event.delegation_id, pending.event.task_index);
                match error {
                    // Asked about again within a second at first (the
                    // retries back off to 32 s): an ERROR once a minute.
                    PlacementError::CorruptEntry(error)
                        if crate::connect::once_a_minute(&CORRUPT_ENTRY_SAID) =>
                    {
                        error!(delegation_id = %id, task_index = index, %error, "An unreadable request's error completion is held until an operator fixes or deletes its wake ledger entry (docs/GUARANTEES.md, \"wake ledger entry that is not ledger JSON\"); will retry.");
                    }
                    PlacementError::CorruptEntry(error) => {
                        warn!(delegation_id = %id, task_index = index, %error, "An unreadable request's error completion is still held behind its corrupt wake ledger entry; will retry.");
                    }
                    PlacementError::Read(error) => {
                        warn!(delegation_id = %id, task_index = index, %error, "Could not tell whether an unreadable request's error completion belongs to a batch; will retry.");
                    }
                }
                Outcome::retry_later(&pending.message)
                    .apply(&pending.message)
                    .await;
                return;
            }
            if !gate.enabled {
                return router.route(pending);
            }
            match gate.verify(&pending).await {
                Ok(()) => router.route(pending),
                Err(Refusal::Forged(reason)) => gate.refuse(&pending, &reason).await,
                Err(Refusal::Unavailable(error)) => {
                    warn!(delegation_id = %pending.event.delegation_id, task_index = pending.event.task_index, %error, "Could not read the submitted record; will retry.");
                    Outcome::retry_later(&pending.message)
                        .apply(&pending.message)
                        .await;
                }
            }
        });
    }

    /// Checks the completion against its task's `submitted` record.
    async fn verify(&self, pending: &Pending) -> Result<(), Refusal> {
        let event = &pending.event;
        let subjects = &self.shared.bus.subjects;
        let token = session_token(&pending.session);
        let expected = subjects.event(
            &token,
            &event.delegation_id,
            event.task_index,
            EventKind::Done,
        );
        if pending.message.subject.as_str() != expected {
            return Err(Refusal::Forged(format!(
                "published on {}, not on the subject its body names ({expected})",
                bounded(pending.message.subject.as_str(), 512)
            )));
        }
        if event.task_index >= event.task_count {
            return Err(Refusal::Forged(format!(
                "task_index {} is not below task_count {}",
                event.task_index, event.task_count
            )));
        }
        let known = self
            .verified
            .lock()
            .expect("origin cache poisoned")
            .get(&event.delegation_id)
            .cloned();
        let (origin, task_count) = match known {
            Some(known) => known,
            None => {
                let record = self.record(&token, pending).await?;
                let known = (
                    record.origin_session_id.unwrap_or_default(),
                    record.task_count,
                );
                let mut verified = self.verified.lock().expect("origin cache poisoned");
                if verified.len() >= REMEMBERED {
                    verified.clear();
                }
                verified.insert(event.delegation_id.clone(), known.clone());
                known
            }
        };
        if origin != pending.session {
            return Err(Refusal::Forged(
                "the submitted record names another origin session".to_owned(),
            ));
        }
        // The error of an unreadable batch member, which could not name
        // its batch (not placed in it: no other task had ended yet), is
        // still its task's.
        if task_count != event.task_count
            && !event.is_task_of(&event.delegation_id, event.task_index, task_count)
        {
            return Err(Refusal::Forged(format!(
                "task_count {} differs from the submitted record's {task_count}",
                event.task_count
            )));
        }
        Ok(())
    }

    /// The task's `submitted` record, read from the stream leader.
    async fn record(&self, token: &str, pending: &Pending) -> Result<SubmittedRecord, Refusal> {
        let event = &pending.event;
        let subject =
            self.shared
                .bus
                .subjects
                .submitted(token, &event.delegation_id, event.task_index);
        match self
            .shared
            .events
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(message) => SubmittedRecord::decode(&message.payload).map_err(|error| {
                Refusal::Forged(bounded(
                    &format!("the submitted record is not valid: {error}"),
                    1024,
                ))
            }),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                Err(Refusal::Forged(self.why_no_record(event).await))
            }
            Err(error) => Err(Refusal::Unavailable(error.to_string())),
        }
    }

    /// Why a completion has no `submitted` record: never written (a forged
    /// completion), or, when the history's oldest message was stored after
    /// the task was dispatched, maybe removed by the history's limits (a
    /// task that waited or ran longer than `--history`). The completion is
    /// refused either way, and the second is said so, at ERROR: most
    /// likely no worker is to blame, the session is not woken, and the
    /// history must be kept longer. (Most likely only: `dispatched_at` is
    /// the publisher's word, and a forger can set it too.)
    async fn why_no_record(&self, event: &crate::protocol::CompletionEvent) -> String {
        let absent = "no submitted record for this delegation, task and session";
        let Some(dispatched) = event.dispatched_at else {
            return absent.to_owned();
        };
        let Ok(info) = self.shared.events.get_info().await else {
            return absent.to_owned();
        };
        let oldest = info.state.first_timestamp;
        if info.state.messages == 0 || oldest <= dispatched {
            return absent.to_owned();
        }
        let reason = format!(
            "{absent}; the task was dispatched at {} (so the completion says), before the oldest event the history still holds ({}): the record may have been removed by the history's limits (--history, now {:?})",
            crate::history::rfc3339(dispatched),
            crate::history::rfc3339(oldest),
            info.config.max_age
        );
        tracing::error!(delegation_id = %event.delegation_id, task_index = event.task_index, %reason, "A completion's submitted record may have expired; its session is not woken. Keep the history longer than tasks wait and run (--history). Check the completion with `wakebus events --dead-letters wake --delegation` before re-driving it: its dispatch time is the worker's word, and a forged completion can claim an old one.");
        reason
    }

    /// Dead-letters a completion whose origin is not verified, then
    /// terminates it; if the dead letter cannot be written, it comes back later.
    async fn refuse(&self, pending: &Pending, reason: &str) {
        let reason = format!("origin not verified: {reason}");
        let event = &pending.event;
        warn!(
            delegation_id = %event.delegation_id,
            task_index = event.task_index,
            session_token = %session_token(&pending.session),
            subject = %pending.message.subject,
            %reason,
            "Refusing a completion whose origin is not verified; dead-lettering it."
        );
        let bus = &self.shared.bus;
        let subject = bus
            .subjects
            .dead_letter_wake(&session_token(&pending.session));
        super::dead_letter_then_term(bus, &pending.message, subject, reason, "origin").await;
    }
}
