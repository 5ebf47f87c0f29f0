//! One stored message of the history, and what can be read off it.

use async_nats::HeaderMap;
use bytes::Bytes;
use serde::Deserialize;
use time::OffsetDateTime;

use super::rfc3339;
use crate::protocol::{
    EventKind, HEADER_DEAD_LETTER_REASON, HEADER_DELEGATION_ID, HEADER_ORIGIN_SESSION,
    HEADER_REPLAY, HEADER_TASK_INDEX, POISON_TOKEN, SYNC_SESSION_TOKEN, Status,
};

/// What a history message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A delegator's `submitted` record.
    Submitted,
    /// A started event.
    Started,
    /// A progress event.
    Progress,
    /// A completion event.
    Done,
    /// A dead-lettered task request.
    TaskDeadLetter,
    /// A dead-lettered completion.
    WakeDeadLetter,
    /// Anything else found in the streams.
    Other,
}

impl From<EventKind> for RecordKind {
    fn from(kind: EventKind) -> Self {
        match kind {
            EventKind::Submitted => Self::Submitted,
            EventKind::Started => Self::Started,
            EventKind::Progress => Self::Progress,
            EventKind::Done => Self::Done,
        }
    }
}

impl RecordKind {
    /// A short name for output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Submitted => "submitted",
            Self::Started => "started",
            Self::Progress => "progress",
            Self::Done => "done",
            Self::TaskDeadLetter => "dlq-task",
            Self::WakeDeadLetter => "dlq-wake",
            Self::Other => "other",
        }
    }
}

/// One stored message, with its place in the stream.
#[derive(Debug, Clone)]
pub struct Record {
    /// The stream it was read from.
    pub stream: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// When the stream stored it.
    pub published: OffsetDateTime,
    /// Its subject.
    pub subject: String,
    /// The subject with the deployment prefix and its dot removed
    /// (`evt.<token>.<delegation>.<task>.<kind>`, `dlq.task.<pool>`, …).
    pub local_subject: String,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub payload: Bytes,
}

/// The few body fields that selections and listings need. Each is read on
/// its own: one of an unexpected type (a hand-written body) leaves the
/// others readable.
#[derive(Debug, Default, Deserialize)]
struct BodyPeek {
    /// The completion's status, if this is a completion.
    #[serde(default, deserialize_with = "lenient")]
    status: Option<Status>,
    /// The delegation id in the body.
    #[serde(default, deserialize_with = "lenient")]
    delegation_id: Option<String>,
    /// The task index in the body.
    #[serde(default, deserialize_with = "lenient")]
    task_index: Option<u32>,
    /// The origin session in the body.
    #[serde(default, deserialize_with = "lenient")]
    origin_session_id: Option<String>,
}

/// A field as `T`, or `None` if it is not one.
fn lenient<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok(serde_json::from_value(value).ok())
}

