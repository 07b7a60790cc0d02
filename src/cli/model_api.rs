//! The model-core interface the CLI is written against: `arbor_model`'s runner API and
//! synthetic-model writer, in one place so the subcommands name one module.

pub use arbor_model::batching::scheduler::{
    DEFAULT_PREFILL_BESIDE_DECODE, DEFAULT_ROW_MULTIPLE, DEFAULT_STEP_OUTPUTS, DEFAULT_STEP_TOKENS,
};
pub use arbor_model::runner::capacity::DEFAULT_GPU_MEMORY_UTILIZATION;
pub use arbor_model::runner::{
    load, BatchWork, Device, FinishReason, GenOutput, GenRequest, KvOptions, LoadOptions, Runner,
    ScoreRequest, StepBudget, UpdateMemory,
};
pub use arbor_model::synth::{
    make_model_with_progress, ConfigFormat, Preset, Progress, SynthOptions,
};
pub use arbor_model::{Arch, Numerics, Sampling, TokenLogprob};
