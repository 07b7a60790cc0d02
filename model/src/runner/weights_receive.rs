//! Tensors a trainer sends to a rank's memory for the next update (docs/rl.md): over the
//! NCCL group (SGLang's and vLLM's lists, vLLM's packed buffers, TRL's one tensor per call,
//! prime-rl's in-band layout) or by CUDA IPC handle from a trainer on the same GPU. They
//! are received into device memory and staged there ([`DeviceTensor`]s), to be cut into
//! shards on the device when the update applies ([`super::weights_update`]).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::weights_update::{IN_BAND_LABEL, IPC_LABEL, NCCL_LABEL};
use super::Worker;
use crate::backend::{Backend, DeviceBytes, DeviceTensor, Wire};
use crate::batching::ipc::IpcBuffer;
use crate::batching::TensorMeta;
use crate::error::{MResult, ModelError};
use crate::safetensors::DType;

/// Tensor `name` at `range` of received `bytes`, or the refusal naming where it came from.
fn staged(
    source: &str,
    name: &str,
    dtype: DType,
    shape: Vec<usize>,
    bytes: &Arc<dyn DeviceBytes>,
    range: Range<usize>,
) -> MResult<DeviceTensor> {
    DeviceTensor::new(dtype, shape, bytes.clone(), range).map_err(|msg| ModelError::Safetensors {
        path: PathBuf::from(source),
        msg: format!("tensor {name:?}: {msg}"),
    })
}

impl<B: Backend> Worker<B> {
    /// Received tensors stay in device memory until the update: where the second copy of
    /// the weights has no room beside the KV cache, the first of an update's receives frees
    /// the cache (made again when the update applies or the tensors are dropped).
    fn make_room_for_staging(&mut self) -> MResult<()> {
        if self.updates.staged_device.is_empty() {
            self.make_room_for_update()?;
        }
        Ok(())
    }

    /// Stages the tensors a trainer on this rank's GPU shares by CUDA IPC handle: this
    /// rank's element of `ranks` is copied device to device from the trainer's
    /// allocations into buffers of this rank's own (the backend opens each handle, waits
    /// for the trainer's event, copies, closes), and each tensor is staged as a range of
    /// its buffer, cut into shards on the device at the update as a NCCL receive's are.
    pub(super) fn stage_ipc(&mut self, ranks: &[Vec<IpcBuffer>]) -> MResult<()> {
        let rank = self.backend.rank();
        let Some(mine) = ranks.get(rank) else {
            return Err(ModelError::BadRequest {
                id: 0,
                msg: format!(
                    "serialized_named_tensors has {} elements and this is rank {rank}: give one per TP rank",
                    ranks.len()
                ),
            });
        };
        self.make_room_for_staging()?;
        let t0 = std::time::Instant::now();
        let copied = self.backend.copy_ipc(mine).map_err(|e| self.berr(e))?;
        let mut device = Vec::new();
        let mut total = 0usize;
        for (b, bytes) in mine.iter().zip(copied) {
            total += bytes.len();
            for p in &b.parts {
                let range = usize::try_from(p.start).unwrap_or(usize::MAX)
                    ..usize::try_from(p.end).unwrap_or(usize::MAX);
                let d = staged(IPC_LABEL, &p.name, p.dtype, p.shape.clone(), &bytes, range)?;
                device.push((p.name.clone(), d));
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            rank,
            buffers = mine.len(),
            tensors = device.len(),
            bytes = total,
            copy_seconds = seconds,
            gb_per_s = total as f64 / seconds.max(1e-9) / 1e9,
            "copied tensors handed over by CUDA IPC into device memory"
        );
        self.stage(Vec::new(), device, IPC_LABEL)
    }

    /// Receives `tensors` from the trainer over the NCCL group into device memory and
    /// stages them there (one broadcast per tensor, or vLLM's packed layout: a few `uint8`
    /// buffers each holding many of `tensors` back to back, `batching::packed`). Every
    /// broadcast is received before any tensor is checked, so the trainer's broadcasts
    /// never wait on a refusal; the values are checked when the update cuts the shards.
    pub(super) fn receive(
        &mut self,
        group: &str,
        tensors: &[TensorMeta],
        packed: Option<usize>,
        timeout: Duration,
    ) -> MResult<()> {
        let rank = self.backend.rank();
        let g = match &mut self.updates.group {
            Some((name, g)) if name == group => g,
            Some((name, _)) => {
                return Err(ModelError::BadRequest {
                    id: 0,
                    msg: format!("no weight-update group {group:?} (the group is {name:?})"),
                })
            }
            None => {
                return Err(ModelError::Unavailable(format!(
                    "no weight-update group {group:?}: init_weights_update_group first"
                )))
            }
        };
        let root = g.root;
        g.slot.joined(rank, timeout)?;
        self.make_room_for_staging()?;
        let t0 = std::time::Instant::now();
        let berr = |source| ModelError::Backend { rank, source };
        let (buffers, wires) = match packed {
            Some(buffer_bytes) => {
                let buffers =
                    crate::batching::packed::plan(tensors, buffer_bytes).map_err(|e| {
                        ModelError::BadRequest {
                            id: 0,
                            msg: e.to_string(),
                        }
                    })?;
                let wires = buffers.iter().map(|b| (b.bytes, Wire::Bytes)).collect();
                (Some(buffers), wires)
            }
            None => {
                let mut wires = Vec::with_capacity(tensors.len());
                for t in tensors {
                    let bytes = t.bytes().ok_or_else(|| ModelError::BadRequest {
                        id: 0,
                        msg: format!("tensor {:?}: shape {:?} overflows", t.name, t.shape),
                    })?;
                    wires.push((bytes, Wire::Elements(t.dtype)));
                }
                (None, wires)
            }
        };
        let Some((_, g)) = &mut self.updates.group else {
            return Err(ModelError::Unavailable(
                "no weight-update group: init it first".into(),
            ));
        };
        let received = g
            .slot
            .joined(rank, timeout)?
            .receive(&wires, root, timeout)
            .map_err(berr)?;
        // The trainer passes vLLM's barrier after its broadcasts (TRL's client does after
        // each tensor), and waits for every member there.
        g.barrier(rank, timeout)?;
        let total: usize = wires.iter().map(|w| w.0).sum();
        let seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            rank,
            tensors = tensors.len(),
            broadcasts = wires.len(),
            bytes = total,
            receive_seconds = seconds,
            gb_per_s = total as f64 / seconds.max(1e-9) / 1e9,
            "received tensors from the trainer into device memory"
        );
        let mut device = Vec::with_capacity(tensors.len());
        match buffers {
            // vLLM's packed layout: each buffer holds many tensors back to back
            // (`batching::packed`); each tensor is a range of its buffer, which is freed
            // once every tensor in it has been cut.
            Some(buffers) => {
                for (b, bytes) in buffers.iter().zip(received) {
                    let list = &tensors[b.tensors.clone()];
                    let ranges =
                        crate::batching::packed::unpack(bytes.len(), list).map_err(|e| {
                            ModelError::BadRequest {
                                id: 0,
                                msg: e.to_string(),
                            }
                        })?;
                    for (t, range) in list.iter().zip(ranges) {
                        let d =
                            staged(NCCL_LABEL, &t.name, t.dtype, t.shape.clone(), &bytes, range)?;
                        device.push((t.name.clone(), d));
                    }
                }
            }
            None => {
                for (t, bytes) in tensors.iter().zip(received) {
                    let range = 0..bytes.len();
                    let d = staged(NCCL_LABEL, &t.name, t.dtype, t.shape.clone(), &bytes, range)?;
                    device.push((t.name.clone(), d));
                }
            }
        }
        self.stage(Vec::new(), device, NCCL_LABEL)
    }

