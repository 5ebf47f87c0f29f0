//! Identifiers: delegation ids, pool names, session ids and their subject tokens.

use sha2::{Digest, Sha256};

/// The subject token used for events that have no origin session (sync mode).
///
/// It cannot collide with a real session token: those are lowercase hex.
pub const SYNC_SESSION_TOKEN: &str = "sync";

/// What a worker names a request whose body and headers hold no usable
/// delegation id (or task index) by: `invalid-<stream sequence>`, task 0 of
/// a delegation of its own.
pub const INVALID_ID_PREFIX: &str = "invalid-";

/// Largest accepted origin session id, in bytes.
///
/// Session ids travel in a NATS header and an HTTP header; both have practical
/// size limits far above this, and nothing legitimate comes near it.
pub const MAX_SESSION_ID_BYTES: usize = 16 * 1024;

/// Largest accepted delegation id or pool name, in bytes.
const MAX_TOKEN_BYTES: usize = 64;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The identifier was empty.
    #[error("{what} must not be empty")]
    Empty {
        /// Which identifier.
        what: &'static str,
    },
    /// The identifier was longer than allowed.
    #[error("{what} is {len} bytes long; the limit is {max}")]
    TooLong {
        /// Which identifier.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The identifier contained a character it may not contain.
    #[error("{what} contains {found:?}; allowed are {allowed}")]
    BadCharacter {
        /// Which identifier.
        what: &'static str,
        /// The first offending character.
        found: char,
        /// A description of the allowed characters.
        allowed: &'static str,
    },
    /// The identifier starts or ends with whitespace, which headers do not keep.
    #[error("{what} must not start or end with whitespace (NATS and HTTP headers trim it)")]
    SurroundingWhitespace {
        /// Which identifier.
        what: &'static str,
    },
}

/// Creates a new delegation id: a ULID, sortable by creation time.
pub fn new_delegation_id() -> String {
    ulid::Ulid::new().to_string()
}

/// The subject token for an origin session: the first 128 bits of its SHA-256, in hex.
///
/// Raw session ids may contain `.`, `*`, `>`, spaces or anything else, so they
/// never appear in subjects; this token does.
pub fn session_token(session_id: &str) -> String {
    let digest = Sha256::digest(session_id.as_bytes());
    let mut token = String::with_capacity(32);
    for byte in &digest[..16] {
        use std::fmt::Write;
        // Writing to a String cannot fail.
        let _ = write!(token, "{byte:02x}");
    }
    token
}

fn validate_token(what: &'static str, value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { what });
    }
    if value.len() > MAX_TOKEN_BYTES {
        return Err(IdError::TooLong {
            what,
            len: value.len(),
            max: MAX_TOKEN_BYTES,
        });
    }
    if let Some(found) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(IdError::BadCharacter {
            what,
            found,
            allowed: "ASCII letters, digits, '-' and '_'",
        });
    }
    Ok(())
}

/// Checks a delegation id: 1 to 64 ASCII letters, digits, `-` or `_`.
///
/// Delegation ids appear in subjects and KV keys, so the alphabet is narrow.
pub fn validate_delegation_id(id: &str) -> Result<(), IdError> {
    validate_token("delegation id", id)
}

/// Checks a pool name: 1 to 64 ASCII letters, digits, `-` or `_`.
pub fn validate_pool(pool: &str) -> Result<(), IdError> {
    validate_token("pool", pool)
}

/// Checks an origin session id: any UTF-8 without control characters and
/// without whitespace at either end, at most [`MAX_SESSION_ID_BYTES`].
///
/// Control characters (CR and LF above all) would break the NATS and HTTP
/// headers the id travels in. Whitespace at either end would not survive
/// them: NATS clients and HTTP servers trim header values, so the session
/// woken would not be the one named.
pub fn validate_session_id(id: &str) -> Result<(), IdError> {
    const WHAT: &str = "origin session id";
    if id.is_empty() {
        return Err(IdError::Empty { what: WHAT });
    }
    if id.len() > MAX_SESSION_ID_BYTES {
        return Err(IdError::TooLong {
            what: WHAT,
            len: id.len(),
            max: MAX_SESSION_ID_BYTES,
        });
    }
    if let Some(found) = id.chars().find(|c| c.is_control()) {
        return Err(IdError::BadCharacter {
            what: WHAT,
            found,
            allowed: "any character but control characters",
        });
    }
    if id.starts_with(char::is_whitespace) || id.ends_with(char::is_whitespace) {
        return Err(IdError::SurroundingWhitespace { what: WHAT });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_tokens_are_subject_safe_and_stable() {
        let token = session_token("a.b *>  ünïcode");
        assert_eq!(token.len(), 32);
        assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(token, session_token("a.b *>  ünïcode"));
        assert_ne!(token, session_token("a.b *>  ünïcode "));
    }

    #[test]
    fn session_ids_with_line_breaks_are_refused() {
        assert!(matches!(
            validate_session_id("abc\r\nX-Evil: 1"),
            Err(IdError::BadCharacter { found: '\r', .. })
        ));
        assert!(validate_session_id("sess.with.dots *> and spaces ✓").is_ok());
    }

    #[test]
    fn session_ids_with_whitespace_at_either_end_are_refused() {
        for bad in [" lead", "trail ", "\u{3000}ideographic", "nbsp\u{a0}"] {
            assert!(
                matches!(
                    validate_session_id(bad),
                    Err(IdError::SurroundingWhitespace { .. })
                ),
                "{bad:?} accepted"
            );
        }
        assert!(validate_session_id("inner  spaces are fine").is_ok());
    }

    #[test]
    fn delegation_ids_refuse_subject_metacharacters() {
        assert!(validate_delegation_id("01HZX-abc_9").is_ok());
        for bad in ["a.b", "a*", "a>", "a b", ""] {
            assert!(validate_delegation_id(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_delegation_id(&"x".repeat(65)).is_err());
        assert!(validate_delegation_id(&new_delegation_id()).is_ok());
    }
}
