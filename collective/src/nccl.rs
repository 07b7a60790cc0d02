//! NCCL communicator for GPU ranks, bootstrapped over a host [`Communicator`].
//!
//! ```text
//! let comm = NcclComm::new(host.clone(), stream.clone())?;   // collective: all ranks call it
//! let gathered = comm.all_gather_f32(&partial)?;              // [world * n], rank order
//! comm.all_reduce_raw(src, dst, n, Dtype::Bf16)?;             // NCCL's own (non-deterministic) sum
//! ```
//!
//! Rank 0 makes the NCCL unique id and broadcasts it with `Communicator::broadcast_bytes`;
//! every rank then joins with `ncclCommInitRank` on the device of `stream`. All work is
//! enqueued on that stream; nothing here synchronises it. The deterministic all-reduce lives
//! in [`crate::gpu`]; this module is its transport and NCCL's reference sum.
//!
//! cudarc opens libcuda / libnccl at first use and panics when one is missing, so
//! [`probe_nccl`] checks first and every entry point returns [`GpuError`] instead.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nres, sys as nsys};

use crate::gpu::driver::probe_driver;
use crate::gpu::error::GpuError;
use crate::Communicator;

/// Element type of a device buffer handed to the raw entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dtype {
    F32,
    /// bf16 stored as `u16` bits.
    Bf16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }

    fn nccl(self) -> nsys::ncclDataType_t {
        match self {
            Dtype::F32 => nsys::ncclDataType_t::ncclFloat32,
            Dtype::Bf16 => nsys::ncclDataType_t::ncclBfloat16,
        }
    }
}

/// The element type a broadcast names (what a trainer's tensor holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireType {
    U8,
    F16,
    Bf16,
    F32,
}

impl WireType {
    pub fn size(self) -> usize {
        match self {
            WireType::U8 => 1,
            WireType::F16 | WireType::Bf16 => 2,
            WireType::F32 => 4,
        }
    }

    fn nccl(self) -> nsys::ncclDataType_t {
        match self {
            WireType::U8 => nsys::ncclDataType_t::ncclUint8,
            WireType::F16 => nsys::ncclDataType_t::ncclFloat16,
            WireType::Bf16 => nsys::ncclDataType_t::ncclBfloat16,
            WireType::F32 => nsys::ncclDataType_t::ncclFloat32,
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Dtype::F32),
            "bf16" => Ok(Dtype::Bf16),
            other => Err(format!("unknown dtype '{other}' (expected f32 or bf16)")),
        }
    }
}

