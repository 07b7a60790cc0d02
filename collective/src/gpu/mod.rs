//! The deterministic GPU all-reduce of the invariance contract.
//!
//! # API (for the CUDA backend)
//!
//! ```text
//! // once per rank, collectively, after the host Communicator is up:
//! let coll = GpuCollective::new(host.clone(), stream.clone())?;
//! // row-parallel layers: partial = this rank's f32 subtree roots, [rows * cols]
//! let full: CudaSlice<f32> = coll.tree_all_reduce(&partial)?;          // new buffer
//! coll.tree_all_reduce_into(Algo::Auto, &partial, &mut out)?;          // into `out`
//! // raw pointers (in place allowed: src == dst), e.g. inside CUDA-graph capture:
//! unsafe { coll.all_reduce_raw(Algo::Auto, src_ptr, dst_ptr, n, Dtype::F32) }?;
//! ```
//!
//! Every algorithm returns, on every rank, exactly the bits of
//! `arbor_kernels::tree::combine_roots` over the ranks' inputs in rank order:
//! `((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7))` in f32; bf16 inputs are widened, combined in f32,
//! and rounded once. World sizes 1, 2, 4, 8.
//!
//! - [`Algo::AllGatherTree`]: NCCL all-gather of the inputs, then the tree as a kernel.
//!   Works for any length and alignment; the fallback.
//! - [`Algo::OneShot`]: each rank reads all peers' inputs over NVLink (CUDA IPC) and sums
//!   them; one barrier. For small messages.
//! - [`Algo::TwoShot`]: rank c reduces chunk c from all peers, then every rank reads the
//!   reduced chunks: ring-like traffic. For large messages.
//! - [`Algo::Auto`]: picks one of the above by size and world size ([`select`]); the choice
//!   is the same on every rank.
//! - [`Algo::Nvls`]: refused unless asked for by name, allowed by `NCCL_NVLS_ENABLE`, and
//!   supported by the device; the transport itself is not implemented ([`nvls`]).
//!
//! All work goes on the stream given at construction; nothing here synchronises it, so
//! calls can be captured in a CUDA graph once the scratch buffer of the all-gather
//! algorithm is large enough ([`GpuCollective::reserve`]). IPC algorithms need 16-byte
//! aligned pointers and a length that is a multiple of 4 f32 / 8 bf16, and at most
//! `ipc_capacity_bytes`; `Auto` falls back to the all-gather otherwise.

pub mod driver;
pub mod error;
pub mod ipc;
pub mod kernels;
pub mod mem;
pub mod nvls;
pub mod reference;
pub mod select;

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    result as dres, sys as dsys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

use crate::nccl::{Dtype, NcclComm};
use crate::Communicator;
pub use driver::probe_driver;
pub use error::GpuError;
use ipc::{IpcBuffers, Mapped, Peers, DATA_OFFSET};
use kernels::{Kernels, MAX_BLOCKS};
use mem::DeviceBuf;
pub use select::{select, Fit, Thresholds};

/// The all-reduce algorithms; all give the tree's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Algo {
    Auto,
    AllGatherTree,
    OneShot,
    TwoShot,
    Nvls,
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::AllGatherTree => "allgather-tree",
            Algo::OneShot => "oneshot",
            Algo::TwoShot => "twoshot",
            Algo::Nvls => "nvls",
        }
    }
}

impl std::str::FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Algo::Auto),
            "allgather-tree" | "allgather" | "tree" => Ok(Algo::AllGatherTree),
            "oneshot" | "one-shot" => Ok(Algo::OneShot),
            "twoshot" | "two-shot" => Ok(Algo::TwoShot),
            "nvls" => Ok(Algo::Nvls),
            other => Err(format!(
                "unknown all-reduce algorithm '{other}' (auto, allgather-tree, oneshot, twoshot, nvls)"
            )),
        }
    }
}

