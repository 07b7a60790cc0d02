//! `arbor._native.Model`: one model loaded by arbor's own loader as a TP group of one rank
//! in this process, scoring sequences on arbor's `Runner::score` path (what `arbor score`
//! runs) and taking new weights on the path `/update_weights_from_tensor` takes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use arbor_collective::{Communicator, SingleComm};
use arbor_model::batching::{ControlMsg, UpdateSource};
use arbor_model::runner::weights_update::run_control;
use arbor_model::runner::{
    load, BatchWork, Device, KvOptions, LoadOptions, Runner, ScoreRequest, StepBudget,
};
use arbor_model::{ModelConfig, Numerics};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{NResult, NativeError};
use crate::spec::config_dict;
use crate::tensors::{describe, safetensors_image};

/// The runner and the group it runs in.
struct Held {
    runner: Box<dyn Runner>,
    comm: Arc<dyn Communicator>,
    /// Weight updates applied since the load.
    updates: u64,
}

// SAFETY: `load` on `Device::Cpu` (the only device this module loads on) returns a
// `Worker<CpuBackend>`, whose fields (host buffers, an `Arc<dyn Communicator + Send + Sync>`,
// the tokenizer, plain data) are all `Send`; the trait object merely does not say so. The
// runner is only ever reached through the `Mutex` below, one thread at a time.
unsafe impl Send for Held {}

/// What the `unsafe impl Send for Held` above rests on: the CPU engine is `Send`.
const _: () = {
    const fn send<T: Send>() {}
    send::<arbor_model::runner::Worker<arbor_model::backend::cpu::CpuBackend>>();
};

/// Per sequence: its log-probs and the digests of its logits rows.
type Scores = (Vec<Vec<f32>>, Vec<Vec<u64>>);

#[pyclass(module = "arbor._native", name = "Model", frozen)]
pub struct Model {
    held: Mutex<Held>,
    path: PathBuf,
    cfg: ModelConfig,
    shapes: BTreeMap<String, Vec<usize>>,
}

/// `"cpu"`, or an error that says what is not there yet.
fn check_device(device: &str) -> NResult<Device> {
    match device {
        "cpu" => Ok(Device::Cpu),
        d if d == "cuda" || d.starts_with("cuda:") => Err(NativeError::NotYet(format!(
            "device {d:?}: the Python package runs arbor on the CPU only so far (the GPU engine \
             works from the CLI and `arbor serve`; its bits differ from the CPU's, so score on \
             the device your rollouts ran on)"
        ))),
        d => Err(NativeError::Input(format!(
            "device {d:?}: expected \"cpu\" (or, not yet, \"cuda\")"
        ))),
    }
}

/// Checks a batch before arbor sizes a step for it, so that a bad one is refused with its
/// own message rather than as a step that does not fit.
fn score_requests(
    sequences: Vec<Vec<i64>>,
    prompt_lens: &[usize],
    vocab: usize,
    max_len: usize,
) -> NResult<Vec<ScoreRequest>> {
    if sequences.len() != prompt_lens.len() {
        return Err(NativeError::Input(format!(
            "{} sequences but {} prompt lengths",
            sequences.len(),
            prompt_lens.len()
        )));
    }
    let mut reqs = Vec::with_capacity(sequences.len());
    for (i, (seq, &prompt_len)) in sequences.into_iter().zip(prompt_lens).enumerate() {
        if prompt_len == 0 || prompt_len > seq.len() {
            return Err(NativeError::Input(format!(
                "sequence {i}: prompt length {prompt_len} must be between 1 and the sequence length {}",
                seq.len()
            )));
        }
        if seq.len() > max_len {
            return Err(NativeError::Input(format!(
                "sequence {i}: {} tokens, longer than the context of {max_len} positions \
                 (load with a larger max_seq_len, up to the model's)",
                seq.len()
            )));
        }
        let mut tokens = Vec::with_capacity(seq.len());
        for (j, &t) in seq.iter().enumerate() {
            match u32::try_from(t) {
                Ok(t) if (t as usize) < vocab => tokens.push(t),
                _ => {
                    return Err(NativeError::Input(format!(
                        "sequence {i}: token id {t} at index {j} is outside the vocabulary (size {vocab})"
                    )))
                }
            }
        }
        reqs.push(ScoreRequest {
            id: i as u64,
            tokens,
            prompt_len,
        });
    }
    Ok(reqs)
}

impl Model {
    fn held(&self) -> NResult<MutexGuard<'_, Held>> {
        self.held
            .lock()
            .map_err(|e| NativeError::Poisoned(e.to_string()))
    }
}

