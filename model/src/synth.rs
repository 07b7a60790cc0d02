//! Random-weight models in real Hugging Face format (config.json, safetensors, a
//! tokenizer.json), deterministic from a seed. Tensors are generated and written one
//! chunk at a time, so even the 8B-shaped presets never sit in memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::json;

use crate::config::Arch;
use crate::error::{MResult, ModelError};
use crate::safetensors::{build_header, DType};

/// Shards of real-shape checkpoints stay under this size (as HF does, ~5 GB).
pub const DEFAULT_SHARD_BYTES: usize = 5 << 30;

/// Token ids of the synthetic tokenizer: 256 byte tokens, then these two.
pub const SYNTH_BOS: u32 = 256;
pub const SYNTH_EOS: u32 = 257;
/// Number of tokens the synthetic tokenizer knows.
pub const SYNTH_TOKENIZER_VOCAB: usize = 258;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Llama3_8b,
    Qwen3_8b,
    /// Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (~61 GB of bf16).
    Qwen3_30bA3b,
    /// Mixtral-8x7B: 32 layers of 8 experts, 2 per token (~93 GB of bf16).
    Mixtral8x7b,
}

/// The shape of a synthetic model (what config.json will say).
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_pos: usize,
    pub rope_theta: f64,
    pub llama3_rope_scaling: bool,
    pub tie_word_embeddings: bool,
    /// attention_bias and mlp_bias (Llama only: Qwen2 always has q/k/v biases, Qwen3
    /// none).
    pub bias: bool,
    pub rms_norm_eps: f64,
    /// The experts of a mixture-of-experts model (Qwen3-MoE, Mixtral).
    pub moe: Option<MoeShape>,
}

/// The experts of a synthetic mixture-of-experts model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    pub experts: usize,
    pub top_k: usize,
    /// One expert's intermediate width (Mixtral's config calls it `intermediate_size`).
    pub intermediate: usize,
    /// The first layers keep a dense MLP of `Shape::intermediate` (Qwen3-MoE's
    /// `mlp_only_layers`; Mixtral has no such key, so 0 there).
    pub dense_layers: usize,
}

/// Whether layer `i` of a synthetic `arch` model of shape `s` has experts.
fn sparse_layer(arch: Arch, s: &Shape, i: usize) -> bool {
    arch.is_moe() && s.moe.is_some_and(|m| i >= m.dense_layers)
}

impl Shape {
    /// The shape one rank of a TP=`tp` group computes: query heads, KV heads (one
    /// replicated head when there are fewer than `tp`), the intermediate size and the
    /// vocabulary (the head's padded block) divided by `tp`; hidden size, head_dim and
    /// layers unchanged. A TP=1 run of it does a rank's GEMMs, attention and head without
    /// the collectives: a rank's compute, measured on one GPU.
    pub fn per_rank(&self, tp: usize) -> Result<Shape, String> {
        if !arbor_kernels::tree::is_valid_world(tp) {
            return Err(format!("TP {tp}: must be 1, 2, 4 or 8"));
        }
        if !self.heads.is_multiple_of(tp) || !self.intermediate.is_multiple_of(tp) {
            return Err(format!(
                "{} attention heads and intermediate size {} are not both divisible by TP {tp}",
                self.heads, self.intermediate
            ));
        }
        let moe = match self.moe {
            Some(m) if !m.intermediate.is_multiple_of(tp) => {
                return Err(format!(
                    "an expert's intermediate size {} is not divisible by TP {tp}",
                    m.intermediate
                ))
            }
            Some(m) => Some(MoeShape {
                intermediate: m.intermediate / tp,
                ..m
            }),
            None => None,
        };
        let kv_heads = if self.kv_heads >= tp {
            if !self.kv_heads.is_multiple_of(tp) {
                return Err(format!(
                    "{} KV heads are not divisible by TP {tp}",
                    self.kv_heads
                ));
            }
            self.kv_heads / tp
        } else {
            1
        };
        Ok(Shape {
            heads: self.heads / tp,
            kv_heads,
            intermediate: self.intermediate / tp,
            vocab: self.vocab.div_ceil(tp),
            moe,
            ..*self
        })
    }
}

