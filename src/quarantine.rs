//! Messages the NATS client cannot read at all.
//!
//! nats-server stores a message whose headers are not UTF-8 (or otherwise
//! malformed), or whose subject is not UTF-8, without complaint, but
//! async-nats treats either as a protocol error and drops the connection
//! whenever such a message is delivered. On a
//! durable consumer the message comes back after every AckWait, and the
//! connection with it: the service stalls. No handler ever sees the message,
//! so it cannot be terminated the usual way. (A header value holding a
//! carriage return is read since async-nats 0.52, with a space in its place;
//! 0.51 panicked in its connection task on one.)
//!
//! At start and after a reconnect, [`sweep`] reads the consumer's messages
//! after its ack floor (unacknowledged, or next to be delivered) through the
//! JetStream API (whose JSON answer the client can parse), copies each
//! unreadable one to a dead-letter subject with the reason, and deletes it
//! from the stream. Deleting needs
//! `$JS.API.STREAM.MSG.DELETE.<stream>`; a NATS user without it (the
//! least-privileged roles) logs at ERROR the command an operator can run
//! instead.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde::Deserialize;
use tracing::{error, info, warn};

use crate::bus::Bus;

/// Most of a consumer's messages read in one window of a sweep (and the
/// sequences in one stretch of its walk back).
const MAX_SCAN: u64 = 512;
/// Limit for each JetStream API request.
/// Short: a NATS user that may not read messages gets no answer at all,
/// and a starting service waits this long before it consumes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a header block cannot be read by async-nats, mirroring its parser.
pub fn unreadable_headers(block: &[u8]) -> Option<&'static str> {
    let Ok(text) = std::str::from_utf8(block) else {
        return Some("its NATS headers are not valid UTF-8");
    };
    let mut lines = text.lines().peekable();
    let Some(version) = lines.next() else {
        return Some("its NATS headers have no version line");
    };
    let Some(suffix) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Some("its NATS header block does not start with NATS/1.0");
    };
    let status = suffix.split_once(' ').map_or(suffix, |(s, _)| s.trim());
    if !status.is_empty() && async_nats::StatusCode::from_str(status).is_err() {
        return Some("its NATS header status is not a number");
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, _value)) = line.split_once(':') else {
            return Some("a NATS header line has no ':'");
        };
        if async_nats::HeaderName::from_str(name).is_err() {
            return Some("a NATS header name is invalid");
        }
        // Lines that start with whitespace continue the value, whatever they
        // hold (async-nats reads a carriage return in it as a space).
        while lines
            .next_if(|l| l.starts_with(char::is_whitespace))
            .is_some()
        {}
    }
    None
}

#[derive(Deserialize)]
struct ConsumerInfo {
    config: ConsumerFilters,
    ack_floor: SequencePair,
    delivered: SequencePair,
    #[serde(default)]
    num_ack_pending: u64,
}

#[derive(Deserialize)]
struct ConsumerFilters {
    #[serde(default)]
    filter_subject: Option<String>,
    #[serde(default)]
    filter_subjects: Vec<String>,
}

impl ConsumerFilters {
    /// The consumer's filter, when it has exactly one.
    fn only_filter(&self) -> Option<&str> {
        let mut filters = self
            .filter_subject
            .iter()
            .chain(&self.filter_subjects)
            .filter(|f| !f.is_empty());
        match (filters.next(), filters.next()) {
            (Some(only), None) => Some(only),
            _ => None,
        }
    }

    /// Whether the consumer reads `subject`.
    fn take(&self, subject: &str) -> bool {
        let mut filters = self
            .filter_subject
            .iter()
            .chain(&self.filter_subjects)
            .filter(|f| !f.is_empty())
            .peekable();
        filters.peek().is_none() || filters.any(|filter| subject_matches(filter, subject))
    }
}

