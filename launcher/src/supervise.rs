//! Starts the ranks, watches them, and stops them all when one fails or when arbor-launch
//! is told to stop.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::output::{Pump, Stream, Tail};
use crate::remote::{self, Placement, RemoteAgent};
use crate::signals;

/// How often the supervisor looks at its children.
const POLL: Duration = Duration::from_millis(20);
/// How long to wait for the last output of finished ranks.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
/// Ranks that failed by themselves within this long of the first failure seen are
/// candidates for its cause: a peer that notices a death can exit before the kernel shows
/// the dead rank as ended.
const CAUSE_WINDOW: Duration = Duration::from_millis(500);

/// What to start.
#[derive(Debug, Clone)]
pub struct Plan {
    pub command: Vec<OsString>,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Where each rank runs (index = rank); empty = every rank local.
    pub placement: Vec<Placement>,
    /// How to start the ranks of other hosts (set when there are any).
    pub remote: Option<RemoteStart>,
    /// Show only rank 0's output.
    pub rank0_only: bool,
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks after a failure, and the time
    /// the other ranks get to follow the first one that stopped after a forwarded signal.
    pub kill_grace: Duration,
    /// The job's secret (ARBOR_JOB_TOKEN) for every rank; None where the ranks find it
    /// themselves (ARBOR_JOB_TOKEN_FILE inherited from arbor-launch's environment).
    pub job_token: Option<JobToken>,
    /// Ranks listen on every interface (ARBOR_BIND_ALL=1).
    pub bind_all: bool,
    /// `--ranks-per-gpu`: ARBOR_RANKS_PER_GPU for every rank.
    pub ranks_per_gpu: Option<String>,
}

/// The job's secret; kept out of `Debug` output so that no log of a plan shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(pub String);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobToken(<{} bytes>)", self.0.len())
    }
}

/// Ranks on other hosts: the agent and the variables of arbor-launch's environment they get
/// (see `remote`).
#[derive(Debug, Clone)]
pub struct RemoteStart {
    pub agent: RemoteAgent,
    pub env: Vec<(String, String)>,
}

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Code(i32),
    Signal(i32),
}

impl Ending {
    fn of(status: ExitStatus) -> Ending {
        match (status.code(), status.signal()) {
            (Some(c), _) => Ending::Code(c),
            (None, Some(s)) => Ending::Signal(s),
            // Neither an exit code nor a signal cannot happen on Unix; call it a failure.
            (None, None) => Ending::Code(-1),
        }
    }

    pub fn success(self) -> bool {
        self == Ending::Code(0)
    }

    /// The exit code arbor-launch reports for it (shell convention for signals).
    pub fn exit_code(self) -> i32 {
        match self {
            Ending::Code(c) => c,
            Ending::Signal(s) => 128 + s,
        }
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::Code(c) => write!(f, "exited with code {c}"),
            Ending::Signal(s) => write!(f, "was killed by signal {s} ({})", signals::name(*s)),
        }
    }
}

struct Rank {
    rank: usize,
    child: Child,
    ending: Option<Ending>,
    stderr_tail: Option<Tail>,
    /// Started on another host through the remote-shell agent.
    remote: bool,
    /// The agent's stdin of a remote rank: the rank is stopped when this closes.
    agent_stdin: Option<ChildStdin>,
    /// The signals arbor-launch sent it (forwarded, or to stop it): a death by one of
    /// them is ours, not news.
    sent: Vec<i32>,
    /// When arbor-launch saw it end.
    ended_at: Option<Instant>,
}

impl Rank {
    /// It failed by itself: a non-zero exit code, or a signal arbor-launch did not send.
    fn failed_by_itself(&self) -> bool {
        match self.ending {
            Some(Ending::Code(c)) => c != 0,
            Some(Ending::Signal(s)) => !self.sent.contains(&s),
            None => false,
        }
    }
}

/// Why the group ended early.
enum Stop {
    /// A rank failed by itself, first seen at this time ([`cause`] names the rank).
    Failed(Instant),
    Signalled(i32),
}

/// The rank whose failure stopped the group, first seen at `first`: of the ranks that
/// failed by themselves within [`CAUSE_WINDOW`] of it, one killed by a signal (its peers'
/// exits, a broken connection, usually follow from its death, and may be seen first),
/// then the first seen, then the lowest.
fn cause(ranks: &[Rank], first: Instant) -> Option<&Rank> {
    ranks
        .iter()
        .filter(|r| r.failed_by_itself())
        .filter(|r| r.ended_at.is_some_and(|t| t <= first + CAUSE_WINDOW))
        .min_by_key(|r| {
            (
                !matches!(r.ending, Some(Ending::Signal(_))),
                r.ended_at,
                r.rank,
            )
        })
}

