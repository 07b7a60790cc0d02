//! Opening a rank's GPU: the device, the GEMM choice, the collectives, the profiler
//! and step recording; the TP=1 shadow on the same device.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use arbor_collective::device_map::{self, DeviceSlot, RanksPerGpu};
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

/// This rank's GPU ([`device_map`]): its local rank (`LOCAL_RANK`, or the MPI / Slurm
/// equivalent) within CUDA_VISIBLE_DEVICES, or local rank / N with `ARBOR_RANKS_PER_GPU=N`.
fn device_slot() -> Result<DeviceSlot, String> {
    let visible = arbor_kernels::cuda::probe::driver().map_err(|e| e.to_string())?;
    device_map::from_env(visible).map_err(|e| e.to_string())
}

/// The tensor-core GEMM when `kind` resolves to it on `dev`'s architecture (None: the
/// simple kernel).
pub(super) fn linear_kernel(
    dev: &GpuDevice,
    kind: GemmKind,
    rank: usize,
) -> Result<Option<TensorGemm>, String> {
    let (major, _) = dev
        .ctx
        .compute_capability()
        .map_err(|e| format!("cuDeviceGetAttribute(compute capability): {e}"))?;
    let kind = kind.resolve(major);
    tracing::info!(rank, gemm = ?kind, "CUDA backend linear layers");
    match kind {
        GemmKind::Simple | GemmKind::Auto => Ok(None),
        GemmKind::Tensor => TensorGemm::new(dev).map(Some).map_err(|e| e.to_string()),
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
        super::gemm::PadRows::from_env().map_err(err)?;
        let allow_shared = RanksPerGpu::from_env().map_err(err)?.allows_sharing();
        let slot = device_slot().map_err(err)?;
        let dev = GpuDevice::open(slot.ordinal).map_err(|e| err(e.to_string()))?;
        let gemm = linear_kernel(&dev, kind, rank).map_err(err)?;
        let algo =
            allreduce_algo(std::env::var("ARBOR_GPU_ALLREDUCE").ok().as_deref()).map_err(err)?;
        let coll = if comm.world_size() > 1 {
            Some(gpu_collective(&comm, &dev, algo, allow_shared).map_err(err)?)
        } else {
            None
        };
        if let Some(c) = coll.as_ref().filter(|c| c.shared()) {
            let on_mine = c.sharing().groups.get(rank).map_or(1, Vec::len);
            tracing::info!(
                rank,
                ordinal = slot.ordinal,
                ranks_on_gpu = on_mine,
                allreduce = algo.name(),
                "ranks share GPUs: all-gathers staged through the host (a recorded decode \
                 step holds them as memcpy and host nodes)"
            );
            if numerics == Numerics::Fast && rank == 0 {
                tracing::warn!(
                    "--numerics fast with ranks sharing a GPU: NCCL cannot run there, so its \
                     all-reduce is replaced by the tree through the host"
                );
            }
        }
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
            slot,
            dev: Arc::new(dev),
            coll,
            algo,
            rope: Mutex::new(None),
            gemm,
            blas,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(graphs && prof.is_none())),
            prof,
            host_reads: AtomicU64::new(0),
            handoff: Mutex::new(None),
        };
        backend.warm_up_collectives()?;
        Ok(backend)
    }

    /// A world-size-1 backend on an already opened device, with the simple GEMM and no
    /// recorded steps.
    pub fn solo(dev: Arc<GpuDevice>) -> Self {
        Self {
            comm: Arc::new(arbor_collective::SingleComm),
            slot: DeviceSlot {
                ordinal: dev.ordinal,
                ranks_per_gpu: 1,
                ranks_on_device: 1,
            },
            dev,
            coll: None,
            algo: Algo::AllGatherTree,
            rope: Mutex::new(None),
            gemm: None,
            blas: None,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(false)),
            prof: None,
            host_reads: AtomicU64::new(0),
            handoff: Mutex::new(None),
        }
    }

    /// The TP=1 shadow of this backend: world size 1 on the same device, the same GEMM
    /// choice (sharing its compiled kernels, with scratch buffers of its own).
    pub fn tp1_shadow(&self) -> Self {
        let mut shadow = Self::solo(self.dev.clone());
        shadow.gemm = self.gemm.as_ref().map(TensorGemm::sibling);
        shadow.slot = self.slot;
        shadow
    }
}
