//! What common clients send and read, as they send it: vLLM's tokenizer routes (lm-eval's
//! `local-completions` probes them), the model card, refusals that name the field, seeds
//! returned so that a sample replays, guidellm's streams with usage in every chunk, and
//! lm-eval-harness itself on a local task.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::client;
use crate::server::*;

/// The data lines of a stream, parsed, without `[DONE]`.
fn chunks(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    let r = client::post_sse(&s.addr, path, &body.to_string(), &[], |d| {
        if d != "[DONE]" {
            out.push(serde_json::from_str(d).expect("JSON chunk"));
        }
        true
    })
    .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    out
}

/// A POST's `x-arbor-seed` header and its JSON body (the test client keeps no headers).
fn post_with_seed_header(s: &Server, path: &str, body: &Value) -> (Option<u64>, Value) {
    let body = body.to_string();
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut raw = String::new();
    c.read_to_string(&mut raw).expect("read");
    let (head, rest) = raw.split_once("\r\n\r\n").expect("headers");
    assert!(head.starts_with("HTTP/1.1 200"), "{raw}");
    let seed = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("x-arbor-seed")
            .then(|| v.trim().parse().expect("numeric seed"))
    });
    let json_text = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        // One chunk for a small JSON body: "<hex len>\r\n<body>\r\n0\r\n\r\n".
        rest.split_once("\r\n").map_or(rest, |(_, b)| b)
    } else {
        rest
    };
    let end = json_text.rfind('}').map_or(json_text.len(), |i| i + 1);
    (
        seed,
        serde_json::from_str(&json_text[..end]).expect("JSON body"),
    )
}

#[test]
fn tokenizer_routes_model_card_and_refusals() {
    let s = Scratch::new("serve-clients");
    let srv = Server::start(1, &[], s.path().join("server.log"));

    // /tokenizer_info: what lm-eval checks for (eos_token) and the chat template.
    let (st, info) = srv.call("GET", "/tokenizer_info", None, &[]);
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["eos_token"], "</s>", "{info}");
    assert_eq!(info["bos_token"], "<s>", "{info}");
    assert_eq!(info["max_model_len"], 128, "{info}");
    assert!(info["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("messages")));

    // /tokenize of text equals the prompt /v1/completions runs; of messages, the chat's.
    let done = srv.completion(&json!({"prompt": "Hello there", "max_tokens": 1, "temperature": 0}));
    let (st, t) = srv.post("/tokenize", &json!({"prompt": "Hello there"}));
    assert_eq!(st, 200, "{t}");
    assert_eq!(t["tokens"], done["choices"][0]["prompt_token_ids"], "{t}");
    assert_eq!(
        t["count"],
        t["tokens"].as_array().map(Vec::len).unwrap_or(0)
    );
    assert_eq!(t["max_model_len"], 128);
    let (_, plain) = srv.post(
        "/tokenize",
        &json!({"prompt": "Hello there", "add_special_tokens": false, "return_token_strs": true}),
    );
    assert_eq!(plain["token_strs"][0], "H", "{plain}");
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let (st, chat) = srv.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(st, 200, "{chat}");
    let (_, t) = srv.post("/tokenize", &json!({"messages": messages}));
    assert_eq!(t["tokens"], chat["choices"][0]["prompt_token_ids"], "{t}");

    // /detokenize gives the text back, special tokens included.
    let (st, d) = srv.post("/detokenize", &json!({"tokens": plain["tokens"]}));
    assert_eq!(
        (st, d["prompt"].as_str()),
        (200, Some("Hello there")),
        "{d}"
    );
    let (st, e) = srv.post("/detokenize", &json!({"tokens": [1, 999999]}));
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("tokens")),
        "{e}"
    );
    let (st, e) = srv.post("/tokenize", &json!({"prompt": "x", "temperature": 0}));
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("temperature")),
        "{e}"
    );

    // The model card; an unknown id is 404 in OpenAI's error shape.
    let (st, m) = srv.call("GET", "/v1/models/shared-serve-llama", None, &[]);
    assert_eq!(
        (st, m["id"].as_str()),
        (200, Some("shared-serve-llama")),
        "{m}"
    );
    let (st, e) = srv.call("GET", "/v1/models/org/other", None, &[]);
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("org/other")));

    // Fields the server does not implement: 400, "not supported", `param` the field.
    for (field, value) in [
        (
            "functions",
            json!([{"name": "f", "parameters": {"type": "object"}}]),
        ),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("max_tokns", json!(3)),
    ] {
        let mut body = json!({"messages": messages, "max_tokens": 2});
        body[field] = value;
        let (st, e) = srv.post("/v1/chat/completions", &body);
        assert_eq!(st, 400, "{field}: {e}");
        assert_eq!(e["error"]["param"], field, "{e}");
        assert_eq!(e["error"]["code"], "unsupported_parameter", "{e}");
        let msg = e["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("not supported") && msg.contains(field),
            "{msg}"
        );
    }
    // Ranges in plain words; null is the default.
    let (st, e) = srv.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": -1}),
    );
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "max_tokens");
    assert_eq!(
        e["error"]["message"],
        "max_tokens must be at least 1, got -1"
    );
    let (st, e) = srv.post("/v1/completions", &json!({"prompt": "x", "n": "two"}));
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("n")), "{e}");
    let v =
        srv.completion(&json!({"prompt": "x", "max_tokens": null, "temperature": 0, "seed": null}));
    assert_eq!(
        v["usage"]["completion_tokens"], 16,
        "the default max_tokens: {v}"
    );
}

