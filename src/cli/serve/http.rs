//! The HTTP side on rank 0 (axum): OpenAI routes, auth, limits, SSE, and the hand-off of
//! each choice to the engine loop as one sequence.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use arbor_model::engine::{Record, SeqSpec};
use arbor_model::FinishReason;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{channel, Receiver};

use super::api::{parse_body, ApiError, ChatRequest, CompletionRequest, Params, PromptInput};
use super::chat::ChatTemplate;
use super::conn::{self, Limits};
use super::msg::{Cmd, SeqEvent, Submission, SubmitChoice};
use super::stats::Stats;
use super::Args;
use crate::cli::model_api::Runner;

/// Events a stream's handler may hold unread before its sequences are cancelled: a
/// client that does not read its stream (far past the socket's buffers) costs the server
/// this much, not its whole output.
pub const STREAM_BACKLOG: usize = 1024;

pub struct AppState {
    pub(super) tx: std::sync::mpsc::Sender<Cmd>,
    tokenizer: Option<tokenizers::Tokenizer>,
    tokenizer_config: Option<arbor_model::TokenizerConfig>,
    chat: Option<ChatTemplate>,
    model_name: String,
    max_len: usize,
    vocab: usize,
    api_key: Option<String>,
    pub(super) draining: AtomicBool,
    inflight: AtomicUsize,
    max_queue: usize,
    max_n: usize,
    max_body: usize,
    limits: Limits,
    pub(super) max_upload: usize,
    /// The whole model in f32: no push may list more.
    pub(super) max_push_bytes: usize,
    pub(super) tp: usize,
    pub(super) stats: Arc<Stats>,
    next_id: AtomicU64,
    /// Set by the leader once the engine loop has ended: the server then shuts down.
    pub stop: Arc<tokio::sync::watch::Sender<bool>>,
}

