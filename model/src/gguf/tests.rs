//! The GGUF reader's tests: what it reads, what it refuses and why, and that a file
//! computes what its HF directory does.

use super::testfile::*;
use super::*;

fn open_err(b: &Builder) -> String {
    let p = b.write("err");
    let e = GgufModel::open(&p).err().map(|e| e.to_string());
    let _ = std::fs::remove_file(&p);
    e.expect("the file should be refused")
}

/// Each file is refused with a message holding every one of its words.
fn assert_refused(cases: Vec<(Builder, &[&str])>) {
    for (b, words) in cases {
        let e = open_err(&b);
        for w in words {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
    }
}

fn open_bytes_err(bytes: &[u8]) -> String {
    let p = write_bytes("bytes", bytes);
    let e = GgufModel::open(&p).err().map(|e| e.to_string());
    let _ = std::fs::remove_file(&p);
    e.expect("the file should be refused")
}

/// A non-finite weight is refused when it is read, naming the tensor and the element
/// (loaded silently, NaN weights made the log-probs come back null).
#[test]
fn non_finite_weights_are_refused() {
    let p = Builder::llama()
        .tensor("blk.0.ffn_down.weight", |t| {
            t.data[4 * 37..4 * 38].copy_from_slice(&f32::NAN.to_le_bytes())
        })
        .tensor("output_norm.weight", |t| {
            t.data[4 * 3..4 * 4].copy_from_slice(&f32::INFINITY.to_le_bytes())
        })
        .write("nan");
    let m = GgufModel::open(&p).expect("the file itself is well formed");
    let _ = std::fs::remove_file(&p);
    // Rows and columns of a matrix, and a vector.
    for e in [
        m.weights
            .rows("model.layers.0.mlp.down_proj.weight", HIDDEN, FF, 0..HIDDEN),
        m.weights
            .cols("model.layers.0.mlp.down_proj.weight", HIDDEN, FF, 0..FF),
    ] {
        let e = e.expect_err("refused").to_string();
        assert!(
            e.contains("blk.0.ffn_down.weight") && e.contains("element 37") && e.contains("NaN"),
            "{e}"
        );
    }
    let e = m
        .weights
        .vector("model.norm.weight", HIDDEN, 0..HIDDEN)
        .err();
    let e = e.expect("refused").to_string();
    assert!(
        e.contains("output_norm.weight") && e.contains("element 3") && e.contains("inf"),
        "{e}"
    );
    // Other tensors read as before.
    assert!(m
        .weights
        .rows("model.layers.0.mlp.up_proj.weight", FF, HIDDEN, 0..FF)
        .is_ok());
}

#[test]
fn the_test_model_opens_with_its_tokenizer_and_template() {
    let p = Builder::llama().write("ok");
    let mut m = GgufModel::open(&p).expect("valid test model");
    let _ = std::fs::remove_file(&p);
    assert_eq!(m.config.num_layers, 1);
    assert_eq!(m.config.head_dim, 8);
    assert_eq!(m.config.num_kv_heads, 1);
    assert!(!m.config.tie_word_embeddings);
    assert_eq!(m.config.eos_token_ids, vec![257]);
    let (tok, cfg) = m.tokenizer_parts();
    let tok = tok.expect("tokenizer");
    let ids = tok
        .encode("<|begin|>hi", true)
        .expect("encode")
        .get_ids()
        .to_vec();
    assert_eq!(ids, vec![256, u32::from(b'h'), u32::from(b'i')]);
    let cfg = cfg.expect("tokenizer config");
    assert_eq!(cfg.bos_token.as_deref(), Some("<|begin|>"));
    assert_eq!(cfg.add_bos_token, Some(false));
    assert!(cfg.chat_template.is_some());
    let from = cfg.chat_template_source.as_deref().unwrap_or_default();
    assert!(from.ends_with(".gguf (tokenizer.chat_template)"), "{from}");
    // q/k rows come back in HF order (heads of 8 rows): HF row 1 (head 0, first half,
    // index 1) is file row 2, HF row 4 (second half, index 0) is file row 1; o_proj is
    // read as stored. Seeds 5, 6, 8 made q, k, o (testfile.rs).
    let bf = |x: f32| half::bf16::from_f32(x);
    let rows = |name: &str, n: usize| m.weights.rows(name, n, HIDDEN, 0..n).unwrap();
    let q = rows("model.layers.0.self_attn.q_proj.weight", HIDDEN);
    let k = rows("model.layers.0.self_attn.k_proj.weight", 8);
    let o = rows("model.layers.0.self_attn.o_proj.weight", HIDDEN);
    for (hf_row, file_row) in [(0, 0), (1, 2), (4, 1), (7, 7), (8, 8), (9, 10), (12, 9)] {
        for c in 0..HIDDEN {
            assert_eq!(
                q[hf_row * HIDDEN + c],
                bf(value(file_row * HIDDEN + c, 5)),
                "q row {hf_row}"
            );
        }
    }
    for (hf_row, file_row) in [(1, 2), (5, 3), (6, 5)] {
        for c in 0..HIDDEN {
            assert_eq!(
                k[hf_row * HIDDEN + c],
                bf(value(file_row * HIDDEN + c, 6)),
                "k row {hf_row}"
            );
        }
    }
    for (i, &x) in o.iter().enumerate() {
        assert_eq!(x, bf(value(i, 8)));
    }
    // Columns of a row-parallel shard are the same numbers as whole rows.
    let k_cols = m
        .weights
        .cols("model.layers.0.self_attn.k_proj.weight", 8, HIDDEN, 3..9)
        .unwrap();
    for r in 0..8 {
        assert_eq!(
            &k_cols[r * 6..(r + 1) * 6],
            &k[r * HIDDEN + 3..r * HIDDEN + 9]
        );
    }
}

#[test]
fn add_bos_token_puts_bos_first() {
    let p = Builder::llama()
        .set("tokenizer.ggml.add_bos_token", boolv(true))
        .write("bos");
    let mut m = GgufModel::open(&p).expect("valid test model");
    let _ = std::fs::remove_file(&p);
    let (tok, cfg) = m.tokenizer_parts();
    let enc = crate::PromptEncoder {
        tokenizer: tok.as_ref().expect("tokenizer"),
        config: cfg.as_ref(),
    };
    assert_eq!(enc.encode("hi", true).unwrap(), vec![256, 104, 105]);
    assert_eq!(enc.encode("hi", false).unwrap(), vec![104, 105]);
}

#[test]
fn container_damage_is_named() {
    let good = Builder::llama().bytes();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(open_bytes_err(&bad_magic).contains("not a GGUF file"));
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(open_bytes_err(&v1).contains("version 1"));
    let mut be = good.clone();
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(open_bytes_err(&be).contains("big-endian"));
    let e = open_bytes_err(&good[..good.len() - 100]);
    assert!(
        e.contains("outside the data section") && e.contains("blk.0.ffn_down.weight"),
        "{e}"
    );
    let e = open_bytes_err(&good[..200]);
    assert!(
        e.contains("tensor count 12 cannot fit") && e.contains("truncated"),
        "{e}"
    );
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_bytes_err(&huge).contains("tensor count"));
    let b = Builder::llama().set("general.weird", Val(13, vec![0; 8]));
    assert!(open_err(&b).contains("unknown metadata value type 13"));
    let b = Builder::llama().set("llama.flag", Val(7, vec![2]));
    assert!(open_err(&b).contains("bool byte 2"));
    let b = Builder::llama().tensor("blk.0.attn_norm.weight", |t| t.dims = vec![17]);
    let e = open_err(&b);
    assert!(
        e.contains("overlap") && e.contains("blk.0.attn_norm.weight"),
        "{e}"
    );
}

