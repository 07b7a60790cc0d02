//! What a front end and the serving loop say to each other: the control operations and
//! their replies, and the events of a request's sequences.

use std::path::PathBuf;
use std::sync::Arc;

use arbor_model::batching::{Record, Rendezvous, TensorMeta};
use arbor_model::runner::weights_update::FailureKind;
use arbor_model::FinishReason;

/// What happens to the requests in flight when the weights change or generation pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Requests that have started finish on the old weights first (new ones wait).
    Wait,
    /// Requests that have started are re-run from their prompt after the update.
    Retract,
    /// Every request in flight ends now (finish_reason "abort").
    Abort,
}

/// How a pause (`pause_generation`) treats the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// They end (finish_reason "abort").
    Abort,
    /// They go back to the queue and run again from their prompt after the pause.
    Retract,
    /// They keep their place and their KV, and continue after the pause.
    InPlace,
}

/// Whether the staged tensors replace the weights after a part is staged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// Not yet: more parts follow, and a later call commits.
    No,
    /// Now: every tensor the model reads must be staged by then.
    Now(UpdateReq),
    /// As soon as every tensor the model reads is staged (SGLang's clients send a
    /// checkpoint in buckets without saying which is the last).
    WhenComplete(UpdateReq),
}

/// A new checkpoint's source and what to do with the requests in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateReq {
    /// The version the new weights report (default: the number of updates so far).
    pub version: Option<String>,
    pub policy: Policy,
}

/// A weight, memory or generation-control operation (SGLang's names in docs/rl.md). Each
/// runs between two steps, on every rank, and changes nothing where it cannot apply.
#[derive(Debug)]
pub enum ControlOp {
    /// New weights from a checkpoint on disk (`update_weights_from_disk`).
    FromDisk { path: PathBuf, update: UpdateReq },
    /// One part of a push (a safetensors image, `update_weights_from_tensor`), and when
    /// the staged tensors replace the weights.
    Stage { bytes: Vec<u8>, commit: Commit },
    /// One part of a push handed over by CUDA IPC handle (`serialized_named_tensors`):
    /// rank `i` reads `ranks[i]`.
    StageIpc {
        ranks: Vec<Vec<arbor_model::batching::ipc::IpcBuffer>>,
        commit: Commit,
    },
    /// The staged tensors replace the weights (a commit without a part).
    Commit(UpdateReq),
    /// The end of an update whose parts commit once complete (vLLM's
    /// `finish_weight_update`): commits what is staged; with nothing staged (the last
    /// part applied it), nothing to do.
    Finish(UpdateReq),
    /// Drop the staged tensors.
    Discard,
    /// Join a trainer's NCCL group (`init_weights_update_group`).
    InitGroup {
        name: String,
        rendezvous: Rendezvous,
        world: usize,
        rank_offset: usize,
        timeout_s: f64,
    },
    /// Receive tensors the trainer broadcasts and stage them; then commit as `commit` says
    /// (`update_weights_from_distributed`).
    Receive {
        group: String,
        tensors: Vec<TensorMeta>,
        timeout_s: f64,
        /// vLLM's packed layout with this buffer size (`ControlMsg::Receive`).
        packed: Option<usize>,
        commit: Commit,
    },
    /// Receive one update in prime-rl's layout, its tensor list in band
    /// (`ControlMsg::ReceiveInBand`), and stage it; then commit as `commit` says.
    ReceiveInBand {
        group: String,
        timeout_s: f64,
        max_bytes: usize,
        commit: Commit,
    },
    /// Leave the trainer's group (`destroy_weights_update_group`).
    DestroyGroup { name: String },
    /// Stop stepping (`pause_generation`).
    Pause(PauseMode),
    /// Step again (`continue_generation`).
    Continue,
    /// End the requests named `rid`; `None`: every request (`abort_request`).
    Abort { rid: Option<String> },
    /// Free the weights and/or the KV cache (`release_memory_occupation`).
    Release { weights: bool, kv: bool },
    /// Load them again, the weights from `from` when given (`resume_memory_occupation`).
    Resume {
        weights: bool,
        kv: bool,
        from: Option<PathBuf>,
        version: Option<String>,
    },
    /// Drop the cached state that depends on the weights (`flush_cache`).
    FlushCache,
    /// Rename the serving weights (`update_weight_version`): the weights stay, only the
    /// version responses report changes; `abort_all` ends the requests in flight first.
    SetVersion { version: String, abort_all: bool },
}

/// The loop's answer to a control operation: the reply's fields (a JSON object with
/// `"success": true`), or why nothing was done.
pub type ControlReply = Result<serde_json::Value, Refusal>;

/// A control operation that was not carried out; nothing changed on any rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub kind: RefusalKind,
    pub message: String,
}

/// Why an operation was refused (a front end maps it to its statuses: HTTP 400, 409, 500,
/// 503).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The operation's input is wrong: a bad checkpoint or tensor, nothing staged.
    Input,
    /// The server's state does not allow it now: another update waits, requests run, a
    /// push is staged, the memory is released.
    Conflict,
    /// A device or transport failed on some rank.
    Failed,
    /// The loop cannot take it: it is draining or stopped, or an update waited too long.
    Unavailable,
}

impl Refusal {
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Self {
        Refusal {
            kind,
            message: message.into(),
        }
    }
}

impl From<FailureKind> for RefusalKind {
    fn from(k: FailureKind) -> Self {
        match k {
            FailureKind::Input => RefusalKind::Input,
            FailureKind::State => RefusalKind::Conflict,
            FailureKind::Server => RefusalKind::Failed,
        }
    }
}

/// From the serving loop to a request's consumer, for one of its choices.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// The sequence runs (first step), on these weights.
    Started {
        weight_version: Arc<str>,
    },
    Scored(Vec<Record>),
    Token(Record),
    Finished(FinishReason),
    /// The sequence ended before finishing (an abort, a pause with mode abort, an update
    /// with policy abort).
    Aborted {
        weight_version: Arc<str>,
    },
    /// Everything sent for this choice so far is void: it runs again from its prompt
    /// (on the weights its next `Started` names). Its stream's cancel flag is a new one
    /// from here on: a cancel meant for the void run does not stop the new one.
    Restart,
    /// The experts positions `pos0..` were routed to (`Event::Routed`), before that step's
    /// token.
    Routed {
        pos0: usize,
        experts: Vec<u32>,
    },
    /// Not run (or stopped): the message says why. `shutting_down`: the loop is draining
    /// or has stopped (else the request itself could not be admitted).
    Refused {
        shutting_down: bool,
        msg: String,
    },
}
