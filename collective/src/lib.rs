//! arbor's collective layer.
//!
//! `Communicator` moves host bytes between ranks; `tree_all_reduce` builds the
//! deterministic all-reduce of the invariance contract on top of it: every rank
//! contributes the f32 subtree root of its segments, all ranks all-gather the roots, and
//! each finishes the same fixed tree, so all ranks hold the same bits, equal to the
//! single-process tree over the same 8 segments.
//!
//! Entry point for a worker process: [`init_from_env`] reads its rank from the launcher's
//! variables ([`env`]) and returns a connected communicator.

pub mod auth;
pub mod comm;
pub mod device_map;
pub mod env;
mod error;
pub mod gpu;
pub mod inproc;
mod message_passing;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
pub mod pickle;
pub mod pickled_id;
pub mod single;
pub mod stateless_group;
pub mod store_server;
pub mod tcp;
pub mod tcp_store;
pub mod tree_allreduce;
pub mod wire;

use std::sync::Arc;

pub use auth::{JobToken, Security};
pub use comm::Communicator;
pub use env::{RankInfo, Timeouts};
pub use error::CommError;
pub use inproc::{InProcComm, InProcGroup};
pub use single::SingleComm;
pub use tcp::TcpComm;
pub use tree_allreduce::tree_all_reduce;

/// Connects this process to its group: rank and world size from the launcher's variables
/// (RANK/WORLD_SIZE…, OpenMPI, PMI or Slurm; see [`env`]), rendezvous at
/// MASTER_ADDR:MASTER_PORT, timeouts from ARBOR_TIMEOUT_SECS / ARBOR_OP_TIMEOUT_SECS, the job
/// token from ARBOR_JOB_TOKEN / ARBOR_JOB_TOKEN_FILE and ARBOR_BIND_ALL (see [`auth`]).
/// World size 1 (nothing set) needs no network. Returns the communicator and where this
/// process sits (local rank for the GPU choice).
pub fn init_from_env() -> Result<(Arc<dyn Communicator>, RankInfo), CommError> {
    // With feature `mpi`, under mpirun: rank, size and every collective through MPI.
    #[cfg(feature = "mpi")]
    if mpi::under_mpirun() {
        return mpi::init_from_mpi();
    }
    let info = RankInfo::from_env()?;
    let timeouts = Timeouts::from_env()?;
    let security = Security::from_env()?;
    let comm = connect(&info, timeouts, &security)?;
    Ok((comm, info))
}

/// A second group of `parent`'s ranks over TCP sockets of its own, for traffic sent from
/// another thread than `parent`'s (see [`tcp::TcpComm::side_channel`]); the rendezvous
/// host, timeouts and job token come from the same variables as [`init_from_env`]'s.
/// Collective: every rank of `parent` calls it.
pub fn side_channel(parent: &dyn Communicator) -> Result<Arc<dyn Communicator>, CommError> {
    if parent.world_size() == 1 {
        return Ok(Arc::new(SingleComm));
    }
    let info = RankInfo::from_env()?;
    let timeouts = Timeouts::from_env()?;
    let security = Security::from_env()?;
    Ok(Arc::new(TcpComm::side_channel(
        parent, &info, timeouts, &security,
    )?))
}

/// Like [`init_from_env`] with the rank, timeouts and security settings given.
pub fn connect(
    info: &RankInfo,
    timeouts: Timeouts,
    security: &Security,
) -> Result<Arc<dyn Communicator>, CommError> {
    tracing::debug!(
        rank = info.rank,
        world = info.world_size,
        source = info.source,
        master = %format!("{}:{}", info.master_addr, info.master_port),
        "joining the group"
    );
    if info.world_size == 1 {
        return Ok(Arc::new(SingleComm));
    }
    Ok(Arc::new(TcpComm::connect(info, timeouts, security)?))
}
