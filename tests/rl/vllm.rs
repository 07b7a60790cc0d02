//! vLLM's token-in, token-out `/inference/v1/generate` and its weight-transfer routes,
//! replayed as SkyRL's and prime-rl's clients send them (the file each body comes from is
//! named beside it), against `arbor serve` at TP 2 on CPU ranks: what the client reads back
//! is there and equals `/v1/completions` bit for bit; the weight-transfer bodies are
//! checked field by field; the group is joined vLLM style through a real PyTorch
//! `TCPStore` (CPU ranks then refuse, saying which id they read). The packed layout's
//! arithmetic is unit-tested in `model/src/batching/packed.rs`; the NCCL receive itself
//! runs on GPUs (`scripts/gpu/rendezvous-check.sh packed`).

use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::cli_support::{free_port, python_has};
use crate::rendezvous::Trainer;
use crate::server::Server;

const PROMPT: [u32; 7] = [5, 17, 101, 42, 7, 230, 11];

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list of ids: {v}"))
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect()
}

fn bits(v: &Value) -> u32 {
    (v.as_f64().expect("a finite log-prob") as f32).to_bits()
}

fn model_id(s: &Server) -> String {
    let (st, v) = s.call("GET", "/v1/models", None);
    assert_eq!(st, 200, "{v}");
    v["data"][0]["id"].as_str().expect("model id").to_string()
}

#[test]
fn skyrl_and_prime_rl_generate_at_tp2_equal_completions() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "vllm-gen");
    let model = model_id(&s);

    // skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py
    // (NovaSky-AI/SkyRL), `_generate_single`: {"sampling_params", "model", "token_ids"},
    // with sampling params from `get_vllm_sampling_params`
    // (skyrl/backends/skyrl_train/inference_engines/utils.py: `min_tokens: 1` always) and
    // a trainer's seed.
    let skyrl = json!({
        "sampling_params": {
            "min_tokens": 1, "skip_special_tokens": true, "include_stop_str_in_output": true,
            "max_tokens": 10, "temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "logprobs": 0, "stop": null, "seed": 42,
        },
        "model": model,
        "token_ids": PROMPT,
    });
    let g = s.ok("/inference/v1/generate", &skyrl);
    // What SkyRL reads: choices[0].token_ids, .finish_reason, .logprobs.content[*].logprob.
    let choice = &g["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{g}");
    let out = ids(&choice["token_ids"]);
    assert_eq!(out.len(), 10, "{g}");
    let content = choice["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("logprobs.content in {g}"));
    assert_eq!(content.len(), 10);
    for (c, id) in content.iter().zip(&out) {
        assert_eq!(c["token"], format!("token_id:{id}"), "{c}");
        // logprobs 0: the sampled token alone among the alternatives.
        let top = c["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 1, "{c}");
        assert_eq!(bits(&top[0]["logprob"]), bits(&c["logprob"]));
    }
    assert_eq!(g["usage"]["prompt_tokens"], PROMPT.len());
    assert_eq!(g["usage"]["completion_tokens"], 10);
    assert_eq!(g["prompt_logprobs"], Value::Null);
    // The same prompt and sampling on /v1/completions: the same ids and log-prob bits.
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "top_p": 1.0,
                "seed": 42, "logprobs": 0, "skip_special_tokens": true, "min_tokens": 1,
                "include_stop_str_in_output": true}),
    );
    let cc = &c["choices"][0];
    assert_eq!(ids(&cc["token_ids"]), out, "{c}\n{g}");
    let want: Vec<u32> = cc["logprobs"]["token_logprobs"]
        .as_array()
        .expect("token_logprobs")
        .iter()
        .map(bits)
        .collect();
    let got: Vec<u32> = content.iter().map(|c| bits(&c["logprob"])).collect();
    assert_eq!(got, want);
    // SkyRL's Tinker `sample` (same file): n samples, output_kind 2 (final only, which
    // a whole response is anyway), prompt_logprobs None; choice i is completions' i.
    let tinker = json!({
        "sampling_params": {"n": 3, "logprobs": 0, "output_kind": 2, "prompt_logprobs": null,
                            "temperature": 1.0, "max_tokens": 6, "seed": 5, "top_p": 1.0},
        "model": model,
        "token_ids": PROMPT,
    });
    let g = s.ok("/inference/v1/generate", &tinker);
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "n": 3, "max_tokens": 6, "seed": 5, "logprobs": 0}),
    );
    for i in 0..3 {
        assert_eq!(g["choices"][i]["index"], i, "{g}");
        assert_eq!(
            ids(&g["choices"][i]["token_ids"]),
            ids(&c["choices"][i]["token_ids"]),
            "choice {i}"
        );
    }
    // Without max_tokens vLLM generates to the end of the context (128 here).
    let g = s.ok(
        "/inference/v1/generate",
        &json!({"token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "ignore_eos": true}}),
    );
    assert_eq!(
        g["usage"]["completion_tokens"],
        128 - PROMPT.len(),
        "{}",
        g["usage"]
    );

    // prime-rl's `prefill_logprobs` (src/prime_rl/utils/client.py, PrimeIntellect-ai/
    // prime-rl): prompt_logprobs 1 and one token; it reads the first value of each entry.
    let prime = json!({
        "model": model,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1},
    });
    let g = s.ok("/inference/v1/generate", &prime);
    let pl = g["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(pl.len(), PROMPT.len(), "{g}");
    assert_eq!(pl[0], Value::Null);
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": true}),
    );
    let want: Vec<u32> = c["choices"][0]["prompt_logprobs"]
        .as_array()
        .expect("completions' prompt_logprobs")
        .iter()
        .map(bits)
        .collect();
    let got: Vec<u32> = pl[1..]
        .iter()
        .zip(&PROMPT[1..])
        .map(|(e, t)| {
            // The prompt's own token comes first, as prime-rl takes `next(iter(...))`.
            let (k, v) = e.as_object().expect("a map").iter().next().expect("entry");
            assert_eq!(k, &t.to_string(), "{e}");
            bits(&v["logprob"])
        })
        .collect();
    assert_eq!(got, want);
    assert!(pl[1..]
        .iter()
        .all(|e| e.as_object().expect("map").len() <= 2));
}

