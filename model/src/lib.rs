//! arbor's model layer: HF configs and safetensors, sharded linear layers, the decoder
//! forward written once against `backend::Backend`, KV cache and seeded sampling.

pub mod backend;
pub mod batching;
pub mod checkpoint;
pub mod config;
pub mod constraint;
pub mod error;
pub mod forward;
pub mod generation_config;
pub mod gguf;
pub mod layers;
pub mod runner;
pub mod safetensors;
pub mod sampling;
pub mod synth;
pub mod tokenizer_config;
pub mod weights;

pub use backend::Numerics;
pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use generation_config::GenerationConfig;
pub use runner::{
    load, BatchWork, Device, FinishReason, GenOutput, GenRequest, KvCapacity, KvOptions,
    LoadOptions, ModelInfo, OfflineRunner, Runner, ScoreOutput, ScoreRequest, SessionRunner,
    StepBudget, UpdateMemory, WeightControl, Worker,
};
pub use safetensors::DType;
pub use sampling::{Sampling, TokenLogprob};
pub use synth::{
    make_model, make_model_with_progress, ConfigFormat, Preset, Progress, Shape, SynthOptions,
};
pub use tokenizer_config::{PromptEncoder, TokenizerConfig};
