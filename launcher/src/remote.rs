//! Ranks on hosts other than this one, started through a remote-shell agent as mpirun does
//! (`ssh` by default, `--rsh CMD` to choose another).
//!
//! How a host maps onto the agent: the agent's words are split like a shell would split them;
//! `{host}` in them is replaced by the hostfile's host name, and where there is no `{host}`
//! the name goes right after the agent's words (`ssh -p 2222` → `ssh -p 2222 node1`). The
//! agent's last argument is always ONE command line for a POSIX shell on that host, exactly
//! what `ssh host 'line'` runs; an agent that execs its arguments instead ends in `sh -c`:
//! `--rsh "ip netns exec {host} sh -c"` (the host name is the namespace name).
//!
//! The command line (see [`remote_script`]) changes to this directory, sets the rank's
//! variables explicitly (an agent such as ssh forwards no environment) and supervises the rank
//! so that it behaves like a local one: the agent's exit status is the rank's (128+N for a
//! rank killed by signal N, the shell's convention, which ssh passes through where a signal
//! death would not be; [`signal_of_remote_code`] reads it back), SIGTERM/SIGINT/SIGHUP to the
//! shell are passed on as SIGTERM, and the rank is stopped when the agent's standard input
//! closes: the launcher keeps a pipe open on it and closing it (or the agent dying, which
//! closes ssh's channel) stops the remote rank with SIGTERM even where no signal can reach it.
//! No SIGKILL follows through ssh (a timer there would need a process that can outlive the
//! rank): a rank that ignores SIGTERM is killed by the launcher's SIGKILL only where the
//! agent runs it in the agent's own process group, as `ip netns exec … sh -c` does.

use std::fmt::Write as _;
use std::io::Read;
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The agent used when `--rsh` is not given. BatchMode: a host without key authentication
/// fails at once with a clear message instead of waiting on a password prompt.
pub const DEFAULT_AGENT: &str = "ssh -o BatchMode=yes";

/// Where the host name goes in an agent given with `--rsh`.
pub const HOST_PLACEHOLDER: &str = "{host}";

/// How long [`RemoteAgent::check_reachable`] waits for a host by default.
pub const DEFAULT_REACH_TIMEOUT: Duration = Duration::from_secs(30);

/// Variables of the launcher's environment that are forwarded to remote ranks (besides the
/// rank variables and those named with `-x`): arbor's own settings and logging. Everything
/// else (PATH, HOME, CUDA_VISIBLE_DEVICES, ...) belongs to the remote host.
const FORWARDED_PREFIXES: [&str; 3] = ["ARBOR_", "NCCL_", "RUST_"];

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("remote-shell agent {spec:?}: {why}")]
    BadAgent { spec: String, why: String },
    #[error(
        "host {host:?} cannot be reached through `{agent}`: {why}{}",
        detail_suffix(detail)
    )]
    Unreachable {
        host: String,
        agent: String,
        why: String,
        detail: String,
    },
    #[error("cannot start `{agent}` for host {host:?}: {source}")]
    Spawn {
        host: String,
        agent: String,
        #[source]
        source: std::io::Error,
    },
    #[error("environment variable name {name:?} cannot be passed to a remote rank: {why}")]
    BadEnvName { name: String, why: &'static str },
    #[error(
        "argument {arg:?} for host {host:?} is not UTF-8; it cannot be sent to a remote shell"
    )]
    BadArgument { host: String, arg: String },
    #[error("no MASTER_ADDR that host {host:?} can reach: {why}; give one with --master-addr")]
    NoMasterAddr { host: String, why: String },
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" (agent said: {detail})")
    }
}

/// The remote-shell agent (`--rsh`), split into words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteAgent {
    words: Vec<String>,
}

impl Default for RemoteAgent {
    fn default() -> Self {
        RemoteAgent {
            words: DEFAULT_AGENT.split(' ').map(str::to_owned).collect(),
        }
    }
}

impl std::fmt::Display for RemoteAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let quoted: Vec<String> = self.words.iter().map(|w| shell_quote(w)).collect();
        f.write_str(&quoted.join(" "))
    }
}

