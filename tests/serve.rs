//! `arbor serve` end to end on CPU ranks: a request's tokens, log-probs and logits digests
//! are the same bits alone, among ~200 concurrent requests, at TP 1 and 2, and equal to
//! `arbor generate` / `arbor score`; streaming, errors, cancellation and SIGTERM; and the
//! official `openai` Python client against the server.

mod cli_support;

#[path = "../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cli_support::*;
use serde_json::{json, Value};

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// One tiny Llama with a chat template, shared by the tests of this file.
fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = shared_tiny("serve-llama", "llama");
        let cfg = json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write tokenizer_config.json");
        dir
    })
}

struct Server {
    child: Child,
    addr: String,
    log: PathBuf,
}

impl Server {
    /// `arbor serve` at `tp` ranks (directly at TP 1, so that a signal reaches it alone).
    fn start(tp: usize, extra: &[&str], log: PathBuf) -> Server {
        Server::start_with(tp, &[], 128, extra, log)
    }

    /// [`Server::start`] with arbor-launch flags (TP > 1) and a context length.
    fn start_with(
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
            .arg(model())
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

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn call(
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

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(&body.to_string()), &[])
    }

    fn completion(&self, body: &Value) -> Value {
        let (status, v) = self.post("/v1/completions", body);
        assert_eq!(status, 200, "{body} -> {v}\n{}", self.log_text());
        v
    }

    /// SIGTERM; returns the exit status and the log.
    fn terminate(mut self) -> (ExitStatus, String) {
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

/// What must not depend on load: per choice, token ids, log-prob bits, digests, finish.
fn key(resp: &Value) -> Vec<String> {
    resp["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| {
            let bits: Vec<String> = c["logprobs"]["token_logprobs"]
                .as_array()
                .expect("token_logprobs")
                .iter()
                .map(|l| {
                    format!(
                        "{:08x}",
                        (l.as_f64().expect("finite logprob") as f32).to_bits()
                    )
                })
                .collect();
            format!(
                "{} {} {} {}",
                c["token_ids"],
                bits.join(","),
                c["logits_digest"],
                c["finish_reason"]
            )
        })
        .collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const SAMPLED: (f32, usize, f32, u64) = (0.8, 40, 0.95, 7);

/// The probe requests: different prompt lengths, greedy and sampled, one with prompt
/// log-probs; `sample_id` is what `arbor generate` calls the request id.
fn probes() -> Vec<Value> {
    let mut rng = Rng(11);
    (0..6u64)
        .map(|k| {
            let len = [1, 5, 17, 40, 9, 70][k as usize];
            let prompt: Vec<u32> = (0..len).map(|_| 3 + rng.below(250) as u32).collect();
            let mut v =
                json!({"prompt": prompt, "max_tokens": 6, "logprobs": 2, "sample_id": 100 + k});
            if k % 2 == 0 {
                v["temperature"] = json!(0.0);
            } else {
                let (t, top_k, top_p, seed) = SAMPLED;
                v["temperature"] = json!(t);
                v["top_k"] = json!(top_k);
                v["top_p"] = json!(top_p);
                v["seed"] = json!(seed);
            }
            if k == 3 {
                v["prompt_logprobs"] = json!(true);
            }
            v
        })
        .collect()
}

/// Background traffic: random lengths, sampling settings, streaming, n and arrival times.
fn background(rng: &mut Rng, i: u64) -> Value {
    let len = 1 + rng.below(60) as usize;
    let prompt: Vec<u32> = (0..len).map(|_| 3 + rng.below(250) as u32).collect();
    let temperature = [0.0, 0.7, 1.0][rng.below(3) as usize];
    let top_p = [1.0, 0.9][rng.below(2) as usize];
    json!({
        "prompt": prompt,
        "max_tokens": 1 + rng.below(8),
        "temperature": temperature,
        "top_k": rng.below(20),
        "top_p": top_p,
        "seed": rng.below(1000),
        "n": 1 + rng.below(2),
        "sample_id": 1000 + i,
        "stream": rng.below(3) == 0,
        "logprobs": rng.below(3),
    })
}

/// Sends `n` background requests from 8 clients with random gaps while the probes run
/// (each probe once, from its own client); returns the probes' responses.
fn probes_under_load(s: &Server, n: u64, seed: u64) -> Vec<Value> {
    let probes = probes();
    std::thread::scope(|scope| {
        let addr = s.addr.clone();
        let mut bg = Vec::new();
        for c in 0..8u64 {
            let addr = addr.clone();
            bg.push(scope.spawn(move || {
                let mut rng = Rng(seed * 31 + c);
                for i in (c..n).step_by(8) {
                    std::thread::sleep(Duration::from_millis(rng.below(40)));
                    let body = background(&mut rng, i);
                    let r = if body["stream"] == json!(true) {
                        let mut done = false;
                        let r = client::post_sse(
                            &addr,
                            "/v1/completions",
                            &body.to_string(),
                            &[],
                            |d| {
                                done |= d == "[DONE]";
                                true
                            },
                        );
                        assert!(done, "stream of {body} did not end with [DONE]");
                        r
                    } else {
                        client::request(
                            &addr,
                            "POST",
                            "/v1/completions",
                            Some(&body.to_string()),
                            &[],
                        )
                    };
                    let r = r.expect("background request");
                    assert_eq!(r.status, 200, "{body} -> {}", r.body);
                }
            }));
        }
        // Probes arrive while the background traffic is in full swing.
        std::thread::sleep(Duration::from_millis(300));
        let handles: Vec<_> = probes
            .iter()
            .map(|p| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let r = client::request(
                        &addr,
                        "POST",
                        "/v1/completions",
                        Some(&p.to_string()),
                        &[],
                    )
                    .expect("probe request");
                    assert_eq!(r.status, 200, "{}", r.body);
                    serde_json::from_str::<Value>(&r.body).expect("probe JSON")
                })
            })
            .collect();
        let out: Vec<Value> = handles
            .into_iter()
            .map(|h| h.join().expect("probe thread"))
            .collect();
        for h in bg {
            h.join().expect("background client");
        }
        out
    })
}

