//! The registered buffers of the one-shot and two-shot kernels, shared over CUDA IPC.
//!
//! Each rank allocates once `[Signal | staging half 0 | staging half 1]` with `cuMemAlloc`,
//! zeroes the signal, exports an IPC handle, all-gathers the handles over the host
//! communicator and maps every peer's allocation. Buffers are reused by every call.
//!
//! Why two staging halves and one barrier suffice (no barrier at the end of a call): a call
//! of parity q writes only half q of its own staging, after which it waits (block by block)
//! until every peer has entered the same call. When a rank starts call N+2 (half q again),
//! its call N+1 has completed, so each of its blocks saw every peer inside call N+1, so
//! every peer had completed call N: nobody still reads half q of call N. The parity comes
//! from a device-side call counter that only the last block of a call advances, so graph
//! replays keep it right.

use cudarc::driver::{result as dres, sys as dsys, DeviceRepr};

use super::kernels::{MAX_RANKS, SIGNAL_BYTES, SPIN_LIMIT_OFFSET, STALLED_OFFSET};
use super::mem::DeviceBuf;
use super::GpuError;
use crate::Communicator;

/// Kernel argument: every rank's registered base address, mapped in this process.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Peers {
    pub base: [u64; MAX_RANKS],
}

// SAFETY: plain `#[repr(C)]` array of u64, matching `struct Peers` in allreduce.cu.
unsafe impl DeviceRepr for Peers {}

/// Staging starts on a 4 KiB boundary after the signal.
pub const DATA_OFFSET: usize = SIGNAL_BYTES.div_ceil(4096) * 4096;

const IPC_HANDLE_BYTES: usize = 64;

pub struct IpcBuffers {
    // Field order: peers unmap before the own allocation is freed.
    mapped: Mapped,
    own: DeviceBuf,
    pub half_bytes: usize,
}

/// Peers' mappings of one allocation, agreed by all ranks.
pub struct Mapped {
    pub peers: Peers,
    opened: Vec<u64>,
    rank: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        for &p in &self.opened {
            // SAFETY: each pointer came from cuIpcOpenMemHandle and is closed once.
            let r = unsafe { dsys::cuIpcCloseMemHandle(p) };
            if r != dsys::CUresult::CUDA_SUCCESS {
                tracing::warn!(rank = self.rank, "cuIpcCloseMemHandle: {r:?}");
            }
        }
    }
}

fn export_handle(rank: usize, ptr: u64) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
    let mut h = dsys::CUipcMemHandle_st {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: `ptr` is the base of a cuMemAlloc allocation; `h` is an out-param.
    let r = unsafe { dsys::cuIpcGetMemHandle(&mut h, ptr) };
    if r != dsys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Cuda {
            rank,
            msg: format!("cuIpcGetMemHandle of {ptr:#x}: {r:?}"),
        });
    }
    let mut bytes = [0u8; IPC_HANDLE_BYTES];
    for (d, s) in bytes.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(bytes)
}

/// Collective: every rank offers its allocation `local` (the base of a `cuMemAlloc`
/// allocation, or the reason it has none); every rank maps every peer's. `Ok(None)` on
/// every rank when any rank failed, so that all ranks make the same choices afterwards.
pub fn share(
    host: &dyn Communicator,
    local: Result<u64, GpuError>,
) -> Result<Option<Mapped>, GpuError> {
    let rank = host.rank();
    let world = host.world_size();
    let host_err = |what: &str, e: crate::CommError| GpuError::Host {
        rank,
        msg: format!("{what}: {e}"),
    };
    let exported = local.and_then(|ptr| export_handle(rank, ptr).map(|h| (ptr, h)));
    let mut msg = vec![0u8; 1 + IPC_HANDLE_BYTES];
    match &exported {
        Ok((_, h)) => {
            msg[0] = 1;
            msg[1..].copy_from_slice(h);
        }
        Err(e) => tracing::warn!(rank, "CUDA IPC export failed: {e}"),
    }
    let all = host
        .all_gather_bytes(&msg)
        .map_err(|e| host_err("all-gather of IPC handles", e))?;
    let per = 1 + IPC_HANDLE_BYTES;
    if all.len() != per * world {
        return Err(GpuError::Host {
            rank,
            msg: format!(
                "all-gather of IPC handles gave {} bytes, expected {}",
                all.len(),
                per * world
            ),
        });
    }
    let mut mapped = None;
    if let (true, Ok((own, _))) = ((0..world).all(|r| all[r * per] == 1), &exported) {
        let mut m = Mapped {
            peers: Peers {
                base: [0; MAX_RANKS],
            },
            opened: Vec::new(),
            rank,
        };
        let mut failed = false;
        for p in 0..world {
            if p == rank {
                m.peers.base[p] = *own;
                continue;
            }
            let mut h = dsys::CUipcMemHandle_st {
                reserved: [0; IPC_HANDLE_BYTES],
            };
            for (d, s) in h.reserved.iter_mut().zip(&all[p * per + 1..(p + 1) * per]) {
                *d = *s as std::ffi::c_char;
            }
            let mut ptr: dsys::CUdeviceptr = 0;
            // SAFETY: the handle came from peer p's cuIpcGetMemHandle; ptr is an out-param.
            let r = unsafe {
                dsys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    dsys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            };
            if r != dsys::CUresult::CUDA_SUCCESS {
                tracing::warn!(rank, "cuIpcOpenMemHandle of rank {p}'s buffer: {r:?}");
                failed = true;
                break;
            }
            m.opened.push(ptr);
            m.peers.base[p] = ptr;
        }
        if !failed {
            mapped = Some(m);
        }
    }
    let oks = host
        .all_gather_bytes(&[u8::from(mapped.is_some())])
        .map_err(|e| host_err("all-gather of IPC mapping status", e))?;
    if oks.len() == world && oks.iter().all(|&b| b == 1) {
        Ok(mapped)
    } else {
        Ok(None)
    }
}

