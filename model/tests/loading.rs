//! Checkpoint variants (sharded with an index, f32 / f16 on disk) and the TP=1 shadow.

mod common;

use std::sync::Arc;

use arbor_collective::{Communicator, InProcGroup, SingleComm};
use arbor_model::backend::cpu::CpuBackend;
use arbor_model::{
    Arch, DType, GenRequest, ModelError, OfflineRunner, Preset, Sampling, SynthOptions, Worker,
};
use common::*;

fn reqs() -> Vec<GenRequest> {
    vec![
        GenRequest {
            id: 1,
            prompt: prompt(1, 9),
            max_new_tokens: 5,
        },
        GenRequest {
            id: 2,
            prompt: prompt(2, 34),
            max_new_tokens: 4,
        },
    ]
}

fn gen(dir: &std::path::Path, tp: usize, shadow: bool) -> Vec<arbor_model::GenOutput> {
    let mut o = opts(dir);
    o.shadow_tp1 = shadow;
    let rs = on_ranks(tp, o, |mut r| r.generate(&reqs(), &Sampling::greedy(), 2));
    same_on_all_ranks(rs, |o| gen_keys(o))
}

/// f32 on disk rounds to the same bf16 weights as the bf16 checkpoint of the same seed,
/// so the outputs are bit-identical; the sharded copy (index + several files) too.
#[test]
fn sharded_and_f32_checkpoints_load_the_same_weights() {
    let base = tiny(Arch::Qwen3, 4);
    let f32_sharded = make(SynthOptions {
        dtype: Some(DType::F32),
        shard_bytes: Some(300_000),
        ..SynthOptions::new(Arch::Qwen3, Preset::Tiny, 4, "")
    });
    assert!(f32_sharded
        .path()
        .join("model.safetensors.index.json")
        .exists());
    assert!(!f32_sharded.path().join("model.safetensors").exists());
    let want = gen_keys(&gen(base.path(), 1, false));
    assert_eq!(gen_keys(&gen(f32_sharded.path(), 1, false)), want);
    assert_eq!(gen_keys(&gen(f32_sharded.path(), 4, false)), want);

    // f16 on disk: a different rounding, so only "loads and runs" is expected.
    let f16 = make(SynthOptions {
        dtype: Some(DType::F16),
        ..SynthOptions::new(Arch::Qwen3, Preset::Tiny, 4, "")
    });
    let out = gen(f16.path(), 2, false);
    assert!(out.iter().all(|o| o.logprobs.iter().all(|x| x.is_finite())));
}

#[test]
fn tokenizer_loads_and_round_trips() {
    let m = tiny(Arch::Llama, 1);
    let r = arbor_model::load(&opts(m.path()), Arc::new(SingleComm)).unwrap();
    let tok = r.tokenizer().expect("synthetic model has a tokenizer.json");
    let text = "Hello, wörld! 123";
    let enc = tok.encode(text, false).unwrap();
    assert!(enc
        .get_ids()
        .iter()
        .all(|&i| (i as usize) < r.config().vocab_size));
    assert_eq!(
        enc.get_ids().len(),
        text.len(),
        "one token per byte: {:?}",
        enc.get_ids()
    );
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
    assert!(tok.get_vocab_size(true) <= r.config().vocab_size);
}

/// With `shadow_tp1`, TP 2 and 8 run alongside a TP=1 copy and agree at every step.
#[test]
fn shadow_tp1_agrees() {
    let m = tiny(Arch::Llama, 6);
    let want = gen_keys(&gen(m.path(), 1, false));
    assert_eq!(gen_keys(&gen(m.path(), 2, true)), want);
    assert_eq!(gen_keys(&gen(m.path(), 8, true)), want);
}

/// The shadow comparison can fail: a shadow holding different weights is reported at
/// the first layer, naming the position and the difference.
#[test]
fn shadow_reports_the_first_divergence() {
    let a = tiny(Arch::Llama, 6);
    let b = tiny(Arch::Llama, 7);
    let (oa, ob) = (opts(a.path()), opts(b.path()));
    let handles: Vec<_> = InProcGroup::new(2)
        .into_iter()
        .map(|c| {
            let (oa, ob) = (oa.clone(), ob.clone());
            std::thread::spawn(move || -> Result<(), ModelError> {
                let c: Arc<dyn Communicator> = Arc::new(c);
                let main = Worker::new(CpuBackend::new(c), &oa)?;
                let shadow = Worker::new(CpuBackend::new(Arc::new(SingleComm)), &ob)?;
                let mut e = main.with_shadow(shadow);
                e.generate(&reqs(), &Sampling::greedy(), 0).map(|_| ())
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap().unwrap_err();
        let s = e.to_string();
        assert!(
            matches!(e, ModelError::ShadowDivergence { ref what, position: 0, id: 1, max_abs_diff, .. }
                if what == "hidden state after layer 0" && max_abs_diff > 0.0),
            "{s}"
        );
    }
}

/// A request stops at its first end-of-sequence token (finish = Eos) while the rest of the
/// batch goes on unchanged.
#[test]
fn eos_stops_one_request_only() {
    let m = tiny(Arch::Llama, 6);
    let base = gen(m.path(), 1, false);
    let stop = base[0].tokens[2];
    let path = m.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["eos_token_id"] = serde_json::json!([999_999, stop]);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let out = gen(m.path(), 2, false);
    for (o, b) in out.iter().zip(&base) {
        match b.tokens.iter().position(|&t| t == stop) {
            Some(i) => {
                assert_eq!(o.finish, arbor_model::FinishReason::Eos);
                assert_eq!(o.tokens, b.tokens[..=i].to_vec());
                assert_eq!(gen_key(o).2, gen_key(b).2[..=i].to_vec());
            }
            None => assert_eq!(gen_key(o), gen_key(b)),
        }
    }
    assert_eq!(
        out[0].tokens.len(),
        base[0].tokens.iter().position(|&t| t == stop).unwrap() + 1
    );
}
