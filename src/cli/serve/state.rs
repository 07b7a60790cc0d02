//! The state the HTTP handlers share on rank 0 (`AppState`): the serving loop's handle,
//! the tokenizer and chat template, the limits, and the checks every request goes through
//! (API key, draining, memory released, model name, prompt against the context length).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use axum::http::{HeaderMap, StatusCode};

use super::api::ApiError;
use super::chat::{Chat, ChatTemplate};
use super::conn::Limits;
use arbor_serving::{ServingHandle, Stats};

use super::Args;
use crate::cli::model_api::Runner;

/// The name arbor gives prime-rl's broadcast group (its routes, and the group whose leaving
/// makes `/update_weights {weight_dir}` read the directory again).
pub const PRIME_RL_GROUP: &str = "prime-rl-broadcast";

pub struct AppState {
    pub(super) handle: ServingHandle,
    tokenizer: Option<tokenizers::Tokenizer>,
    tokenizer_config: Option<arbor_model::TokenizerConfig>,
    chat: Chat,
    /// Constrained decoding over the served tokenizer (made on first use).
    pub(super) structured: Arc<super::structured::Engine>,
    pub(super) model_name: String,
    pub(super) max_len: usize,
    pub(super) vocab: usize,
    /// A mixture-of-experts model's layers and experts per token (what one token's routed
    /// experts hold); None for a dense model.
    pub(super) routed: Option<(usize, usize)>,
    /// The ids that end a sequence (config.json and generation_config.json).
    pub(super) eos_token_ids: Vec<u32>,
    api_key: Option<String>,
    pub(super) draining: AtomicBool,
    pub(super) inflight: AtomicUsize,
    pub(super) max_queue: usize,
    pub(super) max_n: usize,
    pub(super) max_body: usize,
    pub(super) limits: Limits,
    pub(super) max_upload: usize,
    /// The whole model in f32: no push may list more.
    pub(super) max_push_bytes: usize,
    pub(super) tp: usize,
    /// What `/get_server_info` and `/get_model_info` report of the start-up settings.
    pub(super) server_info: serde_json::Value,
    pub(super) stats: Arc<Stats>,
    pub(super) next_id: AtomicU64,
    /// `--default-seed`: the seed of unseeded requests (None: a fresh one each).
    default_seed: Option<u64>,
    /// After prime-rl's `/init_broadcaster`: its timeout, and `/update_weights
    /// {weight_dir}` receives over that group instead of reading the directory.
    pub(super) prime_broadcaster: std::sync::Mutex<Option<f64>>,
    /// Set by the leader once the engine loop has ended: the server then shuts down.
    pub stop: Arc<tokio::sync::watch::Sender<bool>>,
}

