//! A second TCP group of the same ranks, set up through the first: rank 0 opens a
//! rendezvous listener on an ephemeral port of MASTER_ADDR and broadcasts the port over the
//! parent group; the others join it. For traffic issued from another thread than the
//! parent's (the host-staged GPU collectives run inside CUDA host functions while the
//! rank's main thread may use the parent), so that the two never interleave on one link.

use super::rendezvous::bind_rendezvous;
use super::TcpComm;
use crate::auth::Security;
use crate::env::{RankInfo, Timeouts};
use crate::{CommError, Communicator};

impl TcpComm {
    /// Collective over `parent`: every rank calls it. `info` gives the rendezvous host
    /// (its port is not used: rank 0 picks a free one).
    pub fn side_channel(
        parent: &dyn Communicator,
        info: &RankInfo,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<TcpComm, CommError> {
        let rank = parent.rank();
        let world = parent.world_size();
        if world < 2 {
            return Err(CommError::InvalidArgument {
                rank,
                detail: format!("a side channel needs at least 2 ranks, got {world}"),
            });
        }
        if rank == 0 {
            let mut at = info.clone();
            at.master_port = 0;
            let bound = bind_rendezvous(&at, security).and_then(|l| {
                let port = l.local_addr().map_err(|e| CommError::Io {
                    rank,
                    context: "reading the side channel's port".into(),
                    source: e,
                })?;
                Ok((l, port.port()))
            });
            // Sent even when binding failed (empty), so that the others fail at once
            // instead of waiting for a rendezvous that never opens.
            let mut msg = match &bound {
                Ok((_, port)) => port.to_le_bytes().to_vec(),
                Err(_) => Vec::new(),
            };
            parent.broadcast_bytes(&mut msg, 0)?;
            let (listener, _) = bound?;
            Self::serve(listener, world, timeouts, security)
        } else {
            let mut msg = Vec::new();
            parent.broadcast_bytes(&mut msg, 0)?;
            let port = match msg.as_slice() {
                [a, b] => u16::from_le_bytes([*a, *b]),
                _ => {
                    return Err(CommError::Other(format!(
                        "rank {rank}: rank 0 could not open the side channel's listener on {} \
                         (its error says why)",
                        info.master_addr
                    )))
                }
            };
            let target = format!("{}:{port}", info.master_addr);
            Self::join(rank, world, &target, timeouts, security)
        }
    }
}
