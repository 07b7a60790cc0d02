//! The server under test: `arbor serve` on the shared tiny model at TP 1 or 2, its
//! requests, its SIGTERM, and its /metrics.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::client;

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// One tiny Llama with a chat template, shared by the tests of this binary.
pub(crate) fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = shared_tiny("serve-llama", "llama");
        let cfg = json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write tokenizer_config.json");
        dir
    })
}

pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) addr: String,
    pub(crate) log: PathBuf,
}

impl Server {
    /// `arbor serve` at `tp` ranks (directly at TP 1, so that a signal reaches it alone).
    pub(crate) fn start(tp: usize, extra: &[&str], log: PathBuf) -> Server {
        Server::start_with(tp, &[], 128, extra, log)
    }

    /// [`Server::start`] with arbor-launch flags (TP > 1) and a context length.
    pub(crate) fn start_with(
        tp: usize,
        launcher_flags: &[&str],
        max_seq_len: usize,
        extra: &[&str],
        log: PathBuf,
    ) -> Server {
        Server::start_on(model(), tp, launcher_flags, max_seq_len, extra, log)
    }

    /// [`Server::start_with`] on another model.
    pub(crate) fn start_on(
        model: &Path,
        tp: usize,
        launcher_flags: &[&str],
        max_seq_len: usize,
        extra: &[&str],
        log: PathBuf,
    ) -> Server {
        let port = free_port();
        let mut cmd = if tp == 1 {
            Command::new(arbor())
        } else {
            let mut c = Command::new(launcher());
            c.args(["-n", &tp.to_string()])
                .args(launcher_flags)
                .arg("--")
                .arg(arbor());
            c
        };
        cmd.args(["serve", "--model"])
            .arg(model)
            .args(["--port", &port.to_string()])
            .args(["--max-seq-len", &max_seq_len.to_string()])
            .args(extra);
        for v in LAUNCHER_VARS {
            cmd.env_remove(v);
        }
        let f = std::fs::File::create(&log).expect("create server log");
        cmd.stdout(Stdio::null())
            .stderr(f.try_clone().expect("log handle"));
        let child = cmd.spawn().expect("start arbor serve");
        let mut s = Server {
            child,
            addr: format!("127.0.0.1:{port}"),
            log,
        };
        let t0 = Instant::now();
        loop {
            if client::get(&s.addr, "/health").is_ok_and(|r| r.status == 200) {
                return s;
            }
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("server exited early ({st}):\n{}", s.log_text());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "server not ready:\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let r = client::request(&self.addr, method, path, body, headers)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log_text()));
        let v = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
        (r.status, v)
    }

    pub(crate) fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(&body.to_string()), &[])
    }

    pub(crate) fn completion(&self, body: &Value) -> Value {
        let (status, v) = self.post("/v1/completions", body);
        assert_eq!(status, 200, "{body} -> {v}\n{}", self.log_text());
        v
    }

    /// SIGTERM; returns the exit status and the log.
    pub(crate) fn terminate(mut self) -> (ExitStatus, String) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let t0 = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return (st, self.log_text());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no exit after SIGTERM:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// /metrics once the engine has caught up with the requests that finished: the gauges
/// are updated after the step that finished the last request, which its client may see
/// first (at most 2 s of waiting).
pub(crate) fn settled_metrics(srv: &Server) -> String {
    let mut m = String::new();
    for _ in 0..100 {
        let (_, v) = srv.call("GET", "/metrics", None, &[]);
        m = v.as_str().expect("metrics text").to_string();
        if metric(&m, "arbor_kv_blocks_used") == 0 && metric(&m, "arbor_running_sequences") == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    m
}

/// Reads a counter or gauge from /metrics text.
pub(crate) fn metric(m: &str, name: &str) -> u64 {
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

/// A metric's value from /metrics (0 when the server does not answer).
pub(crate) fn metric_of(s: &Server, name: &str) -> u64 {
    match client::get(&s.addr, "/metrics") {
        Ok(r) => metric(&r.body, name),
        Err(_) => 0,
    }
}
