//! The TCP transport end to end: groups of threads on loopback, strangers, tokens, and
//! dead peers.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::gate::{connect_authenticated, handshake, Handshake};
use super::rendezvous::bind_rendezvous;
use super::TcpComm;
use crate::auth::{self, AuthChallenge, AuthHello, AuthProof, JobToken, Purpose, Security};
use crate::env::{RankInfo, Timeouts};
use crate::tree_allreduce::tree_all_reduce;
use crate::wire::{self, Frame, Hello, Kind};
use crate::{CommError, Communicator};

fn timeouts(secs: f64) -> Timeouts {
    Timeouts {
        rendezvous: Duration::from_secs_f64(secs),
        op: Duration::from_secs_f64(secs),
    }
}

fn sec(token: Option<&str>) -> Security {
    Security {
        token: token.map(|t| JobToken::new(t, "test").unwrap()),
        bind_all: false,
    }
}

fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

/// Starts rank 0 and `ranks` (a subset of 1..world) as threads, every one with
/// `security`; returns their results.
fn group<T: Send + 'static>(
    world: usize,
    ranks: Vec<usize>,
    t: Timeouts,
    security: Security,
    f: impl Fn(Result<TcpComm, CommError>) -> T + Send + Sync + Clone + 'static,
) -> (T, Vec<T>, String) {
    let (l, addr) = listener();
    let joins: Vec<_> = ranks
        .into_iter()
        .map(|r| {
            let (f, addr, sec) = (f.clone(), addr.clone(), security.clone());
            thread::spawn(move || f(TcpComm::join(r, world, &addr, t, &sec)))
        })
        .collect();
    let zero = f(TcpComm::serve(l, world, t, &security));
    let rest = joins.into_iter().map(|h| h.join().unwrap()).collect();
    (zero, rest, addr)
}