/// Runs the plan to the end; returns arbor-launch's exit code.
pub fn run(plan: &Plan) -> anyhow::Result<i32> {
    let (done_tx, done_rx) = mpsc::channel();
    let mut ranks: Vec<Rank> = Vec::with_capacity(plan.world_size);
    let mut pumps = 0usize;
    for rank in 0..plan.world_size {
        match spawn(plan, rank, &done_tx) {
            Ok((r, n)) => {
                ranks.push(r);
                pumps += n;
            }
            Err(e) => {
                stop_all(&mut ranks, plan.kill_grace);
                return Err(e);
            }
        }
    }
    drop(done_tx);
    tracing::debug!(
        world = plan.world_size,
        port = plan.master_port,
        "all ranks started"
    );

    let mut stop: Option<Stop> = None;
    // When the live ranks get SIGKILL: --kill-grace after a failure, or after the first
    // rank that stopped following a forwarded signal. A forwarded signal alone sets none:
    // the ranks stop on their own terms (`arbor serve` drains for up to its
    // --drain-timeout-s), and a second signal kills them at once.
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        if let Some(sig) = signals::take() {
            if stop.is_some() {
                // A second interrupt, or one while stopping after a failure: no more
                // patience.
                if !killed {
                    eprintln!(
                        "arbor-launch: got {} while stopping, killing the ranks",
                        signals::name(sig)
                    );
                }
                signal_live(&mut ranks, libc::SIGKILL);
                killed = true;
            } else {
                eprintln!(
                    "arbor-launch: got {}, forwarding it to the ranks (a second signal kills them)",
                    signals::name(sig)
                );
                signal_live(&mut ranks, sig);
                stop = Some(Stop::Signalled(sig));
            }
        }
        let ended = reap(&mut ranks);
        if stop.is_none() {
            if ended.iter().any(|&i| ranks[i].failed_by_itself()) {
                stop = Some(Stop::Failed(Instant::now()));
                kill_at = Some(Instant::now() + plan.kill_grace);
                signal_live(&mut ranks, libc::SIGTERM);
            }
        } else if matches!(stop, Some(Stop::Signalled(_))) && kill_at.is_none() {
            if let Some(&i) = ended.first() {
                kill_at = Some(Instant::now() + plan.kill_grace);
                tracing::debug!(rank = ranks[i].rank, "first rank stopped after the signal");
            }
        }
        if ranks.iter().all(|r| r.ending.is_some()) {
            break;
        }
        if let Some(at) = kill_at {
            if !killed && Instant::now() >= at {
                let live: Vec<String> = ranks
                    .iter()
                    .filter(|r| r.ending.is_none())
                    .map(|r| r.rank.to_string())
                    .collect();
                eprintln!(
                    "arbor-launch: {} {} still running {:.1} s (--kill-grace) after {}; sending SIGKILL",
                    if live.len() == 1 { "rank" } else { "ranks" },
                    live.join(", "),
                    plan.kill_grace.as_secs_f64(),
                    match stop.as_ref().and_then(|s| match s {
                        Stop::Failed(t) => cause(&ranks, *t),
                        Stop::Signalled(_) => None,
                    }) {
                        Some(r) => format!("rank {} failed", r.rank),
                        None => "another rank stopped".to_string(),
                    }
                );
                signal_live(&mut ranks, libc::SIGKILL);
                killed = true;
            }
        }
        std::thread::sleep(POLL);
    }

    // Output threads end when the pipes close; a grandchild that escaped its group could
    // keep one open, so do not wait for ever.
    let until = Instant::now() + OUTPUT_GRACE;
    for _ in 0..pumps {
        if done_rx
            .recv_timeout(until.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    Ok(report(&ranks, stop))
}

/// Records the ending of every rank that ended since the last look; returns their indices.
fn reap(ranks: &mut [Rank]) -> Vec<usize> {
    let mut ended = Vec::new();
    for (i, r) in ranks.iter_mut().enumerate() {
        if r.ending.is_some() {
            continue;
        }
        match r.child.try_wait() {
            Ok(Some(status)) => {
                let mut ending = Ending::of(status);
                r.agent_stdin = None;
                if r.remote {
                    // A remote rank's signal death arrives as 128+N (see `remote`).
                    if let Some(sig) = match ending {
                        Ending::Code(c) => remote::signal_of_remote_code(c),
                        Ending::Signal(_) => None,
                    } {
                        ending = Ending::Signal(sig);
                    }
                }
                r.ending = Some(ending);
                r.ended_at = Some(Instant::now());
                tracing::debug!(rank = r.rank, %ending, "rank ended");
                ended.push(i);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(rank = r.rank, error = %e, "cannot query rank"),
        }
    }
    ended
}

/// SIGTERM to the live ranks, then SIGKILL after `grace`; reaps them.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    signal_live(ranks, libc::SIGTERM);
    let until = Instant::now() + grace;
    while Instant::now() < until
        && ranks
            .iter_mut()
            .any(|r| matches!(r.child.try_wait(), Ok(None)))
    {
        std::thread::sleep(POLL);
    }
    signal_live(ranks, libc::SIGKILL);
    for r in ranks.iter_mut() {
        let _ = r.child.wait();
    }
}

fn signal_live(ranks: &mut [Rank], sig: i32) {
    for r in ranks.iter_mut().filter(|r| r.ending.is_none()) {
        if r.remote && sig != libc::SIGKILL {
            // The remote side stops it with SIGTERM.
            r.sent.push(libc::SIGTERM);
        }
        r.sent.push(sig);
        if r.remote && sig != libc::SIGKILL {
            // A signal would reach the agent (ssh), not the rank; closing the
            // agent's stdin makes the remote side stop the rank with SIGTERM (see `remote`).
            r.agent_stdin = None;
        } else {
            signals::signal_group(r.child.id(), sig);
        }
    }
}

fn spawn(plan: &Plan, rank: usize, done: &mpsc::Sender<()>) -> anyhow::Result<(Rank, usize)> {
    let Some((program, args)) = plan.command.split_first() else {
        anyhow::bail!("no command to run");
    };
    let (local_rank, local_world_size) = match plan.placement.get(rank) {
        Some(p) => (p.local_rank, p.local_world_size),
        None => (rank, plan.world_size),
    };
    let mut rank_env = vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", plan.world_size.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_world_size.to_string()),
        ("MASTER_ADDR", plan.master_addr.clone()),
        ("MASTER_PORT", plan.master_port.to_string()),
    ];
    if plan.bind_all {
        rank_env.push(("ARBOR_BIND_ALL", "1".to_string()));
    }
    if let Some(n) = &plan.ranks_per_gpu {
        rank_env.push((crate::RANKS_PER_GPU_ENV, n.clone()));
    }
    // A rank on another host: the agent runs it there, its variables on the
    // command line; the agent's stdin is a pipe held until the rank ends.
    let remote_host = plan
        .placement
        .get(rank)
        .filter(|p| !p.local)
        .map(|p| p.host.as_str());
    let mut cmd = match (remote_host, &plan.remote) {
        (Some(host), Some(start)) => {
            let mut env: Vec<(String, String)> = start
                .env
                .iter()
                .filter(|(k, _)| k != remote::STDIN_SECRET_VAR)
                .cloned()
                .collect();
            env.extend(rank_env.iter().map(|(k, v)| (k.to_string(), v.clone())));
            let mut cmd = remote::remote_command(
                &start.agent,
                host,
                &env,
                &plan.command,
                plan.job_token.is_some(),
            )?;
            cmd.stdin(Stdio::piped());
            cmd
        }
        (Some(host), None) => {
            anyhow::bail!("rank {rank}: host {host:?} is remote but no agent was set up")
        }
        (None, _) => {
            let mut cmd = Command::new(program);
            cmd.args(args).envs(rank_env.iter().map(|(k, v)| (k, v)));
            if let Some(t) = &plan.job_token {
                cmd.env(remote::STDIN_SECRET_VAR, &t.0);
            }
            // Rank 0 may read our stdin (mpirun does the same), unless it is a terminal: a
            // background process group reading the terminal would be stopped (SIGTTIN).
            // SAFETY: isatty has no memory-safety preconditions.
            let stdin_is_tty = unsafe { libc::isatty(0) } == 1;
            cmd.stdin(if rank == 0 && !stdin_is_tty {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
            cmd
        }
    };
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: a terminal's Ctrl-C reaches arbor-launch only (which
        // forwards it once), and stopping a rank stops its children too.
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs between fork and exec and only calls prctl and getppid,
        // which are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // If arbor-launch itself is killed (SIGKILL cannot be forwarded), the rank
                // goes too instead of running on as an orphan.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::other(
                        "arbor-launch exited while starting a rank",
                    ));
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().map_err(|e| match remote_host {
        Some(host) => anyhow::anyhow!(
            "cannot start rank {rank} on host {host:?} through {:?}: {e}",
            cmd.get_program().to_string_lossy()
        ),
        None => anyhow::anyhow!(
            "cannot start rank {rank}: {:?}: {e}",
            program.to_string_lossy()
        ),
    })?;
    let mut agent_stdin = child.stdin.take().filter(|_| remote_host.is_some());
    if let (Some(pipe), Some(token)) = (agent_stdin.as_mut(), &plan.job_token) {
        use std::io::Write as _;
        // The remote script reads this line before it starts the rank (see `remote`); an
        // agent that already died shows up as the rank's failure.
        if let Err(e) = writeln!(pipe, "{}", token.0).and_then(|_| pipe.flush()) {
            tracing::warn!("rank {rank}: could not pass the job token to the agent: {e}");
        }
    }
    let show = !plan.rank0_only || rank == 0;
    let prefix = if plan.prefix {
        format!("[rank {rank}] ").into_bytes()
    } else {
        Vec::new()
    };
    let stderr_tail: Option<Tail> = (!show).then(Default::default);
    let mut pumps = 0;
    if let Some(out) = child.stdout.take() {
        Pump {
            stream: Stream::Stdout,
            prefix: prefix.clone(),
            show,
            tail: None,
        }
        .spawn(out, done.clone())?;
        pumps += 1;
    }
    if let Some(err) = child.stderr.take() {
        Pump {
            stream: Stream::Stderr,
            prefix,
            show,
            tail: stderr_tail.clone(),
        }
        .spawn(err, done.clone())?;
        pumps += 1;
    }
    Ok((
        Rank {
            rank,
            child,
            ending: None,
            stderr_tail,
            remote: remote_host.is_some(),
            agent_stdin,
            sent: Vec::new(),
            ended_at: None,
        },
        pumps,
    ))
}

