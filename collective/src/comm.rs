//! The `Communicator` trait every transport implements. The typed helpers at the end are
//! provided methods built on the byte operations: a transport does not implement them.

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
    /// This is also how the GPU side ships an NCCL unique id from rank 0 to the others.
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError>;

    fn barrier(&self) -> Result<(), CommError>;

    /// A short name for logs and reports ("inproc", "tcp", "mpi").
    fn transport(&self) -> &'static str;

    /// Gathers `data` from every rank as f32 (little-endian on the wire, so hosts of any
    /// byte order agree); returns the ranks' slices concatenated in rank order. Values
    /// travel bit for bit: NaN payloads and signed zeros survive.
    fn all_gather_f32(&self, data: &[f32]) -> Result<Vec<f32>, CommError> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let gathered = self.all_gather_bytes(&bytes)?;
        Ok(gathered
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Gathers one u64 per rank (e.g. a digest of a result), in rank order.
    fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>, CommError> {
        let gathered = self.all_gather_bytes(&value.to_le_bytes())?;
        Ok(gathered
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
}