/// Whether `subject` matches the NATS subject filter `filter` (`*` is one
/// token, a last `>` one or more).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for wanted in filter.split('.') {
        match (wanted, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (wanted, Some(token)) if wanted == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[derive(Deserialize)]
struct StreamInfo {
    state: StreamState,
}

#[derive(Deserialize)]
struct StreamState {
    last_seq: u64,
}

#[derive(Deserialize)]
struct SequencePair {
    stream_seq: u64,
}

#[derive(Deserialize)]
struct MsgGet {
    message: Option<StoredMessage>,
}

/// The `error` of a JetStream API answer that refused a request.
#[derive(Deserialize)]
struct Refusal {
    /// Present only when the request was refused.
    error: Option<ApiError>,
}

/// What JetStream says of a request it refused.
#[derive(Deserialize)]
struct ApiError {
    /// An HTTP-like status (404, 503).
    #[serde(default)]
    code: u16,
    /// JetStream's own code ([`NO_MESSAGE_FOUND`], ...).
    #[serde(default)]
    err_code: u32,
    /// In words.
    #[serde(default)]
    description: String,
}

/// JetStream's `err_code` for "no message found": a read past the last
/// message the filter takes, or of a deleted sequence.
const NO_MESSAGE_FOUND: u32 = 10037;

/// Whether `error` is JetStream saying there is no such message (the end
/// of what a consumer takes, or a gap), not that it could not answer.
fn no_message(error: &SweepError) -> bool {
    matches!(error, SweepError::Api { err_code, .. } if *err_code == NO_MESSAGE_FOUND)
}

/// Whether a refused delete says the message is not there (nats-server
/// answers a delete of a missing sequence with the store's "no message
/// found", under the delete's own error code).
fn already_deleted(error: &SweepError) -> bool {
    matches!(error, SweepError::Api { err_code, description, .. }
        if *err_code == NO_MESSAGE_FOUND || description.to_ascii_lowercase().contains("no message found"))
}

/// Reads a JetStream API answer: the `T` it carries, or the refusal it is.
fn answer<T: for<'de> Deserialize<'de>>(subject: &str, payload: &[u8]) -> Result<T, SweepError> {
    let refused = serde_json::from_slice::<Refusal>(payload)
        .ok()
        .and_then(|refusal| refusal.error);
    if let Some(error) = refused {
        return Err(SweepError::Api {
            subject: subject.to_owned(),
            code: error.code,
            err_code: error.err_code,
            description: error.description,
        });
    }
    serde_json::from_slice(payload).map_err(|e| SweepError::Request {
        subject: subject.to_owned(),
        reason: e.to_string(),
    })
}

#[derive(Deserialize)]
struct StoredMessage {
    #[serde(default)]
    subject: String,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

#[derive(Deserialize)]
struct Deleted {
    #[serde(default)]
    success: bool,
}

/// Notices reconnects of a client (an unreadable message drops the
/// connection), so that a sweep runs only after one, and never two at once.
#[derive(Debug)]
pub struct ReconnectWatch {
    /// The client's connect count at the last check.
    seen: u64,
    /// Set while a sweep runs.
    sweeping: Arc<AtomicBool>,
}

impl ReconnectWatch {
    /// Starts watching `client`.
    pub fn new(client: &async_nats::Client) -> Self {
        Self {
            seen: connects(client),
            sweeping: Arc::default(),
        }
    }

    /// Whether the client connected again since the last call.
    pub fn reconnected(&mut self, client: &async_nats::Client) -> bool {
        let now = connects(client);
        std::mem::replace(&mut self.seen, now) != now
    }
}

/// How many times `client` has connected: it changes with each reconnect.
pub(crate) fn connects(client: &async_nats::Client) -> u64 {
    client.statistics().connects.load(Ordering::Acquire)
}

/// After a reconnect, sweeps in the background (so a slow or refused API
/// request never holds up the consumer loop), logging instead of failing.
pub fn sweep_after_reconnect(
    watch: &mut ReconnectWatch,
    bus: &Bus,
    stream: &str,
    consumer: &str,
    dead_letter_subject: &str,
) {
    // A reconnect during a sweep stays unseen, so that it is swept for once
    // that one ends: the running sweep read where to look before it.
    if watch.sweeping.load(Ordering::Acquire)
        || !watch.reconnected(&bus.client)
        || watch.sweeping.swap(true, Ordering::AcqRel)
    {
        return;
    }
    let sweeping = watch.sweeping.clone();
    let (bus, stream, consumer, dead_letter_subject) = (
        bus.clone(),
        stream.to_owned(),
        consumer.to_owned(),
        dead_letter_subject.to_owned(),
    );
    tokio::spawn(async move {
        if let Err(error) = sweep(&bus, &stream, &consumer, &dead_letter_subject).await {
            warn!(%error, stream, consumer, "Could not look for unreadable messages after a reconnect; if the connection keeps dropping, an operator should look for one (see docs/OPERATIONS.md, \"Poison messages\").");
        }
        sweeping.store(false, Ordering::Release);
    });
}

/// Sweeps once before a service starts consuming: a message that made the
/// previous process's client stop working is still after the ack floor.
/// Logs instead of failing.
pub async fn sweep_at_start(bus: &Bus, stream: &str, consumer: &str, dead_letter_subject: &str) {
    if let Err(error) = sweep(bus, stream, consumer, dead_letter_subject).await {
        warn!(%error, stream, consumer, "Could not look for unreadable messages at start; if the service keeps stopping, an operator should look for one (see docs/OPERATIONS.md, \"Poison messages\").");
    }
}

/// Why a sweep could not finish (it is retried after the next reconnect).
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// A JetStream API request failed or timed out.
    #[error("JetStream API request {subject} failed: {reason}")]
    Request {
        /// The API subject.
        subject: String,
        /// What happened.
        reason: String,
    },
    /// JetStream answered a request with an error (a leader election
    /// under way, a stream or consumer that does not exist).
    #[error(
        "JetStream API request {subject} was refused: {description} (code {code}, err_code {err_code})"
    )]
    Api {
        /// The API subject.
        subject: String,
        /// The HTTP-like status code (503: temporarily unavailable).
        code: u16,
        /// JetStream's own error code.
        err_code: u32,
        /// JetStream's description of the error.
        description: String,
    },
    /// The messages after the ack floor could not be read (a user that may
    /// not read them, as a least-privileged worker): one of them may be
    /// the culprit, for an operator to find.
    #[error(
        "cannot read the messages of {stream} from sequence {from} to {to} to check them ({source}); if the connection keeps dropping, one of them is likely unreadable: inspect them with `nats stream get {stream} <SEQ>` and remove the bad one with `nats stream rmm {stream} <SEQ>`"
    )]
    Unread {
        /// The stream.
        stream: String,
        /// The first sequence not yet checked.
        from: u64,
        /// The stream's last sequence.
        to: u64,
        /// Why the read failed.
        source: Box<SweepError>,
    },
}