impl RemoteAgent {
    /// Parses an `--rsh` value such as `ssh -p 2222` or `ip netns exec {host} sh -c`.
    pub fn parse(spec: &str) -> Result<Self, RemoteError> {
        let bad = |why: &str| RemoteError::BadAgent {
            spec: spec.to_owned(),
            why: why.to_owned(),
        };
        let words = split_words(spec).map_err(|why| bad(&why))?;
        if words.is_empty() {
            return Err(bad("it is empty"));
        }
        if words[0].contains(HOST_PLACEHOLDER) {
            return Err(bad("the first word is the program; {host} cannot be there"));
        }
        Ok(RemoteAgent { words })
    }

    /// The agent's argv for running `shell_line` on `host`.
    pub fn argv(&self, host: &str, shell_line: &str) -> Vec<String> {
        let mut argv: Vec<String> = self
            .words
            .iter()
            .map(|w| w.replace(HOST_PLACEHOLDER, host))
            .collect();
        if !self.words.iter().any(|w| w.contains(HOST_PLACEHOLDER)) {
            argv.push(host.to_owned());
        }
        argv.push(shell_line.to_owned());
        argv
    }

    /// A `Command` running `shell_line` on `host` (stdio left to the caller).
    pub fn command(&self, host: &str, shell_line: &str) -> Command {
        let argv = self.argv(host, shell_line);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        cmd
    }

    /// Runs `exit 0` on `host` through the agent; an agent that cannot be started, fails, or
    /// does not answer within `timeout` is an error naming the host and what the agent said.
    pub fn check_reachable(&self, host: &str, timeout: Duration) -> Result<(), RemoteError> {
        let unreachable = |why: String, detail: String| RemoteError::Unreachable {
            host: host.to_owned(),
            agent: self.to_string(),
            why,
            detail,
        };
        let mut child = self
            .command(host, "exit 0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own process group, so that a timeout stops whatever the agent started too.
            .process_group(0)
            .spawn()
            .map_err(|source| RemoteError::Spawn {
                host: host.to_owned(),
                agent: self.to_string(),
                source,
            })?;
        // Read stderr on the side so a chatty agent cannot block on a full pipe.
        let stderr = child.stderr.take();
        let (said_tx, said_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut s) = stderr {
                let _ = s.read_to_string(&mut text);
            }
            let _ = said_tx.send(text);
        });
        let start = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if start.elapsed() >= timeout => {
                    kill_group(&child);
                    let _ = child.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => {
                    kill_group(&child);
                    return Err(unreachable(
                        format!("waiting for the agent failed: {e}"),
                        String::new(),
                    ));
                }
            }
        };
        // Something the agent left behind may hold stderr open: do not wait on it for long.
        let said = said_rx
            .recv_timeout(Duration::from_secs(1))
            .unwrap_or_default();
        let said = last_lines(&said, 3);
        match status {
            None => Err(unreachable(
                format!("no answer within {} s", timeout.as_secs_f32()),
                said,
            )),
            Some(s) if s.success() => Ok(()),
            Some(s) => Err(unreachable(
                format!("the agent {}", describe_status(s)),
                said,
            )),
        }
    }
}

