//! End-to-end tests of the job token and listening addresses with the real
//! binaries: a rank with the wrong ARBOR_JOB_TOKEN is turned away while the real one
//! completes the job, every listener of a job on one host is on loopback, and
//! arbor-launch hands its ranks a fresh token.

mod cli_support;

use std::collections::HashSet;
use std::net::IpAddr;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use cli_support::{free_port, LAUNCHER_VARS};

const ARBOR: &str = env!("CARGO_BIN_EXE_arbor");
const LAUNCH: &str = env!("CARGO_BIN_EXE_arbor-launch");

/// What a started rank must not inherit from an enclosing launcher or the test's own
/// environment.
fn clean(cmd: &mut Command) -> &mut Command {
    for v in LAUNCHER_VARS.iter().chain(&[
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "ARBOR_JOB_TOKEN",
        "ARBOR_JOB_TOKEN_FILE",
        "ARBOR_BIND_ALL",
        "RUST_LOG",
    ]) {
        cmd.env_remove(v);
    }
    cmd.stdin(Stdio::null())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// One `arbor collective-check` rank started by hand, as under mpirun or Slurm.
fn rank(rank: usize, world: usize, port: u16, token: &str) -> Child {
    let mut cmd = Command::new(ARBOR);
    clean(&mut cmd)
        .args(["collective-check", "--sizes", "8,1000"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ARBOR_TIMEOUT_SECS", "30")
        .env("ARBOR_JOB_TOKEN", token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("arbor starts")
}

/// The inodes of the sockets process `pid` holds.
fn socket_inodes(pid: u32) -> HashSet<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    dir.filter_map(|e| {
        let link = std::fs::read_link(e.ok()?.path()).ok()?;
        let l = link.to_str()?;
        l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
    })
    .collect()
}

/// Decodes /proc/net/tcp{,6}'s hex address: 32-bit words in the host's byte order.
fn proc_ip(hex: &str) -> IpAddr {
    let words: Vec<[u8; 4]> = (0..hex.len() / 8)
        .map(|i| {
            u32::from_str_radix(&hex[i * 8..i * 8 + 8], 16)
                .expect("hex address")
                .to_ne_bytes()
        })
        .collect();
    let bytes: Vec<u8> = words.concat();
    match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).expect("4 bytes")),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).expect("16 bytes")),
        n => panic!("unexpected address length {n} in {hex}"),
    }
}

/// The (ip, port) of every TCP socket in LISTEN state that process `pid` holds.
fn listeners_of(pid: u32) -> Vec<(IpAddr, u16)> {
    let mine = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(t) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in t.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let Ok(inode) = f[9].parse::<u64>() else {
                continue;
            };
            if !mine.contains(&inode) {
                continue;
            }
            let (ip, port) = f[1].split_once(':').expect("ip:port");
            out.push((
                proc_ip(ip),
                u16::from_str_radix(port, 16).expect("hex port"),
            ));
        }
    }
    out
}

