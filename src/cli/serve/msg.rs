//! The messages between the HTTP side and the engine loop: both sides name them, neither
//! owns them.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arbor_model::engine::{Record, SeqSpec};
use arbor_model::FinishReason;
use tokio::sync::mpsc::Sender;

/// From the HTTP side to the engine loop.
pub enum Cmd {
    Submit {
        spec: SeqSpec,
        /// Which choice of its request (events carry it back).
        tag: usize,
        /// Bounded: a request whose handler falls that far behind (a streaming client
        /// that does not read) has its sequences cancelled, never waited for.
        events: Sender<(usize, SeqEvent)>,
        /// Set by the handler to stop the sequence (a stop string matched); set by the
        /// engine when it cancelled the sequence because `events` was full.
        cancel: Arc<AtomicBool>,
    },
    /// SIGTERM: finish what runs (up to the drain timeout), then stop.
    Drain,
}

/// From the engine loop to one request's handler.
#[derive(Debug)]
pub enum SeqEvent {
    Scored(Vec<Record>),
    Token(Record),
    Finished(FinishReason),
    /// Not run (or stopped): the message says why.
    Refused {
        shutting_down: bool,
        msg: String,
    },
}
