//! Commands that change what every rank serves with, not what it computes: new weights
//! (from disk, pushed over HTTP, or broadcast over NCCL by a trainer), memory released
//! and resumed, caches dropped. Rank 0 broadcasts each one in place of a step plan
//! (`PlanMsg::Control`), every rank runs it in two phases (`runner::weights_update`), and
//! all ranks end in the same state.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ipc::IpcBuffer;
use crate::safetensors::DType;

/// Where the weights of an update come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateSource {
    /// An HF model directory (config.json and safetensors), as `--model` takes.
    Disk(PathBuf),
    /// The tensors staged by `Stage` / `Receive` since the last update.
    Staged,
}

/// One tensor a trainer broadcasts over the NCCL group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorMeta {
    /// Bytes on the wire (`None` on overflow).
    pub fn bytes(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// How every rank learns the unique id of a trainer's NCCL group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rendezvous {
    /// The trainer made the 128-byte `ncclUniqueId` and passed it over HTTP.
    UniqueId(Vec<u8>),
    /// Each rank reads it from the trainer's torch `TCPStore` at `host:port`, under
    /// `key` (as torch's Python names it), where the group's rank 0 sets it.
    Store {
        host: String,
        port: u16,
        key: String,
        format: IdFormat,
    },
    /// arbor's rank 0 is the group's rank 0 of a vLLM `StatelessProcessGroup` (the trainer
    /// takes the last rank, as TRL's vLLM client does): it runs the group's `TCPStore` on
    /// `host:port`, makes the NCCL id and publishes it pickled under
    /// `broadcast_from/0/0`; every rank takes part in vLLM's store barrier after each
    /// broadcast it receives.
    Serve { host: String, port: u16 },
}

/// How the id is written under a store key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdFormat {
    /// The 128 bytes (torch's `ProcessGroupNCCL`).
    Raw,
    /// vLLM's `StatelessProcessGroup.broadcast_obj` of the `ncclUniqueId` ctypes struct
    /// (a pickle), by `PyNcclCommunicator`, which then warms the communicator up with a
    /// one-element all-reduce every member takes part in.
    VllmPickle,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ControlMsg {
    /// Stage the tensors of a safetensors image (one part of a push); `label` names it
    /// in errors.
    Stage { label: String, bytes: Vec<u8> },
    /// Receive `tensors`, in order, from the trainer over the NCCL group `group`, and
    /// stage them: one broadcast per tensor, or with `packed` (vLLM's
    /// `packed_buffer_size_bytes`) in `uint8` buffers of many tensors ([`super::packed`]).
    Receive {
        group: String,
        tensors: Vec<TensorMeta>,
        timeout_s: f64,
        packed: Option<usize>,
    },
    /// Receive one update in prime-rl's layout ([`super::in_band`]: the tensor list
    /// travels pickled in band) from the trainer over the NCCL group `group`, and stage
    /// it; `max_bytes` bounds each broadcast of tensors.
    ReceiveInBand {
        group: String,
        timeout_s: f64,
        max_bytes: usize,
    },
    /// Stage the tensors a trainer on the same GPUs hands over by CUDA IPC handle
    /// (`update_weights_from_tensor` with `serialized_named_tensors`): rank `i` reads
    /// `ranks[i]`.
    StageIpc { ranks: Vec<Vec<IpcBuffer>> },
    /// Drop the staged tensors.
    Discard,
    /// Replace the weights (every tensor the model reads) and drop the caches.
    Update(UpdateSource),
    /// Free the weights and/or the KV cache.
    Release { weights: bool, kv: bool },
    /// Load the weights again (from `from`, else from the directory they last came from)
    /// and/or allocate the KV cache again; what is already there stays.
    Resume {
        weights: bool,
        kv: bool,
        from: Option<PathBuf>,
    },
    /// Drop cached state that depends on the weights (recorded steps; a prefix cache).
    FlushCache,
    /// Join the trainer's NCCL group `name` as rank `rank_offset + rank` of `world`.
    JoinGroup {
        name: String,
        rendezvous: Rendezvous,
        world: usize,
        rank_offset: usize,
        timeout_s: f64,
    },
    /// Leave the NCCL group `name`.
    LeaveGroup { name: String },
}

impl ControlMsg {
    /// A short name for logs and errors.
    pub fn what(&self) -> &'static str {
        match self {
            ControlMsg::Stage { .. } => "staging pushed tensors",
            ControlMsg::Receive { .. } | ControlMsg::ReceiveInBand { .. } => {
                "receiving tensors over NCCL"
            }
            ControlMsg::StageIpc { .. } => "staging tensors handed over by CUDA IPC",
            ControlMsg::Discard => "discarding staged tensors",
            ControlMsg::Update(UpdateSource::Disk(_)) => "updating the weights from disk",
            ControlMsg::Update(UpdateSource::Staged) => "updating the weights from pushed tensors",
            ControlMsg::Release { .. } => "releasing memory",
            ControlMsg::Resume { .. } => "resuming memory",
            ControlMsg::FlushCache => "flushing the cache",
            ControlMsg::JoinGroup { .. } => "joining the weight-update group",
            ControlMsg::LeaveGroup { .. } => "leaving the weight-update group",
        }
    }
}
