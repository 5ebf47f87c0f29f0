//! `replay tasks`: publishing a dead-lettered request again under a derived
//! delegation id, unless an earlier re-queue of it is queued, running or done.

use async_nats::HeaderMap;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use sha2::{Digest, Sha256};

use super::{Action, ReplayError, ReplayItem, Replayer, encode, replay_headers, set_ids};
use crate::cancel::CancelTarget;
use crate::history::Record;
use crate::protocol::{EventKind, HEADER_DELEGATION_ID, TaskRequest, new_delegation_id};

impl Replayer {
    pub(super) async fn requeue_task(
        &mut self,
        record: &Record,
    ) -> Result<ReplayItem, ReplayError> {
        let item = ReplayItem::for_record(record);
        let Some(pool) = record.pool().map(str::to_owned) else {
            return Ok(item.skipped("not a task dead letter"));
        };
        // Dead-lettered without its body, too large to store again with its
        // reason: the tasks stream dropped the request when it was acked,
        // so no copy is left to re-queue.
        if record.payload.is_empty()
            && record
                .dead_letter_reason()
                .is_some_and(|reason| reason.starts_with("(body of "))
        {
            return Ok(item.skipped(
                "its body was too large to keep in the dead letter, and the tasks stream keeps no request once a worker has taken it: publish the request again from where it came from",
            ));
        }
        let request =
            TaskRequest::decode_within(&record.payload, &self.limits).and_then(|request| {
                request
                    .check_origin_header(record.origin_session())
                    .map(|()| request)
            });
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return Ok(item.skipped(format!("the request cannot run again: {error}")));
            }
        };
        // The copy is the JSON edited rather than the request re-encoded,
        // so that fields this version does not know survive. A body read
        // as a request may still not read as JSON (a lone surrogate escape
        // in a field the request does not know, which its reading skips):
        // such a copy would lose every field but its new id.
        let body = match serde_json::from_slice::<serde_json::Value>(&record.payload) {
            Ok(body) if body.is_object() => body,
            Ok(_) => return Ok(item.skipped("the request is not a JSON object")),
            Err(error) => {
                return Ok(item.skipped(format!(
                    "the request cannot be copied with all its fields ({error}); fix its body and publish it again by hand"
                )));
            }
        };
        if request.origin_session_id.is_none() && !self.plan.tasks.include_sync {
            return Ok(item.skipped(
                "sync mode: its caller had the failure, and a re-run's result would reach nobody (use --include-sync to run it anyway)",
            ));
        }
        // A re-queue that failed again: its request names the dead letter
        // it was re-queued from, which a run of the same replay skips as
        // re-queued. Re-queued again, a task that keeps failing would run
        // once more at every run (and a forced run would re-queue both).
        let own_dead_letters = format!("{}:", self.bus.subjects.dead_letter_stream());
        if let Some(from) = record
            .replay_of()
            .filter(|from| from.starts_with(&own_dead_letters))
            && !self.plan.tasks.include_requeued
        {
            return Ok(item.skipped(format!(
                "a re-queue (of {from}) that failed again (use --include-requeued to run it once more)"
            )));
        }
        // A task given up twice has two dead letters: it runs once, forced
        // or not (a forced re-queue takes a new id each time).
        let task = super::Handled::key(&[
            "task",
            &request.delegation_id,
            &request.task_index.to_string(),
        ]);
        if !self.seen.insert(task) {
            return Ok(
                item.skipped("another dead letter of this task was already handled in this run")
            );
        }
        self.requeue_request(record, item, request, body, &pool, task)
            .await
    }

    /// The rest of [`Self::requeue_task`], for a request that may run
    /// again and that this run has not handled yet. Where what decides it
    /// cannot be known, `task` is let go from `seen`: a later dead letter
    /// of the task may be decided.
    async fn requeue_request(
        &mut self,
        record: &Record,
        mut item: ReplayItem,
        request: TaskRequest,
        mut body: serde_json::Value,
        pool: &str,
        task: super::HandledKey,
    ) -> Result<ReplayItem, ReplayError> {
        if !self.plan.tasks.include_cancelled {
            match self.cancelled(&request, record).await {
                Ok(None) => {}
                Ok(Some(reason)) => return Ok(item.skipped(reason)),
                Err(error) => {
                    self.seen.remove(&task);
                    return Ok(
                        item.unchecked(format!("cannot tell whether it was cancelled: {error} (use --include-cancelled to send it anyway)"))
                    );
                }
            }
        }
        // Earlier releases derived the id from the dead letter's sequence:
        // a re-queue of this one made by them is this one's.
        let legacy = legacy_derived_delegation_id(&request.delegation_id, record.sequence);
        let id = derived_delegation_id(&request.delegation_id, request.task_index);
        let (new_id, earlier) = match self.requeued(&legacy).await {
            Requeued::No => {
                let earlier = self.requeued(&id).await;
                (id, earlier)
            }
            // Not known: said of the id it would be sent under.
            Requeued::Unknown(error) => (id, Requeued::Unknown(error)),
            earlier => (legacy, earlier),
        };
        // Nothing under the id, for a dead letter older than the history's
        // events: a re-queue may have run and expired.
        let outlived = matches!(earlier, Requeued::No)
            .then(|| self.outlived_its_traces(record, "a re-queue's events"))
            .flatten();
        // A forced re-queue goes under the id a plain one would take when
        // a plain one would send it, so that a plain replay after it finds
        // it and does not run the task again; under a new id only where a
        // plain one would not send it (or cannot tell).
        let (new_id, earlier) = match earlier {
            Requeued::Yes | Requeued::Unknown(_) if self.plan.force => {
                (new_delegation_id(), Requeued::No)
            }
            Requeued::No if self.plan.force && outlived.is_some() => {
                (new_delegation_id(), Requeued::No)
            }
            earlier => (new_id, earlier),
        };
        item.new_delegation_id = Some(new_id.clone());
        let subject = self.bus.subjects.task(pool);
        item.target_subject = Some(subject.clone());
        if !self.plan.force
            && let Some(reason) = outlived
        {
            self.seen.remove(&task);
            return Ok(item.skipped(reason));
        }
        match earlier {
            Requeued::No | Requeued::RecordOnly => {}
            Requeued::Yes => {
                return Ok(item.skipped(format!(
                    "already re-queued as delegation {new_id} (use --force to run it once more)"
                )));
            }
            Requeued::Unknown(error) => {
                self.seen.remove(&task);
                return Ok(item.unchecked(format!(
                    "cannot tell whether delegation {new_id} is queued: {error}"
                )));
            }
        }
        if self.plan.dry_run {
            item.action = Action::WouldReplay;
            return Ok(item);
        }
        let mut requeued = request;
        requeued.delegation_id.clone_from(&new_id);
        body["delegation_id"] = serde_json::Value::from(new_id.as_str());
        if requeued.task_count > 1 {
            // Alone under its new id, a one-task delegation: a batch would
            // wait for siblings that will never run, and a cancel would
            // count them as still running.
            requeued.task_index = 0;
            requeued.task_count = 1;
            requeued.wake_mode = crate::protocol::WakeMode::Independent;
            body["task_index"] = serde_json::Value::from(0);
            body["task_count"] = serde_json::Value::from(1);
            body["wake_mode"] = serde_json::Value::from("independent");
        }
        let payload = encode(&subject, &body)?;
        let mut headers = replay_headers(record);
        set_ids(&mut headers, &format!("{new_id}.{}", requeued.task_index));
        headers.insert(HEADER_DELEGATION_ID, new_id.as_str());
        headers.insert(
            crate::protocol::HEADER_TASK_INDEX,
            requeued.task_index.to_string().as_str(),
        );
        // After a re-queue whose task write failed, the record is there;
        // it is written again all the same (dropped as a duplicate within
        // the window), as an earlier release wrote a member's under its
        // own index, not 0. The task goes under the same Nats-Msg-Id.
        self.publish_submitted(&requeued, pool, &headers).await?;
        self.publish(subject, headers, payload).await?;
        item.action = Action::Replayed;
        Ok(item)
    }

    /// Why the task must not run again, if it must not: its delegation was
    /// cancelled, or its earlier re-run (under the id a plain replay gives
    /// it, which `--force` does not look for), or its session since before
    /// the request was made (as a worker would have judged the original;
    /// the re-queued copy, a new delegation stored now, would escape them
    /// all). A failed read is no answer.
    async fn cancelled(
        &self,
        request: &TaskRequest,
        record: &Record,
    ) -> Result<Option<String>, String> {
        let cancels = match &self.cancels {
            Ok(Some(cancels)) => cancels,
            Ok(None) => return Ok(None),
            Err(error) => return Err(error.clone()),
        };
        // When the server stored the record, as workers take it.
        let read = |target: CancelTarget| async move {
            match cancels.entry(target.key()).await {
                Ok(Some(entry)) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                    Ok(Some(entry.created))
                }
                Ok(_) => Ok(None),
                Err(error) => Err(error.to_string()),
            }
        };
        if read(CancelTarget::Delegation(request.delegation_id.clone()))
            .await?
            .is_some()
        {
            return Ok(Some(format!(
                "delegation {} was cancelled (use --include-cancelled to run it anyway)",
                request.delegation_id
            )));
        }
        // A user who stopped the re-run stopped the task: a forced replay
        // (which makes a new id) must not start it once more.
        let reruns = [
            derived_delegation_id(&request.delegation_id, request.task_index),
            legacy_derived_delegation_id(&request.delegation_id, record.sequence),
        ];
        for rerun in reruns {
            if read(CancelTarget::Delegation(rerun.clone()))
                .await?
                .is_some()
            {
                return Ok(Some(format!(
                    "its re-run, delegation {rerun}, was cancelled (use --include-cancelled to run it anyway)"
                )));
            }
        }
        let token = crate::worker::token_for(request.origin_session_id.as_deref());
        // Stored at the latest when it was dead-lettered (the server's
        // clock), and about when it was made (the publisher's).
        let made = request
            .created_at
            .map_or(record.published, |created| created.min(record.published));
        match read(CancelTarget::Session(token)).await? {
            Some(at) if at >= made => Ok(Some(format!(
                "its session was cancelled at {}, after the request was made (use --include-cancelled to run it anyway)",
                crate::history::rfc3339(at)
            ))),
            _ => Ok(outlived_cancel_records(
                cancels.stream.cached_info().config.max_age,
                time::OffsetDateTime::now_utc() - made,
            )),
        }
    }

    /// How far an earlier re-queue of the derived delegation got. Its
    /// `submitted` record is written before the task, so a record alone
    /// means either a task still in the queue (or in its first second of
    /// running, before its started event) or a task write that failed.
    async fn requeued(&self, new_id: &str) -> Requeued {
        let events = self
            .events
            .as_ref()
            .expect("task replays open the events stream");
        // Whether an event of `kind` exists, for any task of the new id: a
        // batch member is re-queued as task 0 (by earlier releases, under
        // its own index); a failed read is no answer.
        let has = |kind| {
            let subject = self.bus.subjects.delegation_events(new_id, kind);
            async move {
                match events.get_last_raw_message_by_subject(&subject).await {
                    Ok(_) => Ok(true),
                    Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                        Ok(false)
                    }
                    Err(error) => Err(error.to_string()),
                }
            }
        };
        let answer = async {
            if has(EventKind::Done).await? || has(EventKind::Started).await? {
                return Ok(Requeued::Yes);
            }
            if !has(EventKind::Submitted).await? {
                return Ok(Requeued::No);
            }
            match self.bus.find_queued(new_id).await {
                Ok(Some(true)) => Ok(Requeued::Yes),
                Ok(Some(false)) => Ok(Requeued::RecordOnly),
                Ok(None) => Err(
                    "the task queue is longer than this check reads in its time; try again when it is shorter"
                        .to_owned(),
                ),
                Err(error) => Err(error.to_string()),
            }
        };
        answer.await.unwrap_or_else(Requeued::Unknown)
    }

    /// Writes the re-queued task's `submitted` record, which a wake that
    /// verifies origins requires of its completion (docs/PROTOCOL.md, 5.6).
    async fn publish_submitted(
        &self,
        requeued: &TaskRequest,
        pool: &str,
        request_headers: &HeaderMap,
    ) -> Result<(), ReplayError> {
        let new_id = &requeued.delegation_id;
        let token = crate::worker::token_for(requeued.origin_session_id.as_deref());
        let subject = self
            .bus
            .subjects
            .submitted(&token, new_id, requeued.task_index);
        let body = crate::protocol::SubmittedRecord::for_request(requeued, pool, None);
        let payload = encode(&subject, &body)?;
        let mut headers = request_headers.clone();
        set_ids(
            &mut headers,
            &crate::protocol::SubmittedRecord::id_for(new_id, requeued.task_index),
        );
        headers.insert(
            crate::protocol::HEADER_CE_TYPE,
            crate::protocol::EventKind::Submitted.ce_type(),
        );
        self.publish(subject, headers, payload).await.map(drop)
    }
}

