//! The task request body, published on `<prefix>.task.<pool>`.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::ids::{IdError, validate_delegation_id, validate_session_id};
use super::limits::{Limits, TooLarge};

/// The request body version this build writes and the highest it reads.
pub const PROTOCOL_VERSION: u32 = 1;

/// What kind of subagent runs the task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Does the task itself and may not delegate further.
    #[default]
    Leaf,
    /// May delegate parts of the task (subject to the depth limit).
    Orchestrator,
}

/// How the tasks of a multi-task delegation wake their session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WakeMode {
    /// One consolidated turn once every task has ended.
    #[default]
    Batch,
    /// Each task wakes the session on its own.
    Independent,
}

/// One task of a delegation, as workers receive it.
///
/// Unknown fields are ignored so that newer publishers can add fields
/// without breaking older workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRequest {
    /// Body version; readers refuse versions above [`PROTOCOL_VERSION`].
    pub version: u32,
    /// Identifies the delegation (shared by all its tasks).
    pub delegation_id: String,
    /// Position of this task within the delegation, from 0.
    #[serde(default)]
    pub task_index: u32,
    /// How many tasks the delegation has (a batch has several).
    #[serde(default = "default_task_count")]
    pub task_count: u32,
    /// For several tasks: one consolidated wake (`batch`) or one per task.
    #[serde(default)]
    pub wake_mode: WakeMode,
    /// In batch mode, also send an early notice when a task fails while
    /// its siblings still run.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub notify_early_failure: bool,
    /// The session to wake with the result; `None` means the caller waits (sync mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin_session_id: Option<String>,
    /// What the subagent should achieve.
    pub goal: String,
    /// Background the subagent needs.
    #[serde(default)]
    pub context: String,
    /// Leaf or orchestrator.
    #[serde(default)]
    pub role: Role,
    /// Model the subagent should use, if the caller cares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Tool sets the subagent may use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub toolsets: Vec<String>,
    /// Per-task time limit; the pool default applies when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Nesting level of the subagent that runs this task: 1 for a task a
    /// top-level session delegated, 2 for one its subagent delegated, ...
    #[serde(default = "default_depth")]
    pub depth: u32,
    /// The session of the agent that delegated, when it differs from the origin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    /// When the delegation was created. A worker asks the history before
    /// running a request stored long after this (a copy sent after the
    /// duplicate window) or without it, so a copy keeps the original's.
    #[serde(
        default,
        with = "super::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub created_at: Option<OffsetDateTime>,
    /// A JSON Schema the answer must satisfy (`llm` executor: the model gets
    /// one correction attempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
}

fn default_task_count() -> u32 {
    1
}

fn default_depth() -> u32 {
    1
}

/// The deepest subagent nesting allowed by default: subagents cannot delegate.
pub const DEFAULT_MAX_DEPTH: u32 = 1;

/// The most tasks one delegation may have. A batch's wake reads every
/// task's completion to build one turn, so the count a request or
/// completion claims must be bounded: an untrusted one is never used to
/// size memory or a loop of reads beyond this. (Each completion of a batch
/// in hand reads the others, from the last down: a batch of N costs about
/// N reads when its tasks end in order, up to N²/2 in reverse order, and
/// holds N completions, up to 1 MiB each.)
pub const MAX_TASK_COUNT: u32 = 1_000;