/// Construction options.
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Largest message (bytes per rank) the IPC algorithms take; 0 disables IPC.
    pub ipc_capacity_bytes: usize,
    pub thresholds: Thresholds,
    /// Grid caps (blocks of 512 threads) of the one-shot and two-shot kernels.
    pub oneshot_blocks: usize,
    pub twoshot_blocks: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self {
            ipc_capacity_bytes: 64 << 20,
            thresholds: Thresholds::default(),
            oneshot_blocks: 64,
            twoshot_blocks: MAX_BLOCKS,
        }
    }
}

const THREADS: u32 = 512;

/// A caller's allocation mapped on every rank (see [`GpuCollective::register_buffer`]).
struct UserBuf {
    base: u64,
    bytes: usize,
    mapped: Mapped,
}

/// One rank's deterministic GPU collective.
pub struct GpuCollective {
    host: Arc<dyn Communicator>,
    stream: Arc<CudaStream>,
    nccl: NcclComm,
    kernels: Kernels,
    ipc: Option<IpcBuffers>,
    scratch: Mutex<Option<DeviceBuf>>,
    /// Scratch buffers outgrown by a later call: a recorded graph may still point at one,
    /// so they live as long as the collective.
    retired: Mutex<Vec<DeviceBuf>>,
    registered: Mutex<Vec<UserBuf>>,
    opts: GpuOptions,
    rank: usize,
    world: usize,
}

impl GpuCollective {
    /// Collective over `host`: every rank calls it with a stream on its own GPU.
    pub fn new(host: Arc<dyn Communicator>, stream: Arc<CudaStream>) -> Result<Self, GpuError> {
        Self::with_options(host, stream, GpuOptions::default())
    }