/// Why finding no cancel record proves nothing for a request made `age`
/// ago: cancel records are kept `kept` (the history's age; dead letters
/// are kept longer), less a margin for the clocks. `None` while a cancel
/// made since the request would still be there.
fn outlived_cancel_records(kept: std::time::Duration, age: time::Duration) -> Option<String> {
    super::outlived(kept, age).map(|(age, kept)| {
        format!(
            "made {age} ago, and cancel records are kept {kept}: whether it was cancelled is not known (use --include-cancelled to run it anyway)"
        )
    })
}

/// How far an earlier re-queue of a dead letter got.
enum Requeued {
    /// Never re-queued.
    No,
    /// Its `submitted` record is stored but its task is neither queued nor
    /// run: the task write failed.
    RecordOnly,
    /// Queued, running or done.
    Yes,
    /// The queue could not be read.
    Unknown(String),
}

/// The delegation id a dead-lettered task is re-queued under:
/// `<original>-rt<task index>`, or, when that would exceed the
/// 64-character limit, the first 32 hex digits of the original's SHA-256
/// instead of the original.
///
/// Derived from the task, not from its dead letter: a task given up twice
/// (its `failed` completion not stored before its worker stopped, and the
/// next worker giving it up again after the dead letters' duplicate
/// window) has two dead letters, and both must lead to one re-run.
pub fn derived_delegation_id(original: &str, task_index: u32) -> String {
    with_suffix(original, &format!("-rt{task_index}"))
}

