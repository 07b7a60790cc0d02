//! Several hosts on one machine: network namespaces joined by veth pairs to a bridge, each
//! "host" with its own address in 10.213.7.0/24, and arbor ranks in them talking real TCP.
//!
//! Only addresses this test creates are used, and only inside its own namespaces (the
//! machine's own network namespace is not touched). Everything is removed on drop, also
//! when a test fails. Without root or `ip`, the tests print why and skip; with
//! ARBOR_REQUIRE_NETNS=1 (CI) they fail instead.

mod cli_support;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cli_support::{
    check_command, sampled_generate_args, write_executable, write_token_prompts, Scratch,
};

const ARBOR: &str = env!("CARGO_BIN_EXE_arbor");
/// The test hosts' subnet: 10.213.7.1, 10.213.7.2, ...
const SUBNET: &str = "10.213.7";

/// Runs `ip ARGS`; the error names the command and what `ip` said.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Test hosts: namespaces `<tag>-h0`, `<tag>-h1`, … (eth0 = 10.213.7.(i+1)/24) and a
/// switch namespace `<tag>-sw` holding the bridge. Dropping it deletes the namespaces, and
/// with them every interface and address the test made.
struct Lab {
    hosts: Vec<String>,
    switch: Option<String>,
}

/// Why a lab could not be made: skip (no namespaces here) or fail (broken after creation).
enum LabError {
    Unsupported(String),
    Broken(String),
}

impl Lab {
    fn new(n_hosts: usize) -> Result<Lab, LabError> {
        static RUN: AtomicUsize = AtomicUsize::new(0);
        let tag = format!(
            "arbor-mh{}-{}",
            std::process::id(),
            RUN.fetch_add(1, Ordering::SeqCst)
        );
        let mut lab = Lab {
            hosts: Vec::new(),
            switch: None,
        };
        let switch = format!("{tag}-sw");
        ip(&["netns", "add", &switch]).map_err(LabError::Unsupported)?;
        lab.switch = Some(switch.clone());
        let broken = LabError::Broken;
        let sw = |args: &[&str]| {
            let mut all = vec!["-n", switch.as_str()];
            all.extend_from_slice(args);
            ip(&all)
        };
        sw(&["link", "add", "br0", "type", "bridge"]).map_err(broken)?;
        sw(&["link", "set", "br0", "up"]).map_err(broken)?;
        for i in 0..n_hosts {
            let host = format!("{tag}-h{i}");
            ip(&["netns", "add", &host]).map_err(broken)?;
            lab.hosts.push(host.clone());
            let port = format!("p{i}");
            // Both ends are created inside the namespaces: nothing appears in this one.
            ip(&[
                "link", "add", "eth0", "netns", &host, "type", "veth", "peer", "name", &port,
                "netns", &switch,
            ])
            .map_err(broken)?;
            sw(&["link", "set", &port, "master", "br0"]).map_err(broken)?;
            sw(&["link", "set", &port, "up"]).map_err(broken)?;
            let addr = format!("{}/24", lab.addr(i));
            for args in [
                vec!["addr", "add", addr.as_str(), "dev", "eth0"],
                vec!["link", "set", "eth0", "up"],
                vec!["link", "set", "lo", "up"],
            ] {
                let mut all = vec!["-n", host.as_str()];
                all.extend(args);
                ip(&all).map_err(broken)?;
            }
        }
        Ok(lab)
    }

    fn addr(&self, host: usize) -> String {
        format!("{SUBNET}.{}", host + 1)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(self.switch.iter()) {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

/// The lab, or `None` after printing why the test is skipped.
fn lab_or_skip(test: &str, n_hosts: usize) -> Option<Lab> {
    match Lab::new(n_hosts) {
        Ok(lab) => Some(lab),
        Err(LabError::Broken(why)) => panic!("{test}: making the test hosts failed: {why}"),
        Err(LabError::Unsupported(why)) => {
            if std::env::var("ARBOR_REQUIRE_NETNS").is_ok_and(|v| v == "1") {
                panic!("{test}: cannot create network namespaces and ARBOR_REQUIRE_NETNS=1: {why}");
            }
            // Straight to stderr: the test harness would swallow eprintln! of a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: cannot create network namespaces here (needs root and iproute2): {why}"
            );
            None
        }
    }
}

/// Waits for `child` up to `deadline`, then kills it; returns its output.
fn finish(mut child: Child, deadline: Instant, what: &str) -> Output {
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => panic!("waiting for {what}: {e}"),
    }
}

fn make_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    let out = Command::new(ARBOR)
        .args(["make-model", "--out"])
        .arg(&model)
        .output();
    match out {
        Ok(o) if o.status.success() => model,
        Ok(o) => panic!("make-model failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => panic!("cannot run make-model: {e}"),
    }
}

fn tp1_reference(model: &Path, prompts: &Path) -> String {
    let out = Command::new(ARBOR)
        .args(sampled_generate_args(model, prompts, 3, 2))
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            assert_eq!(text.lines().count(), 3, "one record per prompt:\n{text}");
            text
        }
        Ok(o) => panic!(
            "TP=1 generate failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("cannot run arbor: {e}"),
    }
}

