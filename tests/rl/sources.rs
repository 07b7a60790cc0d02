//! Hostile update sources (TP 2): GGUF files that are damaged, not GGUF at all, or carry
//! metadata no model has, and pushed safetensors headers that break the format in ways
//! JSON parsers forgive (a repeated key, metadata that are not strings). Each is refused as a bad input (400) naming what is wrong, as
//! `--model` would name it, and the old weights keep serving.

use serde_json::{json, Value};

use crate::bits::*;
use crate::checkpoint::models;
use crate::cli_support::*;
use crate::gguf_testfile::{f32v, u32v, Builder};
use crate::server::Server;

/// `/update_weights_from_disk` on `path`: 400, and the message holds every `needle`.
fn refused(s: &Server, path: &std::path::Path, needles: &[&str]) {
    let (st, v) = s.post("/update_weights_from_disk", &json!({ "model_path": path }));
    let msg = v["message"].as_str().unwrap_or_default();
    assert_eq!(st, 400, "{}: {v}", path.display());
    for n in needles {
        assert!(msg.contains(n), "{}: {n:?} not in {msg}", path.display());
    }
    assert_eq!(v["success"], Value::Bool(false));
}

#[test]
fn hostile_update_sources_are_bad_input() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "sources");
    let scratch = Scratch::new("rl-sources");
    let file = |name: &str, bytes: &[u8]| {
        let p = scratch.path().join(name);
        std::fs::write(&p, bytes).expect("write source");
        p
    };
    let good = Builder::llama().bytes();
    // Damage the reader finds: as --model says it, and a 4xx (it was 500).
    refused(
        &s,
        &file("truncated.gguf", &good[..good.len() - 100]),
        &["GGUF", "outside the data section"],
    );
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    refused(&s, &file("count.gguf", &huge), &["GGUF", "tensor count"]);
    // Not GGUF at all: said so (it was "…/config.json: Not a directory").
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"XGUF");
    refused(&s, &file("magic.gguf", &magic), &["not a GGUF file"]);
    refused(&s, &file("empty.gguf", &[]), &["not a GGUF file", "empty"]);
    // Metadata no model has, refused by key before anything is sized by it.
    let b = Builder::llama().set("llama.context_length", u32v(u32::MAX));
    refused(
        &s,
        &file("context.gguf", &b.bytes()),
        &["llama.context_length 4294967295"],
    );
    let b = Builder::llama().set("llama.rope.freq_base", f32v(f32::NAN));
    refused(
        &s,
        &file("theta.gguf", &b.bytes()),
        &["llama.rope.freq_base is NaN"],
    );
    // A sound GGUF of another model.
    refused(
        &s,
        &file("other.gguf", &good),
        &["not the served model", "hidden_size"],
    );
    pushed_headers_json_forgives_are_refused(&s);
    assert_serves(&s, "0");
}

/// A safetensors image of one tensor with `header` (its JSON text) as the header.
fn image(header: &str, data: &[u8]) -> Vec<u8> {
    crate::checkpoint::safetensors_image(header.as_bytes(), data)
}

/// A key given twice (JSON parsers keep one of them silently) and `__metadata__` values
/// that are not strings: refused as the format's rules are broken, nothing staged.
fn pushed_headers_json_forgives_are_refused(s: &Server) {
    let t = &models().c_tensors;
    let name = "model.norm.weight";
    let (dtype, shape, data) = &t.0[name];
    let entry = json!({"dtype": dtype, "shape": shape, "data_offsets": [0, data.len()]});
    let twice = format!("{{\"{name}\":{entry},\"{name}\":{entry}}}");
    let meta = format!("{{\"__metadata__\":{{\"step\":3}},\"{name}\":{entry}}}");
    for (header, needle) in [
        (twice, format!("the key \"{name}\" appears twice")),
        (
            meta,
            "\"__metadata__\" must map strings to strings".to_string(),
        ),
    ] {
        let (st, v) = s.push("commit=false", &image(&header, data));
        assert_eq!(st, 400, "{header}: {v}");
        let msg = v["message"].as_str().unwrap_or_default();
        assert!(msg.contains(&needle), "{needle:?} not in {msg}");
    }
    // Well formed, it stages; then dropped.
    let ok = format!("{{\"__metadata__\":{{\"format\":\"pt\"}},\"{name}\":{entry}}}");
    let (st, v) = s.push("commit=false", &image(&ok, data));
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.push("discard=true", &[]);
    assert_eq!(st, 200, "{v}");
}