/// The id earlier releases re-queued a dead letter under:
/// `<original>-r<dead-letter sequence>`, shortened as above.
fn legacy_derived_delegation_id(original: &str, dead_letter_sequence: u64) -> String {
    with_suffix(original, &format!("-r{dead_letter_sequence}"))
}

/// `original` then `suffix`, the original replaced by a digest of it when
/// the two exceed the 64-character limit of a delegation id.
fn with_suffix(original: &str, suffix: &str) -> String {
    if original.len() + suffix.len() <= 64 {
        format!("{original}{suffix}")
    } else {
        let digest = Sha256::digest(original.as_bytes());
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{hex}{suffix}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::validate_delegation_id;

    /// Cancel records live as long as the history (7 days by default),
    /// dead letters 30: an older request found no record and was re-queued
    /// by `--force`, though its user may have cancelled it.
    #[test]
    fn a_request_older_than_the_cancel_records_is_not_taken_for_uncancelled() {
        let week = std::time::Duration::from_secs(7 * 86_400);
        assert_eq!(outlived_cancel_records(week, time::Duration::days(1)), None);
        let reason = outlived_cancel_records(week, time::Duration::days(8)).unwrap();
        assert!(reason.contains("--include-cancelled"), "{reason}");
        // Within the clock margin of the keep, it is not known either.
        let nearly = time::Duration::days(7) - time::Duration::minutes(1);
        assert!(outlived_cancel_records(week, nearly).is_some());
        // Kept for ever: a missing record means none.
        assert_eq!(
            outlived_cancel_records(std::time::Duration::ZERO, time::Duration::days(400)),
            None
        );
    }

    #[test]
    fn derived_ids_are_valid_deterministic_and_distinct_per_task() {
        let id = derived_delegation_id("01JV3N4Y8K6D2Q7R9T1W5X0ZAB", 17);
        assert_eq!(id, "01JV3N4Y8K6D2Q7R9T1W5X0ZAB-rt17");
        assert_ne!(id, derived_delegation_id("01JV3N4Y8K6D2Q7R9T1W5X0ZAB", 18));
        let long = "x".repeat(64);
        let derived = derived_delegation_id(&long, u32::MAX);
        assert!(validate_delegation_id(&derived).is_ok(), "{derived}");
        assert_eq!(derived, derived_delegation_id(&long, u32::MAX));
        let legacy = legacy_derived_delegation_id(&long, u64::MAX);
        assert!(validate_delegation_id(&legacy).is_ok(), "{legacy}");
        assert_eq!(
            legacy_derived_delegation_id("01JV3N4Y8K6D2Q7R9T1W5X0ZAB", 17),
            "01JV3N4Y8K6D2Q7R9T1W5X0ZAB-r17"
        );
    }
}
