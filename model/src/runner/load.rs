//! Loading: a rank's shard on the chosen device (and a TP=1 shadow if asked), its
//! tokenizer, generation config and context length, from a model directory or a GGUF
//! file ([`Checkpoint`]).

use std::sync::Arc;

use arbor_collective::Communicator;

use super::weights_update::Updates;
use super::{Device, GenTiming, LoadOptions, Runner, Worker};
use crate::backend::cpu::{default_threads, CpuBackend};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Numerics};
use crate::checkpoint::Checkpoint;
use crate::error::{MResult, ModelError};
use crate::forward::Model;
use crate::layers::LoadCtx;

/// Loads this rank's shard (TP = `comm.world_size()`).
pub fn load(opts: &LoadOptions, comm: Arc<dyn Communicator>) -> MResult<Box<dyn Runner>> {
    match opts.device {
        Device::Cpu if opts.numerics == Numerics::Fast => Err(ModelError::Unavailable(
            "--numerics fast needs --device cuda (cuBLAS and NCCL); the CPU backend has only the invariant kernels".into(),
        )),
        Device::Cpu => {
            if comm.rank() == 0 {
                note_ranks_per_gpu_on_cpu();
            }
            // An explicit ARBOR_CPU_THREADS wins; otherwise share the cores among the
            // ranks on this host.
            if std::env::var_os(arbor_kernels::cpu::THREADS_ENV).is_none() {
                arbor_kernels::cpu::set_num_threads(default_threads());
            }
            let mut engine = Worker::new(CpuBackend::new(comm), opts)?;
            if opts.shadow_tp1 {
                let shadow = Worker::new(
                    CpuBackend::new(Arc::new(arbor_collective::SingleComm)),
                    opts,
                )?;
                engine = engine.with_shadow(shadow);
            }
            if opts.kv.step.is_some() {
                engine.init_cache()?;
            }
            Ok(Box::new(engine))
        }
        Device::Cuda if opts.numerics == Numerics::Fast && opts.shadow_tp1 => {
            Err(ModelError::Unavailable(
                "--shadow-tp1 asserts bit-equality with TP 1, which --numerics fast does not promise"
                    .into(),
            ))
        }
        Device::Cuda => load_cuda(opts, comm),
    }
}

/// `arbor-launch --ranks-per-gpu` (`ARBOR_RANKS_PER_GPU`) places ranks on CUDA devices:
/// CPU ranks have none to share, so they say that the flag does nothing here.
fn note_ranks_per_gpu_on_cpu() {
    use arbor_collective::device_map::RANKS_PER_GPU_ENV;
    if let Some(v) = std::env::var_os(RANKS_PER_GPU_ENV).filter(|v| !v.is_empty()) {
        tracing::warn!(
            "{RANKS_PER_GPU_ENV}={} (arbor-launch --ranks-per-gpu) has no effect: it places ranks on CUDA devices, and these ranks run on the CPU",
            v.to_string_lossy()
        );
    }
}

/// Loads this rank's shard on its GPU (and a TP=1 shadow on the same GPU if asked).
fn load_cuda(
    opts: &LoadOptions,
    comm: Arc<dyn Communicator>,
) -> Result<Box<dyn Runner>, ModelError> {
    let rank = comm.rank();
    let backend = CudaBackend::new(comm, opts.numerics)
        .map_err(|source| ModelError::Backend { rank, source })?;
    let shadow = opts.shadow_tp1.then(|| backend.tp1_shadow());
    let mut engine = Worker::new(backend, opts)?;
    if let Some(shadow) = shadow {
        let shadow = Worker::new(shadow, opts)?;
        engine = engine.with_shadow(shadow);
    }
    if opts.kv.step.is_some() {
        engine.init_cache()?;
    }
    Ok(Box::new(engine))
}

