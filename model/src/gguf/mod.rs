//! GGUF files (llama.cpp's format) as arbor checkpoints: `--model FILE.gguf` loads the
//! weights (dequantized to bf16 at load), the config, the tokenizer and the chat template
//! from the one file.
//!
//! - `reader`: the container, validated against the file's size;
//! - `dequant`: the GGML types and their dequantization;
//! - `config`: metadata -> the config.json transformers would have;
//! - `tensors`: GGUF tensor names -> HF names, q/k rows back in HF's RoPE order, a
//!   mixture-of-experts layer's stacked experts as one matrix per expert;
//! - `tokenizer`: the vocabulary, merges and special tokens -> tokenizer.json.

pub mod config;
pub mod dequant;
pub mod reader;
pub mod spm;
pub mod tensors;
pub mod tokenizer;

use std::path::Path;

pub use config::GgufArch;
pub use reader::{is_gguf, GgufFile, MetaValue};
pub use tensors::GgufWeights;

use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::tokenizer_config::TokenizerConfig;

/// Everything a GGUF file holds, in arbor's terms.
pub struct GgufModel {
    pub config: ModelConfig,
    pub config_json: serde_json::Value,
    pub weights: GgufWeights,
    pub tokenizer: Option<tokenizer::GgufTokenizer>,
}

impl GgufModel {
    pub fn open(path: &Path) -> MResult<Self> {
        let file = GgufFile::open(path)?;
        let rope_freqs = match file.tensors.get("rope_freqs.weight") {
            None => None,
            Some(info) => {
                let mut v = Vec::new();
                dequant::dequantize(info.ty, file.data(info), &mut v).map_err(|msg| {
                    ModelError::Gguf {
                        path: path.to_path_buf(),
                        msg: format!("tensor \"rope_freqs.weight\": {msg}"),
                    }
                })?;
                Some(v)
            }
        };
        let cfg = config::read(&file, rope_freqs.as_deref())?;
        let tokenizer = tokenizer::read(&file, cfg.config.vocab_size)?;
        let weights = GgufWeights::new(
            file,
            cfg.arch,
            cfg.config.num_heads,
            cfg.config.num_kv_heads,
            cfg.config
                .moe
                .as_ref()
                .map(|m| tensors::MoeNames::new(cfg.config.arch, m.num_experts)),
        )?;
        tracing::info!(
            gguf = %path.display(),
            arch = cfg.arch.name(),
            layers = cfg.config.num_layers,
            tokenizer = tokenizer.is_some(),
            "GGUF model read"
        );
        Ok(GgufModel {
            config: cfg.config,
            config_json: cfg.config_json,
            weights,
            tokenizer,
        })
    }

    /// The tokenizer and its config, split for the runner.
    pub fn tokenizer_parts(&mut self) -> (Option<tokenizers::Tokenizer>, Option<TokenizerConfig>) {
        match self.tokenizer.take() {
            None => (None, None),
            Some(t) => (Some(t.tokenizer), Some(t.config)),
        }
    }
}

#[cfg(test)]
mod testfile;

#[cfg(test)]
mod tests;