#[test]
fn what_arbor_does_not_implement_is_refused_by_name() {
    let cases: Vec<(Builder, &[&str])> = vec![
        (
            Builder::llama().set("llama.attention.clamp_kqv", f32v(8.0)),
            &["llama.attention.clamp_kqv", "ARBOR_ALLOW_CONFIG_KEYS"],
        ),
        (
            Builder::llama().set("llama.expert_used_count", u32v(2)),
            &[
                "llama.expert_used_count = 2",
                "mixture-of-experts",
                "without llama.expert_count",
            ],
        ),
        (
            Builder::llama().set("general.architecture", strv("gpt2")),
            &["\"gpt2\"", "llama", "qwen2", "qwen3", "qwen3moe"],
        ),
        (
            Builder::llama().set("split.count", u32v(3)),
            &["one of 3 split"],
        ),
        (
            Builder::llama().set("llama.rope.dimension_count", u32v(4)),
            &["partial rotary"],
        ),
        (
            Builder::llama().remove("llama.block_count"),
            &["llama.block_count"],
        ),
        (
            Builder::llama().set("llama.rope.scaling.type", strv("longrope")),
            &["longrope"],
        ),
        (
            Builder::llama().set("tokenizer.ggml.pre", strv("default")),
            &["\"default\"", "smollm"],
        ),
        (
            Builder::llama().set("tokenizer.ggml.model", strv("bert")),
            &["\"bert\""],
        ),
        (
            Builder::llama().set("tokenizer.ggml.eos_token_id", u32v(999)),
            &["eos_token_id 999"],
        ),
        (
            Builder::llama().tensor("blk.0.ffn_up.weight", |t| {
                t.name = "blk.0.ffn_up_exps.weight".into()
            }),
            &["blk.0.ffn_up_exps.weight"],
        ),
    ];
    assert_refused(cases);
}

