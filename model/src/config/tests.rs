//! The config parser against real configs of each family and generation, and its refusals.

use super::*;

#[test]
fn same_model_ignores_context_and_tokens_and_names_the_first_difference() {
    let p = in_memory_path();
    let base = ModelConfig::from_json_str(LLAMA3, &p).unwrap();
    let other = ModelConfig::from_json_str(
        &LLAMA3
            .replace("131072", "8192")
            .replace("[128001, 128008, 128009]", "128001"),
        &p,
    )
    .unwrap();
    assert_eq!(base.same_model_as(&other), Ok(()));
    for (from, to, field) in [
        (
            "\"rms_norm_eps\": 1e-05",
            "\"rms_norm_eps\": 1e-06",
            "rms_norm_eps",
        ),
        (
            "\"num_key_value_heads\": 8",
            "\"num_key_value_heads\": 4",
            "num_key_value_heads",
        ),
        ("500000.0", "10000.0", "rope_theta"),
        ("\"factor\": 8.0", "\"factor\": 4.0", "rope_scaling"),
        ("\"mlp_bias\": false", "\"mlp_bias\": true", "mlp_bias"),
    ] {
        let text = LLAMA3.replace(from, to);
        assert_ne!(text, LLAMA3, "{from}");
        let other = ModelConfig::from_json_str(&text, &p).unwrap();
        let e = base.same_model_as(&other).unwrap_err();
        assert!(e.starts_with(field), "{field}: {e}");
    }
}

/// Qwen2.5-7B-Instruct's config.json as the Hub has it (transformers 4).
const QWEN25_7B: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
  "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
  "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
  "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 152064
}"#;

#[test]
fn qwen2_has_qkv_biases_and_no_o_bias() {
    let p = in_memory_path();
    let c = ModelConfig::from_json_str(QWEN25_7B, &p).unwrap();
    assert_eq!(c.arch, Arch::Qwen2);
    assert_eq!((c.qkv_bias, c.o_bias, c.mlp_bias), (true, false, false));
    assert_eq!(
        (c.head_dim, c.num_kv_heads, c.sliding_window),
        (128, 4, None)
    );
    assert_eq!(c.rope_theta, 1e6);
    // The window slides from layer 2 on: layers 2.. need a context the window covers.
    let sliding = QWEN25_7B
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        )
        .replace("\"max_window_layers\": 28", "\"max_window_layers\": 2");
    let c = ModelConfig::from_json_str(&sliding, &p).unwrap();
    assert_eq!(c.sliding_window, Some(131072));
    // attention_bias is Llama's key: on a Qwen2 config it says something Qwen2 cannot.
    let text = QWEN25_7B.replace("\"use_cache\"", "\"attention_bias\": true, \"use_cache\"");
    let e = ModelConfig::from_json_str(&text, &p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention_bias") && e.contains("Qwen2"), "{e}");
    // A model type of another family is refused.
    let e = ModelConfig::from_json_str(&QWEN25_7B.replace("\"qwen2\"", "\"qwen3\""), &p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model_type"), "{e}");
}

const LLAMA3: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "max_position_embeddings": 131072, "tie_word_embeddings": false, "hidden_act": "silu",
  "attention_bias": false, "mlp_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
}"#;

const QWEN3: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
  "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
  "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
  "max_position_embeddings": 40960, "tie_word_embeddings": false, "attention_bias": false,
  "bos_token_id": 151643, "eos_token_id": 151645, "rope_scaling": null,
  "sliding_window": null, "use_sliding_window": false
}"#;

fn parse(s: &str) -> MResult<ModelConfig> {
    ModelConfig::from_json_str(s, &in_memory_path())
}

#[test]
fn llama3_with_rope_scaling_and_eos_list() {
    let c = parse(LLAMA3).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.num_kv_heads, 8);
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(c.bos_token_id, Some(128000));
    let Some(RopeScaling::Llama3(s)) = c.rope_scaling else {
        panic!("llama3 scaling expected, got {:?}", c.rope_scaling)
    };
    assert_eq!(s.factor, 8.0);
    assert_eq!(s.original_max_position_embeddings, 8192);
}

#[test]
fn an_absurd_layer_count_is_refused_before_it_sizes_anything() {
    // Found by fuzz_parsers: a derived per-layer list of 10^15 entries ran out of memory.
    let s = QWEN3.replace(
        "\"num_hidden_layers\": 36",
        "\"num_hidden_layers\": 1000000000000000",
    );
    let e = parse(&s).unwrap_err().to_string();
    assert!(
        e.contains("num_hidden_layers 1000000000000000 is beyond"),
        "{e}"
    );
}

