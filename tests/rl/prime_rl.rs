//! prime-rl (PrimeIntellect-ai/prime-rl) against `arbor serve`: its orchestrator's admin
//! calls (`src/prime_rl/utils/client.py`: `/pause?mode=keep&clear_cache=false`,
//! `/update_weights {weight_dir}`, `/resume`, `/init_broadcaster`), the routes of its
//! server (`src/prime_rl/inference/vllm/server.py`), the in-band NCCL layout of its
//! trainer (`src/prime_rl/transports/weights/nccl.py`) replayed from real torch and
//! pickle bytes, and its rollout client, the `renderers` package from PyPI, unmodified.

use std::path::{Path, PathBuf};

use arbor_model::batching::in_band::{self, Broadcast};
use serde_json::{json, Value};

use crate::checkpoint::{models, Tensors};
use crate::cli_support::{free_port, python_has};
use crate::rendezvous::Trainer;
use crate::server::Server;
use crate::vllm::TRAINER;

const PROMPT: [u32; 7] = [5, 17, 101, 42, 7, 230, 11];

fn here(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/rl")
        .join(file)
}

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn python(args: &[&std::ffi::OsStr]) -> String {
    let o = std::process::Command::new("python3")
        .args(args)
        .output()
        .expect("start python3");
    assert!(
        o.status.success(),
        "python3 {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The broadcasts a recorded stream holds, in order.
fn broadcasts(path: &Path) -> Vec<Vec<u8>> {
    let raw = std::fs::read(path).expect("read the stream");
    let mut out = Vec::new();
    let mut at = 0;
    while at < raw.len() {
        let n = u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes")) as usize;
        out.push(raw[at + 8..at + 8 + n].to_vec());
        at += 8 + n;
    }
    out
}

/// Each protocol `pickle.dumps` may write (prime-rl uses the default, 4 on Python 3.8 to
/// 3.13, 5 from 3.14): the receiver asks for exactly the broadcasts the trainer made, in
/// its order, and ends with every tensor of the state dict, bit for bit, in its dtype.
#[test]
fn prime_rl_in_band_receive_replays_the_trainers_broadcasts() {
    if !python_has(
        &["torch", "safetensors"],
        "python3 -m pip install torch safetensors",
    ) {
        return;
    }
    let m = models();
    let protocols = ["default", "2", "3", "5"];
    let out = tmp("prime-rl-streams");
    let script = here("prime_rl_broadcast.py");
    let mut args: Vec<&std::ffi::OsStr> =
        vec![script.as_os_str(), m.a.as_os_str(), out.as_os_str()];
    args.extend(protocols.iter().map(std::ffi::OsStr::new));
    let said = python(&args);
    for protocol in protocols {
        let mut sent = broadcasts(&out.join(format!("stream-{protocol}")));
        assert!(
            said.contains(&format!("{protocol}: {} broadcasts", sent.len())),
            "{said}"
        );
        let n = sent.len();
        sent.reverse();
        let mut asked: Vec<Broadcast> = Vec::new();
        let got = in_band::receive(
            |w| {
                asked.push(w.clone());
                let b = sent.pop().ok_or("the trainer sent nothing more")?;
                // A receive sized unlike the trainer's tensor would hang NCCL: the sizes
                // must match before the bytes are taken.
                if b.len() != w.bytes() {
                    return Err(format!(
                        "{w:?} wants {} bytes; the trainer sent {}",
                        w.bytes(),
                        b.len()
                    ));
                }
                Ok(b)
            },
            1 << 30,
        )
        .unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        assert!(sent.is_empty(), "{} broadcasts left", sent.len());
        assert_eq!(asked.len(), n);
        assert_eq!(asked[0], Broadcast::Count);
        let want = Tensors::read(&out.join("expected.safetensors")).0;
        let mut seen = 0;
        for r in &got {
            let parts = r.parts().expect("bf16 and f32 are stored");
            for p in parts {
                let (dtype, shape, bytes) = &want[&p.name];
                assert_eq!(p.dtype.name(), dtype, "{}", p.name);
                assert_eq!(&p.shape, shape, "{}", p.name);
                assert!(
                    &r.bytes[p.data.clone()] == bytes.as_slice(),
                    "{} differs",
                    p.name
                );
                seen += 1;
            }
        }
        assert_eq!(seen, want.len(), "protocol {protocol}");
        // Two dtypes per state dict, as the script casts them.
        assert!(got.iter().any(|r| r.dtype.name == "float32"));
        assert!(got.iter().any(|r| r.dtype.name == "bfloat16"));
    }

    // A pickle that would run a command is refused by name, not run.
    let evil = python(&[
        "-c".as_ref(),
        "import os, pickle, sys\nclass E:\n    def __reduce__(self):\n        return (os.system, ('touch /tmp/arbor-pwned',))\nsys.stdout.write(pickle.dumps({E(): []}).hex())"
            .as_ref(),
    ]);
    let bytes: Vec<u8> = (0..evil.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&evil[i..i + 2], 16).expect("hex"))
        .collect();
    let e = in_band::parse_metadata(&bytes).expect_err("refused");
    assert!(e.contains("the global posix.system"), "{e}");
}

fn greedy(s: &Server) -> Vec<u32> {
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}),
    );
    v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("log-probs")
        .iter()
        .map(|x| (x.as_f64().expect("a log-prob") as f32).to_bits())
        .collect()
}