#[test]
fn unseeded_samples_return_their_seed_and_replay() {
    let s = Scratch::new("serve-seeds");
    let srv = Server::start(1, &[], s.path().join("server.log"));
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "logprobs": 0});
    let (h1, a) = post_with_seed_header(&srv, "/v1/completions", &body);
    let (h2, b) = post_with_seed_header(&srv, "/v1/completions", &body);
    let (sa, sb) = (a["seed"].as_u64(), b["seed"].as_u64());
    assert!(sa.is_some() && h1 == sa && h2 == sb, "{h1:?} {a}");
    assert_ne!(sa, sb, "two unseeded requests drew the same seed");
    assert!(sa.is_some_and(|s| s < 1 << 53));
    // Each sample replays bit for bit from its returned seed.
    for (seed, out) in [(sa, &a), (sb, &b)] {
        let mut again = body.clone();
        again["seed"] = json!(seed);
        let r = srv.completion(&again);
        for k in ["token_ids", "logits_digest", "logprobs"] {
            assert_eq!(r["choices"][0][k], out["choices"][0][k], "{k}");
        }
        assert_eq!(r["seed"], json!(seed));
    }
    // A stream carries its seed in every chunk; greedy needs no seed and reports 0.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let cs = chunks(&srv, "/v1/completions", &streamed);
    let seed = &cs[0]["seed"];
    assert!(
        seed.is_u64() && cs.iter().all(|c| &c["seed"] == seed),
        "{cs:?}"
    );
    let g = srv.completion(&json!({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}));
    assert_eq!(g["seed"], 0, "{g}");
    drop(srv);

    // --default-seed N: unseeded requests use N, as the server did before seeds were drawn.
    let srv = Server::start(1, &["--default-seed", "42"], s.path().join("fixed.log"));
    let fixed = srv.completion(&body);
    assert_eq!(fixed["seed"], 42, "{fixed}");
    let mut seeded = body.clone();
    seeded["seed"] = json!(42);
    let r = srv.completion(&seeded);
    assert_eq!(
        r["choices"][0]["token_ids"],
        fixed["choices"][0]["token_ids"]
    );
}

