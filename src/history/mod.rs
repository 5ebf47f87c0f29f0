//! Reading the recorded history: a filtered, ordered read of the events or
//! dead-letter stream, shared by `wakebus events`, `wakebus replay` and
//! `wakebus status`.
//!
//! Every read goes through an **ordered ephemeral consumer**: the server
//! delivers matching messages in stream order, nothing is acknowledged, and
//! the consumer disappears by itself shortly after the reader stops (it is
//! also deleted explicitly when the read ends), so no durable state is left
//! behind. Whatever a [`Selection`] can express as a subject (session,
//! delegation, kind, pool) is filtered **by the server**; the rest (status,
//! time and sequence bounds, the raw session id behind a token) is checked
//! here, on each message.
//!
//! A **follow** outlives its consumer: when the server loses it (a restart
//! of a single server drops ephemeral consumers), the read is opened again
//! after the last sequence it saw, so nothing is skipped or shown twice. It
//! also outlives its stream: a deleted stream is waited for (said once),
//! and a stream created again under the same name, whose sequences start
//! over, is read from its start.
//!
//! Nothing here reads `<PREFIX>_TASKS`: it is a work-queue stream on which a
//! consumer would compete with the workers.

use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::{Ordered, OrderedConfig};
use futures::StreamExt;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tracing::warn;

mod follow;
mod record;

pub use record::{Record, RecordKind};

use crate::bus::Bus;
use crate::protocol::{
    EventKind, IdError, Status, Subjects, session_token, validate_delegation_id, validate_pool,
    validate_session_id,
};

/// The most messages a read's pull asks for at a time, at most: a bound on
/// what it holds (about one and a half times this many messages) that
/// still reads a long history in few round trips.
const MAX_READ_BATCH: i64 = 64;

/// What a read's pull may bring at once at the server's max payload, in
/// bytes: the client's ordered pulls take no byte limit, so the count is
/// cut for a server whose messages may be large (dead letters of large
/// requests are exactly those).
const READ_BATCH_BYTES: usize = 64 << 20;

/// How many messages a read's pull asks for at a time with messages of up
/// to `max_payload` bytes: [`MAX_READ_BATCH`], fewer when they could
/// together exceed [`READ_BATCH_BYTES`] (8 at an 8 MB max payload), and at
/// least one. A read then holds about 100 MB at most.
fn read_batch(max_payload: usize) -> i64 {
    let fits = READ_BATCH_BYTES / max_payload.max(1);
    i64::try_from(fits).map_or(MAX_READ_BATCH, |fits| fits.clamp(1, MAX_READ_BATCH))
}

/// How long a bounded read waits for the next message it knows is pending
/// before it reports the read as stalled.
const STALL_TIMEOUT: Duration = Duration::from_secs(15);

/// Which part of the history to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `<PREFIX>_EVENTS`: started and done events.
    Events,
    /// `<PREFIX>_DLQ`, `<prefix>.dlq.task.<pool>`: requests workers gave up on.
    TaskDeadLetters,
    /// `<PREFIX>_DLQ`, `<prefix>.dlq.wake.<token>`: completions that could not be woken.
    WakeDeadLetters,
    /// All of `<PREFIX>_DLQ`.
    DeadLetters,
}

impl Source {
    /// The stream this source lives in.
    pub fn stream(self, subjects: &Subjects) -> String {
        match self {
            Self::Events => subjects.events_stream(),
            _ => subjects.dead_letter_stream(),
        }
    }
}

/// What to read. Every field narrows the selection; an empty selection
/// reads the whole source.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Only this origin session (the raw id; the subject token is derived).
    pub session: Option<String>,
    /// Only this delegation.
    pub delegation: Option<String>,
    /// Only started, progress or done events (events only).
    pub kind: Option<EventKind>,
    /// Only completions with this status (implies done events).
    pub status: Option<Status>,
    /// Only this pool (task dead letters only).
    pub pool: Option<String>,
    /// Only messages stored at or after this time.
    pub since: Option<OffsetDateTime>,
    /// Only messages stored at or before this time.
    pub until: Option<OffsetDateTime>,
    /// Only stream sequences from this one on.
    pub from_seq: Option<u64>,
    /// Only stream sequences up to this one.
    pub to_seq: Option<u64>,
}

