//! The `llm` executor: a subagent on any OpenAI-compatible chat-completions
//! endpoint.
//!
//! A system prompt for the role, the goal and context as the user message,
//! the answer as the summary. If the request carries an `output_schema`, the
//! answer must be JSON that satisfies it; the model gets one correction
//! attempt. Each model call is reported as progress. The API key is only
//! ever held in a sensitive header value, never logged.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{ExecError, ExecOutput, Progress};
use crate::http_client::{Unread, read_at_most};
use crate::protocol::{Role, Status, TaskRequest};

/// Where and how to call the model.
#[derive(Debug, Clone)]
pub struct LlmConfig {
    /// Base URL including the version, e.g. `https://api.openai.com/v1`;
    /// `/chat/completions` is appended.
    pub base_url: String,
    /// Model used when the request names none.
    pub model: String,
    /// Bearer token, if the endpoint needs one.
    pub api_key: Option<String>,
    /// Limit for one model call.
    pub request_timeout: Duration,
}

/// Why the executor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LlmConfigError {
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The API key has characters a header cannot carry.
    #[error("the LLM API key contains characters not allowed in an HTTP header")]
    BadApiKey,
    /// The base URL is not an http(s) URL.
    #[error("the LLM base URL {url:?} is not an http:// or https:// URL")]
    BadUrl {
        /// The URL as given.
        url: String,
    },
}

/// Runs tasks on a chat-completions endpoint.
#[derive(Debug, Clone)]
pub struct LlmExecutor {
    /// Keeps connections alive between calls.
    http: reqwest::Client,
    /// The chat-completions URL.
    url: String,
    /// Default model.
    model: String,
    /// `Bearer <key>`, marked sensitive.
    authorization: Option<HeaderValue>,
}

/// The parts of a chat-completions response we read.
#[derive(Debug, Deserialize)]
struct ChatResponse {
    /// The answers (we use the first).
    choices: Vec<Choice>,
    /// Token counts.
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    /// The answer.
    message: ChatMessage,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    /// Its text.
    #[serde(default)]
    content: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    prompt_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    completion_tokens: u64,
}

/// How one model call ended.
enum Call {
    /// An answer and its token counts.
    Answer(String, Usage),
    /// A refusal that retrying will not fix (4xx other than 408/429).
    Refused(String),
}

/// Whether a request to `url` crosses the network unencrypted: plain
/// http to anything but this machine.
fn sends_in_clear(url: &reqwest::Url) -> bool {
    let host = crate::http_client::bare_host(url.host_str().unwrap_or_default());
    url.scheme() == "http" && !crate::http_client::is_loopback(host)
}

fn system_prompt(role: Role) -> &'static str {
    match role {
        Role::Leaf => {
            "You are a focused subagent. Complete the task you are given yourself and answer with the result only."
        }
        Role::Orchestrator => {
            "You are an orchestrating subagent. Plan the task, do what you can, and answer with the result and any remaining steps."
        }
    }
}

impl LlmExecutor {
    /// An executor calling `config.base_url`.
    pub fn new(config: &LlmConfig) -> Result<Self, LlmConfigError> {
        let base = reqwest::Url::parse(&config.base_url)
            .ok()
            .filter(|url| matches!(url.scheme(), "http" | "https") && url.has_host())
            .ok_or_else(|| LlmConfigError::BadUrl {
                url: config.base_url.clone(),
            })?;
        if config.api_key.is_some() && sends_in_clear(&base) {
            tracing::warn!(
                host = base.host_str().unwrap_or_default(),
                "The LLM API key is sent in clear over plain http to another machine; use https unless the network between them is trusted."
            );
        }
        crate::http_client::install_crypto_provider();
        // A 301, 302 or 303 comes back as a refusal naming it.
        let http = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .redirect(crate::http_client::body_keeping_redirects(|_| {
                Ok::<(), std::convert::Infallible>(())
            }))
            .build()?;
        let authorization = match &config.api_key {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| LlmConfigError::BadApiKey)?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(Self {
            http,
            url: format!("{}/chat/completions", config.base_url.trim_end_matches('/')),
            model: config.model.clone(),
            authorization,
        })
    }

    /// Runs one task; `stop` aborts the call in flight.
    pub async fn run(
        &self,
        request: &TaskRequest,
        stop: &CancellationToken,
        progress: &Progress,
    ) -> Result<ExecOutput, ExecError> {
        let model = request.model.clone().unwrap_or_else(|| self.model.clone());
        let mut user = request.goal.clone();
        if !request.context.is_empty() {
            user.push_str("\n\nContext:\n");
            user.push_str(&request.context);
        }
        if let Some(schema) = &request.output_schema {
            user.push_str("\n\nAnswer with JSON only, matching this JSON Schema:\n");
            user.push_str(&schema.to_string());
        }
        let mut messages = vec![
            json!({"role": "system", "content": system_prompt(request.role)}),
            json!({"role": "user", "content": user}),
        ];
        let mut calls = 0u64;
        let mut tokens = (0u64, 0u64);
        loop {
            calls += 1;
            progress.report(format!("model call {calls}"));
            let call = tokio::select! {
                call = self.call(&model, &messages) => call?,
                () = stop.cancelled() => return Err(ExecError::Stopped {
                    partial: None,
                    api_calls: calls,
                    tokens: Some(tokens),
                    truncated: false,
                }),
            };
            let (answer, usage) = match call {
                Call::Answer(answer, usage) => (answer, usage),
                Call::Refused(reason) => {
                    return Ok(output(
                        Status::Failed,
                        None,
                        Some(reason),
                        calls,
                        tokens,
                        "llm_refused",
                    ));
                }
            };
            tokens.0 += usage.prompt_tokens;
            tokens.1 += usage.completion_tokens;
            let Some(schema) = &request.output_schema else {
                return Ok(output(
                    Status::Completed,
                    Some(answer),
                    None,
                    calls,
                    tokens,
                    "completed",
                ));
            };
            match check_against(schema, &answer) {
                Ok(()) => {
                    return Ok(output(
                        Status::Completed,
                        Some(answer),
                        None,
                        calls,
                        tokens,
                        "completed",
                    ));
                }
                Err(problem) if calls == 1 => {
                    messages.push(json!({"role": "assistant", "content": answer}));
                    messages.push(json!({"role": "user", "content": format!(
                        "Your answer does not match the required JSON Schema: {problem}. Reply again with only JSON that matches it."
                    )}));
                }
                Err(problem) => {
                    return Ok(output(
                        Status::Failed,
                        Some(answer),
                        Some(format!(
                            "answer does not match output_schema after a correction attempt: {problem}"
                        )),
                        calls,
                        tokens,
                        "schema_mismatch",
                    ));
                }
            }
        }
    }

