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
//! algorithm is large enough ([`GpuCollective::reserve`]).
//!
//! **Ranks sharing a GPU** ([`crate::device_map`], `arbor-launch --ranks-per-gpu`): NCCL
//! refuses two ranks on one device, so when the ranks' device UUIDs show that any two of
//! the group share one (and every rank allowed it, [`GpuOptions::allow_shared`]), the
//! all-gather is staged through the host ([`staged`]) and `Auto` runs all-gather + tree
//! on it: the same bits, still capturable in a graph, slow. The IPC kernels still run
//! when asked for by name; a watchdog ([`GpuOptions::spin_limit`]) ends a barrier that
//! waits too long for a time-sliced peer, and [`GpuCollective::check`] turns that into an
//! error. A checking mode, not for speed. IPC algorithms need 16-byte
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
pub mod staged;

use std::sync::{Arc, Mutex};
use std::time::Duration;

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
use staged::Staged;

/// Milliseconds an IPC kernel's barrier waits for a peer before it gives up (0: for ever).
pub const SPIN_TIMEOUT_ENV: &str = "ARBOR_IPC_SPIN_TIMEOUT_MS";
/// The watchdog's default where ranks share a GPU.
pub const SHARED_SPIN_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Ranks may share a GPU (the user asked for it: `device_map::RanksPerGpu`); then
    /// every collective goes through the host. Without it on every rank, two ranks on one
    /// GPU is an error.
    pub allow_shared: bool,
    /// Where ranks share a GPU, register the IPC buffers too (for an algorithm asked for
    /// by name: `Auto` never picks them there).
    pub shared_ipc: bool,
    /// How long an IPC kernel's barrier waits for a peer before it gives up and the call
    /// fails ([`GpuCollective::check`]); `Some(ZERO)`: for ever. `None`: from
    /// [`SPIN_TIMEOUT_ENV`], else [`SHARED_SPIN_TIMEOUT`] where ranks share a GPU and for
    /// ever otherwise.
    pub spin_limit: Option<Duration>,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self {
            ipc_capacity_bytes: 64 << 20,
            thresholds: Thresholds::default(),
            oneshot_blocks: 64,
            twoshot_blocks: MAX_BLOCKS,
            allow_shared: false,
            shared_ipc: true,
            spin_limit: None,
        }
    }
}

/// The IPC watchdog's limit: `given`, else the value of [`SPIN_TIMEOUT_ENV`] (`env`), else
/// the default for the mode; zero means no limit.
pub fn spin_limit(
    given: Option<Duration>,
    env: Option<&str>,
    shared: bool,
) -> Result<Duration, String> {
    if let Some(d) = given {
        return Ok(d);
    }
    match env.map(str::trim).filter(|v| !v.is_empty()) {
        Some(v) => v
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| format!("{SPIN_TIMEOUT_ENV}={v:?}: expected milliseconds (0: no limit)")),
        None if shared => Ok(SHARED_SPIN_TIMEOUT),
        None => Ok(Duration::ZERO),
    }
}

/// How the ranks' GPUs relate, agreed by all ranks at construction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharing {
    /// For each rank, the ranks on its GPU (itself included), in rank order.
    pub groups: Vec<Vec<usize>>,
}

impl Sharing {
    /// From every rank's (device UUID, sharing allowed), in rank order: the groups, or the
    /// error every rank reports when ranks share a GPU that not all of them allowed.
    pub fn from_devices(devices: &[([u8; 16], bool)]) -> Result<Sharing, String> {
        let groups: Vec<Vec<usize>> = devices
            .iter()
            .map(|(u, _)| (0..devices.len()).filter(|&r| devices[r].0 == *u).collect())
            .collect();
        let sharing = Sharing { groups };
        if let Some(g) = sharing.groups.iter().find(|g| g.len() > 1) {
            if let Some(r) = g.iter().find(|&&r| !devices[r].1) {
                return Err(format!(
                    "ranks {} use the same GPU ({}), which NCCL refuses, and rank {r} was not \
                     told that ranks may share a GPU: start the ranks with `arbor-launch \
                     --ranks-per-gpu N` (or auto), or set ARBOR_RANKS_PER_GPU on every rank, \
                     to run them there with collectives staged through the host (a checking \
                     mode, slow), or give each rank its own GPU (CUDA_VISIBLE_DEVICES / \
                     LOCAL_RANK)",
                    g.iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    format_uuid(&devices[g[0]].0),
                ));
            }
        }
        Ok(sharing)
    }