#[test]
fn mesh_of_four_gathers_broadcasts_and_reduces() {
    // With a job token: every rendezvous and mesh link passes the handshake.
    for security in [sec(Some("s3cret")), sec(None)] {
        let (zero, rest, _) = group(4, vec![1, 2, 3], timeouts(20.0), security, |c| {
            let c = c.unwrap();
            let r = c.rank();
            let g = c.all_gather_bytes(&[r as u8; 3]).unwrap();
            let mut b = if r == 2 { vec![42; 5] } else { vec![] };
            c.broadcast_bytes(&mut b, 2).unwrap();
            c.barrier().unwrap();
            // Order-sensitive per-rank roots; every rank must get the tree's bits.
            let roots = [1e8f32, -1e8, 1.0, 3.5e-3];
            let sum = tree_all_reduce(&c, &[roots[r]]).unwrap();
            (g, b, sum[0].to_bits(), c.transport())
        });
        let expect_sum = ((1e8f32 + -1e8) + (1.0 + 3.5e-3)).to_bits();
        for (g, b, sum, t) in std::iter::once(zero).chain(rest) {
            assert_eq!(g, vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
            assert_eq!(b, vec![42; 5]);
            assert_eq!(sum, expect_sum);
            assert_eq!(t, "tcp");
        }
    }
}

#[test]
fn missing_rank_is_named_on_every_rank() {
    let (zero, rest, _) = group(3, vec![1], timeouts(0.5), sec(Some("t")), |c| {
        c.err().map(|e| e.to_string())
    });
    let zero = zero.unwrap();
    assert!(zero.contains("rank(s) 2 never arrived"), "{zero}");
    let one = rest[0].clone().unwrap();
    assert!(
        one.contains("rank 0 aborted") && one.contains("rank(s) 2 never arrived"),
        "{one}"
    );
}

#[test]
fn unreachable_rank_zero_is_named() {
    let (l, addr) = listener();
    drop(l);
    let e = TcpComm::join(1, 2, &addr, timeouts(0.3), &sec(None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("could not reach the rendezvous of rank 0"),
        "{e}"
    );
}

/// Connects to `addr`, sends `bytes`, and returns what came back until the peer
/// closed (or 5 s passed).
fn stranger(addr: &str, bytes: &[u8], keep_silent: bool) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    if !keep_silent {
        let _ = s.shutdown(Shutdown::Write);
    }
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    back
}

/// The reason in the `Abort` frame a refused stranger was sent.
fn abort_reason(back: &[u8]) -> String {
    match wire::read_frame(&mut &back[..], wire::MAX_CONTROL_LEN) {
        Ok(f) if f.kind == Kind::Abort => String::from_utf8_lossy(&f.payload).into_owned(),
        other => panic!("expected an abort frame, got {other:?}"),
    }
}

#[test]
fn strangers_are_turned_away_without_disturbing_the_group() {
    let (l, addr) = listener();
    let t = timeouts(20.0);
    let token = sec(Some("the-real-one"));
    // A silent connection first: it must not hold up anyone.
    let silent = {
        let addr = addr.clone();
        thread::spawn(move || stranger(&addr, b"", true))
    };
    let mut hello_only = Vec::new();
    wire::write_msg(
        &mut hello_only,
        Kind::Hello,
        2,
        &Hello {
            world_size: 3,
            data_port: 1,
            host: "h".into(),
        },
    )
    .unwrap();
    let mut wrong_version = wire::encode_header(Kind::AuthHello, 2, 0, 0, 0);
    wrong_version[4..8].copy_from_slice(&7u32.to_le_bytes());
    let half = wire::encode_header(Kind::AuthHello, 2, 0, 0, 9)[..20].to_vec();
    let loud: Vec<(Vec<u8>, &str)> = vec![
        (
            b"GET / HTTP/1.1\r\n\r\n012345678901234567890123456789".to_vec(),
            "not an arbor frame",
        ),
        (wrong_version, "protocol version 7"),
        (half, "closed mid-frame"),
        // An arbor peer of a build without job tokens.
        (hello_only, "expected AuthHello"),
    ];
    let strangers = {
        let addr = addr.clone();
        thread::spawn(move || {
            loud.into_iter()
                .map(|(bytes, want)| (abort_reason(&stranger(&addr, &bytes, false)), want))
                .collect::<Vec<_>>()
        })
    };
    let ranks: Vec<_> = [1, 2]
        .into_iter()
        .map(|r| {
            let (addr, token) = (addr.clone(), token.clone());
            thread::spawn(move || {
                // Let the strangers go first.
                thread::sleep(Duration::from_millis(300));
                TcpComm::join(r, 3, &addr, t, &token).map(|c| c.barrier())
            })
        })
        .collect();
    let start = Instant::now();
    let zero = TcpComm::serve(l, 3, t, &token).unwrap();
    zero.barrier().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "rank 0 took {:?}: a silent stranger held it up",
        start.elapsed()
    );
    for h in ranks {
        h.join().unwrap().unwrap().unwrap();
    }
    for (reason, want) in strangers.join().unwrap() {
        assert!(reason.contains(want), "{want}: {reason}");
    }
    drop(zero);
    // The silent one is let go when its handshake time runs out.
    let back = silent.join().unwrap();
    assert!(abort_reason(&back).contains("did not complete the job-token handshake"));
}

#[test]
fn wrong_token_is_refused_and_the_right_rank_still_joins() {
    let (l, addr) = listener();
    let t = timeouts(20.0);
    let impostor = {
        let addr = addr.clone();
        thread::spawn(move || TcpComm::join(1, 2, &addr, t, &sec(Some("guess"))))
    };
    let real = {
        let addr = addr.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            TcpComm::join(1, 2, &addr, t, &sec(Some("right"))).map(|c| c.barrier())
        })
    };
    let zero = TcpComm::serve(l, 2, t, &sec(Some("right"))).unwrap();
    zero.barrier().unwrap();
    real.join().unwrap().unwrap().unwrap();
    let e = impostor.join().unwrap().err().unwrap().to_string();
    assert!(
        e.contains(&format!(
            "rank 0 at {addr} refused this rank: job token mismatch"
        )) && e.contains("ARBOR_JOB_TOKEN"),
        "{e}"
    );
}

#[test]
fn a_timeout_names_the_refused_connections() {
    let (l, addr) = listener();
    let t = timeouts(1.0);
    let impostor =
        thread::spawn(move || TcpComm::join(1, 2, &addr, t, &sec(Some("guess"))).is_err());
    let e = TcpComm::serve(l, 2, t, &sec(Some("right")))
        .err()
        .unwrap()
        .to_string();
    assert!(impostor.join().unwrap());
    assert!(
        e.contains("rank(s) 1 never arrived")
            && e.contains("1 connection(s) were refused, the last from 127.0.0.1:")
            && e.contains("job token mismatch"),
        "{e}"
    );
}

