//! TRL's server protocol replayed as its client sends it: the bodies are those of
//! `VLLMClient` in `trl/generation/vllm_client.py` (huggingface/trl; `trl/extras/` in older
//! releases), the routes and defaults those of `trl/scripts/vllm_serve.py`, trailing
//! slashes included. At TP 2 on CPU ranks: what the client reads back is there, and
//! `/generate/` gives the bits `/v1/completions` gives for the same prompt and seed.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::server::Server;

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// Model A with a chat template (`/chat/` renders one).
fn with_template() -> PathBuf {
    let src = &models().a;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-rl-trl");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in std::fs::read_dir(src).expect("read model dir").flatten() {
        std::fs::copy(f.path(), dir.join(f.file_name())).expect("copy model file");
    }
    let cfg =
        json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write config");
    dir
}

/// `VLLMClient.generate`'s body with its defaults (`images` None, `top_k` 0, `logprobs` 0,
/// `structured_outputs_regex` None, `generation_kwargs or {}`).
fn generate_body(prompts: Value, n: usize, max_tokens: usize, kwargs: Value) -> Value {
    json!({
        "prompts": prompts,
        "images": null,
        "n": n,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": max_tokens,
        "logprobs": 0,
        "structured_outputs_regex": null,
        "generation_kwargs": kwargs,
    })
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list: {v}"))
        .iter()
        .map(|t| t.as_u64().expect("an id"))
        .collect()
}

fn bits(v: &Value) -> u32 {
    (v.as_f64().expect("a log-prob") as f32).to_bits()
}