impl AppState {
    pub fn new(
        args: &Args,
        runner: &dyn Runner,
        handle: ServingHandle,
        stats: Arc<Stats>,
    ) -> Result<Self> {
        let model_name = args.served_model_name.clone().unwrap_or_else(|| {
            args.model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| args.model.display().to_string())
        });
        let limits = Limits::from_args(args, runner.weights_state().largest_tensor_elements);
        let server_info = server_info(args, runner, &model_name);
        Ok(AppState {
            handle,
            tokenizer: runner.tokenizer().cloned(),
            chat: Chat::from_config(runner.tokenizer_config()),
            structured: Arc::new(super::structured::Engine::new(
                runner.tokenizer().cloned(),
                runner.config().vocab_size,
                runner.eos_token_ids().to_vec(),
            )),
            tokenizer_config: runner.tokenizer_config().cloned(),
            model_name,
            max_len: runner.max_seq_len(),
            vocab: runner.config().vocab_size,
            routed: runner
                .config()
                .moe
                .as_ref()
                .map(|m| (runner.config().num_layers, m.top_k)),
            eos_token_ids: runner.eos_token_ids().to_vec(),
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
            server_info,
            stats,
            next_id: AtomicU64::new(0),
            prime_broadcaster: std::sync::Mutex::new(None),
            default_seed: args.default_seed,
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
    pub(super) fn generating(&self) -> Result<(), ApiError> {
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

    /// The chat template, or why `/v1/chat/completions` cannot run.
    pub(super) fn chat_template(&self) -> Result<&ChatTemplate, ApiError> {
        match &self.chat {
            Chat::Ready(t) => Ok(t.as_ref()),
            Chat::Missing => Err(ApiError::bad(
                "messages",
                "this model has no chat template (tokenizer_config.json chat_template, chat_template.jinja or GGUF tokenizer.chat_template): use /v1/completions",
            )
            .with_code("chat_unavailable")),
            Chat::Broken(why) => Err(ApiError::bad(
                "messages",
                format!("chat is unavailable on this server: {why}; /v1/completions works"),
            )
            .with_code("chat_unavailable")),
        }
    }

    pub(super) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError {
                param: Some("model".into()),
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

    /// Sets the seed of a request that gave none: `--default-seed` (0 without it) for a
    /// greedy one, whose tokens no seed changes; else `--default-seed` or a fresh draw,
    /// which the response returns so that the sample can be replayed.
    pub(super) fn seed(&self, p: &mut super::api::Params) {
        if p.seeded {
            return;
        }
        p.sampling.seed = match self.default_seed {
            Some(s) => s,
            None if p.sampling.is_greedy() => 0,
            None => fresh_seed(),
        };
    }

    /// Compiles a request's constraint off the async threads (a large schema takes a
    /// while); None when it asked for none.
    pub(super) async fn compile(
        &self,
        req: Option<super::structured::Requested>,
    ) -> Result<Option<Arc<super::structured::Compiled>>, ApiError> {
        let Some(req) = req else {
            return Ok(None);
        };
        let engine = self.structured.clone();
        tokio::task::spawn_blocking(move || engine.compile(&req).map(Arc::new))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("compiling the output constraint failed: {e}"),
                )
            })?
            .map(Some)
    }

    pub(super) fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
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

    pub(super) fn tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub(super) fn tokenizer_config(&self) -> Option<&arbor_model::TokenizerConfig> {
        self.tokenizer_config.as_ref()
    }

    pub(super) fn vocab(&self) -> usize {
        self.vocab
    }

    pub(super) fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, true)
    }

    /// The text of `ids`, special tokens left out when `skip_special`.
    pub(super) fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(ids, skip_special).unwrap_or_default(),
            None => String::new(),
        }
    }

    pub(super) fn token_str(&self, id: u32) -> String {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_else(|| format!("<{id}>"))
    }

    pub(super) fn check_prompt(&self, prompt: &[u32], max_tokens: usize) -> Result<(), ApiError> {
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
}

/// The settings SGLang's `/get_server_info` reports, under its names where it has one.
fn server_info(args: &Args, runner: &dyn Runner, model_name: &str) -> serde_json::Value {
    let path = args.model.display().to_string();
    let kv_tokens = runner.kv_capacity().map_or(0, |c| c.tokens());
    serde_json::json!({
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": model_name,
        "tp_size": runner.tp(),
        "dp_size": 1,
        "pp_size": 1,
        "context_length": runner.max_seq_len(),
        "max_total_num_tokens": kv_tokens,
        "max_running_requests": args.max_num_seqs,
        "max_prefill_tokens": args.max_num_batched_tokens,
        "chunked_prefill_size": args.prefill_chunk,
        "page_size": arbor_kernels::paged::KV_BLOCK,
        "disable_radix_cache": args.kv.no_prefix_cache,
        "max_queue": args.max_queue,
        "device": format!("{:?}", args.device).to_lowercase(),
        "skip_tokenizer_init": false,
        "is_embedding": false,
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "arbor",
        // arbor's own key, and SGLang's name for the same promise: with invariant numerics
        // a prompt's output does not depend on load, batch or TP size.
        "numerics": args.numerics.resolve().as_str(),
        "enable_deterministic_inference":
            args.numerics.resolve() == crate::cli::model_api::Numerics::Invariant,
    })
}

/// A random seed below 2^53, so that it survives a JSON client that reads numbers as
/// doubles (JavaScript) and can be sent back as `seed`.
fn fresh_seed() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No OS randomness: the clock and a counter still give each request its own seed.
        static N: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        b = (t ^ N
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .to_le_bytes();
    }
    u64::from_le_bytes(b) & ((1 << 53) - 1)
}
