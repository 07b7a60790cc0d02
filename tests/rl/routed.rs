//! SGLang's `return_routed_experts` on `/generate`, read as slime reads it
//! (`slime/utils/types.py` `Sample._apply_meta_info` and `slime/utils/misc.py`
//! `decode_int32_meta_array`, THUDM/slime): `meta_info["routed_experts"]` is base64 of
//! little-endian int32 `[len(tokens) - 1 - routed_experts_start_len, num_layers, topk]`,
//! `tokens` the prompt and the output. The buffer is SGLang's
//! (`python/sglang/srt/layers/moe/routed_experts_capturer.py`: zeros where a layer has no
//! experts). The experts must be the same at TP 1 and 2, alone and in a batch, and when the
//! whole sequence is fed again as one prompt; asking must not change a bit of the tokens.

use std::sync::OnceLock;

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::server::Server;

/// The tiny Qwen3-MoE: (dir, layers, top_k, experts, which layers have experts).
struct Moe {
    dir: std::path::PathBuf,
    layers: usize,
    top_k: usize,
    experts: u32,
    sparse: Vec<bool>,
}

fn moe() -> &'static Moe {
    static M: OnceLock<Moe> = OnceLock::new();
    M.get_or_init(|| {
        let dir = shared_tiny("rl-moe", "qwen3-moe");
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).expect("config.json"),
        )
        .expect("config JSON");
        let n = |k: &str| cfg[k].as_u64().unwrap_or_else(|| panic!("{k} in {cfg}")) as usize;
        let layers = n("num_hidden_layers");
        let dense: Vec<u64> = cfg["mlp_only_layers"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let step = cfg["decoder_sparse_step"].as_u64().unwrap_or(1).max(1);
        let sparse = (0..layers as u64)
            .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
            .collect();
        Moe {
            layers,
            top_k: n("num_experts_per_tok"),
            experts: n("num_experts") as u32,
            sparse,
            dir,
        }
    })
}

/// RFC 4648 base64, as Python's `base64.b64decode` reads it.
fn b64decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a') as u32 + 26,
            b'0'..=b'9' => (c - b'0') as u32 + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?} in {s}"),
        }
    };
    assert_eq!(s.len() % 4, 0, "padded base64: {s}");
    let mut out = Vec::new();
    for q in s.as_bytes().chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = q[..4 - pad]
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | val(c) << (18 - 6 * i));
        out.extend(&n.to_be_bytes()[1..4 - pad]);
    }
    out
}

/// `meta_info.routed_experts` as slime decodes it: `[rows, layers, top_k]` rows, each
/// checked against the model (a layer with experts: `top_k` distinct ids below the expert
/// count, in increasing order; one without: zeros).
fn routes(item: &Value) -> Vec<Vec<i32>> {
    let m = moe();
    let s = item["meta_info"]["routed_experts"]
        .as_str()
        .unwrap_or_else(|| panic!("routed_experts in {item}"));
    let bytes = b64decode(s);
    assert_eq!(bytes.len() % 4, 0);
    let ids: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let per = m.layers * m.top_k;
    assert_eq!(ids.len() % per, 0, "{} values for rows of {per}", ids.len());
    let rows: Vec<Vec<i32>> = ids.chunks(per).map(<[i32]>::to_vec).collect();
    for (r, row) in rows.iter().enumerate() {
        for (l, e) in row.chunks(m.top_k).enumerate() {
            if m.sparse[l] {
                assert!(
                    e.windows(2).all(|w| w[0] < w[1])
                        && e.iter().all(|&x| (0..m.experts as i32).contains(&x)),
                    "row {r} layer {l}: {e:?}"
                );
            } else {
                assert!(e.iter().all(|&x| x == 0), "dense layer {l}: {e:?}");
            }
        }
    }
    rows
}

