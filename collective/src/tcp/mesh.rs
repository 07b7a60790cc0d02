//! The mesh: rank j connects to every rank 0 < i < j and accepts the ranks above it.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Instant;

use super::gate::{connect_authenticated, Gate};
use super::link::read_error;
use super::TcpComm;
use crate::auth::{Purpose, Security};
use crate::env::Timeouts;
use crate::wire::{self, Kind, MeshHello, ReadError, Welcome};
use crate::CommError;

impl TcpComm {
    /// Connects to ranks 1..rank, accepts ranks rank+1..world.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open_mesh(
        rank: usize,
        world: usize,
        welcome: &Welcome,
        listener: TcpListener,
        links: &mut [Option<TcpStream>],
        deadline: Instant,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<(), CommError> {
        for (i, addr) in welcome.peers.iter().enumerate().take(rank).skip(1) {
            let target: SocketAddr = addr.parse().map_err(|_| CommError::Protocol {
                rank,
                peer: "rank 0".into(),
                detail: format!("welcome gives rank {i} the address {addr:?}"),
            })?;
            let name = format!("rank {i} at {addr}");
            let mut s = connect_authenticated(
                rank,
                &[target],
                &name,
                &name,
                Purpose::Mesh,
                security.token.as_ref(),
                deadline,
                timeouts.rendezvous,
            )?;
            wire::write_msg(
                &mut s,
                Kind::MeshHello,
                rank,
                &MeshHello {
                    session: welcome.session,
                },
            )
            .map_err(|e| CommError::PeerDisconnected {
                rank,
                peer: i,
                context: format!("while opening the link to {addr} ({e})"),
            })?;
            links[i] = Some(s);
        }
        let here = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let io_err = |e: io::Error| CommError::Io {
            rank,
            context: format!("accepting links on {here}"),
            source: e,
        };
        let mut waiting = world - rank - 1;
        if waiting == 0 {
            return Ok(());
        }
        let mut gate = Gate::new(
            listener,
            rank,
            Purpose::Mesh,
            security.token.clone(),
            deadline,
        )
        .map_err(io_err)?;
        while waiting > 0 {
            if let Some((s, addr, res)) = gate.poll().map_err(io_err)? {
                let peer = format!("connection from {addr}");
                let frame = match res {
                    Ok(f) => f,
                    Err(ReadError::TimedOut) => continue,
                    Err(e) => {
                        return Err(read_error(
                            rank,
                            usize::MAX,
                            &peer,
                            e,
                            "while opening the mesh",
                        ))
                    }
                };
                let j = frame.rank;
                let hello: MeshHello = if frame.kind == Kind::MeshHello {
                    wire::decode_msg(&frame).map_err(|detail| CommError::Protocol {
                        rank,
                        peer: peer.clone(),
                        detail,
                    })?
                } else {
                    return Err(CommError::Protocol {
                        rank,
                        peer,
                        detail: format!("expected a mesh hello, got a {:?} frame", frame.kind),
                    });
                };
                if hello.session != welcome.session {
                    // A rank of an earlier group with the same token and ports: not ours,
                    // and no reason to fail this group.
                    tracing::warn!(
                        "rank {rank}: refused a link from {addr}: it belongs to another arbor \
                         group (session id differs)"
                    );
                    continue;
                }
                if j <= rank || j >= world || links[j].is_some() {
                    return Err(CommError::Protocol {
                        rank,
                        peer,
                        detail: format!(
                            "claims rank {j}, which may not connect here (world {world})"
                        ),
                    });
                }
                links[j] = Some(s);
                waiting -= 1;
            } else if Instant::now() >= deadline {
                let missing: Vec<usize> =
                    (rank + 1..world).filter(|&j| links[j].is_none()).collect();
                return Err(CommError::RendezvousTimeout {
                    rank,
                    addr: here,
                    timeout: timeouts.rendezvous,
                    missing,
                    refused: gate.refusals(),
                });
            }
        }
        Ok(())
    }
}

pub(super) fn abort_links(links: &mut [Option<TcpStream>], rank: usize, err: &CommError) {
    let reason = err.to_string();
    for s in links.iter_mut().flatten() {
        let _ = wire::write_frame(s, Kind::Abort, rank, 0, 0, reason.as_bytes());
    }
}