    /// Whether any two ranks of the group share a GPU.
    pub fn any(&self) -> bool {
        self.groups.iter().any(|g| g.len() > 1)
    }
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi shows it.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// How the all-gather travels.
enum Transport {
    Nccl(NcclComm),
    /// Ranks share a GPU: through the host (staged.rs).
    Staged(Staged),
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
    transport: Transport,
    sharing: Sharing,
    /// The IPC watchdog's limit (zero: none).
    spin_limit: Duration,
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
        probe_driver()?;
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
        let sharing = Self::agree_on_devices(host.as_ref(), &ctx, opts.allow_shared)?;
        let shared = sharing.any();
        let spin_limit = spin_limit(
            opts.spin_limit,
            std::env::var(SPIN_TIMEOUT_ENV).ok().as_deref(),
            shared,
        )
        .map_err(|msg| GpuError::Invalid { rank, msg })?;
        let kernels = Kernels::load(&ctx, rank)?;
        let transport = if shared {
            if rank == 0 {
                let g = &sharing.groups[0];
                tracing::warn!(
                    "ranks share a GPU (ranks {g:?} on rank 0's): collectives are staged \
                     through the host, a checking mode; timings are not representative"
                );
            }
            let side = crate::side_channel(host.as_ref()).map_err(|e| GpuError::Host {
                rank,
                msg: format!("opening the host channel of the staged collectives: {e}"),
            })?;
            Transport::Staged(Staged::new(side, stream.clone()))
        } else {
            crate::nccl::probe_nccl()?;
            Transport::Nccl(NcclComm::new(host.clone(), stream.clone())?)
        };
        let ipc = if world > 1 && opts.ipc_capacity_bytes > 0 && (!shared || opts.shared_ipc) {
            IpcBuffers::register(host.as_ref(), opts.ipc_capacity_bytes)?
        } else {
            None
        };
        if let Some(b) = &ipc {
            b.set_spin_limit(rank, spin_limit.as_nanos().min(u64::MAX as u128) as u64)?;
        }
        if world > 1 && ipc.is_none() && opts.ipc_capacity_bytes > 0 && !shared {
            tracing::warn!(
                rank,
                "CUDA IPC unavailable: all-reduce falls back to all-gather + tree"
            );
        }
        Ok(Self {
            host,
            stream,
            transport,
            sharing,
            spin_limit,
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

    /// Collective: every rank's device UUID and whether it may share it, all-gathered;
    /// the same answer (or the same error) on every rank.
    fn agree_on_devices(
        host: &dyn Communicator,
        ctx: &Arc<cudarc::driver::CudaContext>,
        allow: bool,
    ) -> Result<Sharing, GpuError> {
        let rank = host.rank();
        let uuid = ctx.uuid().map_err(|e| GpuError::Cuda {
            rank,
            msg: format!("cuDeviceGetUuid: {e:?}"),
        })?;
        let mut mine = [0u8; 17];
        for (d, s) in mine.iter_mut().zip(uuid.bytes.iter()) {
            *d = *s as u8;
        }
        mine[16] = u8::from(allow);
        let all = host.all_gather_bytes(&mine).map_err(|e| GpuError::Host {
            rank,
            msg: format!("all-gather of the ranks' GPU ids: {e}"),
        })?;
        if all.len() != 17 * host.world_size() {
            return Err(GpuError::Host {
                rank,
                msg: format!(
                    "all-gather of the ranks' GPU ids gave {} bytes for {} ranks",
                    all.len(),
                    host.world_size()
                ),
            });
        }
        let devices: Vec<([u8; 16], bool)> = all
            .chunks_exact(17)
            .map(|c| {
                let mut u = [0u8; 16];
                u.copy_from_slice(&c[..16]);
                (u, c[16] == 1)
            })
            .collect();
        Sharing::from_devices(&devices).map_err(|msg| GpuError::Invalid { rank, msg })
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

    /// The NCCL communicator; `None` where ranks share a GPU (NCCL cannot run there).
    pub fn nccl(&self) -> Option<&NcclComm> {
        match &self.transport {
            Transport::Nccl(c) => Some(c),
            Transport::Staged(_) => None,
        }
    }

    /// How the all-gather travels: "nccl" or "host-staged".
    pub fn transport(&self) -> &'static str {
        match &self.transport {
            Transport::Nccl(_) => "nccl",
            Transport::Staged(_) => "host-staged",
        }
    }

    /// The ranks on each rank's GPU (agreed by all ranks).
    pub fn sharing(&self) -> &Sharing {
        &self.sharing
    }

    /// Whether any two ranks of the group share a GPU (collectives staged through the host).
    pub fn shared(&self) -> bool {
        self.sharing.any()
    }

    /// All-gather of `n` elements per rank from `src` into `dst` (`world * n`, rank order),
    /// through NCCL or, where ranks share a GPU, through the host.
    ///
    /// # Safety
    /// `src` and `dst` are device pointers on this rank's GPU holding `n` and `world * n`
    /// elements of `dtype`, valid until the stream's work completes. Every rank makes the
    /// same call.
    pub unsafe fn all_gather_raw(
        &self,
        src: u64,
        dst: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<(), GpuError> {
        match &self.transport {
            // SAFETY: forwarded from the caller.
            Transport::Nccl(c) => unsafe { c.all_gather_raw(src, dst, n, dtype) },
            // SAFETY: forwarded from the caller.
            Transport::Staged(s) => unsafe { s.all_gather_raw(src, dst, n * dtype.size()) },
        }
    }

    /// The sum all-reduce of `--numerics fast`: NCCL's own, or where ranks share a GPU
    /// (no NCCL) the tree through the host. Returns what ran ("nccl" or "tree").
    ///
    /// # Safety
    /// As [`GpuCollective::all_reduce_raw`].
    pub unsafe fn sum_all_reduce_raw(
        &self,
        src: u64,
        dst: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<&'static str, GpuError> {
        match &self.transport {
            Transport::Nccl(c) => {
                // SAFETY: forwarded from the caller.
                unsafe { c.all_reduce_raw(src, dst, n, dtype) }?;
                Ok("nccl")
            }
            Transport::Staged(_) => {
                // SAFETY: forwarded from the caller.
                unsafe { self.all_reduce_raw(Algo::AllGatherTree, src, dst, n, dtype) }?;
                Ok("tree")
            }
        }
    }

    /// Errors of earlier calls that the stream could not report: a failed host-staged
    /// exchange, an IPC barrier that gave up (watchdog). Synchronises the stream; call
    /// where the results of a step reach the host. Every call since the failure produced
    /// garbage.
    pub fn check(&self) -> Result<(), GpuError> {
        let staged = match &self.transport {
            Transport::Staged(s) => Some(s),
            Transport::Nccl(_) => None,
        };
        let watchdog = self.ipc.as_ref().filter(|_| !self.spin_limit.is_zero());
        if staged.is_none() && watchdog.is_none() {
            return Ok(());
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda("binding the context", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.cuda("synchronizing the stream", e))?;
        if let Some(msg) = staged.and_then(Staged::failure) {
            return Err(GpuError::Host {
                rank: self.rank,
                msg: format!("host-staged all-gather failed: {msg}"),
            });
        }
        if let Some(b) = watchdog {
            if let Some(peer) = b.stalled_on(self.rank)? {
                return Err(self.invalid(format!(
                    "an IPC all-reduce kernel (one-shot / two-shot) waited {:.1} s for rank \
                     {peer} and gave up: the kernels spin on their peers' flags, and {}. \
                     Unset ARBOR_GPU_ALLREDUCE for the default algorithm (host-staged where \
                     ranks share a GPU), or raise {SPIN_TIMEOUT_ENV}",
                    self.spin_limit.as_secs_f64(),
                    if self.shared() {
                        "with ranks time-sliced on one GPU the peer's kernel did not run in that time"
                    } else {
                        "the peer never arrived"
                    }
                )));
            }
        }
        Ok(())
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

    /// The algorithm `Algo::Auto` runs for this call (same on every rank). Where ranks
    /// share a GPU, always all-gather + tree: the IPC kernels only when asked for by name.
    pub fn choose(&self, src: u64, dst: u64, n: usize, dtype: Dtype) -> Algo {
        if self.shared() {
            return Algo::AllGatherTree;
        }
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
        // SAFETY: `scratch` holds world * n elements (reserved above); `src` per the caller.
        unsafe { self.all_gather_raw(src, scratch, n, dtype) }?;
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

    #[test]
    fn ranks_on_one_gpu_are_found_and_need_permission() {
        let a = [1u8; 16];
        let b = [2u8; 16];
        // One rank per GPU: no sharing, permission or not.
        let s = Sharing::from_devices(&[(a, false), (b, false)]).unwrap();
        assert!(!s.any());
        assert_eq!(s.groups, vec![vec![0], vec![1]]);
        // Four ranks on one GPU, all allowed.
        let s = Sharing::from_devices(&[(a, true); 4]).unwrap();
        assert!(s.any());
        assert_eq!(s.groups[3], vec![0, 1, 2, 3]);
        // Two GPUs, two ranks each.
        let s = Sharing::from_devices(&[(a, true), (a, true), (b, true), (b, true)]).unwrap();
        assert_eq!(
            s.groups,
            vec![vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]
        );
        // A rank that was not told: the same error on every rank, naming the fix.
        let e = Sharing::from_devices(&[(a, true), (b, true), (a, false)]).unwrap_err();
        assert!(
            e.contains("ranks 0, 2 use the same GPU (GPU-01010101-0101-")
                && e.contains("rank 2 was not told")
                && e.contains("--ranks-per-gpu"),
            "{e}"
        );
    }

    #[test]
    fn the_watchdog_limit_comes_from_the_caller_the_variable_or_the_mode() {
        let s = Duration::from_secs(3);
        assert_eq!(spin_limit(Some(s), Some("5"), true), Ok(s));
        assert_eq!(
            spin_limit(None, Some("250"), false),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(spin_limit(None, Some("0"), true), Ok(Duration::ZERO));
        assert_eq!(spin_limit(None, None, true), Ok(SHARED_SPIN_TIMEOUT));
        assert_eq!(spin_limit(None, Some(" "), false), Ok(Duration::ZERO));
        let e = spin_limit(None, Some("10s"), true).unwrap_err();
        assert!(e.contains("ARBOR_IPC_SPIN_TIMEOUT_MS=\"10s\""), "{e}");
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
