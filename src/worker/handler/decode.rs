//! Decoding a request as a worker receives it; an unusable one keeps
//! whatever identity its body or headers give, for its `error` completion.

use async_nats::HeaderMap;

use crate::protocol::{
    HEADER_DELEGATION_ID, HEADER_ORIGIN_SESSION, HEADER_TASK_INDEX, Limits, MAX_TASK_COUNT,
    TaskRequest, bounded, header, validate_delegation_id, validate_session_id,
};

/// Why a request could not be used, with whatever identity could be salvaged
/// for its `error` completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The reason, for the `error` completion and the dead letter.
    pub reason: String,
    /// The delegation id from the body or headers, if valid.
    pub delegation_id: Option<String>,
    /// The task index from the body or headers: 0 when neither gives one
    /// (the protocol's default), `None` when one is given but unreadable
    /// (not an integer, above `u32::MAX`), which must not be taken for 0:
    /// that id belongs to the real task 0.
    pub task_index: Option<u32>,
    /// The origin session from the body or headers, if valid.
    pub origin_session: Option<String>,
    /// The batch the task belongs to, as far as the body says, so that an
    /// unusable member still completes its batch.
    pub batch: Option<(u32, crate::protocol::WakeMode, bool)>,
    /// Whether its origin header contradicts its body: a forged or
    /// mismatched copy, whose claim to be its task cannot be trusted, so
    /// that its `error` completion must not take the real one's id.
    pub forged: bool,
}

/// Longest rejection reason kept: serde errors may quote the offending input.
const MAX_REASON_BYTES: usize = 1024;

/// Decodes a request as a worker does, salvaging its identity from body or
/// headers when it is unusable.
pub fn decode_request(
    payload: &[u8],
    headers: Option<&HeaderMap>,
    limits: &Limits,
) -> Result<TaskRequest, Rejected> {
    let origin_header = header(headers, HEADER_ORIGIN_SESSION);
    let result = TaskRequest::decode_within(payload, limits)
        .and_then(|request| request.check_origin_header(origin_header).map(|()| request));
    result.map_err(|err| {
        let loose: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
        // The body's, if valid; else the header's, if valid.
        let valid = |id: &&str| validate_delegation_id(id).is_ok();
        let delegation_id = loose
            .get("delegation_id")
            .and_then(|v| v.as_str())
            .filter(valid)
            .or_else(|| header(headers, HEADER_DELEGATION_ID).filter(valid))
            .map(str::to_owned);
        let read = |value: Option<u64>| value.and_then(|v| u32::try_from(v).ok());
        // The body's, if readable; else the header's, if readable.
        let task_index = match (loose.get("task_index"), header(headers, HEADER_TASK_INDEX)) {
            (Some(body), header) => {
                read(body.as_u64()).or_else(|| read(header.and_then(|h| h.parse().ok())))
            }
            (None, Some(header)) => read(header.parse().ok()),
            (None, None) => Some(0),
        };
        // With a forged or mismatched origin, wake nobody: the body's claim
        // is exactly what cannot be trusted. A body that names another
        // session than the header is judged so whatever else is wrong with
        // it: a copy with a blank goal is no more trustworthy. (One that
        // names none, or does not parse, has no claim to compare: an
        // unusable request's headers may be all there is of it.)
        let forged = matches!(err, crate::protocol::DecodeError::OriginMismatch)
            || match (origin_header, loose.get("origin_session_id")) {
                (Some(header), Some(serde_json::Value::String(body))) => body != header,
                (Some(_), Some(other)) => !other.is_null(),
                _ => false,
            };
        let origin_session = match forged {
            true => None,
            false => origin_header
                .or_else(|| loose.get("origin_session_id").and_then(|v| v.as_str()))
                .filter(|s| validate_session_id(s).is_ok())
                .map(str::to_owned),
        };
        let batch = loose
            .get("task_count")
            .and_then(serde_json::Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .filter(|count| task_index.is_some_and(|index| *count > index))
            .filter(|count| *count <= MAX_TASK_COUNT)
            .map(|count| {
                let mode = loose
                    .get("wake_mode")
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_default();
                let notify = loose
                    .get("notify_early_failure")
                    .and_then(serde_json::Value::as_bool)
                    .unwrap_or(false);
                (count, mode, notify)
            });
        Rejected {
            reason: bounded(&err.to_string(), MAX_REASON_BYTES),
            delegation_id,
            task_index,
            origin_session,
            batch,
            forged,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "01JV3S2D6F8H0K2M4P6R8T0W2Y";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, *value);
        }
        headers
    }

    fn rejected(body: &str, pairs: &[(&str, &str)]) -> Rejected {
        let headers = headers(pairs);
        decode_request(body.as_bytes(), Some(&headers), &Limits::default())
            .expect_err("an unusable request")
    }

    #[test]
    fn an_origin_header_contradicting_the_body_is_forged_whatever_else_is_wrong_with_it() {
        let blank_goal = format!(
            r#"{{"version":1,"delegation_id":"{ID}","origin_session_id":"s.real","goal":" "}}"#
        );
        let forged = rejected(&blank_goal, &[(HEADER_ORIGIN_SESSION, "s.other")]);
        assert!(forged.forged);
        assert_eq!(forged.origin_session, None);
        // A body that names no session has no claim against the header's.
        let no_session = format!(r#"{{"version":1,"delegation_id":"{ID}"}}"#);
        let unclaimed = rejected(&no_session, &[(HEADER_ORIGIN_SESSION, "s.one")]);
        assert!(!unclaimed.forged);
        assert_eq!(unclaimed.origin_session.as_deref(), Some("s.one"));
        // The same header, agreeing with the body: the session is woken.
        let agreeing = rejected(&blank_goal, &[(HEADER_ORIGIN_SESSION, "s.real")]);
        assert!(!agreeing.forged);
        assert_eq!(agreeing.origin_session.as_deref(), Some("s.real"));
    }

    #[test]
    fn a_body_that_does_not_parse_keeps_the_identity_its_headers_give() {
        let broken = rejected(
            "{not json",
            &[
                (HEADER_ORIGIN_SESSION, "s.one"),
                (HEADER_DELEGATION_ID, ID),
                (HEADER_TASK_INDEX, "2"),
            ],
        );
        assert!(!broken.forged);
        assert_eq!(broken.origin_session.as_deref(), Some("s.one"));
        assert_eq!(broken.delegation_id.as_deref(), Some(ID));
        assert_eq!(broken.task_index, Some(2));
    }

    #[test]
    fn a_valid_delegation_id_header_stands_in_for_an_invalid_one_in_the_body() {
        let body = r#"{"version":1,"delegation_id":"job.42","goal":"g"}"#;
        let rejected = rejected(body, &[(HEADER_DELEGATION_ID, ID)]);
        assert_eq!(rejected.delegation_id.as_deref(), Some(ID));
        // A valid body id wins over the header's.
        let body = format!(r#"{{"version":1,"delegation_id":"{ID}","goal":""}}"#);
        let other = "01JV3S2D6F8H0K2M4P6R8T0W30";
        let rejected = self::rejected(&body, &[(HEADER_DELEGATION_ID, other)]);
        assert_eq!(rejected.delegation_id.as_deref(), Some(ID));
        // So with the task index.
        let body = format!(r#"{{"version":1,"delegation_id":"{ID}","task_index":"2"}}"#);
        let rejected = self::rejected(&body, &[(HEADER_TASK_INDEX, "2")]);
        assert_eq!(rejected.task_index, Some(2));
        let rejected = self::rejected(&body, &[]);
        assert_eq!(rejected.task_index, None, "unreadable is not task 0");
    }
}