/// `arbor generate` for the probes with the given sampling flags (ids = sample_id).
fn generate_probes(dir: &Path, probes: &[&Value], flags: &[&str]) -> Vec<Value> {
    let file = dir.join(format!("probes-{}.jsonl", probes.len() + flags.len()));
    let lines: Vec<String> = probes
        .iter()
        .map(|p| json!({"id": p["sample_id"], "tokens": p["prompt"]}).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").expect("write prompts");
    let mut args = vec![
        "generate",
        "--model",
        model().to_str().expect("utf-8"),
        "--prompts",
        file.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(&[
        "--max-tokens",
        "6",
        "--logprobs",
        "2",
        "--jsonl",
        "--max-seq-len",
        "128",
    ]);
    args.extend_from_slice(flags);
    let o = run_arbor(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    out.lines()
        .map(|l| serde_json::from_str(l).expect("JSONL"))
        .collect()
}

/// /metrics once the engine has caught up with the requests that finished: the gauges
/// are updated after the step that finished the last request, which its client may see
/// first (at most 2 s of waiting).
fn settled_metrics(srv: &Server) -> String {
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
fn metric(m: &str, name: &str) -> u64 {
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

#[test]
fn preempted_requests_keep_their_bits() {
    let s = Scratch::new("serve-preempt");
    // 3 blocks of 64 positions; four requests that each grow to 124 positions (2
    // blocks): any two running together outgrow the cache, so the newest is preempted and
    // recomputed.
    let flags = [
        "--max-num-seqs",
        "4",
        "--kv-blocks",
        "3",
        "--prefill-chunk",
        "4",
    ];
    let srv = Server::start(1, &flags, s.path().join("preempt.log"));
    let reqs: Vec<Value> = (0..4u64)
        .map(|k| {
            let mut v = json!({"prompt": [5 + k as u32, 9, 11, 13], "max_tokens": 120,
                               "ignore_eos": true, "logprobs": 1, "sample_id": 50 + k});
            if k % 2 == 1 {
                v["temperature"] = json!(0.9);
                v["seed"] = json!(3);
            } else {
                v["temperature"] = json!(0.0);
            }
            v
        })
        .collect();
    let alone: Vec<Vec<String>> = reqs.iter().map(|r| key(&srv.completion(r))).collect();
    let (_, m) = srv.call("GET", "/metrics", None, &[]);
    assert_eq!(metric(m.as_str().unwrap(), "arbor_preemptions_total"), 0);
    let together: Vec<Vec<String>> = std::thread::scope(|scope| {
        let hs: Vec<_> = reqs
            .iter()
            .map(|r| scope.spawn(|| key(&srv.completion(r))))
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    let (_, m) = srv.call("GET", "/metrics", None, &[]);
    let m = m.as_str().unwrap().to_string();
    assert!(
        metric(&m, "arbor_preemptions_total") > 0,
        "nothing was preempted: {m}"
    );
    let m = settled_metrics(&srv);
    assert_eq!(
        metric(&m, "arbor_kv_blocks_used"),
        0,
        "KV blocks still in use after every request finished: {m}"
    );
    assert_eq!(
        alone, together,
        "preemption changed tokens, log-prob bits or digests"
    );
    let (st, log) = srv.terminate();
    assert!(st.success(), "{st}\n{log}");
}

/// The prefix cache gives the bits of recomputation (issue 25): a repeated system prompt,
/// `n` samples of one prompt, prompt log-probs over a cached prefix, and a second turn
/// that continues the first, served with the cache at TP 2 and with a cache too small to
/// keep everything (blocks evicted, requests preempted and recomputed) give the records of
/// a server without it.
#[test]
fn the_prefix_cache_gives_the_bits_of_recomputation() {
    let s = Scratch::new("serve-prefix");
    let mut rng = Rng(25);
    let mut toks = |n: usize| -> Vec<u32> { (0..n).map(|_| 3 + rng.below(250) as u32).collect() };
    let system = toks(200);
    let shared = toks(150);
    let mut reqs: Vec<Value> = (0..4u64)
        .map(|k| {
            let mut p = system.clone();
            p.extend(toks(10 * k as usize + 3));
            let mut v = json!({"prompt": p, "max_tokens": 140, "logprobs": 1, "ignore_eos": true,
                               "sample_id": 300 + k, "temperature": 0.0});
            if k % 2 == 1 {
                v["temperature"] = json!(0.9);
                v["seed"] = json!(11);
            }
            if k == 2 {
                v["prompt_logprobs"] = json!(true);
            }
            v
        })
        .collect();
    reqs.push(
        json!({"prompt": shared, "max_tokens": 100, "logprobs": 1, "ignore_eos": true,
                     "n": 3, "sample_id": 400, "temperature": 0.8, "seed": 5}),
    );
    let run = |tp: usize, flags: &[&str], tag: &str| {
        let mut args = vec!["--max-num-seqs", "4"];
        args.extend_from_slice(flags);
        let srv = Server::start_with(tp, &[], 512, &args, s.path().join(format!("{tag}.log")));
        let first: Vec<Value> = std::thread::scope(|scope| {
            let hs: Vec<_> = reqs
                .iter()
                .map(|r| scope.spawn(|| srv.completion(r)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("client")).collect()
        });
        // The second turn: the first conversation so far and a new message.
        let mut turn: Vec<u32> = serde_json::from_value(reqs[0]["prompt"].clone()).unwrap();
        turn.extend(
            first[0]["choices"][0]["token_ids"]
                .as_array()
                .expect("token_ids")
                .iter()
                .map(|t| t.as_u64().unwrap() as u32),
        );
        turn.extend([7, 8, 9, 10, 11]);
        let second = srv.completion(&json!({"prompt": turn, "max_tokens": 8, "logprobs": 1,
                                            "sample_id": 500, "temperature": 0.0}));
        let mut keys: Vec<Vec<String>> = first.iter().map(key).collect();
        keys.push(key(&second));
        // Prompt log-probs too (computed rows, never skipped for the cache).
        keys.push(vec![first[2]["choices"][0]["prompt_logprobs"].to_string()]);
        let m = settled_metrics(&srv);
        let (st, log) = srv.terminate();
        assert!(st.success(), "{tag}: {st}\n{log}");
        (keys, m)
    };
    let (want, m) = run(1, &["--no-prefix-cache"], "off");
    assert_eq!(metric(&m, "arbor_prefix_cache_hits_total"), 0, "{m}");
    assert!(
        want.last().is_some_and(|p| p[0].len() > 200),
        "no prompt log-probs: {want:?}"
    );
    let (got, m) = run(2, &[], "on-tp2");
    assert_eq!(got, want, "the prefix cache changed records (TP 2)");
    let hits = metric(&m, "arbor_prefix_cache_hits_total");
    // The system prompt's 3 blocks for at least two requests, the shared prompt's 2
    // blocks for two of its samples, the first turn's blocks for the second.
    assert!(
        hits >= (2 * 3 + 2 * 2 + 3) * 64,
        "{hits} positions from the cache:\n{m}"
    );
    assert!(m.contains("arbor_prefix_cache_hit_rate 0."), "{m}");
    // 8 blocks for sequences of up to 6: requests wait, cached blocks are evicted and
    // running ones preempted (their shared blocks stay with the others).
    let (tight, m) = run(1, &["--kv-blocks", "8", "--prefill-chunk", "32"], "tight");
    assert_eq!(tight, want, "a small cache changed records");
    let preempted = metric(&m, "arbor_preemptions_total");
    println!(
        "tight cache: {preempted} preemptions, {} positions from the cache",
        metric(&m, "arbor_prefix_cache_hits_total")
    );
    assert!(preempted > 0, "nothing was preempted:\n{m}");
}

#[test]
fn outputs_do_not_depend_on_load_tp_or_path() {
    let s = Scratch::new("serve-load");
    // Small limits so that requests queue for KV, prompts are chunked, and steps mix.
    let flags = [
        "--max-num-seqs",
        "6",
        "--kv-blocks",
        "4",
        "--prefill-chunk",
        "8",
        "--max-num-batched-tokens",
        "24",
        "--max-queue",
        "512",
    ];
    let probes = probes();
    let tp1 = Server::start(1, &flags, s.path().join("tp1.log"));
    let alone: Vec<Value> = probes.iter().map(|p| tp1.completion(p)).collect();
    let alone_keys: Vec<Vec<String>> = alone.iter().map(key).collect();
    let loaded = probes_under_load(&tp1, 200, 1);
    for (i, (a, b)) in alone_keys.iter().zip(&loaded).enumerate() {
        assert_eq!(a, &key(b), "probe {i}: alone vs under load at TP 1");
    }
    // The load really queued and chunked: more steps than requests, KV full at times.
    let m = settled_metrics(&tp1);
    assert!(m.contains("arbor_requests_total 212\n"), "{m}");
    assert!(
        m.contains("arbor_kv_blocks_used 0\n") && m.contains("arbor_running_sequences 0\n"),
        "{m}"
    );
    let (st, log) = tp1.terminate();
    assert!(st.success(), "SIGTERM must drain and exit 0: {st}\n{log}");

    // Equal to `arbor generate` (the probe's sample_id is generate's request id).
    let greedy: Vec<&Value> = probes
        .iter()
        .filter(|p| p["temperature"] == json!(0.0))
        .collect();
    let sampled: Vec<&Value> = probes
        .iter()
        .filter(|p| p["temperature"] != json!(0.0))
        .collect();
    let (t, k, p, seed) = SAMPLED;
    let sflags = [
        t.to_string(),
        k.to_string(),
        p.to_string(),
        seed.to_string(),
    ];
    let gen_g = generate_probes(s.path(), &greedy, &[]);
    let gen_s = generate_probes(
        s.path(),
        &sampled,
        &[
            "--temperature",
            &sflags[0],
            "--top-k",
            &sflags[1],
            "--top-p",
            &sflags[2],
            "--seed",
            &sflags[3],
        ],
    );
    for (group, gens) in [(&greedy, &gen_g), (&sampled, &gen_s)] {
        for (probe, g) in group.iter().zip(gens.iter()) {
            let i = probes.iter().position(|q| q == *probe).expect("probe");
            let c = &alone[i]["choices"][0];
            assert_eq!(c["token_ids"], g["tokens"], "probe {i}: tokens vs generate");
            assert_eq!(
                c["logits_digest"], g["logits_digest"],
                "probe {i}: digests vs generate"
            );
            let bits = |v: &Value| -> Vec<u32> {
                v.as_array()
                    .expect("array")
                    .iter()
                    .map(|l| (l.as_f64().expect("num") as f32).to_bits())
                    .collect()
            };
            assert_eq!(
                bits(&c["logprobs"]["token_logprobs"]),
                bits(&g["logprobs"]),
                "probe {i}: logprobs vs generate"
            );
        }
    }

    // prompt_logprobs == `arbor score` of the prompt (prompt_len 1).
    let probe = &probes[3];
    let input = s.path().join("score.jsonl");
    std::fs::write(
        &input,
        json!({"id": 0, "tokens": probe["prompt"], "prompt_len": 1}).to_string() + "\n",
    )
    .expect("write");
    let o = run_arbor(&[
        "score",
        "--model",
        model().to_str().expect("utf-8"),
        "--input",
        input.to_str().expect("utf-8"),
        "--max-seq-len",
        "128",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let scored: Value = serde_json::from_str(out.trim()).expect("score JSON");
    let c = &alone[3]["choices"][0];
    assert_eq!(
        c["prompt_logits_digest"], scored["logits_digest"],
        "prompt log-probs vs score (digests)"
    );
    let n = probe["prompt"].as_array().expect("prompt").len();
    assert_eq!(
        c["prompt_logprobs"].as_array().map(|a| a.len()),
        Some(n - 1)
    );
    assert_eq!(
        c["prompt_logprobs"]
            .as_array()
            .expect("plp")
            .iter()
            .map(|l| (l.as_f64().expect("num") as f32).to_bits())
            .collect::<Vec<_>>(),
        scored["logprobs"]
            .as_array()
            .expect("lps")
            .iter()
            .map(|l| (l.as_f64().expect("num") as f32).to_bits())
            .collect::<Vec<_>>(),
        "prompt log-probs vs score"
    );

    // TP 2: the same bits, alone and under (lighter) load.
    let tp2 = Server::start(2, &flags, s.path().join("tp2.log"));
    for (i, p) in probes.iter().enumerate() {
        assert_eq!(
            alone_keys[i],
            key(&tp2.completion(p)),
            "probe {i}: TP 2 alone vs TP 1"
        );
    }
    let loaded2 = probes_under_load(&tp2, 40, 2);
    for (i, b) in loaded2.iter().enumerate() {
        assert_eq!(
            alone_keys[i],
            key(b),
            "probe {i}: TP 2 under load vs TP 1 alone"
        );
    }
}

/// The data lines of a stream, up to and including `[DONE]`.
fn stream(s: &Server, path: &str, body: &Value, headers: &[(&str, &str)]) -> Vec<String> {
    let mut events = Vec::new();
    let r = client::post_sse(&s.addr, path, &body.to_string(), headers, |d| {
        events.push(d.to_string());
        true
    })
    .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    events
}

fn error_of(s: &Server, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, v) = s.call("POST", "/v1/completions", Some(body), headers);
    let e = &v["error"];
    assert!(
        e["message"].is_string() && e["type"].is_string(),
        "OpenAI error body: {v}"
    );
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    (status, v)
}

#[test]
fn streaming_errors_cancellation_and_drain() {
    let s = Scratch::new("serve-errors");
    let srv = Server::start(
        1,
        &[
            "--api-key",
            "sekrit",
            "--max-body-bytes",
            "2048",
            "--max-queue",
            "4",
            "--max-num-seqs",
            "2",
        ],
        s.path().join("server.log"),
    );
    let auth = [("Authorization", "Bearer sekrit")];

    // Streaming carries the same tokens, log-probs and digests as the plain response.
    let body = json!({"prompt": "Hello there", "max_tokens": 8, "temperature": 0.9, "seed": 3, "logprobs": 1, "ignore_eos": true});
    let (st, plain) = srv.call("POST", "/v1/completions", Some(&body.to_string()), &auth);
    assert_eq!(st, 200, "{plain}");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let events = stream(&srv, "/v1/completions", &sbody, &auth);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    let (mut ids, mut digests, mut lps, mut text) =
        (Vec::new(), Vec::new(), Vec::new(), String::new());
    for c in chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
    {
        ids.extend(c["token_ids"].as_array().cloned().unwrap_or_default());
        digests.extend(c["logits_digest"].as_array().cloned().unwrap_or_default());
        lps.extend(
            c["logprobs"]["token_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        );
        text.push_str(c["text"].as_str().unwrap_or_default());
    }
    let pc = &plain["choices"][0];
    assert_eq!(json!(ids), pc["token_ids"]);
    assert_eq!(json!(digests), pc["logits_digest"]);
    assert_eq!(json!(lps), pc["logprobs"]["token_logprobs"]);
    assert_eq!(json!(text), pc["text"]);
    assert_eq!(ids.len(), 8);
    assert_eq!(
        chunks
            .last()
            .map(|c| c["usage"]["completion_tokens"].clone()),
        Some(json!(8)),
        "{chunks:?}"
    );

    // Chat: the template renders, the stream starts with the role and ends with a reason.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": true});
    let ev = stream(&srv, "/v1/chat/completions", &chat, &auth);
    let first: Value = serde_json::from_str(&ev[0]).expect("chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant", "{first}");
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).expect("chunk");
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");

    // A stop string ends the text before it, with finish_reason "stop".
    let base =
        json!({"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (_, full) = srv.call("POST", "/v1/completions", Some(&base.to_string()), &auth);
    let full_text = full["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    let (at, stop) = full_text
        .char_indices()
        .skip(1)
        .find(|(_, c)| *c != '\u{FFFD}')
        .expect("a generated character to stop at");
    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop.to_string()]);
    let (st, v) = srv.call(
        "POST",
        "/v1/completions",
        Some(&with_stop.to_string()),
        &auth,
    );
    assert_eq!(st, 200, "{v}");
    let first = full_text.find(stop).unwrap_or(at);
    assert_eq!(
        v["choices"][0]["text"],
        json!(&full_text[..first]),
        "{full_text:?} stop {stop:?}: {v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    // Errors: OpenAI bodies with the right status, and the server keeps serving.
    let ok = json!({"prompt": [1, 2, 3], "max_tokens": 2}).to_string();
    assert_eq!(error_of(&srv, &ok, &[]).0, 401);
    assert_eq!(
        error_of(&srv, &ok, &[("Authorization", "Bearer nope")]).0,
        401
    );
    assert_eq!(error_of(&srv, "{\"prompt\": [1,", &auth).0, 400);
    let (st, v) = error_of(&srv, r#"{"prompt": [1], "max_tokns": 2}"#, &auth);
    assert_eq!(st, 422, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("max_tokns"),
        "{v}"
    );
    assert_eq!(
        error_of(&srv, r#"{"prompt": [1], "max_tokens": "many"}"#, &auth).0,
        422
    );
    let (st, v) = error_of(
        &srv,
        &json!({"prompt": vec![5; 120], "max_tokens": 20}).to_string(),
        &auth,
    );
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{v}"
    );
    let (st, v) = error_of(&srv, r#"{"prompt": [1], "max_tokens": 100000}"#, &auth);
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );
    for bad in [
        r#""temperature": -1"#,
        r#""top_p": 0"#,
        r#""top_p": 1.5"#,
        r#""n": 0"#,
        r#""seed": -3"#,
        r#""logprobs": 50"#,
    ] {
        let (st, v) = error_of(&srv, &format!(r#"{{"prompt": [1], {bad}}}"#), &auth);
        assert_eq!(st, 400, "{bad}: {v}");
    }
    let (st, v) = error_of(&srv, r#"{"prompt": [1, 999999]}"#, &auth);
    assert!(
        st == 400
            && v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("999999"),
        "{v}"
    );
    assert_eq!(error_of(&srv, r#"{"prompt": []}"#, &auth).0, 400);
    let big = json!({"prompt": "x".repeat(5000)}).to_string();
    assert_eq!(error_of(&srv, &big, &auth).0, 413);
    assert_eq!(
        error_of(&srv, r#"{"prompt": [1], "model": "gpt-9"}"#, &auth).0,
        404
    );
    let (st, v) = srv.call("GET", "/v1/nothing", None, &auth);
    assert_eq!(st, 404, "{v}");
    // More sequences than the queue can ever hold (n, or prompts × n) are a bad request,
    // not "retry later" (issue 31).
    let (st, v) = error_of(&srv, r#"{"prompt": [1], "n": 5}"#, &auth);
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("n")), "{v}");
    let many = json!({"prompt": vec![vec![1u32]; 300], "max_tokens": 1}).to_string();
    let (st, v) = error_of(&srv, &many, &auth);
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("300"),
        "{v}"
    );
    // Choice i is keyed by sample_id + i: ids past 2^64 - 1 are refused, not wrapped.
    let wraps = json!({"prompt": [1], "max_tokens": 1, "n": 2, "sample_id": u64::MAX});
    let (st, v) = error_of(&srv, &wraps.to_string(), &auth);
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("sample_id")),
        "{v}"
    );
    let last = json!({"prompt": [1], "max_tokens": 1, "sample_id": u64::MAX});
    let (st, v) = srv.call("POST", "/v1/completions", Some(&last.to_string()), &auth);
    assert_eq!(st, 200, "{v}");
    let (st, models) = srv.call("GET", "/v1/models", None, &auth);
    assert_eq!(st, 200);
    assert_eq!(models["data"][0]["id"], "shared-serve-llama", "{models}");

    // A client that hangs up mid-stream: its sequence is cancelled and its KV freed.
    let metric = |name: &str| -> u64 {
        let (_, m) = srv.call("GET", "/metrics", None, &[]);
        let m = m.as_str().unwrap_or_default().to_string();
        m.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {name} in\n{m}"))
    };
    // Earlier requests may still hold KV (a stop-string completion's sequence is cancelled
    // by the leader's next pass, after its response is sent): wait until none does, so the
    // count below moves by this stream's cancellation alone.
    let t0 = Instant::now();
    while metric("arbor_kv_blocks_used ") != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "earlier sequences still hold KV"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let cancelled_before = metric("arbor_sequences_cancelled_total ");
    let long = json!({"prompt": [7, 8, 9], "max_tokens": 100, "ignore_eos": true, "stream": true});
    let mut got = 0;
    let r = client::post_sse(
        &srv.addr,
        "/v1/completions",
        &long.to_string(),
        &auth,
        |_| {
            got += 1;
            got < 3
        },
    )
    .expect("stream");
    assert_eq!(r.status, 200);
    let t0 = Instant::now();
    loop {
        let cancelled = metric("arbor_sequences_cancelled_total ");
        if cancelled == cancelled_before + 1 && metric("arbor_kv_blocks_used ") == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no cancellation seen ({cancelled_before} -> {cancelled})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Still serving after all of that.
    let (st, _) = srv.call("POST", "/v1/completions", Some(&ok), &auth);
    assert_eq!(st, 200);

    // SIGTERM while a request runs: it finishes, then the server exits 0.
    let addr = srv.addr.clone();
    let inflight = std::thread::spawn(move || {
        let body = json!({"prompt": [4, 5], "max_tokens": 60, "ignore_eos": true}).to_string();
        client::request(
            &addr,
            "POST",
            "/v1/completions",
            Some(&body),
            &[("Authorization", "Bearer sekrit")],
        )
    });
    std::thread::sleep(Duration::from_millis(200));
    let (st, log) = srv.terminate();
    assert!(st.success(), "{st}\n{log}");
    assert!(
        log.contains("draining") && log.contains("drained, exiting"),
        "{log}"
    );
    let r = inflight
        .join()
        .expect("in-flight client")
        .expect("in-flight response");
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map(|a| a.len()),
        Some(60),
        "{v}"
    );
}

/// The official `openai` Python client against the server. Without python3 + openai the
/// test is skipped locally but fails in CI (`CI` set), where .ci/run installs the client.
#[test]
fn official_openai_python_client() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let has_client = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(
            !ci,
            "CI: python3 with the openai package is required (python3 -m pip install openai)"
        );
        eprintln!("SKIPPED: python3 -c 'import openai' failed (python3 -m pip install openai)");
        return;
    }
    let s = Scratch::new("serve-openai");
    let srv = Server::start(1, &["--api-key", "k-test"], s.path().join("server.log"));
    let o = Command::new("python3")
        .arg(&script)
        .args([
            &format!("http://{}/v1", srv.addr),
            "k-test",
            "shared-serve-llama",
        ])
        .output()
        .expect("run python3");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}\n{}", srv.log_text());
    assert!(out.contains("openai client: all checks passed"), "{out}");
    // The client's results are the server's: compare one with a direct request.
    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0.7, "seed": 5, "logprobs": 0});
    let (st, direct) = srv.call(
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        &[("Authorization", "Bearer k-test")],
    );
    assert_eq!(st, 200, "{direct}");
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("tokens: "))
        .expect("tokens line");
    assert_eq!(
        serde_json::from_str::<Value>(line).expect("JSON"),
        direct["choices"][0]["token_ids"],
        "{out}"
    );
}

/// A metric's value from /metrics (0 when the server does not answer).
fn metric_of(s: &Server, name: &str) -> u64 {
    match client::get(&s.addr, "/metrics") {
        Ok(r) => metric(&r.body, name),
        Err(_) => 0,
    }
}

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
/// exits 0: its --kill-grace (here 0.2 s) does not cut the drain short (issue 31).
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
/// value (issue 31): a KV cache beyond memory (was an allocation abort; the cache is one
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

/// Slow or oversized clients cannot hold the server (issue 31): headers that never end
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
/// it still holds the connection (issue 31).
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
/// request had finished), never an empty one (issue 31: the leader returned its error
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

#[test]
fn bench_serve_reports_one_output_per_repeated_prompt() {
    let s = Scratch::new("bench-serve");
    let json_path = s.path().join("bench.json");
    let model = model().to_string_lossy().into_owned();
    let json_s = json_path.to_string_lossy().into_owned();
    let out = run_arbor(&[
        "bench",
        "serve",
        "--model",
        &model,
        "--tp",
        "2",
        "--requests",
        "24",
        "--concurrency",
        "4",
        "--prompt-len",
        "2:8",
        "--shared-prefix",
        "130",
        "--output-len",
        "2:6",
        "--repeat",
        "3",
        "--json",
        &json_s,
        "--server-args",
        "--max-num-seqs 4 --kv-blocks 8",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("distinct outputs per repeated prompt: 1"),
        "{stdout}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(v["requests_ok"], 24);
    assert_eq!(v["requests_failed"], 0);
    assert_eq!(v["distinct_prompts"], 8);
    assert_eq!(v["max_distinct_outputs_per_prompt"], 1);
    assert!(v["ttft_ms_p50"].as_f64().unwrap() > 0.0);
    // Every prompt starts with the same 2 full blocks: the cache serves them.
    assert!(
        stdout.contains("prefix cache       hit rate 0."),
        "{stdout}"
    );
    assert!(
        v["prefix_cache_hit_tokens"].as_f64().unwrap() >= 128.0,
        "{v}"
    );
}