fn output_ids(item: &Value) -> Vec<u32> {
    item["output_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("output_ids in {item}"))
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

/// (ids, log-prob bits) of the output.
fn bits(item: &Value) -> Vec<(u64, u64)> {
    item["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("output_token_logprobs in {item}"))
        .iter()
        .map(|e| {
            (
                e[1].as_u64().expect("id"),
                e[0].as_f64().expect("lp").to_bits(),
            )
        })
        .collect()
}

const A: [u32; 6] = [5, 17, 101, 42, 7, 230];
const B: [u32; 9] = [9, 3, 77, 18, 250, 6, 61, 4, 12];
const NEW: usize = 8;

fn body(ids: Value, routed: bool) -> Value {
    json!({
        "input_ids": ids,
        "sampling_params": {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": NEW,
                            "sampling_seed": 7, "ignore_eos": true},
        "return_logprob": true,
        "return_routed_experts": routed,
    })
}

#[test]
fn routed_experts_as_sglang_returns_them_at_tp1_and_tp2() {
    let m = moe();
    let s1 = Server::start(1, &m.dir, &[], "routed-tp1");
    let one = s1.ok("/generate", &body(json!(A), true));
    let plain = s1.ok("/generate", &body(json!(A), false));
    assert!(
        plain["meta_info"].get("routed_experts").is_none(),
        "{plain}"
    );
    assert_eq!(bits(&one), bits(&plain), "asking changed the tokens");
    let out = output_ids(&one);
    assert_eq!(out.len(), NEW);
    let r1 = routes(&one);
    // Every position the forward ran: the prompt and the output but its last token.
    assert_eq!(r1.len(), A.len() + NEW - 1);
    // The rows route apart (the check below would hold for a constant too).
    assert!(r1.iter().any(|r| r != &r1[0]), "{r1:?}");

    // The whole sequence fed again as one prompt (one prefill instead of decode steps):
    // its positions route alike.
    let full: Vec<u32> = A.iter().copied().chain(out.iter().copied()).collect();
    let again = s1.ok(
        "/generate",
        &json!({"input_ids": full, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_routed_experts": true}),
    );
    let ra = routes(&again);
    assert_eq!(ra.len(), full.len());
    assert_eq!(ra[..r1.len()], r1[..], "prefill and decode routed apart");

    // From a start position (SGLang's routed_experts_start_len): the rows from there.
    let mut from = body(json!(A), true);
    from["routed_experts_start_len"] = json!(3);
    let part = s1.ok("/generate", &from);
    assert_eq!(routes(&part), r1[3..].to_vec());
    from["routed_experts_start_len"] = json!(A.len() + 1);
    let (status, v) = s1.post("/generate", &from);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "routed_experts_start_len", "{v}");
    drop(s1);

    // TP 2, alone and second in a batch with another prompt: the same experts and tokens.
    let s2 = Server::start(2, &m.dir, &[], "routed-tp2");
    let two = s2.ok("/generate", &body(json!(A), true));
    assert_eq!(bits(&two), bits(&one));
    assert_eq!(routes(&two), r1, "TP 2 routed apart from TP 1");
    // A batch's item i draws with sample key i: A first draws as A alone.
    let batch = s2.ok("/generate", &body(json!([A.to_vec(), B.to_vec()]), true));
    let items = batch
        .as_array()
        .unwrap_or_else(|| panic!("a list: {batch}"));
    assert_eq!(items.len(), 2);
    let a_item = items.iter().find(|i| i["index"] == 0).expect("item 0");
    let b_item = items.iter().find(|i| i["index"] == 1).expect("item 1");
    assert_eq!(bits(a_item), bits(&one));
    assert_eq!(routes(a_item), r1, "a batch routed apart");
    // B's positions route as the same sequence fed whole, alone.
    let b_full: Vec<u32> = B.iter().copied().chain(output_ids(b_item)).collect();
    let alone = s2.ok(
        "/generate",
        &json!({"input_ids": b_full, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_routed_experts": true}),
    );
    let rb = routes(b_item);
    assert_eq!(rb.len(), B.len() + NEW - 1);
    assert_eq!(routes(&alone)[..rb.len()], rb[..]);
}

#[test]
fn a_dense_model_refuses_routed_experts_naming_the_field() {
    let dense = shared_tiny("rl-routed-dense", "llama");
    let s = Server::start(1, &dense, &[], "routed-dense");
    let (status, v) = s.post("/generate", &body(json!(A), true));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "return_routed_experts", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("no experts"), "{v}");
    // false is taken, as SGLang's default.
    let ok = s.ok("/generate", &body(json!(A), false));
    assert_eq!(output_ids(&ok).len(), NEW);
}
