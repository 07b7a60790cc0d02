//! The tokenizer a GGUF file carries, rebuilt as the `tokenizer.json` and
//! `tokenizer_config.json` transformers would use for the same model: the vocabulary and
//! merges, the special tokens, the pre-tokenizer `tokenizer.ggml.pre` names, BOS/EOS
//! handling and the chat template. Two kinds: byte-level BPE (`tokenizer.ggml.model`
//! "gpt2") and SentencePiece BPE ("llama", whose merges come from the pieces' scores as
//! transformers' converter derives them).

use std::path::Path;

use serde_json::{json, Map, Value};

use super::reader::{GgufFile, MetaValue};
use crate::error::{MResult, ModelError};
use crate::tokenizer_config::TokenizerConfig;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;
const TOKEN_BYTE: i64 = 6;

/// GPT-2's pre-tokenizer regex (what `ByteLevel { use_regex: true }` applies).
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's (`tokenizer.ggml.pre` "llama-bpe").
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2/2.5/3's (`tokenizer.ggml.pre` "qwen2").
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values arbor rebuilds, for messages.
pub const SUPPORTED_PRE: &str = "gpt-2, smollm, starcoder, llama-bpe (llama3, llama-v3), qwen2";

/// How one tokenizer family is rebuilt, beyond the vocabulary: what tokenizer.json says
/// around its BPE model.
struct Family {
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// The post-processor when no BOS/EOS is added.
    post_processor: Value,
    /// `unk_token`, `fuse_unk`, `byte_fallback`, `ignore_merges` of the BPE model.
    unk_token: Option<String>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    merges: Value,
    default_add_bos: bool,
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// A byte-level BPE family named by `tokenizer.ggml.pre`; None if arbor does not know it.
fn byte_level_family(name: &str, merges: Value) -> Option<Family> {
    let plain = |pre: Value| Family {
        normalizer: Value::Null,
        pre_tokenizer: pre,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        post_processor: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        unk_token: None,
        fuse_unk: false,
        byte_fallback: false,
        ignore_merges: false,
        merges: merges.clone(),
        default_add_bos: false,
    };
    Some(match name {
        "gpt-2" | "gpt2" => plain(byte_level(true)),
        // Digits one by one, then GPT-2's split (SmolLM, StarCoder).
        "smollm" | "starcoder" => plain(json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]})),
        "llama-bpe" | "llama3" | "llama-v3" => Family {
            ignore_merges: true,
            default_add_bos: true,
            ..plain(
                json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]}),
            )
        },
        "qwen2" => Family {
            normalizer: json!({"type": "NFC"}),
            ..plain(
                json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
            )
        },
        _ => return None,
    })
}

/// SentencePiece BPE as transformers' `LlamaConverter` writes it ("legacy" Llama 2 /
/// Mistral): a "▁" before the text, spaces as "▁", unknown bytes as `<0xXX>` pieces.
fn sentencepiece_family(merges: Value, unk: Option<String>, byte_fallback: bool) -> Family {
    Family {
        normalizer: json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]}),
        pre_tokenizer: Value::Null,
        decoder: json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
        post_processor: Value::Null,
        unk_token: unk,
        fuse_unk: true,
        byte_fallback,
        ignore_merges: false,
        merges,
        default_add_bos: true,
    }
}

/// The GPT-2 regex, for tests that re-implement the split independently.
pub fn gpt2_regex() -> &'static str {
    GPT2_REGEX
}

/// What the file's tokenizer metadata rebuilds to.
pub struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub config: TokenizerConfig,
    /// tokenizer.json and tokenizer_config.json as transformers would have them.
    pub tokenizer_json: Value,
    pub tokenizer_config_json: Value,
}

fn err(path: &Path, msg: String) -> ModelError {
    ModelError::Tokenizer {
        path: path.to_path_buf(),
        msg,
    }
}

