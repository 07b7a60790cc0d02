//! RL rollouts against `arbor serve` on CPU ranks (docs/rl.md): weights updated from disk
//! and pushed over HTTP while requests run, at TP 1, 2 and 4. Every response must carry
//! the weight version it ran on and be bit-identical to a fresh TP 1 server started on
//! those weights (requests that finish, wait or are re-run per the policy; none lost);
//! a bad checkpoint is refused and the old weights keep serving; pause / continue /
//! abort / release / resume; and the trainer loop of `examples/rl_loop.py` without torch:
//! nudge the weights, push them at TP 2, roll out with log-probs, and check them against
//! `arbor score` at TP 1 on a checkpoint of the same weights, bit for bit.

mod cli_support;

#[path = "../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cli_support::*;
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Checkpoints

/// A safetensors file in memory: its tensors by name (dtype, shape, bytes).
#[derive(Clone)]
struct Tensors(BTreeMap<String, (String, Vec<usize>, Vec<u8>)>);

impl Tensors {
    fn read(path: &Path) -> Tensors {
        let raw = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let n = u64::from_le_bytes(raw[..8].try_into().expect("8 bytes")) as usize;
        let header: Value = serde_json::from_slice(&raw[8..8 + n]).expect("header JSON");
        let data = &raw[8 + n..];
        let mut out = BTreeMap::new();
        for (name, t) in header.as_object().expect("header object") {
            if name == "__metadata__" {
                continue;
            }
            let offs: Vec<usize> = t["data_offsets"]
                .as_array()
                .expect("offsets")
                .iter()
                .map(|v| v.as_u64().expect("offset") as usize)
                .collect();
            let shape = t["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|v| v.as_u64().expect("dim") as usize)
                .collect();
            out.insert(
                name.clone(),
                (
                    t["dtype"].as_str().expect("dtype").to_string(),
                    shape,
                    data[offs[0]..offs[1]].to_vec(),
                ),
            );
        }
        Tensors(out)
    }

    /// A safetensors image of the tensors `names`.
    fn image(&self, names: &[&String]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for name in names {
            let (dtype, shape, bytes) = &self.0[*name];
            header.insert(
                (*name).clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend_from_slice(bytes);
        }
        let mut h = Value::Object(header).to_string().into_bytes();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        out
    }

    fn names(&self) -> Vec<&String> {
        self.0.keys().collect()
    }

    /// `parts` safetensors images that hold every tensor once between them.
    fn parts(&self, parts: usize) -> Vec<Vec<u8>> {
        let names = self.names();
        let per = names.len().div_ceil(parts);
        names.chunks(per).map(|c| self.image(c)).collect()
    }

    /// Safetensors images of at most `max` bytes each, every tensor once between them.
    fn parts_below(&self, max: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut cur: Vec<&String> = Vec::new();
        for name in self.names() {
            cur.push(name);
            if self.image(&cur).len() > max {
                cur.pop();
                out.push(self.image(&cur));
                cur = vec![name];
            }
        }
        out.push(self.image(&cur));
        out
    }

    /// What an optimizer step does to the weights, in miniature: every 5th bf16 value of
    /// every tensor moves by one unit in the last place (deterministic in `step`).
    fn nudge(&mut self, step: u64) {
        for (dtype, _, bytes) in self.0.values_mut() {
            assert_eq!(dtype, "BF16", "the tiny models are bf16");
            for (i, c) in bytes.chunks_exact_mut(2).enumerate() {
                if (i as u64 + step).is_multiple_of(5) {
                    let b = u16::from_le_bytes([c[0], c[1]]);
                    // Toward or away from zero by one ulp: stays finite for these weights.
                    let b = if (i as u64 / 5 + step).is_multiple_of(2) {
                        b.wrapping_add(1)
                    } else {
                        b.wrapping_sub(1)
                    };
                    c.copy_from_slice(&b.to_le_bytes());
                }
            }
        }
    }

    /// A model directory: `like`'s config and tokenizer files, these weights.
    fn write_dir(&self, like: &Path, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create checkpoint dir");
        for f in std::fs::read_dir(like).expect("read model dir") {
            let f = f.expect("dir entry").path();
            let name = f.file_name().expect("file name").to_owned();
            if name != "model.safetensors" && f.is_file() {
                std::fs::copy(&f, dir.join(&name)).expect("copy model file");
            }
        }
        let names = self.names();
        std::fs::write(dir.join("model.safetensors"), self.image(&names)).expect("write weights");
    }
}

/// The checkpoints the tests switch between: A and B (two seeds of the tiny Llama) and
/// C (A nudged, written as a directory too), and their reference responses.
struct Models {
    a: PathBuf,
    b: PathBuf,
    c: PathBuf,
    c_tensors: Tensors,
}

fn models() -> &'static Models {
    static M: OnceLock<Models> = OnceLock::new();
    M.get_or_init(|| {
        let a = shared_tiny("rl-a", "llama");
        let b = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-rl-b");
        let _ = std::fs::remove_dir_all(&b);
        let o = run_arbor(&[
            "make-model",
            "--preset",
            "tiny",
            "--seed",
            "8",
            "--out",
            b.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "make-model B: {:?}", text(&o));
        let mut c_tensors = Tensors::read(&a.join("model.safetensors"));
        c_tensors.nudge(1);
        let c = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-rl-c");
        let _ = std::fs::remove_dir_all(&c);
        c_tensors.write_dir(&a, &c);
        Models { a, b, c, c_tensors }
    })
}

// ---------------------------------------------------------------------------------------
// Servers

struct Server {
    child: Child,
    addr: String,
    log: PathBuf,
    key: Option<String>,
}

const SERVE_ARGS: &[&str] = &["--max-seq-len", "128", "--max-num-seqs", "4"];

impl Server {
    fn start(tp: usize, model: &Path, extra: &[&str], tag: &str) -> Server {
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

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn auth(&self) -> Vec<(&str, String)> {
        self.key
            .iter()
            .map(|k| ("Authorization", format!("Bearer {k}")))
            .collect()
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let auth = self.auth();
        let headers: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let text = body.map(Value::to_string);
        let r = client::request(&self.addr, method, path, text.as_deref(), &headers)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log_text()));
        let v = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
        (r.status, v)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(body))
    }

