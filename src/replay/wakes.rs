//! `replay wakes`: publishing a completion again so that the wake service
//! posts it, after checking it as the wake would and against the ledger.

use async_nats::HeaderMap;

use super::{Action, ReplayError, ReplayItem, Replayer, replay_headers};
use crate::history::{Record, RecordKind};
use crate::protocol::{CompletionEvent, EventKind, HEADER_MSG_ID, WakeMode, session_token};
use crate::wake::ledger::{LedgerState, WakeLedger};
use crate::wake::{Admission, check_completion};

pub use crate::protocol::HEADER_FORCED_REPLAY;

/// The Idempotency-Key of a forced re-post: `<base>.replay.<ULID>`, `base`
/// being the key the post would otherwise carry (`<delegation_id>.<task_index>.done`,
/// or `<delegation_id>.batch` for a batch), if `headers` mark a forced copy
/// with a valid ULID. Only a ULID is taken from the header, so the key can
/// never be another completion's.
pub fn forced_idempotency_key(base: &str, headers: Option<&HeaderMap>) -> Option<String> {
    let value = headers?.get(HEADER_FORCED_REPLAY)?.as_str();
    let id = ulid::Ulid::from_string(value).ok()?;
    Some(format!("{base}.replay.{id}"))
}

/// Whether `key` is a forced re-post's key of `base` (as
/// [`forced_idempotency_key`] makes them).
pub fn is_forced_key_of(base: &str, key: &str) -> bool {
    key.strip_prefix(base)
        .and_then(|rest| rest.strip_prefix(".replay."))
        .is_some_and(|id| ulid::Ulid::from_string(id).is_ok())
}

/// The ledger key of `event`'s wake (its batch's for a batch member), and
/// whether it is a batch's.
fn wake_key(event: &CompletionEvent) -> (String, bool) {
    // A batch wakes once for all its tasks: one copy of any member makes
    // the wake service post the consolidated turn again.
    if event.task_count > 1 && event.wake_mode == WakeMode::Batch {
        (WakeLedger::batch_key(&event.delegation_id), true)
    } else {
        (
            WakeLedger::key(&event.delegation_id, event.task_index),
            false,
        )
    }
}

/// Whether `record` is a wake dead letter of a turn given up after 409s.
fn given_up_after_conflicts(record: &Record) -> bool {
    record
        .dead_letter_reason()
        .is_some_and(|reason| reason.starts_with(crate::wake::CONFLICT_REFUSAL))
}

impl Replayer {
    /// Before a forced run over the wake dead letters, notes the
    /// completions that one of them says were given up after 409s: such a
    /// turn may have been delivered under its key, so no dead letter of
    /// that completion is forced, an earlier one included (refused with a
    /// 404, replayed plainly once the API was fixed, then given up after
    /// 409s: forcing the 404's dead letter would make a second turn). Read
    /// from the selection's start to the stream's end, as the 409s may have
    /// come after the selection, and with its session and delegation
    /// filters only. Returns false if cancelled meanwhile.
    pub(super) async fn note_conflicts(
        &mut self,
        cancel: &tokio_util::sync::CancellationToken,
        progress: &mut impl FnMut(super::Progress<'_>),
    ) -> Result<bool, ReplayError> {
        if !(self.plan.force && matches!(self.plan.kind, super::ReplayKind::WakeDeadLetters)) {
            return Ok(true);
        }
        // What every dead letter of one completion shares: its session
        // and delegation, and the range from the selection's start. A
        // status, kind or pool filter could leave out the give-up (another
        // member of the batch, dead-lettered by the same turn).
        let chosen = self.plan.effective_selection();
        let selection = crate::history::Selection {
            session: chosen.session,
            delegation: chosen.delegation,
            since: chosen.since,
            from_seq: chosen.from_seq,
            ..crate::history::Selection::default()
        };
        let mut reader =
            crate::history::HistoryReader::open(&self.bus, self.plan.source(), selection, false)
                .await?;
        progress(super::Progress::Prereading {
            total: reader.estimated_total(),
        });
        let read = async {
            loop {
                let next = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(false),
                    next = reader.next() => next,
                };
                let Some(record) = next else {
                    return Ok(true);
                };
                let record = record?;
                progress(super::Progress::Preread);
                if given_up_after_conflicts(&record)
                    && let Ok((event, session)) =
                        check_completion(&record.payload, record.origin_session())
                {
                    let (key, _) = wake_key(&event);
                    self.conflicted
                        .insert(super::Handled::key(&["wake", &key, &session]));
                    // An unreadable member's error may have been given up
                    // in its batch's turn.
                    if event.is_of_an_unreadable_batch() {
                        let batch = WakeLedger::batch_key(&event.delegation_id);
                        self.conflicted
                            .insert(super::Handled::key(&["wake", &batch, &session]));
                    }
                }
            }
        }
        .await;
        reader.close().await;
        read
    }

