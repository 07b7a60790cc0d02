//! Every way loading or running a model can fail; each variant names the file, tensor,
//! rank or value that was wrong.

use std::path::PathBuf;

use crate::backend::error::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("config {path}: unknown architecture {arch:?} (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM)")]
    UnknownArch { path: PathBuf, arch: String },
    #[error("GGUF {path}: {msg}")]
    Gguf { path: PathBuf, msg: String },
    #[error("safetensors {path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("tensor {tensor:?} not found in the checkpoint under {dir}")]
    MissingTensor { dir: PathBuf, tensor: String },
    #[error("tensor {tensor:?} in {path}: shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {tensor:?} in {path}: dtype {dtype} not supported (bf16, f16, f32 are)")]
    DtypeUnsupported {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("model cannot be split over TP={tp}: {msg}")]
    Sharding { tp: usize, msg: String },
    #[error(
        "request {id}: token id {token} at index {index} is outside the vocabulary (size {vocab})"
    )]
    TokenOutOfVocab {
        id: u64,
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error("request {id}: needs {needed} positions but the context holds {max} (prompt {prompt_len} tokens)")]
    ContextTooLong {
        id: u64,
        needed: usize,
        max: usize,
        prompt_len: usize,
    },
    #[error("request {id}: {msg}")]
    BadRequest { id: u64, msg: String },
    #[error("invalid sampling parameters: {0}")]
    BadSampling(String),
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("backend error (rank {rank}): {source}")]
    Backend {
        rank: usize,
        #[source]
        source: BackendError,
    },
    #[error("shadow TP=1 check failed on rank {rank}: {what} differs at position {position} (request {id}), max |difference| {max_abs_diff:e}")]
    ShadowDivergence {
        rank: usize,
        what: String,
        position: usize,
        id: u64,
        max_abs_diff: f32,
    },
    #[error("{0}")]
    Unavailable(String),
    /// A trainer's store that cannot be reached, or holds no usable NCCL id in time.
    #[error("{0}")]
    Rendezvous(String),
    #[error("step plan: {0}")]
    Plan(String),
    #[error("synthetic model: {0}")]
    Synth(String),
}

pub type MResult<T> = Result<T, ModelError>;
