//! The "oldest undelivered wakes" part of `wakebus status`: the completions
//! above the wake consumer's ack floor that still wait for their wake.
//!
//! The floor is held by the oldest completion not yet acknowledged, which
//! is when an operator looks; above it lie completions the wake has long
//! finished with. Each is judged as the wake judges it, and only those
//! still waiting are listed:
//!
//! - one the wake cannot use (it dead-letters it under `poison`) is
//!   counted as unusable, by the wake's own admission check;
//! - one whose ledger entry says `delivered` was woken;
//! - a batch member whose batch has tasks still to end waits for them (the
//!   wake acknowledged it);
//! - one the wake dead-lettered (the session API refused its turn, or its
//!   origin was not verified) is found in the wake dead letters, whose
//!   dedupe id ends with the completion's stream sequence, and counted as
//!   refused.

use std::collections::{HashMap, HashSet};

use time::OffsetDateTime;

use super::{ScanInfo, StatusError, StatusOptions, UndeliveredSession, read_error};
use crate::bus::{Bus, is_stream_not_found};
use crate::history::{HistoryReader, Record, Selection, Source};
use crate::protocol::{EventKind, HEADER_MSG_ID, POISON_TOKEN, SYNC_SESSION_TOKEN, WakeMode};
use crate::wake::ledger::{LedgerError, LedgerState, WakeLedger};
use crate::wake::{Admission, check_completion};

/// How far before the oldest waiting completion the wake dead letters are
/// read.
const CLOCK_MARGIN: time::Duration = time::Duration::minutes(1);

/// The most wake dead letters (poison included) read to find refused
/// completions: beyond, the rest is listed as waiting, and the scan says
/// so.
const MAX_DEAD_LETTERS_READ: u64 = 50_000;

/// A completion that no ledger entry shows delivered, and that waits for
/// no other task.
struct Candidate {
    /// Its sequence in the events stream.
    sequence: u64,
    /// When it was stored.
    published: OffsetDateTime,
    /// The raw session id it wakes.
    session: String,
    /// That session's subject token.
    session_token: String,
    /// Its delegation.
    delegation_id: String,
    /// Its task.
    task_index: u32,
    /// Whether its batch is woken by one turn for all its tasks.
    batch: bool,
}

/// Completions above the wake consumer's ack floor still waiting for their
/// wake, grouped by session, oldest first (at most `top_sessions`). Without
/// a ledger (the wake service never ran) every background completion there
/// waits.
pub(super) async fn undelivered(
    bus: &Bus,
    from_seq: u64,
    options: &StatusOptions,
) -> Result<(Vec<UndeliveredSession>, ScanInfo), StatusError> {
    let mut scan = ScanInfo {
        from_seq,
        session: options.session.clone(),
        ..ScanInfo::default()
    };
    // Missing means the wake never ran; any other failure is reported, not
    // read as "nothing delivered".
    let ledger = match bus
        .js
        .get_key_value(bus.subjects.wake_ledger_bucket())
        .await
    {
        Ok(bucket) => Some(WakeLedger::new(bucket)),
        Err(error) if crate::bus::is_bucket_missing(&error) => None,
        Err(error) => return Err(read_error("the wake ledger", error)),
    };
    // `--session`: that session's completions only, so that the scan limit
    // is spent on them, not on every other session's.
    let selection = Selection {
        session: options.session.clone(),
        kind: Some(EventKind::Done),
        from_seq: Some(scan.from_seq),
        ..Selection::default()
    };
    let mut reader = match HistoryReader::open(bus, Source::Events, selection, false).await {
        Ok(reader) => reader,
        Err(crate::history::HistoryError::Stream { source, .. })
            if is_stream_not_found(&source) =>
        {
            scan.complete = true;
            return Ok((Vec::new(), scan));
        }
        Err(error) => return Err(read_error("completions", error)),
    };
    let mut lookups = Lookups {
        bus,
        ledger,
        states: HashMap::new(),
        batches: HashMap::new(),
    };
    let found = candidates(&mut reader, &mut lookups, options, &mut scan).await;
    reader.close().await;
    let candidates = found?;

    let refused = match candidates.iter().map(|c| c.published).min() {
        Some(oldest) => match Refused::since(bus, oldest).await {
            Ok(refused) => {
                if refused.cut {
                    scan.refused_error = Some(format!(
                        "more than {MAX_DEAD_LETTERS_READ} wake dead letters since the oldest waiting completion; the rest were not read"
                    ));
                }
                refused
            }
            Err(error) => {
                scan.refused_error = Some(error.to_string());
                Refused::default()
            }
        },
        None => Refused::default(),
    };
    let now = OffsetDateTime::now_utc();
    let mut sessions: HashMap<String, UndeliveredSession> = HashMap::new();
    // Each task once: the history can hold copies of its completion
    // (replays, a re-send after the duplicate window). A copy dead-lettered
    // does not hide a later one still waiting.
    let mut tasks = HashSet::new();
    for candidate in candidates {
        if refused.covers(&candidate) {
            scan.refused += 1;
            continue;
        }
        if !tasks.insert((candidate.delegation_id.clone(), candidate.task_index)) {
            continue;
        }
        let entry = sessions
            .entry(candidate.session.clone())
            .or_insert_with(|| UndeliveredSession {
                session: candidate.session.clone(),
                session_token: candidate.session_token.clone(),
                completions: 0,
                oldest: candidate.published,
                age_seconds: (now - candidate.published).as_seconds_f64().max(0.0),
                oldest_delegation_id: candidate.delegation_id.clone(),
            });
        entry.completions += 1;
    }
    scan.sessions = sessions.len() as u64;
    scan.completions = sessions.values().map(|s| s.completions).sum();
    let mut list: Vec<UndeliveredSession> = sessions.into_values().collect();
    list.sort_by_key(|s| s.oldest);
    if let Some(session) = &options.session {
        list.retain(|waiting| &waiting.session == session);
    }
    list.truncate(options.top_sessions);
    Ok((list, scan))
}

