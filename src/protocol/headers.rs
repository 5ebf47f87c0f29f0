//! NATS header names and the header set every wakebus publish carries.

use async_nats::HeaderMap;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// JetStream's dedupe id.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
/// The raw origin session id (absent in sync mode).
pub const HEADER_ORIGIN_SESSION: &str = "Wakebus-Origin-Session";
/// The delegation id.
pub const HEADER_DELEGATION_ID: &str = "Wakebus-Delegation-Id";
/// The task index within the delegation.
pub const HEADER_TASK_INDEX: &str = "Wakebus-Task-Index";
/// Why a message was dead-lettered.
pub const HEADER_DEAD_LETTER_REASON: &str = "Wakebus-Dead-Letter-Reason";
/// Marks a copy made by `wakebus replay`; the value names the original as
/// `<stream>:<sequence>`.
pub const HEADER_REPLAY: &str = "Wakebus-Replay";
/// On a `replay wakes --force` copy of a delivered completion: the copy's
/// ULID (the one in its `Nats-Msg-Id`). The wake service posts such a copy
/// alone, under a key of its own (`<usual key>.replay.<ULID>`).
pub const HEADER_FORCED_REPLAY: &str = "Wakebus-Forced-Replay";
/// JetStream stores a message with this header only if the last message on
/// its subject has this sequence (0: none).
pub const HEADER_EXPECTED_LAST_SUBJECT_SEQUENCE: &str = "Nats-Expected-Last-Subject-Sequence";
/// The CloudEvents type of a task request.
pub const CE_TYPE_REQUESTED: &str = "io.wakebus.task.requested";
/// W3C trace context.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// CloudEvents id.
pub const HEADER_CE_ID: &str = "ce-id";
/// CloudEvents type.
pub const HEADER_CE_TYPE: &str = "ce-type";
/// CloudEvents source.
pub const HEADER_CE_SOURCE: &str = "ce-source";
/// CloudEvents spec version.
pub const HEADER_CE_SPECVERSION: &str = "ce-specversion";
/// CloudEvents time.
pub const HEADER_CE_TIME: &str = "ce-time";
/// Body content type.
pub const HEADER_CONTENT_TYPE: &str = "content-type";
/// The CloudEvents spec version wakebus follows.
pub const CE_SPECVERSION: &str = "1.0";

/// A W3C `traceparent`: version 00, trace id, parent span id, flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace id shared by every hop of one delegation.
    pub trace_id: u128,
    /// The span id of the hop that published the message.
    pub span_id: u64,
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Starts a new trace (sampled).
    pub fn new_root() -> Self {
        Self {
            trace_id: ulid::Ulid::new().0,
            span_id: new_span_id(),
            flags: 1,
        }
    }

    /// A new span in the same trace, for the next hop.
    pub fn child(&self) -> Self {
        Self {
            span_id: new_span_id(),
            ..*self
        }
    }

    /// Parses a `traceparent` header value; `None` if it is malformed, as
    /// W3C Trace Context defines it: lowercase hex fields of the right
    /// lengths, exactly four of them in version `00` (a later version may
    /// add more, which are ignored).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().splitn(5, '-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let lower_hex = |part: &str| part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if ![version, trace, span, flags].into_iter().all(lower_hex) {
            return None;
        }
        if version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let span_id = u64::from_str_radix(span, 16).ok()?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            flags: u8::from_str_radix(flags, 16).ok()?,
        })
    }

    /// The trace id as 32 lowercase hex digits, for logs.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

fn new_span_id() -> u64 {
    // The low 64 bits of a ULID are random; zero is not a valid span id.
    (ulid::Ulid::new().0 as u64).max(1)
}

/// The headers of one wakebus publish (request or event).
#[derive(Debug, Clone)]
pub struct EventHeaders<'a> {
    /// JetStream dedupe id, also the CloudEvents id.
    pub id: &'a str,
    /// CloudEvents type, for example `io.wakebus.task.done`.
    pub ce_type: &'a str,
    /// CloudEvents source, for example `wakebus/worker/<instance>`.
    pub source: &'a str,
    /// Raw origin session id, if any.
    pub origin_session: Option<&'a str>,
    /// The delegation id.
    pub delegation_id: &'a str,
    /// The task index.
    pub task_index: u32,
    /// Trace context for this hop.
    pub traceparent: TraceParent,
}

impl EventHeaders<'_> {
    /// Builds the NATS header map.
    pub fn to_header_map(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_MSG_ID, self.id);
        headers.insert(HEADER_CE_ID, self.id);
        headers.insert(HEADER_CE_SPECVERSION, CE_SPECVERSION);
        headers.insert(HEADER_CE_TYPE, self.ce_type);
        headers.insert(HEADER_CE_SOURCE, self.source);
        let now = OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default();
        headers.insert(HEADER_CE_TIME, now.as_str());
        headers.insert(HEADER_CONTENT_TYPE, "application/json");
        headers.insert(HEADER_DELEGATION_ID, self.delegation_id);
        headers.insert(HEADER_TASK_INDEX, self.task_index.to_string().as_str());
        headers.insert(HEADER_TRACEPARENT, self.traceparent.to_string().as_str());
        if let Some(session) = self.origin_session {
            headers.insert(HEADER_ORIGIN_SESSION, session);
        }
        headers
    }
}

/// Makes untrusted text safe for a header value: control characters (CR and
/// LF above all) become spaces and the result is cut to 1024 characters.
/// The NATS client refuses (panics on) header values with line breaks.
pub fn header_safe(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(1024)
        .collect()
}

/// Whether nats-server acts on a header of this name when a message is
/// published (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`,
/// `Nats-Rollup`, `Nats-TTL`, `Nats-Msg-Id`, …: every name it reads starts
/// with `Nats-`). A copy of a message to another stream or subject (a dead
/// letter, a replay) leaves them out: what held where the original was
/// stored may be refused where the copy goes, and a copy refused forever
/// would bring the original back forever.
pub fn is_server_directive(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|start| start.eq_ignore_ascii_case("nats-"))
}

/// Reads a header as text, if present.
pub fn header<'h>(headers: Option<&'h HeaderMap>, name: &str) -> Option<&'h str> {
    headers?.get(name).map(|value| value.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_children_share_the_trace() {
        let root = TraceParent::new_root();
        let parsed = TraceParent::parse(&root.to_string()).unwrap();
        assert_eq!(parsed, root);
        let child = root.child();
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.span_id, root.span_id);
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "00-abc-def-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            // Uppercase, a sign, a fifth field in version 00.
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-+1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad:?} accepted");
        }
        assert!(
            TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_some()
        );
        // A later version's extra fields are ignored.
        assert!(
            TraceParent::parse("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra")
                .is_some()
        );
    }
}
