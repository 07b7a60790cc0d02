//! The all-gather of a group whose ranks share a GPU ([`crate::device_map`]): NCCL refuses
//! two ranks on one device, so the bytes go through the host.
//!
//! On the rank's stream, in order: the input is copied to pinned host memory, a CUDA host
//! function all-gathers it over a TCP group of its own ([`crate::tcp::TcpComm::side_channel`])
//! into a second pinned buffer, and that is copied to the device. The tree all-reduce then
//! combines the gathered roots with the same kernel as the NCCL path, so the bits are those
//! of every other algorithm.
//!
//! Why a host function and not a synchronous exchange on the calling thread: the three
//! steps are stream work, so a decode step that contains them can still be captured into a
//! CUDA graph (memcpy and host nodes) and replayed. The exchange always ends: it fails
//! after the host group's operation timeout (ARBOR_OP_TIMEOUT_SECS) or as soon as a peer's
//! process is gone. A host function cannot return an error: a failure is recorded, later
//! exchanges are skipped (their output is garbage, never read as valid), and
//! [`Staged::failure`] reports it once the caller has synchronised the stream.
//!
//! The side channel is used only from the host functions, in stream order, so it never
//! interleaves with what the rank's main thread sends over its own group.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as dres, sys as dsys, CudaStream};

use super::GpuError;
use crate::Communicator;

/// Pinned (page-locked) host memory, so that copies to and from it are stream work that a
/// graph can hold.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
    rank: usize,
}

// SAFETY: plain host memory; the stream orders every access (copies and host functions).
unsafe impl Send for Pinned {}

