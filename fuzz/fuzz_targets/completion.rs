//! A completion event as the wake service receives it: any body bytes and
//! any `Wakebus-Origin-Session` header. The admission decision must never
//! panic, and a completion it lets through must be safe to turn into HTTP
//! headers (session id, `Idempotency-Key`) and a turn text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wakebus::protocol::CompletionEvent;
use wakebus::wake::{check_completion, turn};

// The input is the `Wakebus-Origin-Session` header line (empty: absent)
// followed by the body.
fuzz_target!(|data: &[u8]| {
    let (line, body) = match data.iter().position(|&b| b == b'\n') {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &data[data.len()..]),
    };
    let header = String::from_utf8_lossy(line).replace('\r', "");
    let origin = Some(header.trim()).filter(|h| !h.is_empty());
    let Ok((event, session)) = check_completion(body, origin) else {
        return;
    };
    assert_eq!(Some(session.as_str()), origin);
    assert_eq!(
        event.event_id,
        CompletionEvent::id_for(&event.delegation_id, event.task_index)
    );
    reqwest::header::HeaderValue::from_str(&event.event_id).expect("idempotency key header");
    reqwest::header::HeaderValue::from_bytes(session.as_bytes()).expect("session header");
    let text = turn::render(&[&event]);
    assert!(text.contains(&event.delegation_id));
});