/// Four ranks started by hand, two per namespace, rank 0's rendezvous at host 0's address:
/// the TCP transport across hosts, without any launcher.
#[test]
fn tp4_across_two_namespaces_by_hand_matches_tp1() {
    let Some(lab) = lab_or_skip("tp4_across_two_namespaces_by_hand_matches_tp1", 2) else {
        return;
    };
    let s = Scratch::new("multihost-byhand");
    let model = make_model(&s.0);
    let prompts = write_token_prompts(&s.0);
    let reference = tp1_reference(&model, &prompts);

    let deadline = Instant::now() + Duration::from_secs(120);
    let mut children = Vec::new();
    for rank in 0..4usize {
        let host = rank / 2;
        let child = Command::new("ip")
            .args(["netns", "exec", &lab.hosts[host], ARBOR])
            .args(sampled_generate_args(&model, &prompts, 3, 2))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "4")
            .env("LOCAL_RANK", (rank % 2).to_string())
            .env("LOCAL_WORLD_SIZE", "2")
            .env("MASTER_ADDR", lab.addr(0))
            .env("MASTER_PORT", "29500")
            .env("ARBOR_TIMEOUT_SECS", "30")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => panic!("cannot start rank {rank} in {}: {e}", lab.hosts[host]),
        }
    }
    let outs: Vec<Output> = children
        .into_iter()
        .enumerate()
        .map(|(r, c)| finish(c, deadline, &format!("rank {r}")))
        .collect();
    for (rank, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {rank} failed ({}):\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&outs[0].stdout),
        reference,
        "TP=4 across namespaces differs from TP=1"
    );
}

const LAUNCH: &str = env!("CARGO_BIN_EXE_arbor-launch");

/// The agent for namespaces: the host name is the namespace name, `sh -c` runs the line.
const NETNS_AGENT: &str = "ip netns exec {host} sh -c";

/// A hostfile naming the lab's hosts, `slots` each.
fn write_hostfile(dir: &Path, lab: &Lab, slots: usize) -> PathBuf {
    let p = dir.join("hostfile");
    let text: String = lab
        .hosts
        .iter()
        .map(|h| format!("{h} slots={slots}\n"))
        .collect();
    if let Err(e) = std::fs::write(&p, text) {
        panic!("cannot write {}: {e}", p.display());
    }
    p
}

