//! The NCCL group a trainer opens with the GPU ranks to broadcast new weights
//! (`Backend::join_weights_group`, docs/rl.md): the trainer sends each tensor (or packed
//! buffer) whole; this rank receives it on a stream of its own into a device buffer of its
//! own, where it stays until the update cuts this rank's shard from it on the device
//! (received.rs). The broadcasts of one call are queued back to back and waited for
//! together: no round trip to the host between two tensors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_collective::nccl::{Dtype, NcclComm, WireType};
use cudarc::driver::sys::{cuStreamQuery, CUresult};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtrMut};

use super::received::CudaBytes;
use super::CudaBackend;
use crate::backend::{BResult, BackendError, DeviceBytes, WeightsGroup, WeightsGroupJoiner, Wire};
use crate::safetensors::DType;

pub struct CudaWeightsGroup {
    /// None once aborted (a broadcast that never came).
    comm: Option<NcclComm>,
    stream: Arc<CudaStream>,
    rank: usize,
}

impl CudaBackend {
    pub(super) fn group_joiner(
        &self,
        world: usize,
        rank: usize,
        timeout: Duration,
    ) -> BResult<WeightsGroupJoiner> {
        let me = self.comm.rank();
        let err = move |msg: String| BackendError::Device { rank: me, msg };
        if self.slot.ranks_on_device > 1 {
            return Err(BackendError::Unsupported(format!(
                "rank {me}: {} ranks share GPU {} (--ranks-per-gpu), and a NCCL group holds one member per GPU: push the weights over HTTP (update_weights_from_tensor) or from disk instead",
                self.slot.ranks_on_device, self.slot.ordinal
            )));
        }
        // A stream of its own: a wait for the trainer never blocks the serving stream.
        let stream = self
            .dev
            .ctx
            .new_stream()
            .map_err(|e| err(format!("creating the weight-update stream: {e:?}")))?;
        Ok(Box::new(move |unique_id: &[u8]| {
            let comm = NcclComm::join_within(unique_id, world, rank, stream.clone(), timeout)
                .map_err(|e| err(e.to_string()))?;
            // Every member must run the same NCCL: the log says which one this rank loaded.
            let version = cudarc::nccl::result::get_nccl_version().unwrap_or(0);
            tracing::info!(
                rank = me,
                group_rank = rank,
                world,
                nccl_version = version,
                "joined the weight-update group"
            );
            Ok(Box::new(CudaWeightsGroup {
                comm: Some(comm),
                stream,
                rank: me,
            }) as Box<dyn WeightsGroup>)
        }))
    }
}

impl CudaWeightsGroup {
    fn err(&self, msg: String) -> BackendError {
        BackendError::Device {
            rank: self.rank,
            msg,
        }
    }