impl AppState {
    pub fn new(
        args: &Args,
        runner: &dyn Runner,
        tx: std::sync::mpsc::Sender<Cmd>,
        stats: Arc<Stats>,
    ) -> Result<Self> {
        let model_name = args.served_model_name.clone().unwrap_or_else(|| {
            args.model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| args.model.display().to_string())
        });
        let limits = Limits::from_args(args, runner.weights_state().largest_tensor_elements);
        Ok(AppState {
            tx,
            tokenizer: runner.tokenizer().cloned(),
            chat: ChatTemplate::from_config(runner.tokenizer_config())?,
            tokenizer_config: runner.tokenizer_config().cloned(),
            model_name,
            max_len: runner.max_seq_len(),
            vocab: runner.config().vocab_size,
            api_key: args.api_key.clone(),
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            max_queue: args.max_queue,
            max_n: args.max_n,
            max_body: args.max_body_bytes,
            limits,
            max_upload: limits.max_upload,
            max_push_bytes: runner.weights_state().model_elements.saturating_mul(4),
            tp: runner.tp(),
            stats,
            next_id: AtomicU64::new(0),
            stop: Arc::new(tokio::sync::watch::channel(false).0),
        })
    }

    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given == Some(key.as_str()) {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key (Authorization: Bearer KEY)",
        )
        .with_code("invalid_api_key"))
    }

    pub(super) fn accepting(&self) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            ));
        }
        Ok(())
    }

    /// Generation needs the weights and the KV cache in memory.
    fn generating(&self) -> Result<(), ApiError> {
        self.accepting()?;
        if self.stats.released.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server has released its memory (release_memory_occupation): call resume_memory_occupation first",
            )
            .with_code("memory_released"));
        }
        Ok(())
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError {
                param: Some("model"),
                ..ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "model {m:?} does not exist (this server serves {:?})",
                        self.model_name
                    ),
                )
            }
            .with_code("model_not_found")),
            _ => Ok(()),
        }
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad(
                "prompt",
                "this model has no tokenizer.json: give the prompt as token ids",
            )
        })?;
        // As `arbor generate` encodes a prompt (tokenizer_config.json's add_bos_token too).
        let encoder = arbor_model::PromptEncoder {
            tokenizer: tok,
            config: self.tokenizer_config.as_ref(),
        };
        encoder
            .encode(text, special)
            .map_err(|e| ApiError::bad("prompt", format!("cannot tokenise the prompt: {e}")))
    }

    fn decode(&self, ids: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(ids, true).unwrap_or_default(),
            None => String::new(),
        }
    }

    fn token_str(&self, id: u32) -> String {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_else(|| format!("<{id}>"))
    }

    fn check_prompt(&self, prompt: &[u32], max_tokens: usize) -> Result<(), ApiError> {
        if prompt.is_empty() {
            return Err(ApiError::bad(
                "prompt",
                "the prompt is empty (it needs at least one token)",
            ));
        }
        if let Some((i, t)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.vocab)
        {
            return Err(ApiError::bad(
                "prompt",
                format!(
                    "token id {t} at index {i} is outside the vocabulary (size {})",
                    self.vocab
                ),
            ));
        }
        if max_tokens > self.max_len {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "max_tokens {max_tokens} exceeds the context length {}",
                    self.max_len
                ),
            ));
        }
        if prompt.len() + max_tokens > self.max_len {
            return Err(ApiError::bad("prompt", format!(
                "the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context length {}",
                prompt.len(),
                self.max_len
            ))
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    /// Hands every (prompt, choice) to the engine as one sequence.
    fn submit(
        self: &Arc<Self>,
        prompts: Vec<Vec<u32>>,
        p: Params,
        chat: bool,
    ) -> Result<Job, ApiError> {
        let total = p.sequences(prompts.len(), self.max_queue)?;
        let before = self.inflight.fetch_add(total, Ordering::SeqCst);
        let guard = InflightGuard {
            st: self.clone(),
            n: total,
        };
        if before + total > self.max_queue {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                "the queue is full ({before} sequences waiting or running, limit {}); retry later",
                self.max_queue
            ),
            ));
        }
        // A plain response's handler reads every event as it comes (the response holds
        // them all anyway: room for a whole run of every choice twice, as an update with
        // policy retract re-runs it, with its version, restart and finish events); a
        // stream's reads only as fast as its client does.
        let backlog = if p.stream {
            STREAM_BACKLOG
        } else {
            total.saturating_mul(p.max_tokens.saturating_add(6).saturating_mul(2))
        };
        let (tx, rx) = channel(backlog.max(1));
        let mut choices = Vec::with_capacity(total);
        let mut subs = Vec::with_capacity(total);
        let score = p.prompt_logprobs || (p.echo && p.logprobs.is_some());
        for (pi, prompt) in prompts.into_iter().enumerate() {
            let prompt = Arc::new(prompt);
            for j in 0..p.n {
                let index = pi * p.n + j;
                let cancel = Arc::new(AtomicBool::new(false));
                let spec = SeqSpec {
                    sample_key: p.sample_id.wrapping_add(index as u64),
                    tokens: prompt.to_vec(),
                    score_from: score.then_some(1),
                    max_new: p.max_tokens,
                    sampling: p.sampling,
                    n_top: p.logprobs.unwrap_or(0),
                    ignore_eos: p.ignore_eos,
                };
                subs.push(SubmitChoice {
                    spec,
                    cancel: cancel.clone(),
                });
                choices.push(ChoiceState::new(index, prompt.clone(), cancel));
            }
        }
        let prefix = if chat { "chatcmpl" } else { "cmpl" };
        let id = match &p.rid {
            Some(rid) => rid.clone(),
            None => format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed)),
        };
        // One command for the whole request: its choices run on one weight version.
        let cmd = Cmd::Submit(Submission {
            rid: id.clone(),
            choices: subs,
            events: tx,
        });
        self.tx.send(cmd).map_err(|_| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
        })?;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        Ok(Job {
            rx,
            choices,
            p,
            chat,
            id,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.model_name.clone(),
            st: self.clone(),
            _guard: guard,
        })
    }
}

struct InflightGuard {
    st: Arc<AppState>,
    n: usize,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.st.inflight.fetch_sub(self.n, Ordering::SeqCst);
    }
}

fn hex(d: u64) -> String {
    format!("{d:016x}")
}

/// One choice as its events arrive.
struct ChoiceState {
    index: usize,
    prompt: Arc<Vec<u32>>,
    cancel: Arc<AtomicBool>,
    records: Vec<Record>,
    prompt_records: Vec<Record>,
    text: String,
    /// Bytes of `text` already streamed, and that text.
    sent: usize,
    emitted: String,
    finish: Option<&'static str>,
    /// The weights it ran on (from its first step).
    version: Option<Arc<str>>,
    /// Something of it was streamed (a restart cannot take that back).
    streamed: bool,
}