/// Why a request body could not be used. Each kind ends the task with an
/// `error` completion rather than a retry: sending it again cannot help.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not JSON of the request shape (including a missing goal).
    #[error("request body is not a valid task request: {0}")]
    Json(#[from] serde_json::Error),
    /// The body is not UTF-8 (so not JSON either).
    #[error("request body is not valid UTF-8: {0}")]
    NotUtf8(#[from] std::str::Utf8Error),
    /// The body declares a version this build does not understand.
    #[error(
        "request version {found} is not supported (this worker reads up to {PROTOCOL_VERSION})"
    )]
    UnsupportedVersion {
        /// The declared version.
        found: u32,
    },
    /// The goal is empty or only whitespace.
    #[error("request goal is empty")]
    EmptyGoal,
    /// An id in the body is malformed.
    #[error("request has an invalid id: {0}")]
    InvalidId(#[from] IdError),
    /// The output schema is not a usable JSON Schema.
    #[error("output_schema is not a valid JSON Schema: {0}")]
    OutputSchema(String),
    /// `timeout_seconds` is 0, which would time the task out at once
    /// (`null` or absent means the pool's default).
    #[error("timeout_seconds must be at least 1 (null or absent: the worker's default)")]
    ZeroTimeout,
    /// `depth` is 0: a top-level session's task is at depth 1, and a 0
    /// would let its subagent delegate one level past `--max-depth`.
    #[error("depth must be at least 1 (1: delegated by a top-level session; absent: 1)")]
    ZeroDepth,
    /// The task index is not below the task count.
    #[error("task_index {index} is not below task_count {count}")]
    TaskIndex {
        /// The index.
        index: u32,
        /// The count.
        count: u32,
    },
    /// The task count is above [`MAX_TASK_COUNT`].
    #[error("task_count {count} is above the limit of {MAX_TASK_COUNT}")]
    TaskCount {
        /// The count.
        count: u32,
    },
    /// The body, goal or context is larger than the worker accepts.
    #[error("request is too large: {0}")]
    TooLarge(#[from] TooLarge),
    /// The origin session header disagrees with the body.
    #[error("the Wakebus-Origin-Session header does not match origin_session_id in the body")]
    OriginMismatch,
}

impl TaskRequest {
    /// A request for task 0 of a one-task delegation, with defaults elsewhere.
    pub fn new(delegation_id: impl Into<String>, goal: impl Into<String>) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            delegation_id: delegation_id.into(),
            task_index: 0,
            task_count: 1,
            wake_mode: WakeMode::Batch,
            notify_early_failure: false,
            origin_session_id: None,
            goal: goal.into(),
            context: String::new(),
            role: Role::Leaf,
            model: None,
            toolsets: Vec::new(),
            timeout_seconds: None,
            depth: default_depth(),
            parent_session_id: None,
            created_at: None,
            output_schema: None,
        }
    }

    /// Decodes and validates a request body within the default [`Limits`].
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_within(body, &Limits::default())
    }

    /// Decodes and validates a request body within `limits`. The body's size
    /// is checked before it is parsed.
    pub fn decode_within(body: &[u8], limits: &Limits) -> Result<Self, DecodeError> {
        limits.check_body(body.len())?;
        let text = std::str::from_utf8(body)?;
        let request: Self = match serde_json::from_str(text) {
            Ok(request) => request,
            // A later version's body may lack what this one needs: its
            // publisher is told the version, not that a field is missing.
            Err(error) => {
                return Err(match later_version(body) {
                    Some(found) => DecodeError::UnsupportedVersion { found },
                    None => error.into(),
                });
            }
        };
        request.validate()?;
        limits.check_fields(&request.goal, &request.context)?;
        Ok(request)
    }

    /// Checks the fields serde cannot: version, ids and a non-empty goal.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.version == 0 || self.version > PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                found: self.version,
            });
        }
        validate_delegation_id(&self.delegation_id)?;
        if let Some(session) = &self.origin_session_id {
            validate_session_id(session)?;
        }
        if self.goal.trim().is_empty() {
            return Err(DecodeError::EmptyGoal);
        }
        if let Some(schema) = &self.output_schema {
            check_output_schema(schema).map_err(DecodeError::OutputSchema)?;
        }
        if self.timeout_seconds == Some(0) {
            return Err(DecodeError::ZeroTimeout);
        }
        if self.depth == 0 {
            return Err(DecodeError::ZeroDepth);
        }
        if self.task_count > MAX_TASK_COUNT {
            return Err(DecodeError::TaskCount {
                count: self.task_count,
            });
        }
        if self.task_count == 0 || self.task_index >= self.task_count {
            return Err(DecodeError::TaskIndex {
                index: self.task_index,
                count: self.task_count,
            });
        }
        Ok(())
    }

    /// Checks that the origin session header, if any, agrees with the body.
    pub fn check_origin_header(&self, header: Option<&str>) -> Result<(), DecodeError> {
        match (header, self.origin_session_id.as_deref()) {
            (None, _) => Ok(()),
            (Some(h), Some(b)) if h == b => Ok(()),
            _ => Err(DecodeError::OriginMismatch),
        }
    }
}