    /// prime-rl's layout (`batching::in_band`): the count, then per state dict its pickled
    /// tensor list and one buffer per dtype. Every rank receives every broadcast (NCCL's
    /// broadcast reaches all members) and reads the count and the lists on the host
    /// itself, so the ranks agree without talking; each dtype's buffer stays in device
    /// memory, its tensors ranges of it.
    pub(super) fn receive_in_band(
        &mut self,
        group: &str,
        timeout: Duration,
        max_bytes: usize,
    ) -> MResult<()> {
        let rank = self.backend.rank();
        match &self.updates.group {
            Some((name, _)) if name == group => {}
            _ => {
                return Err(ModelError::Unavailable(format!(
                    "no weight-update group {group:?}: init_broadcaster first"
                )))
            }
        }
        self.make_room_for_staging()?;
        let Some((_, g)) = &mut self.updates.group else {
            return Err(ModelError::Unavailable(
                "no weight-update group: init_broadcaster first".into(),
            ));
        };
        let root = g.root;
        let joined = g.slot.joined(rank, timeout)?;
        let t0 = std::time::Instant::now();
        let received = crate::batching::in_band::receive(
            |w| {
                let wire = match w.dtype() {
                    Some(dtype) => Wire::Elements(dtype),
                    None => Wire::Bytes,
                };
                let mut got = joined.receive(&[(w.bytes(), wire)], root, timeout)?;
                got.pop()
                    .ok_or_else(|| crate::backend::BackendError::Device {
                        rank,
                        msg: "the weight-update group received nothing".into(),
                    })
            },
            max_bytes,
        )
        .map_err(|e| match e {
            crate::batching::in_band::InBandError::Receive { cause, .. } => ModelError::Backend {
                rank,
                source: cause,
            },
            other => ModelError::BadRequest {
                id: 0,
                msg: other.to_string(),
            },
        })?;
        let (mut device, mut total) = (Vec::new(), 0usize);
        for r in received {
            let parts = r
                .parts()
                .map_err(|msg| ModelError::BadRequest { id: 0, msg })?;
            total += r.bytes.len();
            for part in parts {
                let d = staged(
                    IN_BAND_LABEL,
                    &part.name,
                    part.dtype,
                    part.shape,
                    &r.bytes,
                    part.data,
                )?;
                device.push((part.name, d));
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            rank,
            tensors = device.len(),
            bytes = total,
            receive_seconds = seconds,
            gb_per_s = total as f64 / seconds.max(1e-9) / 1e9,
            "received a prime-rl update from the trainer into device memory"
        );
        self.stage(Vec::new(), device, IN_BAND_LABEL)
    }
}
