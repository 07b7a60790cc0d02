//! What `--model PATH` names: a Hugging Face directory (config.json, safetensors,
//! tokenizer files) or a GGUF file. Either way the runner gets the same parts.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::generation_config::GenerationConfig;
use crate::gguf::{is_gguf, GgufModel};
use crate::tokenizer_config::TokenizerConfig;
use crate::weights::WeightStore;

pub struct Checkpoint {
    pub config: ModelConfig,
    /// The file the config came from, for messages (config.json, or the GGUF file).
    pub config_path: PathBuf,
    pub weights: WeightStore,
    pub tokenizer: Option<tokenizers::Tokenizer>,
    pub tokenizer_config: Option<TokenizerConfig>,
    pub generation_config: Option<GenerationConfig>,
}

/// Whether `path` looks like something `--model` takes: a directory with config.json,
/// or a GGUF file.
pub fn is_model(path: &Path) -> bool {
    path.join("config.json").is_file() || is_gguf(path)
}

/// Whether the model at `path` can turn text into ids (a directory's tokenizer.json, or
/// a GGUF file's tokenizer metadata).
pub fn has_tokenizer(path: &Path) -> bool {
    if path.join("tokenizer.json").is_file() {
        return true;
    }
    is_gguf(path)
        && crate::gguf::GgufFile::open(path).is_ok_and(|f| {
            f.get("tokenizer.ggml.model")
                .and_then(crate::gguf::MetaValue::as_str)
                .is_some_and(|m| !matches!(m, "none" | "no_vocab"))
        })
}

impl Checkpoint {
    /// Opens the model at `path`; the weights are read later, a shard at a time.
    pub fn open(path: &Path) -> MResult<Self> {
        if is_gguf(path) {
            let mut g = GgufModel::open(path)?;
            let (tokenizer, tokenizer_config) = g.tokenizer_parts();
            return Ok(Checkpoint {
                config: g.config,
                config_path: path.to_path_buf(),
                weights: WeightStore::gguf(g.weights),
                tokenizer,
                tokenizer_config,
                generation_config: None,
            });
        }
        if path.is_file() {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                msg: "a file that is not GGUF (it does not start with \"GGUF\"); --model takes a GGUF file or a model directory".into(),
            });
        }
        Ok(Checkpoint {
            config: ModelConfig::from_dir(path)?,
            config_path: path.join("config.json"),
            weights: WeightStore::open(path)?,
            tokenizer: load_tokenizer(path)?,
            tokenizer_config: TokenizerConfig::from_dir(path)?,
            generation_config: GenerationConfig::from_dir(path)?,
        })
    }
}

/// The config of the model at `path` and the file it came from, without the tokenizer or
/// the weights: what a check of the flags needs before anything loads.
pub fn read_config(path: &Path) -> MResult<(ModelConfig, PathBuf)> {
    if is_gguf(path) {
        return Ok((GgufModel::open(path)?.config, path.to_path_buf()));
    }
    Ok((ModelConfig::from_dir(path)?, path.join("config.json")))
}

/// Reads `<dir>/tokenizer.json` if present.
pub fn load_tokenizer(dir: &Path) -> MResult<Option<tokenizers::Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    tokenizers::Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| ModelError::Tokenizer {
            path,
            msg: e.to_string(),
        })
}
