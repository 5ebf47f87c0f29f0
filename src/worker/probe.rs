//! Whether a subject of the events stream holds a message, asked without
//! read access to the stream.
//!
//! A worker must not read the events stream: reading would let it list
//! delegation ids (which the wake's origin check relies on being secret).
//! Read grants cannot be narrowed to one subject either: a permission on
//! `$JS.API.DIRECT.GET.<stream>.<prefix>.evt.*.*.*.done` also admits the
//! literal subject with `*` tokens, which the server answers with the newest
//! completion of every session. So the worker asks by publishing: an empty
//! message to the subject with `Nats-Expected-Last-Subject-Sequence` set to
//! a sequence that never matches. JetStream refuses to store it and names
//! the subject's actual last sequence (0 when it has none). Nothing is
//! stored, and the answer is a number, not a message.

use async_nats::HeaderMap;
use bytes::Bytes;
use serde::Deserialize;

use crate::bus::Bus;

use crate::protocol::HEADER_EXPECTED_LAST_SUBJECT_SEQUENCE as EXPECTED_LAST_SUBJECT_SEQUENCE;

/// JetStream's error code for "wrong last sequence".
const WRONG_LAST_SEQUENCE: u64 = 10071;

/// Why a probe gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No stream stores the subject.
    #[error("no stream stores this subject")]
    NoStream,
    /// The request failed (timeout, connection, permission).
    #[error("probe request failed: {0}")]
    Request(#[from] async_nats::RequestError),
    /// JetStream answered something else than a refusal naming the sequence.
    #[error("unexpected answer to a probe: {0}")]
    Unexpected(String),
}

/// A JetStream publish acknowledgement or refusal.
#[derive(Debug, Deserialize)]
struct Answer {
    /// Present when JetStream refused the message.
    error: Option<ApiError>,
}

/// A JetStream API error.
#[derive(Debug, Deserialize)]
struct ApiError {
    /// The specific error code.
    err_code: u64,
    /// The text, which carries the actual last sequence.
    description: String,
}

/// The stream sequence of the last message stored on `subject`; 0 if none.
pub async fn last_sequence_on(bus: &Bus, subject: &str) -> Result<u64, ProbeError> {
    let mut headers = HeaderMap::new();
    headers.insert(
        EXPECTED_LAST_SUBJECT_SEQUENCE,
        u64::MAX.to_string().as_str(),
    );
    let answer = match bus
        .client
        .request_with_headers(subject.to_owned(), headers, Bytes::new())
        .await
    {
        Ok(answer) => answer,
        Err(error) if error.kind() == async_nats::RequestErrorKind::NoResponders => {
            return Err(ProbeError::NoStream);
        }
        Err(error) => return Err(error.into()),
    };
    let unexpected = || ProbeError::Unexpected(String::from_utf8_lossy(&answer.payload).into());
    let parsed: Answer = serde_json::from_slice(&answer.payload).map_err(|_| unexpected())?;
    match parsed.error {
        Some(error) if error.err_code == WRONG_LAST_SEQUENCE => error
            .description
            .rsplit(':')
            .next()
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(unexpected),
        _ => Err(unexpected()),
    }
}