#[test]
fn trl_vllm_client_bodies_at_tp2() {
    let model = with_template();
    let s = Server::start(2, &model, &[], "trl");

    // check_server: GET /health/ must answer 200.
    let (st, v) = s.call("GET", "/health/", None);
    assert_eq!((st, &v["status"]), (200, &json!("ok")), "{v}");
    // init_communicator's first call: world_size is the server's workers.
    let (st, v) = s.call("GET", "/get_world_size/", None);
    assert_eq!((st, &v["world_size"]), (200, &json!(2)), "{v}");

    // generate(prompts=[ids, ids], n=2, max_tokens=8, generation_kwargs={"seed": 11}).
    let p0 = json!([5, 17, 101, 42, 7, 230]);
    let p1 = json!([9, 8, 7]);
    let body = generate_body(json!([p0, p1]), 2, 8, json!({"seed": 11}));
    let g = s.ok("/generate/", &body);
    // What VLLMClient.generate reads back.
    assert_eq!(g["prompt_ids"], json!([p0, p1]), "{g}");
    let comp = g["completion_ids"].as_array().expect("completion_ids");
    let lps = g["logprobs"].as_array().expect("logprobs");
    let lp_ids = g["logprob_token_ids"]
        .as_array()
        .expect("logprob_token_ids");
    assert_eq!((comp.len(), lps.len(), lp_ids.len()), (4, 4, 4), "{g}");
    // The same prompts, n and seed through /v1/completions: the same bits.
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": [p0, p1], "n": 2, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                "seed": 11, "logprobs": 0}),
    );
    let choices = c["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    for (i, ch) in choices.iter().enumerate() {
        let want_ids = ids(&ch["token_ids"]);
        assert!(!want_ids.is_empty(), "{ch}");
        assert_eq!(ids(&comp[i]), want_ids, "choice {i}");
        // logprobs=0: one entry per position, the sampled token's.
        let want: Vec<u32> = ch["logprobs"]["token_logprobs"]
            .as_array()
            .expect("token_logprobs")
            .iter()
            .map(bits)
            .collect();
        let got: Vec<u32> = lps[i]
            .as_array()
            .expect("positions")
            .iter()
            .map(|pos| {
                assert_eq!(pos.as_array().map(Vec::len), Some(1), "{pos}");
                bits(&pos[0])
            })
            .collect();
        assert_eq!(got, want, "choice {i} log-prob bits");
        let got_ids: Vec<u64> = lp_ids[i]
            .as_array()
            .expect("positions")
            .iter()
            .map(|pos| pos[0].as_u64().expect("id"))
            .collect();
        assert_eq!(got_ids, want_ids, "choice {i} logprob_token_ids");
    }
    // The n samples of a prompt differ (keyed apart), and the seed replays.
    assert_ne!(comp[0], comp[1], "{g}");
    assert_eq!(
        s.ok("/generate/", &body)["completion_ids"],
        g["completion_ids"]
    );

    // logprobs=3: the 3 most likely first, and the sampled token after them when it is
    // not among them (vLLM's ranks), so 3 or 4 entries, most likely first.
    let mut top = generate_body(json!([p0]), 1, 6, json!({"seed": 3}));
    top["logprobs"] = json!(3);
    let t = s.ok("/generate/", &top);
    let sampled = ids(&t["completion_ids"][0]);
    for (pos, (l, i)) in t["logprobs"][0]
        .as_array()
        .expect("positions")
        .iter()
        .zip(t["logprob_token_ids"][0].as_array().expect("positions"))
        .enumerate()
    {
        let l: Vec<f64> = l
            .as_array()
            .expect("lps")
            .iter()
            .map(|x| x.as_f64().expect("lp"))
            .collect();
        let i = ids(i);
        assert!(l.len() == 3 || l.len() == 4, "{l:?}");
        assert_eq!(l.len(), i.len());
        assert!(
            i.contains(&sampled[pos]),
            "position {pos}: {i:?} lacks {}",
            sampled[pos]
        );
        assert_eq!(i.len() == 4, !i[..3].contains(&sampled[pos]), "{i:?}");
        assert!(l[..3].windows(2).all(|w| w[0] >= w[1]), "{l:?}");
    }
    // logprobs=None: neither list.
    let mut none = generate_body(json!(["hello world"]), 1, 4, json!({}));
    none["logprobs"] = Value::Null;
    let v = s.ok("/generate/", &none);
    assert_eq!(
        (&v["logprobs"], &v["logprob_token_ids"]),
        (&Value::Null, &Value::Null),
        "{v}"
    );
    assert_eq!(
        v["completion_ids"][0].as_array().map(Vec::len),
        Some(4),
        "{v}"
    );
    // A text prompt is tokenised as /v1/completions tokenises it.
    let c = s.ok(
        "/v1/completions",
        &json!({"prompt": "hello world", "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(
        v["prompt_ids"][0], c["choices"][0]["prompt_token_ids"],
        "{v} {c}"
    );

    // chat(messages=[[...]], ...): the conversation rendered, as /v1/chat/completions does.
    let conv = json!([{"role": "user", "content": "hi there"}]);
    let chat = s.ok(
        "/chat/",
        &json!({
            "messages": [conv],
            "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "max_tokens": 5, "logprobs": 0, "structured_outputs_regex": null,
            "generation_kwargs": {"seed": 5}, "chat_template_kwargs": {}, "tools": null,
        }),
    );
    let oc = s.ok(
        "/v1/chat/completions",
        &json!({"messages": conv, "max_tokens": 5, "seed": 5, "logprobs": true, "top_logprobs": 0}),
    );
    assert_eq!(
        chat["prompt_ids"][0], oc["choices"][0]["prompt_token_ids"],
        "{chat} {oc}"
    );
    assert_eq!(
        chat["completion_ids"][0], oc["choices"][0]["token_ids"],
        "{chat} {oc}"
    );

    // reset_prefix_cache: a POST without a body.
    let (st, v) = s.call("POST", "/reset_prefix_cache/", None);
    assert_eq!(st, 200, "{v}");

    // What arbor cannot honour is refused, naming the field; neutral values pass.
    for (body, param) in [
        (
            {
                let mut b = generate_body(json!([p1]), 1, 2, json!({}));
                b["repetition_penalty"] = json!(1.1);
                b
            },
            "repetition_penalty",
        ),
        (
            {
                let mut b = generate_body(json!([p1]), 1, 2, json!({}));
                b["min_p"] = json!(0.1);
                b
            },
            "min_p",
        ),
        (
            generate_body(json!([p1]), 1, 2, json!({"frequency_penalty": 0.5})),
            "generation_kwargs.frequency_penalty",
        ),
        (
            generate_body(json!([p1]), 1, 2, json!({"bad_words": ["x"]})),
            "generation_kwargs.bad_words",
        ),
        (
            {
                let mut b = generate_body(json!([p1]), 1, 2, json!({}));
                b["images"] = json!([["aGk="]]);
                b
            },
            "images",
        ),
    ] {
        let (st, v) = s.post("/generate/", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    let (st, v) = s.post(
        "/chat/",
        &json!({"messages": [conv], "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("chat_template_kwargs.enable_thinking")),
        "{v}"
    );
    // A regex is a constraint /v1/completions takes too.
    let mut re = generate_body(json!(["hello"]), 1, 6, json!({"seed": 1}));
    re["structured_outputs_regex"] = json!("(ab)+");
    let (st, v) = s.post("/generate/", &re);
    assert_eq!(st, 200, "{v}");
}

/// The weight routes on CPU ranks: `init_communicator`'s body (TRL's client sends the
/// server's world size plus its own rank; host "0.0.0.0", here the loopback) is checked,
/// and CPU ranks refuse to join a NCCL group before anything listens on the port;
/// `update_named_param` answers at once, as TRL's server does, and its failure is
/// reported by the next call; `close_communicator` with nothing open succeeds.
#[test]
fn trl_weight_routes_on_cpu_ranks() {
    let s = Server::start(2, &models().a, &[], "trl-weights");
    let port = crate::cli_support::free_port();
    let init = |world: usize, port: i64| {
        json!({"host": "127.0.0.1", "port": port, "world_size": world,
               "client_device_uuid": "GPU-5e1a9f0c-0000-0000-0000-000000000000"})
    };
    for (body, param) in [
        (init(2, port as i64), "world_size"),
        (init(3, 0), "port"),
        (init(3, 70000), "port"),
    ] {
        let (st, v) = s.post("/init_communicator/", &body);
        assert_eq!(
            (st, &v["error"]["param"]),
            (400, &json!(param)),
            "{body} -> {v}"
        );
    }
    let (st, v) = s.post("/init_communicator/", &init(3, port as i64));
    assert_eq!(st, 400, "{v}");
    let msg = v["message"].as_str().expect("message");
    assert!(
        msg.contains("rank 0:") && msg.contains("rank 1:") && msg.contains("--device cuda"),
        "{msg}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing may listen on the group's port after a refused init"
    );
    // update_named_param(name, weights): answered before the (absent) broadcast.
    let param = json!({"name": "model.norm.weight", "dtype": "torch.bfloat16", "shape": [64]});
    let (st, v) = s.post("/update_named_param/", &param);
    assert_eq!(st, 200, "{v}");
    let t0 = std::time::Instant::now();
    let v = loop {
        let (st, v) = s.post("/update_named_param/", &param);
        if st != 200 {
            assert_eq!(st, 409, "{v}");
            break v;
        }
        assert!(t0.elapsed().as_secs() < 20, "the failure never showed: {v}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let msg = v["message"].as_str().expect("message");
    assert!(
        msg.contains("\"model.norm.weight\"") && msg.contains("no weight-update group \\\"trl\\\""),
        "{msg}"
    );
    let (st, v) = s.post(
        "/update_named_param/",
        &json!({"name": "x", "dtype": "torch.int8", "shape": [2]}),
    );
    assert_eq!((st, &v["error"]["param"]), (400, &json!("dtype")), "{v}");
    let (st, v) = s.call("POST", "/close_communicator/", None);
    assert_eq!(st, 200, "{v}");
    // Generation goes on.
    let (st, v) = s.post(
        "/generate/",
        &json!({"prompts": [[1, 2, 3]], "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
}