    pub fn with_options(
        host: Arc<dyn Communicator>,
        stream: Arc<CudaStream>,
        opts: GpuOptions,
    ) -> Result<Self, GpuError> {
        crate::nccl::probe_nccl()?;
        let rank = host.rank();
        let world = host.world_size();
        if !arbor_kernels::tree::is_valid_world(world) {
            return Err(GpuError::Invalid {
                rank,
                msg: format!("world size {world}: the tree all-reduce needs 1, 2, 4 or 8 ranks"),
            });
        }
        if opts.oneshot_blocks == 0
            || opts.oneshot_blocks > MAX_BLOCKS
            || opts.twoshot_blocks == 0
            || opts.twoshot_blocks > MAX_BLOCKS
        {
            return Err(GpuError::Invalid {
                rank,
                msg: format!(
                    "grid caps {} / {} blocks: each must be in 1..={MAX_BLOCKS}",
                    opts.oneshot_blocks, opts.twoshot_blocks
                ),
            });
        }
        let ctx = stream.context().clone();
        ctx.bind_to_thread().map_err(|e| GpuError::Cuda {
            rank,
            msg: format!("binding the context: {e:?}"),
        })?;
        let kernels = Kernels::load(&ctx, rank)?;
        let nccl = NcclComm::new(host.clone(), stream.clone())?;
        let ipc = if world > 1 && opts.ipc_capacity_bytes > 0 {
            IpcBuffers::register(host.as_ref(), opts.ipc_capacity_bytes)?
        } else {
            None
        };
        if world > 1 && ipc.is_none() {
            tracing::warn!(
                rank,
                "CUDA IPC unavailable: all-reduce falls back to all-gather + tree"
            );
        }
        Ok(Self {
            host,
            stream,
            nccl,
            kernels,
            ipc,
            scratch: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            registered: Mutex::new(Vec::new()),
            opts,
            rank,
            world,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn nccl(&self) -> &NcclComm {
        &self.nccl
    }

    pub fn host(&self) -> &Arc<dyn Communicator> {
        &self.host
    }

    /// Whether the one-shot / two-shot buffers are registered on all ranks.
    pub fn ipc_enabled(&self) -> bool {
        self.ipc.is_some()
    }

    /// Largest message the IPC algorithms take (0 without IPC).
    pub fn ipc_capacity(&self) -> usize {
        self.ipc.as_ref().map_or(0, |b| b.half_bytes)
    }

    /// Collective: maps the `cuMemAlloc` allocation holding `ptr` on every rank, so that
    /// two-shot reads the peers' inputs in place instead of first copying them into the
    /// staging buffer (one pass over the input less). Afterwards every rank must pass
    /// inputs at the same offset of its registered allocation, or all pass unregistered
    /// ones. Stream-ordered (pool) allocations cannot be shared: then every rank gets
    /// `Ok(false)` and calls keep working through the staging copy.
    pub fn register_buffer(&self, ptr: u64) -> Result<bool, GpuError> {
        if self.world == 1 || self.ipc.is_none() {
            return Ok(false);
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda("binding the context", e))?;
        let local = ipc::allocation_of(self.rank, ptr);
        let base = local.as_ref().map(|b| *b).ok();
        let mapped = ipc::share(self.host.as_ref(), local.map(|(b, _)| b))?;
        match (mapped, base) {
            (Some(mapped), Some((base, bytes))) => {
                let mut reg = self.registered.lock().unwrap_or_else(|e| e.into_inner());
                reg.push(UserBuf {
                    base,
                    bytes,
                    mapped,
                });
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The peers' mapped addresses of `src` when it lies in a registered allocation.
    fn registered_inputs(&self, src: u64, bytes: usize) -> Option<Peers> {
        let reg = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        let b = reg
            .iter()
            .find(|b| src >= b.base && src + bytes as u64 <= b.base + b.bytes as u64)?;
        let off = src - b.base;
        let mut p = b.mapped.peers;
        for base in p.base.iter_mut().take(self.world) {
            *base += off;
        }
        Some(p)
    }

    fn fit(&self, src: u64, dst: u64, n: usize, dtype: Dtype) -> Fit {
        let per_pack = 16 / dtype.size();
        Fit {
            ipc: self.ipc.is_some(),
            packed: src.is_multiple_of(16) && dst.is_multiple_of(16) && n.is_multiple_of(per_pack),
            fits: n * dtype.size() <= self.ipc_capacity(),
        }
    }

    /// The algorithm `Algo::Auto` runs for this call (same on every rank).
    pub fn choose(&self, src: u64, dst: u64, n: usize, dtype: Dtype) -> Algo {
        select(
            n * dtype.size(),
            self.world,
            self.fit(src, dst, n, dtype),
            &self.opts.thresholds,
        )
    }

    /// Grows the all-gather scratch to hold `bytes_per_rank` from every rank. Call before
    /// capturing a graph: growing allocates with `cuMemAlloc`, which only a relaxed
    /// capture allows. The outgrown buffer is kept (a recorded graph may point at it).
    pub fn reserve(&self, bytes_per_rank: usize) -> Result<(), GpuError> {
        let need = bytes_per_rank * self.world;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_some_and(|b| b.bytes() >= need) {
            return Ok(());
        }
        let grown = DeviceBuf::alloc(need, self.rank)?;
        if let Some(old) = guard.replace(grown) {
            self.retired
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(old);
        }
        Ok(())
    }

    fn cuda(&self, what: &str, e: cudarc::driver::DriverError) -> GpuError {
        GpuError::Cuda {
            rank: self.rank,
            msg: format!("{what}: {e:?}"),
        }
    }

    fn invalid(&self, msg: String) -> GpuError {
        GpuError::Invalid {
            rank: self.rank,
            msg,
        }
    }

    /// The tree all-reduce of `n` elements from `src` into `dst` (may equal `src`) with
    /// `algo`; returns the algorithm that ran.
    ///
    /// # Safety
    /// `src` and `dst` are device pointers on this rank's GPU holding `n` elements of
    /// `dtype`, valid until the stream's work completes. Every rank makes the same call.
    pub unsafe fn all_reduce_raw(
        &self,
        algo: Algo,
        src: u64,
        dst: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<Algo, GpuError> {
        let algo = match algo {
            Algo::Auto => self.choose(src, dst, n, dtype),
            a => a,
        };
        if algo == Algo::Nvls {
            let ctx = self.stream.context().clone();
            nvls::nvls_all_reduce(true, || {
                ctx.attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)
                    .map(|v| v == 1)
                    .map_err(|e| self.cuda("reading the multicast attribute", e))
            })?;
            return Ok(algo);
        }
        if n == 0 {
            return Ok(algo);
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda("binding the context", e))?;
        if self.world == 1 {
            if src != dst {
                dres::memcpy_dtod_async(dst, src, n * dtype.size(), self.stream.cu_stream())
                    .map_err(|e| self.cuda("copying the single rank's buffer", e))?;
            }
            return Ok(algo);
        }
        match algo {
            Algo::AllGatherTree => self.allgather_tree(src, dst, n, dtype)?,
            Algo::OneShot | Algo::TwoShot => {
                let fit = self.fit(src, dst, n, dtype);
                if !fit.ipc {
                    return Err(self.invalid(format!(
                        "{} needs CUDA IPC buffers, which could not be registered on all ranks",
                        algo.name()
                    )));
                }
                if !fit.packed {
                    return Err(self.invalid(format!(
                        "{} needs 16-byte aligned buffers and a length that is a multiple of {} \
                         {} (got {n} elements at {src:#x} -> {dst:#x})",
                        algo.name(),
                        16 / dtype.size(),
                        dtype.name()
                    )));
                }
                if !fit.fits {
                    return Err(self.invalid(format!(
                        "{} of {} bytes exceeds the registered capacity of {} bytes",
                        algo.name(),
                        n * dtype.size(),
                        self.ipc_capacity()
                    )));
                }
                self.launch_ipc(algo, src, dst, n, dtype)?;
            }
            Algo::Auto | Algo::Nvls => unreachable!("resolved above"),
        }
        Ok(algo)
    }

    unsafe fn allgather_tree(
        &self,
        src: u64,
        dst: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<(), GpuError> {
        self.reserve(n * dtype.size())?;
        let scratch = {
            let guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            guard
                .as_ref()
                .map(DeviceBuf::ptr)
                .ok_or_else(|| self.invalid("no scratch".into()))?
        };
        self.nccl.all_gather_raw(src, scratch, n, dtype)?;
        let f = match dtype {
            Dtype::F32 => &self.kernels.tree_combine_f32,
            Dtype::Bf16 => &self.kernels.tree_combine_bf16,
        };
        let blocks = (n as u64).div_ceil(THREADS as u64).clamp(1, 132 * 4) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n64 = n as u64;
        let world = self.world as i32;
        self.stream
            .launch_builder(f)
            .arg(&scratch)
            .arg(&dst)
            .arg(&n64)
            .arg(&world)
            .launch(cfg)
            .map_err(|e| self.cuda("launching tree_combine", e))?;
        Ok(())
    }

    unsafe fn launch_ipc(
        &self,
        algo: Algo,
        src: u64,
        dst: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<(), GpuError> {
        let ipc = self
            .ipc
            .as_ref()
            .ok_or_else(|| self.invalid("IPC buffers missing".into()))?;
        let n_packs = (n * dtype.size() / 16) as u64;
        let direct = if algo == Algo::TwoShot {
            self.registered_inputs(src, n * dtype.size())
        } else {
            None
        };
        let k = &self.kernels;
        let f = match (algo, dtype, direct.is_some()) {
            (Algo::OneShot, Dtype::F32, _) => &k.oneshot_f32,
            (Algo::OneShot, Dtype::Bf16, _) => &k.oneshot_bf16,
            (_, Dtype::F32, false) => &k.twoshot_f32,
            (_, Dtype::Bf16, false) => &k.twoshot_bf16,
            (_, Dtype::F32, true) => &k.twoshot_direct_f32,
            (_, Dtype::Bf16, true) => &k.twoshot_direct_bf16,
        };
        let blocks = if algo == Algo::OneShot {
            self.blocks(n_packs, self.opts.oneshot_blocks)
        } else {
            self.blocks(
                n_packs.div_ceil(self.world as u64),
                self.opts.twoshot_blocks,
            )
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let rank = self.rank as i32;
        let world = self.world as i32;
        let data_off = DATA_OFFSET as u64;
        let half = ipc.half_bytes as u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&src).arg(&dst).arg(&n_packs).arg(ipc.peers());
        if let Some(inputs) = direct.as_ref() {
            b.arg(inputs);
        }
        b.arg(&rank).arg(&world).arg(&data_off).arg(&half);
        b.launch(cfg)
            .map_err(|e| self.cuda(&format!("launching {}", algo.name()), e))?;
        Ok(())
    }

    fn blocks(&self, packs: u64, cap: usize) -> u32 {
        packs.div_ceil(THREADS as u64).clamp(1, cap as u64) as u32
    }

    /// Tree all-reduce of an f32 buffer into a new buffer, with `Algo::Auto`.
    pub fn tree_all_reduce(&self, partial: &CudaSlice<f32>) -> Result<CudaSlice<f32>, GpuError> {
        self.tree_all_reduce_with(Algo::Auto, partial)
    }

    pub fn tree_all_reduce_with(
        &self,
        algo: Algo,
        partial: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>, GpuError> {
        // SAFETY: written in full by the all-reduce before it is returned.
        let mut out = unsafe { self.stream.alloc::<f32>(partial.len()) }
            .map_err(|e| self.cuda(&format!("alloc of {} f32", partial.len()), e))?;
        self.tree_all_reduce_into(algo, partial, &mut out)?;
        Ok(out)
    }

    /// Tree all-reduce of `partial` into `out` (same length).
    pub fn tree_all_reduce_into(
        &self,
        algo: Algo,
        partial: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<Algo, GpuError> {
        if partial.len() != out.len() {
            return Err(self.invalid(format!(
                "input has {} elements, output {}",
                partial.len(),
                out.len()
            )));
        }
        let (s, _gs) = partial.device_ptr(&self.stream);
        let (d, _gd) = out.device_ptr_mut(&self.stream);
        // SAFETY: both slices live on this stream's device and hold `len` f32.
        unsafe { self.all_reduce_raw(algo, s, d, partial.len(), Dtype::F32) }
    }

    /// Tree all-reduce of a bf16 buffer (`u16` bits): widened, tree in f32, rounded once.
    pub fn tree_all_reduce_bf16(
        &self,
        algo: Algo,
        partial: &CudaSlice<u16>,
    ) -> Result<CudaSlice<u16>, GpuError> {
        // SAFETY: written in full by the all-reduce before it is returned.
        let mut out = unsafe { self.stream.alloc::<u16>(partial.len()) }
            .map_err(|e| self.cuda(&format!("alloc of {} bf16", partial.len()), e))?;
        {
            let (s, _gs) = partial.device_ptr(&self.stream);
            let (d, _gd) = out.device_ptr_mut(&self.stream);
            // SAFETY: both slices live on this stream's device and hold `len` bf16.
            unsafe { self.all_reduce_raw(algo, s, d, partial.len(), Dtype::Bf16) }?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_names_round_trip() {
        for a in [
            Algo::Auto,
            Algo::AllGatherTree,
            Algo::OneShot,
            Algo::TwoShot,
            Algo::Nvls,
        ] {
            assert_eq!(a.name().parse::<Algo>(), Ok(a));
        }
        assert!("ring".parse::<Algo>().unwrap_err().contains("ring"));
    }

    /// Without a GPU (CI), construction reports that clearly instead of panicking.
    #[test]
    fn probe_reports_missing_driver_without_panicking() {
        match probe_driver() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(e.to_string().contains("unavailable"), "{e}"),
        }
    }
}