#[test]
fn generate_fields_arbor_cannot_honour_are_named() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "vllm-gen-bad");
    let with = |sp: Value| json!({"token_ids": PROMPT, "sampling_params": sp});
    for (body, param) in [
        (
            with(json!({"min_tokens": -1, "max_tokens": 4})),
            "sampling_params.min_tokens",
        ),
        (
            with(json!({"logprobs": -1, "max_tokens": 4})),
            "sampling_params.logprobs",
        ),
        (
            with(json!({"prompt_logprobs": 21, "max_tokens": 4})),
            "sampling_params.prompt_logprobs",
        ),
        (
            with(json!({"allowed_token_ids": [1, 2]})),
            "sampling_params.allowed_token_ids",
        ),
        (
            with(json!({"use_beam_search": true})),
            "sampling_params.use_beam_search",
        ),
        (
            with(json!({"min_p": 0.1, "max_tokens": 4})),
            "sampling_params.min_p",
        ),
        (
            json!({"token_ids": PROMPT, "sampling_params": {}, "stream": true}),
            "stream",
        ),
        (
            json!({"token_ids": PROMPT, "sampling_params": {},
                   "features": {"mm_hashes": {"image": ["x"]}}}),
            "features",
        ),
        (json!({"sampling_params": {}}), "token_ids"),
        (json!({"token_ids": [], "sampling_params": {}}), "token_ids"),
        (json!({"token_ids": PROMPT}), "sampling_params"),
        (
            json!({"token_ids": PROMPT, "sampling_params": {}, "echo": true}),
            "echo",
        ),
        (
            json!({"token_ids": PROMPT, "sampling_params": {}, "request_id": "r".repeat(300)}),
            "request_id",
        ),
    ] {
        let (st, v) = s.post("/inference/v1/generate", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    // Fields that cannot change the output are taken: priority, cache_salt, a request
    // id, detokenize, spaces_between_special_tokens, an empty kv_transfer_params.
    let (st, v) = s.post(
        "/inference/v1/generate",
        &json!({"token_ids": PROMPT, "request_id": "r-1", "priority": 3, "cache_salt": "s",
                "kv_transfer_params": null, "stream": false,
                "sampling_params": {"max_tokens": 3, "detokenize": false, "seed": 1,
                                    "spaces_between_special_tokens": true, "output_kind": 0}}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["request_id"], "r-1");
    assert_eq!(ids(&v["choices"][0]["token_ids"]).len(), 3);
}

/// The tiny model A with `eos` as its end-of-sequence id (generation_config.json): a model
/// whose greedy reply to `PROMPT` ends at once, where `eos` is its first greedy token.
fn with_eos(a: &std::path::Path, eos: u64, name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("model dir");
    for e in std::fs::read_dir(a).expect("model A").flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy model A");
        }
    }
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": eos}).to_string(),
    )
    .expect("generation_config.json");
    dir
}

