//! Weight updates on a TP group of threads (`runner::weights_update`): a failure on one
//! rank leaves the old weights on every rank; a successful update gives the bits of a
//! fresh load of the new checkpoint; pushed tensors, release and resume.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arbor_collective::{Communicator, InProcGroup};
use arbor_model::batching::{ControlMsg, UpdateSource};
use arbor_model::runner::weights_update::{run_control, FailureKind, Origin};
use arbor_model::{load, Arch, GenOutput, GenRequest, Runner, Sampling};
use common::*;

fn reqs() -> Vec<GenRequest> {
    vec![
        GenRequest {
            id: 3,
            prompt: vec![5, 9, 200, 17],
            max_new_tokens: 5,
        },
        GenRequest {
            id: 4,
            prompt: (1..30).collect(),
            max_new_tokens: 3,
        },
    ]
}

fn keys(outs: &[GenOutput]) -> Vec<(Vec<u32>, Vec<u32>, Vec<u64>)> {
    outs.iter()
        .map(|o| {
            (
                o.tokens.clone(),
                o.logprobs.iter().map(|l| l.to_bits()).collect(),
                o.logits_digest.clone(),
            )
        })
        .collect()
}

type Keys = Vec<(Vec<u32>, Vec<u32>, Vec<u64>)>;

fn generate(r: &mut dyn Runner) -> Keys {
    let s = Sampling {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        seed: 5,
    };
    keys(&r.generate(&reqs(), &s, 0).expect("generate"))
}

/// A fresh TP 1 load of `dir`: the reference.
fn fresh(dir: &Path) -> Keys {
    let mut r = load(&opts(dir), Arc::new(arbor_collective::SingleComm)).expect("load");
    generate(r.as_mut())
}