impl Bus {
    async fn api<T: for<'de> Deserialize<'de>>(
        &self,
        subject: String,
        body: String,
    ) -> Result<T, SweepError> {
        let failed = |reason: String| SweepError::Request {
            subject: subject.clone(),
            reason,
        };
        let reply = tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.client.request(subject.clone(), body.into()),
        )
        .await
        .map_err(|_| {
            failed(format!(
                "no answer within {REQUEST_TIMEOUT:?} (a leader election under way, or a request this NATS user may not make)"
            ))
        })?
        .map_err(|e| failed(e.to_string()))?;
        answer(&subject, &reply.payload)
    }
}

/// Moves the messages of `consumer` on `stream` that the client cannot read
/// to `dead_letter_subject` and deletes them from the stream. Returns how
/// many were removed.
pub async fn sweep(
    bus: &Bus,
    stream: &str,
    consumer: &str,
    dead_letter_subject: &str,
) -> Result<usize, SweepError> {
    let info: ConsumerInfo = bus
        .api(
            format!("$JS.API.CONSUMER.INFO.{stream}.{consumer}"),
            String::new(),
        )
        .await?;
    // Nothing unacknowledged: nothing can have dropped a connection (and a
    // NATS user that may not read messages is not asked to).
    if info.num_ack_pending == 0 && info.delivered.stream_seq <= info.ack_floor.stream_seq {
        return Ok(0);
    }
    // Everything after the ack floor: what is unacknowledged, and what is
    // delivered next. (Not just up to the consumer's `delivered`: once the
    // AckWait of a message whose client died has passed, nats-server 2.9
    // may report `delivered` below it.)
    let state: StreamInfo = bus
        .api(format!("$JS.API.STREAM.INFO.{stream}"), String::new())
        .await?;
    let last = state.state.last_seq;
    let scan = Scan {
        bus,
        stream,
        info: &info,
        dead_letter_subject,
    };
    let first = scan.window(info.ack_floor.stream_seq + 1, last).await?;
    if first.next > last {
        return Ok(first.removed);
    }
    // A floor held back (one session's completions retried for hours, a
    // consumer made again at sequence 0 on nats-server 2.9) can put more
    // of the consumer's messages before the culprit than one window reads.
    // The culprit dropped the connection as it was delivered, so it is
    // among the last messages delivered: walk back from there, a stretch
    // of sequences at a time, until one is found or the first window is
    // reached.
    let mut removed = first.removed;
    let mut end = info.delivered.stream_seq.saturating_add(MAX_SCAN).min(last);
    for _ in 0..MAX_STRETCHES {
        if end < first.next {
            return Ok(removed);
        }
        let start = end.saturating_sub(MAX_SCAN - 1).max(first.next);
        let found = scan.window(start, end).await?.removed;
        removed += found;
        if found > 0 {
            return Ok(removed);
        }
        end = start - 1;
    }
    if end >= first.next {
        info!(
            stream,
            consumer,
            unread_from = first.next,
            unread_to = end,
            "The sweep for unreadable messages did not read every message between the consumer's ack floor and its last delivered one; if the connection keeps dropping, an unreadable message may be among those not read: inspect them with `nats stream get` and remove it with `nats stream rmm`."
        );
    }
    Ok(removed)
}

