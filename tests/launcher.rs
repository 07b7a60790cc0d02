//! End-to-end tests of the real `arbor-launch` binary: environment of the ranks, output
//! prefixes, failure handling (a crashing rank stops the group quickly), signal
//! forwarding and hostfile errors.

#[path = "cli_support/mod.rs"]
mod cli_support;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const LAUNCH: &str = env!("CARGO_BIN_EXE_arbor-launch");

fn launch(args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = Command::new(LAUNCH)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("arbor-launch runs");
    (out, t0.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh scratch directory for this test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("arbor-launch-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn ranks_get_their_variables_and_prefixed_output() {
    for n in [1usize, 2, 4, 8] {
        let (out, _) = launch(&[
            "-n",
            &n.to_string(),
            "--",
            "sh",
            "-c",
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\"; echo \"to stderr $RANK\" >&2",
        ]);
        assert!(out.status.success(), "n={n}: {}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let mut lines: Vec<&str> = stdout.lines().collect();
        lines.sort();
        assert_eq!(lines.len(), n, "n={n}: {stdout}");
        let mut ports = Vec::new();
        for (r, line) in lines.iter().enumerate() {
            let want = format!("[rank {r}] {r} {n} {r} {n} 127.0.0.1 ");
            assert!(
                line.starts_with(&want),
                "n={n}: {line:?} should start with {want:?}"
            );
            let port: u16 = line[want.len()..].parse().expect("MASTER_PORT is a port");
            assert_ne!(port, 0);
            ports.push(port);
        }
        ports.dedup();
        assert_eq!(ports.len(), 1, "all ranks share one MASTER_PORT");
        let stderr = text(&out.stderr);
        for r in 0..n {
            assert!(
                stderr.contains(&format!("[rank {r}] to stderr {r}\n")),
                "{stderr}"
            );
        }
    }
}

#[test]
fn environment_passes_through_and_options_apply() {
    let out = Command::new(LAUNCH)
        .args([
            "-n",
            "2",
            "--master-port",
            "23456",
            "--master-addr",
            "10.1.2.3",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "echo \"$NCCL_NVLS_ENABLE $ARBOR_E2E_MARK $MASTER_ADDR:$MASTER_PORT\"",
        ])
        .env("NCCL_NVLS_ENABLE", "0")
        .env("ARBOR_E2E_MARK", "kept")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {r}] 0 kept 10.1.2.3:23456\n")),
            "{stdout}"
        );
    }

    // Rank 0 only, without prefixes.
    let (out, _) = launch(&[
        "-n",
        "4",
        "--output",
        "rank0",
        "--no-prefix",
        "--",
        "sh",
        "-c",
        "echo r$RANK",
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), "r0\n");
    let (out, _) = launch(&["-n", "3", "--rank0-only", "--", "sh", "-c", "echo r$RANK"]);
    assert_eq!(text(&out.stdout), "[rank 0] r0\n");
}

/// `--ranks-per-gpu` reaches every rank as ARBOR_RANKS_PER_GPU (the variable the ranks'
/// device map reads), over an inherited value; without the flag an inherited value passes
/// through (set by hand, as under mpirun); a bad value stops the launch before any rank.
#[test]
fn ranks_per_gpu_reaches_every_rank() {
    assert_eq!(
        arbor_launch::RANKS_PER_GPU_ENV,
        arbor_collective::device_map::RANKS_PER_GPU_ENV
    );
    let run = |flag: Option<&str>, inherited: Option<&str>| {
        let mut cmd = Command::new(LAUNCH);
        cmd.args(["-n", "4"]);
        if let Some(f) = flag {
            cmd.args(["--ranks-per-gpu", f]);
        }
        cmd.args([
            "--",
            "sh",
            "-c",
            "echo \"$LOCAL_RANK ${ARBOR_RANKS_PER_GPU-unset}\"",
        ]);
        match inherited {
            Some(v) => cmd.env("ARBOR_RANKS_PER_GPU", v),
            None => cmd.env_remove("ARBOR_RANKS_PER_GPU"),
        };
        let out = cmd.stdin(Stdio::null()).output().unwrap();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    for (flag, inherited, want) in [
        (Some("4"), None, "4"),
        (Some("auto"), Some("2"), "auto"),
        (None, Some("2"), "2"),
        (None, None, "unset"),
    ] {
        let (code, stdout, stderr) = run(flag, inherited);
        assert_eq!(code, Some(0), "{stderr}");
        for r in 0..4 {
            assert!(
                stdout.contains(&format!("[rank {r}] {r} {want}\n")),
                "{flag:?} {inherited:?}: {stdout}"
            );
        }
    }
    let (code, stdout, stderr) = run(Some("0"), None);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains("--ranks-per-gpu") && stderr.contains("\"auto\""),
        "{stderr}"
    );
}

