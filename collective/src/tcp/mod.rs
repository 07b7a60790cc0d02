//! The TCP transport: one process per rank, a full mesh of sockets (fine up to 8 ranks).
//!
//! Setup, in [`TcpComm::connect`]:
//! 1. Rank 0 listens on MASTER_PORT at the address MASTER_ADDR resolves to (loopback for a
//!    job on one host), or on every interface with ARBOR_BIND_ALL=1, and serves the
//!    rendezvous.
//! 2. Every other rank connects to MASTER_ADDR:MASTER_PORT (retrying until rank 0 is up),
//!    opens a data listener on an ephemeral port of the local address that connection
//!    uses, proves the job token (see [`crate::auth`]) and sends a `Hello` (rank, world
//!    size, data port).
//! 3. When all have arrived, rank 0 answers each with a `Welcome`: the session id and every
//!    rank's data address, made of the IP rank 0 saw the rank connect from (an address
//!    that demonstrably routes, never a guessed 127.0.0.1) and its data port. The
//!    rendezvous connection itself stays as the link between rank 0 and that rank.
//! 4. Rank j connects to every rank 0 < i < j, proves the token again and introduces itself
//!    with a `MeshHello`; then a barrier over the whole mesh confirms every link.
//!
//! Every incoming connection is handled on its own thread with a short deadline: a
//! stranger that sends garbage, nothing, or a wrong token is turned away (and logged)
//! while the listener keeps waiting for the real ranks. Only a peer that passed the token
//! check can make the group fail (a wrong WORLD_SIZE, a rank claimed twice).
//!
//! Every wait has a deadline (ARBOR_TIMEOUT_SECS). On any failure rank 0 sends an `Abort`
//! with the reason to every rank that arrived, so all of them fail with the same message.
//! After setup each link has a reader thread that drains frames into a channel, so sends
//! never deadlock; collective operations time out after ARBOR_OP_TIMEOUT_SECS.
//!
//! Files: the rendezvous (rendezvous.rs: rank 0 serves it, the others join), the mesh of
//! links between ranks > 0 (mesh.rs), the gate every incoming connection passes and the
//! job-token handshake (gate.rs), the links after setup (link.rs: framing, the reader
//! threads, the errors a read maps to), addressing (net.rs), and a second group of the same
//! ranks set up through a first one (side.rs).

mod gate;
mod link;
mod mesh;
mod net;
mod rendezvous;
mod side;
#[cfg(test)]
mod tests;

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;
use std::thread;

use crossbeam::channel::{unbounded, Receiver};

use crate::auth::Security;
use crate::env::{RankInfo, Timeouts};
use crate::message_passing::{message_communicator, Incoming, MessageCollectives};
use crate::CommError;
use link::{read_loop, TcpOutbox};
use rendezvous::{bind_rendezvous, warn_unauthenticated};

/// One rank of a TCP group.
pub struct TcpComm {
    collectives: MessageCollectives<TcpOutbox>,
    /// The links, kept to shut them down on drop (which ends the reader threads).
    streams: Vec<Option<TcpStream>>,
}

impl TcpComm {
    /// Joins (rank > 0) or serves (rank 0) the rendezvous at `info.master_addr:master_port`
    /// and opens the mesh.
    pub fn connect(
        info: &RankInfo,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<TcpComm, CommError> {
        let target = format!("{}:{}", info.master_addr, info.master_port);
        if info.rank == 0 && security.token.is_none() {
            warn_unauthenticated(&target);
        }
        if info.rank == 0 {
            let listener = bind_rendezvous(info, security)?;
            Self::serve(listener, info.world_size, timeouts, security)
        } else {
            Self::join(info.rank, info.world_size, &target, timeouts, security)
        }
    }

    /// Starts the reader threads and confirms the mesh with a barrier.
    fn finish(
        rank: usize,
        world: usize,
        links: Vec<Option<TcpStream>>,
        timeouts: Timeouts,
    ) -> Result<TcpComm, CommError> {
        let mut writers: Vec<Option<Mutex<TcpStream>>> = (0..world).map(|_| None).collect();
        let mut inbox: Vec<Option<Receiver<Incoming>>> = (0..world).map(|_| None).collect();
        for (peer, link) in links.iter().enumerate() {
            let Some(s) = link else { continue };
            let io_err = |e: io::Error| CommError::Io {
                rank,
                context: format!("setting up the link to rank {peer}"),
                source: e,
            };
            s.set_nodelay(true).map_err(io_err)?;
            s.set_nonblocking(false).map_err(io_err)?;
            s.set_read_timeout(None).map_err(io_err)?;
            s.set_write_timeout(Some(timeouts.op)).map_err(io_err)?;
            writers[peer] = Some(Mutex::new(s.try_clone().map_err(io_err)?));
            let reader = s.try_clone().map_err(io_err)?;
            let (tx, rx) = unbounded();
            thread::Builder::new()
                .name(format!("arbor-rx-{peer}"))
                .spawn(move || read_loop(rank, peer, reader, tx))
                .map_err(|e| CommError::Io {
                    rank,
                    context: format!("starting the reader thread for rank {peer}"),
                    source: e,
                })?;
            inbox[peer] = Some(rx);
        }
        let comm = TcpComm {
            collectives: MessageCollectives::new(
                rank,
                world,
                timeouts.op,
                TcpOutbox {
                    rank,
                    timeout: timeouts.op,
                    writers,
                },
                inbox,
            ),
            streams: links,
        };
        comm.collectives.barrier_within(timeouts.rendezvous)?;
        tracing::debug!(rank, world, "tcp mesh ready");
        Ok(comm)
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

message_communicator!(TcpComm, "tcp");