impl Record {
    /// Builds a record from a delivered message.
    pub(super) fn from_message(
        message: &async_nats::jetstream::Message,
        prefix: &str,
    ) -> Result<Self, String> {
        let info = message.info().map_err(|err| err.to_string())?;
        let subject = message.subject.to_string();
        let local_subject = subject
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
            .unwrap_or(&subject)
            .to_owned();
        Ok(Self {
            stream: info.stream.to_owned(),
            sequence: info.stream_sequence,
            published: info.published,
            subject,
            local_subject,
            headers: message.headers.clone().unwrap_or_default(),
            payload: message.payload.clone(),
        })
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|value| value.as_str())
    }

    fn tokens(&self) -> Vec<&str> {
        self.local_subject.split('.').collect()
    }

    fn peek(&self) -> BodyPeek {
        serde_json::from_slice(&self.payload).unwrap_or_default()
    }

    /// What this message is, from its subject.
    pub fn kind(&self) -> RecordKind {
        match self.tokens().as_slice() {
            ["evt", _, _, _, "submitted"] => RecordKind::Submitted,
            ["evt", _, _, _, "started"] => RecordKind::Started,
            ["evt", _, _, _, "progress"] => RecordKind::Progress,
            ["evt", _, _, _, "done"] => RecordKind::Done,
            ["dlq", "task", _] => RecordKind::TaskDeadLetter,
            ["dlq", "wake", _] => RecordKind::WakeDeadLetter,
            _ => RecordKind::Other,
        }
    }

    /// The session token in the subject (events and wake dead letters).
    pub fn session_token(&self) -> Option<&str> {
        match self.tokens().as_slice() {
            ["evt", token, _, _, _] | ["dlq", "wake", token] => Some(*token),
            _ => None,
        }
    }

    /// The pool (task dead letters).
    pub fn pool(&self) -> Option<&str> {
        match self.kind() {
            RecordKind::TaskDeadLetter => self.local_subject.rsplit('.').next(),
            _ => None,
        }
    }

    /// The raw origin session id, from the header.
    pub fn origin_session(&self) -> Option<&str> {
        self.header(HEADER_ORIGIN_SESSION)
    }

    /// Who to show as the record's session: the origin header; the body's
    /// origin session when the header is missing (it is optional for
    /// publishers, and a dead letter too large for its original headers
    /// keeps none); the subject's session token when neither names one;
    /// `(sync)` when nothing does.
    pub fn session_label(&self) -> String {
        if let Some(origin) = self.origin_session() {
            return origin.to_owned();
        }
        if let Some(origin) = self.peek().origin_session_id {
            return origin;
        }
        match self.session_token() {
            Some(token) if token != SYNC_SESSION_TOKEN && token != POISON_TOKEN => {
                format!("(token {token})")
            }
            Some(POISON_TOKEN) => "-".to_owned(),
            _ => "(sync)".to_owned(),
        }
    }

    /// Whether this record is of `session`: by its origin header; when it
    /// has none (the header is optional for publishers, and a dead letter
    /// keeps the headers its original had), by the session token in its
    /// subject, or by its body.
    pub fn is_of_session(&self, session: &str) -> bool {
        match (self.origin_session(), self.session_token()) {
            (Some(origin), _) => origin == session,
            // Unusable completions of any session share one subject.
            (None, Some(token)) if token != POISON_TOKEN => {
                token == crate::protocol::session_token(session)
            }
            (None, _) => self.peek().origin_session_id.as_deref() == Some(session),
        }
    }

    /// The delegation id: from the event subject, else the body, else
    /// the header (a dead letter's). The body first, as workers and
    /// replays act on it: a request sent again may carry a stale header
    /// (PROTOCOL 4.2 reads the header only when the body is unusable).
    pub fn delegation_id(&self) -> Option<String> {
        if let ["evt", _, delegation, _, _] = self.tokens().as_slice() {
            return Some((*delegation).to_owned());
        }
        self.peek()
            .delegation_id
            .or_else(|| self.header(HEADER_DELEGATION_ID).map(str::to_owned))
    }

    /// The task index: from the event subject, else the body, else the
    /// header (see [`Self::delegation_id`]).
    pub fn task_index(&self) -> Option<u32> {
        if let ["evt", _, _, index, _] = self.tokens().as_slice() {
            return index.parse().ok();
        }
        self.peek()
            .task_index
            .or_else(|| self.header(HEADER_TASK_INDEX).and_then(|v| v.parse().ok()))
    }

    /// The completion's status (done events and wake dead letters).
    pub fn status(&self) -> Option<Status> {
        match self.kind() {
            RecordKind::Done | RecordKind::WakeDeadLetter => self.peek().status,
            _ => None,
        }
    }

    /// Why it was dead-lettered.
    pub fn dead_letter_reason(&self) -> Option<&str> {
        self.header(HEADER_DEAD_LETTER_REASON)
    }

    /// The original this is a replay copy of, if it is one.
    pub fn replay_of(&self) -> Option<&str> {
        self.header(HEADER_REPLAY)
    }

    /// Where a replay copy says it came from: `<stream>:<sequence>`.
    pub fn origin_ref(&self) -> String {
        format!("{}:{}", self.stream, self.sequence)
    }

    /// The record as one JSON object, for `--json` output and scripts.
    pub fn to_json(&self) -> serde_json::Value {
        let headers: serde_json::Map<String, serde_json::Value> = self
            .headers
            .iter()
            .map(|(name, values)| {
                let value = values.first().map(|v| v.as_str()).unwrap_or_default();
                (name.to_string(), serde_json::Value::from(value))
            })
            .collect();
        let body =
            serde_json::from_slice::<serde_json::Value>(&self.payload).unwrap_or_else(|_| {
                serde_json::Value::from(String::from_utf8_lossy(&self.payload).into_owned())
            });
        serde_json::json!({
            "stream": self.stream,
            "seq": self.sequence,
            "time": rfc3339(self.published),
            "subject": self.subject,
            "kind": self.kind().as_str(),
            "session_token": self.session_token(),
            "origin_session": self.origin_session(),
            "delegation_id": self.delegation_id(),
            "task_index": self.task_index(),
            "status": self.status(),
            "pool": self.pool(),
            "replay_of": self.replay_of(),
            "dead_letter_reason": self.dead_letter_reason(),
            "headers": headers,
            "body": body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(local_subject: &str, origin_header: Option<&str>, body: &str) -> Record {
        let mut headers = HeaderMap::new();
        if let Some(origin) = origin_header {
            headers.insert(HEADER_ORIGIN_SESSION, origin);
        }
        Record {
            stream: "P_DLQ".to_owned(),
            sequence: 1,
            published: OffsetDateTime::UNIX_EPOCH,
            subject: format!("p.{local_subject}"),
            local_subject: local_subject.to_owned(),
            headers,
            payload: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    /// A record without the origin header is not taken for sync mode when
    /// its body or its subject names a session.
    #[test]
    fn a_records_session_is_named_from_its_header_body_or_subject() {
        let label = |local: &str, header: Option<&str>, body: &str| {
            record(local, header, body).session_label()
        };
        assert_eq!(label("dlq.wake.ab12", Some("s.1"), "{}"), "s.1");
        assert_eq!(
            label("dlq.wake.ab12", None, r#"{"origin_session_id":"s.2"}"#),
            "s.2"
        );
        assert_eq!(label("dlq.wake.ab12", None, "{}"), "(token ab12)");
        assert_eq!(label("dlq.wake.poison", None, "not json"), "-");
        assert_eq!(label("evt.sync.D.0.done", None, "{}"), "(sync)");
        assert_eq!(label("task.default", None, "{}"), "(sync)");
        // A poison dead letter of S, its header lost, is still S's.
        let poison = record("dlq.wake.poison", None, r#"{"origin_session_id":"s.3"}"#);
        assert!(poison.is_of_session("s.3"));
        assert!(!poison.is_of_session("s.4"));
    }

    /// A task dead letter is named by the request its replay re-queues:
    /// by a stale header (a request sent again by a publisher that kept an
    /// old one), `--delegation` picked the wrong request.
    #[test]
    fn a_dead_letters_delegation_is_its_bodys_and_the_header_only_stands_in_for_an_unusable_one() {
        let mut stale = record(
            "dlq.task.default",
            None,
            r#"{"delegation_id":"body-id","task_index":2}"#,
        );
        stale.headers.insert(HEADER_DELEGATION_ID, "header-id");
        stale.headers.insert(HEADER_TASK_INDEX, "5");
        assert_eq!(stale.delegation_id().as_deref(), Some("body-id"));
        assert_eq!(stale.task_index(), Some(2));
        let mut unusable = record("dlq.task.default", None, "not json");
        unusable.headers.insert(HEADER_DELEGATION_ID, "header-id");
        unusable.headers.insert(HEADER_TASK_INDEX, "5");
        assert_eq!(unusable.delegation_id().as_deref(), Some("header-id"));
        assert_eq!(unusable.task_index(), Some(5));
    }
}