/// Why a history read failed.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The selection contradicts itself or the source.
    #[error("invalid selection: {0}")]
    Selection(String),
    /// An id in the selection is malformed.
    #[error("invalid selection: {0}")]
    InvalidId(IdError),
    /// The stream does not exist or cannot be read.
    #[error("cannot read stream {stream}: {source}")]
    Stream {
        /// The stream.
        stream: String,
        /// The JetStream error.
        source: async_nats::jetstream::context::GetStreamError,
    },
    /// The ordered consumer could not be created.
    #[error("cannot create a reader on {stream}: {source}")]
    Consumer {
        /// The stream.
        stream: String,
        /// The JetStream error.
        source: async_nats::jetstream::stream::ConsumerError,
    },
    /// The consumer's message stream failed.
    #[error("reading {stream} failed: {reason}")]
    Read {
        /// The stream.
        stream: String,
        /// What went wrong.
        reason: String,
    },
    /// No message arrived although more were pending.
    #[error(
        "reading {stream} stalled: no message for {STALL_TIMEOUT:?} although more were pending"
    )]
    Stalled {
        /// The stream.
        stream: String,
    },
}

impl From<IdError> for HistoryError {
    fn from(error: IdError) -> Self {
        Self::InvalidId(error)
    }
}

impl Selection {
    /// Checks the selection against itself and the source.
    pub fn validate(&self, source: Source) -> Result<(), HistoryError> {
        if let Some(session) = &self.session {
            validate_session_id(session)?;
        }
        if let Some(delegation) = &self.delegation {
            validate_delegation_id(delegation)?;
        }
        if let Some(pool) = &self.pool {
            validate_pool(pool)?;
            if source != Source::TaskDeadLetters && source != Source::DeadLetters {
                return Err(HistoryError::Selection(
                    "--pool applies to task dead letters only".to_owned(),
                ));
            }
        }
        if self.kind.is_some() && source != Source::Events {
            return Err(HistoryError::Selection(
                "--kind applies to events only, not to dead letters".to_owned(),
            ));
        }
        if self.status.is_some() {
            if matches!(
                self.kind,
                Some(EventKind::Submitted | EventKind::Started | EventKind::Progress)
            ) {
                return Err(HistoryError::Selection(
                    "--status selects completions; submitted, started and progress events have none"
                        .to_owned(),
                ));
            }
            if source == Source::TaskDeadLetters {
                return Err(HistoryError::Selection(
                    "--status selects completions; task dead letters are requests".to_owned(),
                ));
            }
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since > until
        {
            return Err(HistoryError::Selection(format!(
                "--since ({}) is after --until ({})",
                rfc3339(since),
                rfc3339(until)
            )));
        }
        // The server refuses a read from sequence 0 with a message about
        // its delivery policy; say what is wrong instead.
        if self.from_seq == Some(0) || self.to_seq == Some(0) {
            return Err(HistoryError::Selection(
                "stream sequences start at 1: --from-seq and --to-seq must be at least 1"
                    .to_owned(),
            ));
        }
        if let (Some(from), Some(to)) = (self.from_seq, self.to_seq)
            && from > to
        {
            return Err(HistoryError::Selection(format!(
                "--from-seq ({from}) is after --to-seq ({to})"
            )));
        }
        Ok(())
    }

    /// The subject filter the server applies: as narrow as the selection allows.
    pub fn filter_subject(&self, subjects: &Subjects, source: Source) -> String {
        let token = self.session.as_deref().map(session_token);
        let any = |value: Option<&str>| value.unwrap_or("*").to_owned();
        match source {
            Source::Events => {
                let kind = match (self.kind, self.status) {
                    (_, Some(_)) => Some(EventKind::Done),
                    (kind, None) => kind,
                };
                if token.is_none() && self.delegation.is_none() && kind.is_none() {
                    return subjects.events_all();
                }
                format!(
                    "{}.evt.{}.{}.*.{}",
                    subjects.prefix(),
                    any(token.as_deref()),
                    any(self.delegation.as_deref()),
                    any(kind.map(EventKind::as_str)),
                )
            }
            Source::TaskDeadLetters => subjects.dead_letter_task(&any(self.pool.as_deref())),
            // Not narrowed by the session: its unusable completions are
            // dead-lettered under `poison`, not under its token (the
            // session is matched on the client).
            Source::WakeDeadLetters => subjects.dead_letter_wake("*"),
            Source::DeadLetters => subjects.dead_letters_all(),
        }
    }

    /// The checks the subject filter cannot do. `record` already matched
    /// the subject filter.
    pub fn matches(&self, record: &Record) -> bool {
        if self.from_seq.is_some_and(|from| record.sequence < from)
            || self.to_seq.is_some_and(|to| record.sequence > to)
            || self.since.is_some_and(|since| record.published < since)
            || self.until.is_some_and(|until| record.published > until)
        {
            return false;
        }
        // The token is a hash: the header holds the raw id to compare.
        if let Some(session) = &self.session
            && !record.is_of_session(session)
        {
            return false;
        }
        if let Some(delegation) = &self.delegation
            && record.delegation_id().as_deref() != Some(delegation.as_str())
        {
            return false;
        }
        if let Some(pool) = &self.pool
            && record.pool() != Some(pool.as_str())
        {
            return false;
        }
        if let Some(kind) = self.kind
            && record.kind() != RecordKind::from(kind)
        {
            return false;
        }
        if let Some(status) = self.status
            && record.status() != Some(status)
        {
            return false;
        }
        true
    }

    fn deliver_policy(&self) -> DeliverPolicy {
        match (self.from_seq, self.since) {
            (Some(start_sequence), _) => DeliverPolicy::ByStartSequence { start_sequence },
            (None, Some(start_time)) => DeliverPolicy::ByStartTime { start_time },
            (None, None) => DeliverPolicy::All,
        }
    }
}

/// A read of one source under a selection, in stream order.
///
/// Bounded by default: it ends with the last matching message stored when
/// it was opened (messages published later, replay copies included, are not
/// read). With `follow` it keeps waiting for new ones.
pub struct HistoryReader {
    /// The ordered consumer's messages.
    messages: Ordered,
    /// The stream, to open the read again when following.
    handle: async_nats::jetstream::stream::Stream,
    /// To look the stream up again when following.
    js: async_nats::jetstream::Context,
    /// When the stream read was created: a stream of the same name with
    /// another creation time is a new one, whose sequences start over.
    created: OffsetDateTime,
    /// Whether the operator was told that the stream is gone (once per
    /// absence, not at every retry).
    told_gone: bool,
    /// When a follow next looks the stream up between messages.
    stream_check: tokio::time::Interval,
    /// The server-side filter, for the same.
    filter_subject: String,
    /// The stream sequence of the last message read (matching or not): a
    /// follow opened again starts after it.
    last_sequence: Option<u64>,
    /// The wait before opening a follow again when the last reopen brought
    /// no message (reset by each message), so a read failing at once does
    /// not spin.
    reopen_delay: Option<Duration>,
    /// The client-side checks.
    selection: Selection,
    /// The stream read.
    stream: String,
    /// The deployment prefix, to split subjects.
    prefix: String,
    /// The last sequence to read (bounded reads); `None` when following.
    end: Option<u64>,
    /// Matching messages pending when the reader was opened.
    total: u64,
    /// Keep waiting for new messages instead of ending.
    follow: bool,
    /// Set once the read is over.
    finished: bool,
    /// Set once a follow's `--until` (plus its margin) has passed: it ends
    /// as soon as nothing stored before `--until` is left to show.
    past_until: bool,
    /// The ephemeral consumer to delete at the end: the one the read
    /// opened, or the one the client created in its place since.
    cleanup: Option<String>,
    /// The stream sequence before the first one the read's consumer
    /// started at: a read from a time starts past older messages, which
    /// are none of what it has still to deliver.
    start_floor: u64,
    /// How many messages a pull asks for ([`read_batch`]), kept for a
    /// follow opened again.
    batch: i64,
}

impl std::fmt::Debug for HistoryReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HistoryReader")
            .field("stream", &self.stream)
            .field("selection", &self.selection)
            .field("end", &self.end)
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl HistoryReader {
    /// Opens a read of `source` under `selection`.
    pub async fn open(
        bus: &Bus,
        source: Source,
        selection: Selection,
        follow: bool,
    ) -> Result<Self, HistoryError> {
        selection.validate(source)?;
        let stream_name = source.stream(&bus.subjects);
        let mut stream =
            bus.js
                .get_stream(&stream_name)
                .await
                .map_err(|source| HistoryError::Stream {
                    stream: stream_name.clone(),
                    source,
                })?;
        let created = stream.cached_info().created;
        // The answer to the lookup just made, if a fresh one fails: the
        // end of a bounded read is never left open.
        let looked_up = stream.cached_info().state.last_sequence;
        let last_stored = stream
            .info()
            .await
            .map_or(looked_up, |info| info.state.last_sequence);
        let filter_subject = selection.filter_subject(&bus.subjects, source);
        let batch = read_batch(bus.max_payload());
        let (messages, consumer_name, total, start_floor) = read(
            &stream,
            &stream_name,
            &filter_subject,
            selection.deliver_policy(),
            batch,
        )
        .await?;
        let end = if follow {
            selection.to_seq
        } else {
            Some(selection.to_seq.unwrap_or(u64::MAX).min(last_stored))
        };
        Ok(Self {
            messages,
            handle: stream,
            js: bus.js.clone(),
            created,
            told_gone: false,
            stream_check: follow::stream_check(),
            filter_subject,
            last_sequence: None,
            reopen_delay: None,
            finished: !follow && total == 0,
            past_until: false,
            follow,
            selection,
            stream: stream_name,
            prefix: bus.subjects.prefix().to_owned(),
            end,
            total,
            cleanup: Some(consumer_name),
            start_floor,
            batch,
        })
    }

    /// How many messages matched the subject filter when the reader was
    /// opened (an upper bound of what a bounded read returns).
    pub fn estimated_total(&self) -> u64 {
        self.total
    }

    /// Whether a bounded read has nothing left to deliver: it has reached
    /// its end, or no message after the last one delivered matches its
    /// subject filter up to its end (one that its other filters would
    /// leave out counts as left). Asks the server in the second case.
    pub async fn has_nothing_left(&self) -> bool {
        self.finished || self.nothing_left().await
    }

    /// The next matching record, or `None` at the end of a bounded read.
    pub async fn next(&mut self) -> Option<Result<Record, HistoryError>> {
        loop {
            if self.finished {
                self.close().await;
                return None;
            }
            let next = if self.follow {
                tokio::select! {
                    next = self.messages.next() => next,
                    _ = self.stream_check.tick() => {
                        self.check_stream().await;
                        // Past `--to-seq` or `--until` with nothing left to
                        // show before it: a later message cannot match.
                        let past_end = self.past_until
                            || self.end.is_some_and(|end| self.handle.cached_info().state.last_sequence >= end);
                        if past_end && self.nothing_left().await {
                            self.finished = true;
                        }
                        continue;
                    }
                    // Nothing stored after `--until` can match: a follow
                    // that waits for a later message might wait for ever.
                    // What was stored before it and is not shown yet (a
                    // long history read from `--since`) is shown first.
                    () = until_passed(self.selection.until), if !self.past_until => {
                        self.past_until = true;
                        if self.nothing_left().await {
                            self.finished = true;
                        }
                        continue;
                    }
                }
            } else {
                match tokio::time::timeout(STALL_TIMEOUT, self.messages.next()).await {
                    Ok(next) => next,
                    // What was pending went away before it was delivered
                    // (purged, deleted, removed by a sweep): the read has
                    // reached the end of what there is.
                    Err(_) if self.nothing_left().await => {
                        self.finished = true;
                        continue;
                    }
                    Err(_) => {
                        self.finished = true;
                        return Some(Err(HistoryError::Stalled {
                            stream: self.stream.clone(),
                        }));
                    }
                }
            };
            let message = match next {
                Some(Ok(message)) if self.same_read(&message).await => message,
                Some(Ok(_)) => continue,
                Some(Err(error)) if self.follow => {
                    warn!(stream = %self.stream, after = ?self.last_sequence, %error, "Following was interrupted; reading again after the last event shown.");
                    self.reopen().await;
                    continue;
                }
                Some(Err(error)) => {
                    self.finished = true;
                    return Some(Err(HistoryError::Read {
                        stream: self.stream.clone(),
                        reason: error.to_string(),
                    }));
                }
                None => {
                    self.finished = true;
                    continue;
                }
            };
            let pending = message.info().map(|info| info.pending).unwrap_or(0);
            let record = match Record::from_message(&message, &self.prefix) {
                Ok(record) => record,
                Err(reason) => {
                    self.finished = true;
                    return Some(Err(HistoryError::Read {
                        stream: self.stream.clone(),
                        reason,
                    }));
                }
            };
            // Shown already: a consumer the client made again by itself
            // before it had delivered anything starts over from the first
            // message of the stream (a stream made anew is read from its
            // start with `last_sequence` cleared, so this is never one).
            let shown = self
                .last_sequence
                .is_some_and(|last| record.sequence <= last);
            if !shown {
                self.last_sequence = Some(record.sequence);
                self.reopen_delay = None;
            }
            if self.end.is_some_and(|end| record.sequence > end)
                || self.selection.until.is_some_and(|u| record.published > u)
            {
                self.finished = true;
                continue;
            }
            // A bounded read ends with the last message pending when it
            // reaches it; a follow ends only at --to-seq or --until.
            if self.end == Some(record.sequence) || (!self.follow && pending == 0) {
                self.finished = true;
            }
            if !shown && self.selection.matches(&record) {
                return Some(Ok(record));
            }
        }
    }

    /// Whether the stream holds no message this read has still to deliver:
    /// none matching after the last one delivered (or from where the read
    /// started, before the first), or the next one past the read's end.
    async fn nothing_left(&self) -> bool {
        let from = self.last_sequence.map_or(
            self.selection
                .from_seq
                .unwrap_or(1)
                .max(self.start_floor + 1),
            |last| last + 1,
        );
        let next = self
            .handle
            .raw_message_builder()
            .sequence(from.max(1))
            .next_by_subject(&self.filter_subject)
            .send()
            .await;
        match next {
            Ok(message) => {
                self.end.is_some_and(|end| message.sequence > end)
                    || self
                        .selection
                        .until
                        .is_some_and(|until| message.time > until)
            }
            Err(error) => {
                error.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
            }
        }
    }

    /// Deletes the ephemeral consumer (it would otherwise expire by itself
    /// after 30 seconds of inactivity). Done by itself at the end of a
    /// bounded read; call it when stopping early (Ctrl-C, a closed pipe).
    /// A consumer the client recreated by itself under another name (after
    /// a reconnect) is the one deleted once a message came through it.
    pub async fn close(&mut self) {
        if let Some(name) = self.cleanup.take() {
            let _ = self.handle.delete_consumer(&name).await;
        }
    }
}

/// How long after `--until` (by this machine's clock) a follow ends, for
/// the server's clock, which stamps the messages, running behind.
const UNTIL_MARGIN: Duration = Duration::from_secs(5);

/// Completes once `until` (plus [`UNTIL_MARGIN`]) has passed; never
/// without one.
async fn until_passed(until: Option<OffsetDateTime>) {
    let Some(until) = until else {
        return std::future::pending().await;
    };
    let left = until + UNTIL_MARGIN - OffsetDateTime::now_utc();
    tokio::time::sleep(Duration::try_from(left).unwrap_or(Duration::ZERO)).await;
}

/// Opens an ordered read of `filter_subject` on `stream`: its messages, the
/// consumer's name, how many messages it has pending, and the stream
/// sequence before the one it starts at. Its pulls ask for `batch`
/// messages at a time.
async fn read(
    stream: &async_nats::jetstream::stream::Stream,
    stream_name: &str,
    filter_subject: &str,
    deliver_policy: DeliverPolicy,
    batch: i64,
) -> Result<(Ordered, String, u64, u64), HistoryError> {
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: filter_subject.to_owned(),
            deliver_policy,
            description: Some("wakebus history reader".to_owned()),
            // The client asks for 500 at a time, and holds up to half as
            // many more: with dead letters of large requests, gigabytes.
            max_batch: batch,
            ..Default::default()
        })
        .await
        .map_err(|source| HistoryError::Consumer {
            stream: stream_name.to_owned(),
            source,
        })?;
    let total = consumer.cached_info().num_pending;
    let name = consumer.cached_info().name.clone();
    // Before any delivery: the sequence before the consumer's start.
    let floor = consumer.cached_info().delivered.stream_sequence;
    let messages = consumer
        .messages()
        .await
        .map_err(|err| HistoryError::Read {
            stream: stream_name.to_owned(),
            reason: err.to_string(),
        })?;
    Ok((messages, name, total, floor))
}

