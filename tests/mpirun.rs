//! `arbor` under OpenMPI's `mpirun`: TP=4 output bit-identical to TP=1, `arbor check` over
//! TP 1/2/4/8 with mpirun as its launcher, and a failing job that ends instead of hanging.
//!
//! Built without the `mpi` feature, the ranks find their rank in OMPI_COMM_WORLD_* and
//! meet at MASTER_ADDR/MASTER_PORT (TCP); built with it (`scripts/ci/ci-mpi.sh`), they bootstrap
//! and all-gather through MPI, and the test checks that they did. Skipped, with a message,
//! where `mpirun` is not installed.

mod cli_support;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use cli_support::{
    check_command, free_port, sampled_generate_args, text, write_executable, write_token_prompts,
    Scratch, LAUNCHER_VARS,
};

const ARBOR: &str = env!("CARGO_BIN_EXE_arbor");
const MPI_FEATURE: bool = cfg!(feature = "mpi");
/// What the MPI transport logs at info level once per rank.
const MPI_BOOTSTRAP_LOG: &str = "bootstrapped through MPI";

fn mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    let found = std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file());
    if found.is_none() {
        // Straight to stderr: the test harness would swallow eprintln! of a passing test.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: no mpirun on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)"
        );
    }
    found
}

/// Runs `cmd` to completion, killed after `limit` (so a hang fails the test).
fn run_limited(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Variables of an enclosing launcher would change what the ranks think they are.
    for name in LAUNCHER_VARS {
        cmd.env_remove(name);
    }
    let start = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => panic!("cannot start {cmd:?}: {e}"),
    };
    // Drain the pipes on the side while we watch the clock.
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let drain = |p: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out_t = drain(stdout.map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let err_t = drain(stderr.map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                match child.wait() {
                    Ok(s) => break s,
                    Err(e) => panic!("waiting for {cmd:?}: {e}"),
                }
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("waiting for {cmd:?}: {e}"),
        }
    };
    let elapsed = start.elapsed();
    let output = Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    };
    (output, elapsed)
}

fn make_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    let mut cmd = Command::new(ARBOR);
    cmd.args(["make-model", "--out"]).arg(&model);
    let (o, _) = run_limited(cmd, Duration::from_secs(120));
    let (out, err) = text(&o);
    assert!(o.status.success(), "make-model failed:\n{out}\n{err}");
    model
}

fn mpirun_cmd(mpirun: &Path, np: usize, port: u16) -> Command {
    let mut cmd = Command::new(mpirun);
    cmd.args([
        "-np",
        &np.to_string(),
        "--oversubscribe",
        "--allow-run-as-root",
    ])
    // Used only by the build without the feature (all ranks on this host: 127.0.0.1).
    .args(["-x", &format!("MASTER_PORT={port}")])
    .args(["-x", "RUST_LOG=arbor_collective=info"]);
    cmd
}

#[test]
fn generate_at_tp4_under_mpirun_is_bit_identical_to_tp1() {
    let Some(mpirun) = mpirun() else { return };
    let s = Scratch::new("mpirun-generate");
    let model = make_model(&s.0);
    let prompts = write_token_prompts(&s.0);

    let mut tp1 = Command::new(ARBOR);
    tp1.args(sampled_generate_args(&model, &prompts, 7, 1));
    let (o1, _) = run_limited(tp1, Duration::from_secs(120));
    let (ref_out, ref_err) = text(&o1);
    assert!(o1.status.success(), "TP=1 generate failed:\n{ref_err}");
    let ref_lines: Vec<&str> = ref_out.lines().collect();
    assert_eq!(ref_lines.len(), 3, "one JSON line per prompt:\n{ref_out}");
    // The digests are of the f32 logits' bits: equal lines mean equal logits.
    assert!(
        ref_lines.iter().all(|l| l.contains("logits_digest")),
        "{ref_out}"
    );

    let mut cmd = mpirun_cmd(&mpirun, 4, free_port());
    cmd.arg(ARBOR)
        .args(sampled_generate_args(&model, &prompts, 7, 3));
    let (o4, elapsed) = run_limited(cmd, Duration::from_secs(180));
    let (out, err) = text(&o4);
    assert!(
        o4.status.success(),
        "mpirun -np 4 generate failed ({elapsed:?}):\n{out}\n{err}"
    );
    // Only rank 0 prints records.
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ref_lines,
        "TP=4 under mpirun differs from TP=1\n{err}"
    );
    let mpi_logs = err.matches(MPI_BOOTSTRAP_LOG).count();
    if MPI_FEATURE {
        assert_eq!(mpi_logs, 4, "every rank must bootstrap through MPI:\n{err}");
    } else {
        assert_eq!(
            mpi_logs, 0,
            "a build without the mpi feature used MPI?\n{err}"
        );
    }
}

/// `arbor check` runs every configuration as `LAUNCHER -n TP -- arbor …`: a two-line script
/// turns that into an mpirun command line.
#[test]
fn check_with_mpirun_as_the_launcher() {
    let Some(mpirun) = mpirun() else { return };
    let s = Scratch::new("mpirun-check");
    let model = make_model(&s.0);
    let wrapper = s.0.join("mpilaunch");
    let script = format!(
        "#!/bin/sh\n\
         # usage: mpilaunch -n N -- command args...\n\
         [ \"$1\" = -n ] && [ \"$3\" = -- ] || {{ echo \"mpilaunch: bad arguments: $*\" >&2; exit 2; }}\n\
         n=$2; shift 3\n\
         exec '{}' -np \"$n\" --oversubscribe --allow-run-as-root -x MASTER_PORT={} \"$@\"\n",
        mpirun.display(),
        free_port()
    );
    write_executable(&wrapper, &script);
    let json = s.0.join("report.json");
    let cmd = check_command(&model, &wrapper, &json);
    let (o, elapsed) = run_limited(cmd, Duration::from_secs(300));
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "arbor check through mpirun failed ({elapsed:?}):\n{out}\n{err}"
    );
    let report = std::fs::read_to_string(&json).unwrap_or_default();
    assert!(!report.is_empty(), "no JSON report:\n{out}\n{err}");
    // The report names every configuration it ran.
    for tp in [1, 2, 4, 8] {
        assert!(
            report.contains(&format!("TP={tp} batch=3")),
            "TP={tp} missing:\n{report}"
        );
    }
}

#[test]
fn a_rank_that_fails_ends_the_mpirun_job() {
    let Some(mpirun) = mpirun() else { return };
    let s = Scratch::new("mpirun-fail");
    let mut cmd = mpirun_cmd(&mpirun, 4, free_port());
    cmd.arg(ARBOR)
        .args(["generate", "--model"])
        .arg(s.0.join("no-such-model"))
        .args(["--prompt", "x"]);
    let (o, elapsed) = run_limited(cmd, Duration::from_secs(60));
    let (out, err) = text(&o);
    assert!(
        !o.status.success(),
        "mpirun succeeded on a missing model:\n{out}\n{err}"
    );
    assert!(
        o.status.code().is_some(),
        "mpirun was killed after the time limit: a hang\n{err}"
    );
    assert!(
        err.contains("no-such-model"),
        "the error should name the model dir:\n{err}"
    );
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
}
