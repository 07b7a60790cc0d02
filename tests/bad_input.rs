//! Bad input: each case exits non-zero with a message naming the file, tensor or value,
//! never panics, and the other ranks do not hang (each run ends well within the limit).

mod cli_support;

#[path = "../model/src/gguf/testfile.rs"]
#[allow(dead_code)]
mod gguf_testfile;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cli_support::*;

/// A run must end this fast: a hanging rank would sit in a collective far longer.
const LIMIT: Duration = Duration::from_secs(60);

fn pristine() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| shared_tiny("bad-input-llama", "llama"))
}

/// A private copy of the tiny model to break.
fn copy_model(s: &Scratch) -> PathBuf {
    let dst = s.path().join("m");
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(pristine()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// Runs `generate` on `model` at `tp` ranks and checks the failure is clean and names
/// every string in `needles`.
fn expect_failure(tp: usize, model: &Path, extra: &[&str], needles: &[&str]) {
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--max-tokens",
        "2",
    ];
    args.extend_from_slice(extra);
    if !extra.contains(&"--prompts") {
        args.extend(["--prompt", "hello"]);
    }
    let t0 = Instant::now();
    let o = run_launched(tp, &args);
    let took = t0.elapsed();
    let (out, err) = text(&o);
    assert!(
        !o.status.success(),
        "must fail\nstdout:\n{out}\nstderr:\n{err}"
    );
    assert!(
        !err.contains("panicked") && !out.contains("panicked"),
        "panic:\n{err}"
    );
    for n in needles {
        assert!(err.contains(n), "stderr does not name {n:?}:\n{err}");
    }
    assert!(took < LIMIT, "took {took:?}: a rank hung?\n{err}");
}

/// Replaces the first `from` after `after` by `to` (same length) inside the safetensors
/// JSON header.
fn patch_header(file: &Path, after: &str, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap().to_string();
    let start = header
        .find(after)
        .unwrap_or_else(|| panic!("{after} not in header"));
    let at = start
        + header[start..]
            .find(from)
            .unwrap_or_else(|| panic!("{from} not after {after}"));
    bytes[8 + at..8 + at + to.len()].copy_from_slice(to.as_bytes());
    std::fs::write(file, bytes).unwrap();
}

/// Rewrites the safetensors JSON header through `f`, padded with spaces to its old length
/// (the format allows trailing whitespace), so the data section stays where it was.
fn rewrite_header(file: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let mut text = header.to_string().into_bytes();
    assert!(
        text.len() <= n,
        "rewritten header is longer than the original"
    );
    text.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&text);
    std::fs::write(file, bytes).unwrap();
}

