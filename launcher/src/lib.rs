//! arbor-launch: starts one process per rank with RANK, WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun's variables), prefixes
//! their output with the rank, and stops the whole group when one rank fails.
//!
//! Nothing else is asked of the ranks: any program that reads those variables (or none)
//! can be launched. The `arbor-launch` binary (src/bin/arbor-launch.rs in the root
//! package) only calls [`main`].

pub mod hostfile;
pub mod output;
pub mod remote;
pub mod signals;
pub mod supervise;

use std::ffi::OsString;
use std::net::{TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};

use hostfile::Hostfile;

/// Whose output to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Every rank's stdout and stderr, each line prefixed "[rank N] ".
    All,
    /// Rank 0's only (the last stderr lines of a failing rank are still shown).
    Rank0,
}

#[derive(Debug, Parser)]
#[command(
    name = "arbor-launch",
    version,
    about = "Start one process per rank of a tensor-parallel group (torchrun/mpirun style)",
    long_about = "Start one process per rank of a tensor-parallel group (torchrun/mpirun style).\n\n\
        Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and \
        MASTER_PORT in its environment (and ARBOR_RANKS_PER_GPU with --ranks-per-gpu), \
        on top of everything arbor-launch inherited \
        (NCCL_*, CUDA_*, RUST_LOG ... pass through untouched), and ARBOR_JOB_TOKEN: a \
        fresh random secret per job (unless ARBOR_JOB_TOKEN or ARBOR_JOB_TOKEN_FILE is \
        already set), so that only this job's ranks can join its rendezvous. Output lines are prefixed \
        with the rank. If a rank exits non-zero or dies by a signal, the other ranks get \
        SIGTERM, then SIGKILL after --kill-grace seconds, and arbor-launch exits non-zero \
        naming the rank and how it ended. SIGINT, SIGTERM and SIGHUP are forwarded to the \
        ranks, which then stop on their own terms (arbor serve drains for up to its \
        --drain-timeout-s): arbor-launch waits for them; once one has ended, the others get \
        --kill-grace seconds to follow before SIGKILL. A second signal kills them at once.\n\n\
        Example: arbor-launch -n 8 -- arbor collective-check",
    after_help = "Exit status: 0 when every rank succeeded (also after a forwarded signal \
        that every rank handled by exiting 0); the failing rank's exit code (128+N for \
        signal N) when one failed; 128+N when arbor-launch was stopped by signal N and a \
        rank did not exit 0; 2 for bad arguments or hostfiles."
)]
pub struct Args {
    /// Number of ranks to start [default: the hostfile's slot count].
    #[arg(short = 'n', long = "np", value_name = "N")]
    pub np: Option<usize>,

    /// Hostfile in OpenMPI format ("host slots=N" lines, # comments). Ranks fill the hosts'
    /// slots in order; hosts that are not this machine get theirs through --rsh.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,

    /// Remote-shell agent for hostfile hosts that are not this machine: "{host}" in it is
    /// replaced by the host name (else the name follows the agent's words) and its last
    /// argument is one shell command line, as for ssh. E.g. "ssh -p 2222", or for network
    /// namespaces "ip netns exec {host} sh -c".
    #[arg(long, value_name = "CMD", default_value = remote::DEFAULT_AGENT)]
    pub rsh: String,

    /// Also pass this variable of arbor-launch's environment to remote ranks (repeatable;
    /// ARBOR_*, NCCL_* and RUST_* always are). Local ranks inherit everything.
    #[arg(short = 'x', long = "export", value_name = "NAME")]
    pub export: Vec<String>,

    /// Allow more ranks than the hostfile has slots.
    #[arg(long)]
    pub oversubscribe: bool,

    /// Address of rank 0's rendezvous, as every rank reaches it [default: 127.0.0.1 when
    /// all ranks are local; with remote hosts, this host's address toward them when rank 0
    /// runs here, else rank 0's host name].
    #[arg(long, value_name = "ADDR")]
    pub master_addr: Option<String>,

    /// Let the ranks listen on every network interface instead of only the one MASTER_ADDR
    /// resolves to (sets ARBOR_BIND_ALL=1 for them). For hosts whose ranks reach rank 0
    /// through an address it does not own (NAT); the job token still guards the ports.
    #[arg(long)]
    pub bind_all: bool,

