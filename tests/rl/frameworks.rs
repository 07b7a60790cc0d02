//! The RL frameworks' own rollout and control calls, replayed as their code sends them
//! (the file each body comes from is named beside it), against `arbor serve`: what the
//! framework reads back is there, and SGLang's `/generate` gives the same bits as
//! `/v1/completions` for the same prompt and sampling.

use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::server::Server;

fn f32_bits(v: &Value) -> u32 {
    (v.as_f64().expect("a finite log-prob") as f32).to_bits()
}

/// (ids, log-prob bits) of a `/generate` item, read as slime and AReaL read them:
/// `[item[1] for item in meta_info["output_token_logprobs"]]` and `item[0]`.
fn generate_bits(item: &Value) -> (Vec<u64>, Vec<u32>) {
    let lps = item["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("output_token_logprobs in {item}"));
    let ids: Vec<u64> = lps.iter().map(|e| e[1].as_u64().expect("id")).collect();
    let out: Vec<u64> = item["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    assert_eq!(ids, out, "output_ids against output_token_logprobs: {item}");
    (ids, lps.iter().map(|e| f32_bits(&e[0])).collect())
}

fn completion_bits(c: &Value) -> (Vec<u64>, Vec<u32>) {
    let ids = c["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    let lps = c["logprobs"]["token_logprobs"]
        .as_array()
        .expect("token_logprobs")
        .iter()
        .map(f32_bits)
        .collect();
    (ids, lps)
}

const PROMPT: [u32; 6] = [5, 17, 101, 42, 7, 230];

#[test]
fn sglang_generate_replays_slime_and_areal_at_tp2() {
    let m = models();
    // Unseeded bodies draw a fresh seed each; a fixed default makes them replay.
    let s = Server::start(2, &m.a, &["--default-seed", "0"], "frameworks-gen");

    // slime/rollout/sglang_rollout.py (THUDM/slime): GenerateState.sampling_params and the
    // payload of `generate` (`sampling_seed` from --sglang-enable-deterministic-inference).
    let slime = json!({
        "sampling_params": {
            "temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
            "stop": null, "stop_token_ids": null, "skip_special_tokens": false,
            "no_stop_trim": true, "spaces_between_special_tokens": false,
            "sampling_seed": 7,
        },
        "return_logprob": true,
        "input_ids": PROMPT,
    });
    let g = s.ok("/generate", &slime);
    let meta = &g["meta_info"];
    assert_eq!(meta["finish_reason"]["type"], "length", "{g}");
    assert_eq!(meta["finish_reason"]["length"], 12);
    assert_eq!(meta["prompt_tokens"], PROMPT.len());
    assert_eq!(meta["completion_tokens"], 12);
    assert_eq!(meta["weight_version"], "0");
    assert!(g["text"].is_string());
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 7, "logprobs": 0}),
    );
    assert_eq!(
        generate_bits(&g),
        completion_bits(&c["choices"][0]),
        "/generate and /v1/completions differ"
    );

    // areal/engine/sglang_remote.py (inclusionAI/AReaL): RemoteSGLangEngine.agenerate's
    // payload; it reads finish_reason["type"] (and "message" on abort) and the entries of
    // output_token_logprobs. A stop token from an unconstrained run ends the choice there.
    let free = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "logprobs": 0}),
    );
    let (free_ids, _) = completion_bits(&free["choices"][0]);
    let stop_id = free_ids[3];
    let first = free_ids
        .iter()
        .position(|&t| t == stop_id)
        .expect("in the run");
    let areal = json!({
        "input_ids": PROMPT,
        "image_data": null,
        "sampling_params": {
            "top_p": 0.9, "top_k": 20, "max_new_tokens": 10, "temperature": 1.0,
            "stop_token_ids": [stop_id], "frequency_penalty": 0.0,
        },
        "return_logprob": true,
        "stream": false,
    });
    let g = s.ok("/generate", &areal);
    assert_eq!(
        g["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": stop_id}),
        "{g}"
    );
    let (ids, _) = generate_bits(&g);
    assert_eq!(ids, free_ids[..=first].to_vec());
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                "logprobs": 0, "stop_token_ids": [stop_id]}),
    );
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    assert_eq!(generate_bits(&g), completion_bits(&c["choices"][0]));
    // vLLM's include_stop_str_in_output keeps the stop token's text.
    let kept = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                "stop_token_ids": [stop_id], "include_stop_str_in_output": true}),
    );
    let (short, long) = (
        c["choices"][0]["text"].as_str().expect("text"),
        kept["choices"][0]["text"].as_str().expect("text"),
    );
    assert!(long.starts_with(short), "{short:?} / {long:?}");

    // The batch form with n: a list, choice i keyed as /v1/completions keys it.
    let prompts = [PROMPT.to_vec(), vec![9, 8, 7]];
    let batch = s.ok(
        "/generate",
        &json!({"input_ids": prompts, "return_logprob": true, "top_logprobs_num": 2,
                "sampling_params": {"n": 2, "temperature": 0.7, "max_new_tokens": 6}}),
    );
    let items = batch.as_array().expect("a list for a batch");
    assert_eq!(items.len(), 4);
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": prompts, "n": 2, "temperature": 0.7, "max_tokens": 6, "logprobs": 2}),
    );
    for (i, item) in items.iter().enumerate() {
        assert_eq!(item["index"], i);
        assert_eq!(
            generate_bits(item),
            completion_bits(&c["choices"][i]),
            "item {i}"
        );
        let top = &item["meta_info"]["output_top_logprobs"][0];
        assert_eq!(top.as_array().map(Vec::len), Some(2), "{item}");
    }

    // Prompt log-probs from logprob_start_len: aligned with the prompt, the first null.
    let g = s.ok(
        "/generate",
        &json!({"input_ids": PROMPT, "return_logprob": true, "logprob_start_len": 0,
                "return_text_in_logprobs": true,
                "sampling_params": {"temperature": 0, "max_new_tokens": 3}}),
    );
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "temperature": 0, "max_tokens": 3, "prompt_logprobs": true, "logprobs": 0}),
    );
    let input = g["meta_info"]["input_token_logprobs"]
        .as_array()
        .expect("input_token_logprobs");
    assert_eq!(input.len(), PROMPT.len());
    assert!(input[0][0].is_null() && input[0][1] == PROMPT[0]);
    assert!(input[0][2].is_string(), "return_text_in_logprobs: {g}");
    let want: Vec<u32> = c["choices"][0]["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs")
        .iter()
        .map(f32_bits)
        .collect();
    let got: Vec<u32> = input[1..].iter().map(|e| f32_bits(&e[0])).collect();
    assert_eq!(got, want);
    // By default only the last prompt token's (null), as SGLang does.
    let g = s.ok(
        "/generate",
        &json!({"input_ids": PROMPT, "return_logprob": true, "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(
        g["meta_info"]["input_token_logprobs"],
        json!([[null, PROMPT[5], null]])
    );

    // stream: SGLang's SSE, cumulative chunks ending with the whole item, then [DONE].
    let whole = s.ok(
        "/generate",
        &json!({"input_ids": PROMPT, "return_logprob": true, "sampling_params": {"temperature": 0.5, "max_new_tokens": 8}}),
    );
    let r = crate::client::request(
        &s.addr,
        "POST",
        "/generate",
        Some(
            &json!({"input_ids": PROMPT, "return_logprob": true, "stream": true,
                     "sampling_params": {"temperature": 0.5, "max_new_tokens": 8}})
            .to_string(),
        ),
        &[],
    )
    .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    let data: Vec<&str> = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{}", r.body);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let lens: Vec<usize> = chunks
        .iter()
        .map(|c| c["output_ids"].as_array().map_or(0, Vec::len))
        .collect();
    assert!(
        lens.windows(2).all(|w| w[0] <= w[1]),
        "cumulative: {lens:?}"
    );
    let last = chunks.last().expect("chunks");
    assert_eq!(generate_bits(last), generate_bits(&whole));
    assert_eq!(last["text"], whole["text"]);
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");

    // Fields that would change the output are refused, naming them.
    for (field, sp) in [
        ("min_p", json!({"min_p": 0.05})),
        ("frequency_penalty", json!({"frequency_penalty": 0.5})),
        ("stop_regex", json!({"stop_regex": "a+"})),
    ] {
        let (status, v) = s.post(
            "/generate",
            &json!({"input_ids": PROMPT, "sampling_params": sp}),
        );
        assert_eq!(status, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field);
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("not supported")),
            "{v}"
        );
    }
    let (status, _) = s.post(
        "/generate",
        &json!({"input_ids": PROMPT, "image_data": ["x.png"]}),
    );
    assert_eq!(status, 400);
    let (status, _) = s.post("/generate", &json!({"input_ids": PROMPT, "max_tokens": 3}));
    assert_eq!(status, 422);
}