/// Runs the acceptor's handshake on one connection to a fresh listener; returns the
/// listener's address and the outcome (Ok: passed, Err: the refusal).
fn acceptor(token: Option<&str>) -> (String, thread::JoinHandle<Result<(), String>>) {
    let (l, addr) = listener();
    let token = sec(token).token;
    let h = thread::spawn(move || {
        let (s, a) = l.accept().unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let spoke = std::sync::atomic::AtomicBool::new(false);
        match handshake(s, a, 0, Purpose::Rendezvous, token.as_ref(), until, &spoke) {
            Handshake::Passed(..) => Ok(()),
            Handshake::Refused(_, why) => Err(why),
        }
    });
    (addr, h)
}

fn connector(addr: &str, token: Option<&str>) -> Result<(), CommError> {
    let token = sec(token).token;
    let until = Instant::now() + Duration::from_secs(5);
    let addrs = [addr.parse().unwrap()];
    let mut s = connect_authenticated(
        1,
        &addrs,
        addr,
        "rank 0",
        Purpose::Rendezvous,
        token.as_ref(),
        until,
        Duration::from_secs(5),
    )?;
    // The acceptor reads one protocol frame after the handshake.
    wire::write_frame(&mut s, Kind::Barrier, 1, 0, 0, &[]).unwrap();
    Ok(())
}

#[test]
fn handshake_right_wrong_and_missing_tokens() {
    let (addr, h) = acceptor(Some("k"));
    connector(&addr, Some("k")).unwrap();
    h.join().unwrap().unwrap();

    let (addr, h) = acceptor(None);
    connector(&addr, None).unwrap();
    h.join().unwrap().unwrap();

    let (addr, h) = acceptor(Some("k"));
    let e = connector(&addr, Some("not-k")).unwrap_err().to_string();
    assert!(
        e.contains("rank 0 refused this rank: job token mismatch"),
        "{e}"
    );
    assert!(h
        .join()
        .unwrap()
        .unwrap_err()
        .contains("job token mismatch"));

    let (addr, h) = acceptor(Some("k"));
    let e = connector(&addr, None).unwrap_err().to_string();
    assert!(
        e.contains(
            "refused this rank: this job requires a job token and the connecting process has none"
        ),
        "{e}"
    );
    assert!(h.join().unwrap().unwrap_err().contains("has none"));

    let (addr, h) = acceptor(None);
    let e = connector(&addr, Some("k")).unwrap_err().to_string();
    assert!(
        e.contains("refused this rank: the connecting process has a job token but this job runs without one"),
        "{e}"
    );
    assert!(h.join().unwrap().unwrap_err().contains("runs without one"));
}

/// Reads one frame of `kind` off `s`.
fn expect(s: &mut TcpStream, kind: Kind) -> Frame {
    let f = wire::read_frame(s, wire::MAX_CONTROL_LEN).unwrap();
    assert_eq!(f.kind, kind, "{f:?}");
    f
}