/// How many completions are read ahead of their ledger lookups, which are
/// made together: one round trip for as many, not one each.
const LOOKAHEAD: usize = 64;

/// A completion the wake would act on, with what judging it needs.
struct Admitted {
    /// What is listed if it waits.
    candidate: Candidate,
    /// Its batch's task count.
    task_count: u32,
    /// Its ledger key (its batch's, for a batch member).
    key: String,
    /// For the error of an unreadable batch member, which the wake may have
    /// taken into its batch (`wake::stand_in`): that batch's key, whose
    /// delivery reports it when its own key has no entry.
    batch_key: Option<String>,
}

/// Reads the completions from the floor on (at most `scan_limit`), and
/// keeps those the ledger does not show delivered and that wait for no
/// other task, counting the others in `scan`.
async fn candidates(
    reader: &mut HistoryReader,
    lookups: &mut Lookups<'_>,
    options: &StatusOptions,
    scan: &mut ScanInfo,
) -> Result<Vec<Candidate>, StatusError> {
    let mut candidates = Vec::new();
    scan.complete = true;
    let mut more = true;
    while more {
        let mut ahead = Vec::with_capacity(LOOKAHEAD);
        while ahead.len() < LOOKAHEAD {
            let Some(record) = reader.next().await else {
                more = false;
                break;
            };
            let record = record.map_err(|e| read_error("completions", e))?;
            if scan.scanned >= options.scan_limit {
                scan.complete = false;
                more = false;
                break;
            }
            scan.scanned += 1;
            if let Some(admitted) = admit(&record, scan) {
                ahead.push(admitted);
            }
        }
        lookups
            .read_ahead(ahead.iter().map(|a| a.key.as_str()))
            .await?;
        for Admitted {
            candidate,
            task_count,
            key,
            batch_key,
        } in ahead
        {
            let mut state = lookups.state(&key).await?;
            if let (Entry::Read(None), Some(batch_key)) = (&state, &batch_key)
                && let delivered @ Entry::Read(Some(LedgerState::Delivered { .. })) =
                    lookups.state(batch_key).await?
            {
                state = delivered;
            }
            match state {
                Entry::Read(Some(LedgerState::Delivered { .. })) => continue,
                Entry::Read(None) if candidate.batch => {
                    let done = lookups
                        .tasks_ended(
                            &candidate.delegation_id,
                            &candidate.session_token,
                            task_count,
                        )
                        .await?;
                    if done < task_count {
                        scan.batch_waiting += 1;
                        continue;
                    }
                }
                Entry::Read(_) => {}
                Entry::Corrupt => scan.unreadable_entries += 1,
            }
            candidates.push(candidate);
        }
    }
    Ok(candidates)
}

