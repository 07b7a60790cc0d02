//! End-to-end tests of the collective stack with the real binaries: `arbor
//! collective-check` over 1, 2, 4 and 8 processes, and the rendezvous' failure modes
//! (a rank that never arrives, no rank 0), and strangers sending garbage or a wrong
//! protocol version to the rendezvous port, which are turned away without failing the job.

mod cli_support;

use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use cli_support::{free_port, LAUNCHER_VARS};

const ARBOR: &str = env!("CARGO_BIN_EXE_arbor");
const LAUNCH: &str = env!("CARGO_BIN_EXE_arbor-launch");

/// Variables of other launchers the test process might have inherited (e.g. under Slurm
/// or mpirun), on top of `LAUNCHER_VARS`.
const OTHER_RANK_VARS: &[&str] = &[
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

fn clean(cmd: &mut Command) -> &mut Command {
    for v in LAUNCHER_VARS.iter().chain(OTHER_RANK_VARS) {
        cmd.env_remove(v);
    }
    cmd.stdin(Stdio::null())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const SIZES: &str = "1,7,1000,20000";

fn check_under_launcher(n: usize, extra: &[&str]) -> Output {
    let mut cmd = Command::new(LAUNCH);
    clean(&mut cmd)
        .args([
            "-n",
            &n.to_string(),
            "--",
            ARBOR,
            "collective-check",
            "--sizes",
            SIZES,
        ])
        .args(extra);
    cmd.output().unwrap()
}

#[test]
fn collective_check_is_bit_identical_for_world_1_2_4_8() {
    let mut alone = Command::new(ARBOR);
    let out = clean(&mut alone)
        .args(["collective-check", "--sizes", SIZES])
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("world 1 (single)"), "{stdout}");
    assert!(
        stdout.contains("all 4 size(s) bit-identical to the single-process tree on all 1 rank(s)"),
        "{stdout}"
    );

    for n in [2usize, 4, 8] {
        let out = check_under_launcher(n, &[]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "world {n}:\n{stdout}{stderr}");
        assert!(
            stdout.contains(&format!("[rank 0] arbor collective-check: world {n} (tcp)")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!(
                "bit-identical to the single-process tree on all {n} rank(s)"
            )),
            "{stdout}"
        );
        // One "ok" row per size, and only rank 0 reports.
        assert_eq!(stdout.matches("  ok\n").count(), 4, "{stdout}");
        assert!(!stdout.contains("[rank 1]"), "{stdout}");
    }
}

#[test]
fn collective_check_reports_a_corrupted_rank() {
    let out = check_under_launcher(4, &["--corrupt-rank", "3"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("MISMATCH on 1 rank(s); first: rank 3 index 0"),
        "{stdout}"
    );
    assert!(stderr.contains("not bit-identical"), "{stderr}");
}

#[test]
fn world_size_three_is_a_clear_error() {
    let out = check_under_launcher(3, &[]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("world size of 1, 2, 4 or 8, got 3"),
        "{stderr}"
    );
}

/// One `arbor collective-check` rank started by hand.
fn rank(rank: usize, world: usize, port: u16, timeout_secs: &str) -> Child {
    let mut cmd = Command::new(ARBOR);
    clean(&mut cmd)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ARBOR_TIMEOUT_SECS", timeout_secs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let port = free_port();
    let t0 = Instant::now();
    let out = rank(0, 2, port, "1").wait_with_output().unwrap();
    let took = t0.elapsed();
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank(s) 1 never arrived"), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn no_rank_zero_is_named() {
    let port = free_port();
    let out = rank(1, 2, port, "0.5").wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("could not reach the rendezvous of rank 0"),
        "{stderr}"
    );
}

/// Starts rank 0 of a world of 2 and sends each of `strangers` to its rendezvous port on a
/// connection of its own: each is turned away with an abort naming what was wrong (the
/// `want` text), rank 0 logs it, and the real rank 1 then completes the job.
fn rendezvous_refuses(strangers: &[(Vec<u8>, &str)]) {
    let port = free_port();
    let zero = rank(0, 2, port, "30");
    let t0 = Instant::now();
    for (bytes, want) in strangers {
        let mut s = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("rank 0 never listened on {port}: {e}"),
            }
        };
        s.write_all(bytes).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut back = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut back);
        let reason = match arbor_collective::wire::read_frame(&mut &back[..], 1 << 20) {
            Ok(f) if f.kind == arbor_collective::wire::Kind::Abort => text(&f.payload),
            other => panic!("{want}: expected an abort frame, got {other:?}"),
        };
        assert!(reason.contains(want), "{want}: {reason}");
    }
    let one = rank(1, 2, port, "30").wait_with_output().unwrap();
    assert!(one.status.success(), "{}", text(&one.stderr));
    let out = zero.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for (_, want) in strangers {
        assert!(
            stderr.contains("refused a connection from 127.0.0.1:") && stderr.contains(want),
            "{want}: {stderr}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn garbage_and_wrong_versions_at_the_rendezvous_are_refused_without_failing_the_job() {
    // Right magic, protocol version 99: the first 8 bytes of every arbor frame.
    let mut v = b"ARBR".to_vec();
    v.extend_from_slice(&99u32.to_le_bytes());
    v.extend_from_slice(&[0u8; 25]);
    rendezvous_refuses(&[
        (
            b"GET / HTTP/1.1\r\nHost: arbor\r\n\r\n".to_vec(),
            "not an arbor frame",
        ),
        (v, "speaks wire protocol version 99"),
        // An arbor frame cut off mid-header: a peer that disconnects mid-exchange.
        (
            arbor_collective::wire::encode_header(
                arbor_collective::wire::Kind::AuthHello,
                1,
                0,
                0,
                9,
            )[..20]
                .to_vec(),
            "closed mid-frame",
        ),
    ]);
}

#[test]
fn a_rank_that_dies_before_the_rendezvous_stops_the_group_quickly() {
    // Rank 3 exits instead of joining; the others wait in the rendezvous (60 s timeout)
    // until arbor-launch stops them.
    let t0 = Instant::now();
    let mut cmd = Command::new(LAUNCH);
    let out = clean(&mut cmd)
        .args(["-n", "4", "--kill-grace", "20", "--", "sh", "-c"])
        .arg(format!(
            "if [ \"$RANK\" = 3 ]; then sleep 0.3; exit 7; fi; exec '{ARBOR}' collective-check --sizes 8"
        ))
        .output()
        .unwrap();
    let took = t0.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 3 exited with code 7"), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// Idle connections to the rendezvous port (anyone on the host can open them, token or
/// not) must not keep the real rank out: 100 of them, held open, more than rank 0 handles
/// at once, and more arriving while rank 1 joins (the real rank was once dropped,
/// "64 handshakes already in progress", and the job never formed).
#[test]
fn idle_connections_cannot_keep_a_rank_out_of_the_rendezvous() {
    let port = free_port();
    let token = "idle-connections-test-token";
    let start = |r: usize| {
        let mut cmd = Command::new(ARBOR);
        clean(&mut cmd)
            .args(["collective-check", "--sizes", "8"])
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("ARBOR_TIMEOUT_SECS", "60")
            .env("ARBOR_JOB_TOKEN", token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let zero = start(0);
    let t0 = Instant::now();
    let mut idle = Vec::new();
    while idle.len() < 100 {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => idle.push(s),
            Err(_) if idle.is_empty() && t0.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("connection {} to rank 0: {e}", idle.len()),
        }
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut more = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && more.len() < 200 {
                if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                    more.push(s);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            more
        })
    };
    let t1 = Instant::now();
    let one = start(1).wait_with_output().unwrap();
    let took = t1.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let out = zero.wait_with_output().unwrap();
    drop(flood.join().unwrap());
    drop(idle);
    assert!(one.status.success(), "rank 1:\n{}", text(&one.stderr));
    assert!(out.status.success(), "rank 0:\n{}", text(&out.stderr));
    // Well within the 10 s an idle connection may take: it got in past them, not after.
    assert!(took < Duration::from_secs(8), "rank 1 took {took:?}");
}