impl Preset {
    pub fn shape(self, arch: Arch) -> Shape {
        match (self, arch) {
            // intermediate 344 = 8·43: segments of 43 columns, not a multiple of the
            // kernels' lane width; vocab 258 is padded at TP 4 and 8.
            (Preset::Tiny, Arch::Llama) => Shape {
                hidden: 128,
                layers: 4,
                heads: 8,
                kv_heads: 4,
                head_dim: 16,
                intermediate: 344,
                vocab: SYNTH_TOKENIZER_VOCAB,
                max_pos: 2048,
                rope_theta: 500000.0,
                llama3_rope_scaling: true,
                tie_word_embeddings: false,
                bias: false,
                rms_norm_eps: 1e-5,
                moe: None,
            },
            // head_dim 32 ≠ hidden/heads, tied embeddings: Qwen3-0.6B's traits.
            (Preset::Tiny, Arch::Qwen3) => Shape {
                hidden: 128,
                layers: 4,
                heads: 8,
                kv_heads: 4,
                head_dim: 32,
                intermediate: 344,
                vocab: SYNTH_TOKENIZER_VOCAB,
                max_pos: 2048,
                rope_theta: 1000000.0,
                llama3_rope_scaling: false,
                tie_word_embeddings: true,
                bias: false,
                rms_norm_eps: 1e-6,
                moe: None,
            },
            // Tied embeddings and fewer KV heads than TP 8 has ranks (replicated there):
            // Qwen2.5-0.5B's traits, with heads that split over TP 8.
            (Preset::Tiny, Arch::Qwen2) => Shape {
                kv_heads: 2,
                head_dim: 16,
                ..Preset::Tiny.shape(Arch::Qwen3)
            },
            // 8 experts, 2 per token, narrow enough that a rank of TP 8 holds 8 columns of
            // each; layer 0 keeps a dense MLP; untied embeddings, as Qwen3-30B-A3B's.
            (Preset::Tiny, Arch::Qwen3Moe) => Shape {
                tie_word_embeddings: false,
                moe: Some(MoeShape {
                    experts: 8,
                    top_k: 2,
                    intermediate: 64,
                    dense_layers: 1,
                }),
                ..Preset::Tiny.shape(Arch::Qwen3)
            },
            (Preset::Tiny, Arch::Mixtral) => Shape {
                rope_theta: 1000000.0,
                llama3_rope_scaling: false,
                moe: Some(MoeShape {
                    experts: 8,
                    top_k: 2,
                    intermediate: 64,
                    dense_layers: 0,
                }),
                ..Preset::Tiny.shape(Arch::Llama)
            },
            // Qwen3-30B-A3B's config.json: every layer sparse, untied embeddings.
            (Preset::Qwen3_30bA3b, _) => Shape {
                hidden: 2048,
                layers: 48,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                intermediate: 6144,
                vocab: 151936,
                max_pos: 40960,
                rope_theta: 1000000.0,
                llama3_rope_scaling: false,
                tie_word_embeddings: false,
                bias: false,
                rms_norm_eps: 1e-6,
                moe: Some(MoeShape {
                    experts: 128,
                    top_k: 8,
                    intermediate: 768,
                    dense_layers: 0,
                }),
            },
            // Mixtral-8x7B-v0.1's config.json.
            (Preset::Mixtral8x7b, _) => Shape {
                hidden: 4096,
                layers: 32,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                intermediate: 14336,
                vocab: 32000,
                max_pos: 32768,
                rope_theta: 1000000.0,
                llama3_rope_scaling: false,
                tie_word_embeddings: false,
                bias: false,
                rms_norm_eps: 1e-5,
                moe: Some(MoeShape {
                    experts: 8,
                    top_k: 2,
                    intermediate: 14336,
                    dense_layers: 0,
                }),
            },
            (Preset::Llama3_8b, _) => Shape {
                hidden: 4096,
                layers: 32,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                intermediate: 14336,
                vocab: 128256,
                max_pos: 131072,
                rope_theta: 500000.0,
                llama3_rope_scaling: true,
                tie_word_embeddings: false,
                bias: false,
                rms_norm_eps: 1e-5,
                moe: None,
            },
            (Preset::Qwen3_8b, _) => Shape {
                hidden: 4096,
                layers: 36,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                intermediate: 12288,
                vocab: 151936,
                max_pos: 40960,
                rope_theta: 1000000.0,
                llama3_rope_scaling: false,
                tie_word_embeddings: false,
                bias: false,
                rms_norm_eps: 1e-6,
                moe: None,
            },
        }
    }