/// `record`, if the wake would act on it: a completion for a session that
/// it would not dead-letter (counted in `scan` if it would).
fn admit(record: &Record, scan: &mut ScanInfo) -> Option<Admitted> {
    let token = record.session_token()?;
    if token == SYNC_SESSION_TOKEN {
        return None;
    }
    let (event, session) = match check_completion(&record.payload, record.origin_session()) {
        Ok(admitted) => admitted,
        // Sync mode, a silent cancel: nothing to wake.
        Err(Admission::NothingToWake) => return None,
        Err(Admission::Poison(_)) => {
            scan.unusable += 1;
            return None;
        }
    };
    let batch = event.task_count > 1 && event.wake_mode == WakeMode::Batch;
    let key = if batch {
        WakeLedger::batch_key(&event.delegation_id)
    } else {
        WakeLedger::key(&event.delegation_id, event.task_index)
    };
    Some(Admitted {
        task_count: event.task_count,
        key,
        batch_key: event
            .is_of_an_unreadable_batch()
            .then(|| WakeLedger::batch_key(&event.delegation_id)),
        candidate: Candidate {
            sequence: record.sequence,
            published: record.published,
            session,
            session_token: token.to_owned(),
            delegation_id: event.delegation_id,
            task_index: event.task_index,
            batch,
        },
    })
}

/// A ledger entry as status can use it.
#[derive(Clone)]
enum Entry {
    /// Read: its state, or none.
    Read(Option<LedgerState>),
    /// Present but not ledger JSON (edited by hand, or written by a newer
    /// wakebus): not known delivered, and the rest of the scan goes on.
    Corrupt,
}

/// The reads the scan makes, each once.
struct Lookups<'a> {
    /// Where the events stream is.
    bus: &'a Bus,
    /// The wake ledger, if there is one.
    ledger: Option<WakeLedger>,
    /// Ledger entries read, by key: a batch's members share one.
    states: HashMap<String, Entry>,
    /// How many tasks of a batch have a completion stored, by delegation,
    /// session token and task count (a completion that names the same
    /// delegation otherwise, a forged one, counts only for its own).
    batches: HashMap<(String, String, u32), u32>,
}

impl Lookups<'_> {
    /// Reads the ledger entries under `keys` not read yet, all at once.
    async fn read_ahead(&mut self, keys: impl Iterator<Item = &str>) -> Result<(), StatusError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        let mut missing: Vec<&str> = keys.filter(|key| !self.states.contains_key(*key)).collect();
        missing.sort_unstable();
        missing.dedup();
        let read = futures::future::join_all(missing.iter().map(|key| ledger.get(key))).await;
        for (key, result) in missing.into_iter().zip(read) {
            let entry = match result {
                Ok(state) => Entry::Read(state),
                Err(LedgerError::Corrupt { .. }) => Entry::Corrupt,
                Err(error) => return Err(read_error("the wake ledger", error)),
            };
            self.states.insert(key.to_owned(), entry);
        }
        Ok(())
    }

    /// The ledger entry under `key`.
    async fn state(&mut self, key: &str) -> Result<Entry, StatusError> {
        let Some(ledger) = &self.ledger else {
            return Ok(Entry::Read(None));
        };
        if let Some(entry) = self.states.get(key) {
            return Ok(entry.clone());
        }
        let entry = match ledger.get(key).await {
            Ok(state) => Entry::Read(state),
            Err(LedgerError::Corrupt { .. }) => Entry::Corrupt,
            Err(error) => return Err(read_error("the wake ledger", error)),
        };
        self.states.insert(key.to_owned(), entry.clone());
        Ok(entry)
    }

    /// How many tasks of the batch `delegation_id` (of `task_count`, under
    /// `session_token`) have a completion stored: one look at the stream's
    /// subjects.
    async fn tasks_ended(
        &mut self,
        delegation_id: &str,
        session_token: &str,
        task_count: u32,
    ) -> Result<u32, StatusError> {
        let batch = (
            delegation_id.to_owned(),
            session_token.to_owned(),
            task_count,
        );
        if let Some(done) = self.batches.get(&batch) {
            return Ok(*done);
        }
        let what = || format!("the completions of delegation {delegation_id}");
        let subjects = &self.bus.subjects;
        let events = self
            .bus
            .js
            .get_stream(subjects.events_stream())
            .await
            .map_err(|e| read_error(what(), e))?;
        let mut stored = events
            .info_with_subjects(subjects.delegation_events(delegation_id, EventKind::Done))
            .await
            .map_err(|e| read_error(what(), e))?;
        let mut ended = HashSet::new();
        while let Some(subject) = futures::StreamExt::next(&mut stored).await {
            let (subject, _) = subject.map_err(|e| read_error(what(), e))?;
            if let Some(done) = subjects.parse_event(&subject)
                && done.session_token == session_token
                && done.task_index < task_count
            {
                ended.insert(done.task_index);
            }
        }
        let done = ended.len() as u32;
        self.batches.insert(batch, done);
        Ok(done)
    }
}