/// Checks that libcuda and libnccl can be loaded, without letting cudarc panic.
pub fn probe_nccl() -> Result<(), GpuError> {
    probe_driver()?;
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if !unsafe { nsys::is_culib_present() } {
        return Err(GpuError::Unavailable(
            "libnccl.so could not be loaded (NCCL is not installed or not on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    Ok(())
}

fn nccl_err(rank: usize, what: &str, e: nres::NcclError) -> GpuError {
    GpuError::Nccl {
        rank,
        msg: format!("{what} failed: {:?}", e.0),
    }
}

/// One rank's NCCL communicator; all collective calls are enqueued on `stream`.
pub struct NcclComm {
    comm: nsys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every method takes `&self` but NCCL serialises enqueueing per communicator,
// and arbor issues collectives from one thread per rank.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// A fresh `ncclUniqueId` (`ncclGetUniqueId`), as the rank 0 of a group makes it.
pub fn new_unique_id(rank: usize) -> Result<[u8; 128], GpuError> {
    probe_nccl()?;
    let id = std::panic::catch_unwind(nres::get_uniqueid)
        .map_err(|_| GpuError::Unavailable("libnccl lacks ncclGetUniqueId".into()))?
        .map_err(|e| nccl_err(rank, "ncclGetUniqueId", e))?;
    Ok(std::array::from_fn(|i| id.internal[i] as u8))
}

impl NcclComm {
    /// Collective: every rank of `host` calls it with a stream on its own GPU.
    pub fn new(host: Arc<dyn Communicator>, stream: Arc<CudaStream>) -> Result<Self, GpuError> {
        probe_nccl()?;
        let rank = host.rank();
        let world = host.world_size();
        let mut bytes = Vec::new();
        if rank == 0 {
            let id = std::panic::catch_unwind(nres::get_uniqueid)
                .map_err(|_| GpuError::Unavailable("libnccl lacks ncclGetUniqueId".into()))?
                .map_err(|e| nccl_err(rank, "ncclGetUniqueId", e))?;
            bytes = id.internal.iter().map(|&c| c as u8).collect();
        }
        host.broadcast_bytes(&mut bytes, 0)
            .map_err(|e| GpuError::Host {
                rank,
                msg: format!("broadcast of the NCCL id: {e}"),
            })?;
        if bytes.len() != 128 {
            return Err(GpuError::Nccl {
                rank,
                msg: format!(
                    "the NCCL unique id from rank 0 has {} bytes, expected 128",
                    bytes.len()
                ),
            });
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        let id = nsys::ncclUniqueId { internal };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| GpuError::Cuda {
                rank,
                msg: format!("binding the context: {e:?}"),
            })?;
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id comes from rank 0's ncclGetUniqueId.
        unsafe { nres::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| nccl_err(rank, &format!("ncclCommInitRank (world {world})"), e))?;
        tracing::debug!(rank, world, "NCCL communicator ready");
        Ok(Self {
            comm,
            stream,
            rank,
            world,
        })
    }

    /// Joins a group whose unique id another process made (a trainer that broadcasts
    /// weights: `docs/rl.md`), as `rank` of `world`, on the device of `stream`. Blocks
    /// until every member has joined: call it where a wait is bounded (`join_within`).
    pub fn join(
        unique_id: &[u8],
        world: usize,
        rank: usize,
        stream: Arc<CudaStream>,
    ) -> Result<Self, GpuError> {
        probe_nccl()?;
        if unique_id.len() != 128 {
            return Err(GpuError::Invalid {
                rank,
                msg: format!(
                    "a NCCL unique id has 128 bytes, this one {}",
                    unique_id.len()
                ),
            });
        }
        if rank >= world {
            return Err(GpuError::Invalid {
                rank,
                msg: format!("rank {rank} is outside a group of {world}"),
            });
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(unique_id) {
            *d = *s as std::ffi::c_char;
        }
        let id = nsys::ncclUniqueId { internal };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| GpuError::Cuda {
                rank,
                msg: format!("binding the context: {e:?}"),
            })?;
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id has the size of an ncclUniqueId.
        unsafe { nres::comm_init_rank(&mut comm, world as i32, id, rank as i32) }.map_err(|e| {
            nccl_err(
                rank,
                &format!("ncclCommInitRank (rank {rank} of {world})"),
                e,
            )
        })?;
        Ok(Self {
            comm,
            stream,
            rank,
            world,
        })
    }

    /// [`NcclComm::join`] on a thread of its own, waiting at most `timeout`: a member that
    /// never comes must not hold the caller forever. On a timeout the joining thread is
    /// left blocked (NCCL offers no way to cancel an init) and the error says so.
    pub fn join_within(
        unique_id: &[u8],
        world: usize,
        rank: usize,
        stream: Arc<CudaStream>,
        timeout: std::time::Duration,
    ) -> Result<Self, GpuError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let id = unique_id.to_vec();
        std::thread::Builder::new()
            .name("nccl-join".into())
            .spawn(move || {
                let _ = tx.send(Self::join(&id, world, rank, stream));
            })
            .map_err(|e| GpuError::Host {
                rank,
                msg: format!("starting the NCCL join thread: {e}"),
            })?;
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => Err(GpuError::Nccl {
                rank,
                msg: format!(
                    "the other members of the group (world {world}) did not join within {:.0} s",
                    timeout.as_secs_f64()
                ),
            }),
        }
    }

    /// `ncclBroadcast` of `count` elements of `ty` from `root` (in place: `buf` is sent on
    /// the root and received elsewhere), enqueued on the stream. NCCL wants every member to
    /// name the same count and type: a receiver names the sender's.
    ///
    /// # Safety
    /// `buf` must be a device pointer on this rank's GPU, valid for `count` elements of
    /// `ty` for the stream's work.
    pub unsafe fn broadcast_raw(
        &self,
        buf: u64,
        count: usize,
        ty: WireType,
        root: usize,
    ) -> Result<(), GpuError> {
        nres::broadcast(
            buf as *const _,
            buf as *mut _,
            count,
            ty.nccl(),
            root as i32,
            self.comm,
            self.cu_stream(),
        )
        .map(|_| ())
        .map_err(|e| {
            nccl_err(
                self.rank,
                &format!("ncclBroadcast of {count} {ty:?} from rank {root}"),
                e,
            )
        })
    }

    /// Aborts the communicator's outstanding work (a broadcast whose sender never came):
    /// the kernels waiting on it return. The communicator is unusable after.
    pub fn abort(self) {
        // SAFETY: `comm` is live; it is not destroyed again (Drop is skipped).
        if let Err(e) = unsafe { nres::comm_abort(self.comm) } {
            tracing::warn!(rank = self.rank, "ncclCommAbort failed: {:?}", e.0);
        }
        std::mem::forget(self);
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

    fn cu_stream(&self) -> nsys::cudaStream_t {
        self.stream.cu_stream() as nsys::cudaStream_t
    }

    /// NCCL all-gather of `count` elements per rank: `recv` receives `world * count`.
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers on this rank's GPU, valid for the stream's
    /// work, holding `count` and `world * count` elements of `dtype`.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: Dtype,
    ) -> Result<(), GpuError> {
        nres::all_gather(
            send as *const _,
            recv as *mut _,
            count,
            dtype.nccl(),
            self.comm,
            self.cu_stream(),
        )
        .map(|_| ())
        .map_err(|e| {
            nccl_err(
                self.rank,
                &format!("ncclAllGather of {count} {}", dtype.name()),
                e,
            )
        })
    }

    /// NCCL's own sum all-reduce (its order depends on NCCL's algorithm choice: the
    /// non-deterministic reference the benchmark compares against).
    ///
    /// # Safety
    /// As [`NcclComm::all_gather_raw`], with `count` elements in both buffers.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: Dtype,
    ) -> Result<(), GpuError> {
        nres::all_reduce(
            send as *const _,
            recv as *mut _,
            count,
            dtype.nccl(),
            nsys::ncclRedOp_t::ncclSum,
            self.comm,
            self.cu_stream(),
        )
        .map(|_| ())
        .map_err(|e| {
            nccl_err(
                self.rank,
                &format!("ncclAllReduce of {count} {}", dtype.name()),
                e,
            )
        })
    }

    /// All-gather of an f32 buffer: the ranks' buffers concatenated in rank order.
    pub fn all_gather_f32(&self, send: &CudaSlice<f32>) -> Result<CudaSlice<f32>, GpuError> {
        self.all_gather_typed(send, Dtype::F32)
    }

    /// All-gather of a bf16 buffer (`u16` bits).
    pub fn all_gather_bf16(&self, send: &CudaSlice<u16>) -> Result<CudaSlice<u16>, GpuError> {
        self.all_gather_typed(send, Dtype::Bf16)
    }

    fn all_gather_typed<T: cudarc::driver::DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        dtype: Dtype,
    ) -> Result<CudaSlice<T>, GpuError> {
        let n = send.len();
        // SAFETY: fully written by the all-gather below before anyone reads it.
        let mut recv =
            unsafe { self.stream.alloc::<T>(n * self.world) }.map_err(|e| GpuError::Cuda {
                rank: self.rank,
                msg: format!("alloc of {} elements: {e:?}", n * self.world),
            })?;
        {
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            // SAFETY: both buffers live on this stream's device with the right lengths.
            unsafe { self.all_gather_raw(s, r, n, dtype) }?;
        }
        Ok(recv)
    }

    /// NCCL sum all-reduce of an f32 buffer into a new buffer (non-deterministic order).
    pub fn nccl_all_reduce_f32(&self, send: &CudaSlice<f32>) -> Result<CudaSlice<f32>, GpuError> {
        let n = send.len();
        // SAFETY: fully written by the all-reduce below.
        let mut recv = unsafe { self.stream.alloc::<f32>(n) }.map_err(|e| GpuError::Cuda {
            rank: self.rank,
            msg: format!("alloc of {n} f32: {e:?}"),
        })?;
        {
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            // SAFETY: both buffers hold n f32 on this stream's device.
            unsafe { self.all_reduce_raw(s, r, n, Dtype::F32) }?;
        }
        Ok(recv)
    }
}