    /// Waits for the stream's work, at most `timeout`.
    fn wait(&self, timeout: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            // SAFETY: the stream is live for `self`'s lifetime.
            match unsafe { cuStreamQuery(self.stream.cu_stream()) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(format!("the weight-update stream failed: {other:?}")),
            }
            if t0.elapsed() > timeout {
                return Err(format!(
                    "no broadcast from the trainer within {:.0} s",
                    timeout.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Waits for `events` in order (each marks the end of one broadcast), at most
    /// `timeout` for each after the previous one completed: a trainer that is slow but
    /// sending is waited for, one that stopped is not.
    fn wait_each(&self, events: &[Option<CudaEvent>], timeout: Duration) -> Result<(), String> {
        let mut t0 = Instant::now();
        for (i, e) in events.iter().enumerate() {
            let Some(e) = e else { continue };
            loop {
                match e.try_is_complete() {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(err) => {
                        return Err(format!(
                            "the weight-update stream failed at broadcast {i}: {err:?}"
                        ))
                    }
                }
                if t0.elapsed() > timeout {
                    return Err(format!(
                        "no broadcast from the trainer within {:.0} s ({i} of {} received)",
                        timeout.as_secs_f64(),
                        events.len()
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            t0 = Instant::now();
        }
        Ok(())
    }

    /// Aborts the communicator: a receive may still be pending inside NCCL, and its
    /// buffer can only go once it is.
    fn abort(&mut self) {
        if let Some(c) = self.comm.take() {
            c.abort();
        }
    }
}

impl Drop for CudaWeightsGroup {
    fn drop(&mut self) {
        // ncclCommDestroy returns only once the trainer destroys its communicator too, and
        // a trainer may wait for this server's answer to destroy_weights_update_group
        // before it does (seen on nvidia-h100-x4, 2026-11-26: 250 s, with generation
        // stalled). The destroy runs on a thread of its own, so the answer goes out now.
        if let Some(comm) = self.comm.take() {
            let rank = self.rank;
            let spawned = std::thread::Builder::new()
                .name("weights-group-destroy".into())
                .spawn(move || drop(comm));
            if let Err(e) = spawned {
                // The closure, and the communicator, were dropped here, in place.
                tracing::warn!(rank, "no thread to destroy the weight-update group on: {e}");
            }
        }
    }
}

impl WeightsGroup for CudaWeightsGroup {
    fn receive(
        &mut self,
        parts: &[(usize, Wire)],
        root: usize,
        timeout: Duration,
    ) -> BResult<Vec<Arc<dyn DeviceBytes>>> {
        let wire = |w: Wire| match w {
            Wire::Elements(DType::BF16) => WireType::Bf16,
            Wire::Elements(DType::F16) => WireType::F16,
            Wire::Elements(DType::F32) => WireType::F32,
            Wire::Bytes => WireType::U8,
        };
        // Checked before anything is queued: a refusal never leaves a broadcast pending.
        for (i, &(bytes, w)) in parts.iter().enumerate() {
            let ty = wire(w);
            if !bytes.is_multiple_of(ty.size()) {
                return Err(self.err(format!(
                    "broadcast {i}: {bytes} bytes are not whole {ty:?} elements"
                )));
            }
        }
        if self.comm.is_none() {
            return Err(self.err(
                "the weight-update group was aborted after a failed broadcast: destroy it and init a new one"
                    .into(),
            ));
        }
        let mut out: Vec<Arc<dyn DeviceBytes>> = Vec::with_capacity(parts.len());
        let mut events = Vec::with_capacity(parts.len());
        for (i, &(bytes, w)) in parts.iter().enumerate() {
            if bytes == 0 {
                out.push(Arc::new(CudaBytes::empty()));
                events.push(None);
                continue;
            }
            let ty = wire(w);
            let queued = (|| {
                // SAFETY: fully written by the broadcast before anything reads it.
                let mut buf = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| {
                    format!("allocating {bytes} bytes to receive broadcast {i} into: {e:?}")
                })?;
                {
                    let comm = self.comm.as_ref().ok_or("the group was aborted")?;
                    let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
                    // SAFETY: `buf` holds `bytes` bytes on this group's device and stream.
                    unsafe { comm.broadcast_raw(ptr, bytes / ty.size(), ty, root) }
                        .map_err(|e| e.to_string())?;
                }
                let done = self
                    .stream
                    .record_event(None)
                    .map_err(|e| format!("recording the end of broadcast {i}: {e:?}"))?;
                Ok::<_, String>((buf, done))
            })();
            match queued {
                Ok((buf, done)) => {
                    out.push(Arc::new(CudaBytes::new(buf)));
                    events.push(Some(done));
                }
                Err(msg) => {
                    // Broadcasts queued before this one wait inside NCCL for the trainer.
                    if i > 0 {
                        self.abort();
                    }
                    return Err(self.err(msg));
                }
            }
        }
        if let Err(msg) = self.wait_each(&events, timeout) {
            self.abort();
            return Err(self.err(msg));
        }
        Ok(out)
    }

    fn abort(mut self: Box<Self>) {
        if let Some(comm) = self.comm.take() {
            comm.abort();
        }
    }

    fn warm_up(&mut self, timeout: Duration) -> BResult<()> {
        let Some(comm) = self.comm.as_ref() else {
            return Err(self
                .err("the weight-update group was aborted: destroy it and init a new one".into()));
        };
        // It runs on the thread that joined the group in the background, not the rank's.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.err(format!("binding the context for the warm-up: {e:?}")))?;
        let mut buf = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| self.err(format!("allocating the warm-up all-reduce: {e:?}")))?;
        {
            let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
            // SAFETY: `buf` holds one f32 on this group's device and stream, reduced in place.
            unsafe { comm.all_reduce_raw(ptr, ptr, 1, Dtype::F32) }
                .map_err(|e| self.err(e.to_string()))?;
        }
        if let Err(msg) = self.wait(timeout) {
            if let Some(c) = self.comm.take() {
                c.abort();
            }
            return Err(self.err(format!("the warm-up all-reduce: {msg}")));
        }
        Ok(())
    }
}