/// The `version` of a body this version of the protocol cannot read, if it
/// is a later one.
pub(super) fn later_version(body: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    struct VersionOnly {
        version: Option<serde_json::Value>,
    }
    let found = serde_json::from_slice::<VersionOnly>(body)
        .ok()?
        .version?
        .as_u64()?;
    (found > u64::from(PROTOCOL_VERSION)).then(|| u32::try_from(found).unwrap_or(u32::MAX))
}

/// Checks that `schema` can be an `output_schema`: a JSON object that is a
/// valid JSON Schema. (`true` and `false` are valid schemas too, but the
/// contract allows only objects: `false` would refuse every answer.)
pub fn check_output_schema(schema: &serde_json::Value) -> Result<(), String> {
    if !schema.is_object() {
        return Err(format!("it must be a JSON object, not {schema}"));
    }
    jsonschema::validator_for(schema)
        .map(drop)
        .map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of a later version may lack what this one needs, or hold it
    /// differently: its publisher learns the version is not supported,
    /// not that `goal` is missing.
    #[test]
    fn a_later_versions_body_is_refused_for_its_version() {
        let later = br#"{"version":2,"delegation_id":"d1","objective":"g"}"#;
        let error = TaskRequest::decode(later).unwrap_err();
        assert!(
            matches!(error, DecodeError::UnsupportedVersion { found: 2 }),
            "{error}"
        );
        let this = br#"{"version":1,"delegation_id":"d1","objective":"g"}"#;
        let error = TaskRequest::decode(this).unwrap_err();
        assert!(error.to_string().contains("goal"), "{error}");
    }

    #[test]
    fn a_task_count_above_the_limit_is_refused_and_the_limit_itself_is_not() {
        let body = |count: u32| {
            format!(r#"{{"version":1,"delegation_id":"d1","goal":"g","task_count":{count}}}"#)
        };
        let refused = TaskRequest::decode(body(MAX_TASK_COUNT + 1).as_bytes()).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "task_count 1001 is above the limit of 1000"
        );
        let most = TaskRequest::decode(body(MAX_TASK_COUNT).as_bytes()).unwrap();
        assert_eq!(most.task_count, MAX_TASK_COUNT);
    }

    #[test]
    fn minimal_request_from_another_language_decodes() {
        let req =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":"g","extra":1}"#)
                .unwrap();
        assert_eq!(req.goal, "g");
        assert_eq!(req.role, Role::Leaf);
        assert_eq!(req.origin_session_id, None);
    }

    #[test]
    fn missing_goal_wrong_types_and_future_versions_are_clear_errors() {
        let err = TaskRequest::decode(br#"{"version":1,"delegation_id":"d1"}"#).unwrap_err();
        assert!(err.to_string().contains("missing field `goal`"), "{err}");
        let err =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":7}"#).unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
        let err =
            TaskRequest::decode(br#"{"version":9,"delegation_id":"d1","goal":"g"}"#).unwrap_err();
        assert!(matches!(err, DecodeError::UnsupportedVersion { found: 9 }));
        let err =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":"  "}"#).unwrap_err();
        assert!(matches!(err, DecodeError::EmptyGoal));
    }

    #[test]
    fn a_zero_time_limit_is_refused_rather_than_timing_the_task_out_at_once() {
        let err = TaskRequest::decode(
            br#"{"version":1,"delegation_id":"d1","goal":"g","timeout_seconds":0}"#,
        )
        .unwrap_err();
        assert!(matches!(err, DecodeError::ZeroTimeout), "{err}");
        let ok = TaskRequest::decode(
            br#"{"version":1,"delegation_id":"d1","goal":"g","timeout_seconds":null}"#,
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    /// A subagent delegates at its own depth plus one: a 0 would give a
    /// task's subagent depth 1, as if a top-level session had delegated.
    #[test]
    fn a_depth_of_zero_is_refused_rather_than_granting_a_level_past_the_limit() {
        let err =
            TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":"g","depth":0}"#)
                .unwrap_err();
        assert!(matches!(err, DecodeError::ZeroDepth), "{err}");
        let absent = TaskRequest::decode(br#"{"version":1,"delegation_id":"d1","goal":"g"}"#);
        assert_eq!(absent.unwrap().depth, 1);
    }

    #[test]
    fn an_output_schema_that_is_no_schema_is_refused() {
        let err = TaskRequest::decode(
            br#"{"version":1,"delegation_id":"d1","goal":"g","output_schema":"just text"}"#,
        )
        .unwrap_err();
        assert!(matches!(err, DecodeError::OutputSchema(_)), "{err}");
        // Valid JSON Schemas, but not objects: `false` would refuse every answer.
        for boolean in ["true", "false"] {
            let body = format!(
                r#"{{"version":1,"delegation_id":"d1","goal":"g","output_schema":{boolean}}}"#
            );
            let err = TaskRequest::decode(body.as_bytes()).unwrap_err();
            assert!(err.to_string().contains("must be a JSON object"), "{err}");
        }
        assert!(
            TaskRequest::decode(
                br#"{"version":1,"delegation_id":"d1","goal":"g","output_schema":{"type":"object"}}"#
            )
            .is_ok()
        );
    }

    #[test]
    fn oversized_bodies_goals_and_contexts_are_refused_with_their_sizes() {
        let limits = Limits {
            max_request_bytes: 200,
            max_goal_bytes: 5,
            max_context_bytes: 8,
        };
        let err = TaskRequest::decode_within(&[b' '; 201], &limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            "request is too large: request body is 201 bytes; the limit is 200 bytes"
        );
        let body = br#"{"version":1,"delegation_id":"d1","goal":"123456"}"#;
        let err = TaskRequest::decode_within(body, &limits).unwrap_err();
        assert!(matches!(
            err,
            DecodeError::TooLarge(TooLarge {
                what: "goal",
                len: 6,
                max: 5
            })
        ));
        let body = br#"{"version":1,"delegation_id":"d1","goal":"g","context":"123456789"}"#;
        let err = TaskRequest::decode_within(body, &limits).unwrap_err();
        assert!(err.to_string().contains("context is 9 bytes"), "{err}");
    }

    #[test]
    fn invalid_utf8_is_a_clear_error() {
        let err =
            TaskRequest::decode(b"{\"version\":1,\"delegation_id\":\"d1\",\"goal\":\"\xff\xfe\"}")
                .unwrap_err();
        assert_eq!(
            err.to_string(),
            "request body is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 42"
        );
    }

    #[test]
    fn a_forged_origin_header_is_detected() {
        let req = TaskRequest::decode(
            br#"{"version":1,"delegation_id":"d1","goal":"g","origin_session_id":"s1"}"#,
        )
        .unwrap();
        assert!(req.check_origin_header(Some("s1")).is_ok());
        assert!(req.check_origin_header(None).is_ok());
        assert!(matches!(
            req.check_origin_header(Some("s2")),
            Err(DecodeError::OriginMismatch)
        ));
    }
}