impl Pinned {
    /// The caller has bound the device's context to this thread.
    fn alloc(bytes: usize, rank: usize) -> Result<Self, GpuError> {
        // SAFETY: plain allocation of at least 64 bytes.
        let ptr = unsafe { dres::malloc_host(bytes.max(64), 0) }.map_err(|e| GpuError::Cuda {
            rank,
            msg: format!("cuMemHostAlloc of {bytes} bytes for the host-staged all-gather: {e:?}"),
        })?;
        Ok(Self {
            ptr: ptr.cast(),
            bytes,
            rank,
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc above and freed once.
        if let Err(e) = unsafe { dres::free_host(self.ptr.cast()) } {
            tracing::warn!(
                rank = self.rank,
                "cuMemFreeHost of {} bytes: {e:?}",
                self.bytes
            );
        }
    }
}

/// What the host functions of one collective share.
pub(crate) struct Shared {
    comm: Arc<dyn Communicator>,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Exchanges run (for logs and tests).
    exchanges: AtomicU64,
}

impl Shared {
    pub(crate) fn new(comm: Arc<dyn Communicator>) -> Arc<Self> {
        Arc::new(Self {
            comm,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            exchanges: AtomicU64::new(0),
        })
    }

    fn fail(&self, msg: String) {
        tracing::error!(rank = self.comm.rank(), "host-staged all-gather: {msg}");
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert(msg);
        self.failed.store(true, Ordering::Release);
    }

    pub(crate) fn failure(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One all-gather: `bytes` at `send` from every rank into `recv` (`world * bytes`, rank
/// order). The argument of a host function.
pub(crate) struct Exchange {
    shared: Arc<Shared>,
    send: *const u8,
    recv: *mut u8,
    bytes: usize,
}

// SAFETY: the pointers are pinned buffers the collective keeps alive for as long as any
// host function may read them; the stream orders every access.
unsafe impl Send for Exchange {}

impl Exchange {
    /// # Safety
    /// `send` holds `bytes` readable bytes and `recv` `world * bytes` writable bytes,
    /// valid whenever [`Exchange::run`] runs.
    pub(crate) unsafe fn new(
        shared: Arc<Shared>,
        send: *const u8,
        recv: *mut u8,
        bytes: usize,
    ) -> Self {
        Self {
            shared,
            send,
            recv,
            bytes,
        }
    }

    /// Runs the exchange; after a failure (this one's or an earlier one's) it only records.
    pub(crate) fn run(&self) {
        let s = &self.shared;
        if s.failed.load(Ordering::Acquire) {
            return;
        }
        let rank = s.comm.rank();
        let world = s.comm.world_size();
        // SAFETY: see `Exchange::new`.
        let send = unsafe { std::slice::from_raw_parts(self.send, self.bytes) };
        match s.comm.all_gather_bytes(send) {
            Ok(all) if all.len() == world * self.bytes => {
                // SAFETY: see `Exchange::new`.
                let recv = unsafe { std::slice::from_raw_parts_mut(self.recv, all.len()) };
                recv.copy_from_slice(&all);
                s.exchanges.fetch_add(1, Ordering::Relaxed);
            }
            Ok(all) => s.fail(format!(
                "rank {rank}: the all-gather of {} bytes per rank returned {} bytes for {world} ranks",
                self.bytes,
                all.len()
            )),
            Err(e) => s.fail(format!("rank {rank}: {e}")),
        }
    }

    /// Runs the exchange, recording a panic as a failure (a host function must not unwind).
    fn run_guarded(&self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run()));
        if r.is_err() {
            self.shared.fail("the exchange panicked".into());
        }
    }
}

/// Host function of an eager call: owns its argument.
///
/// # Safety
/// `arg` comes from `Box::into_raw(Box<Exchange>)` and is passed to this function once.
pub(crate) unsafe extern "C" fn exchange_once(arg: *mut c_void) {
    // SAFETY: see above.
    let ex = unsafe { Box::from_raw(arg.cast::<Exchange>()) };
    ex.run_guarded();
}

/// Host function of a captured call: a graph replays it, so it only borrows.
///
/// # Safety
/// `arg` points to an `Exchange` that outlives every launch of the graph.
pub(crate) unsafe extern "C" fn exchange_replayed(arg: *mut c_void) {
    // SAFETY: see above.
    let ex = unsafe { &*arg.cast::<Exchange>() };
    ex.run_guarded();
}

/// The pinned buffers, grown in powers of two; outgrown ones are kept (a recorded graph may
/// still copy through them).
#[derive(Default)]
struct Buffers {
    send: Option<Pinned>,
    recv: Option<Pinned>,
    retired: Vec<Pinned>,
}

/// The host-staged all-gather of one rank.
pub struct Staged {
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    bufs: Mutex<Buffers>,
    /// Arguments of host functions captured into graphs: kept as long as the collective.
    /// Boxed because the driver holds their addresses: a Vec of values would move them
    /// when it grows.
    #[allow(clippy::vec_box)]
    captured: Mutex<Vec<Box<Exchange>>>,
    rank: usize,
    world: usize,
}

impl Staged {
    /// `side`: a group of the same ranks that nothing else uses (see the module docs).
    pub fn new(side: Arc<dyn Communicator>, stream: Arc<CudaStream>) -> Self {
        Self {
            rank: side.rank(),
            world: side.world_size(),
            shared: Shared::new(side),
            stream,
            bufs: Mutex::new(Buffers::default()),
            captured: Mutex::new(Vec::new()),
        }
    }

    fn cuda(&self, what: &str, e: impl std::fmt::Debug) -> GpuError {
        GpuError::Cuda {
            rank: self.rank,
            msg: format!("{what}: {e:?}"),
        }
    }

    /// Pinned send and receive buffers of at least `bytes` and `world * bytes`.
    fn buffers(&self, bytes: usize) -> Result<(*mut u8, *mut u8), GpuError> {
        let mut b = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let grow = |slot: &mut Option<Pinned>, need: usize, retired: &mut Vec<Pinned>| {
            if slot.as_ref().is_some_and(|p| p.bytes >= need) {
                return Ok(());
            }
            let fresh = Pinned::alloc(need.next_power_of_two(), self.rank)?;
            if let Some(old) = slot.replace(fresh) {
                retired.push(old);
            }
            Ok::<(), GpuError>(())
        };
        let Buffers {
            send,
            recv,
            retired,
        } = &mut *b;
        grow(send, bytes, retired)?;
        grow(recv, self.world * bytes, retired)?;
        match (send.as_ref(), recv.as_ref()) {
            (Some(s), Some(r)) => Ok((s.ptr, r.ptr)),
            _ => Err(self.cuda("host-staged buffers", "missing after allocation")),
        }
    }

    /// All-gathers `bytes` at device address `src` of every rank into `dst` (`world *
    /// bytes`, rank order), as work on the stream.
    ///
    /// # Safety
    /// `src` and `dst` are device pointers on this rank's GPU holding `bytes` and `world *
    /// bytes`, valid until the stream's work completes. Every rank makes the same call.
    pub unsafe fn all_gather_raw(&self, src: u64, dst: u64, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda("binding the context", e))?;
        let (send, recv) = self.buffers(bytes)?;
        let cu = self.stream.cu_stream();
        // SAFETY: `send` holds at least `bytes`; `src` is valid per the caller.
        unsafe { dsys::cuMemcpyDtoHAsync_v2(send.cast(), src, bytes, cu) }
            .result()
            .map_err(|e| self.cuda("copying the all-gather input to the host", e))?;
        // Inside a capture the host function becomes a graph node that replays: its
        // argument must outlive the graph, so the collective keeps it.
        let capturing = !matches!(
            self.stream.capture_status(),
            Ok(dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        // SAFETY: the buffers live as long as the collective (outgrown ones are retired,
        // not freed); the stream orders the copies around the exchange.
        let ex = Box::new(unsafe { Exchange::new(self.shared.clone(), send, recv, bytes) });
        if capturing {
            let arg = (&*ex as *const Exchange).cast_mut().cast::<c_void>();
            // SAFETY: `arg` stays valid: the box is kept in `captured` below.
            unsafe { dres::stream::launch_host_function(cu, exchange_replayed, arg) }
                .map_err(|e| self.cuda("enqueueing the host-staged exchange", e))?;
            self.captured
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(ex);
        } else {
            let arg = Box::into_raw(ex).cast::<c_void>();
            // SAFETY: the host function takes ownership of `arg` and frees it.
            if let Err(e) = unsafe { dres::stream::launch_host_function(cu, exchange_once, arg) } {
                // Not enqueued: the box is still ours.
                // SAFETY: from Box::into_raw above, never handed to the driver.
                drop(unsafe { Box::from_raw(arg.cast::<Exchange>()) });
                return Err(self.cuda("enqueueing the host-staged exchange", e));
            }
        }
        // SAFETY: `recv` holds world * bytes; `dst` is valid per the caller.
        unsafe {
            dsys::cuMemcpyHtoDAsync_v2(dst, recv.cast_const().cast(), self.world * bytes, cu)
        }
        .result()
        .map_err(|e| self.cuda("copying the gathered values to the device", e))?;
        Ok(())
    }

    /// The first failure of an exchange, if any. Call after synchronising the stream.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    /// Exchanges completed so far.
    pub fn exchanges(&self) -> u64 {
        self.shared.exchanges.load(Ordering::Relaxed)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // The pinned buffers and captured arguments go with this: no copy or host
        // function may still use them.
        if self.stream.context().bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::reference::tree_reference_f32;
    use crate::inproc::InProcGroup;
    use arbor_kernels::tree::{tree_sum, SegmentLayout, SEGMENTS};
    use std::time::Duration;

    fn segment_sums(n: usize) -> Vec<[f32; SEGMENTS]> {
        (0..n)
            .map(|j| {
                let b = j as f32;
                [1e8 + b, 1.0, -1e8, 1.0 + b, 3.5e-3, 7.0, -2.0e7 - b, 2.0e7]
            })
            .collect()
    }

    /// Host memory in place of the pinned buffers: the exchange itself is what runs in the
    /// host function, through the same entry points.
    fn exchange(shared: &Arc<Shared>, send: &[f32], world: usize, captured: bool) -> Vec<f32> {
        let bytes: Vec<u8> = send.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut recv = vec![0u8; world * bytes.len()];
        // SAFETY: both buffers outlive the call below.
        let ex = unsafe {
            Exchange::new(
                shared.clone(),
                bytes.as_ptr(),
                recv.as_mut_ptr(),
                bytes.len(),
            )
        };
        if captured {
            // SAFETY: `ex` outlives the call.
            unsafe { exchange_replayed((&ex as *const Exchange).cast_mut().cast()) };
        } else {
            // SAFETY: a fresh box, passed once.
            unsafe { exchange_once(Box::into_raw(Box::new(ex)).cast()) };
        }
        recv.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Download → host all-gather → tree combine (the kernel's host twin) gives the
    /// single-process tree's bits at every world size, eager or replayed.
    #[test]
    fn staged_all_gather_then_tree_equals_the_single_process_tree() {
        let sums = segment_sums(41);
        let want: Vec<u32> = sums.iter().map(|s| tree_sum(s).to_bits()).collect();
        for world in [2usize, 4, 8] {
            let handles: Vec<_> = InProcGroup::new(world)
                .into_iter()
                .map(|comm| {
                    let sums = sums.clone();
                    std::thread::spawn(move || {
                        let rank = comm.rank();
                        let shared = Shared::new(Arc::new(comm));
                        let segs = SegmentLayout::segments_of(rank, world);
                        let partial: Vec<f32> =
                            sums.iter().map(|s| tree_sum(&s[segs.clone()])).collect();
                        let mut outs = Vec::new();
                        for captured in [false, true, true] {
                            let gathered = exchange(&shared, &partial, world, captured);
                            let roots: Vec<&[f32]> = gathered.chunks_exact(partial.len()).collect();
                            outs.push(tree_reference_f32(&roots));
                        }
                        assert_eq!(shared.failure(), None);
                        assert_eq!(shared.exchanges.load(Ordering::Relaxed), 3);
                        outs
                    })
                })
                .collect();
            for (rank, h) in handles.into_iter().enumerate() {
                for out in h.join().unwrap() {
                    let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits, want, "world {world} rank {rank}");
                }
            }
        }
        // Order-sensitive data: a left-to-right sum differs, so the comparison can fail.
        let seq: Vec<u32> = sums
            .iter()
            .map(|s| s.iter().fold(0.0f32, |a, &b| a + b).to_bits())
            .collect();
        assert_ne!(seq, want);
    }

    /// A peer that never comes: the exchange fails after the operation timeout, says so,
    /// and later exchanges return at once instead of waiting again.
    #[test]
    fn a_missing_peer_is_a_recorded_failure_and_later_exchanges_skip() {
        let mut group = InProcGroup::with_timeout(2, Duration::from_millis(300)).into_iter();
        let comm0 = group.next().unwrap();
        let _silent = group.next().unwrap();
        let shared = Shared::new(Arc::new(comm0));
        let t0 = std::time::Instant::now();
        exchange(&shared, &[1.0, 2.0], 2, false);
        let msg = shared.failure().expect("the exchange failed");
        assert!(msg.contains("rank 0"), "{msg}");
        let t1 = std::time::Instant::now();
        exchange(&shared, &[1.0, 2.0], 2, true);
        assert!(
            t1.elapsed() < Duration::from_millis(100),
            "{:?}",
            t1.elapsed()
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(shared.failure(), Some(msg));
    }
}
