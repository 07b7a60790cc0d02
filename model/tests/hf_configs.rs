//! Checkpoints as transformers 4 and 5 write them: configs saved by transformers 4.57 and
//! 5.23 themselves (fixtures/hf-configs, written by its generate.py) parse to the same
//! model, and twins give the same bits while every RoPE setting really changes them.

mod common;

use std::path::{Path, PathBuf};

use arbor_kernels::cpu::RopeScaling;
use arbor_model::{Arch, ConfigFormat, ModelConfig, Preset, Sampling, SynthOptions};
use common::*;
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-configs")
}

fn parse_fixture(generation: &str, name: &str) -> ModelConfig {
    let path = fixtures().join(generation).join(format!("{name}.json"));
    ModelConfig::from_json_str(&std::fs::read_to_string(&path).unwrap(), &path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

const NAMES: &[&str] = &[
    "llama-default",
    "llama-llama3",
    "llama-linear",
    "llama-dynamic",
    "llama-tied",
    "qwen3-default",
    "qwen3-yarn",
    "qwen3-sliding",
    "mistral-default",
    "mistral-sliding",
];

#[test]
fn both_generations_parse_to_the_same_model() {
    for name in NAMES {
        let v4 = parse_fixture("tf4.57", name);
        let v5 = parse_fixture("tf5.23", name);
        assert_eq!(v4, v5, "{name}");
        assert_eq!(v5.dtype.as_deref(), Some("bfloat16"), "{name}");
    }
    let c = |n| parse_fixture("tf5.23", n);
    assert!(
        matches!(c("llama-llama3").rope_scaling, Some(RopeScaling::Llama3(s)) if s.factor == 8.0 && s.original_max_position_embeddings == 64)
    );
    assert_eq!(c("llama-llama3").rope_theta, 500000.0);
    assert!(
        matches!(c("llama-linear").rope_scaling, Some(RopeScaling::Linear { factor }) if factor == 2.0)
    );
    // Dynamic's original context defaults to max_position_embeddings, as in HF.
    assert!(matches!(
        c("llama-dynamic").rope_scaling,
        Some(RopeScaling::Dynamic {
            original_max_position_embeddings: 512,
            ..
        })
    ));
    let Some(RopeScaling::Yarn(y)) = c("qwen3-yarn").rope_scaling else {
        panic!("yarn expected")
    };
    assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 128));
    assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
    assert!((y.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    assert_eq!(c("qwen3-default").rope_theta, 1e6);
    assert!(c("llama-tied").tie_word_embeddings);
    assert_eq!(c("mistral-default").sliding_window, None);
    assert_eq!(c("mistral-sliding").sliding_window, Some(256));
    // Qwen3 slides only from max_window_layers (1) on; one sliding layer is enough.
    assert_eq!(c("qwen3-sliding").sliding_window, Some(256));
    assert_eq!(c("qwen3-default").sliding_window, None);
}

/// A tiny model whose config.json is replaced by `config`.
fn with_config(arch: Arch, format: ConfigFormat, edit: impl Fn(&mut Value)) -> TempDir {
    let dir = make(SynthOptions {
        config_format: format,
        ..SynthOptions::new(arch, Preset::Tiny, 11, "")
    });
    let path = dir.path().join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    dir
}

fn run(dir: &Path, max_seq_len: usize) -> (Vec<GenKey>, Vec<ScoreKey>) {
    let mut o = opts(dir);
    o.max_seq_len = Some(max_seq_len);
    let reqs = vec![arbor_model::GenRequest {
        id: 5,
        prompt: prompt(5, 40),
        max_new_tokens: 6,
    }];
    let score = vec![arbor_model::ScoreRequest {
        id: 5,
        tokens: prompt(6, 60),
        prompt_len: 1,
    }];
    let rs = on_ranks(1, o, move |mut r| {
        Ok((
            gen_keys(&r.generate(&reqs, &Sampling::greedy(), 3)?),
            score_keys(&r.score(&score, 3)?),
        ))
    });
    rs.into_iter().next().unwrap().unwrap()
}

/// The RoPE part of a config in each generation.
fn rope_v4(v: &mut Value, theta: f64, scaling: Value) {
    v["rope_theta"] = json!(theta);
    v["rope_scaling"] = scaling;
}

fn rope_v5(v: &mut Value, theta: f64, scaling: Value) {
    let obj = v.as_object_mut().unwrap();
    obj.remove("rope_theta");
    obj.remove("rope_scaling");
    let mut p = match scaling {
        Value::Object(m) => m,
        _ => serde_json::Map::from_iter([("rope_type".to_string(), json!("default"))]),
    };
    p.insert("rope_theta".into(), json!(theta));
    obj.insert("rope_parameters".into(), Value::Object(p));
}

#[test]
fn twins_give_the_same_bits_and_every_rope_setting_counts() {
    let settings = [
        (Arch::Llama, 10000.0, Value::Null),
        (
            Arch::Llama,
            10000.0,
            json!({"rope_type": "linear", "factor": 4.0}),
        ),
        (
            Arch::Llama,
            500000.0,
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        ),
        (
            Arch::Qwen3,
            1000000.0,
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        ),
    ];
    let mut seen: Vec<(Arch, (Vec<GenKey>, Vec<ScoreKey>))> = Vec::new();
    for (arch, theta, scaling) in settings {
        let (s4, s5) = (scaling.clone(), scaling.clone());
        let v4 = with_config(arch, ConfigFormat::Transformers4, move |v| {
            rope_v4(v, theta, s4.clone())
        });
        let v5 = with_config(arch, ConfigFormat::Transformers5, move |v| {
            rope_v5(v, theta, s5.clone())
        });
        let a = run(v4.path(), 128);
        let b = run(v5.path(), 128);
        assert_eq!(a, b, "{arch:?} {scaling}: the two generations differ");
        // A setting that were ignored would reproduce an earlier one's bits.
        for (other_arch, earlier) in &seen {
            if *other_arch == arch {
                assert_ne!(
                    &a, earlier,
                    "{arch:?} {scaling} gives the same bits as another setting"
                );
            }
        }
        seen.push((arch, a));
    }
}

#[test]
fn transformers5_checkpoint_written_by_make_model_matches_its_v4_twin() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let v4 = with_config(arch, ConfigFormat::Transformers4, |_| {});
        let v5 = with_config(arch, ConfigFormat::Transformers5, |_| {});
        let text = std::fs::read_to_string(v5.path().join("config.json")).unwrap();
        assert!(
            text.contains("rope_parameters") && !text.contains("rope_scaling"),
            "{text}"
        );
        assert_eq!(run(v4.path(), 128), run(v5.path(), 128), "{arch:?}");
    }
}