/// How long `ncclCommDestroy` may take before the wait is reported.
const DESTROY_WARN_AFTER: Duration = Duration::from_secs(10);

/// Runs `work`; if it has not returned after `after`, calls `report` once (from a watcher
/// thread) while it goes on waiting.
fn report_if_slow<T>(
    after: Duration,
    report: impl FnOnce() + Send + 'static,
    work: impl FnOnce() -> T,
) -> T {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watcher = std::thread::Builder::new()
        .name("slow-call-watch".into())
        .spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(after) {
                report();
            }
        })
        .ok();
    let out = work();
    drop(done_tx);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    out
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // ncclCommDestroy (NCCL >= 2.26) blocks until every CUDA graph that captured one of
        // this communicator's collectives is destroyed, and until the other members destroy
        // theirs: a graph kept alive past the communicator, or a member that waits for this
        // one first, hangs the process silently (both seen on GPUs, 2026-11-26). The
        // watcher names the causes while the destroy waits.
        let rank = self.rank;
        let report = move || {
            tracing::error!(
                rank,
                seconds = DESTROY_WARN_AFTER.as_secs(),
                "ncclCommDestroy is still waiting: NCCL destroys a communicator once every \
                 member has called it and every CUDA graph that captured its collectives is \
                 destroyed (a member that has not left, or a recorded graph still alive)"
            );
        };
        // SAFETY: the communicator was created by ncclCommInitRank and is destroyed once.
        let r = report_if_slow(DESTROY_WARN_AFTER, report, || unsafe {
            nres::comm_destroy(self.comm)
        });
        if let Err(e) = r {
            tracing::warn!(rank = self.rank, "ncclCommDestroy failed: {:?}", e.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_call_is_reported_once_and_a_quick_one_never() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let reports = Arc::new(AtomicUsize::new(0));
        let r = reports.clone();
        let out = report_if_slow(
            Duration::from_millis(20),
            move || {
                r.fetch_add(1, Ordering::SeqCst);
            },
            || {
                std::thread::sleep(Duration::from_millis(200));
                7
            },
        );
        assert_eq!(out, 7);
        assert_eq!(reports.load(Ordering::SeqCst), 1);
        let r = reports.clone();
        let out = report_if_slow(
            Duration::from_secs(5),
            move || {
                r.fetch_add(1, Ordering::SeqCst);
            },
            || 8,
        );
        assert_eq!(out, 8);
        assert_eq!(reports.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn dtype_parses_and_sizes() {
        assert_eq!("f32".parse::<Dtype>(), Ok(Dtype::F32));
        assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::Bf16));
        assert!("f16".parse::<Dtype>().unwrap_err().contains("f16"));
        assert_eq!(Dtype::F32.size(), 4);
        assert_eq!(Dtype::Bf16.size(), 2);
    }
}
