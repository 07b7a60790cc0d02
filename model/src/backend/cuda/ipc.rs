//! Taking a trainer's tensors by CUDA IPC handle (`Backend::copy_ipc`, docs/rl.md): the
//! trainer runs on this rank's GPU and shares its allocations; this rank opens each one
//! once per request, waits for the trainer's event where torch recorded one, copies the
//! bytes device to device into buffers of its own ([`CudaBytes`], as a NCCL receive
//! leaves them) on a stream of its own, and closes the handles. No NCCL and no host copy:
//! the trainer and the rank share the GPU, and the update cuts the shards from the copies.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{
    cuDeviceGetUuid_v2, cuEventDestroy_v2, cuIpcCloseMemHandle, cuIpcOpenEventHandle,
    cuIpcOpenMemHandle_v2, cuMemcpyDtoDAsync_v2, cuStreamWaitEvent, CUdeviceptr, CUevent,
    CUipcEventHandle, CUipcMemHandle, CUipcMem_flags, CUresult, CUuuid,
};
use cudarc::driver::{CudaStream, DevicePtrMut};

use super::received::CudaBytes;
use super::CudaBackend;
use crate::backend::{BResult, BackendError, DeviceBytes};
use crate::batching::ipc::{IpcBuffer, IpcDevice};

/// The handles opened for one request, closed when it ends (also on an error).
struct Opened {
    ptrs: HashMap<Vec<u8>, CUdeviceptr>,
}

