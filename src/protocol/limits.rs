//! Size limits on requests: what a worker accepts and a delegator sends.
//!
//! A request's goal and context end up in a subagent's prompt, in the
//! completion event and in a continuation turn, so a publisher must not be
//! able to make them arbitrarily large. The whole body is checked before it
//! is parsed, so an oversized request costs no parsing.

/// Default for [`Limits::max_request_bytes`]: 6 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 6 * 1024 * 1024;
/// Default for [`Limits::max_goal_bytes`]: 64 KiB.
pub const DEFAULT_MAX_GOAL_BYTES: usize = 64 * 1024;
/// Default for [`Limits::max_context_bytes`]: 4 MiB.
pub const DEFAULT_MAX_CONTEXT_BYTES: usize = 4 * 1024 * 1024;

/// The largest request a worker accepts (and a delegator sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body, in bytes (the NATS server's `max_payload` also
    /// applies, and is usually the smaller of the two).
    pub max_request_bytes: usize,
    /// Largest `goal`, in bytes of UTF-8.
    pub max_goal_bytes: usize,
    /// Largest `context`, in bytes of UTF-8.
    pub max_context_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_goal_bytes: DEFAULT_MAX_GOAL_BYTES,
            max_context_bytes: DEFAULT_MAX_CONTEXT_BYTES,
        }
    }
}

/// A value over its limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is {len} bytes; the limit is {max} bytes")]
pub struct TooLarge {
    /// What was too large: `request body`, `goal` or `context`.
    pub what: &'static str,
    /// Its size in bytes.
    pub len: usize,
    /// The limit in bytes.
    pub max: usize,
}

impl Limits {
    /// Checks a whole request body.
    pub fn check_body(&self, len: usize) -> Result<(), TooLarge> {
        check("request body", len, self.max_request_bytes)
    }

    /// Checks a goal and a context.
    pub fn check_fields(&self, goal: &str, context: &str) -> Result<(), TooLarge> {
        check("goal", goal.len(), self.max_goal_bytes)?;
        check("context", context.len(), self.max_context_bytes)
    }
}

fn check(what: &'static str, len: usize, max: usize) -> Result<(), TooLarge> {
    if len > max {
        Err(TooLarge { what, len, max })
    } else {
        Ok(())
    }
}

/// Cuts `text` to at most `max` bytes (on a character boundary), marking the
/// cut. For messages (error reasons, logs) that may quote untrusted input.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… [{} bytes cut]", &text[..cut], text.len() - cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_at_the_limit_pass_and_one_byte_more_fails_with_a_clear_message() {
        let limits = Limits {
            max_request_bytes: 10,
            max_goal_bytes: 3,
            max_context_bytes: 4,
        };
        assert!(limits.check_body(10).is_ok());
        assert_eq!(
            limits.check_body(11).unwrap_err().to_string(),
            "request body is 11 bytes; the limit is 10 bytes"
        );
        assert!(limits.check_fields("abc", "abcd").is_ok());
        assert_eq!(limits.check_fields("abcd", "").unwrap_err().what, "goal");
        assert_eq!(
            limits.check_fields("", "abcde").unwrap_err().what,
            "context"
        );
    }

    #[test]
    fn bounded_cuts_on_a_character_boundary() {
        assert_eq!(bounded("short", 10), "short");
        let cut = bounded("ééé", 3);
        assert!(cut.starts_with("é…"), "{cut}");
        assert!(cut.ends_with("[4 bytes cut]"), "{cut}");
    }
}