/// Stretches of [`MAX_SCAN`] sequences a sweep walks back from the last
/// delivered message: a pull's batch (the wake's 256, a worker's
/// concurrency) with many events stored around each of its messages.
const MAX_STRETCHES: u64 = 16;

/// One sweep's reading of a consumer's messages.
struct Scan<'a> {
    /// Reads, dead-letters and deletes.
    bus: &'a Bus,
    /// The stream read.
    stream: &'a str,
    /// The consumer whose messages are read: its filter.
    info: &'a ConsumerInfo,
    /// Where an unreadable message goes.
    dead_letter_subject: &'a str,
}

/// What one window of a sweep did.
struct Window {
    /// Messages dead-lettered and deleted.
    removed: usize,
    /// The first sequence not read (past `last` when the window reached it).
    next: u64,
}

impl Scan<'_> {
    /// Reads up to [`MAX_SCAN`] of the consumer's messages from `seq` to
    /// `last`, removing those no client can read.
    async fn window(&self, mut seq: u64, last: u64) -> Result<Window, SweepError> {
        let (bus, stream) = (self.bus, self.stream);
        // With one filter (as wakebus's consumers have), each read skips to
        // the next message the consumer takes, past other subjects and gaps.
        let filter = self.info.config.only_filter();
        let mut removed = 0;
        for _ in 0..MAX_SCAN {
            if seq > last {
                break;
            }
            let request = match filter {
                Some(filter) => serde_json::json!({"seq": seq, "next_by_subj": filter}),
                None => serde_json::json!({"seq": seq}),
            };
            let got: Result<MsgGet, _> = bus
                .api(
                    format!("$JS.API.STREAM.MSG.GET.{stream}"),
                    request.to_string(),
                )
                .await;
            // Only "no message found" ends the window (or skips a gap):
            // any other refusal (an election under way) leaves the rest
            // unchecked, which the sweep must say.
            let got = match got {
                Ok(got) => got.message,
                Err(error) if no_message(&error) => None,
                Err(source) => {
                    return Err(SweepError::Unread {
                        stream: stream.to_owned(),
                        from: seq,
                        to: last,
                        source: Box::new(source),
                    });
                }
            };
            let Some(message) = got else {
                if filter.is_some() {
                    // Nothing more this consumer takes.
                    seq = last + 1;
                    break;
                }
                seq += 1; // deleted
                continue;
            };
            let at = if message.seq == 0 { seq } else { message.seq };
            seq = at + 1;
            // The stream holds other consumers' messages too (another
            // pool's tasks, events the wake does not read): only this
            // one's are its.
            if at > last || !self.info.config.take(&message.subject) {
                continue;
            }
            let Some(reason) = unreadable(&message) else {
                continue;
            };
            let body = message
                .data
                .as_deref()
                .and_then(|d| BASE64.decode(d).ok())
                .unwrap_or_default();
            if quarantine(bus, stream, at, self.dead_letter_subject, &reason, body).await? {
                removed += 1;
            }
        }
        Ok(Window { removed, next: seq })
    }
}

