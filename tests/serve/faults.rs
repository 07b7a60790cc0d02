//! What cannot take the server down or hang a client: SIGTERM to the launcher (drain),
//! flags that cannot work, slow, oversized, idle and unread clients, and a rank that dies.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::client;
use crate::server::*;

/// Sends each body on its own connection from its own thread.
fn fire(
    s: &Server,
    bodies: &[Value],
) -> Vec<std::thread::JoinHandle<std::io::Result<client::HttpResponse>>> {
    bodies
        .iter()
        .map(|b| {
            let (addr, body) = (s.addr.clone(), b.to_string());
            std::thread::spawn(move || {
                client::request(&addr, "POST", "/v1/completions", Some(&body), &[])
            })
        })
        .collect()
}

/// Waits until `n` sequences run (admitted, so in flight when a signal or a failure
/// comes).
fn wait_running(s: &Server, n: u64) {
    let t0 = Instant::now();
    while metric_of(s, "arbor_running_sequences") < n {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{n} sequences never ran:\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every client's reply: 200 with `max_tokens` tokens in every choice, or 503 with an
/// OpenAI error body; never none. Returns how many got 503.
fn replies_are_complete_or_503(
    clients: Vec<std::thread::JoinHandle<std::io::Result<client::HttpResponse>>>,
    max_tokens: usize,
    log: &dyn Fn() -> String,
) -> usize {
    let mut refused = 0;
    for (i, c) in clients.into_iter().enumerate() {
        let r = match c.join().expect("client thread") {
            Ok(r) => r,
            Err(e) => panic!("client {i} got no reply: {e}\n{}", log()),
        };
        let v: Value = serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("client {i}: {} {:?}: {e}\n{}", r.status, r.body, log()));
        match r.status {
            200 => {
                for c in v["choices"].as_array().expect("choices") {
                    assert_eq!(
                        c["token_ids"].as_array().map(Vec::len),
                        Some(max_tokens),
                        "client {i}: {v}"
                    );
                }
            }
            503 => {
                assert!(v["error"]["message"].is_string(), "client {i}: {v}");
                refused += 1;
            }
            st => panic!("client {i}: status {st}: {v}\n{}", log()),
        }
    }
    refused
}

/// SIGTERM to arbor-launch while requests run at TP 2: the ranks drain as `arbor serve`
/// alone does (every request finishes, or gets 503 at --drain-timeout-s), and the launcher
/// exits 0: its --kill-grace (here 0.2 s) does not cut the drain short.
#[test]
fn sigterm_to_the_launcher_drains() {
    let s = Scratch::new("serve-launcher-drain");
    let max_tokens = 600;
    let body = json!({"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": true, "n": 4, "temperature": 0});
    for (drain, finishes) in [("30", true), ("0.3", false)] {
        let srv = Server::start_with(
            2,
            &["--kill-grace", "0.2"],
            1024,
            &["--drain-timeout-s", drain],
            s.path().join(format!("drain-{drain}.log")),
        );
        let clients = fire(&srv, &[body.clone(), body.clone()]);
        wait_running(&srv, 8);
        let log = srv.log.clone();
        let (st, text) = srv.terminate();
        let refused = replies_are_complete_or_503(clients, max_tokens, &|| {
            std::fs::read_to_string(&log).unwrap_or_default()
        });
        assert_eq!(st.code(), Some(0), "drain {drain}: {st}\n{text}");
        assert!(text.contains("drained, exiting"), "drain {drain}:\n{text}");
        if finishes {
            assert_eq!(refused, 0, "a 30 s drain finishes every request\n{text}");
        } else {
            // 600 tokens cannot all be made in 0.3 s: the deadline cancelled them.
            assert!(
                refused > 0,
                "no request was cancelled at the deadline\n{text}"
            );
        }
    }
}

/// `arbor serve` with `flags` (and `env`) must fail before it listens, naming every string
/// of `needles`, without a panic or an allocation abort, well within the limit.
fn refused_at_start(tp: usize, flags: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let port = free_port().to_string();
    let mut cmd = if tp == 1 {
        Command::new(arbor())
    } else {
        let mut c = Command::new(launcher());
        c.args(["-n", &tp.to_string(), "--"]).arg(arbor());
        c
    };
    cmd.args(["serve", "--model"])
        .arg(model())
        .args(["--port", &port])
        .args(flags)
        .env_remove("ARBOR_API_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    for v in LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    let t0 = Instant::now();
    let o = cmd.output().expect("start arbor serve");
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{flags:?} must fail:\n{out}\n{err}");
    assert!(
        !err.contains("panicked")
            && !err.contains("memory allocation")
            && !err.contains("listening"),
        "{flags:?}:\n{err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{flags:?}: stderr does not name {n:?}:\n{err}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "{flags:?} took {:?}",
        t0.elapsed()
    );
}

/// Flags that cannot work are refused before the server starts, naming the flag and the
/// value: a KV cache beyond memory (was an allocation abort; the cache is one
/// pool of blocks now, `--max-num-seqs` takes no memory of its own), a drain timeout
/// beyond a Duration (was a panic after "listening"), an empty API key (a server that
/// refuses everything), no KV blocks (every request refused).
#[test]
fn bad_flags_are_refused_before_anything_starts() {
    refused_at_start(
        1,
        &["--kv-cache-gib", "100000"],
        &[],
        &["--kv-cache-gib 100000", "KV cache", "bytes", "fit"],
    );
    refused_at_start(
        2,
        &["--kv-blocks", "100000000", "--max-seq-len", "64"],
        &[],
        &["--kv-blocks 100000000", "KV cache", "bytes"],
    );
    refused_at_start(
        1,
        &["--drain-timeout-s", "1e300"],
        &[],
        &["--drain-timeout-s", "1e300"],
    );
    refused_at_start(1, &["--drain-timeout-s=-1"], &[], &["--drain-timeout-s -1"]);
    refused_at_start(
        1,
        &[],
        &[("ARBOR_API_KEY", "")],
        &["ARBOR_API_KEY", "empty"],
    );
    refused_at_start(1, &["--api-key", " "], &[], &["--api-key", "empty"]);
    refused_at_start(1, &["--kv-blocks", "0"], &[], &["--kv-blocks 0"]);
    refused_at_start(
        1,
        &["--kv-blocks", "99999999999"],
        &[],
        &["--kv-blocks 99999999999"],
    );
    refused_at_start(
        1,
        &["--host", "no such host!"],
        &[],
        &["--host", "no such host!"],
    );
}

/// Sends `raw` on a new connection, then reads until the server closes it (or 60 s pass);
/// returns what came back and when the server closed.
fn raw_exchange(addr: &str, raw: &[u8]) -> (String, Duration) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.write_all(raw).expect("send");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let t0 = Instant::now();
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    (String::from_utf8_lossy(&back).into_owned(), t0.elapsed())
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Slow or oversized clients cannot hold the server: headers that never end
/// and bodies that never arrive are cut off at their timeouts, a body declared larger
/// than --max-body-bytes is 413 before it is sent, open connections are bounded, and a
/// normal request still gets through past hundreds of idle connections under a
/// 256-descriptor limit.
#[test]
fn slow_oversized_and_idle_connections_are_bounded() {
    let s = Scratch::new("serve-slow-clients");
    let srv = Server::start(
        1,
        &[
            "--header-timeout-s",
            "1",
            "--body-timeout-s",
            "1",
            "--max-connections",
            "8",
        ],
        s.path().join("server.log"),
    );
    let addr = srv.addr.clone();
    // Half the headers, then nothing: closed at the header timeout.
    let (_, took) = raw_exchange(&addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    assert!(took < Duration::from_secs(10), "half headers held {took:?}");
    // A body that never arrives: 408 at the body timeout.
    let (back, took) = raw_exchange(
        &addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
    );
    assert!(back.starts_with("HTTP/1.1 408"), "{back}");
    assert!(
        took < Duration::from_secs(10),
        "a stalled body held {took:?}"
    );
    // A declared length beyond --max-body-bytes: 413 at once, nothing read.
    let (back, took) = raw_exchange(
        &addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n",
    );
    assert!(back.starts_with("HTTP/1.1 413"), "{back}");
    assert!(back.contains("\"error\""), "an OpenAI error body: {back}");
    assert!(took < Duration::from_secs(5), "413 took {took:?}");
    // 20 idle connections: the server holds at most 8 (the rest wait to be accepted).
    let before = open_fds(srv.child.id());
    let idle: Vec<_> = (0..20)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = open_fds(srv.child.id());
    assert!(
        during <= before + 8,
        "{} descriptors with 20 idle connections (cap 8)",
        during - before
    );
    // A normal request gets through once the idle ones time out.
    let t0 = Instant::now();
    let v = srv.completion(&json!({"prompt": [1, 2], "max_tokens": 2}));
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(2)
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    drop(idle);
    let (st, log) = srv.terminate();
    assert!(st.success(), "{st}\n{log}");

    // Under a 256-descriptor limit, with the default --max-connections: 400 idle
    // connections, then a normal request.
    let port = free_port();
    let log = s.path().join("fd-limit.log");
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n 256 && exec '{}' serve --model '{}' --port {port} --max-seq-len 128 --header-timeout-s 1",
            arbor().display(),
            model().display()
        ))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("start arbor serve");
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    while !client::get(&addr, "/health").is_ok_and(|r| r.status == 200) {
        assert!(t0.elapsed() < Duration::from_secs(60), "not ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let idle: Vec<_> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() >= 300, "only {} connections", idle.len());
    let t0 = Instant::now();
    let body = json!({"prompt": [1, 2], "max_tokens": 2}).to_string();
    let r = client::request(&addr, "POST", "/v1/completions", Some(&body), &[]);
    let took = t0.elapsed();
    drop(idle);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let st = child.wait().expect("wait");
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    let r = r.unwrap_or_else(|e| panic!("no reply past 400 idle connections: {e}\n{log}"));
    assert_eq!(r.status, 200, "{}\n{log}", r.body);
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(st.success(), "{st}\n{log}");
}

/// A streaming client that never reads cannot make the server buffer without bound: once
/// its stream is far enough behind, its sequences are cancelled and their KV freed while
/// it still holds the connection.
#[test]
fn a_stream_that_is_never_read_is_cancelled() {
    use std::io::Write;
    let s = Scratch::new("serve-unread-stream");
    let srv = Server::start_with(1, &[], 2048, &[], s.path().join("server.log"));
    let cancelled_before = metric_of(&srv, "arbor_sequences_cancelled_total");
    // 16 choices of 2000 tokens with 20 alternatives each: far more than the socket
    // buffers hold.
    let body = json!({"prompt": [1, 2], "max_tokens": 2000, "n": 16, "logprobs": 20,
        "ignore_eos": true, "stream": true})
    .to_string();
    let mut c = std::net::TcpStream::connect(&srv.addr).expect("connect");
    c.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .expect("send");
    // Never read `c`. Its 16 sequences must be cancelled long before they could finish.
    let t0 = Instant::now();
    loop {
        let cancelled = metric_of(&srv, "arbor_sequences_cancelled_total") - cancelled_before;
        let running = metric_of(&srv, "arbor_running_sequences");
        if cancelled == 16 && running == 0 && metric_of(&srv, "arbor_kv_blocks_used") == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{cancelled} of 16 sequences cancelled, {running} running\n{}",
            srv.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(c);
    let v = srv.completion(&json!({"prompt": [1, 2], "max_tokens": 2}));
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(2)
    );
}

/// The pid of rank `r` among arbor-launch's children.
fn rank_pid(launcher_pid: u32, r: usize) -> String {
    let out = Command::new("pgrep")
        .args(["-P", &launcher_pid.to_string()])
        .output()
        .expect("pgrep");
    let pids = String::from_utf8_lossy(&out.stdout).to_string();
    let want = format!("RANK={r}");
    pids.split_whitespace()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()))
                .unwrap_or(false)
        })
        .unwrap_or_else(|| panic!("no rank {r} among the launcher's children {pids:?}"))
        .to_string()
}