/// Runs `f(rank, runner, comm)` on every rank of a TP group of threads over `dir`.
fn group<T: Send + 'static>(
    tp: usize,
    dir: &Path,
    f: impl Fn(usize, &mut dyn Runner, &dyn Communicator) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let o = opts(dir);
    let handles: Vec<_> = InProcGroup::new(tp)
        .into_iter()
        .map(|c| {
            let f = f.clone();
            let o = o.clone();
            std::thread::spawn(move || {
                let comm: Arc<dyn Communicator> = Arc::new(c);
                let mut r = load(&o, comm.clone()).expect("load");
                f(comm.rank(), r.as_mut(), comm.as_ref())
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// The model's safetensors file, whole.
fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).expect("read weights")
}

#[test]
fn one_rank_failing_leaves_the_old_weights_everywhere() {
    let a = tiny(Arch::Llama, 7);
    let b = tiny(Arch::Llama, 8);
    let (want_a, want_b) = (fresh(a.path()), fresh(b.path()));
    assert_ne!(want_a, want_b);
    let b_dir = b.path().to_path_buf();
    let outs = group(2, a.path(), move |rank, r, comm| {
        let before = generate(r);
        // Rank 1 cannot read its checkpoint: nobody swaps.
        let src = if rank == 1 {
            PathBuf::from("/nonexistent/arbor-checkpoint")
        } else {
            b_dir.clone()
        };
        let e = run_control(r, comm, ControlMsg::Update(UpdateSource::Disk(src)))
            .expect("the ranks agree")
            .expect_err("rank 1 failed");
        assert_eq!(e.kind, FailureKind::Input);
        assert_eq!(e.failures.len(), 1, "{e}");
        assert_eq!(e.failures[0].0, 1);
        assert!(
            e.to_string().contains("/nonexistent/arbor-checkpoint"),
            "{e}"
        );
        let after_failure = generate(r);
        // Then every rank reads B: B's bits.
        run_control(
            r,
            comm,
            ControlMsg::Update(UpdateSource::Disk(b_dir.clone())),
        )
        .expect("agree")
        .expect("update");
        assert_eq!(r.weights_state().origin, Origin::Disk(b_dir.clone()));
        (before, after_failure, generate(r))
    });
    for (before, after_failure, after_update) in outs {
        assert_eq!(before, want_a);
        assert_eq!(after_failure, want_a, "a failed update changed the weights");
        assert_eq!(
            after_update, want_b,
            "the update does not give a fresh load's bits"
        );
    }
}

#[test]
fn pushed_tensors_stage_on_every_rank_or_none() {
    let a = tiny(Arch::Qwen3, 1);
    let b = tiny(Arch::Qwen3, 2);
    let want_b = fresh(b.path());
    let want_a = fresh(a.path());
    let pushed = weights(b.path());
    let outs = group(4, a.path(), move |rank, r, comm| {
        // Rank 2 gets a corrupt part: every rank drops what it staged.
        let bytes = if rank == 2 {
            pushed[..pushed.len() / 2].to_vec()
        } else {
            pushed.clone()
        };
        let stage = |bytes: Vec<u8>| ControlMsg::Stage {
            label: "test part".into(),
            bytes,
        };
        let e = run_control(r, comm, stage(bytes))
            .expect("agree")
            .expect_err("rank 2 failed");
        assert_eq!(e.failures.iter().map(|f| f.0).collect::<Vec<_>>(), [2]);
        assert_eq!(r.weights_state().staged_tensors, 0);
        // Nothing staged: the commit names a missing tensor, and nothing changes.
        let e = run_control(r, comm, ControlMsg::Update(UpdateSource::Staged))
            .expect("agree")
            .expect_err("nothing staged");
        assert!(e.to_string().contains("missing"), "{e}");
        let after_failures = generate(r);
        run_control(r, comm, stage(pushed.clone()))
            .expect("agree")
            .expect("stage");
        let st = r.weights_state();
        assert!(st.staged_tensors > 0 && st.staged_bytes > 0);
        run_control(r, comm, ControlMsg::Update(UpdateSource::Staged))
            .expect("agree")
            .expect("commit");
        let st = r.weights_state();
        assert_eq!((st.staged_tensors, st.origin), (0, Origin::Pushed));
        let after_push = generate(r);
        // Pushed weights have no copy on disk: released, they cannot come back alone.
        run_control(
            r,
            comm,
            ControlMsg::Release {
                weights: true,
                kv: false,
            },
        )
        .expect("agree")
        .expect("release");
        assert!(r
            .generate(&reqs(), &Sampling::greedy(), 0)
            .unwrap_err()
            .to_string()
            .contains("released"));
        let resume = |from: Option<PathBuf>| ControlMsg::Resume {
            weights: true,
            kv: false,
            from,
        };
        let e = run_control(r, comm, resume(None))
            .expect("agree")
            .expect_err("no copy on disk");
        assert_eq!(e.kind, FailureKind::State);
        (after_failures, after_push)
    });
    for (after_failures, after_push) in outs {
        assert_eq!(after_failures, want_a);
        assert_eq!(after_push, want_b);
    }
}

#[test]
fn release_and_resume_give_back_the_same_bits() {
    let a = tiny(Arch::Llama, 3);
    let b = tiny(Arch::Llama, 4);
    let want_b = fresh(b.path());
    let b_dir = b.path().to_path_buf();
    let outs = group(2, a.path(), move |_, r, comm| {
        // The KV cache is made at load; generate runs on it.
        assert!(r.weights_state().kv_loaded);
        let before = generate(r);
        let release = ControlMsg::Release {
            weights: true,
            kv: true,
        };
        run_control(r, comm, release)
            .expect("agree")
            .expect("release");
        let st = r.weights_state();
        assert!(!st.weights_loaded && !st.kv_loaded);
        // The KV cache cannot come back before the weights.
        let kv_only = ControlMsg::Resume {
            weights: false,
            kv: true,
            from: None,
        };
        let e = run_control(r, comm, kv_only)
            .expect("agree")
            .expect_err("no weights");
        assert_eq!(e.kind, FailureKind::State);
        let all = |from| ControlMsg::Resume {
            weights: true,
            kv: true,
            from,
        };
        run_control(r, comm, all(None))
            .expect("agree")
            .expect("resume");
        let st = r.weights_state();
        assert!(st.weights_loaded && st.kv_loaded);
        let resumed = generate(r);
        // Released again, and back from another checkpoint.
        let release = ControlMsg::Release {
            weights: true,
            kv: true,
        };
        run_control(r, comm, release)
            .expect("agree")
            .expect("release");
        run_control(r, comm, all(Some(b_dir.clone())))
            .expect("agree")
            .expect("resume from B");
        (before, resumed, generate(r))
    });
    for (before, resumed, from_b) in outs {
        assert_eq!(before, resumed);
        assert_eq!(from_b, want_b);
    }
}

#[test]
fn a_checkpoint_of_another_model_is_refused() {
    let a = tiny(Arch::Llama, 1);
    let q = tiny(Arch::Qwen3, 1);
    let q_dir = q.path().to_path_buf();
    let outs = group(1, a.path(), move |_, r, comm| {
        let e = run_control(
            r,
            comm,
            ControlMsg::Update(UpdateSource::Disk(q_dir.clone())),
        )
        .expect("agree")
        .expect_err("another architecture");
        (e.kind, e.to_string())
    });
    let (kind, msg) = &outs[0];
    assert_eq!(*kind, FailureKind::Input);
    assert!(msg.contains("not the served model"), "{msg}");
}