fn logprob_bits(choice: &Value) -> Vec<u32> {
    choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("token_logprobs in {choice}"))
        .iter()
        .map(bits)
        .collect()
}

/// vLLM's `min_tokens` on a model whose greedy reply ends at its first token: the ban of
/// end-of-sequence (and of `stop_token_ids`) holds for the first N tokens, gives the same
/// bits at TP 1 and TP 2 and alone or beside other choices, reports the unmasked model's
/// log-probs (as `arbor score`'s teacher-forced ones), and SkyRL's exact body with its
/// `min_tokens: 1` gets a reply where without it there is none.
#[test]
fn min_tokens_holds_back_the_stop_tokens_at_tp1_and_tp2() {
    let m = models();
    let probe = Server::start(1, &m.a, &[], "mintok-probe");
    let g = probe.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
    );
    let free = ids(&g["choices"][0]["token_ids"]);
    drop(probe);
    let eos = free[0];
    let dir = with_eos(&m.a, eos, "rl-mintok-eos");
    let greedy = |min: usize| {
        json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1,
               "min_tokens": min})
    };
    let sampled = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11,
                         "n": 3, "logprobs": 0, "min_tokens": 5, "stop_token_ids": [free[1]]});
    let mut replies = Vec::new();
    for tp in [1, 2] {
        let s = Server::start(tp, &dir, &[], &format!("mintok-tp{tp}"));
        // Without min_tokens: end-of-sequence at once.
        let c = s.ok("/v1/completions", &greedy(0));
        assert_eq!(ids(&c["choices"][0]["token_ids"]), vec![eos], "{c}");
        assert_eq!(c["choices"][0]["finish_reason"], "stop", "{c}");
        // min_tokens 4: at least 4 tokens, none of them end-of-sequence.
        let c = s.ok("/v1/completions", &greedy(4));
        let out = ids(&c["choices"][0]["token_ids"]);
        assert!(out.len() >= 4, "{c}");
        assert!(!out[..4].contains(&eos), "{c}");
        // The log-probs are the model's own: a teacher-forced score of the same tokens.
        let mut whole: Vec<u64> = PROMPT.iter().map(|&t| t as u64).collect();
        whole.extend(&out);
        let sc = s.ok(
            "/v1/completions",
            &json!({"prompt": whole, "max_tokens": 1, "prompt_logprobs": true}),
        );
        let scored: Vec<u32> = sc["choices"][0]["prompt_logprobs"]
            .as_array()
            .expect("prompt_logprobs")
            .iter()
            // Entry k is position k + 1's.
            .skip(PROMPT.len() - 1)
            .map(bits)
            .collect();
        assert_eq!(
            logprob_bits(&c["choices"][0]),
            scored,
            "{c}
{sc}"
        );
        // SGLang's `min_new_tokens` (/generate) is the same ban: completions' tokens.
        let sg = s.ok(
            "/generate",
            &json!({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12,
                    "temperature": 0, "min_new_tokens": 4}}),
        );
        assert_eq!(ids(&sg["output_ids"]), out, "{sg}");
        // TRL's `generation_kwargs` (its VLLMClient.generate body, as tests/rl/trl.rs
        // sends it) with `min_tokens`: the tokens of completions with the same fields.
        let trl = s.ok(
            "/generate/",
            &json!({"prompts": [PROMPT], "images": null, "n": 1, "repetition_penalty": 1.0,
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "max_tokens": 12, "logprobs": 0, "structured_outputs_regex": null,
                    "generation_kwargs": {"seed": 3, "min_tokens": 4}}),
        );
        let c = s.ok(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3,
                    "min_tokens": 4}),
        );
        let trl_ids = ids(&trl["completion_ids"][0]);
        assert!(trl_ids.len() >= 4 && !trl_ids[..4].contains(&eos), "{trl}");
        assert_eq!(trl_ids, ids(&c["choices"][0]["token_ids"]), "{trl}\n{c}");
        // Sampled, n 3, with a stop token banned too: each choice alone is the same.
        let n3 = s.ok("/v1/completions", &sampled);
        for i in 0..3 {
            let ch = &n3["choices"][i];
            let out = ids(&ch["token_ids"]);
            assert!(out.len() >= 5, "{n3}");
            assert!(
                !out[..5].contains(&eos) && !out[..5].contains(&free[1]),
                "{n3}"
            );
            let mut one = sampled.clone();
            one["n"] = json!(1);
            one["sample_id"] = json!(i);
            let alone = s.ok("/v1/completions", &one);
            assert_eq!(ids(&alone["choices"][0]["token_ids"]), out, "choice {i}");
            assert_eq!(logprob_bits(&alone["choices"][0]), logprob_bits(ch));
        }
        // SkyRL's body (get_vllm_sampling_params in
        // skyrl/backends/skyrl_train/inference_engines/utils.py, sent by
        // remote_inference_client.py's `_generate_single`), greedy: min_tokens 1 gives a
        // first token; /v1/completions with the same fields gives the same bits.
        let model = model_id(&s);
        let skyrl = json!({
            "sampling_params": {
                "min_tokens": 1, "skip_special_tokens": true, "include_stop_str_in_output": true,
                "max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "logprobs": 0, "stop": null,
            },
            "model": model,
            "token_ids": PROMPT,
        });
        let g = s.ok("/inference/v1/generate", &skyrl);
        let gen = ids(&g["choices"][0]["token_ids"]);
        assert!(!gen.is_empty() && gen[0] != eos, "{g}");
        let c = s.ok(
            "/v1/completions",
            &json!({"prompt": PROMPT, "min_tokens": 1, "skip_special_tokens": true,
                    "include_stop_str_in_output": true, "max_tokens": 6, "temperature": 0.0,
                    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0}),
        );
        assert_eq!(
            ids(&c["choices"][0]["token_ids"]),
            gen,
            "{c}
{g}"
        );
        let got: Vec<u32> = g["choices"][0]["logprobs"]["content"]
            .as_array()
            .expect("content")
            .iter()
            .map(|e| bits(&e["logprob"]))
            .collect();
        assert_eq!(got, logprob_bits(&c["choices"][0]));
        replies.push((
            s.ok("/v1/completions", &greedy(4)),
            n3,
            g["choices"][0].clone(),
        ));
    }
    // TP 1 and TP 2: the same tokens and log-prob bits.
    let (a, b) = (&replies[0], &replies[1]);
    assert_eq!(a.0["choices"], b.0["choices"]);
    assert_eq!(a.1["choices"], b.1["choices"]);
    assert_eq!(a.2, b.2);
}

