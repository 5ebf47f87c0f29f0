//! Header values from the network: `traceparent`, origin session ids, dead
//! letter reasons. Parsing must never panic, a parsed traceparent must
//! round-trip, and anything wakebus accepts or sanitises must be a valid NATS
//! and HTTP header value that survives the trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wakebus::protocol::{TraceParent, header_safe, session_token, validate_session_id};

fuzz_target!(|text: &str| {
    if let Some(trace) = TraceParent::parse(text) {
        let printed = trace.to_string();
        assert_eq!(TraceParent::parse(&printed), Some(trace));
        assert_eq!(trace.child().trace_id, trace.trace_id);
    }

    // A dead-letter reason built from this text is a valid header value.
    let safe = header_safe(text);
    assert!(!safe.contains(['\r', '\n']));
    async_nats::HeaderValue::try_from(safe.as_str()).expect("NATS header");

    if validate_session_id(text).is_ok() {
        // async-nats would replace CR/LF with spaces, changing the id.
        async_nats::HeaderValue::try_from(text).expect("NATS header");
        // NATS clients trim header values; a valid id is unchanged by that.
        assert_eq!(text.trim(), text);
        reqwest::header::HeaderValue::from_bytes(text.as_bytes()).expect("HTTP header");
        let token = session_token(text);
        assert_eq!(token.len(), 32);
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
    }
});