    /// Port of rank 0's rendezvous [default: a free port].
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,

    /// Whose output to show.
    #[arg(long, value_enum, default_value_t = Output::All)]
    pub output: Output,

    /// Same as --output rank0.
    #[arg(long, conflicts_with = "output")]
    pub rank0_only: bool,

    /// Do not prefix output lines with "[rank N] ".
    #[arg(long)]
    pub no_prefix: bool,

    /// Let N ranks share each GPU, or `auto`: as many per GPU as it takes to place this
    /// host's ranks on its visible GPUs (one each where there are enough). Sets
    /// ARBOR_RANKS_PER_GPU for every rank, which then takes GPU LOCAL_RANK / N. For checking
    /// TP 2, 4, 8 with fewer GPUs: the collectives of ranks that share a GPU go through the
    /// host, so it is slow. Without it, more ranks than GPUs on a host is an error.
    #[arg(long, value_name = "N|auto", value_parser = parse_ranks_per_gpu)]
    pub ranks_per_gpu: Option<String>,

    /// Seconds between SIGTERM and SIGKILL when stopping the ranks after one failed; after a
    /// forwarded signal, the seconds the other ranks get to follow the first that ended.
    #[arg(long, value_name = "SECS", default_value_t = 3.0)]
    pub kill_grace: f64,

    /// The program each rank runs, and its arguments (after "--").
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// The variable `--ranks-per-gpu` sets (read by arbor's `device_map`).
pub const RANKS_PER_GPU_ENV: &str = "ARBOR_RANKS_PER_GPU";

/// `--ranks-per-gpu`: a whole number of at least 1, or `auto` (as the ranks parse it).
fn parse_ranks_per_gpu(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok("auto".into());
    }
    match t.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n.to_string()),
        _ => Err(format!(
            "{s:?} is not a number of ranks per GPU (1 or more) or \"auto\""
        )),
    }
}

/// What `--ranks-per-gpu value` does to the ranks of `placement`, said when they start:
/// per host, how many GPUs its ranks take (a value above a host's ranks puts them all on
/// one GPU), and that the flag places CUDA ranks only (the launcher cannot know where the
/// ranks run).
pub fn ranks_per_gpu_note(value: &str, placement: &[remote::Placement]) -> String {
    const CPU: &str = "it places ranks on CUDA devices: ranks that run on the CPU ignore it";
    let Ok(per) = value.parse::<usize>() else {
        return format!(
            "--ranks-per-gpu {value}: each host's ranks spread over its visible GPUs,              sharing one only where there are fewer GPUs than ranks (each rank decides); {CPU}"
        );
    };
    let per = per.max(1);
    let mut hosts: Vec<(&str, usize)> = Vec::new();
    for p in placement {
        if !hosts.iter().any(|(h, _)| *h == p.host) {
            hosts.push((&p.host, p.local_world_size));
        }
    }
    let plural = |n: usize, one: &str, many: &str| {
        if n == 1 {
            format!("{n} {one}")
        } else {
            format!("{n} {many}")
        }
    };
    let each: Vec<String> = hosts
        .iter()
        .map(|&(host, ranks)| {
            let gpus = ranks.div_ceil(per);
            let mut s = format!(
                "{} on {host} {} {}",
                plural(ranks, "rank", "ranks"),
                if ranks == 1 { "takes" } else { "take" },
                plural(gpus, "GPU", "GPUs")
            );
            if per > ranks && ranks > 1 {
                s.push_str(&format!(
                    " (all on one: {per} per GPU is more than the {ranks} ranks there)"
                ));
            } else if ranks > 1 && gpus > 1 {
                s.push_str(&format!(" ({per} per GPU)"));
            }
            s
        })
        .collect();
    format!("--ranks-per-gpu {per}: {}; {CPU}", each.join(", "))
}