#[test]
fn info_health_and_vllm_control_routes() {
    let m = models();
    let s = Server::start(1, &m.a, &[], "frameworks-info");
    let get = |path: &str| {
        let (status, v) = s.call("GET", path, None);
        assert_eq!(status, 200, "{path}: {v}");
        v
    };
    // SGLang's info and health routes (python/sglang/srt/entrypoints/http_server.py).
    get("/health_generate");
    let info = get("/get_model_info");
    assert_eq!(info["is_generation"], true);
    assert_eq!(info["model_path"], m.a.display().to_string());
    assert_eq!(info["weight_version"], "0");
    let server = get("/get_server_info");
    assert_eq!(server["tp_size"], 1);
    assert!(server["max_total_num_tokens"]
        .as_u64()
        .is_some_and(|t| t > 0));
    assert!(server["version"].is_string());
    // The server's numerics, so that a client (or `bench serve`) knows whether a prompt's
    // output may depend on load.
    assert_eq!(server["numerics"], "invariant");
    assert_eq!(server["enable_deterministic_inference"], true);
    assert_eq!(get("/get_load")[0]["dp_rank"], 0);
    assert_eq!(get("/get_world_size")["world_size"], 1);

    // update_weight_version renames the weights; responses report the new name.
    s.ok(
        "/update_weight_version",
        &json!({"new_version": "step-3", "abort_all_requests": false}),
    );
    assert_eq!(s.version(), "step-3");
    let g = s.ok(
        "/generate",
        &json!({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(g["meta_info"]["weight_version"], "step-3");

    // vLLM's pause / resume (vllm/entrypoints/openai/api_server.py: mode keep | wait | abort).
    s.ok("/pause?mode=keep", &json!({}));
    assert_eq!(get("/health")["paused"], true);
    let (status, v) = s.post("/pause?mode=wait", &json!({}));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("mode")),
        "{v}"
    );
    s.ok("/resume", &json!({}));
    s.ok("/pause?mode=abort", &json!({}));
    // SGLang's continue with torch_empty_cache (as SGLang's own RL client sends it).
    s.ok("/continue_generation", &json!({"torch_empty_cache": true}));
    assert_eq!(get("/health")["paused"], false);

    // verl's abort of everything: `{"rid": "", "abort_all": true}`.
    s.ok("/abort_request", &json!({"rid": "", "abort_all": true}));

    // Memory: verl's tags include cuda_graph (nothing of arbor's); vLLM's sleep takes
    // tags in the query, repeated or comma-separated.
    s.ok(
        "/release_memory_occupation",
        &json!({"tags": ["cuda_graph"]}),
    );
    assert_eq!(get("/is_sleeping")["is_sleeping"], false);
    s.ok("/sleep?level=1&tags=weights&tags=kv_cache", &json!({}));
    assert_eq!(get("/is_sleeping")["is_sleeping"], true);
    s.ok("/wake_up?tags=weights,kv_cache", &json!({}));
    assert_eq!(get("/is_sleeping")["is_sleeping"], false);
    s.ok(
        "/release_memory_occupation",
        &json!({"tags": ["kv_cache", "weights", "cuda_graph"]}),
    );
    s.ok(
        "/resume_memory_occupation",
        &json!({"tags": ["kv_cache", "weights", "cuda_graph"]}),
    );
    // vLLM's reset with a body (SkyRL sends one), and SGLang's flush.
    s.ok(
        "/reset_prefix_cache",
        &json!({"reset_running_requests": false, "reset_external": false}),
    );
    s.ok("/flush_cache", &json!({}));

    // AReaL's disk update spells abort_all_request (areal/engine/sglang_remote.py).
    let m_a = m.a.display().to_string();
    s.ok(
        "/update_weights_from_disk",
        &json!({"model_path": m_a, "abort_all_request": true}),
    );

    // vLLM's fields that keep the output's bits are accepted; min_p is refused by name.
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 3, "return_token_ids": true,
                "skip_special_tokens": true, "include_stop_str_in_output": false,
                "stop_token_ids": [], "cache_salt": "x", "min_p": 0.0, "min_tokens": 0}),
    );
    assert_eq!(
        c["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(3)
    );
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 3, "min_p": 0.1}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("min_p")),
        "{v}"
    );
    get("/health_generate");
}