/// The file's tokenizer; None when it has none (`tokenizer.ggml.model` absent or
/// "none"), in which case prompts must be token ids.
pub fn read(f: &GgufFile, vocab_size: usize) -> MResult<Option<GgufTokenizer>> {
    let path = &f.path;
    let model = match f.get("tokenizer.ggml.model") {
        None => return Ok(None),
        Some(v) => v.as_str().ok_or_else(|| {
            err(
                path,
                format!("tokenizer.ggml.model is {}, not a string", v.brief()),
            )
        })?,
    };
    let strings = |key: &str| -> MResult<Vec<&str>> {
        let a = f
            .get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| err(path, format!("{key} is missing or not an array")))?;
        a.iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    err(
                        path,
                        format!("{key} holds a {}, not strings", v.type_name()),
                    )
                })
            })
            .collect()
    };
    let flag = |key: &str| -> MResult<Option<bool>> {
        match f.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| err(path, format!("{key} is {}, not a bool", v.brief()))),
        }
    };
    if !matches!(model, "gpt2" | "llama") {
        return match model {
            "none" | "no_vocab" => Ok(None),
            other => Err(err(
                path,
                format!("tokenizer.ggml.model {other:?} is not supported (byte-level BPE \"gpt2\" and SentencePiece BPE \"llama\" are)"),
            )),
        };
    }
    let tokens = strings("tokenizer.ggml.tokens")?;
    if tokens.len() > vocab_size {
        return Err(err(
            path,
            format!(
                "{} tokens but the model's vocabulary has {vocab_size} rows",
                tokens.len()
            ),
        ));
    }
    let types: Vec<i64> = match f.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => {
            let a = v
                .as_array()
                .filter(|a| a.len() == tokens.len())
                .ok_or_else(|| {
                    err(
                        path,
                        format!(
                            "tokenizer.ggml.token_type is {}, not one type per token ({})",
                            v.brief(),
                            tokens.len()
                        ),
                    )
                })?;
            a.iter()
                .map(|t| {
                    t.as_i64().ok_or_else(|| {
                        err(path, "tokenizer.ggml.token_type holds a non-integer".into())
                    })
                })
                .collect::<MResult<_>>()?
        }
    };
    let family = if model == "gpt2" {
        // A vocabulary of single bytes has no merges, and writers then leave the key out.
        let merges = match f.get("tokenizer.ggml.merges") {
            None => Vec::new(),
            Some(_) => strings("tokenizer.ggml.merges")?,
        };
        let name = f
            .get("tokenizer.ggml.pre")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| err(path, "a gpt2 tokenizer without tokenizer.ggml.pre: arbor cannot tell how it splits text".into()))?;
        byte_level_family(name, json!(merges)).ok_or_else(|| {
            err(
                path,
                format!("tokenizer.ggml.pre {name:?} is not a pre-tokenizer arbor rebuilds (supported: {SUPPORTED_PRE})"),
            )
        })?
    } else {
        for key in [
            "tokenizer.ggml.precompiled_charsmap",
            "tokenizer.ggml.merges",
        ] {
            if f.get(key).is_some() {
                return Err(err(
                    path,
                    format!("a SentencePiece tokenizer with {key}: not supported"),
                ));
            }
        }
        for (key, want) in [
            ("tokenizer.ggml.add_space_prefix", true),
            ("tokenizer.ggml.remove_extra_whitespaces", false),
        ] {
            if flag(key)?.is_some_and(|v| v != want) {
                return Err(err(path, format!("{key} = {}: arbor rebuilds SentencePiece tokenizers with {key} = {want} only", !want)));
            }
        }
        let scores: Vec<f32> = match f.get("tokenizer.ggml.scores").and_then(MetaValue::as_array) {
            // The scores rank the merges: a NaN or infinite one would rank them arbitrarily.
            Some(a) if a.len() == tokens.len() => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64()
                        .map(|x| x as f32)
                        .filter(|x| x.is_finite())
                        .ok_or_else(|| {
                            err(
                                path,
                                format!(
                                    "tokenizer.ggml.scores[{i}] is {}: every score must be a finite number",
                                    v.brief()
                                ),
                            )
                        })
                })
                .collect::<MResult<_>>()?,
            _ => {
                return Err(err(
                    path,
                    format!(
                        "a SentencePiece tokenizer needs tokenizer.ggml.scores, one per token ({})",
                        tokens.len()
                    ),
                ))
            }
        };
        let unk = match f
            .get("tokenizer.ggml.unknown_token_id")
            .and_then(MetaValue::as_u64)
        {
            Some(id) => Some(
                tokens
                    .get(id as usize)
                    .ok_or_else(|| {
                        err(
                            path,
                            format!(
                                "tokenizer.ggml.unknown_token_id {id} is outside the {} tokens",
                                tokens.len()
                            ),
                        )
                    })?
                    .to_string(),
            ),
            None => types
                .iter()
                .position(|&t| t == TOKEN_UNKNOWN)
                .map(|i| tokens[i].to_string()),
        };
        let byte_fallback = types.contains(&TOKEN_BYTE);
        sentencepiece_family(super::spm::merges(&tokens, &scores), unk, byte_fallback)
    };
    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.contains_key(tok) {
            tracing::warn!(gguf = %path.display(), token = tok, id, "token listed twice; the first id is the one text encodes to");
            continue;
        }
        vocab.insert(tok.to_string(), json!(id));
        if matches!(ty, TOKEN_UNKNOWN | TOKEN_CONTROL | TOKEN_USER_DEFINED) {
            added.push(
                json!({"id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != TOKEN_USER_DEFINED}),
            );
        }
    }
    let token_of = |key: &str| -> MResult<Option<(u32, String)>> {
        let Some(v) = f.get(key) else { return Ok(None) };
        let id = v
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| err(path, format!("{key} is {}, not a token id", v.brief())))?;
        let tok = tokens.get(id as usize).ok_or_else(|| {
            err(
                path,
                format!("{key} {id} is outside the {} tokens", tokens.len()),
            )
        })?;
        Ok(Some((id, tok.to_string())))
    };
    let bos = token_of("tokenizer.ggml.bos_token_id")?;
    let eos = token_of("tokenizer.ggml.eos_token_id")?;
    let pad = token_of("tokenizer.ggml.padding_token_id")?;
    let add_bos = flag("tokenizer.ggml.add_bos_token")?.unwrap_or(family.default_add_bos);
    let add_eos = flag("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let special = |t: &(u32, String)| json!({"SpecialToken": {"id": t.1, "type_id": 0}});
    let post_processor = match (
        bos.as_ref().filter(|_| add_bos),
        eos.as_ref().filter(|_| add_eos),
    ) {
        (None, None) => family.post_processor.clone(),
        (b, e) => {
            let mut single = Vec::new();
            let mut specials = Map::new();
            for t in [b, e].into_iter().flatten() {
                specials.insert(
                    t.1.clone(),
                    json!({"id": t.1, "ids": [t.0], "tokens": [t.1]}),
                );
            }
            single.extend(b.map(special));
            single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
            single.extend(e.map(special));
            let mut pair = single.clone();
            pair.extend(b.map(special));
            pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
            pair.extend(e.map(special));
            json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
        }
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": family.normalizer,
        "pre_tokenizer": family.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": family.decoder,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": family.unk_token, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": family.fuse_unk, "byte_fallback": family.byte_fallback,
            "ignore_merges": family.ignore_merges, "vocab": vocab, "merges": family.merges,
        }
    });
    let tokenizer: tokenizers::Tokenizer = tokenizer_json
        .to_string()
        .parse()
        .map_err(|e| err(path, format!("the rebuilt tokenizer does not load: {e}")))?;
    let mut tc = Map::new();
    for (key, t) in [
        ("bos_token", &bos),
        ("eos_token", &eos),
        ("pad_token", &pad),
    ] {
        if let Some((_, s)) = t {
            tc.insert(key.into(), json!(s));
        }
    }
    tc.insert("add_bos_token".into(), json!(add_bos));
    tc.insert("add_eos_token".into(), json!(add_eos));
    match f.get("tokenizer.chat_template") {
        None => {}
        Some(MetaValue::String(s)) => {
            tc.insert("chat_template".into(), json!(s));
        }
        Some(v) => {
            return Err(err(
                path,
                format!("tokenizer.chat_template is {}, not a string", v.brief()),
            ))
        }
    }
    let tokenizer_config_json = Value::Object(tc);
    let mut config = TokenizerConfig::from_json_str(&tokenizer_config_json.to_string(), path)?;
    if config.chat_template.is_some() {
        config.chat_template_source = Some(format!("{} (tokenizer.chat_template)", path.display()));
    }
    Ok(Some(GgufTokenizer {
        tokenizer,
        config,
        tokenizer_json,
        tokenizer_config_json,
    }))
}