#[test]
fn replayed_proofs_are_refused() {
    let token = sec(Some("k")).token.unwrap();
    let nc = [7u8; auth::NONCE_LEN];
    let hello = AuthHello {
        nonce: nc,
        has_token: true,
    };
    // A genuine exchange, recorded by an eavesdropper.
    let (addr, h) = acceptor(Some("k"));
    let mut s = TcpStream::connect(&addr).unwrap();
    wire::write_msg(&mut s, Kind::AuthHello, 1, &hello).unwrap();
    let recorded: AuthChallenge = wire::decode_msg(&expect(&mut s, Kind::AuthChallenge)).unwrap();
    let proof = auth::connector_proof(&token, Purpose::Rendezvous, &recorded.nonce, &nc);
    wire::write_msg(
        &mut s,
        Kind::AuthProof,
        1,
        &AuthProof {
            proof: proof.clone(),
        },
    )
    .unwrap();
    expect(&mut s, Kind::AuthOk);
    wire::write_frame(&mut s, Kind::Barrier, 1, 0, 0, &[]).unwrap();
    h.join().unwrap().unwrap();

    // Replaying the connector's side: same nonce, same proof, a fresh acceptor nonce.
    let (addr, h) = acceptor(Some("k"));
    let mut s = TcpStream::connect(&addr).unwrap();
    wire::write_msg(&mut s, Kind::AuthHello, 1, &hello).unwrap();
    let fresh: AuthChallenge = wire::decode_msg(&expect(&mut s, Kind::AuthChallenge)).unwrap();
    assert_ne!(fresh.nonce, recorded.nonce);
    wire::write_msg(&mut s, Kind::AuthProof, 1, &AuthProof { proof }).unwrap();
    let refusal = expect(&mut s, Kind::Abort);
    assert!(String::from_utf8_lossy(&refusal.payload).contains("job token mismatch"));
    assert!(h
        .join()
        .unwrap()
        .unwrap_err()
        .contains("job token mismatch"));

    // Replaying the acceptor's side: a fake rank 0 answers with the recorded challenge;
    // the connector's nonce is new, so the recorded proof does not hold.
    let (l, addr) = listener();
    let fake = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        expect(&mut s, Kind::AuthHello);
        wire::write_msg(&mut s, Kind::AuthChallenge, 0, &recorded).unwrap();
        expect(&mut s, Kind::AuthProof);
        wire::write_frame(&mut s, Kind::AuthOk, 0, 0, 0, &[]).unwrap();
    });
    let e = connector(&addr, Some("k")).unwrap_err().to_string();
    assert!(e.contains("without proving this job's token"), "{e}");
    fake.join().unwrap();
}

#[test]
fn wrong_world_size_from_a_real_rank_still_fails_the_group() {
    let (l, addr) = listener();
    let t = timeouts(10.0);
    let one = {
        let addr = addr.clone();
        thread::spawn(move || {
            TcpComm::join(1, 3, &addr, t, &sec(Some("k")))
                .err()
                .map(|e| e.to_string())
        })
    };
    let bad = {
        let addr = addr.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            let token = sec(Some("k")).token;
            let until = Instant::now() + Duration::from_secs(5);
            let mut s = connect_authenticated(
                2,
                &[addr.parse().unwrap()],
                &addr,
                "rank 0",
                Purpose::Rendezvous,
                token.as_ref(),
                until,
                Duration::from_secs(5),
            )
            .unwrap();
            let hello = Hello {
                world_size: 4,
                data_port: 1,
                host: "h".into(),
            };
            wire::write_msg(&mut s, Kind::Hello, 2, &hello).unwrap();
        })
    };
    let zero = TcpComm::serve(l, 3, t, &sec(Some("k")))
        .err()
        .unwrap()
        .to_string();
    bad.join().unwrap();
    assert!(
        zero.contains("rank 2 (host h) has WORLD_SIZE=4, rank 0 has 3"),
        "{zero}"
    );
    let one = one.join().unwrap().unwrap();
    assert!(
        one.contains("rank 0 aborted") && one.contains("WORLD_SIZE=4"),
        "{one}"
    );
}

