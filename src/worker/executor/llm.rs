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
#[non_exhaustive]
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
        /// The URL as given, its credentials and query hidden.
        url: String,
    },
    /// A base URL with a query or fragment, after which the path
    /// `/chat/completions` cannot be appended.
    #[error(
        "the LLM base URL has a query or fragment, and /chat/completions is appended to it: give the API's base URL"
    )]
    QueryInBaseUrl,
    /// A user name or password in the URL besides an API key: each becomes
    /// an `Authorization` header.
    #[error(
        "the LLM base URL holds a user name or password and an API key is given too: each would be sent as an Authorization header; give one of them"
    )]
    TwoCredentials,
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

/// One answer of a chat-completions response.
#[derive(Debug, Deserialize)]
struct Choice {
    /// The answer.
    message: ChatMessage,
    /// Why the model stopped: `length` means the answer was cut at the
    /// token limit.
    #[serde(default)]
    finish_reason: Option<String>,
}

/// The assistant message of an answer.
#[derive(Debug, Deserialize)]
struct ChatMessage {
    /// Its text; `null` when the model declined or called a tool.
    #[serde(default)]
    content: Option<String>,
    /// The model's refusal, when it declined (OpenAI's structured outputs).
    #[serde(default)]
    refusal: Option<String>,
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
    /// The endpoint answered (possibly with no text).
    Answer(Answer),
    /// A refusal that retrying will not fix (4xx other than 408/429).
    Refused(String),
}

