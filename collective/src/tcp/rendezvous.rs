//! The rendezvous: rank 0 serves it on MASTER_ADDR:MASTER_PORT until every rank has
//! arrived, then welcomes each with every rank's data address; the others join it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::gate::{connect_authenticated, Gate};
use super::link::read_error;
use super::mesh::abort_links;
use super::net::{resolve, split_host_port};
use super::TcpComm;
use crate::auth::{self, Purpose, Security};
use crate::env::{RankInfo, Timeouts};
use crate::wire::{self, Frame, Hello, Kind, ReadError, Welcome};
use crate::CommError;

impl TcpComm {
    /// Rank 0: serves the rendezvous on `listener` until `world - 1` ranks have arrived.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<TcpComm, CommError> {
        let deadline = Instant::now() + timeouts.rendezvous;
        let here = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let io_err = |context: &str, e: io::Error| CommError::Io {
            rank: 0,
            context: format!("{context} on the rendezvous port {here}"),
            source: e,
        };
        let mut gate = Gate::new(
            listener,
            0,
            Purpose::Rendezvous,
            security.token.clone(),
            deadline,
        )
        .map_err(|e| io_err("setting up", e))?;
        let mut arrived: Vec<Option<(TcpStream, Hello, SocketAddr)>> =
            (0..world).map(|_| None).collect();
        let mut count = 1;
        tracing::debug!(%here, world, "rank 0: serving the rendezvous");
        while count < world {
            let next = match gate.poll() {
                Ok(n) => n,
                Err(e) => {
                    let err = io_err("accepting", e);
                    abort_all(&mut arrived, &err);
                    return Err(err);
                }
            };
            if let Some((mut stream, addr, res)) = next {
                match check_hello(res, addr, world, &arrived) {
                    Ok(Some((r, hello))) => {
                        tracing::debug!(rank = r, %addr, host = %hello.host, "rank arrived");
                        arrived[r] = Some((stream, hello, addr));
                        count += 1;
                    }
                    // Proved the token, then said nothing in time: the timeout below
                    // reports the ranks that are missing.
                    Ok(None) => {}
                    Err(err) => {
                        let _ = wire::write_frame(
                            &mut stream,
                            Kind::Abort,
                            0,
                            0,
                            0,
                            err.to_string().as_bytes(),
                        );
                        abort_all(&mut arrived, &err);
                        return Err(err);
                    }
                }
            }
            if count < world && Instant::now() >= deadline {
                let missing: Vec<usize> = (1..world).filter(|&r| arrived[r].is_none()).collect();
                let err = CommError::RendezvousTimeout {
                    rank: 0,
                    addr: here.clone(),
                    timeout: timeouts.rendezvous,
                    missing,
                    refused: gate.refusals(),
                };
                abort_all(&mut arrived, &err);
                return Err(err);
            }
        }
        let session = session_id();
        let peers: Vec<String> = arrived
            .iter()
            .map(|a| match a {
                Some((_, hello, addr)) => SocketAddr::new(addr.ip(), hello.data_port).to_string(),
                None => String::new(),
            })
            .collect();
        let welcome = Welcome { session, peers };
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for r in 1..world {
            let Some((mut stream, _, _)) = arrived[r].take() else {
                continue;
            };
            if let Err(e) = wire::write_msg(&mut stream, Kind::Welcome, 0, &welcome) {
                let err = CommError::PeerDisconnected {
                    rank: 0,
                    peer: r,
                    context: format!("before it got the rendezvous welcome ({e})"),
                };
                abort_all(&mut arrived, &err);
                abort_links(&mut links, 0, &err);
                return Err(err);
            }
            links[r] = Some(stream);
        }
        Self::finish(0, world, links, timeouts)
    }

    /// Rank > 0: joins the rendezvous at `master` ("host:port") and opens the mesh.
    pub fn join(
        rank: usize,
        world: usize,
        master: &str,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<TcpComm, CommError> {
        if rank == 0 || rank >= world {
            return Err(CommError::InvalidArgument {
                rank,
                detail: format!("join needs 0 < rank < world size {world}"),
            });
        }
        let deadline = Instant::now() + timeouts.rendezvous;
        let (host, port) = split_host_port(rank, master)?;
        let addrs = resolve(rank, host, port)?;
        let peer0 = format!("rank 0 at {master}");
        let mut stream = connect_authenticated(
            rank,
            &addrs,
            master,
            &peer0,
            Purpose::Rendezvous,
            security.token.as_ref(),
            deadline,
            timeouts.rendezvous,
        )?;
        let io_err = |context: String, e: io::Error| CommError::Io {
            rank,
            context,
            source: e,
        };
        let local_ip = stream
            .local_addr()
            .map_err(|e| io_err(format!("reading the local address toward {master}"), e))?
            .ip();
        // Peers reach this rank's data port at the address rank 0 sees it connect from,
        // which is this local address: nothing needs to listen anywhere else.
        let bind_ip = if security.bind_all {
            unspecified_like(local_ip)
        } else {
            local_ip
        };
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| io_err(format!("opening the data listener on {bind_ip}"), e))?;
        let data_port = listener
            .local_addr()
            .map_err(|e| io_err("reading the data listener's port".into(), e))?
            .port();
        let hello = Hello {
            world_size: world as u32,
            data_port,
            host: host_name(),
        };
        wire::write_msg(&mut stream, Kind::Hello, rank, &hello).map_err(|e| {
            CommError::PeerDisconnected {
                rank,
                peer: 0,
                context: format!("while this rank introduced itself at {master} ({e})"),
            }
        })?;
        // Rank 0 is alive and enforces its own deadline (which began before ours could);
        // wait a little longer so that its abort message, naming the missing ranks, arrives.
        let welcome_wait = timeouts.rendezvous + Duration::from_secs(5);
        stream
            .set_read_timeout(Some(welcome_wait))
            .map_err(|e| io_err("setting a read timeout".into(), e))?;
        let frame = wire::read_frame(&mut stream, wire::MAX_CONTROL_LEN).map_err(|e| match e {
            ReadError::TimedOut => CommError::OpTimeout {
                rank,
                op: "rendezvous (waiting for rank 0's welcome)".into(),
                timeout: welcome_wait,
                missing: vec![0],
            },
            e => read_error(rank, 0, &peer0, e, "during the rendezvous"),
        })?;
        let welcome: Welcome = match frame.kind {
            Kind::Welcome => wire::decode_msg(&frame).map_err(|detail| CommError::Protocol {
                rank,
                peer: peer0.clone(),
                detail,
            })?,
            Kind::Abort => {
                return Err(CommError::PeerAborted {
                    rank,
                    peer: 0,
                    reason: String::from_utf8_lossy(&frame.payload).into_owned(),
                })
            }
            k => {
                return Err(CommError::Protocol {
                    rank,
                    peer: peer0,
                    detail: format!("expected a welcome, got a {k:?} frame"),
                })
            }
        };
        if welcome.peers.len() != world {
            return Err(CommError::Protocol {
                rank,
                peer: peer0,
                detail: format!(
                    "welcome lists {} ranks, the world size is {world}",
                    welcome.peers.len()
                ),
            });
        }
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        links[0] = Some(stream);
        let mesh = Self::open_mesh(
            rank, world, &welcome, listener, &mut links, deadline, timeouts, security,
        );
        if let Err(err) = mesh {
            abort_links(&mut links, rank, &err);
            return Err(err);
        }
        Self::finish(rank, world, links, timeouts)
    }
}