/// A float that is NaN, infinite or out of range is refused by its key, never
/// replaced by a default (NaN rope.freq_base once ran with theta 10000, and an
/// infinite epsilon loaded and gave near-uniform logits); so is a context length no
/// model has (2^32 − 1 aborted the process), and a token id that is not one.
#[test]
fn bad_metadata_values_are_refused_by_key() {
    const EPS: &str = "llama.attention.layer_norm_rms_epsilon";
    const BASE: &str = "llama.rope.freq_base";
    let cases: Vec<(Builder, &[&str])> = vec![
        (
            Builder::llama().set(BASE, f32v(f32::NAN)),
            &[BASE, "is NaN"],
        ),
        (
            Builder::llama().set(BASE, f32v(f32::INFINITY)),
            &[BASE, "is inf"],
        ),
        (Builder::llama().set(BASE, f32v(0.5)), &[BASE, "above 1"]),
        (
            Builder::llama().set(EPS, f32v(f32::INFINITY)),
            &[EPS, "is inf"],
        ),
        (Builder::llama().set(EPS, f32v(f32::NAN)), &[EPS, "is NaN"]),
        (Builder::llama().set(EPS, f32v(-1.0)), &[EPS, "is -1"]),
        (Builder::llama().set(EPS, f32v(1e30)), &[EPS, "in [0, 1]"]),
        (
            Builder::llama()
                .set("llama.rope.scaling.type", strv("linear"))
                .set("llama.rope.scaling.factor", f32v(f32::NAN)),
            &["llama.rope.scaling.factor is NaN"],
        ),
        (
            Builder::llama().set("llama.rope.scaling.factor", f32v(4.0)),
            &["llama.rope.scaling.factor 4 without a llama.rope.scaling.type"],
        ),
        (
            Builder::llama().set("llama.context_length", u32v(u32::MAX)),
            &["llama.context_length 4294967295 is beyond"],
        ),
        (
            Builder::llama().set("tokenizer.ggml.eos_token_id", strv("</s>")),
            &["tokenizer.ggml.eos_token_id", "not a token id"],
        ),
    ];
    assert_refused(cases);
    // Absent, the base is the default; 0 (llama.cpp's "unset") and 1 scale nothing.
    for b in [
        Builder::llama().remove(BASE),
        Builder::llama().set("llama.rope.scaling.factor", f32v(0.0)),
    ] {
        let p = b.write("ok");
        let m = GgufModel::open(&p);
        let _ = std::fs::remove_file(&p);
        let m = m.expect("valid");
        assert_eq!(m.config.rope_theta, 10000.0);
        assert!(m.config.rope_scaling.is_none());
    }
}

