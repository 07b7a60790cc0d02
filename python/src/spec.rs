//! `arbor._native.ModelSpec`: a checkpoint's configuration as arbor reads it (HF directory
//! or GGUF file), without its weights, and the RoPE table arbor builds from it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arbor_kernels::cpu::RopeTable;
use arbor_model::checkpoint::open_weights;
use arbor_model::config::Arch;
use arbor_model::safetensors::DType;
use arbor_model::ModelConfig;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::error::{NResult, NativeError};
use crate::ops::{operand, Place};

fn arch_name(a: Arch) -> &'static str {
    match a {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        Arch::Qwen3Moe => "qwen3_moe",
        Arch::Mixtral => "mixtral",
    }
}

/// The fields of `c` a forward needs, as a dict.
pub fn config_dict<'py>(py: Python<'py>, c: &ModelConfig) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("arch", arch_name(c.arch))?;
    d.set_item("arch_name", &c.arch_name)?;
    d.set_item("hidden_size", c.hidden_size)?;
    d.set_item("intermediate_size", c.intermediate_size)?;
    d.set_item("num_layers", c.num_layers)?;
    d.set_item("num_heads", c.num_heads)?;
    d.set_item("num_kv_heads", c.num_kv_heads)?;
    d.set_item("head_dim", c.head_dim)?;
    d.set_item("vocab_size", c.vocab_size)?;
    d.set_item("rms_norm_eps", c.rms_norm_eps)?;
    d.set_item("rope_theta", c.rope_theta)?;
    d.set_item("max_position_embeddings", c.max_position_embeddings)?;
    d.set_item("tie_word_embeddings", c.tie_word_embeddings)?;
    d.set_item("qkv_bias", c.qkv_bias)?;
    d.set_item("o_bias", c.o_bias)?;
    d.set_item("mlp_bias", c.mlp_bias)?;
    d.set_item("qk_norm", c.arch.has_qk_norm())?;
    d.set_item("bos_token_id", c.bos_token_id)?;
    d.set_item("eos_token_ids", c.eos_token_ids.clone())?;
    match &c.moe {
        Some(m) => {
            let moe = PyDict::new(py);
            moe.set_item("num_experts", m.num_experts)?;
            moe.set_item("top_k", m.top_k)?;
            moe.set_item("expert_intermediate", m.expert_intermediate)?;
            moe.set_item("norm_topk_prob", m.norm_topk_prob)?;
            // Per layer, as the engine reads `decoder_sparse_step` and `mlp_only_layers`.
            moe.set_item("sparse_layers", m.sparse_layers.clone())?;
            d.set_item("moe", moe)?;
        }
        None => d.set_item("moe", py.None())?,
    }
    Ok(d)
}

#[pyclass(module = "arbor._native", name = "ModelSpec", frozen)]
pub struct ModelSpec {
    path: PathBuf,
    cfg: ModelConfig,
    /// The RoPE table for the longest run so far. Entry (p, i) depends on p and i alone,
    /// so a larger table gives the same values to the positions a smaller one had.
    rope: Mutex<Option<Arc<RopeTable>>>,
}

impl ModelSpec {
    pub(crate) fn head_dim(&self) -> usize {
        self.cfg.head_dim
    }

    /// A table holding positions `0..positions`: the held one, or a new one of at least
    /// twice its size (at most the model's context).
    pub(crate) fn table(&self, positions: usize) -> NResult<Arc<RopeTable>> {
        let c = &self.cfg;
        if positions > c.max_position_embeddings {
            return Err(NativeError::Input(format!(
                "position {} is beyond the model's context of {} positions (max_position_embeddings)",
                positions - 1,
                c.max_position_embeddings
            )));
        }
        let mut held = self
            .rope
            .lock()
            .map_err(|e| NativeError::Poisoned(e.to_string()))?;
        if let Some(t) = held.as_ref().filter(|t| t.max_pos >= positions) {
            return Ok(t.clone());
        }
        let have = held.as_ref().map_or(0, |t| t.max_pos);
        let size = positions
            .max(2 * have)
            .max(256)
            .min(c.max_position_embeddings);
        let t = RopeTable::try_new(c.head_dim, size, c.rope_theta, c.rope_scaling)
            .map_err(|e| NativeError::Input(e.to_string()))?;
        let t = Arc::new(t);
        *held = Some(t.clone());
        Ok(t)
    }
}

#[pymethods]
impl ModelSpec {
    /// Reads the configuration of the checkpoint at `path` (an HF directory or a GGUF
    /// file) as arbor's loader does; the weights are not read.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let (cfg, _, _) = py
            .detach(|| open_weights(&path))
            .map_err(NativeError::from)?;
        Ok(ModelSpec {
            path,
            cfg,
            rope: Mutex::new(None),
        })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The model's configuration as arbor read it (the fields a forward needs).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.cfg)
    }

    /// Rotates `x` (f32 `[rows, n_heads·head_dim]`, in place) with arbor's RoPE: row i at
    /// position `positions[i]`, every scaling schedule the config names folded in.
    fn rope(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        positions: Vec<usize>,
        n_heads: usize,
    ) -> PyResult<()> {
        const OP: &str = "rope";
        let m = operand(OP, "x", x, DType::F32, 2, Place::Cpu)?;
        let hd = self.cfg.head_dim;
        if m.shape != [positions.len(), n_heads * hd] {
            return Err(NativeError::Input(format!(
                "{OP}: x has shape {:?}, expected [{}, {n_heads} heads × {hd}]",
                m.shape,
                positions.len()
            ))
            .into());
        }
        let table = self.table(positions.iter().max().map_or(0, |&p| p + 1))?;
        py.detach(|| {
            // SAFETY: `x` is an argument of this call (alive), a checked contiguous CPU f32
            // tensor of this shape, and the only tensor the call touches.
            let xs = unsafe { m.slice_mut::<f32>() };
            table.apply(xs, n_heads, &positions);
        });
        Ok(())
    }

    /// arbor's RoPE table for positions `0..positions`: `(cos, sin)`, each
    /// `positions × head_dim/2` little-endian f32.
    fn rope_table<'py>(
        &self,
        py: Python<'py>,
        positions: usize,
    ) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
        let t = self.table(positions)?;
        let half = self.cfg.head_dim / 2;
        let bytes = |v: &[f32]| -> Vec<u8> {
            v[..positions * half]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect()
        };
        Ok((
            PyByteArray::new(py, &bytes(&t.cos)),
            PyByteArray::new(py, &bytes(&t.sin)),
        ))
    }

    fn __repr__(&self) -> String {
        format!(
            "arbor._native.ModelSpec({:?}, arch={}, layers={}, hidden={}, vocab={})",
            self.path.display().to_string(),
            self.cfg.arch_name,
            self.cfg.num_layers,
            self.cfg.hidden_size,
            self.cfg.vocab_size
        )
    }
}