/// vLLM's `StatelessProcessGroup.create` as the trainer's rank 0 (a `TCPStore` master of
/// `world_size`) and `PyNcclCommunicator`'s `broadcast_obj(unique_id, src=0)` (the
/// `ncclUniqueId` ctypes struct, pickled, under `broadcast_from/0/0`), as
/// `NCCLWeightTransferEngine.trainer_init` runs them
/// (vllm/distributed/weight_transfer/nccl_engine.py).
pub(crate) const TRAINER: &str = r#"
import ctypes, pickle, sys, types
from datetime import timedelta
from torch.distributed import TCPStore

port, world = int(sys.argv[1]), int(sys.argv[2])
store = TCPStore("127.0.0.1", port, world_size=world, is_master=True,
                 timeout=timedelta(seconds=60), use_libuv=False)
print("CHECKED_IN", flush=True)
# vLLM's module name, without vLLM: pickle names the class by module and name.
mod = types.ModuleType("vllm_stub.pynccl_wrapper")
sys.modules["vllm_stub"] = types.ModuleType("vllm_stub")
class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]
ncclUniqueId.__module__ = mod.__name__
mod.ncclUniqueId = ncclUniqueId
sys.modules[mod.__name__] = mod
uid = ncclUniqueId()
ctypes.memmove(ctypes.addressof(uid), bytes((5 * i + 1) % 256 for i in range(128)), 128)
store.set("broadcast_from/0/0", pickle.dumps(uid))
print("PUBLISHED", flush=True)
sys.stdin.read()
"#;