/// Prints how the group ended; returns the exit code.
fn report(ranks: &[Rank], stop: Option<Stop>) -> i32 {
    // Ranks we stopped end by our signals; only those that failed by themselves are news.
    let others = |skip: Option<usize>| -> String {
        let list: Vec<String> = ranks
            .iter()
            .filter(|r| Some(r.rank) != skip && r.failed_by_itself())
            .filter_map(|r| r.ending.map(|e| format!("rank {} {e}", r.rank)))
            .collect();
        if list.is_empty() {
            String::new()
        } else {
            format!(" ({})", list.join(", "))
        }
    };
    match stop {
        None => 0,
        Some(Stop::Failed(first)) => {
            // The failure that set `first` is among the ranks, so there is a cause.
            let Some((rank, ending)) =
                cause(ranks, first).and_then(|r| r.ending.map(|e| (r.rank, e)))
            else {
                eprintln!(
                    "arbor-launch: a rank failed; stopped the others{}",
                    others(None)
                );
                return 1;
            };
            eprintln!(
                "arbor-launch: rank {rank} {ending}; stopped the other {} rank(s){}",
                ranks.len() - 1,
                others(Some(rank))
            );
            if let Some(tail) = ranks.get(rank).and_then(|r| r.stderr_tail.as_ref()) {
                let t = match tail.lock() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                if !t.is_empty() {
                    eprintln!("arbor-launch: last lines of rank {rank}'s stderr:");
                    for line in t.iter() {
                        eprint!("[rank {rank}] {}", String::from_utf8_lossy(line));
                        if !line.ends_with(b"\n") {
                            eprintln!();
                        }
                    }
                }
            }
            match ending.exit_code() {
                0 => 1,
                c => c,
            }
        }
        Some(Stop::Signalled(sig)) => {
            // Ranks that stopped cleanly on the forwarded signal (`arbor serve` after its
            // drain) ended the job as asked: success.
            if ranks.iter().all(|r| r.ending.is_some_and(Ending::success)) {
                eprintln!(
                    "arbor-launch: stopped by {}; every rank exited with code 0",
                    signals::name(sig)
                );
                return 0;
            }
            eprintln!(
                "arbor-launch: stopped by {}{}",
                signals::name(sig),
                others(None)
            );
            128 + sig
        }
    }
}
