//! Every ModelError case: a clear error naming the file, tensor or value; no panic, and
//! (for TP groups) no rank left hanging.

mod common;

use std::path::Path;
use std::sync::Arc;

use arbor_collective::SingleComm;
use arbor_model::{
    load, Arch, GenRequest, ModelError, Preset, Sampling, ScoreRequest, SynthOptions,
};
use common::*;
use serde_json::Value;

fn load_err(dir: &Path) -> ModelError {
    match load(&opts(dir), Arc::new(SingleComm)) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

/// Rewrites model.safetensors with its header JSON edited by `f` (data unchanged).
fn edit_header(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(h.as_object_mut().unwrap());
    let json = h.to_string().into_bytes();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn missing_and_malformed_config() {
    let m = tiny(Arch::Llama, 1);
    std::fs::remove_file(m.path().join("config.json")).unwrap();
    let e = load_err(m.path());
    assert!(
        matches!(e, ModelError::Io { ref path, .. } if path.ends_with("config.json")),
        "{e}"
    );

    std::fs::write(m.path().join("config.json"), "{\"architectures\": [").unwrap();
    let e = load_err(m.path());
    assert!(
        matches!(e, ModelError::Config { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );
}

#[test]
fn unknown_architecture() {
    let m = tiny(Arch::Llama, 1);
    edit_config(m.path(), |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["DeepseekV3ForCausalLM"]),
        );
    });
    let e = load_err(m.path());
    assert!(e.to_string().contains("DeepseekV3ForCausalLM"), "{e}");
    assert!(matches!(e, ModelError::UnknownArch { .. }));
}

#[test]
fn truncated_safetensors() {
    let m = tiny(Arch::Llama, 1);
    let p = m.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load_err(m.path());
    let s = e.to_string();
    assert!(
        matches!(e, ModelError::Safetensors { .. })
            && s.contains("model.safetensors")
            && s.contains("outside the data section"),
        "{s}"
    );
    f.set_len(4).unwrap();
    let s = load_err(m.path()).to_string();
    assert!(s.contains("truncated"), "{s}");
}

#[test]
fn header_lying_about_offsets_or_shapes() {
    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        h["model.norm.weight"]["data_offsets"][1] = serde_json::json!(u64::MAX / 2);
    });
    let s = load_err(m.path()).to_string();
    assert!(
        s.contains("model.norm.weight") && s.contains("outside the data section"),
        "{s}"
    );

    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        h["model.norm.weight"]["shape"] = serde_json::json!([129]);
    });
    let s = load_err(m.path()).to_string();
    assert!(
        s.contains("model.norm.weight") && s.contains("needs 258"),
        "{s}"
    );

    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        let a = h["model.layers.0.input_layernorm.weight"]["data_offsets"].clone();
        h["model.norm.weight"]["data_offsets"] = a;
    });
    let s = load_err(m.path()).to_string();
    assert!(s.contains("overlap"), "{s}");
}

#[test]
fn missing_tensor_and_shape_and_dtype_mismatch() {
    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        h.remove("model.layers.2.mlp.up_proj.weight");
    });
    let e = load_err(m.path());
    assert!(
        matches!(e, ModelError::MissingTensor { ref tensor, .. } if tensor == "model.layers.2.mlp.up_proj.weight"),
        "{e}"
    );

    // A self-consistent header whose shape disagrees with config.json.
    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        let b = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap();
        h["model.norm.weight"]["shape"] = serde_json::json!([64]);
        h["model.norm.weight"]["data_offsets"] = serde_json::json!([b, b + 128]);
    });
    let e = load_err(m.path());
    assert!(
        matches!(e, ModelError::ShapeMismatch { ref tensor, ref found, ref expected, .. }
            if tensor == "model.norm.weight" && found == &vec![64] && expected == &vec![128]),
        "{e}"
    );

    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        h["model.norm.weight"]["dtype"] = serde_json::json!("I16");
    });
    let e = load_err(m.path());
    assert!(
        matches!(e, ModelError::DtypeUnsupported { ref dtype, .. } if dtype == "I16"),
        "{e}"
    );

    // Same bytes relabelled F32: the header now lies about the size.
    let m = tiny(Arch::Llama, 1);
    edit_header(m.path(), |h| {
        h["model.norm.weight"]["dtype"] = serde_json::json!("F32");
    });
    let s = load_err(m.path()).to_string();
    assert!(s.contains("model.norm.weight") && s.contains("F32"), "{s}");
}