    fn push(&self, query: &str, image: &[u8]) -> (u16, Value) {
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
    fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body);
        assert_eq!(status, 200, "{path} {body} -> {v}\n{}", self.log_text());
        v
    }

    fn version(&self) -> String {
        let (status, v) = self.call("GET", "/get_weight_version", None);
        assert_eq!(status, 200, "{v}");
        v["weight_version"].as_str().expect("version").to_string()
    }

    fn metric(&self, name: &str) -> f64 {
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

// ---------------------------------------------------------------------------------------
// Requests and their bits

/// Long requests (100 new tokens, ignore_eos) that keep the 4 slots busy: greedy and
/// sampled, one or two choices, token log-probs.
fn load(tag: &str) -> Vec<Value> {
    (0..16u64)
        .map(|i| {
            let len = 2 + (i * 7 % 17) as usize;
            let prompt: Vec<u64> = (0..len as u64)
                .map(|j| 3 + (i * 31 + j * 7) % 250)
                .collect();
            let mut v = json!({
                "prompt": prompt, "max_tokens": 100, "logprobs": 1, "ignore_eos": true,
                "sample_id": i, "rid": format!("{tag}-{i}"),
            });
            if i % 2 == 0 {
                v["temperature"] = json!(0.0);
            } else {
                v["temperature"] = json!(0.9);
                v["seed"] = json!(i);
                v["n"] = json!(2);
            }
            v
        })
        .collect()
}

/// Short probes: what a quick check of the serving weights sends.
fn probes() -> Vec<Value> {
    (0..3u64)
        .map(|i| {
            json!({"prompt": [5 + i, 17, 99, 3], "max_tokens": 8, "logprobs": 2,
                   "temperature": if i == 0 { 0.0 } else { 0.8 }, "seed": i, "prompt_logprobs": true})
        })
        .collect()
}

/// Per choice: token ids, log-prob bits, digests (the prefix that ran, for an aborted
/// choice), prompt log-prob bits.
fn choice_bits(c: &Value) -> (Vec<u64>, Vec<u32>, Vec<String>, Vec<u32>) {
    let f32_bits = |v: &Value| -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|l| (l.as_f64().expect("finite log-prob") as f32).to_bits())
                    .collect()
            })
            .unwrap_or_default()
    };
    let ids = c["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    let digests = c["logits_digest"]
        .as_array()
        .expect("digests")
        .iter()
        .map(|d| d.as_str().expect("hex").to_string())
        .collect();
    (
        ids,
        f32_bits(&c["logprobs"]["token_logprobs"]),
        digests,
        f32_bits(&c["prompt_logprobs"]),
    )
}