fn edit_config(model: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = model.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn missing_config() {
    let s = Scratch::new("bad-missing-config");
    let m = copy_model(&s);
    std::fs::remove_file(m.join("config.json")).unwrap();
    expect_failure(2, &m, &[], &["config.json"]);
}

#[test]
fn malformed_config() {
    let s = Scratch::new("bad-malformed-config");
    let m = copy_model(&s);
    std::fs::write(
        m.join("config.json"),
        "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": ",
    )
    .unwrap();
    expect_failure(2, &m, &[], &["config.json"]);
}

#[test]
fn unknown_architecture() {
    let s = Scratch::new("bad-arch");
    let m = copy_model(&s);
    edit_config(&m, |v| {
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
    });
    expect_failure(2, &m, &[], &["config.json", "GPT2LMHeadModel"]);
}

#[test]
fn truncated_safetensors() {
    let s = Scratch::new("bad-truncated");
    let m = copy_model(&s);
    let f = m.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(len / 2).unwrap();
    expect_failure(2, &m, &[], &["model.safetensors"]);
}

#[test]
fn header_lies_about_a_shape() {
    let s = Scratch::new("bad-shape");
    let m = copy_model(&s);
    patch_header(
        &m.join("model.safetensors"),
        "\"model.norm.weight\"",
        "\"shape\":[128]",
        "\"shape\":[129]",
    );
    expect_failure(2, &m, &[], &["model.norm.weight"]);
}

#[test]
fn missing_tensor() {
    let s = Scratch::new("bad-missing-tensor");
    let m = copy_model(&s);
    patch_header(
        &m.join("model.safetensors"),
        "\"model.norm.weight\"",
        "\"model.norm.weight\"",
        "\"model.norm.weighx\"",
    );
    expect_failure(2, &m, &[], &["model.norm.weight"]);
}

#[test]
fn tp_not_dividing_the_heads() {
    let s = Scratch::new("bad-heads");
    let m = copy_model(&s);
    // Same tensor shapes (4·32 = 8·16 query features, 2·32 = 4·16 KV features), but 4
    // heads cannot be split over 8 ranks.
    edit_config(&m, |v| {
        v["num_attention_heads"] = 4.into();
        v["num_key_value_heads"] = 2.into();
        v["head_dim"] = 32.into();
    });
    expect_failure(8, &m, &[], &["num_attention_heads 4", "TP"]);
}

#[test]
fn token_out_of_vocabulary() {
    let s = Scratch::new("bad-token");
    let m = copy_model(&s);
    let p = s.path().join("p.jsonl");
    std::fs::write(&p, "{\"id\":6,\"tokens\":[1,2,999999]}\n").unwrap();
    expect_failure(
        2,
        &m,
        &["--prompts", p.to_str().unwrap()],
        &["999999", "request 6"],
    );
}

#[test]
fn prompt_longer_than_the_context() {
    let s = Scratch::new("bad-context");
    let m = copy_model(&s);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    let ctx = cfg["max_position_embeddings"].as_u64().unwrap() as usize;
    let tokens: Vec<u32> = (0..ctx + 1).map(|i| (i % 200) as u32 + 1).collect();
    let p = s.path().join("p.jsonl");
    std::fs::write(
        &p,
        serde_json::json!({"id": 2, "tokens": tokens}).to_string(),
    )
    .unwrap();
    let ctx_s = ctx.to_string();
    expect_failure(
        2,
        &m,
        &["--prompts", p.to_str().unwrap()],
        &["request 2", &ctx_s],
    );
}

/// A context length no model has (2^32 − 1) is refused by its key before anything is
/// sized by it, from config.json or from GGUF metadata. It once aborted the process
/// (SIGABRT: a RoPE table of 137 GB), even with a cache of 8 blocks.
#[test]
fn an_absurd_context_length_is_refused_by_name() {
    let s = Scratch::new("bad-huge-context");
    let m = copy_model(&s);
    edit_config(&m, |v| {
        v["max_position_embeddings"] = serde_json::json!(4_294_967_295u64)
    });
    let kv = ["--kv-blocks", "8"];
    expect_failure(1, &m, &kv, &["max_position_embeddings", "4294967295"]);
    let g = s.path().join("huge-context.gguf");
    let b =
        gguf_testfile::Builder::llama().set("llama.context_length", gguf_testfile::u32v(u32::MAX));
    std::fs::write(&g, b.bytes()).unwrap();
    expect_failure(1, &g, &kv, &["llama.context_length", "4294967295"]);
}

/// A model may declare a long context: a run pays only for the context its cache holds.
#[test]
fn a_long_declared_context_runs_within_its_cache() {
    let s = Scratch::new("long-context");
    let m = copy_model(&s);
    edit_config(&m, |v| {
        v["max_position_embeddings"] = serde_json::json!(1u64 << 24)
    });
    let o = run_launched(
        1,
        &[
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--kv-blocks",
            "8",
            "--max-tokens",
            "2",
            "--prompt",
            "hello",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
}

#[test]
fn malformed_prompts_file() {
    let s = Scratch::new("bad-prompts");
    let m = copy_model(&s);
    let p = s.path().join("prompts.jsonl");
    std::fs::write(&p, "{\"prompt\":\"ok\"}\n{\"prompt\": 5}\n").unwrap();
    expect_failure(
        2,
        &m,
        &["--prompts", p.to_str().unwrap()],
        &["prompts.jsonl:2"],
    );
}

#[test]
fn make_model_refuses_a_non_empty_dir() {
    let s = Scratch::new("bad-make-model");
    let m = copy_model(&s);
    let o = run_arbor(&[
        "make-model",
        "--preset",
        "tiny",
        "--out",
        m.to_str().unwrap(),
    ]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--force") && err.contains(m.to_str().unwrap()),
        "{err}"
    );
}

/// Only rank 1 gets a broken model: rank 0 loads fine and waits for it in the first
/// collective; the group must still end promptly, with rank 1's error shown.
/// A bad `--ranks-per-gpu` value set by hand (as under mpirun) is named before any GPU is
/// touched, on a machine with or without one; `arbor check` passes its flag on to
/// arbor-launch, whose refusal it shows.
#[test]
fn bad_ranks_per_gpu_values_are_named() {
    let model = pristine();
    let o = std::process::Command::new(launcher())
        .args(["-n", "2", "--"])
        .arg(arbor())
        .args([
            "generate", "--device", "cuda", "--prompt", "hello", "--model",
        ])
        .arg(model)
        .env("ARBOR_RANKS_PER_GPU", "zero")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("ARBOR_RANKS_PER_GPU=\"zero\""), "{err}");
    let o = run_arbor(&[
        "check",
        "--model",
        model.to_str().unwrap(),
        "--tp",
        "2",
        "--batch",
        "1",
        "--ranks-per-gpu=-3",
        "--launcher",
        launcher().to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}{err}");
    assert!(
        err.contains("--ranks-per-gpu") && err.contains("\"-3\""),
        "{err}"
    );
}

#[test]
fn one_failing_rank_does_not_hang_the_others() {
    let s = Scratch::new("bad-one-rank");
    let m = copy_model(&s);
    let broken = s.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(m.join(f), broken.join(f)).unwrap();
    }
    std::fs::write(broken.join("config.json"), "{ not json").unwrap();
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then m='{}'; else m='{}'; fi; \
         exec '{}' generate --model \"$m\" --prompt hello --max-tokens 4",
        broken.display(),
        m.display(),
        arbor().display()
    );
    let t0 = Instant::now();
    let o = std::process::Command::new(launcher())
        .args(["-n", "2", "--kill-grace", "1", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let took = t0.elapsed();
    let (out, err) = text(&o);
    assert!(!o.status.success(), "must fail\n{out}\n{err}");
    assert!(
        err.contains("broken/config.json") || err.contains("broken\\config.json"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(took < LIMIT, "took {took:?}\n{err}");
}

#[test]
fn header_lies_about_offsets() {
    let s = Scratch::new("bad-offsets");
    let m = copy_model(&s);
    // model.norm.weight claims the first 256 bytes, which embed_tokens already holds.
    rewrite_header(&m.join("model.safetensors"), |h| {
        h["model.norm.weight"]["data_offsets"] = serde_json::json!([0, 256]);
    });
    expect_failure(2, &m, &[], &["model.safetensors", "model.norm.weight"]);
}

#[test]
fn unsupported_dtype() {
    let s = Scratch::new("bad-dtype");
    let m = copy_model(&s);
    rewrite_header(&m.join("model.safetensors"), |h| {
        h["model.norm.weight"]["dtype"] = "I8".into();
    });
    expect_failure(2, &m, &[], &["model.norm.weight", "I8"]);
}

#[test]
fn config_disagrees_with_the_tensor_shapes() {
    let s = Scratch::new("bad-config-shape");
    let m = copy_model(&s);
    edit_config(&m, |v| v["intermediate_size"] = 352.into());
    expect_failure(2, &m, &[], &["mlp", "344"]);
}

/// Overwrites element `index` of `tensor` (a bf16 tensor) with the bf16 `bits`.
fn poke_bf16(file: &Path, tensor: &str, index: usize, bits: u16) {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[tensor]["dtype"], "BF16", "{tensor}");
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + n + start + 2 * index;
    bytes[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    std::fs::write(file, bytes).unwrap();
}

/// Non-finite weights are refused at load, naming the tensor and the element (they once
/// loaded silently and log-probs came back null).
#[test]
fn non_finite_weights_are_refused() {
    for (tensor, index, bits, what) in [
        ("model.norm.weight", 5, 0x7fc0u16, "NaN"),
        ("model.layers.1.mlp.down_proj.weight", 1000, 0xff80, "-inf"),
    ] {
        let s = Scratch::new("bad-non-finite");
        let m = copy_model(&s);
        poke_bf16(&m.join("model.safetensors"), tensor, index, bits);
        expect_failure(2, &m, &[], &[tensor, what, &format!("element {index}")]);
    }
}
