//! The wire contract: subjects, headers and message bodies.
//!
//! Everything another language needs to talk to wakebus is defined here and
//! written down in `docs/PROTOCOL.md` and `schema/*.json`. Change the three
//! together.

mod event;
mod headers;
mod ids;
mod limits;
mod request;
mod subjects;

pub use event::{CompletionEvent, EventKind, ProgressEvent, StartedEvent, Status, SubmittedRecord};
pub use headers::{
    CE_SPECVERSION, CE_TYPE_REQUESTED, EventHeaders, HEADER_CE_ID, HEADER_CE_SOURCE,
    HEADER_CE_SPECVERSION, HEADER_CE_TIME, HEADER_CE_TYPE, HEADER_CONTENT_TYPE,
    HEADER_DEAD_LETTER_REASON, HEADER_DELEGATION_ID, HEADER_EXPECTED_LAST_SUBJECT_SEQUENCE,
    HEADER_FORCED_REPLAY, HEADER_MSG_ID, HEADER_ORIGIN_SESSION, HEADER_REPLAY, HEADER_TASK_INDEX,
    HEADER_TRACEPARENT, TraceParent, header, header_safe, is_server_directive,
};
pub use ids::{
    INVALID_ID_PREFIX, IdError, MAX_SESSION_ID_BYTES, SYNC_SESSION_TOKEN, new_delegation_id,
    session_token, validate_delegation_id, validate_pool, validate_session_id,
};
pub use limits::{
    DEFAULT_MAX_CONTEXT_BYTES, DEFAULT_MAX_GOAL_BYTES, DEFAULT_MAX_REQUEST_BYTES, Limits, TooLarge,
    bounded,
};
pub use request::{
    DEFAULT_MAX_DEPTH, DecodeError, MAX_TASK_COUNT, PROTOCOL_VERSION, Role, TaskRequest, WakeMode,
    check_output_schema,
};
pub use subjects::{EventSubject, POISON_TOKEN, PrefixError, Subjects};

/// Formats a timestamp the way every wakebus body does (RFC 3339, UTC).
pub(crate) mod rfc3339 {
    pub(crate) use time::serde::rfc3339::option;
    pub(crate) use time::serde::rfc3339::{deserialize, serialize};
}
