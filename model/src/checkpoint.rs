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

/// What a model path holds.
enum Kind {
    Gguf,
    Dir,
}

/// Whether `path` is a GGUF file or (anything else but a file) a model directory; a file
/// that is not GGUF is refused here, saying so, whichever route named it (`--model`, a
/// weight update), rather than failing later as a directory that is not one.
fn kind(path: &Path) -> MResult<Kind> {
    if is_gguf(path) {
        return Ok(Kind::Gguf);
    }
    if !path.is_file() {
        return Ok(Kind::Dir);
    }
    let mut head = Vec::new();
    let read = std::fs::File::open(path).and_then(|f| {
        use std::io::Read;
        f.take(4).read_to_end(&mut head)
    });
    let what = match read {
        Err(source) => {
            return Err(ModelError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
        Ok(0) => "it is empty".to_string(),
        Ok(_) => format!("it starts with {head:02x?}, not \"GGUF\""),
    };
    Err(ModelError::Gguf {
        path: path.to_path_buf(),
        msg: format!("not a GGUF file: {what} (a model is a GGUF file or a model directory)"),
    })
}

impl Checkpoint {
    /// Opens the model at `path`; the weights are read later, a shard at a time.
    pub fn open(path: &Path) -> MResult<Self> {
        match kind(path)? {
            Kind::Gguf => {
                let mut g = GgufModel::open(path)?;
                let (tokenizer, tokenizer_config) = g.tokenizer_parts();
                Ok(Checkpoint {
                    config: g.config,
                    config_path: path.to_path_buf(),
                    weights: WeightStore::gguf(g.weights),
                    tokenizer,
                    tokenizer_config,
                    generation_config: None,
                })
            }
            Kind::Dir => {
                let (config, config_path, weights) = open_dir_weights(path)?;
                Ok(Checkpoint {
                    config,
                    config_path,
                    weights,
                    tokenizer: load_tokenizer(path)?,
                    tokenizer_config: TokenizerConfig::from_dir(path)?,
                    generation_config: GenerationConfig::from_dir(path)?,
                })
            }
        }
    }
}

/// The config (and the file it came from) and the weights of the model at `path`, read
/// as [`Checkpoint::open`] reads them, with the same errors: what a weight update takes.
pub fn open_weights(path: &Path) -> MResult<(ModelConfig, PathBuf, WeightStore)> {
    match kind(path)? {
        Kind::Gguf => {
            let g = GgufModel::open(path)?;
            Ok((g.config, path.to_path_buf(), WeightStore::gguf(g.weights)))
        }
        Kind::Dir => open_dir_weights(path),
    }
}

fn open_dir_weights(dir: &Path) -> MResult<(ModelConfig, PathBuf, WeightStore)> {
    let config = ModelConfig::from_dir(dir)?;
    Ok((config, dir.join("config.json"), WeightStore::open(dir)?))
}

/// The config of the model at `path` and the file it came from, without the tokenizer or
/// the weights: what a check of the flags needs before anything loads.
pub fn read_config(path: &Path) -> MResult<(ModelConfig, PathBuf)> {
    match kind(path)? {
        Kind::Gguf => Ok((GgufModel::open(path)?.config, path.to_path_buf())),
        Kind::Dir => Ok((ModelConfig::from_dir(path)?, path.join("config.json"))),
    }
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