impl Drop for Opened {
    fn drop(&mut self) {
        for (_, p) in self.ptrs.drain() {
            // SAFETY: opened by cuIpcOpenMemHandle in this context; every copy reading it
            // was synchronised before the request ends.
            let r = unsafe { cuIpcCloseMemHandle(p) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!("closing a CUDA IPC handle: {r:?}");
            }
        }
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of 16 UUID bytes (nvidia-smi's spelling).
pub(crate) fn uuid_text(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// Whether a UUID as a trainer wrote it (torch's `str(props.uuid)`, with or without
/// `GPU-`) names the GPU of `ours`.
pub(crate) fn same_uuid(theirs: &str, ours: &str) -> bool {
    let norm = |s: &str| {
        s.trim()
            .trim_start_matches("GPU-")
            .chars()
            .filter(|c| *c != '-')
            .collect::<String>()
            .to_ascii_lowercase()
    };
    norm(theirs) == norm(ours)
}

impl CudaBackend {
    fn gpu_uuid(&self) -> BResult<String> {
        let mut u = CUuuid { bytes: [0; 16] };
        // SAFETY: a valid out pointer and this context's device.
        let r = unsafe { cuDeviceGetUuid_v2(&mut u, self.dev.ctx.cu_device()) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(BackendError::Device {
                rank: self.comm.rank(),
                msg: format!("reading the GPU's UUID: {r:?}"),
            });
        }
        Ok(uuid_text(&u.bytes.map(|c| c as u8)))
    }

    /// Copies each of `buffers` out of the trainer's allocation into a buffer of this
    /// rank's (on a stream of its own, after the trainer's event), then closes the handles
    /// and takes this rank off torch's consumer counts.
    pub(super) fn copy_ipc_buffers(
        &self,
        buffers: &[IpcBuffer],
    ) -> BResult<Vec<Arc<dyn DeviceBytes>>> {
        let rank = self.comm.rank();
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| self.dev_err_msg("binding the context", e))?;
        let ours = self.gpu_uuid()?;
        let ordinal = self.dev.ordinal;
        for b in buffers {
            let matches = match &b.device {
                IpcDevice::Uuid(u) => same_uuid(u, &ours),
                IpcDevice::Index(i) => *i as usize == ordinal,
            };
            if !matches {
                return Err(BackendError::Unsupported(format!(
                    "serialized_named_tensors[{rank}]: the handle of {:?} is for GPU {}, and rank {rank} runs on GPU {ours} (cuda:{ordinal}): each rank's element must come from a trainer process on that rank's GPU",
                    b.parts.first().map(|p| p.name.as_str()).unwrap_or(""),
                    b.device
                )));
            }
        }
        // A stream of its own: the copies wait for the trainer's events, never the serving
        // stream's work. The buffers are allocated on it too, so they are whole once it is
        // synchronised below, whichever stream reads them next.
        let stream = self
            .dev
            .ctx
            .new_stream()
            .map_err(|e| self.dev_err_msg("creating the IPC copy stream", e))?;
        let mut opened = Opened {
            ptrs: HashMap::new(),
        };
        let queued = self.queue_ipc_copies(buffers, &stream, &mut opened);
        // Every copy queued, the failed request's too, ends before its handle closes.
        let synced = stream
            .synchronize()
            .map_err(|e| self.dev_err_msg("copying from the trainer's allocations", e));
        drop(opened);
        let out = queued?;
        synced?;
        for b in buffers {
            if let Some((name, offset)) = &b.ref_counter {
                if let Err(e) = crate::batching::ipc::release_ref_counter(name, *offset) {
                    tracing::warn!("{e}");
                }
            }
        }
        Ok(out)
    }

    fn queue_ipc_copies(
        &self,
        buffers: &[IpcBuffer],
        stream: &Arc<CudaStream>,
        opened: &mut Opened,
    ) -> BResult<Vec<Arc<dyn DeviceBytes>>> {
        let rank = self.comm.rank();
        let err = |what: &str, r: CUresult| BackendError::Device {
            rank,
            msg: format!("{what}: {r:?}"),
        };
        let cu_stream = stream.cu_stream();
        let mut out: Vec<Arc<dyn DeviceBytes>> = Vec::with_capacity(buffers.len());
        for b in buffers {
            let name = b.parts.first().map(|p| p.name.as_str()).unwrap_or("");
            let base = match opened.ptrs.get(&b.handle) {
                Some(&p) => p,
                None => {
                    let mut h = CUipcMemHandle { reserved: [0; 64] };
                    for (d, s) in h.reserved.iter_mut().zip(&b.handle) {
                        *d = *s as _;
                    }
                    let mut p: CUdeviceptr = 0;
                    // SAFETY: a valid out pointer; the handle is 64 bytes (checked when
                    // parsed) and the driver refuses one that names no allocation.
                    let r = unsafe {
                        cuIpcOpenMemHandle_v2(
                            &mut p,
                            h,
                            CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                        )
                    };
                    if r != CUresult::CUDA_SUCCESS {
                        return Err(BackendError::Unsupported(format!(
                            "serialized_named_tensors[{rank}]: opening the CUDA IPC handle of {name:?} failed ({r:?}): the trainer must keep the tensor alive until the call returns, and run in another process on this GPU"
                        )));
                    }
                    opened.ptrs.insert(b.handle.clone(), p);
                    p
                }
            };
            if let Some(ev) = &b.event {
                let mut h = CUipcEventHandle { reserved: [0; 64] };
                for (d, s) in h.reserved.iter_mut().zip(ev) {
                    *d = *s as _;
                }
                let mut e: CUevent = std::ptr::null_mut();
                // SAFETY: a valid out pointer and a 64-byte handle.
                let r = unsafe { cuIpcOpenEventHandle(&mut e, h) };
                if r != CUresult::CUDA_SUCCESS {
                    return Err(err("opening the trainer's CUDA IPC event", r));
                }
                // SAFETY: both live; the event may be destroyed once the wait is queued.
                let r = unsafe { cuStreamWaitEvent(cu_stream, e, 0) };
                unsafe { cuEventDestroy_v2(e) };
                if r != CUresult::CUDA_SUCCESS {
                    return Err(err("waiting for the trainer's CUDA IPC event", r));
                }
            }
            let len = usize::try_from(b.len)
                .map_err(|_| err("a buffer size", CUresult::CUDA_ERROR_INVALID_VALUE))?;
            if len == 0 {
                out.push(Arc::new(CudaBytes::empty()));
                continue;
            }
            // SAFETY: fully written by the copy below before anything reads it.
            let mut buf = unsafe { stream.alloc::<u8>(len) }.map_err(|e| {
                self.dev_err_msg(
                    &format!("allocating {len} bytes to copy {name:?} and what follows it into"),
                    e,
                )
            })?;
            {
                let (dst, _guard) = buf.device_ptr_mut(stream);
                // SAFETY: `buf` holds `len` bytes on this device and stream; the source
                // range lies in the storage the trainer shared (checked against
                // storage_size_bytes when parsed), open until the stream is synchronised.
                let r = unsafe { cuMemcpyDtoDAsync_v2(dst, base + b.offset, len, cu_stream) };
                if r != CUresult::CUDA_SUCCESS {
                    return Err(err("copying from the trainer's allocation", r));
                }
            }
            out.push(Arc::new(CudaBytes::new(buf)));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_match_as_torch_and_nvidia_smi_spell_them() {
        let b: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        let ours = uuid_text(&b);
        assert_eq!(ours, "GPU-00112233-4455-6677-8899-aabbccddeeff");
        assert!(same_uuid("00112233-4455-6677-8899-aabbccddeeff", &ours));
        assert!(same_uuid("GPU-00112233-4455-6677-8899-AABBCCDDEEFF", &ours));
        assert!(!same_uuid("00112233-4455-6677-8899-aabbccddeef0", &ours));
    }
}
