//! The trainer loop of `examples/rl_loop.py`, without torch.

use serde_json::{json, Value};

use crate::bits::choice_bits;
use crate::checkpoint::{models, Tensors};
use crate::cli_support::*;
use crate::server::Server;

/// The weights move each iteration; the trainer pushes them to a TP 2 server, requests
/// rollouts with log-probs, and checks them against `arbor score` at TP 1 on a checkpoint
/// of the same weights: the same bits, and the version it pushed.
#[test]
fn trainer_loop_matches_score_at_tp1() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "loop");
    let scratch = Scratch::new("rl-loop");
    let mut weights = Tensors::read(&m.a.join("model.safetensors"));
    let mut previous: Option<Vec<u32>> = None;
    for step in 1..=3u64 {
        weights.nudge(10 + step);
        let version = format!("step-{step}");
        let parts = weights.parts(2);
        let (st, v) = s.push("commit=false", &parts[0]);
        assert_eq!(st, 200, "{v}");
        let (st, v) = s.push(&format!("commit=true&weight_version={version}"), &parts[1]);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["weight_version"], json!(version));

        // Rollouts: 3 prompts × 2 samples, sampled, with log-probs.
        let mut seqs = Vec::new();
        let mut rollout_bits = Vec::new();
        for p in 0..3u64 {
            let prompt: Vec<u64> = (0..4 + p).map(|j| 7 + 13 * j + p).collect();
            let r = s.ok(
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 12, "n": 2, "temperature": 1.0,
                        "seed": step, "logprobs": 0, "sample_id": 10 * p}),
            );
            assert_eq!(r["weight_version"], json!(version));
            for c in r["choices"].as_array().expect("choices") {
                let (ids, lps, digests, _) = choice_bits(c);
                let mut tokens = prompt.clone();
                tokens.extend(&ids);
                seqs.push(json!({"id": seqs.len(), "tokens": tokens, "prompt_len": prompt.len()}));
                rollout_bits.push((lps, digests));
            }
        }
        // The trainer's checkpoint of the same weights, scored at TP 1.
        let ckpt = scratch.path().join(&version);
        weights.write_dir(&m.a, &ckpt);
        let input = scratch.path().join(format!("{version}.jsonl"));
        let lines: Vec<String> = seqs.iter().map(Value::to_string).collect();
        std::fs::write(&input, lines.join("\n") + "\n").expect("write score input");
        let out = scratch.path().join(format!("{version}-score.jsonl"));
        let o = run_arbor(&[
            "score",
            "--model",
            ckpt.to_str().expect("utf-8"),
            "--input",
            input.to_str().expect("utf-8"),
            "--out",
            out.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "arbor score: {:?}", text(&o));
        let scored = read_jsonl(&out);
        assert_eq!(scored.len(), rollout_bits.len());
        let mut all = Vec::new();
        for (sc, (lps, digests)) in scored.iter().zip(&rollout_bits) {
            let got: Vec<u32> = sc["logprobs"]
                .as_array()
                .expect("logprobs")
                .iter()
                .map(|l| (l.as_f64().expect("finite") as f32).to_bits())
                .collect();
            assert_eq!(
                &got, lps,
                "rollout log-probs (TP 2) != arbor score (TP 1) at {version}"
            );
            let d: Vec<String> = sc["logits_digest"]
                .as_array()
                .expect("digests")
                .iter()
                .map(|d| d.as_str().expect("hex").to_string())
                .collect();
            assert_eq!(&d, digests);
            all.extend(got);
        }
        // The update took effect: the log-probs moved with the weights.
        assert_ne!(previous.as_ref(), Some(&all), "{version}: nothing changed");
        previous = Some(all);
    }
}
