//! `arbor._native`: arbor's runner inside a Python process. A model loads with arbor's
//! own loader (HF directory or GGUF file) as a TP group of one rank, scores sequences on
//! the path `arbor score` runs, and takes new weights from torch tensors on the path
//! `/update_weights_from_tensor` takes. `arbor.torch` builds its module on top of it.

mod cuda_ops;
mod error;
mod model;
mod ops;
mod spec;
mod tensors;

use std::collections::BTreeMap;
use std::path::PathBuf;

use arbor_model::checkpoint::Checkpoint;
use half::bf16;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::error::{NResult, NativeError};

/// One tensor of `store`, whole, as the bf16 values arbor computes with.
fn read_whole(
    store: &arbor_model::weights::WeightStore,
    name: &str,
    shape: &[usize],
) -> NResult<Vec<u8>> {
    let values: Vec<bf16> = match *shape {
        [n] => store
            .vector(name, n, 0..n)?
            .into_iter()
            // Exact: `vector` widens bf16 values to f32.
            .map(bf16::from_f32)
            .collect(),
        [n, k] => store.rows(name, n, k, 0..n)?,
        _ => {
            return Err(NativeError::Input(format!(
                "tensor {name:?}: shape {shape:?}; arbor's models hold vectors and matrices only"
            )))
        }
    };
    Ok(values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect())
}

/// Reads the tensors `shapes` names from the checkpoint at `path` (an HF directory or a
/// GGUF file) whole, as the bf16 values arbor computes with (f16 / f32 rounded, GGUF
/// blocks dequantized): `{name: bytearray}` of little-endian bf16, each of its shape.
#[pyfunction]
fn read_checkpoint<'py>(
    py: Python<'py>,
    path: PathBuf,
    shapes: BTreeMap<String, Vec<usize>>,
) -> PyResult<Bound<'py, PyDict>> {
    let store = py
        .detach(|| Checkpoint::open(&path).map(|c| c.weights))
        .map_err(NativeError::from)?;
    let out = PyDict::new(py);
    for (name, shape) in &shapes {
        let bytes = py.detach(|| read_whole(&store, name, shape))?;
        out.set_item(name, PyByteArray::new(py, &bytes))?;
    }
    Ok(out)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<model::Model>()?;
    m.add_class::<spec::ModelSpec>()?;
    m.add_class::<cuda_ops::CudaOps>()?;
    for f in [
        wrap_pyfunction!(ops::tree_linear, m)?,
        wrap_pyfunction!(ops::rms_norm, m)?,
        wrap_pyfunction!(ops::silu_mul, m)?,
        wrap_pyfunction!(ops::moe_route, m)?,
        wrap_pyfunction!(ops::attention, m)?,
        wrap_pyfunction!(ops::token_logprobs, m)?,
        wrap_pyfunction!(ops::logits_digest, m)?,
    ] {
        m.add_function(f)?;
    }
    m.add_function(wrap_pyfunction!(read_checkpoint, m)?)?;
    m.add("ArborError", py.get_type::<error::ArborError>())?;
    m.add("CheckpointError", py.get_type::<error::CheckpointError>())?;
    m.add("InvalidInput", py.get_type::<error::InvalidInput>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
