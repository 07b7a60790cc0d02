//! Which config.json keys arbor knows. A key outside these lists may change the model's
//! math in a way arbor does not implement, so it is refused rather than ignored.

/// Keys whose values arbor reads and implements (or refuses value by value); the
/// mixture-of-experts ones are `moe::KEYS`.
pub const MATH: &[&str] = &[
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "pruned_heads",
    "is_encoder_decoder",
    "add_cross_attention",
];

/// Keys that do not change inference: provenance, training-only settings (dropout,
/// initialisation, HF's sliced-matmul `pretraining_tp`, which computes the same products)
/// and the generation defaults transformers 4 also wrote into config.json (arbor takes
/// sampling settings from the request and generation_config.json).
pub const INERT: &[&str] = &[
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "_commit_hash",
    "auto_map",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
    "hidden_dropout",
    "mlp_dropout",
    "embd_pdrop",
    "resid_pdrop",
    "pretraining_tp",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "return_dict",
    "return_dict_in_generate",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "chunk_size_feed_forward",
    "is_decoder",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "finetuning_task",
    "id2label",
    "label2id",
    "num_labels",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "problem_type",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// The environment variable naming extra keys a user vouches are harmless
/// (comma-separated); they are ignored with a warning.
pub const ALLOW_ENV: &str = "ARBOR_ALLOW_CONFIG_KEYS";

/// Keys of `obj` that are neither read nor known to be inert nor allowed by the user,
/// in file order.
pub fn unknown<'a>(
    obj: &'a serde_json::Map<String, serde_json::Value>,
    allowed: &[String],
) -> Vec<&'a str> {
    obj.keys()
        .map(String::as_str)
        .filter(|k| {
            !MATH.contains(k)
                && !super::moe::KEYS.contains(k)
                && !INERT.contains(k)
                && !allowed.iter().any(|a| a == k)
        })
        .collect()
}

/// The user's allow-list from [`ALLOW_ENV`].
pub fn allowed_from_env() -> Vec<String> {
    std::env::var(ALLOW_ENV)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}