/// The base and size of the allocation holding `ptr`.
pub fn allocation_of(rank: usize, ptr: u64) -> Result<(u64, usize), GpuError> {
    let mut base: dsys::CUdeviceptr = 0;
    let mut size = 0usize;
    // SAFETY: out-params only.
    let r = unsafe { dsys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    if r != dsys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Invalid {
            rank,
            msg: format!("{ptr:#x} is not device memory of this context: {r:?}"),
        });
    }
    Ok((base, size))
}

impl IpcBuffers {
    /// Collective over `host`. The caller has bound this rank's context to the thread.
    /// Returns `Ok(None)` on every rank when any rank could not register or map (e.g. no
    /// peer access between the GPUs), so that all ranks make the same algorithm choices.
    pub fn register(host: &dyn Communicator, half_bytes: usize) -> Result<Option<Self>, GpuError> {
        let rank = host.rank();
        let half_bytes = half_bytes.div_ceil(4096) * 4096;
        let own = Self::alloc_zeroed(rank, half_bytes);
        let ptr = own
            .as_ref()
            .map(DeviceBuf::ptr)
            .map_err(|e| GpuError::Cuda {
                rank,
                msg: e.to_string(),
            });
        let mapped = share(host, ptr)?;
        match (own, mapped) {
            (Ok(own), Some(mapped)) => Ok(Some(Self {
                own,
                mapped,
                half_bytes,
            })),
            _ => Ok(None),
        }
    }

    pub fn peers(&self) -> &Peers {
        &self.mapped.peers
    }

    fn alloc_zeroed(rank: usize, half_bytes: usize) -> Result<DeviceBuf, GpuError> {
        let own = DeviceBuf::alloc(DATA_OFFSET + 2 * half_bytes, rank)?;
        // SAFETY: the signal region lies inside the allocation.
        unsafe { dres::memset_d8_sync(own.ptr(), 0, DATA_OFFSET) }.map_err(|e| GpuError::Cuda {
            rank,
            msg: format!("zeroing the all-reduce signal: {e:?}"),
        })?;
        // The memset must be done before the handle exchange lets peers signal into it.
        // SAFETY: plain context synchronisation on the bound context.
        let r = unsafe { dsys::cuCtxSynchronize() };
        if r != dsys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::Cuda {
                rank,
                msg: format!("cuCtxSynchronize after zeroing the signal: {r:?}"),
            });
        }
        Ok(own)
    }
}

impl IpcBuffers {
    pub fn own_bytes(&self) -> usize {
        self.own.bytes()
    }

    /// Arms the kernels' watchdog: a barrier of this rank gives up after waiting `ns` for
    /// a peer (0: never). Call before any IPC kernel runs; the context is bound.
    pub fn set_spin_limit(&self, rank: usize, ns: u64) -> Result<(), GpuError> {
        // SAFETY: the field lies inside the signal region of the own allocation, and no
        // kernel runs yet.
        unsafe { dres::memcpy_htod_sync(self.own.ptr() + SPIN_LIMIT_OFFSET as u64, &[ns]) }.map_err(
            |e| GpuError::Cuda {
                rank,
                msg: format!("setting the all-reduce watchdog: {e:?}"),
            },
        )
    }

    /// The peer a barrier of this rank gave up on, if any. Call with the stream idle and
    /// the context bound.
    pub fn stalled_on(&self, rank: usize) -> Result<Option<usize>, GpuError> {
        let mut v = [0u32];
        // SAFETY: the field lies inside the signal region of the own allocation.
        unsafe { dres::memcpy_dtoh_sync(&mut v, self.own.ptr() + STALLED_OFFSET as u64) }.map_err(
            |e| GpuError::Cuda {
                rank,
                msg: format!("reading the all-reduce watchdog: {e:?}"),
            },
        )?;
        Ok(v[0].checked_sub(1).map(|p| p as usize))
    }
}