/// Waits until process `pid` listens somewhere; returns where.
fn wait_for_listeners(pid: u32, what: &str) -> Vec<(IpAddr, u16)> {
    let t0 = Instant::now();
    loop {
        let l = listeners_of(pid);
        if !l.is_empty() {
            return l;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what} (pid {pid}) never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn finish(c: Child, what: &str) -> Output {
    let out = c.wait_with_output().expect("wait for a rank");
    assert!(
        out.status.success(),
        "{what} failed: {:?}\n{}",
        out.status,
        text(&out.stderr)
    );
    out
}

#[test]
fn wrong_token_is_refused_while_the_real_rank_completes_the_job() {
    let port = free_port();
    let token = "correct horse battery staple";
    let zero = rank(0, 4, port, token);
    let zero_listens = wait_for_listeners(zero.id(), "rank 0");
    assert!(
        zero_listens
            .iter()
            .any(|&(ip, p)| p == port && ip.is_loopback()),
        "rank 0 should listen on 127.0.0.1:{port}: {zero_listens:?}"
    );
    let ones: Vec<Child> = [1, 2].iter().map(|&r| rank(r, 4, port, token)).collect();
    // Ranks 1 and 2 wait for rank 3 with their data listeners open: all on loopback.
    for (r, c) in ones.iter().enumerate() {
        let l = wait_for_listeners(c.id(), &format!("rank {}", r + 1));
        assert!(
            l.iter().all(|(ip, _)| ip.is_loopback()),
            "rank {}'s listeners {l:?} should all be on loopback",
            r + 1
        );
    }
    let l = listeners_of(zero.id());
    assert!(
        l.iter().all(|(ip, _)| ip.is_loopback()),
        "rank 0's listeners {l:?} should all be on loopback"
    );

    let t0 = Instant::now();
    let impostor = rank(3, 4, port, "a guess").wait_with_output().unwrap();
    let why = text(&impostor.stderr);
    assert!(!impostor.status.success(), "the impostor joined: {why}");
    assert!(
        why.contains(&format!(
            "rank 0 at 127.0.0.1:{port} refused this rank: job token mismatch"
        )) && why.contains("ARBOR_JOB_TOKEN"),
        "{why}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "refusing took {:?}",
        t0.elapsed()
    );

    let three = rank(3, 4, port, token);
    let zero = finish(zero, "rank 0");
    for (r, c) in ones.into_iter().enumerate() {
        finish(c, &format!("rank {}", r + 1));
    }
    finish(three, "rank 3");
    let (stdout, stderr) = (text(&zero.stdout), text(&zero.stderr));
    assert!(stdout.contains("world 4 (tcp)"), "{stdout}");
    assert!(
        stderr.contains("refused a connection from 127.0.0.1:")
            && stderr.contains("job token mismatch"),
        "rank 0 should log the refusal: {stderr}"
    );
    assert!(!stderr.contains("unauthenticated"), "{stderr}");
}

#[test]
fn a_rank_without_a_token_is_refused_and_an_unauthenticated_job_warns() {
    let port = free_port();
    let zero = rank(0, 2, port, "t0k3n");
    wait_for_listeners(zero.id(), "rank 0");
    let mut cmd = Command::new(ARBOR);
    let tokenless = clean(&mut cmd)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .env("ARBOR_TIMEOUT_SECS", "10")
        .output()
        .unwrap();
    let why = text(&tokenless.stderr);
    assert!(!tokenless.status.success());
    assert!(
        why.contains("refused this rank: this job requires a job token"),
        "{why}"
    );
    finish(rank(1, 2, port, "t0k3n"), "rank 1");
    finish(zero, "rank 0");

    // No token anywhere: works as before, with a warning on rank 0.
    let port = free_port();
    let mut zero = Command::new(ARBOR);
    let zero = clean(&mut zero)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut one = Command::new(ARBOR);
    let one = clean(&mut one)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(one, "rank 1");
    let stderr = text(&finish(zero, "rank 0").stderr);
    assert_eq!(
        stderr.matches("this job is unauthenticated").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn token_file_is_read_and_an_empty_one_is_named() {
    let dir = std::env::temp_dir().join(format!("arbor-security-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.token");
    std::fs::write(&file, "").unwrap();
    let mut cmd = Command::new(ARBOR);
    let out = clean(&mut cmd)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", free_port().to_string())
        .env("ARBOR_JOB_TOKEN_FILE", &file)
        .output()
        .unwrap();
    let why = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        why.contains(&file.display().to_string()) && why.contains("is empty"),
        "{why}"
    );

    // The same secret from a file on one rank and the variable on the other.
    std::fs::write(&file, "shared-secret\n").unwrap();
    let port = free_port();
    let mut cmd = Command::new(ARBOR);
    let zero = clean(&mut cmd)
        .args(["collective-check", "--sizes", "8,1000"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .env("ARBOR_JOB_TOKEN_FILE", &file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(rank(1, 2, port, "shared-secret"), "rank 1");
    finish(zero, "rank 0");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn arbor_launch_gives_each_job_a_fresh_token() {
    let token_of_job = || {
        let mut cmd = Command::new(LAUNCH);
        let out = clean(&mut cmd)
            .args(["-n", "2", "--", "sh", "-c", "echo \"$ARBOR_JOB_TOKEN\""])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let tokens: HashSet<String> = stdout
            .lines()
            .map(|l| l.split_once("] ").map_or(l, |(_, t)| t).to_string())
            .collect();
        assert_eq!(tokens.len(), 1, "both ranks get the same token: {stdout}");
        let t = tokens.into_iter().next().unwrap_or_default();
        assert_eq!(t.len(), 64, "{t:?}");
        t
    };
    assert_ne!(token_of_job(), token_of_job());

    // A launched job is authenticated: no warning.
    let mut cmd = Command::new(LAUNCH);
    let out = clean(&mut cmd)
        .args(["-n", "2", "--", ARBOR, "collective-check", "--sizes", "8"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("unauthenticated"), "{stderr}");
}

#[test]
fn bind_all_listens_on_every_interface() {
    let port = free_port();
    let mut cmd = Command::new(ARBOR);
    let mut zero = clean(&mut cmd)
        .args(["collective-check", "--sizes", "8"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .env("ARBOR_JOB_TOKEN", "x")
        .env("ARBOR_BIND_ALL", "1")
        .env("ARBOR_TIMEOUT_SECS", "20")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let l = wait_for_listeners(zero.id(), "rank 0");
    let _ = zero.kill();
    let _ = zero.wait();
    // The same /proc reading that finds loopback above sees the wildcard here.
    assert!(
        l.iter().any(|&(ip, p)| p == port && ip.is_unspecified()),
        "{l:?}"
    );
}