    /// The architecture a preset implies (`Tiny` works for both).
    pub fn natural_arch(self) -> Option<Arch> {
        match self {
            Preset::Tiny => None,
            Preset::Llama3_8b => Some(Arch::Llama),
            Preset::Qwen3_8b => Some(Arch::Qwen3),
            Preset::Qwen3_30bA3b => Some(Arch::Qwen3Moe),
            Preset::Mixtral8x7b => Some(Arch::Mixtral),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SynthOptions {
    pub arch: Arch,
    pub preset: Preset,
    pub seed: u64,
    pub out_dir: PathBuf,
    /// On-disk dtype; bf16 by default.
    pub dtype: Option<DType>,
    /// Replaces the preset's shape (tests use this for edge cases).
    pub shape: Option<Shape>,
    /// Largest shard file; above it the checkpoint is split with an index.
    pub shard_bytes: Option<usize>,
    /// Which transformers generation's config.json to write.
    pub config_format: ConfigFormat,
}

/// The two config.json generations: transformers 4 (`rope_theta` + `rope_scaling`,
/// `torch_dtype`) and 5 (`rope_parameters`, `dtype`, Qwen3's `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConfigFormat {
    #[default]
    Transformers4,
    Transformers5,
}

impl SynthOptions {
    pub fn new(arch: Arch, preset: Preset, seed: u64, out_dir: impl Into<PathBuf>) -> Self {
        SynthOptions {
            arch,
            preset,
            seed,
            out_dir: out_dir.into(),
            dtype: None,
            shape: None,
            shard_bytes: None,
            config_format: ConfigFormat::default(),
        }
    }
}

/// Progress of [`make_model_with_progress`]: bytes written so far of the total.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub tensor: &'a str,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// Uniform with this standard deviation around 0.
    Uniform(f64),
    /// Uniform in `[center - spread, center + spread]`.
    Around(f64, f64),
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

fn specs(arch: Arch, s: &Shape) -> Vec<Spec> {
    let mut v = Vec::new();
    let mut t = |name: String, shape: Vec<usize>, init: Init| v.push(Spec { name, shape, init });
    let h = s.hidden;
    let q = s.heads * s.head_dim;
    let kv = s.kv_heads * s.head_dim;
    let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f64).sqrt());
    let norm = Init::Around(1.0, 0.2);
    t(
        "model.embed_tokens.weight".into(),
        vec![s.vocab, h],
        Init::Uniform(1.0),
    );
    for i in 0..s.layers {
        let p = format!("model.layers.{i}");
        t(format!("{p}.input_layernorm.weight"), vec![h], norm);
        t(format!("{p}.self_attn.q_proj.weight"), vec![q, h], lin(h));
        t(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], lin(h));
        t(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], lin(h));
        t(format!("{p}.self_attn.o_proj.weight"), vec![h, q], lin(q));
        if arch == Arch::Qwen2 {
            for (n, len) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                t(
                    format!("{p}.self_attn.{n}.bias"),
                    vec![len],
                    Init::Uniform(0.1),
                );
            }
        }
        if s.bias && arch == Arch::Llama {
            for (n, len) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)] {
                t(
                    format!("{p}.self_attn.{n}.bias"),
                    vec![len],
                    Init::Uniform(0.1),
                );
            }
        }
        if arch.has_qk_norm() {
            t(
                format!("{p}.self_attn.q_norm.weight"),
                vec![s.head_dim],
                norm,
            );
            t(
                format!("{p}.self_attn.k_norm.weight"),
                vec![s.head_dim],
                norm,
            );
        }
        t(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            norm,
        );
        match s.moe.filter(|_| sparse_layer(arch, s, i)) {
            Some(m) => {
                // The router's logits are spread like a linear layer's; the experts are
                // the dense MLP's shape at their own width.
                let (block, [gate, up, down]) = crate::config::checkpoint_names(arch);
                t(
                    format!("{p}.{block}.gate.weight"),
                    vec![m.experts, h],
                    lin(h),
                );
                for e in 0..m.experts {
                    let x = format!("{p}.{block}.experts.{e}");
                    t(
                        format!("{x}.{gate}.weight"),
                        vec![m.intermediate, h],
                        lin(h),
                    );
                    t(format!("{x}.{up}.weight"), vec![m.intermediate, h], lin(h));
                    t(
                        format!("{x}.{down}.weight"),
                        vec![h, m.intermediate],
                        lin(m.intermediate),
                    );
                }
            }
            None => {
                t(
                    format!("{p}.mlp.gate_proj.weight"),
                    vec![s.intermediate, h],
                    lin(h),
                );
                t(
                    format!("{p}.mlp.up_proj.weight"),
                    vec![s.intermediate, h],
                    lin(h),
                );
                t(
                    format!("{p}.mlp.down_proj.weight"),
                    vec![h, s.intermediate],
                    lin(s.intermediate),
                );
            }
        }
        if s.bias && arch == Arch::Llama {
            for (n, len) in [
                ("gate_proj", s.intermediate),
                ("up_proj", s.intermediate),
                ("down_proj", h),
            ] {
                t(format!("{p}.mlp.{n}.bias"), vec![len], Init::Uniform(0.1));
            }
        }
    }
    // With tied embeddings (std 1 rows) the logits would scale with sqrt(hidden); the
    // final norm compensates so the next-token distribution stays soft.
    let final_norm = if s.tie_word_embeddings {
        Init::Around(2.0 / (h as f64).sqrt(), 0.0)
    } else {
        norm
    };
    t("model.norm.weight".into(), vec![h], final_norm);
    if !s.tie_word_embeddings {
        t(
            "lm_head.weight".into(),
            vec![s.vocab, h],
            Init::Uniform(2.0 / (h as f64).sqrt()),
        );
    }
    v
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_key(seed: u64, name: &str) -> u64 {
    let mut h = splitmix64(seed);
    for b in name.bytes() {
        h = splitmix64(h ^ b as u64);
    }
    h
}

