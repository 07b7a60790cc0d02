//! The messages between the HTTP side and the engine loop: both sides name them, neither
//! owns them.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arbor_model::engine::{Record, SeqSpec, TensorMeta};
use arbor_model::FinishReason;
use tokio::sync::mpsc::Sender;

/// One request: its choices run as sequences, all on one weight version.
pub struct Submission {
    /// The request's id (`rid`, or `cmpl-N`): what `/abort_request` names.
    pub rid: String,
    /// One per choice; a choice's index is its tag in the events.
    pub choices: Vec<SubmitChoice>,
    /// Bounded: a request whose handler falls that far behind (a streaming client that
    /// does not read) has its sequences cancelled, never waited for.
    pub events: Sender<(usize, SeqEvent)>,
}

pub struct SubmitChoice {
    pub spec: SeqSpec,
    /// Set by the handler to stop the sequence (a stop string matched); set by the engine
    /// when it cancelled the sequence because an event could not be delivered.
    pub cancel: Arc<AtomicBool>,
}

/// From the HTTP side to the engine loop.
pub enum Cmd {
    Submit(Submission),
    /// SIGTERM: finish what runs (up to the drain timeout), then stop.
    Drain,
    /// A weight, memory or generation-control command; the engine answers on `reply`.
    Control {
        op: ControlOp,
        reply: tokio::sync::oneshot::Sender<ControlReply>,
    },
}

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

/// How `/pause_generation` treats the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// They end (finish_reason "abort").
    Abort,
    /// They go back to the queue and run again from their prompt after the pause.
    Retract,
    /// They keep their place and their KV, and continue after the pause.
    InPlace,
}

/// A new checkpoint's source and what to do with the requests in flight.
#[derive(Debug, Clone)]
pub struct UpdateReq {
    /// The version the new weights report (default: the number of updates so far).
    pub version: Option<String>,
    pub policy: Policy,
}

pub enum ControlOp {
    /// `/update_weights_from_disk`.
    FromDisk {
        path: PathBuf,
        update: UpdateReq,
    },
    /// `/update_weights_from_tensor`: one part of a push (a safetensors image), and
    /// whether it is the last (then the staged tensors replace the weights).
    Stage {
        bytes: Vec<u8>,
        commit: Option<UpdateReq>,
    },
    /// The staged tensors replace the weights (`commit` without a body).
    Commit(UpdateReq),
    /// Drop the staged tensors.
    Discard,
    InitGroup {
        name: String,
        unique_id: Vec<u8>,
        world: usize,
        rank_offset: usize,
        timeout_s: f64,
    },
    /// `/update_weights_from_distributed`: receive and stage; then commit if asked.
    Receive {
        group: String,
        tensors: Vec<TensorMeta>,
        timeout_s: f64,
        commit: Option<UpdateReq>,
    },
    DestroyGroup {
        name: String,
    },
    Pause(PauseMode),
    Continue,
    /// `None`: every request.
    Abort {
        rid: Option<String>,
    },
    Release {
        weights: bool,
        kv: bool,
    },
    Resume {
        weights: bool,
        kv: bool,
        from: Option<PathBuf>,
        version: Option<String>,
    },
    FlushCache,
}

/// The engine's answer: a JSON body for 200, or a status and message.
pub type ControlReply = Result<serde_json::Value, (u16, String)>;

/// From the engine loop to one request's handler.
#[derive(Debug)]
pub enum SeqEvent {
    /// The sequence runs (first step), on these weights.
    Started {
        weight_version: Arc<str>,
    },
    Scored(Vec<Record>),
    Token(Record),
    Finished(FinishReason),
    /// The sequence ended before finishing (`/abort_request`, `/pause_generation` with
    /// mode abort, an update with policy abort).
    Aborted {
        weight_version: Arc<str>,
    },
    /// Everything sent for this choice so far is void: it runs again from its prompt
    /// (on the weights its next `Started` names). `cancel` replaces the choice's flag.
    Restart {
        cancel: Arc<AtomicBool>,
    },
    /// Not run (or stopped): the message says why.
    Refused {
        shutting_down: bool,
        msg: String,
    },
}