    async fn call(&self, model: &str, messages: &[Value]) -> Result<Call, ExecError> {
        let mut request = self
            .http
            .post(&self.url)
            .json(&json!({"model": model, "messages": messages, "stream": false}));
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let response = request
            .send()
            .await
            .map_err(|e| ExecError::Transient(format!("LLM endpoint unreachable: {e}")))?;
        let status = response.status();
        if status.is_server_error()
            || status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::REQUEST_TIMEOUT
        {
            return Err(ExecError::Transient(format!(
                "LLM endpoint answered {status}"
            )));
        }
        if !status.is_success() {
            let body = match read_at_most(response, MAX_REFUSAL_BYTES).await {
                Ok(body) | Err(Unread::TooLarge(body)) => body,
                Err(Unread::BrokeOff(_)) => Vec::new(),
            };
            let body: String = String::from_utf8_lossy(&body).chars().take(500).collect();
            return Ok(Call::Refused(format!(
                "LLM endpoint answered {status}: {body}"
            )));
        }
        let body = match read_at_most(response, MAX_ANSWER_BYTES).await {
            Ok(body) => body,
            Err(Unread::TooLarge(_)) => {
                return Ok(Call::Refused(format!(
                    "LLM endpoint's answer is larger than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            Err(Unread::BrokeOff(error)) => {
                return Err(ExecError::Transient(format!(
                    "LLM endpoint's answer broke off: {error}"
                )));
            }
        };
        let parsed: ChatResponse = serde_json::from_slice(&body).map_err(|e| {
            ExecError::Transient(format!("LLM response is not a chat completion: {e}"))
        })?;
        let answer = parsed
            .choices
            .into_iter()
            .next()
            .and_then(|c| c.message.content)
            .unwrap_or_default();
        Ok(Call::Answer(answer, parsed.usage.unwrap_or_default()))
    }
}

/// Most of an answer read: far above any chat completion, so that only a
/// misbehaving endpoint (or a proxy in front of it) reaches it, and a
/// worker's memory stays bounded by it times its concurrency.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Most of a refusal's answer read (500 characters of it are kept).
const MAX_REFUSAL_BYTES: usize = 4096;

/// Checks that `answer` is JSON satisfying `schema`; says why not.
fn check_against(schema: &Value, answer: &str) -> Result<(), String> {
    let validator = jsonschema::validator_for(schema)
        .map_err(|e| format!("the output_schema itself is invalid: {e}"))?;
    let trimmed = answer
        .trim()
        .trim_start_matches("```json")
        .trim_start_matches("```")
        .trim_end_matches("```");
    let value: Value = serde_json::from_str(trimmed.trim())
        .map_err(|e| format!("the answer is not JSON ({e})"))?;
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .take(5)
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

fn output(
    status: Status,
    summary: Option<String>,
    error: Option<String>,
    api_calls: u64,
    tokens: (u64, u64),
    exit_reason: &str,
) -> ExecOutput {
    ExecOutput {
        status,
        summary,
        error,
        api_calls,
        tokens: Some(tokens),
        truncated: false,
        exit_reason: exit_reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(base_url: &str) -> LlmConfig {
        LlmConfig {
            base_url: base_url.to_owned(),
            model: "m".to_owned(),
            api_key: Some("sk-test".to_owned()),
            request_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_base_url_that_is_not_http_is_refused_at_start() {
        for bad in ["api.openai.com/v1", "ftp://models/v1", "", "http://"] {
            let error = LlmExecutor::new(&config(bad)).expect_err(bad);
            assert!(
                matches!(error, LlmConfigError::BadUrl { .. }),
                "{bad}: {error}"
            );
        }
        assert!(LlmExecutor::new(&config("https://api.openai.com/v1")).is_ok());
    }

    #[test]
    fn only_plain_http_to_another_machine_sends_the_key_in_clear() {
        let in_clear = |url: &str| sends_in_clear(&reqwest::Url::parse(url).unwrap());
        assert!(in_clear("http://10.0.0.7:8000/v1"));
        assert!(in_clear("http://models.internal/v1"));
        for local in [
            "http://127.0.0.1:11434/v1",
            "http://localhost:8000/v1",
            "http://[::1]:8000/v1",
            "https://models.internal/v1",
        ] {
            assert!(!in_clear(local), "{local}");
        }
    }
}