/// Value `i` of a tensor: a pure function of (seed, name, i).
fn value(key: u64, i: u64, init: Init) -> f32 {
    let u = (splitmix64(key.wrapping_add(i)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64); // [0,1)
    match init {
        Init::Uniform(std) => ((2.0 * u - 1.0) * std * 3f64.sqrt()) as f32,
        Init::Around(c, spread) => (c + (2.0 * u - 1.0) * spread) as f32,
    }
}

fn encode(x: f32, dtype: DType, out: &mut Vec<u8>) {
    match dtype {
        DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes()),
        DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Writes the model; logs progress through `tracing`.
pub fn make_model(opts: &SynthOptions) -> MResult<()> {
    let mut last = 0u64;
    make_model_with_progress(opts, &mut |p| {
        if p.done_bytes == p.total_bytes || p.done_bytes >= last + (1 << 30) {
            last = p.done_bytes;
            tracing::info!(
                written = p.done_bytes,
                total = p.total_bytes,
                tensor = p.tensor,
                "make-model"
            );
        }
    })
}

/// Writes the model, calling `progress` after every chunk written.
pub fn make_model_with_progress(
    opts: &SynthOptions,
    progress: &mut dyn FnMut(Progress),
) -> MResult<()> {
    let shape = opts
        .shape
        .clone()
        .unwrap_or_else(|| opts.preset.shape(opts.arch));
    if shape.vocab < SYNTH_TOKENIZER_VOCAB {
        return Err(ModelError::Synth(format!(
            "vocab {} is smaller than the synthetic tokenizer's {SYNTH_TOKENIZER_VOCAB} tokens",
            shape.vocab
        )));
    }
    if shape.heads == 0
        || shape.kv_heads == 0
        || !shape.heads.is_multiple_of(shape.kv_heads)
        || !shape.head_dim.is_multiple_of(2)
    {
        return Err(ModelError::Synth(format!(
            "heads {} / kv_heads {} / head_dim {} are not a valid attention shape",
            shape.heads, shape.kv_heads, shape.head_dim
        )));
    }
    if shape.layers == 0 {
        return Err(ModelError::Synth("a model of 0 layers".into()));
    }
    if let Some(m) = shape.moe.filter(|_| opts.arch.is_moe()) {
        if m.experts == 0 || m.top_k == 0 || m.top_k > m.experts || m.intermediate == 0 {
            return Err(ModelError::Synth(format!(
                "{} experts, {} per token, of width {}: not a mixture of experts",
                m.experts, m.top_k, m.intermediate
            )));
        }
        if opts.arch == Arch::Mixtral && m.dense_layers > 0 {
            return Err(ModelError::Synth(format!(
                "{} dense layers: a Mixtral config cannot say which layers are dense",
                m.dense_layers
            )));
        }
    }
    let dir = &opts.out_dir;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let dtype = opts.dtype.unwrap_or(DType::BF16);

    write_json(
        &dir.join("config.json"),
        &config_json(opts.arch, &shape, dtype, opts.config_format),
    )?;
    write_json(&dir.join("tokenizer.json"), &tokenizer_json())?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": SYNTH_BOS, "eos_token_id": SYNTH_EOS, "do_sample": false}),
    )?;

    let specs = specs(opts.arch, &shape);
    let size = |s: &Spec| s.shape.iter().product::<usize>() * dtype.size();
    let total: usize = specs.iter().map(size).sum();
    let limit = opts.shard_bytes.unwrap_or(DEFAULT_SHARD_BYTES).max(1);
    // Consecutive tensors grouped into files of at most `limit` bytes (a larger tensor
    // gets a file of its own).
    let mut groups: Vec<Vec<&Spec>> = vec![Vec::new()];
    let mut cur = 0usize;
    for s in &specs {
        let n = size(s);
        if cur > 0 && cur + n > limit {
            groups.push(Vec::new());
            cur = 0;
        }
        cur += n;
        if let Some(g) = groups.last_mut() {
            g.push(s);
        }
    }
    let names: Vec<String> = if groups.len() == 1 {
        vec!["model.safetensors".into()]
    } else {
        (1..=groups.len())
            .map(|i| format!("model-{i:05}-of-{:05}.safetensors", groups.len()))
            .collect()
    };
    let mut done = 0u64;
    let mut weight_map = serde_json::Map::new();
    for (group, fname) in groups.iter().zip(&names) {
        let path = dir.join(fname);
        let entries: Vec<(String, DType, Vec<usize>)> = group
            .iter()
            .map(|s| (s.name.clone(), dtype, s.shape.clone()))
            .collect();
        let (header, _) = build_header(&entries);
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&path).map_err(io(&path))?);
        w.write_all(&header).map_err(io(&path))?;
        let mut buf = Vec::with_capacity(1 << 20);
        for s in group {
            weight_map.insert(s.name.clone(), json!(fname));
            let key = name_key(opts.seed, &s.name);
            let n = s.shape.iter().product::<usize>() as u64;
            const CHUNK: u64 = 1 << 18;
            let mut i = 0u64;
            while i < n {
                let end = (i + CHUNK).min(n);
                buf.clear();
                for j in i..end {
                    encode(value(key, j, s.init), dtype, &mut buf);
                }
                w.write_all(&buf).map_err(io(&path))?;
                done += buf.len() as u64;
                progress(Progress {
                    tensor: &s.name,
                    done_bytes: done,
                    total_bytes: total as u64,
                });
                i = end;
            }
        }
        w.flush().map_err(io(&path))?;
    }
    if groups.len() > 1 {
        write_json(
            &dir.join("model.safetensors.index.json"),
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> MResult<()> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| ModelError::Synth(format!("{}: {e}", path.display())))?;
    std::fs::write(path, text).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn config_json(arch: Arch, s: &Shape, dtype: DType, format: ConfigFormat) -> serde_json::Value {
    let torch_dtype = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
    };
    let mut c = json!({
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_pos,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": s.tie_word_embeddings,
        "bos_token_id": SYNTH_BOS,
        "eos_token_id": SYNTH_EOS,
        "initializer_range": 0.02,
        "torch_dtype": torch_dtype,
        "use_cache": true,
    });
    // A mixture-of-experts architecture without experts in its shape: one, always chosen.
    let m = s.moe.unwrap_or(MoeShape {
        experts: 1,
        top_k: 1,
        intermediate: s.intermediate,
        dense_layers: 0,
    });
    match arch {
        Arch::Llama => {
            c["architectures"] = json!(["LlamaForCausalLM"]);
            c["model_type"] = json!("llama");
            c["attention_bias"] = json!(s.bias);
            c["mlp_bias"] = json!(s.bias);
            c["pretraining_tp"] = json!(1);
            c["rope_scaling"] = if s.llama3_rope_scaling {
                json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"})
            } else {
                serde_json::Value::Null
            };
        }
        Arch::Qwen2 => {
            c["architectures"] = json!(["Qwen2ForCausalLM"]);
            c["model_type"] = json!("qwen2");
            c["rope_scaling"] = serde_json::Value::Null;
            c["sliding_window"] = json!(s.max_pos);
            c["use_sliding_window"] = json!(false);
            c["max_window_layers"] = json!(s.layers);
        }
        Arch::Qwen3Moe => {
            c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
            c["model_type"] = json!("qwen3_moe");
            c["attention_bias"] = json!(false);
            c["rope_scaling"] = serde_json::Value::Null;
            c["sliding_window"] = serde_json::Value::Null;
            c["use_sliding_window"] = json!(false);
            c["max_window_layers"] = json!(s.layers);
            c["num_experts"] = json!(m.experts);
            c["num_experts_per_tok"] = json!(m.top_k);
            c["moe_intermediate_size"] = json!(m.intermediate);
            c["norm_topk_prob"] = json!(true);
            c["decoder_sparse_step"] = json!(1);
            c["mlp_only_layers"] = json!((0..m.dense_layers.min(s.layers)).collect::<Vec<_>>());
            c["router_aux_loss_coef"] = json!(0.001);
            c["output_router_logits"] = json!(false);
        }
        Arch::Mixtral => {
            c["architectures"] = json!(["MixtralForCausalLM"]);
            c["model_type"] = json!("mixtral");
            c["intermediate_size"] = json!(m.intermediate);
            c["rope_scaling"] = serde_json::Value::Null;
            c["sliding_window"] = serde_json::Value::Null;
            c["num_local_experts"] = json!(m.experts);
            c["num_experts_per_tok"] = json!(m.top_k);
            c["router_aux_loss_coef"] = json!(0.02);
            c["output_router_logits"] = json!(false);
            c["router_jitter_noise"] = json!(0.0);
        }
        Arch::Qwen3 => {
            c["architectures"] = json!(["Qwen3ForCausalLM"]);
            c["model_type"] = json!("qwen3");
            c["attention_bias"] = json!(false);
            c["rope_scaling"] = serde_json::Value::Null;
            c["sliding_window"] = serde_json::Value::Null;
            c["use_sliding_window"] = json!(false);
            c["max_window_layers"] = json!(s.layers);
        }
    }
    if format == ConfigFormat::Transformers5 {
        to_transformers5(&mut c, arch, s.layers);
    }
    c
}