fn kill_group(child: &std::process::Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on the process group the child leads (it was started with
        // process_group(0)); no memory is involved.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

fn describe_status(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => format!("ended with {status}"),
    }
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Quotes `word` for a POSIX shell: unchanged when it is made only of safe characters, else
/// in single quotes (a `'` inside becomes `'\''`).
pub fn shell_quote(word: &str) -> String {
    let safe = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c));
    if safe {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Splits an agent specification into words: blanks separate words, single quotes keep
/// everything, double quotes keep everything but `\"` and `\\`, a backslash outside quotes
/// escapes the next character.
pub fn split_words(spec: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err("a single quote is not closed".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => word.push(c),
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => return Err("a double quote is not closed".into()),
                        },
                        Some(c) => word.push(c),
                        None => return Err("a double quote is not closed".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => word.push(c),
                    None => return Err("it ends in a lone backslash".into()),
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

fn check_env_name(name: &str) -> Result<(), RemoteError> {
    let bad = |why| RemoteError::BadEnvName {
        name: name.to_owned(),
        why,
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return Err(bad("it is empty")),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err(bad("it must start with a letter or '_'"))
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(bad("it may hold only letters, digits and '_'"));
    }
    Ok(())
}

/// The variables of `launcher_env` that remote ranks get: those starting with ARBOR_, NCCL_ or
/// RUST_, and every name in `extra` (`-x NAME`) that is set. Sorted by name.
pub fn forwarded_env(
    launcher_env: impl IntoIterator<Item = (String, String)>,
    extra: &[String],
) -> Result<Vec<(String, String)>, RemoteError> {
    for name in extra {
        check_env_name(name)?;
    }
    let mut vars: Vec<(String, String)> = launcher_env
        .into_iter()
        .filter(|(name, _)| {
            FORWARDED_PREFIXES.iter().any(|p| name.starts_with(p)) || extra.contains(name)
        })
        .filter(|(name, _)| check_env_name(name).is_ok())
        .collect();
    vars.sort();
    Ok(vars)
}

/// The variable a remote rank reads from the first line of the agent's standard input
/// instead of its command line (see [`remote_script`]).
pub const STDIN_SECRET_VAR: &str = "ARBOR_JOB_TOKEN";

/// The shell command line that runs one rank on a remote host: `argv` with the variables
/// `env` set (later entries win), from directory `cwd` where that exists on the host, under
/// the supervision described in the module docs. Exit status: the rank's; 128+N for a rank
/// killed by signal N.
///
/// With `secret_on_stdin`, the first line of the agent's standard input becomes
/// [`STDIN_SECRET_VAR`]: a command line is visible to every user of both hosts (`ps`),
/// a process's environment only to its owner.
pub fn remote_script(
    env: &[(String, String)],
    argv: &[String],
    cwd: Option<&Path>,
    secret_on_stdin: bool,
) -> Result<String, RemoteError> {
    let mut line = String::new();
    if let Some(dir) = cwd {
        // As mpirun: the same directory where it exists on that host, else the login one.
        let _ = write!(
            line,
            "cd {} 2>/dev/null; ",
            shell_quote(&dir.to_string_lossy())
        );
    }
    // Background lists of a non-interactive shell read /dev/null, so keep the agent's stdin
    // on fd 3 for the watchdog; the rank's stderr is kept on fd 4 and the shell's own
    // ("Terminated" when it reaps a stopped rank) goes nowhere.
    line.push_str("exec 3<&0 4>&2 2>/dev/null; ");
    if secret_on_stdin {
        // The shell's `read` takes a pipe one byte at a time, so the watchdog below still
        // sees everything after this line.
        let _ = write!(
            line,
            "IFS= read -r {STDIN_SECRET_VAR} <&3 || exit 1; export {STDIN_SECRET_VAR}; "
        );
    }
    line.push_str("env");
    for (name, value) in env {
        check_env_name(name)?;
        let _ = write!(line, " {}", shell_quote(&format!("{name}={value}")));
    }
    for word in argv {
        let _ = write!(line, " {}", shell_quote(word));
    }
    line.push_str(
        " </dev/null 2>&4 3<&- 4>&- & p=$!; \
         (while read -r _; do :; done; kill -TERM $p) <&3 >/dev/null 2>&1 4>&- & w=$!; \
         exec 3<&-; \
         trap 'kill -TERM $p 2>/dev/null' HUP INT TERM; \
         while :; do wait $p; rc=$?; kill -0 $p 2>/dev/null || break; done; \
         kill $w 2>/dev/null; \
         exit $rc",
    );
    Ok(line)
}

/// The signal that killed a remote rank whose agent exited with `code` (128+N, see
/// [`remote_script`]), or `None` for an ordinary exit code.
pub fn signal_of_remote_code(code: i32) -> Option<i32> {
    (129..160).contains(&code).then_some(code - 128)
}

/// This host's address on the route toward `host` (a name or an address): what MASTER_ADDR
/// must be when rank 0 runs here and `host` runs other ranks. No packet is sent: connecting a
/// UDP socket only picks the route.
pub fn master_addr_toward(host: &str) -> Result<IpAddr, RemoteError> {
    let err = |why: String| RemoteError::NoMasterAddr {
        host: host.to_owned(),
        why,
    };
    let target = (host, 9)
        .to_socket_addrs()
        .map_err(|e| err(format!("its name does not resolve here ({e})")))?
        .next()
        .ok_or_else(|| err("its name resolves to no address".into()))?;
    let bind: IpAddr = if target.is_ipv4() {
        IpAddr::from([0u8, 0, 0, 0])
    } else {
        IpAddr::from([0u16; 8])
    };
    let socket = UdpSocket::bind((bind, 0)).map_err(|e| err(format!("no local socket: {e}")))?;
    socket
        .connect(target)
        .map_err(|e| err(format!("no route to {target}: {e}")))?;
    let local = socket
        .local_addr()
        .map_err(|e| err(format!("no local address toward {target}: {e}")))?
        .ip();
    if local.is_loopback() && !target.ip().is_loopback() {
        return Err(err(format!(
            "the route toward {target} leaves through loopback"
        )));
    }
    Ok(local)
}

/// Where one rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The hostfile's name of its host.
    pub host: String,
    /// Whether that host is this machine (started directly, not through the agent).
    pub local: bool,
    /// Rank among the ranks of its host, and how many that host runs.
    pub local_rank: usize,
    pub local_world_size: usize,
}

/// Places `world` ranks on `hosts` (name, slots) as mpirun's default mapping does: rank 0
/// on the first host, each host's slots filled in order; ranks beyond all the slots (when
/// oversubscribing) go round-robin over the hosts. `is_local` says which hosts are this
/// machine.
pub fn place_ranks(
    hosts: &[(String, usize)],
    world: usize,
    is_local: impl Fn(&str) -> bool,
) -> Vec<Placement> {
    let mut host_of: Vec<usize> = Vec::with_capacity(world);
    for (h, (_, slots)) in hosts.iter().enumerate() {
        for _ in 0..*slots {
            if host_of.len() < world {
                host_of.push(h);
            }
        }
    }
    let mut next = 0;
    while host_of.len() < world && !hosts.is_empty() {
        host_of.push(next % hosts.len());
        next += 1;
    }
    let mut count = vec![0usize; hosts.len()];
    let local_ranks: Vec<usize> = host_of
        .iter()
        .map(|&h| {
            count[h] += 1;
            count[h] - 1
        })
        .collect();
    host_of
        .iter()
        .zip(local_ranks)
        .map(|(&h, local_rank)| Placement {
            host: hosts[h].0.clone(),
            local: is_local(&hosts[h].0),
            local_rank,
            local_world_size: count[h],
        })
        .collect()
}

/// MASTER_ADDR for a group placed as `ranks`: `explicit` when given; 127.0.0.1 when every
/// rank is local; this host's address toward the first remote host when rank 0 is local;
/// else rank 0's host name as the hostfile gives it (the other hosts must resolve it).
pub fn choose_master_addr(
    explicit: Option<&str>,
    ranks: &[Placement],
) -> Result<String, RemoteError> {
    if let Some(addr) = explicit {
        return Ok(addr.to_owned());
    }
    let Some(first_remote) = ranks.iter().find(|p| !p.local) else {
        return Ok("127.0.0.1".to_owned());
    };
    match ranks.first() {
        Some(rank0) if rank0.local => {
            master_addr_toward(&first_remote.host).map(|ip| ip.to_string())
        }
        Some(rank0) => Ok(rank0.host.clone()),
        None => Ok("127.0.0.1".to_owned()),
    }
}

/// Checks every distinct remote host of `ranks` through the agent, all at once; the first
/// unreachable one (in hostfile order) is the error, the others are logged.
pub fn check_hosts(
    agent: &RemoteAgent,
    ranks: &[Placement],
    timeout: Duration,
) -> Result<(), RemoteError> {
    let mut hosts: Vec<&str> = Vec::new();
    for p in ranks.iter().filter(|p| !p.local) {
        if !hosts.contains(&p.host.as_str()) {
            hosts.push(&p.host);
        }
    }
    let results: Vec<Result<(), RemoteError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = hosts
            .iter()
            .map(|host| scope.spawn(move || agent.check_reachable(host, timeout)))
            .collect();
        handles
            .into_iter()
            .zip(&hosts)
            .map(|(h, host)| {
                h.join().unwrap_or_else(|_| {
                    Err(RemoteError::Unreachable {
                        host: (*host).to_owned(),
                        agent: agent.to_string(),
                        why: "the check panicked".into(),
                        detail: String::new(),
                    })
                })
            })
            .collect()
    });
    let mut first = None;
    for r in results {
        if let Err(e) = r {
            if first.is_none() {
                first = Some(e);
            } else {
                tracing::error!("{e}");
            }
        }
    }
    first.map_or(Ok(()), Err)
}

/// The agent command that runs `argv` as one remote rank with `env` set (see
/// [`remote_script`]), from this process's working directory where the host has it.
pub fn remote_command(
    agent: &RemoteAgent,
    host: &str,
    env: &[(String, String)],
    argv: &[std::ffi::OsString],
    secret_on_stdin: bool,
) -> Result<Command, RemoteError> {
    let words: Vec<String> = argv
        .iter()
        .map(|a| {
            a.to_str()
                .map(str::to_owned)
                .ok_or_else(|| RemoteError::BadArgument {
                    host: host.to_owned(),
                    arg: a.to_string_lossy().into_owned(),
                })
        })
        .collect::<Result<_, _>>()?;
    let cwd = std::env::current_dir().ok();
    let script = remote_script(env, &words, cwd.as_deref(), secret_on_stdin)?;
    Ok(agent.command(host, &script))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(ws: &[&str]) -> Vec<String> {
        ws.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn splits_agent_words_like_a_shell() {
        assert_eq!(
            split_words("ssh  -p 2222").ok(),
            Some(words(&["ssh", "-p", "2222"]))
        );
        assert_eq!(
            split_words(r#"ssh -o 'ProxyCommand=a b' "x\"y" c\ d"#).ok(),
            Some(words(&["ssh", "-o", "ProxyCommand=a b", "x\"y", "c d"]))
        );
        assert_eq!(split_words("''").ok(), Some(words(&[""])));
        assert!(split_words("ssh 'open").is_err());
        assert!(split_words("ssh \"open").is_err());
        assert!(split_words("ssh \\").is_err());
    }

    #[test]
    fn host_goes_at_placeholder_or_after_agent() {
        let ssh = RemoteAgent::default();
        assert_eq!(
            ssh.argv("node1", "echo hi"),
            words(&["ssh", "-o", "BatchMode=yes", "node1", "echo hi"])
        );
        let netns = RemoteAgent::parse("ip netns exec {host} sh -c").ok();
        assert_eq!(
            netns.map(|a| a.argv("ns-a", "echo hi")),
            Some(words(&[
                "ip", "netns", "exec", "ns-a", "sh", "-c", "echo hi"
            ]))
        );
        assert!(RemoteAgent::parse("  ").is_err());
        assert!(RemoteAgent::parse("{host} x").is_err());
    }

    #[test]
    fn quoting_round_trips_through_sh() {
        let nasty = [
            "plain",
            "",
            "with space",
            "it's",
            "$HOME `id` $(id) \\ \" ;|&<>*?",
            "line\nbreak",
        ];
        for word in nasty {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(word)))
                .output();
            let out = out
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .ok();
            assert_eq!(out.as_deref(), Some(word), "quoting {word:?}");
        }
    }

    #[test]
    fn forwards_only_arbor_settings_and_named_vars() {
        let env = [
            ("PATH", "/bin"),
            ("ARBOR_TIMEOUT_SECS", "5"),
            ("NCCL_NVLS_ENABLE", "0"),
            ("RUST_LOG", "debug"),
            ("MY_VAR", "x"),
            ("HOME", "/root"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        let got = forwarded_env(env, &["MY_VAR".to_string()]).ok();
        let want = [
            ("ARBOR_TIMEOUT_SECS", "5"),
            ("MY_VAR", "x"),
            ("NCCL_NVLS_ENABLE", "0"),
            ("RUST_LOG", "debug"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        assert_eq!(got, Some(want.to_vec()));
        assert!(forwarded_env(Vec::new(), &["BAD-NAME".to_string()]).is_err());
        assert!(forwarded_env(Vec::new(), &["1X".to_string()]).is_err());
    }

    /// An agent that runs the line locally: `sh -c LINE` with the host in a variable.
    fn local_agent() -> RemoteAgent {
        match RemoteAgent::parse("env ARBOR_TEST_HOST={host} sh -c") {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        }
    }

    fn run_rank(env: &[(String, String)], argv: &[&str]) -> std::process::Output {
        run_rank_with(env, argv, None)
    }

    /// Like `run_rank`; `secret` is written to the agent's stdin as the launcher does.
    fn run_rank_with(
        env: &[(String, String)],
        argv: &[&str],
        secret: Option<&str>,
    ) -> std::process::Output {
        let script = match remote_script(env, &words(argv), Some(Path::new("/")), secret.is_some())
        {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        // Stdin: a pipe the test holds open, as the launcher does.
        let child = local_agent()
            .command("hostA", &script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => panic!("starting the agent: {e}"),
        };
        // `wait_with_output` would close stdin first, which stops the rank by design.
        let mut held_stdin = child.stdin.take();
        if let (Some(secret), Some(pipe)) = (secret, held_stdin.as_mut()) {
            use std::io::Write as _;
            if let Err(e) = writeln!(pipe, "{secret}") {
                panic!("writing the secret: {e}");
            }
        }
        let out = child.wait_with_output();
        drop(held_stdin);
        match out {
            Ok(o) => o,
            Err(e) => panic!("running the agent: {e}"),
        }
    }

    #[test]
    fn script_sets_env_cwd_args_and_keeps_exit_code() {
        let env = [
            ("RANK".to_string(), "3".to_string()),
            ("ARBOR_X".to_string(), "a 'b' $c".to_string()),
        ];
        let out = run_rank(
            &env,
            &[
                "sh",
                "-c",
                "echo \"$ARBOR_TEST_HOST $RANK $ARBOR_X $(pwd) $1\"; echo oops >&2; exit 7",
                "_",
                "x y",
            ],
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hostA 3 a 'b' $c / x y\n"
        );
        assert_eq!(out.status.code(), Some(7));
        assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    }

    #[test]
    fn the_job_token_travels_on_stdin_not_on_the_command_line() {
        let secret = "s3cr3t token";
        let script = match remote_script(&[], &words(&["true"]), None, true) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert!(!script.contains(secret));
        let out = run_rank_with(
            &[("RANK".to_string(), "1".to_string())],
            &["sh", "-c", "echo \"[$ARBOR_JOB_TOKEN] $RANK\"; exit 3"],
            Some(secret),
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("[{secret}] 1\n")
        );
        assert_eq!(out.status.code(), Some(3));
    }

    #[test]
    fn rank_killed_by_signal_is_reported_as_128_plus_n() {
        let out = run_rank(&[], &["sh", "-c", "kill -USR1 $$"]);
        let code = out.status.code();
        assert_eq!(code, Some(128 + libc::SIGUSR1), "status {:?}", out.status);
        assert_eq!(code.and_then(signal_of_remote_code), Some(libc::SIGUSR1));
        assert_eq!(signal_of_remote_code(1), None);
        assert_eq!(signal_of_remote_code(255), None);
    }

    #[test]
    fn closing_stdin_or_sigterm_stops_the_rank() {
        for how in ["close stdin", "sigterm"] {
            let script = match remote_script(&[], &words(&["sleep", "30"]), None, false) {
                Ok(s) => s,
                Err(e) => panic!("{e}"),
            };
            let mut child = match local_agent()
                .command("h", &script)
                .stdin(Stdio::piped())
                .spawn()
            {
                Ok(c) => c,
                Err(e) => panic!("{e}"),
            };
            std::thread::sleep(Duration::from_millis(300));
            let start = Instant::now();
            if how == "close stdin" {
                drop(child.stdin.take());
            } else {
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            }
            let status = child.wait().ok();
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{how}: took {:?}",
                start.elapsed()
            );
            assert_eq!(
                status.and_then(|s| s.code()),
                Some(128 + libc::SIGTERM),
                "{how}"
            );
        }
    }

    #[test]
    fn unreachable_host_is_named() {
        let agent = match RemoteAgent::parse("sh -c 'echo no route to $0 >&2; exit 255'") {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        };
        let err = agent
            .check_reachable("node9", Duration::from_secs(5))
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(
            err.contains("\"node9\"")
                && err.contains("code 255")
                && err.contains("no route to node9"),
            "{err}"
        );
        let slow = match RemoteAgent::parse("sh -c 'sleep 10'") {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        };
        let err = slow
            .check_reachable("node8", Duration::from_millis(300))
            .err()
            .map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("no answer"));
        let missing = RemoteAgent::parse("/nonexistent/agent").ok();
        let err = missing.map(|a| a.check_reachable("n", Duration::from_secs(1)).is_err());
        assert_eq!(err, Some(true));
        assert!(local_agent()
            .check_reachable("ok", Duration::from_secs(5))
            .is_ok());
    }

    #[test]
    fn master_addr_toward_loopback_and_unknown() {
        assert_eq!(
            master_addr_toward("127.0.0.1").ok(),
            Some(IpAddr::from([127, 0, 0, 1]))
        );
        assert!(master_addr_toward("arbor-no-such-host.invalid").is_err());
    }

    fn hosts(v: &[(&str, usize)]) -> Vec<(String, usize)> {
        v.iter().map(|(h, n)| (h.to_string(), *n)).collect()
    }

    #[test]
    fn ranks_fill_slots_in_order_then_wrap() {
        let hs = hosts(&[("here", 2), ("a", 1), ("b", 2)]);
        let local = |h: &str| h == "here";
        let got: Vec<(String, bool, usize, usize)> = place_ranks(&hs, 4, local)
            .into_iter()
            .map(|p| (p.host, p.local, p.local_rank, p.local_world_size))
            .collect();
        let want = [
            ("here", true, 0, 2),
            ("here", true, 1, 2),
            ("a", false, 0, 1),
            ("b", false, 0, 1),
        ]
        .map(|(h, l, r, n)| (h.to_string(), l, r, n));
        assert_eq!(got, want.to_vec());
        // Oversubscribed: 5 slots, 7 ranks → two more, round-robin from the first host.
        let over: Vec<(String, usize, usize)> = place_ranks(&hs, 7, local)
            .into_iter()
            .map(|p| (p.host, p.local_rank, p.local_world_size))
            .collect();
        let want = [
            ("here", 0, 3),
            ("here", 1, 3),
            ("a", 0, 2),
            ("b", 0, 2),
            ("b", 1, 2),
            ("here", 2, 3),
            ("a", 1, 2),
        ]
        .map(|(h, r, n)| (h.to_string(), r, n));
        assert_eq!(over, want.to_vec());
    }

    #[test]
    fn master_addr_choice() {
        let hs = hosts(&[("n0", 2), ("n1", 2)]);
        let all_local = place_ranks(&hs, 4, |_| true);
        assert_eq!(
            choose_master_addr(None, &all_local).ok().as_deref(),
            Some("127.0.0.1")
        );
        let remote0 = place_ranks(&hs, 4, |_| false);
        assert_eq!(
            choose_master_addr(None, &remote0).ok().as_deref(),
            Some("n0")
        );
        assert_eq!(
            choose_master_addr(Some("10.0.0.9"), &remote0)
                .ok()
                .as_deref(),
            Some("10.0.0.9")
        );
        // Rank 0 here, the other host unknown to the resolver: say so, ask for --master-addr.
        let hs = hosts(&[("here", 1), ("arbor-no-such-host.invalid", 1)]);
        let mixed = place_ranks(&hs, 2, |h| h == "here");
        let err = choose_master_addr(None, &mixed)
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(
            err.contains("arbor-no-such-host.invalid") && err.contains("--master-addr"),
            "{err}"
        );
    }

    #[test]
    fn every_unreachable_host_is_checked_and_the_first_named() {
        // The agent fails for hosts whose name starts with "down".
        let agent = match RemoteAgent::parse(
            "env H={host} sh -c 'case $H in down*) echo cannot reach $H >&2; exit 255;; esac'",
        ) {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        };
        let hs = hosts(&[("here", 1), ("up1", 1), ("down1", 1), ("down2", 1)]);
        let ranks = place_ranks(&hs, 4, |h| h == "here");
        let err = check_hosts(&agent, &ranks, Duration::from_secs(10))
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(
            err.contains("\"down1\"") && err.contains("cannot reach down1"),
            "{err}"
        );
        let ok = place_ranks(&hosts(&[("here", 1), ("up1", 2)]), 3, |h| h == "here");
        assert!(check_hosts(&agent, &ok, Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn remote_command_runs_in_this_directory() {
        let argv: Vec<std::ffi::OsString> = ["sh", "-c", "pwd; echo $RANK"]
            .iter()
            .map(Into::into)
            .collect();
        let env = [("RANK".to_string(), "5".to_string())];
        let cmd = remote_command(&local_agent(), "h", &env, &argv, false);
        let mut child =
            match cmd.map(|mut c| c.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()) {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => panic!("{e}"),
                Err(e) => panic!("{e}"),
            };
        let held = child.stdin.take();
        let out = child.wait_with_output().ok();
        drop(held);
        let here = std::env::current_dir()
            .ok()
            .map(|d| format!("{}\n5\n", d.display()));
        assert_eq!(
            out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()),
            here
        );
        use std::os::unix::ffi::OsStringExt as _;
        let bad = vec![std::ffi::OsString::from_vec(vec![0xff, 0xfe])];
        assert!(remote_command(&local_agent(), "h", &[], &bad, false).is_err());
    }
}
