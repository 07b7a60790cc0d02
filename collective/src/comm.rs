//! The `Communicator` trait every transport implements. (Interface fixed by the lead.)

use crate::CommError;

/// A group of `world_size` ranks that exchange host buffers.
///
/// Every call is collective: all ranks make the same calls in the same order with equal
/// lengths. A peer that fails, disconnects or sends garbage surfaces as an error on every
/// other rank (never a hang past the configured timeout, never a panic).
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Gathers `data` from every rank; returns the ranks' buffers concatenated in rank
    /// order (`world_size * data.len()` bytes).
    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<u8>, CommError>;

    /// Replaces `data` on every rank with `root`'s `data` (lengths may differ on entry).
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError>;

    fn barrier(&self) -> Result<(), CommError>;

    /// A short name for logs and reports ("inproc", "tcp", "mpi").
    fn transport(&self) -> &'static str;
}