/// guidellm's requests: streams with `stream_options: {include_usage,
/// continuous_usage_stats}` (vLLM's field), `max_completion_tokens` on chat, `ignore_eos`.
#[test]
fn guidellm_streams_get_usage_in_every_chunk() {
    let s = Scratch::new("serve-guidellm");
    let srv = Server::start(1, &[], s.path().join("server.log"));
    let opts = json!({"include_usage": true, "continuous_usage_stats": true});
    let completion = json!({"model": "shared-serve-llama", "prompt": "Hello", "max_tokens": 6,
        "stream": true, "stream_options": opts, "ignore_eos": true, "stop": null});
    let chat = json!({"model": "shared-serve-llama", "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 6, "stream": true, "stream_options": opts, "ignore_eos": true});
    for (path, body) in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
    ] {
        let cs = chunks(&srv, path, &body);
        assert!(cs.len() >= 7, "{path}: {cs:?}");
        let mut last = 0;
        for c in &cs {
            let u = &c["usage"];
            let done = u["completion_tokens"]
                .as_u64()
                .expect("usage in every chunk");
            assert!(done >= last, "{path}: usage goes back: {cs:?}");
            assert_eq!(
                u["total_tokens"].as_u64(),
                Some(done + u["prompt_tokens"].as_u64().unwrap_or(0))
            );
            last = done;
        }
        assert_eq!(last, 6, "{path}");
        let fin = cs.last().expect("chunks");
        assert_eq!(
            fin["choices"],
            json!([]),
            "the usage chunk ends the stream: {fin}"
        );
    }
    // include_usage alone: usage only in the last chunk, as OpenAI sends it.
    let body = json!({"prompt": "Hello", "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}});
    let cs = chunks(&srv, "/v1/completions", &body);
    let with_usage = cs.iter().filter(|c| c.get("usage").is_some()).count();
    assert_eq!(with_usage, 1, "{cs:?}");
}

/// lm-eval-harness's `local-completions` against the server with no tokenizer setup (it
/// finds the tokenizer routes), offline, on a local task: log-likelihoods (echo +
/// logprobs) and greedy generation. Skipped without lm_eval unless `CI` is set.
#[test]
fn lm_eval_local_completions_on_a_local_task() {
    if !python_has(
        &["lm_eval", "tenacity"],
        "python3 -m pip install 'lm-eval[api]==0.4.13'",
    ) {
        return;
    }
    let s = Scratch::new("serve-lm-eval");
    let srv = Server::start(1, &[], s.path().join("server.log"));
    let tasks = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/serve/lm_eval");
    let run = |out: &str| {
        let o = Command::new("python3")
            .args(["-m", "lm_eval", "--model", "local-completions", "--model_args"])
            .arg(format!(
                "model=shared-serve-llama,base_url=http://{}/v1/completions,num_concurrent=4,max_retries=1,max_length=128",
                srv.addr
            ))
            .args(["--tasks", "arbor_tiny_mc,arbor_tiny_gen", "--include_path", "."])
            .arg("--output_path")
            .arg(s.path().join(out))
            .arg("--log_samples")
            .current_dir(&tasks)
            .env("HF_HOME", s.path().join("hf"))
            .env("HF_DATASETS_OFFLINE", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env_remove("OPENAI_API_KEY")
            .output()
            .expect("run python3 -m lm_eval");
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{stdout}\n{stderr}\n{}", srv.log_text());
        assert!(
            stderr.contains("Using remote tokenizer backend"),
            "lm-eval did not find the tokenizer routes:\n{stderr}"
        );
        // Per-sample responses, in a fixed order.
        let mut samples: Vec<(String, Value)> = Vec::new();
        for e in walk(&s.path().join(out)) {
            let name = e
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if name.starts_with("samples_") {
                for v in read_jsonl(&e) {
                    samples.push((name.split('_').nth(3).unwrap_or("").to_string(), v));
                }
            }
        }
        samples.sort_by_key(|(task, v)| (task.clone(), v["doc_id"].as_u64()));
        (
            stdout,
            samples.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        )
    };
    let (table, samples) = run("out");
    assert!(
        table.contains("arbor_tiny_mc") && table.contains("arbor_tiny_gen"),
        "{table}"
    );
    assert_eq!(samples.len(), 12, "6 documents in each task: {samples:?}");
    // A log-likelihood lm-eval reports is the server's, bit for bit: the first choice of
    // the first multiple-choice document, asked for directly.
    let mc = &samples[6];
    let args = &mc["arguments"]["gen_args_0"];
    let tokens = |text: &Value| -> Vec<Value> {
        let (_, t) = srv.post(
            "/tokenize",
            &json!({"prompt": text, "add_special_tokens": false}),
        );
        t["tokens"].as_array().cloned().unwrap_or_default()
    };
    let mut prompt = tokens(&args["arg_0"]);
    let n_ctx = prompt.len();
    prompt.extend(tokens(&args["arg_1"]));
    let v = srv.completion(&json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
        "logprobs": 1, "echo": true}));
    let lps = &v["choices"][0]["logprobs"]["token_logprobs"];
    let direct =
        (n_ctx..prompt.len()).fold(0.0f64, |acc, i| acc + lps[i].as_f64().unwrap_or(f64::NAN));
    let reported: f64 = mc["resps"][0][0][0]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("a log-likelihood");
    assert_eq!(reported.to_bits(), direct.to_bits(), "{mc}");
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