/// A rank that dies ends the whole group, and the launcher names it as the cause; every
/// client with a request in flight gets a reply, 503 naming the failure (or 200 if its
/// request had finished), never an empty one (the leader once returned its error
/// without letting the HTTP side answer, and the launcher blamed rank 0).
#[test]
fn a_dead_rank_ends_the_group() {
    let s = Scratch::new("serve-rank-death");
    let max_tokens = 600;
    let body = json!({"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0});
    for run in 0..3 {
        let srv = Server::start_with(
            2,
            &[],
            1024,
            &[],
            s.path().join(format!("server-{run}.log")),
        );
        let clients = fire(&srv, &vec![body.clone(); 8]);
        wait_running(&srv, 8);
        let rank1 = rank_pid(srv.child.id(), 1);
        let _ = Command::new("kill").args(["-KILL", &rank1]).status();
        let log = srv.log.clone();
        let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
        let refused = replies_are_complete_or_503(clients, max_tokens, &log_text);
        assert!(
            refused > 0,
            "run {run}: no request saw the failure\n{}",
            log_text()
        );
        let mut srv = srv;
        let t0 = Instant::now();
        let status = loop {
            if let Ok(Some(st)) = srv.child.try_wait() {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the group did not end:\n{}",
                srv.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = srv.log_text();
        assert!(!status.success(), "{log}");
        assert!(
            log.contains("arbor-launch: rank 1 was killed by signal 9 (SIGKILL)"),
            "run {run}: the launcher names the dead rank as the cause:\n{log}"
        );
    }
}
