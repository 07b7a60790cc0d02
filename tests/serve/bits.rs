//! What must not depend on load, TP, the path or the cache: a request's token ids,
//! log-prob bits and logits digests alone, under ~200 concurrent requests, preempted and
//! recomputed, from the prefix cache, at TP 1 and 2, and against `arbor generate` /
//! `arbor score`; and `arbor bench serve`'s check of the same.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::client;
use crate::server::*;

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

/// The prefix cache gives the bits of recomputation: a repeated system prompt,
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
    // Small limits so that requests queue for KV, prompts are chunked (beside decode rows
    // at most 5 prompt rows a step), and steps mix.
    let flags = [
        "--max-num-seqs",
        "6",
        "--kv-blocks",
        "4",
        "--prefill-chunk",
        "8",
        "--max-num-batched-tokens",
        "24",
        "--prefill-beside-decode",
        "5",
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
    // The engine's steps during the run, split into decode-only steps and the others.
    let e = &v["engine"];
    let steps = e["steps"].as_f64().unwrap();
    let decode = e["decode_steps"].as_f64().unwrap();
    assert!(steps > 0.0 && decode > 0.0 && decode < steps, "{e}");
    // Every prompt row went through a step that carried prompt rows.
    assert!(e["prompt_rows"].as_f64().unwrap() > 0.0, "{e}");
    assert!(e["rows"].as_f64().unwrap() >= steps, "{e}");
    assert!(stdout.contains("engine steps       "), "{stdout}");
    assert!(stdout.contains("serving loop (s)   execute "), "{stdout}");
    // The decode-only steps by band of rows add up to them.
    let bands = e["decode_bands"].as_array().unwrap();
    assert_eq!(bands.len(), 5, "{e}");
    let band_steps: f64 = bands.iter().map(|b| b["steps"].as_f64().unwrap()).sum();
    assert_eq!(band_steps, decode, "{e}");
    assert!(stdout.contains("decode-only steps 1-64 rows "), "{stdout}");
}