/// Responses of `bodies` from a fresh TP 1 server on `model`: the reference bits.
fn reference(model: &Path, bodies: &[Value], tag: &str) -> Vec<Value> {
    let s = Server::start(1, model, &[], tag);
    bodies.iter().map(|b| s.ok("/v1/completions", b)).collect()
}

/// A checkpoint's responses to `load(..)` and to `probes()`.
type Refs = (Vec<Value>, Vec<Value>);

/// The references of `load(tag)` and `probes()` on each checkpoint, made once.
fn refs(which: &str) -> &'static Refs {
    static R: OnceLock<std::sync::Mutex<BTreeMap<String, &'static Refs>>> = OnceLock::new();
    let m = R.get_or_init(Default::default);
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = g.get(which) {
        return r;
    }
    let ms = models();
    let dir = match which {
        "A" => &ms.a,
        "B" => &ms.b,
        "C" => &ms.c,
        other => panic!("no model {other}"),
    };
    let r: &'static _ = Box::leak(Box::new((
        reference(dir, &load("ref"), &format!("ref-{which}")),
        reference(dir, &probes(), &format!("refp-{which}")),
    )));
    g.insert(which.to_string(), r);
    r
}

/// Which checkpoint each version names in these tests.
fn model_of(version: &str) -> &'static str {
    match version {
        "0" | "A" | "A2" => "A",
        "B" | "B2" => "B",
        "C" => "C",
        other => panic!("unexpected weight version {other:?}"),
    }
}

/// Checks a response of request `i` against the reference of the weights it reports:
/// every choice equal bit for bit, or (finish_reason "abort") a prefix of it. Returns
/// the version and whether a choice was aborted.
fn check(resp: &Value, i: usize, refs_of: impl Fn(&str) -> &'static Value) -> (String, bool) {
    let version = resp["weight_version"]
        .as_str()
        .unwrap_or_else(|| panic!("no weight_version in {resp}"))
        .to_string();
    assert_eq!(resp["metadata"]["weight_version"], json!(version));
    let reference = refs_of(&version);
    let mut aborted = false;
    for (c, r) in resp["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .zip(reference["choices"].as_array().expect("ref choices"))
    {
        assert_eq!(c["weight_version"], json!(version), "choice of {resp}");
        let (got, want) = (choice_bits(c), choice_bits(r));
        if c["finish_reason"] == "abort" {
            aborted = true;
            let n = got.0.len();
            assert!(
                n <= want.0.len()
                    && got.0 == want.0[..n]
                    && got.1 == want.1[..n]
                    && got.2 == want.2[..n],
                "request {i}: aborted choice is not a prefix of version {version}'s reference"
            );
        } else {
            assert_eq!(
                got, want,
                "request {i} on version {version}: bits differ from a fresh server"
            );
            assert_eq!(c["finish_reason"], r["finish_reason"]);
        }
    }
    (version, aborted)
}

fn load_refs(version: &str, i: usize) -> &'static Value {
    &refs(model_of(version)).0[i]
}

fn probe_refs(version: &str, i: usize) -> &'static Value {
    &refs(model_of(version)).1[i]
}