impl ChoiceState {
    fn new(index: usize, prompt: Arc<Vec<u32>>, cancel: Arc<AtomicBool>) -> Self {
        ChoiceState {
            index,
            prompt,
            cancel,
            records: Vec::new(),
            prompt_records: Vec::new(),
            text: String::new(),
            sent: 0,
            emitted: String::new(),
            finish: None,
            version: None,
            streamed: false,
        }
    }

    /// Back to before its first event: it runs again from its prompt.
    fn reset(&mut self, cancel: Arc<AtomicBool>) {
        self.cancel = cancel;
        self.records.clear();
        self.prompt_records.clear();
        self.text.clear();
        self.sent = 0;
        self.emitted.clear();
        self.finish = None;
        self.version = None;
    }

    fn tokens(&self) -> Vec<u32> {
        self.records.iter().map(|r| r.token).collect()
    }

    /// Text that can be streamed now. Held back: a trailing U+FFFD (the bytes of a
    /// character may still be arriving; decoding them later changes that text) and, with
    /// stop strings, the last bytes a stop string could start in.
    fn take_delta(&mut self, holdback: usize) -> String {
        let settled = match self.finish {
            Some(_) => self.text.len(),
            None => self
                .text
                .trim_end_matches('\u{FFFD}')
                .len()
                .saturating_sub(holdback),
        };
        let mut end = settled;
        while end > self.sent && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.sent || !self.text.starts_with(self.emitted.as_str()) {
            return String::new();
        }
        let d = self.text[self.sent..end].to_string();
        self.emitted.push_str(&d);
        self.sent = end;
        d
    }
}

pub struct Job {
    rx: Receiver<(usize, SeqEvent)>,
    choices: Vec<ChoiceState>,
    p: Params,
    chat: bool,
    id: String,
    created: u64,
    model: String,
    st: Arc<AppState>,
    _guard: InflightGuard,
}

/// What one engine event did to a choice (for streaming).
enum Update {
    Scored(usize, Vec<Record>),
    Token(usize, Record),
    Finished(usize),
    Nothing,
}

/// The choice's `finish_reason` when it was aborted.
const ABORT: &str = "abort";