/// Entry point of the `arbor-launch` binary; returns the process exit code.
pub fn main() -> i32 {
    init_logging();
    let args = Args::parse();
    match plan(&args) {
        Err(e) => {
            eprintln!("arbor-launch: error: {e:#}");
            2
        }
        Ok(plan) => {
            if let Some(note) = plan
                .ranks_per_gpu
                .as_deref()
                .map(|n| ranks_per_gpu_note(n, &plan.placement))
            {
                eprintln!("arbor-launch: {note}");
            }
            if let Err(e) = signals::install() {
                eprintln!("arbor-launch: error: cannot install signal handlers: {e}");
                return 2;
            }
            match supervise::run(&plan) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("arbor-launch: error: {e:#}");
                    1
                }
            }
        }
    }
}

/// Logs to stderr, coloured only on a terminal and without `NO_COLOR`.
fn init_logging() {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}

/// Checks the arguments and the hostfile; decides the world size and the rendezvous.
pub fn plan(args: &Args) -> anyhow::Result<supervise::Plan> {
    let hostfile = args.hostfile.as_deref().map(Hostfile::load).transpose()?;
    let world_size = match (args.np, &hostfile) {
        (Some(0), _) => anyhow::bail!("-n 0: at least one rank is needed"),
        (Some(n), _) => n,
        (None, Some(h)) => h.total_slots(),
        (None, None) => anyhow::bail!("give the number of ranks with -n N (or a --hostfile)"),
    };
    if let Some(h) = &hostfile {
        let slots = h.total_slots();
        if world_size > slots && !args.oversubscribe {
            anyhow::bail!(
                "-n {world_size} is more than the {slots} slot(s) of hostfile {} \
                 (add --oversubscribe to allow it)",
                h.path.display()
            );
        }
    }
    if !(args.kill_grace.is_finite() && args.kill_grace >= 0.0 && args.kill_grace < 1e6) {
        anyhow::bail!(
            "--kill-grace {}: give a number of seconds ≥ 0",
            args.kill_grace
        );
    }
    // Where each rank runs; ranks on other hosts start through the agent.
    let hosts: Vec<(String, usize)> = match &hostfile {
        Some(h) => h.hosts.iter().map(|x| (x.name.clone(), x.slots)).collect(),
        None => vec![("localhost".to_string(), world_size)],
    };
    let placement = remote::place_ranks(&hosts, world_size, hostfile::is_local);
    let remote = if placement.iter().any(|p| !p.local) {
        let agent = remote::RemoteAgent::parse(&args.rsh)?;
        remote::check_hosts(&agent, &placement, remote::DEFAULT_REACH_TIMEOUT)
            .map_err(|e| with_hostfile_line(e, hostfile.as_ref()))?;
        // vars() would panic on a variable that is not UTF-8; such a one cannot be quoted
        // for the remote shell anyway.
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        let env = remote::forwarded_env(vars, &args.export)?;
        Some(supervise::RemoteStart { agent, env })
    } else {
        None
    };
    let master_addr = remote::choose_master_addr(args.master_addr.as_deref(), &placement)?;
    let master_port = match args.master_port {
        Some(p) => p,
        None => free_port(&master_addr, args.bind_all)
            .context("finding a free port for the rendezvous (give --master-port)")?,
    };
    let job_token = job_token(|k| std::env::var(k).ok())?.map(supervise::JobToken);
    Ok(supervise::Plan {
        command: args.command.clone(),
        world_size,
        master_addr,
        placement,
        remote,
        master_port,
        rank0_only: args.rank0_only || args.output == Output::Rank0,
        prefix: !args.no_prefix,
        kill_grace: Duration::from_secs_f64(args.kill_grace),
        job_token,
        bind_all: args.bind_all,
        ranks_per_gpu: args.ranks_per_gpu.clone(),
    })
}

/// Puts "hostfile F, line N" before an error about one of its hosts.
fn with_hostfile_line(e: remote::RemoteError, hostfile: Option<&Hostfile>) -> anyhow::Error {
    let host = match &e {
        remote::RemoteError::Unreachable { host, .. } | remote::RemoteError::Spawn { host, .. } => {
            Some(host.as_str())
        }
        _ => None,
    };
    let at = hostfile.zip(host).and_then(|(h, name)| {
        h.hosts
            .iter()
            .find(|x| x.name == name)
            .map(|x| format!("hostfile {}, line {}", h.path.display(), x.line))
    });
    match at {
        Some(at) => anyhow::Error::new(e).context(at),
        None => e.into(),
    }
}