/// Probes the server: every response equals the fresh server on `version`'s weights.
fn assert_serves(s: &Server, version: &str) {
    assert_eq!(s.version(), version);
    for (i, p) in probes().iter().enumerate() {
        let r = s.ok("/v1/completions", p);
        let (v, _) = check(&r, i, |v| probe_refs(v, i));
        assert_eq!(v, version);
    }
}

/// Sends `load(tag)` from 16 clients; once generation has begun, runs `update` (it
/// returns whether it expects the in-flight requests to see it); returns the responses
/// and `update`'s result.
fn under_load(s: &Server, tag: &str, update: impl FnOnce() -> Value) -> (Vec<Value>, Value) {
    let bodies = load(tag);
    let tokens0 = s.metric("arbor_generation_tokens_total");
    std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let addr = s.addr.clone();
                let body = b.to_string();
                let auth = s.auth();
                scope.spawn(move || {
                    let headers: Vec<(&str, &str)> =
                        auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    let r =
                        client::request(&addr, "POST", "/v1/completions", Some(&body), &headers)
                            .expect("completion");
                    assert_eq!(r.status, 200, "{body} -> {}", r.body);
                    serde_json::from_str::<Value>(&r.body).expect("JSON")
                })
            })
            .collect();
        let t0 = Instant::now();
        while s.metric("arbor_generation_tokens_total") < tokens0 + 8.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no tokens generated"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let u = update();
        let resps = handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect();
        (resps, u)
    })
}

// ---------------------------------------------------------------------------------------
// The scenario at TP 1, 2 and 4

fn updates_mid_load(tp: usize) {
    let m = models();
    let s = Server::start(tp, &m.a, &[], &format!("tp{tp}"));
    assert_serves(&s, "0");

    // 1. From disk, policy wait: started requests finish on A, the rest wait for B.
    let (resps, u) = under_load(&s, &format!("w{tp}"), || {
        s.ok(
            "/update_weights_from_disk",
            &json!({"model_path": m.b, "weight_version": "B"}),
        )
    });
    assert_eq!(u["weight_version"], "B", "{u}");
    assert!(u["waited_seconds"].as_f64().expect("waited") > 0.0, "{u}");
    let mut seen = BTreeMap::new();
    for (i, r) in resps.iter().enumerate() {
        let (v, aborted) = check(r, i, |v| load_refs(v, i));
        assert!(!aborted);
        *seen.entry(v).or_insert(0) += 1;
    }
    assert!(
        seen.contains_key("0"),
        "no request finished on the old weights: {seen:?}"
    );
    eprintln!("TP {tp}, wait: {seen:?}");
    assert_serves(&s, "B");

    // 2. From disk, policy retract: started requests run again on A2; none is lost.
    let (resps, u) = under_load(&s, &format!("r{tp}"), || {
        s.ok(
            "/update_weights_from_disk",
            &json!({"model_path": m.a, "weight_version": "A2", "policy": "retract"}),
        )
    });
    assert!(u["retracted"].as_u64().expect("retracted") > 0, "{u}");
    let mut seen = BTreeMap::new();
    for (i, r) in resps.iter().enumerate() {
        let (v, aborted) = check(r, i, |v| load_refs(v, i));
        assert!(!aborted);
        *seen.entry(v).or_insert(0) += 1;
    }
    assert!(seen.contains_key("A2"), "{seen:?}");
    eprintln!("TP {tp}, retract: {seen:?}");

    // 3. Pushed over HTTP in three parts, policy abort: what ran is a prefix of A2's bits.
    let parts = m.c_tensors.parts(3);
    let (resps, u) = under_load(&s, &format!("p{tp}"), || {
        for p in &parts[..parts.len() - 1] {
            let (st, v) = s.push("commit=false", p);
            assert_eq!(st, 200, "{v}");
        }
        let (st, v) = s.push(
            "commit=true&weight_version=C&policy=abort",
            &parts[parts.len() - 1],
        );
        assert_eq!(st, 200, "{v}");
        v
    });
    assert!(u["aborted"].as_u64().expect("aborted") > 0, "{u}");
    let mut aborted = 0;
    for (i, r) in resps.iter().enumerate() {
        let (_, a) = check(r, i, |v| load_refs(v, i));
        aborted += usize::from(a);
    }
    assert!(aborted > 0);
    assert_serves(&s, "C");
    // Requests after the update: C's bits (the load again, alone).
    for (i, b) in load(&format!("after{tp}")).iter().enumerate().take(4) {
        let (v, _) = check(&s.ok("/v1/completions", b), i, |v| load_refs(v, i));
        assert_eq!(v, "C");
    }

    // 4. Bad checkpoints: refused with a 4xx, nothing changes.
    bad_checkpoints(&s, tp);
    assert_serves(&s, "C");
}