/// A qwen3moe file: the config of a Qwen3-MoE (every layer sparse, renormalised top-k,
/// llama.cpp's semantics), and each expert's matrix read from its slab of the stacked
/// tensor, whole rows and a row-parallel shard's columns alike.
#[test]
fn qwen3moe_files_read_their_experts() {
    let p = Builder::qwen3moe().write("moe");
    let m = GgufModel::open(&p).expect("valid test model");
    let _ = std::fs::remove_file(&p);
    assert_eq!(m.config.arch, crate::config::Arch::Qwen3Moe);
    let x = m.config.moe.clone().expect("experts");
    assert_eq!(
        (
            x.num_experts,
            x.top_k,
            x.expert_intermediate,
            x.norm_topk_prob
        ),
        (EXPERTS, EXPERTS_USED, EXPERT_FF, true)
    );
    assert_eq!(x.sparse_layers, vec![true]);
    let bf = |x: f32| half::bf16::from_f32(x);
    let router = m
        .weights
        .rows(
            "model.layers.0.mlp.gate.weight",
            EXPERTS,
            HIDDEN,
            0..EXPERTS,
        )
        .unwrap();
    assert!(router
        .iter()
        .enumerate()
        .all(|(i, &v)| v == bf(value(i, 15))));
    // Expert e of a [h, ff, E] tensor: elements e·ff·h + r·h + c in file order.
    for e in [0, 2, 3] {
        let gate = m
            .weights
            .rows(
                &format!("model.layers.0.mlp.experts.{e}.gate_proj.weight"),
                EXPERT_FF,
                HIDDEN,
                0..EXPERT_FF,
            )
            .unwrap();
        for (i, &v) in gate.iter().enumerate() {
            assert_eq!(v, bf(value(e * EXPERT_FF * HIDDEN + i, 16)), "expert {e}");
        }
        let down = m
            .weights
            .cols(
                &format!("model.layers.0.mlp.experts.{e}.down_proj.weight"),
                HIDDEN,
                EXPERT_FF,
                2..6,
            )
            .unwrap();
        for r in 0..HIDDEN {
            for c in 0..4 {
                assert_eq!(
                    down[r * 4 + c],
                    bf(value(e * HIDDEN * EXPERT_FF + r * EXPERT_FF + 2 + c, 18)),
                    "expert {e} row {r}"
                );
            }
        }
    }
    // An expert past the stack is missing, named by its GGUF tensor.
    let e = m
        .weights
        .rows(
            &format!("model.layers.0.mlp.experts.{EXPERTS}.up_proj.weight"),
            EXPERT_FF,
            HIDDEN,
            0..1,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("blk.0.ffn_up_exps.weight, expert {EXPERTS}")),
        "{e}"
    );
}