#[test]
fn a_sliding_window_bounds_the_context() {
    let dir = with_config(Arch::Llama, ConfigFormat::Transformers5, |v| {
        v["sliding_window"] = json!(64);
    });
    // Within the window the model is exact and runs.
    let _ = run(dir.path(), 64);
    let mut o = opts(dir.path());
    o.max_seq_len = Some(65);
    let err = on_ranks(1, o, |_| Ok(())).into_iter().next().unwrap();
    let e = err.unwrap_err().to_string();
    assert!(
        e.contains("sliding_window 64") && e.contains("--max-seq-len 64"),
        "{e}"
    );
    // Without --max-seq-len, the default context stops at the window.
    let mut o = opts(dir.path());
    o.max_seq_len = None;
    let lens = on_ranks(1, o, |r| Ok(r.max_seq_len()));
    assert_eq!(*lens[0].as_ref().unwrap(), 64);
}

#[test]
fn unknown_and_unsupported_keys_are_refused_at_load() {
    for (key, value, needle) in [
        (
            "logits_scaling",
            json!(2.0),
            "unknown key \"logits_scaling\"",
        ),
        (
            "quantization_config",
            json!({"quant_method": "gptq"}),
            "quantization_config",
        ),
        ("partial_rotary_factor", json!(0.5), "partial_rotary_factor"),
    ] {
        let dir = with_config(Arch::Qwen3, ConfigFormat::Transformers5, |v| {
            v[key] = value.clone();
        });
        let err = on_ranks(1, opts(dir.path()), |_| Ok(()))
            .into_iter()
            .next()
            .unwrap();
        let e = err.unwrap_err().to_string();
        assert!(
            e.contains(needle) && e.contains("config.json"),
            "{key}: {e}"
        );
    }
    let dir = with_config(Arch::Llama, ConfigFormat::Transformers5, |v| {
        v["rope_parameters"]["rope_type"] = json!("longrope");
    });
    let err = on_ranks(1, opts(dir.path()), |_| Ok(()))
        .into_iter()
        .next()
        .unwrap();
    let e = err.unwrap_err().to_string();
    assert!(e.contains("longrope") && e.contains("not supported"), "{e}");
}

#[test]
fn generation_config_eos_list_stops_generation() {
    let dir = tiny(Arch::Llama, 3);
    // Greedy output of this prompt, then make one of its tokens (the first one not seen
    // before it) an end-of-sequence id that only generation_config.json lists.
    let reqs = vec![arbor_model::GenRequest {
        id: 1,
        prompt: prompt(1, 12),
        max_new_tokens: 8,
    }];
    let r2 = reqs.clone();
    let first = on_ranks(1, opts(dir.path()), move |mut r| {
        r.generate(&r2, &Sampling::greedy(), 0)
    });
    let tokens = first.into_iter().next().unwrap().unwrap()[0].tokens.clone();
    let at = (1..tokens.len())
        .find(|&i| !tokens[..i].contains(&tokens[i]))
        .expect("greedy output repeats a single token");
    let stop = tokens[at];
    std::fs::write(
        dir.path().join("generation_config.json"),
        json!({"eos_token_id": [100000, stop], "do_sample": false}).to_string(),
    )
    .unwrap();
    let out = on_ranks(1, opts(dir.path()), move |mut r| {
        assert!(r.eos_token_ids().contains(&stop));
        r.generate(&reqs, &Sampling::greedy(), 0)
    });
    let out = &out.into_iter().next().unwrap().unwrap()[0];
    assert_eq!(out.tokens, tokens[..=at].to_vec());
    assert_eq!(out.finish, arbor_model::FinishReason::Eos);
}