/// Every kind of bad update is refused, naming what is wrong; C keeps serving.
fn bad_checkpoints(s: &Server, tp: usize) {
    let m = models();
    let scratch = Scratch::new(&format!("rl-bad-{tp}"));
    // A config that is not the served model.
    let other = scratch.path().join("eps");
    m.c_tensors.write_dir(&m.a, &other);
    let cfg_path = other.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("config")).expect("JSON");
    cfg["rms_norm_eps"] = json!(1e-3);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write config");
    let (st, v) = s.post("/update_weights_from_disk", &json!({"model_path": other}));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("rms_norm_eps"),
        "{v}"
    );
    assert_eq!(v["success"], false);
    // A truncated safetensors file.
    let trunc = scratch.path().join("trunc");
    m.c_tensors.write_dir(&m.a, &trunc);
    let w = trunc.join("model.safetensors");
    let bytes = std::fs::read(&w).expect("weights");
    std::fs::write(&w, &bytes[..bytes.len() / 2]).expect("truncate");
    let (st, v) = s.post("/update_weights_from_disk", &json!({"model_path": trunc}));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("safetensors"),
        "{v}"
    );
    // A directory that does not exist.
    let (st, v) = s.post(
        "/update_weights_from_disk",
        &json!({"model_path": scratch.path().join("nope")}),
    );
    assert_eq!(st, 400, "{v}");
    // Pushed: a wrong shape, a NaN, an unknown name, a missing tensor.
    let mut t = m.c_tensors.clone();
    let name = "model.layers.0.mlp.down_proj.weight".to_string();
    let (dtype, shape, data) = t.0[&name].clone();
    t.0.insert(
        name.clone(),
        (dtype.clone(), vec![shape[1], shape[0]], data.clone()),
    );
    let (st, v) = s.push("commit=true", &t.image(&t.names()));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("down_proj"),
        "{v}"
    );
    let mut t = m.c_tensors.clone();
    let mut nan = data.clone();
    nan[10..12].copy_from_slice(&0x7fc0u16.to_le_bytes());
    t.0.insert(name.clone(), (dtype.clone(), shape.clone(), nan));
    let (st, v) = s.push("commit=true", &t.image(&t.names()));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("must be finite"),
        "{v}"
    );
    let mut t = m.c_tensors.clone();
    t.0.insert(
        "model.layers.0.mlp.typo.weight".into(),
        (dtype, shape, data),
    );
    let (st, v) = s.push("commit=true", &t.image(&t.names()));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"].as_str().expect("message").contains("typo"),
        "{v}"
    );
    let names = m.c_tensors.names();
    let (st, v) = s.push("commit=false", &m.c_tensors.image(&names[1..]));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["staged_tensors"], json!(names.len() - 1));
    // A disk update while a push is staged is a second update: refused.
    let (st, v) = s.post("/update_weights_from_disk", &json!({"model_path": m.a}));
    assert_eq!(st, 409, "{v}");
    let (st, v) = s.push("commit=true", &[]);
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains(names[0].as_str()),
        "{v}"
    );
    // Nothing is left staged after a failed commit.
    let (st, v) = s.push("commit=true", &[]);
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("nothing is staged"),
        "{v}"
    );
}

#[test]
fn updates_mid_load_tp1() {
    updates_mid_load(1);
}