/// Processes still running in the lab's host namespaces.
fn leftover_pids(lab: &Lab) -> Vec<String> {
    lab.hosts
        .iter()
        .flat_map(|h| {
            let out = Command::new("ip").args(["netns", "pids", h]).output();
            let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            text.unwrap_or_default()
                .split_whitespace()
                .map(|p| format!("{h}:{p}"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// How many `sleep` processes run in the lab's namespaces.
fn sleeping_ranks(lab: &Lab) -> usize {
    leftover_pids(lab)
        .iter()
        .filter_map(|hp| hp.split_once(':'))
        .filter(|(_, pid)| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
        })
        .count()
}

fn wait_no_leftovers(lab: &Lab, within: Duration) -> Vec<String> {
    let until = Instant::now() + within;
    loop {
        let left = leftover_pids(lab);
        if left.is_empty() || Instant::now() > until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `arbor check` over TP 1/2/4/8 with every configuration launched by arbor-launch from a
/// hostfile of two namespace hosts (4 slots each): TP=8 runs 4 ranks on each, real TCP
/// between them; the outputs must be bit-identical to TP=1's.
#[test]
fn arbor_check_across_namespaces_through_arbor_launch() {
    let Some(lab) = lab_or_skip("arbor_check_across_namespaces_through_arbor_launch", 2) else {
        return;
    };
    let s = Scratch::new("multihost-check");
    let model = make_model(&s.0);
    let hostfile = write_hostfile(&s.0, &lab, 4);
    // `arbor check` runs `LAUNCHER -n TP -- arbor …`; the wrapper adds the hosts.
    let wrapper = s.0.join("launch-on-lab");
    let script = format!(
        "#!/bin/sh\nexec '{LAUNCH}' --hostfile '{}' --rsh '{NETNS_AGENT}' --master-addr {} \"$@\"\n",
        hostfile.display(),
        lab.addr(0)
    );
    write_executable(&wrapper, &script);
    let json = s.0.join("report.json");
    let child = check_command(&model, &wrapper, &json)
        .env("ARBOR_TIMEOUT_SECS", "30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => panic!("cannot run arbor check: {e}"),
    };
    let o = finish(
        child,
        Instant::now() + Duration::from_secs(300),
        "arbor check",
    );
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "arbor check across namespaces failed ({}):\n{out}\n{err}",
        o.status
    );
    let report = std::fs::read_to_string(&json).unwrap_or_default();
    for tp in [1, 2, 4, 8] {
        assert!(
            report.contains(&format!("TP={tp} batch=3")),
            "TP={tp} missing:\n{report}"
        );
    }
    assert!(wait_no_leftovers(&lab, Duration::from_secs(5)).is_empty());
}

/// Runs arbor-launch with the lab's hostfile and `cmd` as every rank's command.
fn launch_on_lab(lab: &Lab, dir: &Path, np: usize, cmd: &[&str]) -> Child {
    let hostfile = write_hostfile(dir, lab, 2);
    let child = Command::new(LAUNCH)
        .args(["-n", &np.to_string(), "--hostfile"])
        .arg(&hostfile)
        .args(["--rsh", NETNS_AGENT, "--master-addr", &lab.addr(0), "--"])
        .args(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    match child {
        Ok(c) => c,
        Err(e) => panic!("cannot run arbor-launch: {e}"),
    }
}

#[test]
fn remote_ranks_get_their_variables_and_output_is_prefixed() {
    let Some(lab) = lab_or_skip("remote_ranks_get_their_variables_and_output_is_prefixed", 2)
    else {
        return;
    };
    let s = Scratch::new("multihost-env");
    let child = launch_on_lab(
        &lab,
        &s.0,
        4,
        &["sh", "-c", "echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE master $MASTER_ADDR ns $(ip netns identify)\""],
    );
    let o = finish(
        child,
        Instant::now() + Duration::from_secs(60),
        "arbor-launch",
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for rank in 0..4 {
        let want = format!(
            "[rank {rank}] {rank}/4 local {}/2 master {} ns {}",
            rank % 2,
            lab.addr(0),
            lab.hosts[rank / 2]
        );
        assert!(
            out.lines().any(|l| l == want),
            "missing {want:?} in:\n{out}"
        );
    }
}

#[test]
fn a_failing_remote_rank_stops_every_rank() {
    let Some(lab) = lab_or_skip("a_failing_remote_rank_stops_every_rank", 2) else {
        return;
    };
    let s = Scratch::new("multihost-fail");
    let start = Instant::now();
    let child = launch_on_lab(
        &lab,
        &s.0,
        4,
        &[
            "sh",
            "-c",
            "if [ $RANK = 3 ]; then sleep 0.5; exit 5; fi; exec sleep 60",
        ],
    );
    let o = finish(
        child,
        Instant::now() + Duration::from_secs(60),
        "arbor-launch",
    );
    let elapsed = start.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(err.contains("rank 3"), "{err}");
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?}");
    let left = wait_no_leftovers(&lab, Duration::from_secs(5));
    assert!(
        left.is_empty(),
        "processes left in the namespaces: {left:?}"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_remote_ranks() {
    let Some(lab) = lab_or_skip("sigterm_to_the_launcher_stops_remote_ranks", 2) else {
        return;
    };
    let s = Scratch::new("multihost-sigterm");
    let child = launch_on_lab(&lab, &s.0, 4, &["sleep", "60"]);
    // Wait until all four ranks run.
    let until = Instant::now() + Duration::from_secs(20);
    while sleeping_ranks(&lab) < 4 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(sleeping_ranks(&lab), 4, "the ranks did not start");
    let pid = child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(killed.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    let o = finish(
        child,
        Instant::now() + Duration::from_secs(30),
        "arbor-launch",
    );
    assert!(!o.status.success());
    let left = wait_no_leftovers(&lab, Duration::from_secs(10));
    assert!(
        left.is_empty(),
        "processes left in the namespaces: {left:?}"
    );
}

#[test]
fn an_unreachable_host_is_named() {
    let Some(lab) = lab_or_skip("an_unreachable_host_is_named", 1) else {
        return;
    };
    let s = Scratch::new("multihost-unreachable");
    let missing = format!("{}-missing", lab.hosts[0]);
    let hostfile = s.0.join("hostfile");
    let text = format!("{} slots=1\n{missing} slots=1\n", lab.hosts[0]);
    if let Err(e) = std::fs::write(&hostfile, text) {
        panic!("{e}");
    }
    let o = Command::new(LAUNCH)
        .args(["-n", "2", "--hostfile"])
        .arg(&hostfile)
        .args([
            "--rsh",
            NETNS_AGENT,
            "--master-addr",
            &lab.addr(0),
            "--",
            "true",
        ])
        .output();
    let o = match o {
        Ok(o) => o,
        Err(e) => panic!("{e}"),
    };
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&missing) && err.contains("cannot be reached"),
        "{err}"
    );
    assert!(
        !err.contains(&format!("{:?} cannot", lab.hosts[0])),
        "{err}"
    );
}