impl<B: Backend> Worker<B> {
    /// Loads the model at `opts.model_dir` (a directory or a GGUF file) for `backend`'s
    /// rank and world size.
    pub fn new(backend: B, opts: &LoadOptions) -> MResult<Self> {
        let dir = &opts.model_dir;
        let Checkpoint {
            config: cfg,
            config_path,
            weights: store,
            tokenizer,
            tokenizer_config,
            generation_config,
        } = Checkpoint::open(dir)?;
        let max_seq_len = cfg.context_len(opts.max_seq_len, &config_path)?;
        let row_tp = match opts.rank_of_tp {
            None => backend.world_size(),
            Some(n) if backend.world_size() == 1 && arbor_kernels::tree::is_valid_world(n) => n,
            Some(n) => {
                return Err(ModelError::Sharding {
                    tp: backend.world_size(),
                    msg: format!(
                        "emulating one rank of TP {n} needs a single rank and a TP of 1, 2, 4 or 8"
                    ),
                })
            }
        };
        let ctx = LoadCtx {
            backend: &backend,
            store: &store,
            rank: backend.rank(),
            tp: backend.world_size(),
            row_tp,
        };
        let t0 = std::time::Instant::now();
        // The RoPE table waits for the KV cache, which bounds the context (`init_cache`).
        let model = Model::load(&ctx, &cfg, 0)?;
        tracing::info!(
            rank = ctx.rank,
            seconds = format!("{:.2}", t0.elapsed().as_secs_f64()),
            host_read_seconds = format!("{:.2}", store.read_seconds()),
            upload_wait_seconds = format!("{:.2}", backend.upload_wait_seconds()),
            tp = ctx.tp,
            device = %backend.device_name(),
            arch = %cfg.arch_name,
            layers = cfg.num_layers,
            "model loaded"
        );
        let mut eos_token_ids = cfg.eos_token_ids.clone();
        for id in generation_config.iter().flat_map(|g| &g.eos_token_ids) {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        let updates = Updates::new(store.tensors_read(), dir);
        Ok(Worker {
            tokenizer,
            tokenizer_config,
            generation_config,
            eos_token_ids,
            backend,
            cfg,
            model: Some(model),
            row_tp,
            updates,
            max_seq_len,
            kv_opts: opts.kv.clone(),
            step_asked: None,
            shadow: None,
            timing: GenTiming::default(),
            cache: None,
            kv_shape: None,
            session: false,
            offline_pool: None,
        })
    }

    /// Attaches a TP=1 copy (its backend of world size 1) that every step is compared with.
    pub fn with_shadow(mut self, shadow: Worker<B>) -> Self {
        self.shadow = Some(Box::new(shadow));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, MAX_POSITIONS};
    use crate::runner::{KvOptions, LoadOptions};
    use crate::synth::{make_model, Preset, Shape, SynthOptions};

    /// A model declaring the longest context arbor accepts, run with a cache of 8 blocks:
    /// the RoPE table holds the cache's 512 positions, not the declared 16 Mi (which took
    /// seconds and a GiB per rank, and 2^32 − 1 aborted the process).
    #[test]
    fn the_rope_table_follows_the_kv_cache_not_the_declared_context() {
        let dir = std::env::temp_dir().join(format!("arbor-rope-len-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shape = Shape {
            max_pos: MAX_POSITIONS,
            ..Preset::Tiny.shape(Arch::Llama)
        };
        make_model(&SynthOptions {
            shape: Some(shape),
            ..SynthOptions::new(Arch::Llama, Preset::Tiny, 3, &dir)
        })
        .unwrap();
        let opts = LoadOptions {
            model_dir: dir.clone(),
            device: Device::Cpu,
            max_seq_len: None,
            shadow_tp1: false,
            numerics: Numerics::Invariant,
            rank_of_tp: None,
            kv: KvOptions {
                blocks: Some(8),
                ..Default::default()
            },
        };
        let comm = Arc::new(arbor_collective::SingleComm);
        let t0 = std::time::Instant::now();
        let mut e = Worker::new(CpuBackend::new(comm), &opts).unwrap();
        e.init_cache().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let model = e.model.as_ref().unwrap();
        assert_eq!(model.rope_positions(), 8 * arbor_kernels::paged::KV_BLOCK);
        assert_eq!(e.kv_shape.as_ref().unwrap().max_seq_len, 512);
        assert!(t0.elapsed().as_secs_f64() < 5.0, "{:?}", t0.elapsed());
    }
}