#[test]
fn updates_mid_load_tp2() {
    updates_mid_load(2);
}

#[test]
fn updates_mid_load_tp4() {
    updates_mid_load(4);
}

// ---------------------------------------------------------------------------------------
// Generation control, memory, limits and the API key (TP 2)

#[test]
fn pause_abort_release_and_limits() {
    let m = models();
    let key = "rl-secret";
    let s = Server::start(
        2,
        &m.a,
        &[
            "--api-key",
            key,
            "--max-weight-upload-bytes",
            "200000",
            "--max-body-bytes",
            "65536",
        ],
        "ctl",
    );
    // Every route needs the key.
    for (method, path) in [
        ("POST", "/update_weights_from_disk"),
        ("POST", "/update_weights_from_tensor"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/destroy_weights_update_group"),
        ("GET", "/get_weight_version"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/abort_request"),
        ("POST", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"),
        ("POST", "/flush_cache"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/reset_prefix_cache"),
    ] {
        let r = client::request(&s.addr, method, path, Some("{}"), &[]).expect("request");
        assert_eq!(r.status, 401, "{method} {path} without the key: {}", r.body);
    }
    assert_serves(&s, "0");

    // Uploads above --max-weight-upload-bytes: 413, nothing staged.
    let big: Vec<&String> = m
        .c_tensors
        .names()
        .into_iter()
        .filter(|n| m.c_tensors.0[*n].2.len() > 80_000)
        .take(3)
        .collect();
    let over = m.c_tensors.image(&big);
    assert!(over.len() > 200_000 && over.len() < 400_000);
    let (st, v) = s.push("commit=true", &over);
    assert_eq!(st, 413, "{v}");
    // Parts below it work (a 1.6 MB checkpoint in parts of < 200 KB), larger than the
    // JSON routes' --max-body-bytes.
    let parts = m.c_tensors.parts_below(200_000);
    assert!(parts.len() > 8 && parts.iter().all(|p| p.len() <= 200_000));
    assert!(parts.iter().any(|p| p.len() > 65536));
    for p in &parts {
        let (st, v) = s.push("commit=false", p);
        assert_eq!(st, 200, "{v}");
    }
    let (st, v) = s.push("discard=true", &[]);
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.push("commit=true", &[]);
    assert_eq!(st, 400, "discarded, so nothing to commit: {v}");
    // Malformed bodies.
    let (st, v) = s.post(
        "/update_weights_from_disk",
        &json!({"model_path": m.b, "policy": "later"}),
    );
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.post("/update_weights_from_disk", &json!({"path": m.b}));
    assert_eq!(st, 422, "{v}");
    let (st, v) = s.post("/pause_generation", &json!({"mode": "sometimes"}));
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 3, "group_name": "g"}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("unique_id"),
        "{v}"
    );
    // On CPU ranks a NCCL group cannot form: refused by every rank, nothing changes.
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"unique_id": "00".repeat(128), "rank_offset": 1, "world_size": 3, "group_name": "g", "backend": "nccl"}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("--device cuda"),
        "{v}"
    );
    let (st, v) = s.post(
        "/update_weights_from_distributed",
        &json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": "g"}),
    );
    assert_eq!(st, 409, "{v}");

    // Pause (retract) holds new requests; an update applies; continue runs them on B.
    let v = s.ok("/pause_generation", &json!({"mode": "retract"}));
    assert_eq!(v["success"], true);
    let (resps, _) = std::thread::scope(|scope| {
        let hs: Vec<_> = probes()
            .into_iter()
            .map(|b| {
                let addr = s.addr.clone();
                scope.spawn(move || {
                    let r = client::request(
                        &addr,
                        "POST",
                        "/v1/completions",
                        Some(&b.to_string()),
                        &[("Authorization", "Bearer rl-secret")],
                    )
                    .expect("completion");
                    assert_eq!(r.status, 200, "{}", r.body);
                    serde_json::from_str::<Value>(&r.body).expect("JSON")
                })
            })
            .collect();
        let (st, h) = s.call("GET", "/health", None);
        assert_eq!((st, &h["paused"]), (200, &json!(true)), "{h}");
        std::thread::sleep(Duration::from_millis(300));
        let u = s.ok(
            "/update_weights_from_disk",
            &json!({"model_path": m.b, "weight_version": "B"}),
        );
        assert_eq!(u["weight_version"], "B");
        s.ok("/continue_generation", &json!({}));
        (
            hs.into_iter()
                .map(|h| h.join().expect("client"))
                .collect::<Vec<_>>(),
            u,
        )
    });
    for (i, r) in resps.iter().enumerate() {
        let (v, _) = check(r, i, |v| probe_refs(v, i));
        assert_eq!(v, "B", "queued during the pause, run after the update");
    }

    // Pause in place holds a started request: an update that would wait is refused;
    // continue finishes it on the weights it started on.
    let long = load("long").swap_remove(0);
    let tokens0 = s.metric("arbor_generation_tokens_total");
    std::thread::scope(|scope| {
        let addr = s.addr.clone();
        let body = long.to_string();
        let h = scope.spawn(move || {
            let r = client::request(
                &addr,
                "POST",
                "/v1/completions",
                Some(&body),
                &[("Authorization", "Bearer rl-secret")],
            )
            .expect("completion");
            serde_json::from_str::<Value>(&r.body).expect("JSON")
        });
        while s.metric("arbor_generation_tokens_total") < tokens0 + 2.0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        s.ok("/pause_generation", &json!({"mode": "in_place"}));
        let (st, v) = s.post("/update_weights_from_disk", &json!({"model_path": m.a}));
        assert_eq!(st, 409, "{v}");
        assert!(
            v["message"]
                .as_str()
                .expect("message")
                .contains("held in place"),
            "{v}"
        );
        let (st, v) = s.post("/release_memory_occupation", &json!({}));
        assert_eq!(st, 409, "release while a request holds the KV: {v}");
        s.ok("/continue_generation", &json!({}));
        let r = h.join().expect("client");
        let (v, aborted) = check(&r, 0, |v| load_refs(v, 0));
        assert_eq!((v.as_str(), aborted), ("B", false));
    });

    // Abort one request by its rid: it ends with what it had, a prefix of B's bits.
    let tokens0 = s.metric("arbor_generation_tokens_total");
    std::thread::scope(|scope| {
        let addr = s.addr.clone();
        let body = long.to_string();
        let h = scope.spawn(move || {
            let r = client::request(
                &addr,
                "POST",
                "/v1/completions",
                Some(&body),
                &[("Authorization", "Bearer rl-secret")],
            )
            .expect("completion");
            serde_json::from_str::<Value>(&r.body).expect("JSON")
        });
        while s.metric("arbor_generation_tokens_total") < tokens0 + 2.0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let v = s.ok("/abort_request", &json!({"rid": "long-0"}));
        assert_eq!(v["aborted"], 1, "{v}");
        let r = h.join().expect("client");
        assert_eq!(r["id"], "long-0");
        let (v, aborted) = check(&r, 0, |v| load_refs(v, 0));
        assert_eq!((v.as_str(), aborted), ("B", true));
    });

    // Release: generation gets 503 until resume; resume reads the weights again.
    s.ok("/release_memory_occupation", &json!({}));
    let (st, v) = s.post("/v1/completions", &probes()[0]);
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "memory_released", "{v}");
    let (_, v) = s.call("GET", "/is_sleeping", None);
    assert_eq!(v["is_sleeping"], true);
    s.ok("/resume_memory_occupation", &json!({}));
    assert_serves(&s, "B");
    // vLLM's names, and a resume from another checkpoint (new weights: a new version).
    s.ok("/sleep", &json!({}));
    let (_, v) = s.call("GET", "/is_sleeping", None);
    assert_eq!(v["is_sleeping"], true);
    let v = s.ok(
        "/resume_memory_occupation",
        &json!({"model_path": m.a, "weight_version": "A"}),
    );
    assert_eq!(v["weight_version"], "A");
    assert_serves(&s, "A");
    s.ok("/flush_cache", &json!({}));
    s.ok("/reset_prefix_cache", &json!({}));
    // The version in /health and /metrics.
    let (_, h) = s.call("GET", "/health", None);
    assert_eq!(h["weight_version"], "A");
    let r = client::get(&s.addr, "/metrics").expect("metrics");
    assert!(
        r.body
            .contains("arbor_weight_version_info{version=\"A\"} 1"),
        "{}",
        r.body
    );
}

