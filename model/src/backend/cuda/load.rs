//! Opening a rank's GPU: the device, the GEMM choice, the collectives, the profiler
//! and step recording; the TP=1 shadow on the same device.

use std::sync::{Arc, Mutex};

use arbor_collective::gpu::Algo;
use arbor_collective::Communicator;
use arbor_kernels::cuda::cublas::Blas;
use arbor_kernels::cuda::GpuDevice;

use super::collective::{allreduce_algo, gpu_collective};
use super::gemm::{GemmKind, TensorGemm};
use super::graphs::{self, Graphs};
use super::profile::Profiler;
use super::CudaBackend;
use crate::backend::{BackendError, Numerics};

/// The GPU ordinal of this rank: `LOCAL_RANK`, else the rank.
fn ordinal_for(rank: usize) -> Result<usize, String> {
    match std::env::var("LOCAL_RANK") {
        Ok(s) => s
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("LOCAL_RANK={s:?} is not a GPU index")),
        Err(_) => Ok(rank),
    }
}

impl CudaBackend {
    /// Opens this rank's GPU and, at TP > 1, joins the NCCL group (collective: every rank
    /// of `comm` must call it).
    pub fn new(comm: Arc<dyn Communicator>, numerics: Numerics) -> Result<Self, BackendError> {
        let rank = comm.rank();
        let err = |msg: String| BackendError::Device { rank, msg };
        // Checked before the device is opened, so a bad value is reported on any machine.
        let kind = GemmKind::from_env().map_err(err)?;
        let ordinal = ordinal_for(rank).map_err(err)?;
        let dev = GpuDevice::open(ordinal).map_err(|e| err(e.to_string()))?;
        let (major, _) = dev
            .ctx
            .compute_capability()
            .map_err(|e| err(format!("cuDeviceGetAttribute(compute capability): {e}")))?;
        let kind = kind.resolve(major);
        tracing::info!(rank, gemm = ?kind, "CUDA backend linear layers");
        let algo =
            allreduce_algo(std::env::var("ARBOR_GPU_ALLREDUCE").ok().as_deref()).map_err(err)?;
        let gemm = match kind {
            GemmKind::Simple | GemmKind::Auto => None,
            GemmKind::Tensor => Some(TensorGemm::new(&dev).map_err(|e| err(e.to_string()))?),
        };
        let coll = if comm.world_size() > 1 {
            Some(gpu_collective(&comm, &dev, algo).map_err(err)?)
        } else {
            None
        };
        let blas = match numerics {
            Numerics::Invariant => None,
            Numerics::Fast => Some(Blas::new(&dev.stream).map_err(err)?),
        };
        tracing::info!(rank, numerics = numerics.as_str(), "CUDA backend numerics");
        let prof = Profiler::from_env(rank);
        let graphs = graphs::enabled(std::env::var(graphs::ENV).ok().as_deref()).map_err(err)?;
        if graphs && prof.is_some() {
            tracing::info!(
                rank,
                "ARBOR_PROFILE synchronises every op: decode steps are not recorded as graphs"
            );
        }
        let backend = Self {
            comm,
            dev: Arc::new(dev),
            coll,
            algo,
            rope: Mutex::new(None),
            gemm,
            blas,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(graphs && prof.is_none())),
            prof,
        };
        backend.warm_up_collectives()?;
        Ok(backend)
    }

    /// A world-size-1 backend on an already opened device, with the simple GEMM and no
    /// recorded steps.
    pub fn solo(dev: Arc<GpuDevice>) -> Self {
        Self {
            comm: Arc::new(arbor_collective::SingleComm),
            dev,
            coll: None,
            algo: Algo::AllGatherTree,
            rope: Mutex::new(None),
            gemm: None,
            blas: None,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(false)),
            prof: None,
        }
    }

    /// The TP=1 shadow of this backend: world size 1 on the same device, the same GEMM
    /// choice (sharing its compiled kernels, with scratch buffers of its own).
    pub fn tp1_shadow(&self) -> Self {
        Self {
            gemm: self.gemm.as_ref().map(TensorGemm::sibling),
            ..Self::solo(self.dev.clone())
        }
    }
}