/// What the model answered.
struct Answer {
    /// Its text; empty when it gave none.
    text: String,
    /// Its token counts.
    usage: Usage,
    /// Whether it was cut at the token limit (`finish_reason: length`).
    truncated: bool,
    /// Why it has no text, when it has none.
    declined: Option<String>,
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
                url: crate::wake::session_api::redacted_url(&config.base_url),
            })?;
        if base.query().is_some() || base.fragment().is_some() {
            return Err(LlmConfigError::QueryInBaseUrl);
        }
        if config.api_key.is_some() && (!base.username().is_empty() || base.password().is_some()) {
            return Err(LlmConfigError::TwoCredentials);
        }
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
        let mut tokens = (0u64, 0u64);
        progress.report("model call 1".to_owned());
        let first = match self
            .call_unless_stopped(&model, &messages, 1, tokens, None, stop)
            .await?
        {
            Call::Answer(answer) => answer,
            Call::Refused(reason) => {
                return Ok(output(
                    Status::Failed,
                    None,
                    Some(reason),
                    1,
                    tokens,
                    "llm_refused",
                ));
            }
        };
        tokens.0 += first.usage.prompt_tokens;
        tokens.1 += first.usage.completion_tokens;
        // No text (the model declined): nothing to correct.
        let Some(schema) = request
            .output_schema
            .as_ref()
            .filter(|_| first.declined.is_none())
        else {
            return Ok(first.into_output(1, tokens));
        };
        let problem = match check_against(schema, &first.text) {
            Ok(json) => return Ok(first.with_text(json).into_output(1, tokens)),
            Err(problem) => problem,
        };

        // One correction attempt. Whatever becomes of it, the first answer
        // is not thrown away: a correction call that fails (the longer
        // prompt refused, the endpoint down) ends the task with it.
        messages.push(json!({"role": "assistant", "content": first.text}));
        messages.push(json!({"role": "user", "content": format!(
            "Your answer does not match the required JSON Schema: {problem}. Reply again with only JSON that matches it."
        )}));
        progress.report("model call 2".to_owned());
        let mismatch = |answer: &Answer, tokens, error: String| {
            let mut out = output(
                Status::Failed,
                Some(answer.text.clone()),
                Some(error),
                2,
                tokens,
                "schema_mismatch",
            );
            out.truncated = answer.truncated;
            out
        };
        let failed_correction = |reason: &str| {
            format!(
                "answer does not match output_schema ({problem}); the correction call failed: {reason}"
            )
        };
        let second = match self
            .call_unless_stopped(&model, &messages, 2, tokens, Some(&first), stop)
            .await
        {
            Ok(Call::Answer(answer)) => answer,
            // A failure as the run is stopped is the stop's: the first
            // answer is its partial output.
            Ok(Call::Refused(_)) | Err(ExecError::Transient { .. }) if stop.is_cancelled() => {
                return Err(ExecError::Stopped {
                    partial: Some(first.text.clone()),
                    api_calls: 2,
                    tokens: Some(tokens),
                    truncated: first.truncated,
                });
            }
            // The worker's key refused between the two calls (revoked,
            // rotated): the worker's failure, not the task's, which goes
            // back to a worker whose key works, as for the first call.
            Err(
                refused @ ExecError::Transient {
                    this_worker: true, ..
                },
            ) => return Err(refused),
            Ok(Call::Refused(reason)) | Err(ExecError::Transient { reason, .. }) => {
                let error = failed_correction(&reason);
                return Ok(mismatch(&first, tokens, error));
            }
            Err(stopped) => return Err(stopped),
        };
        tokens.0 += second.usage.prompt_tokens;
        tokens.1 += second.usage.completion_tokens;
        if second.text.is_empty() {
            // The model declined to correct it: the first answer stands.
            let error = failed_correction(second.declined.as_deref().unwrap_or("no answer"));
            return Ok(mismatch(&first, tokens, error));
        }
        match check_against(schema, &second.text) {
            Ok(json) => Ok(second.with_text(json).into_output(2, tokens)),
            Err(problem) => Ok(mismatch(
                &second,
                tokens,
                format!(
                    "answer does not match output_schema after a correction attempt: {problem}"
                ),
            )),
        }
    }

    /// One model call, the `calls`-th, aborted if `stop` fires: what the
    /// task used so far is kept, and `answered` (an earlier answer) is its
    /// partial output.
    async fn call_unless_stopped(
        &self,
        model: &str,
        messages: &[Value],
        calls: u64,
        tokens: (u64, u64),
        answered: Option<&Answer>,
        stop: &CancellationToken,
    ) -> Result<Call, ExecError> {
        let stopped = |made: u64| ExecError::Stopped {
            partial: answered.map(|answer| answer.text.clone()),
            api_calls: made,
            tokens: Some(tokens),
            truncated: answered.is_some_and(|answer| answer.truncated),
        };
        // A run cancelled before this call makes none, and counts none.
        if stop.is_cancelled() {
            return Err(stopped(calls.saturating_sub(1)));
        }
        // The stop first, should both be ready at once.
        tokio::select! {
            biased;
            () = stop.cancelled() => Err(stopped(calls)),
            call = self.call(model, messages) => call,
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
        let response = match request.send().await {
            Ok(response) => response,
            // A redirect the policy refused (too many, or one that would
            // drop the prompt) or a request that cannot be built fails the
            // same way every time.
            // Without the URL: the reason goes into the completion, the
            // session's turn and the history.
            Err(error) if error.is_redirect() || error.is_builder() => {
                let error = error.without_url();
                return Ok(Call::Refused(format!("LLM endpoint not called: {error}")));
            }
            Err(error) => {
                let error = error.without_url();
                return Err(ExecError::transient(format!(
                    "LLM endpoint unreachable: {error}"
                )));
            }
        };
        let status = response.status();
        if crate::http_client::is_retryable(status) {
            return Err(ExecError::Transient {
                reason: format!("LLM endpoint answered {status}"),
                retry_after: crate::http_client::retry_after(response.headers()),
                this_worker: false,
            });
        }
        if !status.is_success() {
            let body = match read_at_most(response, MAX_REFUSAL_BYTES).await {
                Ok(body) | Err(Unread::TooLarge(body)) => body,
                Err(Unread::BrokeOff(_)) => Vec::new(),
            };
            let body: String = String::from_utf8_lossy(&body).chars().take(500).collect();
            let reason = format!("LLM endpoint answered {status}: {body}");
            if refuses_this_worker(status) && model == self.model {
                // This worker's key (or proxy login) is refused for its own
                // model: the task is not at fault. It goes back to the
                // queue, where a worker with working credentials can run
                // it; it fails only once its deliveries run out. (A model
                // the task names may be one no key may use: that refusal
                // is the task's.)
                return Err(ExecError::this_worker(format!(
                    "{reason} (the endpoint refuses this worker's credentials: check --llm-api-key-file)"
                )));
            }
            return Ok(Call::Refused(reason));
        }
        let body = match read_at_most(response, MAX_ANSWER_BYTES).await {
            Ok(body) => body,
            Err(Unread::TooLarge(_)) => {
                return Ok(Call::Refused(format!(
                    "LLM endpoint's answer is larger than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            Err(Unread::BrokeOff(error)) => {
                return Err(ExecError::transient(format!(
                    "LLM endpoint's answer broke off: {error}"
                )));
            }
        };
        let parsed: ChatResponse = serde_json::from_slice(&body).map_err(|e| {
            ExecError::transient(format!("LLM response is not a chat completion: {e}"))
        })?;
        Ok(Call::Answer(Answer::from(parsed)))
    }
}

/// Whether an answer to a call of the worker's own model refuses the
/// worker rather than the task: 401 and 403 (the API key) and 407 (a
/// proxy's login). Retrying on the same worker will not help, but another
/// worker, or this one once its key is fixed, can run the task.
fn refuses_this_worker(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::PROXY_AUTHENTICATION_REQUIRED
    )
}

impl From<ChatResponse> for Answer {
    fn from(response: ChatResponse) -> Self {
        let usage = response.usage.unwrap_or_default();
        let Some(choice) = response.choices.into_iter().next() else {
            return Self {
                text: String::new(),
                usage,
                truncated: false,
                declined: Some("the endpoint returned no choices".to_owned()),
            };
        };
        let text = choice.message.content.unwrap_or_default();
        // Why there is no text: the model's own refusal, or how it finished
        // (`content_filter`, `tool_calls`).
        let declined =
            text.is_empty()
                .then(|| match (choice.message.refusal, &choice.finish_reason) {
                    (Some(refusal), _) => format!("the model declined: {refusal}"),
                    (None, Some(finish)) => {
                        format!("the model gave no answer (finish_reason: {finish})")
                    }
                    (None, None) => "the model gave no answer".to_owned(),
                });
        Self {
            text,
            usage,
            truncated: choice.finish_reason.as_deref() == Some("length"),
            declined,
        }
    }
}

impl Answer {
    /// The same answer with `text` as its text (a structured answer's JSON
    /// without the Markdown fence around it).
    fn with_text(self, text: String) -> Self {
        Self { text, ..self }
    }

    /// The task's outcome when this is its last answer: `completed`, or
    /// `failed` with `llm_no_answer` when the model gave no text.
    fn into_output(self, api_calls: u64, tokens: (u64, u64)) -> ExecOutput {
        let mut out = match self.declined {
            Some(why) => output(
                Status::Failed,
                None,
                Some(why),
                api_calls,
                tokens,
                "llm_no_answer",
            ),
            None => output(
                Status::Completed,
                Some(self.text),
                None,
                api_calls,
                tokens,
                "completed",
            ),
        };
        out.truncated = self.truncated;
        out
    }
}

/// Most of an answer read: far above any chat completion, so that only a
/// misbehaving endpoint (or a proxy in front of it) reaches it, and a
/// worker's memory stays bounded by it times its concurrency.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Most of a refusal's answer read (500 characters of it are kept).
const MAX_REFUSAL_BYTES: usize = 4096;

/// Checks that `answer` is JSON satisfying `schema`; returns that JSON
/// (without a Markdown code fence around it), or says why not.
fn check_against(schema: &Value, answer: &str) -> Result<String, String> {
    let validator = jsonschema::validator_for(schema)
        .map_err(|e| format!("the output_schema itself is invalid: {e}"))?;
    let trimmed = answer
        .trim()
        .trim_start_matches("```json")
        .trim_start_matches("```")
        .trim_end_matches("```");
    let json = trimmed.trim();
    let value: Value =
        serde_json::from_str(json).map_err(|e| format!("the answer is not JSON ({e})"))?;
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .take(5)
        .collect();
    if problems.is_empty() {
        Ok(json.to_owned())
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

    #[tokio::test]
    async fn a_run_cancelled_before_its_first_call_makes_and_counts_none() {
        // Nothing listens there: a call made would fail, not be stopped.
        let executor = LlmExecutor::new(&config("http://127.0.0.1:1/v1")).unwrap();
        let stop = CancellationToken::new();
        stop.cancel();
        let (progress, _) = Progress::channel();
        let result = executor
            .run(&TaskRequest::new("d1", "g"), &stop, &progress)
            .await;
        assert!(
            matches!(result, Err(ExecError::Stopped { api_calls: 0, .. })),
            "{result:?}"
        );
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
        for query in [
            "https://models.example/v1?key=s3cret",
            "https://models.example/v1#x",
        ] {
            let error = LlmExecutor::new(&config(query)).expect_err(query);
            assert!(
                matches!(error, LlmConfigError::QueryInBaseUrl),
                "{query}: {error}"
            );
            assert!(!error.to_string().contains("s3cret"), "{error}");
        }
        // The test config gives an API key.
        let error = LlmExecutor::new(&config("https://bob:pw@models.example/v1")).unwrap_err();
        assert!(matches!(error, LlmConfigError::TwoCredentials), "{error}");
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