/// A port nobody listens on right now at the address rank 0 will bind; rank 0 binds it
/// moments later. Where rank 0 runs on another host, or with `--bind-all`, this host's
/// wildcard address is the best guess there is.
///
/// Drawn at random outside the OS's ephemeral range, probed, and only then left to the
/// OS: a port the OS hands out for `bind(0)` and that is released at once can go to any
/// process's next outgoing connection before rank 0 binds it (seen under a test suite's
/// HTTP clients: "Address already in use" at rank 0), while a port outside that range is
/// only ever taken by an explicit bind. (The end-to-end tests draw their ports here too.)
pub fn free_port(master_addr: &str, bind_all: bool) -> std::io::Result<u16> {
    let host = master_addr.trim_start_matches('[').trim_end_matches(']');
    // The master's first address of this host (one it can bind), else the wildcard.
    let local = if bind_all {
        None
    } else {
        (host, 0)
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.find(|a| TcpListener::bind(a).is_ok()))
    };
    let at = local.unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
    let free = |port: u16| {
        let mut a = at;
        a.set_port(port);
        TcpListener::bind(a)?.local_addr().map(|a| a.port())
    };
    if let Some(range) = non_ephemeral_ports() {
        for _ in 0..64 {
            let mut b = [0u8; 2];
            if getrandom::fill(&mut b).is_err() {
                break;
            }
            let port = range.start + u16::from_le_bytes(b) % (range.end - range.start);
            if let Ok(p) = free(port) {
                return Ok(p);
            }
        }
    }
    free(0)
}

/// Ports below the OS's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range,
/// 32768–60999 by default) and above 10000; none where that range cannot be read or
/// leaves no room.
fn non_ephemeral_ports() -> Option<std::ops::Range<u16>> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let low: u16 = text.split_whitespace().next()?.parse().ok()?;
    (low > 11_000).then_some(10_000..low)
}