#[test]
fn an_absurd_context_length_is_refused_by_name_before_it_sizes_anything() {
    // 2^32 − 1 positions once sized a RoPE table of 137 GB, and the process aborted.
    let s = QWEN3.replace(
        "\"max_position_embeddings\": 40960",
        "\"max_position_embeddings\": 4294967295",
    );
    let e = parse(&s).unwrap_err().to_string();
    assert!(
        e.contains("\"max_position_embeddings\" 4294967295 is beyond"),
        "{e}"
    );
    let at_bound = QWEN3.replace("40960", &MAX_POSITIONS.to_string());
    assert_eq!(
        parse(&at_bound).unwrap().max_position_embeddings,
        MAX_POSITIONS
    );
    let e = parse(&LLAMA3.replace(
        "\"original_max_position_embeddings\": 8192",
        "\"original_max_position_embeddings\": 4294967295",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("\"original_max_position_embeddings\" 4294967295"),
        "{e}"
    );
}

#[test]
fn float_fields_out_of_range_are_refused_by_name() {
    for (from, to, needle) in [
        (
            "\"rms_norm_eps\": 1e-05",
            "\"rms_norm_eps\": 1e300",
            "\"rms_norm_eps\" 1e+300",
        ),
        (
            "\"rms_norm_eps\": 1e-05",
            "\"rms_norm_eps\": -1e-05",
            "\"rms_norm_eps\" -0.00001",
        ),
        (
            "\"rms_norm_eps\": 1e-05",
            "\"rms_norm_eps\": 2.0",
            "\"rms_norm_eps\" 2.0",
        ),
        (
            "500000.0",
            "0.5",
            "rope_theta must be finite and > 1, got 0.5",
        ),
        (
            "500000.0",
            "-3",
            "rope_theta must be finite and > 1, got -3",
        ),
        (
            "\"factor\": 8.0",
            "\"factor\": -8.0",
            "llama3 scaling parameter factor is invalid: -8",
        ),
        (
            "\"high_freq_factor\": 4.0",
            "\"high_freq_factor\": 0.5",
            "high_freq_factor is invalid: 0.5",
        ),
    ] {
        let s = LLAMA3.replace(from, to);
        assert_ne!(s, LLAMA3, "{from}");
        let e = parse(&s).unwrap_err().to_string();
        assert!(e.contains(needle), "{to}: {e}");
    }
    // A number too large for f64 is not JSON serde_json reads as a number.
    let e = parse(&LLAMA3.replace("500000.0", "1e400"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn qwen3_head_dim_and_scalar_eos() {
    let c = parse(QWEN3).unwrap();
    assert_eq!(c.arch, Arch::Qwen3);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.eos_token_ids, vec![151645]);
    assert!(c.rope_scaling.is_none());
    assert_eq!(c.rope_theta, 1e6);
}

#[test]
fn mistral_is_llama_shaped() {
    let s = LLAMA3.replace("LlamaForCausalLM", "MistralForCausalLM");
    assert_eq!(parse(&s).unwrap().arch, Arch::Llama);
    let s = s.replace(
        "\"mlp_bias\": false",
        "\"mlp_bias\": false, \"sliding_window\": 4096",
    );
    let c = parse(&s).unwrap();
    assert_eq!(c.sliding_window, Some(4096));
    c.check_context(4096, &in_memory_path()).unwrap();
    let e = c
        .check_context(4097, &in_memory_path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needs sliding_window 4096") && e.contains("--max-seq-len 4096"),
        "{e}"
    );
}

#[test]
fn unknown_keys_are_refused_by_name_unless_allowed() {
    let s = LLAMA3.replace(
        "\"mlp_bias\": false",
        "\"mlp_bias\": false, \"logit_scale\": 0.5",
    );
    let e = parse(&s).unwrap_err().to_string();
    assert!(e.contains("unknown key \"logit_scale\""), "{e}");
    assert!(e.contains(ALLOW_ENV), "{e}");
    let c = ModelConfig::from_json_str_allowing(&s, &in_memory_path(), &["logit_scale".into()])
        .unwrap();
    assert_eq!(c, parse(LLAMA3).unwrap());
    // Keys that change the math are refused value by value, allowed or not.
    for (key, value) in [
        ("quantization_config", r#"{"quant_method": "awq"}"#),
        ("partial_rotary_factor", "0.5"),
        ("hidden_act", "\"gelu\""),
        ("dtype", "\"float8_e4m3fn\""),
        ("model_type", "\"qwen2\""),
        ("is_encoder_decoder", "true"),
    ] {
        let s = LLAMA3.replace(
            "\"mlp_bias\": false",
            &format!("\"mlp_bias\": false, \"{key}\": {value}"),
        );
        let e = parse(&s).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
}

#[test]
fn rope_parameters_equal_their_legacy_twin() {
    let v5 = LLAMA3
        .replace("\"rope_theta\": 500000.0,", "")
        .replace("\"rope_scaling\"", "\"rope_parameters\"")
        .replace(
            "\"rope_type\": \"llama3\"",
            "\"rope_type\": \"llama3\", \"rope_theta\": 500000.0",
        );
    assert_eq!(parse(&v5).unwrap(), parse(LLAMA3).unwrap());
    // Both forms present and disagreeing: refused, naming both.
    let both = LLAMA3.replace(
        "\"mlp_bias\": false",
        "\"mlp_bias\": false, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0}",
    );
    let e = parse(&both).unwrap_err().to_string();
    assert!(
        e.contains("rope_parameters") && e.contains("rope_scaling"),
        "{e}"
    );
    // A rope key arbor does not know, inside a known type.
    let e = parse(&LLAMA3.replace("\"low_freq_factor\"", "\"low_frequency_factor\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("low_frequency_factor"), "{e}");
}

#[test]
fn per_layer_type_rope_parameters() {
    let nested = QWEN3
        .replace("\"rope_theta\": 1000000,", "")
        .replace(
            "\"rope_scaling\": null",
            "\"layer_types\": [FULL], \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0}}",
        )
        .replace("FULL", &vec!["\"full_attention\""; 36].join(","));
    assert_eq!(parse(&nested).unwrap(), parse(QWEN3).unwrap());
    let e = parse(&nested.replace("\"full_attention\": {", "\"sliding_attention\": {"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no entry for layer type \"full_attention\""),
        "{e}"
    );
}

#[test]
fn errors_name_the_problem() {
    let e = parse(&LLAMA3.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap_err();
    assert!(matches!(e, ModelError::UnknownArch { ref arch, .. } if arch == "GPT2LMHeadModel"));
    let e = parse(&LLAMA3.replace("\"hidden_size\": 4096,", ""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing field \"hidden_size\""), "{e}");
    let e = parse(&LLAMA3.replace("\"hidden_size\": 4096", "\"hidden_size\": \"big\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden_size"), "{e}");
    let e = parse("{ not json").unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
    let e = parse(&LLAMA3.replace("\"llama3\"", "\"longrope\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("longrope"), "{e}");
    let e = parse(&LLAMA3.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_key_value_heads 5"), "{e}");
    let e = parse(&LLAMA3.replace(
        "\"eos_token_id\": [128001, 128008, 128009]",
        "\"eos_token_id\": [-1]",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("eos_token_id"), "{e}");
}

/// Qwen3-30B-A3B's config.json as the Hub has it (transformers 4).
const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
}"#;

/// Mixtral-8x7B's config.json as the Hub has it.
const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
}"#;

#[test]
fn moe_configs_of_both_families_read_their_experts() {
    let p = in_memory_path();
    let q = ModelConfig::from_json_str(QWEN3_30B_A3B, &p).unwrap();
    assert_eq!(q.arch, Arch::Qwen3Moe);
    let m = q.moe.clone().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_intermediate,
            m.norm_topk_prob
        ),
        (128, 8, 768, true)
    );
    assert!(m.sparse_layers.iter().all(|&s| s) && m.sparse_layers.len() == 48);
    // transformers 5's name for the expert count reads the same.
    let v5 = QWEN3_30B_A3B.replace("\"num_experts\"", "\"num_local_experts\"");
    assert_eq!(ModelConfig::from_json_str(&v5, &p).unwrap().moe, q.moe);
    // Dense layers: mlp_only_layers and decoder_sparse_step.
    let some = QWEN3_30B_A3B
        .replace("\"mlp_only_layers\": []", "\"mlp_only_layers\": [0, 5]")
        .replace("\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2");
    let s = ModelConfig::from_json_str(&some, &p)
        .unwrap()
        .moe
        .unwrap()
        .sparse_layers;
    assert_eq!(
        &s[..8],
        &[false, true, false, true, false, false, false, true]
    );
    // Every expert counts among the weights: the published non-embedding sizes, 29.9 B
    // (Qwen3-30B-A3B's model card) and 46.4 B (Mixtral-8x7B's 46.7 B less its two 32000 ×
    // 4096 embeddings).
    let billions = |c: &ModelConfig| c.matrix_params() as f64 / 1e9;
    assert!((29.85..29.95).contains(&billions(&q)), "{}", billions(&q));
    let mixtral = ModelConfig::from_json_str(MIXTRAL_8X7B, &p).unwrap();
    assert!(
        (46.35..46.5).contains(&billions(&mixtral)),
        "{}",
        billions(&mixtral)
    );
    let x = ModelConfig::from_json_str(MIXTRAL_8X7B, &p).unwrap();
    assert_eq!(x.arch, Arch::Mixtral);
    let m = x.moe.unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_intermediate,
            m.norm_topk_prob
        ),
        (8, 2, 14336, true)
    );
    // Refusals name the key.
    for (from, to, needle) in [
        (
            "\"num_experts_per_tok\": 8",
            "\"num_experts_per_tok\": 129",
            "num_experts_per_tok",
        ),
        (
            "\"num_experts\": 128",
            "\"num_experts\": 128, \"num_local_experts\": 64",
            "disagree",
        ),
        (
            "\"mlp_only_layers\": []",
            "\"mlp_only_layers\": [48]",
            "mlp_only_layers",
        ),
        (
            "\"decoder_sparse_step\": 1",
            "\"decoder_sparse_step\": 0",
            "decoder_sparse_step",
        ),
    ] {
        let text = QWEN3_30B_A3B.replace(from, to);
        assert_ne!(text, QWEN3_30B_A3B, "{from}");
        let e = ModelConfig::from_json_str(&text, &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    // An expert key in a dense config says something arbor would not implement.
    let e = ModelConfig::from_json_str(
        &QWEN3_30B_A3B
            .replace("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
            .replace("qwen3_moe", "qwen3"),
        &p,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("mixture-of-experts"), "{e}");
}