#[test]
fn listeners_bind_the_master_address_only() {
    let info = RankInfo {
        rank: 0,
        world_size: 2,
        local_rank: 0,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        source: "test",
    };
    let l = bind_rendezvous(&info, &sec(None)).unwrap();
    assert_eq!(
        l.local_addr().unwrap().ip(),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    let all = Security {
        bind_all: true,
        ..sec(None)
    };
    let l = bind_rendezvous(&info, &all).unwrap();
    assert_eq!(
        l.local_addr().unwrap().ip(),
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    );
    // An address that is not this host's: a clear error naming the way out.
    let far = RankInfo {
        master_addr: "192.0.2.1".into(),
        ..info
    };
    let e = bind_rendezvous(&far, &sec(None)).unwrap_err().to_string();
    assert!(
        e.contains("192.0.2.1") && e.contains("ARBOR_BIND_ALL=1"),
        "{e}"
    );
}

#[test]
fn a_dead_peer_fails_the_next_operation_naming_it() {
    let (zero, rest, _) = group(3, vec![1, 2], timeouts(20.0), sec(None), |c| {
        let c = c.unwrap();
        if c.rank() == 2 {
            drop(c);
            return None;
        }
        Some(c.all_gather_bytes(&[1, 2, 3]).unwrap_err().to_string())
    });
    for msg in [zero.unwrap(), rest[0].clone().unwrap()] {
        assert!(msg.contains("rank 2"), "{msg}");
    }
}

/// More idle and stalled connections than the gate handles at once, and more arriving:
/// the real rank still joins at once (the gate drops the longest-silent ones to make room;
/// a rank dropped unanswered connects again), well before their 10 s run out.
#[test]
fn idle_and_stalled_connections_cannot_keep_a_rank_out() {
    let (l, addr) = listener();
    let t = timeouts(30.0);
    let zero = thread::spawn(move || TcpComm::serve(l, 2, t, &sec(Some("k"))).map(|c| c.barrier()));
    let mut hello = Vec::new();
    wire::write_msg(
        &mut hello,
        Kind::AuthHello,
        1,
        &AuthHello {
            nonce: [7; 32],
            has_token: true,
        },
    )
    .unwrap();
    let mut held = Vec::new();
    for i in 0..140 {
        let mut s = TcpStream::connect(&addr).unwrap();
        if i % 2 == 0 {
            // Says hello, then never proves anything.
            s.write_all(&hello).unwrap();
        }
        held.push(s);
    }
    let flood = {
        let addr = addr.clone();
        thread::spawn(move || {
            (0..100)
                .filter_map(|_| {
                    thread::sleep(Duration::from_millis(2));
                    TcpStream::connect(&addr).ok()
                })
                .collect::<Vec<_>>()
        })
    };
    let t0 = Instant::now();
    let one = TcpComm::join(1, 2, &addr, t, &sec(Some("k"))).map(|c| c.barrier());
    let took = t0.elapsed();
    one.unwrap().unwrap();
    zero.join().unwrap().unwrap().unwrap();
    assert!(took < Duration::from_secs(5), "rank 1 took {took:?}");
    drop(flood.join().unwrap());
    drop(held);
}

/// A side channel set up through a first group carries its own traffic: used at the same
/// time as the parent from another thread, neither sees the other's messages.
#[test]
fn side_channel_is_a_second_independent_group() {
    let world = 4;
    let info = move |rank: usize| RankInfo {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        source: "test",
    };
    let handles: Vec<_> = crate::InProcGroup::new(world)
        .into_iter()
        .map(|parent| {
            thread::spawn(move || {
                let rank = parent.rank();
                let side =
                    TcpComm::side_channel(&parent, &info(rank), timeouts(20.0), &sec(Some("s")))
                        .unwrap();
                assert_eq!((side.rank(), side.world_size()), (rank, world));
                let on_side = thread::spawn(move || {
                    let mut got = Vec::new();
                    for i in 0..50u8 {
                        got.push(side.all_gather_bytes(&[rank as u8, i, 1]).unwrap());
                    }
                    got
                });
                let mut on_parent = Vec::new();
                for i in 0..50u8 {
                    on_parent.push(parent.all_gather_bytes(&[rank as u8, i, 2]).unwrap());
                }
                (on_parent, on_side.join().unwrap())
            })
        })
        .collect();
    for h in handles {
        let (parent, side) = h.join().unwrap();
        for (i, (p, s)) in parent.iter().zip(&side).enumerate() {
            let want =
                |tag: u8| -> Vec<u8> { (0..world as u8).flat_map(|r| [r, i as u8, tag]).collect() };
            assert_eq!(p, &want(2));
            assert_eq!(s, &want(1));
        }
    }
}

/// Rank 0 failing to open the listener ends every rank with an error, at once.
#[test]
fn side_channel_reports_a_listener_rank_0_could_not_open() {
    let handles: Vec<_> = crate::InProcGroup::new(2)
        .into_iter()
        .map(|parent| {
            thread::spawn(move || {
                let rank = parent.rank();
                let info = RankInfo {
                    rank,
                    world_size: 2,
                    local_rank: rank,
                    local_world_size: 2,
                    // Not an address of this host: rank 0 cannot bind it.
                    master_addr: "192.0.2.1".into(),
                    master_port: 1,
                    source: "test",
                };
                let t0 = Instant::now();
                let r = TcpComm::side_channel(&parent, &info, timeouts(30.0), &sec(None));
                (r.err().map(|e| e.to_string()), t0.elapsed())
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (err, took) = h.join().unwrap();
        let err = err.unwrap_or_else(|| panic!("rank {rank} joined a side channel"));
        assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
        if rank == 1 {
            assert!(err.contains("could not open the side channel"), "{err}");
        }
    }
}