// ---------------------------------------------------------------------------------------
// The trainer loop of examples/rl_loop.py, without torch

/// The weights move each iteration; the trainer pushes them to a TP 2 server, requests
/// rollouts with log-probs, and checks them against `arbor score` at TP 1 on a checkpoint
/// of the same weights: the same bits, and the version it pushed.
#[test]
fn trainer_loop_matches_score_at_tp1() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "loop");
    let scratch = Scratch::new("rl-loop");
    let mut weights = Tensors::read(&m.a.join("model.safetensors"));
    let mut previous: Option<Vec<u32>> = None;
    for step in 1..=3u64 {
        weights.nudge(10 + step);
        let version = format!("step-{step}");
        let parts = weights.parts(2);
        let (st, v) = s.push("commit=false", &parts[0]);
        assert_eq!(st, 200, "{v}");
        let (st, v) = s.push(&format!("commit=true&weight_version={version}"), &parts[1]);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["weight_version"], json!(version));

        // Rollouts: 3 prompts × 2 samples, sampled, with log-probs.
        let mut seqs = Vec::new();
        let mut rollout_bits = Vec::new();
        for p in 0..3u64 {
            let prompt: Vec<u64> = (0..4 + p).map(|j| 7 + 13 * j + p).collect();
            let r = s.ok(
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 12, "n": 2, "temperature": 1.0,
                        "seed": step, "logprobs": 0, "sample_id": 10 * p}),
            );
            assert_eq!(r["weight_version"], json!(version));
            for c in r["choices"].as_array().expect("choices") {
                let (ids, lps, digests, _) = choice_bits(c);
                let mut tokens = prompt.clone();
                tokens.extend(&ids);
                seqs.push(json!({"id": seqs.len(), "tokens": tokens, "prompt_len": prompt.len()}));
                rollout_bits.push((lps, digests));
            }
        }
        // The trainer's checkpoint of the same weights, scored at TP 1.
        let ckpt = scratch.path().join(&version);
        weights.write_dir(&m.a, &ckpt);
        let input = scratch.path().join(format!("{version}.jsonl"));
        let lines: Vec<String> = seqs.iter().map(Value::to_string).collect();
        std::fs::write(&input, lines.join("\n") + "\n").expect("write score input");
        let out = scratch.path().join(format!("{version}-score.jsonl"));
        let o = run_arbor(&[
            "score",
            "--model",
            ckpt.to_str().expect("utf-8"),
            "--input",
            input.to_str().expect("utf-8"),
            "--out",
            out.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "arbor score: {:?}", text(&o));
        let scored = read_jsonl(&out);
        assert_eq!(scored.len(), rollout_bits.len());
        let mut all = Vec::new();
        for (sc, (lps, digests)) in scored.iter().zip(&rollout_bits) {
            let got: Vec<u32> = sc["logprobs"]
                .as_array()
                .expect("logprobs")
                .iter()
                .map(|l| (l.as_f64().expect("finite") as f32).to_bits())
                .collect();
            assert_eq!(
                &got, lps,
                "rollout log-probs (TP 2) != arbor score (TP 1) at {version}"
            );
            let d: Vec<String> = sc["logits_digest"]
                .as_array()
                .expect("digests")
                .iter()
                .map(|d| d.as_str().expect("hex").to_string())
                .collect();
            assert_eq!(&d, digests);
            all.extend(got);
        }
        // The update took effect: the log-probs moved with the weights.
        assert_ne!(previous.as_ref(), Some(&all), "{version}: nothing changed");
        previous = Some(all);
    }
}