/// Formats a time as RFC 3339 (UTC).
pub fn rfc3339(time: OffsetDateTime) -> String {
    time.to_offset(time::UtcOffset::UTC)
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// Why a time bound could not be read.
#[derive(Debug, thiserror::Error)]
#[error(
    "{input:?} is neither a duration (e.g. 90s, 2h, 3d) nor an RFC 3339 time (e.g. 2025-05-14T09:30:00Z)"
)]
pub struct TimeBoundError {
    /// What was given.
    pub input: String,
}

/// Reads `--since`/`--until`: a duration back from `now` (`2h`, `15m`) or an
/// RFC 3339 time.
pub fn parse_time_bound(
    input: &str,
    now: OffsetDateTime,
) -> Result<OffsetDateTime, TimeBoundError> {
    let error = || TimeBoundError {
        input: input.to_owned(),
    };
    if let Ok(time) = OffsetDateTime::parse(input.trim(), &Rfc3339) {
        return Ok(time);
    }
    let duration = humantime::parse_duration(input.trim()).map_err(|_| error())?;
    let duration = time::Duration::try_from(duration).map_err(|_| error())?;
    now.checked_sub(duration).ok_or_else(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subjects() -> Subjects {
        Subjects::new("acme.prod").unwrap()
    }

    fn record(local_subject: &str, origin: Option<&str>, body: &str) -> Record {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(origin) = origin {
            headers.insert(crate::protocol::HEADER_ORIGIN_SESSION, origin);
        }
        Record {
            stream: "ACME_PROD_DLQ".into(),
            sequence: 7,
            published: OffsetDateTime::now_utc(),
            subject: format!("acme.prod.{local_subject}"),
            local_subject: local_subject.into(),
            headers,
            payload: body.to_owned().into(),
        }
    }

    #[test]
    fn a_record_without_the_origin_header_is_still_found_by_its_session() {
        let of_s1 = Selection {
            session: Some("s1".into()),
            ..Default::default()
        };
        // A task dead letter of a request published without the header.
        let bare = record(
            "dlq.task.default",
            None,
            r#"{"delegation_id":"d1","origin_session_id":"s1","goal":"g"}"#,
        );
        assert!(of_s1.matches(&bare));
        // An event without the header: its subject's token says.
        let event = record(
            &format!("evt.{}.d1.0.submitted", session_token("s1")),
            None,
            "{}",
        );
        assert!(of_s1.matches(&event));
        // The header, when there is one, decides.
        let other = record(
            "dlq.task.default",
            Some("s2"),
            r#"{"delegation_id":"d1","origin_session_id":"s1","goal":"g"}"#,
        );
        assert!(!of_s1.matches(&other));
        // A field of another type leaves the others readable.
        let odd = record(
            "dlq.task.default",
            None,
            r#"{"delegation_id":"d1","task_index":"zero","origin_session_id":"s1"}"#,
        );
        assert!(of_s1.matches(&odd));
        assert_eq!(odd.delegation_id().as_deref(), Some("d1"));
    }

    #[test]
    fn filters_become_the_narrowest_subject() {
        let s = subjects();
        let all = Selection::default();
        assert_eq!(all.filter_subject(&s, Source::Events), "acme.prod.evt.>");
        let session = Selection {
            session: Some("a.b *>".into()),
            ..Default::default()
        };
        assert_eq!(
            session.filter_subject(&s, Source::Events),
            format!("acme.prod.evt.{}.*.*.*", session_token("a.b *>"))
        );
        let failed = Selection {
            delegation: Some("01H".into()),
            status: Some(Status::Failed),
            ..Default::default()
        };
        assert_eq!(
            failed.filter_subject(&s, Source::Events),
            "acme.prod.evt.*.01H.*.done"
        );
        assert_eq!(
            session.filter_subject(&s, Source::WakeDeadLetters),
            "acme.prod.dlq.wake.*"
        );
        let pool = Selection {
            pool: Some("gpu".into()),
            ..Default::default()
        };
        assert_eq!(
            pool.filter_subject(&s, Source::TaskDeadLetters),
            "acme.prod.dlq.task.gpu"
        );
    }

    #[test]
    fn contradictory_selections_are_refused_with_a_reason() {
        let started_status = Selection {
            kind: Some(EventKind::Started),
            status: Some(Status::Failed),
            ..Default::default()
        };
        assert!(started_status.validate(Source::Events).is_err());
        let bad_id = Selection {
            delegation: Some("a.b".into()),
            ..Default::default()
        };
        assert!(bad_id.validate(Source::Events).is_err());
        let backwards = Selection {
            from_seq: Some(9),
            to_seq: Some(3),
            ..Default::default()
        };
        let err = backwards.validate(Source::Events).unwrap_err().to_string();
        assert!(err.contains("--from-seq"), "{err}");
        let pool_on_events = Selection {
            pool: Some("gpu".into()),
            ..Default::default()
        };
        assert!(pool_on_events.validate(Source::Events).is_err());
        for (from_seq, to_seq) in [(Some(0), None), (None, Some(0))] {
            let zero = Selection {
                from_seq,
                to_seq,
                ..Default::default()
            };
            let err = zero.validate(Source::Events).unwrap_err().to_string();
            assert!(err.contains("start at 1"), "{err}");
        }
    }

    #[test]
    fn time_bounds_accept_durations_and_rfc3339() {
        let now = OffsetDateTime::parse("2025-05-14T12:00:00Z", &Rfc3339).unwrap();
        assert_eq!(
            parse_time_bound("2h", now).unwrap(),
            OffsetDateTime::parse("2025-05-14T10:00:00Z", &Rfc3339).unwrap()
        );
        assert_eq!(
            parse_time_bound("2025-05-14T11:30:00+02:00", now).unwrap(),
            OffsetDateTime::parse("2025-05-14T09:30:00Z", &Rfc3339).unwrap()
        );
        let err = parse_time_bound("yesterday", now).unwrap_err().to_string();
        assert!(err.contains("RFC 3339"), "{err}");
    }
}