impl Job {
    fn done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    async fn next(&mut self) -> Result<Update, ApiError> {
        let Some((i, ev)) = self.rx.recv().await else {
            // The engine let go of every sequence without finishing some: it cancelled
            // them because this handler fell too far behind, or it stopped.
            let behind = self
                .choices
                .iter()
                .any(|c| c.finish.is_none() && c.cancel.load(Ordering::SeqCst));
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                if behind {
                    format!("cancelled: the client left more than {STREAM_BACKLOG} events of its stream unread")
                } else {
                    "the engine has stopped".to_string()
                },
            ));
        };
        let stream = self.p.stream;
        let Some(c) = self.choices.get_mut(i) else {
            return Ok(Update::Nothing);
        };
        if let SeqEvent::Restart { cancel } = ev {
            if stream && c.streamed {
                // What was streamed came from the weights being replaced and cannot be
                // taken back: the choice ends instead of running again.
                cancel.store(true, Ordering::SeqCst);
                c.cancel = cancel;
                if c.finish.is_none() {
                    c.finish = Some(ABORT);
                    return Ok(Update::Finished(i));
                }
                return Ok(Update::Nothing);
            }
            c.reset(cancel);
            return Ok(Update::Nothing);
        }
        if c.finish.is_some() {
            return Ok(Update::Nothing);
        }
        match ev {
            SeqEvent::Started { weight_version } => {
                c.version = Some(weight_version);
                Ok(Update::Nothing)
            }
            SeqEvent::Aborted { weight_version } => {
                c.version.get_or_insert(weight_version);
                c.finish = Some(ABORT);
                Ok(Update::Finished(i))
            }
            SeqEvent::Restart { .. } => Ok(Update::Nothing),
            SeqEvent::Scored(recs) => {
                c.prompt_records.extend(recs.iter().cloned());
                Ok(Update::Scored(i, recs))
            }
            SeqEvent::Token(rec) => {
                c.records.push(rec.clone());
                c.text = self.st.decode(&c.tokens());
                let hit = self
                    .p
                    .stop
                    .iter()
                    .filter_map(|s| c.text.find(s.as_str()))
                    .min();
                if let Some(at) = hit {
                    c.text.truncate(at);
                    c.finish = Some("stop");
                    // The engine frees the sequence at its next step.
                    c.cancel.store(true, Ordering::SeqCst);
                }
                Ok(Update::Token(i, rec))
            }
            SeqEvent::Finished(reason) => {
                c.finish = Some(match reason {
                    FinishReason::Eos => "stop",
                    FinishReason::Length => "length",
                });
                Ok(Update::Finished(i))
            }
            SeqEvent::Refused { shutting_down, msg } => Err(if shutting_down {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg)
            } else {
                ApiError::new(StatusCode::BAD_REQUEST, msg)
            }),
        }
    }

    fn holdback(&self) -> usize {
        self.p.stop.iter().map(|s| s.len()).max().unwrap_or(1) - 1
    }

    fn usage(&self) -> Value {
        let mut seen = std::collections::HashSet::new();
        let prompt: usize = self
            .choices
            .iter()
            .filter(|c| seen.insert(Arc::as_ptr(&c.prompt)))
            .map(|c| c.prompt.len())
            .sum();
        let completion: usize = self.choices.iter().map(|c| c.records.len()).sum();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    /// Log-probs of `recs` in the endpoint's format.
    fn logprobs_json(
        &self,
        recs: &[Record],
        echo_prompt: Option<&ChoiceState>,
        text_offset0: usize,
    ) -> Value {
        let st = &self.st;
        if self.chat {
            let entry = |id: u32, lp: f32| {
                let s = st.token_str(id);
                json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
            };
            let content: Vec<Value> = recs
                .iter()
                .map(|r| {
                    let mut e = entry(r.token, r.logprob);
                    e["top_logprobs"] = r.top.iter().map(|t| entry(t.token, t.logprob)).collect();
                    e
                })
                .collect();
            return json!({"content": content});
        }
        let mut tokens = Vec::new();
        let mut lps: Vec<Value> = Vec::new();
        let mut tops: Vec<Value> = Vec::new();
        let mut offsets = Vec::new();
        let mut off = text_offset0;
        let mut push = |id: u32, lp: Value, top: Value| {
            let s = st.token_str(id);
            offsets.push(off);
            off += s.len();
            tokens.push(s);
            lps.push(lp);
            tops.push(top);
        };
        let top_map = |r: &Record| {
            let m: serde_json::Map<String, Value> = r
                .top
                .iter()
                .map(|t| (st.token_str(t.token), json!(t.logprob)))
                .collect();
            Value::Object(m)
        };
        if let Some(c) = echo_prompt {
            for (k, &id) in c.prompt.iter().enumerate() {
                match k.checked_sub(1).and_then(|j| c.prompt_records.get(j)) {
                    Some(r) => push(id, json!(r.logprob), top_map(r)),
                    None => push(id, Value::Null, Value::Null),
                }
            }
        }
        for r in recs {
            push(r.token, json!(r.logprob), top_map(r));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// arbor's extensions on a choice: token ids and logits digests (and prompt log-probs).
    fn extensions(&self, v: &mut Value, c: &ChoiceState, recs: &[Record], with_prompt: bool) {
        if let Some(ver) = &c.version {
            v["weight_version"] = json!(&**ver);
        }
        v["token_ids"] = json!(recs.iter().map(|r| r.token).collect::<Vec<_>>());
        v["logits_digest"] = json!(recs.iter().map(|r| hex(r.digest)).collect::<Vec<_>>());
        if with_prompt {
            v["prompt_token_ids"] = json!(c.prompt.as_slice());
        }
        if self.p.prompt_logprobs && with_prompt {
            v["prompt_logprobs"] = json!(c
                .prompt_records
                .iter()
                .map(|r| r.logprob)
                .collect::<Vec<_>>());
            v["prompt_logits_digest"] = json!(c
                .prompt_records
                .iter()
                .map(|r| hex(r.digest))
                .collect::<Vec<_>>());
        }
    }

    fn final_body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|c| {
                let mut v = if self.chat {
                    json!({"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish})
                } else {
                    let prompt_text = if self.p.echo { self.st.decode(&c.prompt) } else { String::new() };
                    json!({"index": c.index, "text": format!("{prompt_text}{}", c.text), "finish_reason": c.finish})
                };
                v["logprobs"] = match self.p.logprobs {
                    Some(_) => self.logprobs_json(&c.records, (self.p.echo && !self.chat).then_some(c), 0),
                    None => Value::Null,
                };
                self.extensions(&mut v, c, &c.records, true);
                v
            })
            .collect();
        let mut body = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        });
        // Every choice that ran, ran on one version (docs/rl.md).
        if let Some(v) = self.choices.iter().find_map(|c| c.version.as_deref()) {
            body["weight_version"] = json!(v);
            body["metadata"] = json!({"weight_version": v});
        }
        body
    }

    fn chunk(&self, choices: Vec<Value>) -> Event {
        let v = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        Event::default().data(v.to_string())
    }

    /// The chunk for one choice: a text delta, new records and maybe the finish.
    fn choice_chunk(&mut self, i: usize, recs: Vec<Record>, first: bool) -> Event {
        let holdback = self.holdback();
        let delta = self.choices[i].take_delta(holdback);
        let c = &self.choices[i];
        let mut v = if self.chat {
            let mut d = json!({"content": delta});
            if first {
                d["role"] = json!("assistant");
            }
            json!({"index": c.index, "delta": d, "finish_reason": c.finish})
        } else {
            json!({"index": c.index, "text": delta, "finish_reason": c.finish})
        };
        v["logprobs"] = match (self.p.logprobs, recs.is_empty()) {
            (Some(_), false) => self.logprobs_json(&recs, None, 0),
            _ => Value::Null,
        };
        self.extensions(&mut v, c, &recs, false);
        self.chunk(vec![v])
    }

    fn error_event(e: &ApiError) -> Event {
        Event::default().data(e.body().to_string())
    }
}