/// Bad mixture-of-experts files are refused naming the key or the tensor.
#[test]
fn bad_qwen3moe_files_are_refused_by_name() {
    let cases: Vec<(Builder, &[&str])> = vec![
        (
            Builder::qwen3moe().tensor("blk.0.ffn_gate_exps.weight", |t| {
                t.dims = vec![HIDDEN as u64, EXPERT_FF as u64, 3];
                t.data.truncate(HIDDEN * EXPERT_FF * 3 * 4);
            }),
            &["blk.0.ffn_gate_exps.weight", "[16, 8, 3]", "4 experts"],
        ),
        (
            Builder::qwen3moe().set("qwen3moe.expert_used_count", u32v(5)),
            &["qwen3moe.expert_used_count 5 must be between 1 and qwen3moe.expert_count 4"],
        ),
        (
            Builder::qwen3moe().remove("qwen3moe.expert_count"),
            &["missing metadata key qwen3moe.expert_count"],
        ),
        (
            Builder::qwen3moe().set("qwen3moe.expert_shared_feed_forward_length", u32v(8)),
            &[
                "qwen3moe.expert_shared_feed_forward_length",
                "ARBOR_ALLOW_CONFIG_KEYS",
            ],
        ),
        (
            Builder::qwen3moe()
                .remove("qwen3moe.expert_feed_forward_length")
                .set("qwen3moe.feed_forward_length", u32v(33)),
            &[
                "qwen3moe.feed_forward_length 33",
                "qwen3moe.expert_used_count 2",
            ],
        ),
    ];
    assert_refused(cases);
    // A projection's experts missing altogether: the model's load names the tensor.
    let p = Builder::qwen3moe()
        .drop_tensor("blk.0.ffn_down_exps.weight")
        .write("moe-missing");
    let m = GgufModel::open(&p).expect("the container is valid");
    let _ = std::fs::remove_file(&p);
    let e = m
        .weights
        .cols(
            "model.layers.0.mlp.experts.0.down_proj.weight",
            HIDDEN,
            EXPERT_FF,
            0..EXPERT_FF,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.0.ffn_down_exps.weight, expert 0"), "{e}");
    // Without expert_feed_forward_length the width is llama.cpp's ff / used.
    let p = Builder::qwen3moe()
        .remove("qwen3moe.expert_feed_forward_length")
        .set("qwen3moe.feed_forward_length", u32v(16))
        .write("moe-ff");
    let m = GgufModel::open(&p);
    let _ = std::fs::remove_file(&p);
    let m = m.expect("valid");
    assert_eq!(m.config.moe.expect("experts").expert_intermediate, 8);
}

/// A Mixtral file, as llama.cpp's converter writes one (`llama` with expert counts):
/// Mixtral's config (its renormalised top-k), the router and each expert's matrices
/// under Mixtral's HF names, the same numbers from stacked and per-expert tensors, and
/// the q/k rows still read back from llama.cpp's permutation.
#[test]
fn mixtral_files_read_their_experts() {
    let p = Builder::mixtral().write("mixtral");
    let stacked = GgufModel::open(&p).expect("valid test model");
    let _ = std::fs::remove_file(&p);
    assert_eq!(stacked.config.arch, crate::config::Arch::Mixtral);
    assert_eq!(
        stacked.config_json["architectures"],
        serde_json::json!(["MixtralForCausalLM"])
    );
    let x = stacked.config.moe.clone().expect("experts");
    assert_eq!(
        (
            x.num_experts,
            x.top_k,
            x.expert_intermediate,
            x.norm_topk_prob
        ),
        (EXPERTS, EXPERTS_USED, FF, true)
    );
    assert_eq!(x.sparse_layers, vec![true]);
    let bf = |x: f32| half::bf16::from_f32(x);
    let m = &stacked.weights;
    let router = m
        .rows(
            "model.layers.0.block_sparse_moe.gate.weight",
            EXPERTS,
            HIDDEN,
            0..EXPERTS,
        )
        .unwrap();
    assert!(router
        .iter()
        .enumerate()
        .all(|(i, &v)| v == bf(value(i, 15))));
    let q = m
        .rows(
            "model.layers.0.self_attn.q_proj.weight",
            HIDDEN,
            HIDDEN,
            1..2,
        )
        .unwrap();
    for (c, &v) in q.iter().enumerate() {
        assert_eq!(v, bf(value(2 * HIDDEN + c, 5)), "q row 1 is file row 2");
    }
    // w1 gate (seed 16), w3 up (17), w2 down (18): expert e of a [k, n, E] tensor is
    // elements e·n·k.. in file order.
    for e in [0, 1, 3] {
        for (w, seed, n, k) in [
            ("w1", 16, FF, HIDDEN),
            ("w3", 17, FF, HIDDEN),
            ("w2", 18, HIDDEN, FF),
        ] {
            let name = format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight");
            let rows = m.rows(&name, n, k, 0..n).unwrap();
            for (i, &v) in rows.iter().enumerate() {
                assert_eq!(v, bf(value(e * n * k + i, seed)), "{name}");
            }
        }
    }
    // One tensor per expert (older files) reads the same numbers, rows and columns.
    let p = Builder::mixtral()
        .per_expert("ffn_gate")
        .per_expert("ffn_up")
        .per_expert("ffn_down")
        .write("mixtral-per-expert");
    let single = GgufModel::open(&p).expect("valid test model");
    let _ = std::fs::remove_file(&p);
    assert_eq!(single.config, stacked.config);
    for e in 0..EXPERTS {
        for (w, n, k) in [("w1", FF, HIDDEN), ("w3", FF, HIDDEN), ("w2", HIDDEN, FF)] {
            let name = format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight");
            assert_eq!(
                single.weights.rows(&name, n, k, 0..n).unwrap(),
                m.rows(&name, n, k, 0..n).unwrap(),
                "{name}"
            );
            assert_eq!(
                single.weights.cols(&name, n, k, 3..k).unwrap(),
                m.cols(&name, n, k, 3..k).unwrap(),
                "{name}"
            );
        }
    }
}

/// Bad Mixtral files are refused naming the key or the tensor.
#[test]
fn bad_mixtral_files_are_refused_by_name() {
    let cases: Vec<(Builder, &[&str])> = vec![
        (
            Builder::mixtral().set("llama.expert_used_count", u32v(5)),
            &["llama.expert_used_count 5 must be between 1 and llama.expert_count 4"],
        ),
        (
            Builder::mixtral().set("llama.expert_used_count", u32v(0)),
            &["llama.expert_used_count 0"],
        ),
        (
            Builder::mixtral().remove("llama.expert_used_count"),
            &["missing metadata key llama.expert_used_count"],
        ),
        (
            Builder::mixtral().set("llama.expert_feed_forward_length", u32v(8)),
            &["llama.expert_feed_forward_length 8 differs from llama.feed_forward_length 32"],
        ),
        (
            Builder::mixtral().tensor("blk.0.ffn_up_exps.weight", |t| {
                t.dims = vec![HIDDEN as u64, FF as u64 / 2, EXPERTS as u64 * 2];
            }),
            &["blk.0.ffn_up_exps.weight", "[16, 16, 8]", "4 experts"],
        ),
        (
            Builder::mixtral()
                .per_expert("ffn_down")
                .tensor("blk.0.ffn_down.2.weight", |t| {
                    t.name = "blk.0.ffn_down.4.weight".into()
                }),
            &["blk.0.ffn_down.4.weight", "expert 4", "expert_count is 4"],
        ),
        (
            {
                let mut b = Builder::mixtral();
                b.tensors
                    .push(f32_tensor("blk.0.ffn_gate.1.weight", &[HIDDEN, FF], 19));
                b
            },
            &[
                "blk.0.ffn_gate_exps.weight",
                "blk.0.ffn_gate.1.weight",
                "stacked or one tensor per expert",
            ],
        ),
        (
            {
                let mut b = Builder::mixtral();
                b.tensors
                    .push(f32_tensor("blk.0.ffn_up.weight", &[HIDDEN, FF], 19));
                b
            },
            &["blk.0.ffn_up.weight", "dense MLP", "every layer"],
        ),
        (
            {
                let mut b = Builder::mixtral();
                b.tensors
                    .push(f32_tensor("blk.0.attn_q.bias", &[HIDDEN], 19));
                b
            },
            &["blk.0.attn_q.bias", "attention biases", "Mixtral"],
        ),
        (
            Builder::qwen3moe().per_expert("ffn_up"),
            &["blk.0.ffn_up.0.weight", "qwen3moe", "not supported"],
        ),
    ];
    assert_refused(cases);
    // An expert's tensor missing: the model's load names both forms it may take.
    let p = Builder::mixtral()
        .per_expert("ffn_gate")
        .drop_tensor("blk.0.ffn_gate.2.weight")
        .write("mixtral-missing");
    let m = GgufModel::open(&p).expect("the container is valid");
    let _ = std::fs::remove_file(&p);
    let e = m
        .weights
        .rows(
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
            FF,
            HIDDEN,
            0..FF,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.ffn_gate_exps.weight, expert 2, or blk.0.ffn_gate.2.weight"),
        "{e}"
    );
}

/// The logits (as bits) of a tiny random `arch` model made by `make-model` (every
/// layer sparse, as GGUF files have them), loaded from its HF directory and from the
/// GGUF file llama.cpp's converter would write of it: F32, each projection's experts
/// stacked (`per_expert`: one tensor per expert, as older llama.cpp files for `llama`
/// have them), and for Mixtral, a `llama` file, the q/k rows permuted as
/// convert_hf_to_gguf.py's `LlamaModel.permute` does.
fn hf_and_gguf_logits(arch: crate::config::Arch, per_expert: bool) -> (Vec<u32>, Vec<u32>) {
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, KvRows, SeqRows};
    use crate::config::checkpoint_names;
    use crate::config::Arch;
    use crate::layers::LoadCtx;
    use crate::synth::{make_model, MoeShape, Preset, Shape, SynthOptions};
    use crate::weights::WeightStore;

    let dir = std::env::temp_dir().join(format!(
        "arbor-gguf-moe-hf-{arch:?}-{per_expert}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let tiny = Preset::Tiny.shape(arch);
    let x = tiny.moe.expect("experts");
    let s = Shape {
        layers: 2,
        moe: Some(MoeShape {
            dense_layers: 0,
            ..x
        }),
        ..tiny
    };
    make_model(&SynthOptions {
        shape: Some(s.clone()),
        ..SynthOptions::new(arch, Preset::Tiny, 5, &dir)
    })
    .expect("the HF model");
    let mixtral = arch == Arch::Mixtral;
    let store = WeightStore::open(&dir).expect("its weights");
    let f32_bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let hf_rows = |name: &str, n: usize, k: usize| -> Vec<f32> {
        store
            .rows(name, n, k, 0..n)
            .expect("an HF tensor")
            .iter()
            .map(|v| v.to_f32())
            .collect()
    };
    let mat = |name: &str, n: usize, k: usize| f32_bytes(hf_rows(name, n, k));
    // llama.cpp's permute: reshape(heads, 2, hd/2, k).swapaxes(1, 2), so GGUF row
    // (h, i, j) is HF row (h, j, i).
    let permuted = |name: &str, heads: usize, k: usize| {
        let n = heads * s.head_dim;
        let hf = hf_rows(name, n, k);
        let half = s.head_dim / 2;
        let mut out = Vec::with_capacity(n * k);
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    let r = h * s.head_dim + j * half + i;
                    out.extend_from_slice(&hf[r * k..(r + 1) * k]);
                }
            }
        }
        f32_bytes(out)
    };
    let vector =
        |name: &str, n: usize| f32_bytes(store.vector(name, n, 0..n).expect("an HF vector"));
    let t = |name: &str, dims: &[usize], data: Vec<u8>| Tensor {
        name: name.into(),
        dims: dims.iter().map(|&d| d as u64).collect(),
        ty: 0,
        data,
    };
    let (h, hd, e, ff) = (s.hidden, s.head_dim, x.experts, x.intermediate);
    let (q, kv) = (s.heads * hd, s.kv_heads * hd);
    let (block, [gate, up, down]) = checkpoint_names(arch);
    let mut tensors = vec![
        t(
            "token_embd.weight",
            &[h, s.vocab],
            mat("model.embed_tokens.weight", s.vocab, h),
        ),
        t("output_norm.weight", &[h], vector("model.norm.weight", h)),
    ];
    if !s.tie_word_embeddings {
        tensors.push(t(
            "output.weight",
            &[h, s.vocab],
            mat("lm_head.weight", s.vocab, h),
        ));
    }
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        let b = format!("blk.{l}");
        let (q_rows, k_rows) = if mixtral {
            (
                permuted(&format!("{p}.self_attn.q_proj.weight"), s.heads, h),
                permuted(&format!("{p}.self_attn.k_proj.weight"), s.kv_heads, h),
            )
        } else {
            (
                mat(&format!("{p}.self_attn.q_proj.weight"), q, h),
                mat(&format!("{p}.self_attn.k_proj.weight"), kv, h),
            )
        };
        tensors.extend([
            t(
                &format!("{b}.attn_norm.weight"),
                &[h],
                vector(&format!("{p}.input_layernorm.weight"), h),
            ),
            t(&format!("{b}.attn_q.weight"), &[h, q], q_rows),
            t(&format!("{b}.attn_k.weight"), &[h, kv], k_rows),
            t(
                &format!("{b}.attn_v.weight"),
                &[h, kv],
                mat(&format!("{p}.self_attn.v_proj.weight"), kv, h),
            ),
            t(
                &format!("{b}.attn_output.weight"),
                &[q, h],
                mat(&format!("{p}.self_attn.o_proj.weight"), h, q),
            ),
            t(
                &format!("{b}.ffn_norm.weight"),
                &[h],
                vector(&format!("{p}.post_attention_layernorm.weight"), h),
            ),
            t(
                &format!("{b}.ffn_gate_inp.weight"),
                &[h, e],
                mat(&format!("{p}.{block}.gate.weight"), e, h),
            ),
        ]);
        if !mixtral {
            tensors.extend([
                t(
                    &format!("{b}.attn_q_norm.weight"),
                    &[hd],
                    vector(&format!("{p}.self_attn.q_norm.weight"), hd),
                ),
                t(
                    &format!("{b}.attn_k_norm.weight"),
                    &[hd],
                    vector(&format!("{p}.self_attn.k_norm.weight"), hd),
                ),
            ]);
        }
        for (g, proj, n, k) in [
            ("ffn_gate", gate, ff, h),
            ("ffn_up", up, ff, h),
            ("ffn_down", down, h, ff),
        ] {
            let one = |i: usize| mat(&format!("{p}.{block}.experts.{i}.{proj}.weight"), n, k);
            if per_expert {
                tensors.extend((0..e).map(|i| t(&format!("{b}.{g}.{i}.weight"), &[k, n], one(i))));
            } else {
                tensors.push(t(
                    &format!("{b}.{g}_exps.weight"),
                    &[k, n, e],
                    (0..e).flat_map(one).collect(),
                ));
            }
        }
    }
    let (mut b, prefix) = if mixtral {
        (Builder::mixtral(), "llama")
    } else {
        (Builder::qwen3moe(), "qwen3moe")
    };
    b.tensors = tensors;
    for (k, v) in [
        ("block_count", u32v(s.layers as u32)),
        ("context_length", u32v(s.max_pos as u32)),
        ("embedding_length", u32v(h as u32)),
        (
            "feed_forward_length",
            u32v(if mixtral { ff } else { s.intermediate } as u32),
        ),
        ("attention.head_count", u32v(s.heads as u32)),
        ("attention.head_count_kv", u32v(s.kv_heads as u32)),
        ("attention.key_length", u32v(hd as u32)),
        ("attention.value_length", u32v(hd as u32)),
        (
            "attention.layer_norm_rms_epsilon",
            f32v(s.rms_norm_eps as f32),
        ),
        ("rope.freq_base", f32v(s.rope_theta as f32)),
        ("expert_count", u32v(e as u32)),
        ("expert_used_count", u32v(x.top_k as u32)),
    ] {
        b = b.set(&format!("{prefix}.{k}"), v);
    }
    if !mixtral {
        b = b.set("qwen3moe.expert_feed_forward_length", u32v(ff as u32));
    }
    let gguf = b.write("moe-from-hf");
    // Each loaded as the checkpoint loader loads its kind (the config and the store).
    let logits = |config: &crate::config::ModelConfig, weights: &WeightStore| {
        let backend = CpuBackend::new(std::sync::Arc::new(arbor_collective::SingleComm));
        let ctx = LoadCtx {
            backend: &backend,
            store: weights,
            rank: 0,
            tp: 1,
            row_tp: 1,
        };
        let m = crate::forward::Model::load(&ctx, config, 64).expect("the model");
        let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 250).collect();
        let mut cache = backend.kv_cache(m.kv_spec(1)).expect("a cache");
        let seqs = [SeqRows {
            row0: 0,
            len: ids.len(),
            pos0: 0,
            table0: 0,
        }];
        let rows: Vec<usize> = (0..ids.len()).collect();
        let kv = KvRows {
            seqs: &seqs,
            table: &[0],
        };
        m.forward(&backend, &mut cache, &ids, kv, &rows, None)
            .expect("forward")
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<u32>>()
    };
    let hf_config = crate::config::ModelConfig::from_dir(&dir).expect("the HF config");
    let from_hf = logits(
        &hf_config,
        &WeightStore::open(&dir).expect("the HF weights"),
    );
    let g = GgufModel::open(&gguf).expect("the GGUF file");
    assert_eq!(g.config.arch, arch);
    assert_eq!(g.config.moe, hf_config.moe, "the experts' config");
    let from_gguf = logits(&g.config, &WeightStore::gguf(g.weights));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&gguf);
    assert_eq!(from_hf.len(), 20 * s.vocab);
    (from_hf, from_gguf)
}