#[test]
fn heads_not_divisible_by_tp_fails_on_every_rank() {
    let mut shape = Preset::Tiny.shape(Arch::Llama);
    shape.heads = 6;
    shape.kv_heads = 2;
    shape.hidden = 96;
    let m = make(SynthOptions {
        shape: Some(shape),
        ..SynthOptions::new(Arch::Llama, Preset::Tiny, 1, "")
    });
    // TP 2 works (6 heads / 2), TP 4 must fail cleanly on all 4 ranks.
    let ok = on_ranks(2, opts(m.path()), |r| Ok(r.tp()));
    assert!(ok.iter().all(|r| r.is_ok()));
    let rs = on_ranks(4, opts(m.path()), |r| Ok(r.tp()));
    for r in rs {
        let e = r.expect_err("TP 4 over 6 heads must fail");
        assert!(
            matches!(e, ModelError::Sharding { tp: 4, .. })
                && e.to_string().contains("num_attention_heads 6"),
            "{e}"
        );
    }
    // An o_proj width that is not a multiple of 8: fine at TP 1, refused when split.
    let mut shape = Preset::Tiny.shape(Arch::Llama);
    shape.heads = 3;
    shape.kv_heads = 1;
    shape.head_dim = 10;
    shape.hidden = 30;
    let m = make(SynthOptions {
        shape: Some(shape),
        ..SynthOptions::new(Arch::Llama, Preset::Tiny, 1, "")
    });
    assert!(load(&opts(m.path()), Arc::new(SingleComm)).is_ok());
    let mut shape = Preset::Tiny.shape(Arch::Llama);
    shape.heads = 6;
    shape.kv_heads = 2;
    shape.head_dim = 10;
    shape.hidden = 60;
    let m = make(SynthOptions {
        shape: Some(shape),
        ..SynthOptions::new(Arch::Llama, Preset::Tiny, 1, "")
    });
    for r in on_ranks(2, opts(m.path()), |r| Ok(r.tp())) {
        let s = r
            .expect_err("TP 2 with o_proj K = 60 must fail")
            .to_string();
        assert!(s.contains("not a multiple of 8"), "{s}");
    }
}

#[test]
fn bad_requests() {
    let m = tiny(Arch::Qwen3, 1);
    let mut r = load(&opts(m.path()), Arc::new(SingleComm)).unwrap();
    let g = |prompt: Vec<u32>, n: usize| {
        vec![GenRequest {
            id: 42,
            prompt,
            max_new_tokens: n,
        }]
    };
    let e = r
        .generate(&g(vec![1, 2, 258, 3], 2), &Sampling::greedy(), 0)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::TokenOutOfVocab {
                id: 42,
                token: 258,
                index: 2,
                vocab: 258
            }
        ),
        "{e}"
    );
    let sreq = vec![ScoreRequest {
        id: 7,
        tokens: vec![5, 999],
        prompt_len: 1,
    }];
    assert!(matches!(
        r.score(&sreq, 0).unwrap_err(),
        ModelError::TokenOutOfVocab {
            id: 7,
            token: 999,
            ..
        }
    ));

    // max_seq_len is 256 in these tests.
    let e = r
        .generate(&g(vec![1; 250], 10), &Sampling::greedy(), 0)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ContextTooLong {
                id: 42,
                needed: 260,
                max: 256,
                ..
            }
        ),
        "{e}"
    );
    let sreq = vec![ScoreRequest {
        id: 8,
        tokens: vec![1; 300],
        prompt_len: 1,
    }];
    assert!(matches!(
        r.score(&sreq, 0).unwrap_err(),
        ModelError::ContextTooLong { id: 8, .. }
    ));

    assert!(matches!(
        r.generate(&g(vec![], 3), &Sampling::greedy(), 0)
            .unwrap_err(),
        ModelError::BadRequest { id: 42, .. }
    ));
    let sreq = vec![ScoreRequest {
        id: 9,
        tokens: vec![1, 2],
        prompt_len: 0,
    }];
    assert!(matches!(
        r.score(&sreq, 0).unwrap_err(),
        ModelError::BadRequest { id: 9, .. }
    ));
    let bad = Sampling {
        temperature: -1.0,
        ..Sampling::greedy()
    };
    assert!(matches!(
        r.generate(&g(vec![1], 1), &bad, 0).unwrap_err(),
        ModelError::BadSampling(_)
    ));
    let bad = Sampling {
        top_p: 0.0,
        ..Sampling::greedy()
    };
    assert!(matches!(
        r.generate(&g(vec![1], 1), &bad, 0).unwrap_err(),
        ModelError::BadSampling(_)
    ));

    // The runner still works after rejected requests.
    let ok = r
        .generate(&g(vec![1, 2, 3], 2), &Sampling::greedy(), 0)
        .unwrap();
    assert_eq!(ok[0].tokens.len(), 2);

    // A context longer than the model's is refused at load.
    let mut o = opts(m.path());
    o.max_seq_len = Some(1 << 20);
    let e = load(&o, Arc::new(SingleComm))
        .err()
        .expect("oversized context");
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
}

#[test]
fn no_safetensors_and_bad_index() {
    let m = tiny(Arch::Llama, 1);
    std::fs::remove_file(m.path().join("model.safetensors")).unwrap();
    let s = load_err(m.path()).to_string();
    assert!(s.contains("model.safetensors"), "{s}");
    std::fs::write(
        m.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../x"}}"#,
    )
    .unwrap();
    let s = load_err(m.path()).to_string();
    assert!(s.contains("not a plain file name"), "{s}");
    std::fs::write(
        m.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "nothere.safetensors"}}"#,
    )
    .unwrap();
    let s = load_err(m.path()).to_string();
    assert!(s.contains("nothere.safetensors"), "{s}");
}
