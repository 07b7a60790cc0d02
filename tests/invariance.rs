//! The CI invariance job: `arbor check` on tiny models made by `arbor make-model`, over
//! TP 1, 2, 4, 8 × batch 1, 3, 8, greedy and seeded sampling. Every configuration must give
//! one unique output per prompt, zero top-5 divergence, and score == generate bit for bit.
//! A negative test shows the check does report real differences.

mod cli_support;

use std::path::Path;

use cli_support::*;
use serde_json::Value;

fn check(model: &Path, scratch: &Scratch, extra: &[&str]) -> (std::process::Output, Value) {
    let json = scratch.path().join(format!(
        "report-{}.json",
        extra.join("_").replace(['-', '.', ':'], "")
    ));
    let launcher = launcher();
    let mut args = vec![
        "check",
        "--model",
        model.to_str().unwrap(),
        "--launcher",
        launcher.to_str().unwrap(),
        "--max-tokens",
        "16",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = run_arbor(&args);
    let (out, err) = text(&o);
    assert!(!err.contains("panicked"), "{err}");
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| panic!("no JSON report\nstdout:\n{out}\nstderr:\n{err}"));
    (o, report)
}

fn assert_invariant(arch: &str, sampling: &[&str]) {
    let s = Scratch::new(&format!("invariance-{arch}"));
    let model = s.path().join("m");
    make_tiny(arch, &model);
    let mut extra = vec!["--tp", "1,2,4,8", "--batch", "1,3,8"];
    extra.extend_from_slice(sampling);
    let (o, report) = check(&model, &s, &extra);
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "check failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    let r = &report["report"];
    assert_eq!(report["invariant"], true);
    assert_eq!(r["configs"].as_array().unwrap().len(), 12);
    assert_eq!(r["max_unique_outputs"], 1, "{r}");
    assert_eq!(r["max_top5_divergence"].as_f64(), Some(0.0), "{r}");
    assert_eq!(r["score_equal"], true, "{r}");
    let prompts = r["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 3);
    for p in prompts {
        assert_eq!(p["unique_outputs"], 1, "{p}");
        assert!(p["generated_tokens"].as_u64().unwrap() >= 1, "{p}");
    }
    assert!(
        out.contains("RESULT: bit-identical across all 12 configurations"),
        "{out}"
    );
}

#[test]
fn llama_greedy() {
    assert_invariant("llama", &[]);
}

#[test]
fn llama_sampled() {
    assert_invariant(
        "llama",
        &[
            "--temperature",
            "0.8",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--seed",
            "1234",
        ],
    );
}

/// Qwen2: q/k/v biases, KV heads replicated at TP 4 and 8.
#[test]
fn qwen2_greedy() {
    assert_invariant("qwen2", &[]);
}

/// A mixture of experts: routing and the experts' sums at every TP and batch.
#[test]
fn qwen3_moe_sampled() {
    assert_invariant(
        "qwen3-moe",
        &["--temperature", "1.0", "--top-p", "0.9", "--seed", "5"],
    );
}

#[test]
fn qwen3_greedy() {
    assert_invariant("qwen3", &[]);
}

#[test]
fn qwen3_sampled() {
    assert_invariant(
        "qwen3",
        &["--temperature", "1.0", "--top-p", "0.9", "--seed", "99"],
    );
}

/// The check can fail: one configuration really runs with another seed (a test-only
/// flag), and the report names it as the first difference.
#[test]
fn a_real_difference_is_reported() {
    let s = Scratch::new("invariance-negative");
    let model = s.path().join("m");
    make_tiny("llama", &model);
    let (o, report) = check(
        &model,
        &s,
        &[
            "--tp",
            "1,2",
            "--batch",
            "1,3",
            "--temperature",
            "1.0",
            "--seed",
            "5",
            "--perturb-seed-of",
            "2:3",
        ],
    );
    let (out, err) = text(&o);
    assert!(!o.status.success(), "check must fail\n{out}\n{err}");
    assert_eq!(report["invariant"], false);
    let r = &report["report"];
    assert!(r["max_unique_outputs"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["max_top5_divergence"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["first_difference"]["config"], "TP=2 batch=3", "{r}");
    // score runs on the reference (TP=1 batch=1), which is unperturbed.
    assert_eq!(r["score_equal"], true, "{r}");
    assert!(out.contains("RESULT: DIFFERENT"), "{out}");
    assert!(err.contains("first difference in TP=2 batch=3"), "{err}");
}

/// `--rank-logs` lets the ranks' logs through while each configuration runs; without it
/// they are kept for the message of a configuration that fails (and a passing run shows
/// none of them).
#[test]
fn rank_logs_come_through_only_when_asked() {
    let s = Scratch::new("invariance-rank-logs");
    let model = s.path().join("m");
    make_tiny("llama", &model);
    for stream in [false, true] {
        let mut cmd = check_command(&model, &launcher(), &s.path().join("report.json"));
        cmd.env("RUST_LOG", "info");
        if stream {
            cmd.arg("--rank-logs");
        }
        let o = cmd.output().unwrap();
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "check failed\nstdout:\n{out}\nstderr:\n{err}"
        );
        assert!(out.contains("RESULT: bit-identical"), "{out}");
        // Every rank logs its KV cache at info level.
        let rank1 = err
            .lines()
            .any(|l| l.starts_with("[rank 1]") && l.contains("KV cache"));
        assert_eq!(rank1, stream, "--rank-logs {stream}; stderr:\n{err}");
    }
}