/// A qwen3moe file and its HF directory give bit-identical logits: the names, the
/// stacking and the metadata say what the HF directory says.
#[test]
fn a_qwen3moe_file_computes_what_its_hf_directory_does() {
    let (hf, gguf) = hf_and_gguf_logits(crate::config::Arch::Qwen3Moe, false);
    assert!(
        hf == gguf,
        "the GGUF file's logits differ from its HF directory's"
    );
}

/// A Mixtral file (`llama` with experts), stacked or one tensor per expert, and its HF
/// directory give bit-identical logits: Mixtral's names (`block_sparse_moe`, w1/w3/w2),
/// the q/k permutation and the renormalised top-k all carry over.
#[test]
fn a_mixtral_file_computes_what_its_hf_directory_does() {
    for per_expert in [false, true] {
        let (hf, gguf) = hf_and_gguf_logits(crate::config::Arch::Mixtral, per_expert);
        assert!(
            hf == gguf,
            "the GGUF file's logits differ from its HF directory's (per-expert tensors: {per_expert})"
        );
    }
}

#[test]
fn tensors_of_types_arbor_does_not_dequantize_are_named_when_read() {
    // IQ2_XXS: 256-element blocks of 66 bytes.
    let b = Builder::llama().tensor("blk.0.ffn_gate.weight", |t| {
        t.dims = vec![256, 2];
        t.ty = 16;
        t.data = vec![0; 132];
    });
    let p = b.write("iq");
    let m = GgufModel::open(&p).expect("the container is valid");
    let _ = std::fs::remove_file(&p);
    let e = m
        .weights
        .rows("model.layers.0.mlp.gate_proj.weight", 2, 256, 0..2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("IQ2_XXS") && e.contains("blk.0.ffn_gate.weight"),
        "{e}"
    );
    let e = m
        .weights
        .rows("model.layers.0.mlp.up_proj.weight", FF, 99, 0..1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("[99, 32]"),
        "{e}"
    );
}
