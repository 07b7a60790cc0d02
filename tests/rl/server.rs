//! The server under test: `arbor serve` on a checkpoint at TP 1, 2 or 4, with or without
//! an API key, its JSON routes, weight pushes and /metrics.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cli_support::*;
use crate::client;

pub(crate) struct Server {
    child: Child,
    pub(crate) addr: String,
    log: PathBuf,
    key: Option<String>,
}

const SERVE_ARGS: &[&str] = &["--max-seq-len", "128", "--max-num-seqs", "4"];

impl Server {
    pub(crate) fn start(tp: usize, model: &Path, extra: &[&str], tag: &str) -> Server {
        let port = free_port();
        let mut cmd = if tp == 1 {
            Command::new(arbor())
        } else {
            let mut c = Command::new(launcher());
            c.args(["-n", &tp.to_string(), "--"]).arg(arbor());
            c
        };
        cmd.args(["serve", "--model"])
            .arg(model)
            .args(["--port", &port.to_string()])
            .args(SERVE_ARGS)
            .args(extra);
        for v in LAUNCHER_VARS {
            cmd.env_remove(v);
        }
        cmd.env_remove("ARBOR_API_KEY");
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("rl-{tag}-{}-{port}.log", std::process::id()));
        let f = std::fs::File::create(&log).expect("create server log");
        cmd.stdout(Stdio::null())
            .stderr(f.try_clone().expect("log handle"));
        let child = cmd.spawn().expect("start arbor serve");
        let key = extra
            .iter()
            .position(|a| *a == "--api-key")
            .map(|i| extra[i + 1].to_string());
        let s = Server {
            child,
            addr: format!("127.0.0.1:{port}"),
            log,
            key,
        };
        let t0 = Instant::now();
        loop {
            if client::get(&s.addr, "/health").is_ok_and(|r| r.status == 200) {
                return s;
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

    pub(crate) fn auth(&self) -> Vec<(&str, String)> {
        self.key
            .iter()
            .map(|k| ("Authorization", format!("Bearer {k}")))
            .collect()
    }

    pub(crate) fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let auth = self.auth();
        let headers: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let text = body.map(Value::to_string);
        let r = client::request(&self.addr, method, path, text.as_deref(), &headers)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log_text()));
        let v = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
        (r.status, v)
    }

    pub(crate) fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(body))
    }

    pub(crate) fn push(&self, query: &str, image: &[u8]) -> (u16, Value) {
        let auth = self.auth();
        let headers: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let path = format!("/update_weights_from_tensor?{query}");
        let r = client::request_bytes(
            &self.addr,
            "POST",
            &path,
            image,
            "application/octet-stream",
            &headers,
        )
        .unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", self.log_text()));
        let v = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
        (r.status, v)
    }

    /// Asserts 200 and returns the body.
    pub(crate) fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body);
        assert_eq!(status, 200, "{path} {body} -> {v}\n{}", self.log_text());
        v
    }

    pub(crate) fn version(&self) -> String {
        let (status, v) = self.call("GET", "/get_weight_version", None);
        assert_eq!(status, 200, "{v}");
        v["weight_version"].as_str().expect("version").to_string()
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        let r = client::get(&self.addr, "/metrics").expect("metrics");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM lets arbor-launch stop its ranks; a kill is the fallback.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