/// `--ranks-per-gpu` says what it does: here more per GPU than there are ranks (all on
/// one GPU), and on CPU ranks nothing, which rank 0 says too. Both started without a word.
#[test]
fn ranks_per_gpu_says_what_it_does() {
    let (out, _) = launch(&["-n", "2", "--ranks-per-gpu", "3", "--", "true"]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--ranks-per-gpu 3: 2 ranks on localhost take 1 GPU (all on one")
            && err.contains("ranks that run on the CPU ignore it"),
        "{err}"
    );
    let model = cli_support::shared_tiny("launcher-rpg", "llama");
    let out = Command::new(LAUNCH)
        .args(["-n", "2", "--ranks-per-gpu", "2", "--"])
        .arg(cli_support::arbor())
        .args([
            "generate",
            "--device",
            "cpu",
            "--max-tokens",
            "1",
            "--prompt",
            "hi",
        ])
        .arg("--model")
        .arg(&model)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("arbor-launch runs");
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let note = "ARBOR_RANKS_PER_GPU=2 (arbor-launch --ranks-per-gpu) has no effect";
    assert_eq!(err.matches(note).count(), 1, "rank 0 says it once:\n{err}");
}

#[test]
fn a_crashing_rank_stops_everyone_quickly_and_is_named() {
    // A 20 s SIGKILL grace: finishing within 10 s shows that SIGTERM stopped the others.
    let (out, took) = launch(&[
        "-n",
        "4",
        "--kill-grace",
        "20",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 2 ]; then sleep 0.5; echo dying >&2; exit 3; fi; sleep 60",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("rank 2 exited with code 3"), "{stderr}");
    assert!(stderr.contains("[rank 2] dying"), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn a_rank_killed_by_a_signal_is_named_and_stubborn_ranks_are_killed() {
    // Rank 1 dies by SIGKILL; the others ignore SIGTERM and must be SIGKILLed after the
    // grace period.
    let (out, took) = launch(&[
        "-n",
        "3",
        "--kill-grace",
        "1",
        "--",
        "sh",
        "-c",
        "trap '' TERM; if [ \"$RANK\" = 1 ]; then sleep 0.5; kill -9 $$; fi; sleep 60",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(
        stderr.contains("rank 1 was killed by signal 9 (SIGKILL)"),
        "{stderr}"
    );
    assert!(
        took >= Duration::from_millis(1400),
        "SIGKILL came before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn a_failing_hidden_rank_shows_its_last_lines() {
    let (out, _) = launch(&[
        "-n",
        "2",
        "--rank0-only",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then echo 'why I failed' >&2; exit 5; fi; sleep 60",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("[rank 1] why I failed"), "{stderr}");
}

/// A running launcher whose ranks each print `up` once they are ready; its output is
/// collected on threads so that the test can wait for that readiness line.
struct Running {
    child: std::process::Child,
    stdout: std::sync::mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Running {
    fn start(args: &[&str], script: &str) -> Running {
        use std::io::{BufRead, Read};
        let mut child = Command::new(LAUNCH)
            .args(args)
            .args(["--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let (tx, stdout) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Running {
            child,
            stdout,
            stderr,
        }
    }

    /// Waits until `n` ranks printed `up`; returns the lines read so far.
    fn wait_up(&self, n: usize) -> Vec<String> {
        let mut lines = Vec::new();
        while lines
            .iter()
            .filter(|l: &&String| l.ends_with("] up"))
            .count()
            < n
        {
            match self.stdout.recv_timeout(Duration::from_secs(30)) {
                Ok(l) => lines.push(l),
                Err(e) => panic!("ranks not up ({e}): {lines:?}"),
            }
        }
        lines
    }

    /// SIGTERM to the launcher; returns its exit code, all its stdout and stderr, and how
    /// long it took to exit after the signal.
    fn terminate(mut self, mut lines: Vec<String>) -> (Option<i32>, String, String, Duration) {
        let t0 = Instant::now();
        let kill = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = t0.elapsed();
        lines.extend(self.stdout.iter());
        let stderr = self.stderr.join().unwrap();
        (status.code(), lines.join("\n"), stderr, took)
    }
}

#[test]
fn sigterm_is_forwarded_to_the_ranks() {
    // Ranks that handle SIGTERM and exit 0 end the job cleanly: exit 0.
    let r = Running::start(
        &["-n", "2"],
        "trap 'echo got TERM; exit 0' TERM; echo up; sleep 60 & wait",
    );
    let lines = r.wait_up(2);
    let (code, stdout, stderr, took) = r.terminate(lines);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(code, Some(0), "{stderr}");
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {r}] got TERM")),
            "{stdout}\n{stderr}"
        );
    }
    assert!(stderr.contains("SIGTERM"), "{stderr}");

    // Ranks that die by the signal: 128 + 15, as a shell reports it.
    let r = Running::start(&["-n", "2"], "echo up; exec sleep 60");
    let lines = r.wait_up(2);
    let (code, _, stderr, took) = r.terminate(lines);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(code, Some(128 + 15), "{stderr}");
    assert!(stderr.contains("stopped by SIGTERM"), "{stderr}");
}

/// A forwarded SIGTERM leaves the ranks as long as they need to stop by themselves (an
/// `arbor serve` drain): --kill-grace does not cut it short.
#[test]
fn a_forwarded_sigterm_waits_for_the_ranks_to_finish() {
    let r = Running::start(
        &["-n", "2", "--kill-grace", "0.2"],
        "trap 'sleep 1.5; echo drained; exit 0' TERM; echo up; sleep 60 & wait",
    );
    let lines = r.wait_up(2);
    let (code, stdout, stderr, took) = r.terminate(lines);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {r}] drained")),
            "{stdout}\n{stderr}"
        );
    }
    assert!(took >= Duration::from_millis(1400), "took {took:?}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// Once one rank has stopped after a forwarded signal, the others get --kill-grace to
/// follow, then SIGKILL: a rank that ignores the signal cannot hold the job for ever.
#[test]
fn ranks_that_ignore_a_forwarded_signal_are_killed_after_the_others_stop() {
    let r = Running::start(
        &["-n", "2", "--kill-grace", "0.5"],
        "if [ \"$RANK\" = 1 ]; then trap '' TERM; else trap 'exit 0' TERM; fi; echo up; \
         while :; do sleep 0.1; done",
    );
    let lines = r.wait_up(2);
    let (code, stdout, stderr, took) = r.terminate(lines);
    assert_eq!(code, Some(128 + 15), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGKILL"),
        "{stderr}"
    );
    assert!(took >= Duration::from_millis(450), "took {took:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// Rank 1 is killed; rank 0 notices at once (its read of a pipe rank 1 held ends) and
/// exits 1. The launcher names rank 1's death as the cause, not rank 0's exit, even when
/// it sees both ends in the same look.
#[test]
fn the_rank_that_died_first_is_named_not_the_one_that_noticed() {
    let d = scratch("first-death");
    let fifo = d.join("peer");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for _ in 0..3 {
        let (out, took) = launch(&[
            "-n",
            "2",
            "--kill-grace",
            "5",
            "--",
            "sh",
            "-c",
            &format!(
                "if [ \"$RANK\" = 1 ]; then exec 3>{f}; sleep 0.3; kill -9 $$; \
                 else cat {f} >/dev/null; echo 'peer gone' >&2; exit 1; fi",
                f = fifo.display()
            ),
        ]);
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("arbor-launch: rank 1 was killed by signal 9 (SIGKILL)"),
            "{stderr}"
        );
        // (Rank 0's own exit is listed when it came before arbor-launch's SIGTERM.)
        assert!(!stderr.contains("arbor-launch: rank 0 exited"), "{stderr}");
        assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn hostfile_errors_name_file_and_line() {
    let d = scratch("hostfile");
    let bad = d.join("bad");
    std::fs::write(
        &bad,
        "# two hosts\nlocalhost slots=2\nlocalhost slots=two\n",
    )
    .unwrap();
    let (out, _) = launch(&["--hostfile", bad.to_str().unwrap(), "--", "true"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("line 3") && stderr.contains(bad.to_str().unwrap()),
        "{stderr}"
    );

    let remote = d.join("remote");
    std::fs::write(&remote, "localhost slots=1\nnode-b.invalid slots=4\n").unwrap();
    // A remote host is checked through the remote-shell agent before anything
    // starts; this agent fails as ssh does for a host it cannot reach.
    let (out, _) = launch(&[
        "--hostfile",
        remote.to_str().unwrap(),
        "--rsh",
        "sh -c 'echo no route to host >&2; exit 255'",
        "--",
        "true",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("\"node-b.invalid\" cannot be reached")
            && stderr.contains("no route to host")
            && stderr.contains("line 2"),
        "{stderr}"
    );

    // The repository's hostfile: 8 local slots.
    let local = concat!(env!("CARGO_MANIFEST_DIR"), "/hostfiles/localhost");
    let (out, _) = launch(&[
        "--hostfile",
        local,
        "--rank0-only",
        "--",
        "sh",
        "-c",
        "echo $WORLD_SIZE",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] 8\n");
    let (out, _) = launch(&["-n", "9", "--hostfile", local, "--", "true"]);
    assert!(text(&out.stderr).contains("more than the 8 slot(s)"));
    let (out, _) = launch(&[
        "-n",
        "9",
        "--oversubscribe",
        "--hostfile",
        local,
        "--",
        "true",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_command_that_cannot_start_is_an_error() {
    let (out, took) = launch(&["-n", "2", "--", "/nonexistent/arbor-worker"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot start rank 0") && stderr.contains("/nonexistent/arbor-worker"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(10));
}

#[test]
fn ranks_do_not_outlive_a_killed_launcher() {
    let d = scratch("orphans");
    let child = Command::new(LAUNCH)
        .args(["-n", "2", "--", "sh", "-c"])
        .arg(format!(
            "echo $$ > {}/pid.$RANK; exec sleep 60",
            d.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let pids: Vec<String> = loop {
        let p: Vec<String> = (0..2)
            .filter_map(|r| std::fs::read_to_string(d.join(format!("pid.{r}"))).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if p.len() == 2 {
            break p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "ranks never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut child = child;
    child.kill().unwrap(); // SIGKILL: nothing can be forwarded
    child.wait().unwrap();
    let alive = |pid: &str| {
        Command::new("kill")
            .args(["-0", pid])
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    let t1 = Instant::now();
    while pids.iter().any(|p| alive(p)) && t1.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in &pids {
        assert!(!alive(p), "rank process {p} outlived arbor-launch");
    }
    std::fs::remove_dir_all(&d).unwrap();
}