pub(super) fn body_error(e: BytesRejection) -> ApiError {
    let status = e.status();
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is too large".to_string()
    } else {
        format!("cannot read the request body: {}", e.body_text())
    };
    ApiError::new(status, msg)
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let req: CompletionRequest = parse_body(&bytes)?;
        st.check_model(req.common.model.as_deref())?;
        if req.suffix.is_some() {
            return Err(ApiError::bad("suffix", "suffix is not supported"));
        }
        let prompts = match req.prompt {
            PromptInput::Text(t) => vec![st.encode(&t, true)?],
            PromptInput::Texts(v) => v
                .iter()
                .map(|t| st.encode(t, true))
                .collect::<Result<_, _>>()?,
            PromptInput::Tokens(t) => vec![t],
            PromptInput::TokenLists(v) => v,
        };
        if prompts.is_empty() {
            return Err(ApiError::bad("prompt", "no prompt given"));
        }
        let max_tokens = req.max_tokens.unwrap_or(16);
        let mut p = req.common.params(max_tokens, req.logprobs, st.max_n)?;
        if req.best_of.is_some_and(|b| b != p.n) {
            return Err(ApiError::bad(
                "best_of",
                "best_of is not supported (other than equal to n)",
            ));
        }
        p.echo = req.echo;
        for prompt in &prompts {
            st.check_prompt(prompt, max_tokens)?;
        }
        run_job(st.submit(prompts, p, false)?).await
    }
    .await;
    finish_response(&st, r)
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let req: ChatRequest = parse_body(&bytes)?;
        st.check_model(req.common.model.as_deref())?;
        let tmpl = st.chat.as_ref().ok_or_else(|| {
            ApiError::bad(
                "messages",
                "this model has no chat template (tokenizer_config.json chat_template)",
            )
        })?;
        if req.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages is empty"));
        }
        let text = tmpl
            .render(&req.messages, req.add_generation_prompt.unwrap_or(true))
            .map_err(|e| ApiError::bad("messages", e))?;
        // The template writes the special tokens itself.
        let prompt = st.encode(&text, false)?;
        let max_tokens = req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or_else(|| st.max_len.saturating_sub(prompt.len()));
        let logprobs = match (req.logprobs, req.top_logprobs) {
            (true, k) => Some(k.unwrap_or(0)),
            (false, None) => None,
            (false, Some(_)) => {
                return Err(ApiError::bad(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ))
            }
        };
        let p = req.common.params(max_tokens, logprobs, st.max_n)?;
        st.check_prompt(&prompt, max_tokens)?;
        run_job(st.submit(vec![prompt], p, true)?).await
    }
    .await;
    finish_response(&st, r)
}

fn finish_response(st: &AppState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            st.stats.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(status = %e.status, msg = %e.message, "request refused");
            e.into_response()
        }
    }
}

async fn run_job(mut job: Job) -> Result<Response, ApiError> {
    if job.p.stream {
        return Ok(stream_job(job).into_response());
    }
    while !job.done() {
        job.next().await?;
    }
    Ok(Json(job.final_body()).into_response())
}