/// Why no client can read `message`, if none can.
fn unreadable(message: &StoredMessage) -> Option<String> {
    let headers = message
        .hdrs
        .as_deref()
        .and_then(|h| BASE64.decode(h).ok())
        .unwrap_or_default();
    if message.subject.contains(char::REPLACEMENT_CHARACTER) {
        // nats-server's JSON answer replaces bytes that are not UTF-8 with
        // U+FFFD. (A real U+FFFD is read the same way, but no subject
        // wakebus uses can hold one: its ids and names are ASCII.)
        return Some(format!(
            "its subject is not valid UTF-8, so no NATS client library can read it; subject as JetStream reports it: {}",
            message.subject
        ));
    }
    if headers.is_empty() {
        return None;
    }
    unreadable_headers(&headers).map(|reason| {
        format!(
            "{reason}, so no NATS client library can read it; headers: {}",
            String::from_utf8_lossy(&headers)
        )
    })
}

/// Dead-letters and deletes one message; false if this user may not delete.
async fn quarantine(
    bus: &Bus,
    stream: &str,
    seq: u64,
    dead_letter_subject: &str,
    reason: &str,
    body: Vec<u8>,
) -> Result<bool, SweepError> {
    // Fitted like any dead letter: a body near the max payload is left out
    // (and the reason says so) rather than refused again at every sweep.
    let (headers, payload) = crate::bus::dead_letter_parts(
        None,
        &Bytes::from(body),
        reason,
        &format!("dlq.unreadable.{stream}.{seq}"),
        bus.max_payload(),
    );
    let stored = bus
        .publish_stored(dead_letter_subject.to_owned(), headers, payload)
        .await;
    if let Err(error) = stored {
        warn!(%error, stream, seq, "Could not dead-letter an unreadable message; will retry after the next reconnect.");
        return Ok(false);
    }
    let deleted: Result<Deleted, SweepError> = bus
        .api(
            format!("$JS.API.STREAM.MSG.DELETE.{stream}"),
            format!(r#"{{"seq":{seq},"no_erase":true}}"#),
        )
        .await;
    match deleted {
        Ok(Deleted { success: true }) => {
            crate::ops::metrics::dead_lettered("unreadable");
            info!(
                stream,
                seq,
                dead_letter = dead_letter_subject,
                "Removed a message the NATS client cannot read; a copy is in the dead letters."
            );
            Ok(true)
        }
        // Gone already: another instance's sweep removed it first (both
        // dead-lettered it, under one dedupe id), or an earlier delete
        // whose answer was lost did.
        Err(error) if already_deleted(&error) => {
            info!(
                stream,
                seq,
                "A message the NATS client cannot read was already removed (by another instance's sweep); its copy is in the dead letters."
            );
            Ok(true)
        }
        other => {
            let why = match other {
                Err(error) => error.to_string(),
                Ok(_) => "the server refused".to_owned(),
            };
            error!(stream, seq, %why, "A message the NATS client cannot read blocks this consumer and could not be deleted (this NATS user may not, the stream denies deletes, or no leader answered); an operator must remove it: nats stream rmm {stream} {seq}");
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_no_message_found_ends_a_read_and_other_refusals_are_errors() {
        let subject = "$JS.API.STREAM.MSG.GET.S";
        let end = answer::<MsgGet>(
            subject,
            br#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10037,"description":"no message found"}}"#,
        )
        .err()
        .expect("a refusal");
        assert!(no_message(&end), "{end}");
        let election = answer::<MsgGet>(
            subject,
            br#"{"error":{"code":503,"err_code":10039,"description":"JetStream system temporarily unavailable"}}"#,
        )
        .err()
        .expect("a refusal");
        assert!(!no_message(&election), "{election}");
        assert!(
            election.to_string().contains("temporarily unavailable"),
            "{election}"
        );
        let found = answer::<MsgGet>(subject, br#"{"message":{"subject":"a.b","seq":7}}"#)
            .expect("a message");
        assert_eq!(found.message.map(|m| m.seq), Some(7));
        let refused_delete = answer::<Deleted>(
            "$JS.API.STREAM.MSG.DELETE.S",
            br#"{"error":{"code":500,"err_code":10057,"description":"message delete failed"}}"#,
        );
        let refused_delete = refused_delete
            .err()
            .expect("a refused delete is no success");
        assert!(!already_deleted(&refused_delete), "{refused_delete}");
        let gone = answer::<Deleted>(
            "$JS.API.STREAM.MSG.DELETE.S",
            br#"{"error":{"code":500,"err_code":10057,"description":"no message found"}}"#,
        )
        .err()
        .expect("a refusal");
        assert!(already_deleted(&gone), "{gone}");
    }

    #[test]
    fn subjects_match_filters_token_by_token() {
        for (filter, subject) in [
            ("a.task.default", "a.task.default"),
            ("a.evt.*.*.*.done", "a.evt.s.d.0.done"),
            ("a.>", "a.b.c"),
        ] {
            assert!(subject_matches(filter, subject), "{filter} {subject}");
        }
        for (filter, subject) in [
            ("a.task.default", "a.task.other"),
            ("a.task.default", "a.task.default.more"),
            ("a.evt.*.*.*.done", "a.evt.s.d.x.0.done"),
            ("a.evt.*.*.*.done", "a.evt.s.d.0.started"),
            ("a.>", "a"),
        ] {
            assert!(!subject_matches(filter, subject), "{filter} {subject}");
        }
    }

    #[test]
    fn readable_header_blocks_pass_like_async_nats_parses_them() {
        for ok in [
            &b"NATS/1.0\r\n\r\n"[..],
            b"NATS/1.0\r\nA: b\r\nC:d\r\n\r\n",
            b"NATS/1.0 503\r\n\r\n",
            b"NATS/1.0\r\nA: b\r\n  continued\r\n\r\n",
            "NATS/1.0\r\nWakebus-Origin-Session: ünïcode\r\n\r\n".as_bytes(),
            b"NATS/1.0\r\nA: trailing\r\r\n\r\n",
            // async-nats 0.52 reads these with a space for each `\r`.
            b"NATS/1.0\r\nA: one\rtwo\r\n\r\n",
            b"NATS/1.0\r\nA: one\r\n \rtwo\r\n\r\n",
            b"NATS/1.0\r\nA: one\r\r\n two\r\n\r\n",
        ] {
            assert_eq!(
                unreadable_headers(ok),
                None,
                "{:?}",
                String::from_utf8_lossy(ok)
            );
        }
        for bad in [
            &b"NATS/1.0\r\nA: \xff\xfe\r\n\r\n"[..],
            b"HTTP/1.1\r\n\r\n",
            b"NATS/1.0\r\nno colon here\r\n\r\n",
            b"NATS/1.0 abc\r\n\r\n",
            b"NATS/1.0\r\nbad name: x\r\n\r\n",
        ] {
            assert!(
                unreadable_headers(bad).is_some(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