/// The job token to hand the ranks: the user's ARBOR_JOB_TOKEN when set; none when they
/// name a file with ARBOR_JOB_TOKEN_FILE (inherited by the ranks, which read it); else 32
/// fresh bytes from the OS's random source, hex-encoded.
pub fn job_token(get: impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<String>> {
    let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    if let Some(t) = set("ARBOR_JOB_TOKEN") {
        return Ok(Some(t));
    }
    if set("ARBOR_JOB_TOKEN_FILE").is_some() {
        return Ok(None);
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| anyhow::anyhow!("cannot draw a job token from the OS random source: {e}"))?;
    Ok(Some(bytes.iter().map(|b| format!("{b:02x}")).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Args {
        Args::try_parse_from(v).unwrap()
    }

    #[test]
    fn command_after_double_dash_is_kept_verbatim() {
        let a = args(&[
            "arbor-launch",
            "-n",
            "4",
            "--",
            "sh",
            "-c",
            "echo $RANK",
            "--np",
        ]);
        assert_eq!(a.np, Some(4));
        assert_eq!(a.command, vec!["sh", "-c", "echo $RANK", "--np"]);
        let p = plan(&a).unwrap();
        assert_eq!(p.world_size, 4);
        assert_ne!(p.master_port, 0);
        assert!(Args::try_parse_from(["arbor-launch", "-n", "2"]).is_err());
    }

    #[test]
    fn the_ranks_per_gpu_note_says_what_the_flag_does() {
        let on = |hosts: &[(&str, usize)], world| {
            let h: Vec<(String, usize)> = hosts.iter().map(|(n, s)| (n.to_string(), *s)).collect();
            remote::place_ranks(&h, world, |_| true)
        };
        let one = on(&[("localhost", 2)], 2);
        let n = ranks_per_gpu_note("3", &one);
        assert!(
            n.starts_with("--ranks-per-gpu 3: 2 ranks on localhost take 1 GPU (all on one: 3 per GPU is more than the 2 ranks there)"),
            "{n}"
        );
        assert!(n.contains("ranks that run on the CPU ignore it"), "{n}");
        let n = ranks_per_gpu_note("2", &on(&[("a", 5), ("b", 1)], 6));
        assert!(
            n.contains("5 ranks on a take 3 GPUs (2 per GPU), 1 rank on b takes 1 GPU;"),
            "{n}"
        );
        let n = ranks_per_gpu_note("auto", &one);
        assert!(n.contains("auto") && n.contains("CPU ignore it"), "{n}");
    }

    #[test]
    fn ranks_per_gpu_takes_a_count_or_auto() {
        let p = |v: &[&str]| Args::try_parse_from(v).map(|a| a.ranks_per_gpu);
        assert_eq!(p(&["l", "-n", "2", "--", "x"]).unwrap(), None);
        assert_eq!(
            p(&["l", "-n", "8", "--ranks-per-gpu", "8", "--", "x"]).unwrap(),
            Some("8".into())
        );
        assert_eq!(
            p(&["l", "-n", "8", "--ranks-per-gpu", "AUTO", "--", "x"]).unwrap(),
            Some("auto".into())
        );
        for bad in ["0", "-2", "two", ""] {
            let flag = format!("--ranks-per-gpu={bad}");
            let e = p(&["l", "-n", "2", &flag, "--", "x"])
                .unwrap_err()
                .to_string();
            assert!(e.contains("--ranks-per-gpu"), "{bad}: {e}");
        }
        let a = args(&["l", "-n", "4", "--ranks-per-gpu", "auto", "--", "x"]);
        assert_eq!(plan(&a).unwrap().ranks_per_gpu.as_deref(), Some("auto"));
    }

    #[test]
    fn job_tokens_are_fresh_unless_the_user_gives_one() {
        let none = |_: &str| None;
        let a = job_token(none).unwrap().unwrap();
        let b = job_token(none).unwrap().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b);
        let given = |k: &str| (k == "ARBOR_JOB_TOKEN").then(|| "mine".to_string());
        assert_eq!(job_token(given).unwrap().as_deref(), Some("mine"));
        let file = |k: &str| (k == "ARBOR_JOB_TOKEN_FILE").then(|| "/t".to_string());
        assert_eq!(job_token(file).unwrap(), None);
        let shown = format!("{:?}", supervise::JobToken(a.clone()));
        assert!(!shown.contains(&a), "{shown}");
    }

    #[test]
    fn free_port_is_probed_on_the_master_address() {
        let p = free_port("127.0.0.1", false).unwrap();
        // Free on loopback: rank 0 can bind it there.
        TcpListener::bind(("127.0.0.1", p)).unwrap();
        assert_ne!(free_port("192.0.2.1", false).unwrap(), 0);
        assert_ne!(free_port("127.0.0.1", true).unwrap(), 0);
        // Outside the ephemeral range where the OS says what it is.
        if let Some(range) = non_ephemeral_ports() {
            assert!(range.contains(&p), "{p} outside {range:?}");
        }
    }

    #[test]
    fn slots_bound_the_rank_count() {
        let dir = std::env::temp_dir().join(format!("arbor-launch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let hf = dir.join("hf");
        std::fs::write(&hf, "localhost slots=2\n").unwrap();
        let hfs = hf.to_str().unwrap();
        assert_eq!(
            plan(&args(&["l", "--hostfile", hfs, "--", "x"]))
                .unwrap()
                .world_size,
            2
        );
        let e = plan(&args(&["l", "-n", "3", "--hostfile", hfs, "--", "x"])).unwrap_err();
        assert!(e.to_string().contains("more than the 2 slot(s)"), "{e}");
        assert!(plan(&args(&[
            "l",
            "-n",
            "3",
            "--oversubscribe",
            "--hostfile",
            hfs,
            "--",
            "x"
        ]))
        .is_ok());
        // A remote host is checked through the agent before anything starts; here an
        // agent that always fails, as ssh does for a host it cannot reach.
        std::fs::write(&hf, "localhost slots=2\nnode7.invalid slots=2\n").unwrap();
        let e = plan(&args(&[
            "l",
            "--hostfile",
            hfs,
            "--master-addr",
            "10.0.0.1",
            "--rsh",
            "sh -c 'echo no route >&2; exit 255'",
            "--",
            "x",
        ]))
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("\"node7.invalid\" cannot be reached")
                && format!("{e:#}").contains("line 2")
                && format!("{e:#}").contains("no route"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