fn stream_job(job: Job) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    struct S {
        job: Job,
        pending: VecDeque<Event>,
        started: bool,
        ended: bool,
    }
    let s = S {
        job,
        pending: VecDeque::new(),
        started: false,
        ended: false,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.pending.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            if !s.started {
                s.started = true;
                for i in 0..s.job.choices.len() {
                    let c = &s.job.choices[i];
                    if s.job.chat {
                        let v = json!({"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
                        s.pending.push_back(s.job.chunk(vec![v]));
                    } else if s.job.p.echo {
                        let v = json!({"index": c.index, "text": s.job.st.decode(&c.prompt), "finish_reason": null, "prompt_token_ids": c.prompt.as_slice()});
                        s.pending.push_back(s.job.chunk(vec![v]));
                    }
                }
                continue;
            }
            if s.job.done() {
                if s.job.p.include_usage {
                    let v = json!({"id": s.job.id, "object": if s.job.chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": s.job.created, "model": s.job.model, "choices": [], "usage": s.job.usage()});
                    s.pending.push_back(Event::default().data(v.to_string()));
                }
                s.pending.push_back(Event::default().data("[DONE]"));
                s.ended = true;
                continue;
            }
            match s.job.next().await {
                Ok(Update::Token(i, rec)) => {
                    s.job.choices[i].streamed = true;
                    let e = s.job.choice_chunk(i, vec![rec], false);
                    s.pending.push_back(e);
                }
                Ok(Update::Finished(i)) => {
                    s.job.choices[i].streamed = true;
                    let e = s.job.choice_chunk(i, Vec::new(), false);
                    s.pending.push_back(e);
                }
                Ok(Update::Scored(i, recs)) if s.job.p.prompt_logprobs => {
                    s.job.choices[i].streamed = true;
                    let c = &s.job.choices[i];
                    let mut v = json!({"index": c.index, "text": "", "finish_reason": null,
                        "prompt_logprobs": recs.iter().map(|r| r.logprob).collect::<Vec<_>>(),
                        "prompt_logits_digest": recs.iter().map(|r| hex(r.digest)).collect::<Vec<_>>()});
                    if let Some(ver) = &c.version {
                        v["weight_version"] = json!(&**ver);
                    }
                    s.pending.push_back(s.job.chunk(vec![v]));
                }
                Ok(_) => {}
                Err(e) => {
                    s.pending.push_back(Job::error_event(&e));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": 0, "owned_by": "arbor", "max_model_len": st.max_len,
    }]}))
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.accepting() {
        Ok(()) => Json(json!({
            "status": "ok",
            "weight_version": st.stats.weight_version(),
            "paused": st.stats.paused.load(Ordering::Relaxed),
            "memory_released": st.stats.released.load(Ordering::Relaxed),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        st.stats.render(),
    )
        .into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route {}", uri.path())).into_response()
}

fn router(st: Arc<AppState>) -> Router {
    let limit = st.max_body;
    let limits = st.limits;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(super::admin::routes(st.max_upload))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            limits,
            conn::read_body,
        ))
        .with_state(st)
}

async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs the HTTP server until the leader says stop; reports the bound address (or the
/// bind error) on `ready` first.
pub fn serve(
    state: AppState,
    addr: SocketAddr,
    ready: std::sync::mpsc::Sender<Result<SocketAddr>>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(anyhow::anyhow!("cannot bind {addr}: {e}")));
                return Ok(());
            }
        };
        let bound = listener
            .local_addr()
            .with_context(|| format!("bound {addr}"))?;
        let _ = ready.send(Ok(bound));
        let st = Arc::new(state);
        let sig = st.clone();
        tokio::spawn(async move {
            terminated().await;
            tracing::info!("SIGTERM: draining");
            eprintln!("arbor serve: signal received, draining (new requests get 503)");
            sig.draining.store(true, Ordering::SeqCst);
            let _ = sig.tx.send(Cmd::Drain);
        });
        let stop = st.stop.subscribe();
        let mut stop2 = st.stop.subscribe();
        let limits = st.limits;
        let server = conn::serve(listener, router(st), limits, stop);
        // Connections that outlive the drain (idle keep-alives, stuck clients) get 5 s.
        tokio::select! {
            _ = server => {},
            _ = async move {
                let _ = stop2.wait_for(|v| *v).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            } => {}
        }
        Ok(())
    })
}