/// The address(es) rank 0's rendezvous listens on: where MASTER_ADDR resolves, unless
/// ARBOR_BIND_ALL=1.
pub(super) fn bind_rendezvous(
    info: &RankInfo,
    security: &Security,
) -> Result<TcpListener, CommError> {
    let master = resolve(0, &info.master_addr, info.master_port)?;
    let spans_hosts = info.local_world_size < info.world_size;
    let name_is_ip = info
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok();
    let candidates: Vec<SocketAddr> = if security.bind_all {
        vec![SocketAddr::new(
            unspecified_like(master[0].ip()),
            info.master_port,
        )]
    } else if spans_hosts && !name_is_ip && master.iter().all(|a| a.ip().is_loopback()) {
        // /etc/hosts often maps a machine's own name to 127.0.1.1, while the other hosts
        // resolve it to a routable address: listening on loopback would shut them out.
        tracing::warn!(
            "rank 0: MASTER_ADDR {} resolves to loopback ({}) here but ranks run on other \
             hosts: listening on every interface (the job token still guards the port)",
            info.master_addr,
            master[0].ip()
        );
        vec![SocketAddr::new(
            unspecified_like(master[0].ip()),
            info.master_port,
        )]
    } else {
        master
    };
    let mut last = None;
    for a in &candidates {
        match TcpListener::bind(a) {
            Ok(l) => {
                tracing::debug!(addr = %a, "rank 0: rendezvous listener bound");
                return Ok(l);
            }
            Err(e) => last = Some((*a, e)),
        }
    }
    let (a, e) = last.unwrap_or_else(|| {
        (
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), info.master_port),
            io::Error::other("MASTER_ADDR resolves to no address"),
        )
    });
    let hint = if e.kind() == io::ErrorKind::AddrNotAvailable {
        format!(
            "MASTER_ADDR {} is not an address of this host; set {}=1 to listen on every \
             interface",
            info.master_addr,
            auth::BIND_ALL_VAR
        )
    } else {
        "MASTER_PORT; is another group using it?".to_string()
    };
    Err(CommError::Io {
        rank: 0,
        context: format!("binding the rendezvous port {a} ({hint})"),
        source: e,
    })
}

fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// Warns, once per process, that anyone who reaches the ports can join.
pub(super) fn warn_unauthenticated(target: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "this job is unauthenticated: no {} or {} is set, so any process that can reach \
             the rendezvous at {target} can join it (arbor-launch sets a token for its ranks)",
            auth::TOKEN_VAR,
            auth::TOKEN_FILE_VAR
        )
    });
}

/// Validates a newcomer's hello; Ok(None) for a connection that timed out silently.
fn check_hello(
    res: Result<Frame, ReadError>,
    addr: SocketAddr,
    world: usize,
    arrived: &[Option<(TcpStream, Hello, SocketAddr)>],
) -> Result<Option<(usize, Hello)>, CommError> {
    let peer = format!("connection from {addr}");
    let frame = match res {
        Ok(f) => f,
        Err(ReadError::TimedOut) => return Ok(None),
        Err(e) => return Err(read_error(0, usize::MAX, &peer, e, "at the rendezvous")),
    };
    let protocol = |detail: String| CommError::Protocol {
        rank: 0,
        peer: peer.clone(),
        detail,
    };
    if frame.kind != Kind::Hello {
        return Err(protocol(format!(
            "expected a hello, got a {:?} frame",
            frame.kind
        )));
    }
    let hello: Hello = wire::decode_msg(&frame).map_err(protocol)?;
    let r = frame.rank;
    if hello.world_size as usize != world {
        return Err(protocol(format!(
            "rank {r} (host {}) has WORLD_SIZE={}, rank 0 has {world}",
            hello.host, hello.world_size
        )));
    }
    if r == 0 || r >= world {
        return Err(protocol(format!(
            "claims rank {r}, which is not a non-zero rank of a world of {world}"
        )));
    }
    if let Some((_, _, first)) = &arrived[r] {
        return Err(protocol(format!(
            "claims rank {r}, already taken by {first}"
        )));
    }
    Ok(Some((r, hello)))
}

fn abort_all(arrived: &mut [Option<(TcpStream, Hello, SocketAddr)>], err: &CommError) {
    let reason = err.to_string();
    for (s, _, _) in arrived.iter_mut().flatten() {
        let _ = wire::write_frame(s, Kind::Abort, 0, 0, 0, reason.as_bytes());
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "?".into())
}

/// Distinguishes this group from a stale one on the same ports; not a secret.
fn session_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}
