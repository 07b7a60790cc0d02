//! The communicator of a world of one rank: every collective is the identity.

use crate::{CommError, Communicator};

/// World size 1 (TP = 1): no peers, no sockets.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleComm;

impl Communicator for SingleComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<u8>, CommError> {
        Ok(data.to_vec())
    }
    fn broadcast_bytes(&self, _data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root != 0 {
            return Err(CommError::InvalidArgument {
                rank: 0,
                detail: format!("broadcast root {root} is not a rank of a world of 1"),
            });
        }
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn transport(&self) -> &'static str {
        "single"
    }
}
