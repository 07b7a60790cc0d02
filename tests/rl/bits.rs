//! Requests and their bits: the load and the probes, the references of fresh TP 1
//! servers on each checkpoint, and the check of a response against the reference of the
//! weight version it reports.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::client;
use crate::server::Server;

/// Long requests (100 new tokens, ignore_eos) that keep the 4 slots busy: greedy and
/// sampled, one or two choices, token log-probs.
pub(crate) fn load(tag: &str) -> Vec<Value> {
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
pub(crate) fn probes() -> Vec<Value> {
    (0..3u64)
        .map(|i| {
            json!({"prompt": [5 + i, 17, 99, 3], "max_tokens": 8, "logprobs": 2,
                   "temperature": if i == 0 { 0.0 } else { 0.8 }, "seed": i, "prompt_logprobs": true})
        })
        .collect()
}

/// Per choice: token ids, log-prob bits, digests (the prefix that ran, for an aborted
/// choice), prompt log-prob bits.
pub(crate) fn choice_bits(c: &Value) -> (Vec<u64>, Vec<u32>, Vec<String>, Vec<u32>) {
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
pub(crate) fn check(
    resp: &Value,
    i: usize,
    refs_of: impl Fn(&str) -> &'static Value,
) -> (String, bool) {
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

pub(crate) fn load_refs(version: &str, i: usize) -> &'static Value {
    &refs(model_of(version)).0[i]
}

pub(crate) fn probe_refs(version: &str, i: usize) -> &'static Value {
    &refs(model_of(version)).1[i]
}

/// Probes the server: every response equals the fresh server on `version`'s weights.
pub(crate) fn assert_serves(s: &Server, version: &str) {
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
pub(crate) fn under_load(
    s: &Server,
    tag: &str,
    update: impl FnOnce() -> Value,
) -> (Vec<Value>, Value) {
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