/// The completions the wake dead-lettered instead of waking.
#[derive(Default)]
struct Refused {
    /// Their sequences in the events stream, with the delegation the dead
    /// letter names (if it names one).
    sequences: HashMap<u64, Option<String>>,
    /// The last completion, by stream sequence, of each delegation whose
    /// turn the session API refused: a refused batch turn dead-letters the
    /// members held then, and its earlier members (acknowledged as they
    /// came) are refused with it. A later copy (a replay) is not.
    delegations: HashMap<String, u64>,
    /// Whether the read stopped at [`MAX_DEAD_LETTERS_READ`].
    cut: bool,
}

impl Refused {
    /// The wake dead letters stored since `oldest` (a completion is stored
    /// before its dead letter; a minute earlier, as the two streams' leaders
    /// may be on machines whose clocks differ), at most
    /// [`MAX_DEAD_LETTERS_READ`] of them.
    async fn since(bus: &Bus, oldest: OffsetDateTime) -> Result<Self, StatusError> {
        let selection = Selection {
            since: Some(oldest - CLOCK_MARGIN),
            ..Selection::default()
        };
        let mut reader =
            match HistoryReader::open(bus, Source::WakeDeadLetters, selection, false).await {
                Ok(reader) => reader,
                Err(crate::history::HistoryError::Stream { source, .. })
                    if is_stream_not_found(&source) =>
                {
                    return Ok(Self::default());
                }
                Err(error) => return Err(read_error("the wake dead letters", error)),
            };
        let mut refused = Self::default();
        let read = async {
            let mut read = 0;
            while let Some(record) = reader.next().await {
                let record = record.map_err(|e| read_error("the wake dead letters", e))?;
                // Poison dead letters are never a candidate's, but they
                // count towards the bound: a flood of them would otherwise
                // keep `status` reading for minutes.
                read += 1;
                if read > MAX_DEAD_LETTERS_READ {
                    refused.cut = true;
                    break;
                }
                if record.session_token() != Some(POISON_TOKEN) {
                    refused.add(&record);
                }
            }
            Ok(())
        }
        .await;
        reader.close().await;
        read.map(|()| refused)
    }

    /// Notes the dead letter `record`: its dedupe id is
    /// `dlq.wake.<what>.<completion's stream sequence>`, `<what>` being the
    /// completion's event id for a turn the session API refused, `origin`
    /// or `poison`.
    fn add(&mut self, record: &Record) {
        let Some((what, sequence)) = record
            .header(HEADER_MSG_ID)
            .and_then(|id| id.strip_prefix("dlq.wake."))
            .and_then(|id| id.rsplit_once('.'))
        else {
            return;
        };
        let Ok(sequence) = sequence.parse::<u64>() else {
            return;
        };
        // A poison completion is never a candidate (the same check judged it).
        if what == "poison" || sequence == 0 {
            return;
        }
        let delegation = record.delegation_id();
        if what != "origin"
            && let Some(delegation) = &delegation
        {
            let last = self.delegations.entry(delegation.clone()).or_default();
            *last = (*last).max(sequence);
        }
        self.sequences.insert(sequence, delegation);
    }

    /// Whether `candidate` was dead-lettered (its own dead letter, or its
    /// batch's turn refused).
    fn covers(&self, candidate: &Candidate) -> bool {
        let own = self
            .sequences
            .get(&candidate.sequence)
            .is_some_and(|named| {
                // A dead letter of an events stream made again (whose
                // sequences started over) names another delegation.
                named
                    .as_deref()
                    .is_none_or(|named| named == candidate.delegation_id)
            });
        let turn_refused = candidate.batch
            && self
                .delegations
                .get(&candidate.delegation_id)
                .is_some_and(|last| candidate.sequence <= *last);
        own || turn_refused
    }
}