    pub(super) async fn redrive_wake(
        &mut self,
        record: &Record,
    ) -> Result<ReplayItem, ReplayError> {
        let item = ReplayItem::for_record(record);
        if !matches!(record.kind(), RecordKind::Done | RecordKind::WakeDeadLetter) {
            return Ok(item.skipped("not a completion"));
        }
        // A completion too large to be stored again with its reason was
        // dead-lettered without its body: it is whole in the history.
        if record.payload.is_empty()
            && record
                .dead_letter_reason()
                .is_some_and(|reason| reason.starts_with("(body of "))
        {
            let how = record.delegation_id().map_or_else(
                || "`wakebus replay wakes` with a selection of it".to_owned(),
                |id| format!("`wakebus replay wakes --delegation {id}`"),
            );
            return Ok(item.skipped(format!(
                "its body was too large to keep in the dead letter; the completion is whole in the history: replay it from there with {how}"
            )));
        }
        // The wake service's own admission rules: a copy it would only
        // dead-letter again (a wake dead letter of `dlq.wake.poison` is
        // exactly such a completion) is not published.
        let (event, session) = match check_completion(&record.payload, record.origin_session()) {
            Ok(admitted) => admitted,
            Err(Admission::NothingToWake) => {
                let sync = CompletionEvent::decode(&record.payload)
                    .is_ok_and(|event| event.origin_session_id.is_none());
                return Ok(item.skipped(if sync {
                    "sync mode: there is no session to wake"
                } else {
                    "cancelled silently: nobody is to be woken"
                }));
            }
            Err(Admission::Poison(reason)) => {
                return Ok(item.skipped(format!(
                    "the wake service cannot use it ({reason}); it stays where it is"
                )));
            }
        };
        let (key, batch) = wake_key(&event);
        let seen = super::Handled::key(&["wake", &key, &session]);
        if !self.seen.insert(seen) {
            return Ok(item.skipped(if batch {
                "another completion of this batch was already handled"
            } else {
                "an earlier copy of this completion was already handled"
            }));
        }
        // A forged completion (a real delegation's task claimed for
        // another session: dead-lettered by a verifying wake, and in the
        // history too) shares its ledger key with the genuine one: forcing
        // it would replace the genuine delivery's entry with a forced key,
        // under which a later replay of the genuine completion would wake
        // its session again, and a verifying wake would only refuse its
        // copy. It is not replayed; the genuine one, met in this run or
        // not, is handled on its own (`seen` tells them apart by session).
        // Given up after 409s (this dead letter, or another of the same
        // completion): the turn under its key may have been delivered. A
        // plain replay re-sends it under that key, which the API answers
        // from its store; forced, it would be a second turn.
        if self.plan.force && (given_up_after_conflicts(record) || self.conflicted.contains(&seen))
        {
            return Ok(item.skipped(
                "not forced: the session API answered 409 for this turn, so it may have been delivered under its Idempotency-Key; replay it without --force (the API answers a repeat of the key from its store)",
            ));
        }
        if self.plan.force {
            match self.submitted_for_another_session(&event, &session).await {
                Ok(false) => {}
                Ok(true) => {
                    return Ok(item.skipped(
                        "not forced: its task was submitted for another session, so this completion is not the task's own (forcing it would replace the genuine wake's ledger entry)",
                    ));
                }
                Err(error) => {
                    self.seen.remove(&seen);
                    return Ok(item.unchecked(format!(
                        "cannot tell whether its task was submitted for this session ({error}); run the replay again once the history can be read"
                    )));
                }
            }
        }
        let force = self.plan.force;
        let ledger = self.ledger.as_ref().expect("wake replays open the ledger");
        // Not knowing whether it was delivered (a leader election), it is
        // left for a later run rather than stopping this one; forced, the
        // entry goes whatever it says (a corrupt one included).
        let entry = match ledger.get(&key).await {
            Ok(entry) => Ok(entry),
            Err(_) if force => Err(()),
            Err(error) => {
                self.seen.remove(&seen);
                return Ok(item.unchecked(format!(
                    "cannot tell whether it was delivered ({error}); run the replay again once the ledger can be read (a leader election passes by itself; a refused read or a corrupt entry needs an operator)"
                )));
            }
        };
        let mut item = item;
        // No entry at all: maybe never woken, maybe woken and expired.
        if matches!(entry, Ok(None))
            && !force
            && let Some(reason) = self.outlived_its_traces(record, "wake ledger entries")
        {
            self.seen.remove(&seen);
            return Ok(item.skipped(reason));
        }
        if let Ok(Some(LedgerState::Delivered { at, .. })) = &entry
            && !force
        {
            let at = crate::history::rfc3339(*at);
            return Ok(item.skipped(format!(
                "already delivered at {at} (use --force to post it again)"
            )));
        }
        // The error of an unreadable batch member, which the wake may have
        // taken into its batch (`wake::stand_in`): reported by that batch's
        // turn, recorded under the batch's key only. Forced too, it is left
        // to that turn (forcing a member of the batch posts it again), not
        // posted a second time on its own; and when that cannot be told,
        // it is left for a later run.
        if !matches!(entry, Ok(Some(_))) && event.is_of_an_unreadable_batch() {
            match ledger
                .get(&WakeLedger::batch_key(&event.delegation_id))
                .await
            {
                Ok(None) => {}
                Ok(Some(state)) => {
                    return Ok(item.skipped(match state {
                        LedgerState::Delivered { at, .. } => format!(
                            "reported in its batch's turn, delivered at {} (forcing a member of the batch posts that turn again)",
                            crate::history::rfc3339(at)
                        ),
                        LedgerState::Posting { .. } => "reported in its batch's turn, which is being posted (forcing a member of the batch posts that turn again)".to_owned(),
                    }));
                }
                Err(error) => {
                    self.seen.remove(&seen);
                    return Ok(item.unchecked(format!(
                        "cannot tell whether it was reported in its batch's turn ({error}); run the replay again once the ledger can be read (a leader election passes by itself; a refused read or a corrupt entry needs an operator)"
                    )));
                }
            }
        }
        // Forced, any entry is replaced by the forced post's record: a
        // `posting` one (a post the session API refused, or one in doubt)
        // would have the wake send the copy again under the old key, or
        // inside the old combined turn.
        item.ledger_cleared = force && !matches!(entry, Ok(None));
        let subject = self.bus.subjects.event(
            &session_token(&session),
            &event.delegation_id,
            event.task_index,
            EventKind::Done,
        );
        item.target_subject = Some(subject.clone());
        if self.plan.dry_run {
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        let mut headers = replay_headers(record);
        let event_id = CompletionEvent::id_for(&event.delegation_id, event.task_index);
        let copy = ulid::Ulid::new().to_string();
        let msg_id = format!("{event_id}.replay.{copy}");
        headers.insert(HEADER_MSG_ID, msg_id.as_str());
        if force {
            // Posted before (or by an earlier forced replay that recorded
            // its key and then failed): the usual key would be a repeat to
            // the session API.
            headers.insert(HEADER_FORCED_REPLAY, copy.as_str());
            let base = if batch {
                key.as_str()
            } else {
                event_id.as_str()
            };
            let forced_key = forced_idempotency_key(base, Some(&headers))
                .expect("a ULID was just put in the header");
            // Recorded before the copy is published, so that no copy of
            // the completion wakes under another key from now on.
            if let Err(error) = ledger.record_forced(&key, &forced_key).await {
                self.seen.remove(&seen);
                return Ok(item.unchecked(format!(
                    "cannot record the forced wake in its ledger entry ({error}); run the replay again for it"
                )));
            }
            item.idempotency_key = Some(forced_key.clone());
            // The key is recorded: a copy that cannot be published is
            // reported with it, and the replay goes on. The completion
            // stays handled (`seen`): the copy may have been stored (an
            // ack lost), and another of this run's copies (a batch's
            // other member) forced again would be a second forced wake.
            if let Err(error) = self.publish(subject, headers, record.payload.clone()).await {
                return Ok(item.unchecked(format!(
                    "its forced wake is recorded under Idempotency-Key {forced_key}, but its copy may not have been published ({error}); run `replay wakes` again WITHOUT --force for it: any later copy of the completion is posted under that key (with --force, a second forced wake would be made)"
                )));
            }
            item.action = Action::Replayed;
            return Ok(item);
        }
        self.publish(subject, headers, record.payload.clone())
            .await?;
        item.action = Action::Replayed;
        Ok(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_key_is_recognised_only_as_its_own_completions() {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_FORCED_REPLAY, "01JV3N4Y8K6D2Q7R9T1W5X0ZAB");
        let key = forced_idempotency_key("d.0.done", Some(&headers)).unwrap();
        assert!(is_forced_key_of("d.0.done", &key));
        assert!(!is_forced_key_of("d.1.done", &key));
        assert!(!is_forced_key_of("d.0", &key));
        assert!(!is_forced_key_of("d.0.done", "d.0.done"));
        assert!(!is_forced_key_of("d.0.done", "d.0.done.replay.not-a-ulid"));
    }

    #[test]
    fn a_forced_key_takes_only_a_ulid_from_the_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(forced_idempotency_key("d.0.done", Some(&headers)), None);
        headers.insert(HEADER_FORCED_REPLAY, "01JV3N4Y8K6D2Q7R9T1W5X0ZAB");
        assert_eq!(
            forced_idempotency_key("d.0.done", Some(&headers)).as_deref(),
            Some("d.0.done.replay.01JV3N4Y8K6D2Q7R9T1W5X0ZAB")
        );
        headers.insert(HEADER_FORCED_REPLAY, "other.0.done");
        assert_eq!(forced_idempotency_key("d.0.done", Some(&headers)), None);
        assert_eq!(forced_idempotency_key("d.0.done", None), None);
    }
}