/// Rewrites a transformers-4 config the way transformers 5's `save_pretrained` writes it.
fn to_transformers5(c: &mut serde_json::Value, arch: Arch, layers: usize) {
    let Some(obj) = c.as_object_mut() else {
        return;
    };
    let theta = obj.remove("rope_theta").unwrap_or(json!(10000.0));
    let mut rope = match obj.remove("rope_scaling") {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::from_iter([("rope_type".to_string(), json!("default"))]),
    };
    rope.insert("rope_theta".into(), theta);
    obj.insert("rope_parameters".into(), serde_json::Value::Object(rope));
    if let Some(d) = obj.remove("torch_dtype") {
        obj.insert("dtype".into(), d);
    }
    obj.insert("pad_token_id".into(), serde_json::Value::Null);
    if matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe) {
        obj.insert("layer_types".into(), json!(vec!["full_attention"; layers]));
    }
    // transformers 5 names Qwen3-MoE's expert count as Mixtral does.
    if let Some(n) = obj.remove("num_experts") {
        obj.insert("num_local_experts".into(), n);
    }
}

/// GPT-2's byte-to-character map: every byte gets a printable character.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut map = vec!['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    printable.clear();
    map
}

/// A byte-level BPE with the 256 byte tokens and no merges (so any text encodes), plus
/// BOS and EOS.
fn tokenizer_json() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (i, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(SYNTH_BOS, "<|begin_of_text|>"), special(SYNTH_EOS, "<|end_of_text|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": []
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_shape_divides_heads_intermediate_and_vocab() {
        let full = Preset::Llama3_8b.shape(Arch::Llama);
        let r = full.per_rank(4).unwrap();
        assert_eq!(
            (r.hidden, r.layers, r.heads, r.kv_heads, r.head_dim),
            (4096, 32, 8, 2, 128)
        );
        assert_eq!((r.intermediate, r.vocab), (3584, 32064));
        assert_eq!(full.per_rank(1).unwrap(), full);
        // Fewer KV heads than ranks: one replicated head, as the sharding does.
        let tiny = Preset::Tiny.shape(Arch::Llama);
        let mut few = tiny.clone();
        few.kv_heads = 2;
        few.heads = 8;
        few.intermediate = 64;
        assert_eq!(few.per_rank(8).unwrap().kv_heads, 1);
        assert!(full.per_rank(3).unwrap_err().contains("TP 3"));
        let mut odd = full.clone();
        odd.heads = 6;
        assert!(odd.per_rank(4).unwrap_err().contains("6 attention heads"));
        // The experts are cut like the dense MLP.
        let moe = Preset::Qwen3_30bA3b.shape(Arch::Qwen3Moe);
        let r = moe.per_rank(8).unwrap();
        let m = r.moe.unwrap();
        assert_eq!((m.experts, m.top_k, m.intermediate), (128, 8, 96));
        assert_eq!((r.heads, r.kv_heads, r.intermediate), (4, 1, 768));
        let mut bad = moe.clone();
        bad.moe = Some(MoeShape {
            intermediate: 100,
            ..m
        });
        assert!(bad
            .per_rank(8)
            .unwrap_err()
            .contains("expert's intermediate size 100"));
    }

    /// The real MoE presets' configs read back as the published models' (expert counts,
    /// widths, every layer sparse), here with 2 of their layers, as `make-model --layers 2`
    /// writes them; the tensors' names and shapes are those the loader asks for.
    #[test]
    fn moe_presets_write_the_published_shapes() {
        for (preset, arch, want) in [
            (Preset::Qwen3_30bA3b, Arch::Qwen3Moe, (128, 8, 768, true)),
            (Preset::Mixtral8x7b, Arch::Mixtral, (8, 2, 14336, true)),
        ] {
            assert_eq!(preset.natural_arch(), Some(arch));
            let shape = Shape {
                layers: 2,
                ..preset.shape(arch)
            };
            let c = config_json(arch, &shape, DType::BF16, ConfigFormat::Transformers4);
            let cfg = crate::config::ModelConfig::from_json_str(
                &c.to_string(),
                &crate::config::in_memory_path(),
            )
            .unwrap();
            let m = cfg.moe.clone().unwrap();
            assert_eq!(
                (
                    m.num_experts,
                    m.top_k,
                    m.expert_intermediate,
                    m.norm_topk_prob
                ),
                want
            );
            assert_eq!(m.sparse_layers, vec![true, true]);
            assert_eq!(cfg.num_layers, 2);
            let specs = specs(arch, &shape);
            let (block, down) = match arch {
                Arch::Mixtral => ("block_sparse_moe", "w2"),
                _ => ("mlp", "down_proj"),
            };
            let e = m.num_experts;
            let has = |name: String| specs.iter().any(|s| s.name == name);
            let last = format!("model.layers.1.{block}.experts.{}.{down}.weight", e - 1);
            assert!(has(last.clone()), "{last}");
            assert!(!has(format!(
                "model.layers.1.{block}.experts.{e}.{down}.weight"
            )));
            assert!(!specs.iter().any(|s| s.name.contains("mlp.down_proj")));
        }
        // The tiny Qwen3-MoE keeps its first layer dense.
        let tiny = Preset::Tiny.shape(Arch::Qwen3Moe);
        let c = config_json(
            Arch::Qwen3Moe,
            &tiny,
            DType::BF16,
            ConfigFormat::Transformers4,
        );
        assert_eq!(c["mlp_only_layers"], json!([0]));
    }

    #[test]
    fn bad_synthetic_shapes_are_refused() {
        let dir = std::env::temp_dir().join(format!("arbor-synth-bad-{}", std::process::id()));
        let try_shape = |arch: Arch, shape: Shape| {
            make_model(&SynthOptions {
                shape: Some(shape),
                ..SynthOptions::new(arch, Preset::Tiny, 0, &dir)
            })
            .unwrap_err()
            .to_string()
        };
        let tiny = Preset::Tiny.shape(Arch::Mixtral);
        let m = tiny.moe.unwrap();
        let e = try_shape(
            Arch::Mixtral,
            Shape {
                moe: Some(MoeShape {
                    dense_layers: 1,
                    ..m
                }),
                ..tiny.clone()
            },
        );
        assert!(e.contains("1 dense layers"), "{e}");
        let e = try_shape(
            Arch::Mixtral,
            Shape {
                moe: Some(MoeShape { top_k: 9, ..m }),
                ..tiny.clone()
            },
        );
        assert!(e.contains("8 experts, 9 per token"), "{e}");
        let e = try_shape(Arch::Mixtral, Shape { layers: 0, ..tiny });
        assert!(e.contains("0 layers"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
