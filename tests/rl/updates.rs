//! The scenario at TP 1, 2 and 4: updates from disk and pushed over HTTP while requests
//! run, under each policy (wait, retract, abort), and bad checkpoints refused.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::bits::*;
use crate::checkpoint::models;
use crate::cli_support::*;
use crate::server::Server;

/// `extra`: serve flags (TP 2 runs with `--update-memory free-kv-cache`: every update
/// frees the KV cache and makes it again, failed ones included).
fn updates_mid_load(tp: usize, extra: &[&str]) {
    let m = models();
    let s = Server::start(tp, &m.a, extra, &format!("tp{tp}"));
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

    // 4. Bad checkpoints: refused with a 4xx, nothing changes. A prompt of a full KV
    // block and more, served before them, is in the prefix cache; a failed update that freed and
    // remade the KV cache must not leave it there (its blocks' contents are gone).
    let long = json!({"prompt": (0..120u64).map(|j| 3 + j * 13 % 250).collect::<Vec<_>>(),
                      "max_tokens": 4, "logprobs": 1, "temperature": 0.0});
    let before = choice_bits(&s.ok("/v1/completions", &long)["choices"][0]);
    bad_checkpoints(&s, tp);
    assert_serves(&s, "C");
    let after = choice_bits(&s.ok("/v1/completions", &long)["choices"][0]);
    assert_eq!(
        before, after,
        "the long prompt's bits changed after refused updates"
    );
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
    updates_mid_load(1, &[]);
}

#[test]
fn updates_mid_load_tp2() {
    updates_mid_load(2, &["--update-memory", "free-kv-cache"]);
}

#[test]
fn updates_mid_load_tp4() {
    updates_mid_load(4, &[]);
}