#[test]
fn weight_transfer_joins_vllm_style_and_checks_update_info_at_tp2() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "vllm-wt");
    // NeMo-RL's and SkyRL's `/get_world_size` first (arbor's TP), then the trainer's
    // world is it + 1 with the trainer at rank 0.
    let (st, v) = s.call("GET", "/get_world_size", None);
    assert_eq!((st, &v["world_size"]), (200, &json!(2)), "{v}");

    // The update routes without a group: 409, nothing staged.
    let update = json!({"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"],
                                        "shapes": [[64]], "packed": true}});
    let (st, v) = s.post("/update_weights", &update);
    assert_eq!(st, 409, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap_or("")
            .contains("vllm-weight-transfer"),
        "{v}"
    );

    // Bodies arbor cannot honour name their field (vLLM's own answer to a wrong field is
    // a 400 too: `parse_update_info`).
    for (path, body, param) in [
        ("/update_weights", json!({}), "update_info"),
        (
            "/update_weights",
            json!({"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]],
                                   "ipc_handles": {}}}),
            "update_info.ipc_handles",
        ),
        (
            "/update_weights",
            json!({"update_info": {"names": ["model.norm.weight"], "dtype_names": ["int64"],
                                   "shapes": [[64]]}}),
            "update_info.dtype_names",
        ),
        (
            "/update_weights",
            json!({"update_info": {"names": ["a", "b"], "dtype_names": ["bfloat16"], "shapes": [[2]]}}),
            "update_info.names",
        ),
        (
            "/update_weights",
            json!({"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]],
                                   "packed": true, "packed_buffer_size_bytes": 0}}),
            "update_info.packed_buffer_size_bytes",
        ),
        (
            "/update_weights",
            json!({"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]],
                                   "is_checkpoint_format": false}}),
            "update_info.is_checkpoint_format",
        ),
        // The IPC backend's init (TRL's and others' `{"init_info": {}}`).
        (
            "/init_weight_transfer_engine",
            json!({"init_info": {}}),
            "init_info",
        ),
        ("/init_weight_transfer_engine", json!({}), "init_info"),
        (
            "/init_weight_transfer_engine",
            json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                 "rank_offset": 0, "world_size": 3}}),
            "init_info.rank_offset",
        ),
        (
            "/init_weight_transfer_engine",
            json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                 "rank_offset": 1, "world_size": 2}}),
            "init_info.world_size",
        ),
        (
            "/init_weight_transfer_engine",
            json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                 "rank_offset": 1, "world_size": 3, "backend": "gloo"}}),
            "init_info.backend",
        ),
        (
            "/collective_rpc",
            json!({"method": "reload_weights"}),
            "method",
        ),
    ] {
        let (st, v) = s.post(path, &body);
        assert_eq!(st, 400, "{path} {body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body} -> {v}");
    }

    // SkyRL's three steps through /collective_rpc (remote_inference_client.py's
    // start_weight_update / update_weights_nccl / finish_weight_update): start and finish
    // with nothing staged answer as vLLM's workers do; the update needs the group.
    let (st, v) = s.post(
        "/collective_rpc",
        &json!({"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": true}}),
    );
    assert_eq!((st, &v["results"]), (200, &json!([null, null])), "{v}");
    let (st, v) = s.post(
        "/collective_rpc",
        &json!({"method": "update_weights_nccl", "kwargs": update}),
    );
    assert_eq!(st, 409, "{v}");
    let (st, v) = s.post(
        "/collective_rpc",
        &json!({"method": "skyrl_finish_weight_update"}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.post(
        "/start_weight_update",
        &json!({"is_checkpoint_format": true}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.post("/finish_weight_update", &json!({}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(s.version(), "0", "nothing changed");

    if !python_has(
        &["torch.distributed"],
        "python3 -m pip install torch==2.11.0",
    ) {
        return;
    }
    // NeMo-RL / SkyRL's init body (`{"init_info": {master_address, master_port,
    // rank_offset: 1, world_size}}`), sent while the trainer's `trainer_init` makes the
    // group: every rank checks in at the store and reads the pickled id.
    let port = free_port();
    let trainer = Trainer::run(TRAINER, &[&port.to_string(), "3"]);
    let (st, v) = s.post(
        "/init_weight_transfer_engine",
        &json!({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                              "rank_offset": 1, "world_size": 3}}),
    );
    trainer.expect("CHECKED_IN");
    trainer.expect("PUBLISHED");
    assert_eq!(st, 400, "{v}");
    let want = format!(
        "read the trainer's 128-byte NCCL unique id (beginning 01060b10) from key \"broadcast_from/0/0\" in the TCPStore at 127.0.0.1:{port}"
    );
    let msg = v["message"].as_str().expect("message");
    assert_eq!(msg.matches(&want).count(), 2, "both ranks: {msg}");
    // The server keeps serving.
    let (st, v) = s.post(
        "/inference/v1/generate",
        &json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
    );
    assert_eq!(st, 200, "{v}");
}
