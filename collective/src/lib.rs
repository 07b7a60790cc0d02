//! arbor's collective layer.
//!
//! `Communicator` moves host bytes between ranks; `tree_all_reduce` builds the
//! deterministic all-reduce of the invariance contract on top of it: every rank
//! contributes the f32 subtree root of its segments, all ranks all-gather the roots, and
//! each finishes the same fixed tree, so all ranks hold the same bits, equal to the
//! single-process tree over the same 8 segments.

pub mod comm;

pub use comm::Communicator;

/// Errors of the collective layer; each names the rank(s) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("{0}")]
    Other(String),
}
