//! A task request as a worker receives it: any body bytes, with any
//! `Wakebus-Origin-Session`, `Wakebus-Delegation-Id` and `Wakebus-Task-Index`
//! header values. Decoding must never panic; a rejection must carry a
//! bounded reason and only valid salvaged ids, and an accepted request must
//! honour every limit.
#![no_main]

use async_nats::HeaderMap;
use libfuzzer_sys::fuzz_target;
use wakebus::protocol::{Limits, validate_delegation_id, validate_session_id};
use wakebus::worker::decode_request;

/// The input is three header lines (`Wakebus-Origin-Session`,
/// `Wakebus-Delegation-Id`, `Wakebus-Task-Index`; an empty line means the
/// header is absent) followed by the body, so corpus files stay readable.
fn split(data: &[u8]) -> (HeaderMap, &[u8]) {
    let mut headers = HeaderMap::new();
    let mut rest = data;
    for name in [
        "Wakebus-Origin-Session",
        "Wakebus-Delegation-Id",
        "Wakebus-Task-Index",
    ] {
        let (line, tail) = match rest.iter().position(|&b| b == b'\n') {
            Some(at) => (&rest[..at], &rest[at + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = tail;
        // What a NATS client can deliver: UTF-8 without CR or LF, trimmed.
        let value = String::from_utf8_lossy(line).replace('\r', "");
        let value = value.trim();
        if !value.is_empty() {
            headers.insert(name, value);
        }
    }
    (headers, rest)
}

fn check(body: &[u8], headers: &HeaderMap, limits: &Limits) {
    match decode_request(body, Some(headers), limits) {
        Ok(request) => {
            assert!(body.len() <= limits.max_request_bytes);
            assert!(request.goal.len() <= limits.max_goal_bytes);
            assert!(request.context.len() <= limits.max_context_bytes);
            assert!(!request.goal.trim().is_empty());
            assert!(validate_delegation_id(&request.delegation_id).is_ok());
            if let Some(session) = &request.origin_session_id {
                assert!(validate_session_id(session).is_ok());
            }
            // Re-encoding (what the command executor gets on stdin) works.
            serde_json::to_vec(&request).expect("a decoded request re-encodes");
        }
        Err(rejected) => {
            assert!(!rejected.reason.is_empty());
            assert!(
                rejected.reason.len() <= 1024 + 32,
                "{}",
                rejected.reason.len()
            );
            if let Some(id) = &rejected.delegation_id {
                assert!(validate_delegation_id(id).is_ok());
            }
            if let Some(session) = &rejected.origin_session {
                assert!(validate_session_id(session).is_ok());
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (headers, body) = split(data);
    check(body, &headers, &Limits::default());
    let small = Limits {
        max_request_bytes: 256,
        max_goal_bytes: 16,
        max_context_bytes: 32,
    };
    check(body, &headers, &small);
});