/// The orchestrator's calls with the filesystem broadcast at TP 2 (`update_weights` in
/// `client.py`): pause (mode keep), `/update_weights {weight_dir}` on the directory the
/// trainer writes (sharded safetensors and their index, no config.json, its STABLE and
/// NCCL_READY markers), resume; and `/init_broadcaster`'s checks and rendezvous.
#[test]
fn prime_rl_routes_at_tp2() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "prime-rl");
    let on_a = greedy(&s);
    s.ok("/update_weights_from_disk", &json!({"model_path": m.b}));
    let on_b = greedy(&s);
    assert_ne!(on_a, on_b);
    s.ok("/update_weights_from_disk", &json!({"model_path": m.a}));
    assert_eq!(greedy(&s), on_a);

    // B as prime-rl's `save_state_dict_parallel` leaves it: shards and an index.
    let dir = tmp("prime-rl-broadcasts/step_1");
    let b = Tensors::read(&m.b.join("model.safetensors"));
    let names = b.names();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (i, part) in [first, second].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        std::fs::write(dir.join(&file), b.image(part)).expect("write shard");
        for n in *part {
            map.insert((*n).clone(), json!(file));
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {"total_size": 0}, "weight_map": map}).to_string(),
    )
    .expect("write index");
    std::fs::write(dir.join("STABLE"), b"").expect("marker");
    std::fs::write(dir.join("NCCL_READY"), b"").expect("marker");

    let (st, v) = s.call("POST", "/pause?mode=keep&clear_cache=false", None);
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.post("/update_weights", &json!({"weight_dir": dir}));
    assert_eq!((st, &v["status"]), (200, &json!("ok")), "{v}");
    let (st, v) = s.post("/resume", &json!({}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        greedy(&s),
        on_b,
        "the shards of B serve as B from disk does"
    );
    let (st, v) = s.call("GET", "/liveness", None);
    assert_eq!((st, &v["status"]), (200, &json!("ok")), "{v}");

    // Refusals name the field, and change nothing.
    for (body, param) in [
        (json!({"weight_dir": "/nonexistent/step_2"}), "weight_dir"),
        (json!({"weight_dir": null}), "weight_dir"),
        (json!({"weight_dir": dir, "lora_name": "x"}), "lora_name"),
    ] {
        let (st, v) = s.post("/update_weights", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    for (body, param) in [
        (
            json!({"host": "127.0.0.1", "port": 1, "rank_offset": 0, "inference_world_size": 2,
                   "timeout": 30, "quantize_in_weight_transfer": true}),
            "quantize_in_weight_transfer",
        ),
        (
            json!({"host": "127.0.0.1", "port": 1, "rank_offset": 1, "inference_world_size": 2,
                   "timeout": 30}),
            "inference_world_size",
        ),
        (
            json!({"host": "127.0.0.1", "port": 0, "rank_offset": 0, "inference_world_size": 2,
                   "timeout": 30}),
            "port",
        ),
    ] {
        let (st, v) = s.post("/init_broadcaster", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    assert_eq!(greedy(&s), on_b);

    // `init_nccl_broadcast` for one server of 2 GPUs while the trainer's
    // `NCCLWeightBroadcastSender` makes the group (vLLM's StatelessProcessGroup, the
    // trainer at rank 0 of inference_world_size + 1): both ranks check in at its store
    // and read the pickled NCCL id; CPU ranks then refuse the NCCL join itself.
    if !python_has(&["torch"], "python3 -m pip install torch") {
        return;
    }
    let port = free_port();
    let trainer = Trainer::run(TRAINER, &[&port.to_string(), "3"]);
    let (st, v) = s.post(
        "/init_broadcaster",
        &json!({"host": "127.0.0.1", "port": port, "rank_offset": 0,
                "inference_world_size": 2, "timeout": 60,
                "quantize_in_weight_transfer": false}),
    );
    trainer.expect("CHECKED_IN");
    trainer.expect("PUBLISHED");
    assert_eq!(st, 400, "{v}");
    let want = format!(
        "read the trainer's 128-byte NCCL unique id (beginning 01060b10) from key \"broadcast_from/0/0\" in the TCPStore at 127.0.0.1:{port}"
    );
    let msg = v["message"].as_str().expect("message");
    assert_eq!(msg.matches(&want).count(), 2, "both ranks: {msg}");
    // No broadcaster was made: the directory is read again, and the server serves on.
    let (st, v) = s.post("/update_weights", &json!({"weight_dir": dir}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(greedy(&s), on_b);
}

/// prime-rl's rollout path unmodified: `renderers.client.generate` (PyPI `renderers`)
/// renders each conversation with the model's chat template through transformers'
/// tokenizer, asks `/inference/v1/generate` with `logprobs: 1`, `stop_token_ids` and a
/// `cache_salt`, and checks what comes back; its token ids and log-probs must be the bits
/// `/v1/completions` gives for the same prompt ids and seed.
#[test]
fn prime_rl_renderers_client_at_tp2() {
    // Optional even in CI: `renderers` brings a compiled wheel (openai-harmony), so the
    // README's install step does not install it.
    let probe = "import renderers, transformers, openai";
    let has = std::process::Command::new("python3")
        .args(["-c", probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!(
            "SKIPPED: python3 -c '{probe}' failed (python3 -m pip install renderers==0.1.12 transformers openai)"
        );
        return;
    }
    let m = models();
    let dir = tmp("prime-rl-renderers-model");
    for f in std::fs::read_dir(&m.a).expect("read model dir").flatten() {
        std::fs::copy(f.path(), dir.join(f.file_name())).expect("copy model file");
    }
    // The tiny tokenizer's own special tokens, and a chat template to render with.
    let template = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
               "chat_template": template})
        .to_string(),
    )
    .expect("write tokenizer_config.json");
    let s = Server::start(2, &dir, &[], "prime-rl-renderers");
    let (st, models) = s.call("GET", "/v1/models", None);
    assert_eq!(st, 200, "{models}");
    let id = models["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();
    let out = python(&[
        here("prime_rl_renderers.py").as_os_str(),
        format!("http://{}/v1", s.addr).as_ref(),
        dir.as_os_str(),
        id.as_ref(),
    ]);
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    for r in &lines {
        let prompt = r["prompt_ids"].clone();
        assert_eq!(prompt[0], 256, "the template's bos first: {r}");
        let c = s.ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "top_p": 1.0,
                    "seed": r["seed"], "stop_token_ids": r["stop_token_ids"],
                    "skip_special_tokens": false, "logprobs": 0}),
        );
        let choice = &c["choices"][0];
        assert_eq!(choice["token_ids"], r["completion_ids"], "{r} vs {c}");
        let bits = |v: &Value| -> Vec<u32> {
            v.as_array()
                .expect("log-probs")
                .iter()
                .map(|x| (x.as_f64().expect("a number") as f32).to_bits())
                .collect()
        };
        assert_eq!(
            bits(&choice["logprobs"]["token_logprobs"]),
            bits(&r["completion_logprobs"])
        );
        assert_eq!(choice["finish_reason"], r["finish_reason"]);
    }
}