#[pymethods]
impl Model {
    /// Loads the model at `path` (an HF directory or a GGUF file) as arbor's CLI does at
    /// TP 1; `max_seq_len` bounds the context (default: the model's).
    #[new]
    #[pyo3(signature = (path, device = "cpu", max_seq_len = None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        max_seq_len: Option<usize>,
    ) -> PyResult<Self> {
        let device = check_device(device)?;
        let opts = LoadOptions {
            model_dir: path.clone(),
            device,
            max_seq_len,
            shadow_tp1: false,
            numerics: Numerics::Invariant,
            rank_of_tp: None,
            // Made for each call's work, as an offline command does (`score`).
            kv: KvOptions {
                step: None,
                ..KvOptions::default()
            },
        };
        // One rank: whatever launcher variables the trainer runs under, arbor's group here
        // is this process alone.
        let comm: Arc<dyn Communicator> = Arc::new(SingleComm);
        let held = py
            .detach(|| {
                load(&opts, comm.clone()).map(|runner| Held {
                    runner,
                    comm,
                    updates: 0,
                })
            })
            .map_err(NativeError::from)?;
        let cfg = held.runner.config().clone();
        let shapes = held.runner.weight_shapes();
        Ok(Model {
            held: Mutex::new(held),
            path,
            cfg,
            shapes,
        })
    }

    /// The checkpoint this model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The model's configuration as arbor read it (the fields a forward needs).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.cfg)
    }

    /// The longest sequence `score` takes (the context, at most what the KV cache holds).
    #[getter]
    fn max_seq_len(&self) -> PyResult<usize> {
        Ok(self.held()?.runner.max_seq_len())
    }

    /// Weight updates applied since the load.
    #[getter]
    fn updates(&self) -> PyResult<u64> {
        Ok(self.held()?.updates)
    }

    /// Every tensor the model reads, by HF name, with its shape: what `update_weights`
    /// must be given.
    fn weight_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.shapes.clone()
    }

    /// Teacher-forced log-probs: for each sequence, `log p(tokens[t] | tokens[:t])` for
    /// `t` in `prompt_len..len`, with the 64-bit digest of each full logits row, exactly
    /// as `arbor score` computes them (one static batch; the batch changes no bit).
    /// Errors name the sequence by its index.
    fn score(
        &self,
        py: Python<'_>,
        sequences: Vec<Vec<i64>>,
        prompt_lens: Vec<usize>,
    ) -> PyResult<Scores> {
        let max_len = self.held()?.runner.max_seq_len();
        let reqs = score_requests(sequences, &prompt_lens, self.cfg.vocab_size, max_len)?;
        if reqs.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let work = BatchWork {
            rows: reqs.iter().map(|r| r.tokens.len()).sum(),
            outputs: reqs.iter().map(|r| r.tokens.len() - r.prompt_len).sum(),
            seqs: reqs.len(),
            longest: reqs.iter().map(|r| r.tokens.len()).max().unwrap_or(1),
        };
        let outs = py.detach(|| -> NResult<_> {
            let mut held = self.held()?;
            held.runner
                .reserve_steps(StepBudget::for_batches([work], None))?;
            Ok(held.runner.score(&reqs, 0)?)
        })?;
        Ok(outs
            .into_iter()
            .map(|o| (o.logprobs, o.logits_digest))
            .unzip())
    }

    /// Replaces the weights with `tensors` (pairs of an HF name and a CPU torch tensor of
    /// bf16, f16 or f32; every tensor the model reads), on the path of
    /// `/update_weights_from_tensor`: staged, checked (names, shapes, finite values), cut
    /// into arbor's bf16 weights, swapped in; on any error nothing changes. Returns the
    /// seconds it took.
    fn update_weights(
        &self,
        py: Python<'_>,
        tensors: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<f64> {
        let t0 = Instant::now();
        // A safetensors header is a JSON object: a name given twice would silently keep
        // one of the two.
        let mut seen = std::collections::HashSet::new();
        if let Some((name, _)) = tensors.iter().find(|(n, _)| !seen.insert(n.as_str())) {
            return Err(NativeError::Input(format!("tensor {name:?} is given twice")).into());
        }
        let described = tensors
            .iter()
            .map(|(name, t)| describe(name, t))
            .collect::<NResult<Vec<_>>>()?;
        // The tensors are read under the GIL (no Python code can free them meanwhile);
        // the checks and the conversion run without it.
        let image = safetensors_image(&described);
        drop(described);
        py.detach(|| -> NResult<()> {
            let mut held = self.held()?;
            let comm = held.comm.clone();
            let stage = ControlMsg::Stage {
                label: "tensors pushed from torch".into(),
                bytes: image,
            };
            run_control(held.runner.as_mut(), comm.as_ref(), stage)??;
            let update = ControlMsg::Update(UpdateSource::Staged);
            run_control(held.runner.as_mut(), comm.as_ref(), update)??;
            held.updates += 1;
            Ok(())
        })?;
        Ok(t0.elapsed().as_secs_f64())
    }

    fn __repr__(&self) -> String {
        format!(
            "arbor._native.Model({:?}, arch={}, layers={}, hidden={}, vocab={})",
            self.path.display().to_string(),
            self.cfg.arch_name,
            self.cfg.num_layers,
            self.cfg.hidden_size,
            self.cfg.vocab_size
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_batches_are_refused_by_index() {
        let e = score_requests(vec![vec![1, 2]], &[1, 1], 10, 8).unwrap_err();
        assert!(
            e.to_string().contains("1 sequences but 2 prompt lengths"),
            "{e}"
        );
        let e = score_requests(vec![vec![1, 2], vec![3, 10]], &[1, 1], 10, 8).unwrap_err();
        assert!(
            e.to_string().contains("sequence 1: token id 10 at index 1"),
            "{e}"
        );
        let e = score_requests(vec![vec![-1]], &[1], 10, 8).unwrap_err();
        assert!(e.to_string().contains("token id -1"), "{e}");
        let e = score_requests(vec![vec![1; 9]], &[1], 10, 8).unwrap_err();
        assert!(
            e.to_string()
                .contains("9 tokens, longer than the context of 8"),
            "{e}"
        );
        let e = score_requests(vec![vec![1, 2]], &[0], 10, 8).unwrap_err();
        assert!(e.to_string().contains("prompt length 0"), "{e}");
        let ok = score_requests(vec![vec![1, 2, 3]], &[2], 10, 8).unwrap();
        assert_eq!((ok[0].prompt_len, ok[0].tokens.clone()), (2, vec![1, 2, 3]));
    }
}
