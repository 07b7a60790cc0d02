//! The model on the CUDA backend (skipped with a printed reason where no GPU is usable;
//! scripts/gpu/gpu-check.sh runs this test binary on the lent GPU machines):
//! - GPU logits match the CPU backend's within bf16 tolerance (the measured relative
//!   error is printed), for the Llama and Qwen3 tiny models, with invariant and with fast
//!   (cuBLAS) numerics;
//! - on the GPU, prefill and decode give bit-identical logits, and so does a row's
//!   position inside a batch (each sequence's blocks in reverse order in the paged cache);
//! - decode steps from CUDA graphs, long prompts and the prefix cache give the bits of
//!   op by op recomputation;
//! - constrained rows (structured output's token masks) drawn on the host give the same
//!   bits from recorded steps, op by op and alone (with a CPU twin that runs anywhere).
//! - mixture-of-experts models (Qwen3-MoE, Mixtral): GPU logits near the CPU's, prefill ==
//!   decode == a row in a batch, and steps run through `run_step` (where decode steps are
//!   recorded) equal to op by op.
//! - weights cut from tensors in device memory (what a trainer's NCCL broadcast leaves
//!   there) equal a host load's, and a non-finite value is refused naming the tensor (with
//!   a CPU twin that runs anywhere).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arbor_collective::{Communicator, SingleComm};
use arbor_model::backend::cpu::CpuBackend;
use arbor_model::backend::cuda::CudaBackend;
use arbor_model::backend::{Backend, KvRows, SeqRows};
use arbor_model::forward::Model;
use arbor_model::layers::LoadCtx;
use arbor_model::weights::WeightStore;
use arbor_model::{make_model, Arch, ModelConfig, Numerics, Preset, SynthOptions};

fn gpu_usable() -> bool {
    match arbor_kernels::cuda::probe::driver() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn tiny(arch: Arch, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("arbor-gpu-model-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    make_model(&SynthOptions::new(arch, Preset::Tiny, 11, &dir)).expect("making the tiny model");
    dir
}

fn load<B: Backend>(b: &B, dir: &Path) -> Model<B> {
    let cfg = ModelConfig::from_dir(dir).expect("config");
    let store = WeightStore::open(dir).expect("weights");
    let ctx = LoadCtx {
        backend: b,
        store: &store,
        rank: 0,
        tp: 1,
        row_tp: 1,
    };
    Model::load(&ctx, &cfg, 256).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// Blocks of the caches below: 4 per sequence (256 positions), sequence i's in reverse
/// order from block 4·i + 3, so no sequence's positions lie in block order.
const BLOCKS_PER_SEQ: usize = 4;

fn table_of(i: usize) -> Vec<u32> {
    (0..BLOCKS_PER_SEQ as u32)
        .rev()
        .map(|b| (i * BLOCKS_PER_SEQ) as u32 + b)
        .collect()
}

/// Logits of every position of every sequence, all sequences prefilled as one batch.
fn prefill<B: Backend>(b: &B, m: &Model<B>, seqs_tokens: &[Vec<u32>]) -> Vec<f32> {
    let mut cache = b
        .kv_cache(m.kv_spec(seqs_tokens.len() * BLOCKS_PER_SEQ))
        .expect("kv cache");
    let mut ids = Vec::new();
    let mut seqs = Vec::new();
    let mut table = Vec::new();
    for (i, t) in seqs_tokens.iter().enumerate() {
        seqs.push(SeqRows {
            row0: ids.len(),
            len: t.len(),
            pos0: 0,
            table0: table.len(),
        });
        let blocks = arbor_kernels::paged::blocks_for(t.len());
        table.extend_from_slice(&table_of(i)[..blocks]);
        ids.extend_from_slice(t);
    }
    let rows: Vec<usize> = (0..ids.len()).collect();
    let kv = KvRows {
        seqs: &seqs,
        table: &table,
    };
    m.forward(b, &mut cache, &ids, kv, &rows, None)
        .expect("forward")
}

/// Logits of every position of one sequence, produced one token at a time.
fn decode<B: Backend>(b: &B, m: &Model<B>, tokens: &[u32]) -> Vec<f32> {
    let mut cache = b.kv_cache(m.kv_spec(2 * BLOCKS_PER_SEQ)).expect("kv cache");
    let table = table_of(1);
    let mut out = Vec::new();
    for (p, &t) in tokens.iter().enumerate() {
        let seqs = [SeqRows {
            row0: 0,
            len: 1,
            pos0: p,
            table0: 0,
        }];
        let kv = KvRows {
            seqs: &seqs,
            table: &table[..arbor_kernels::paged::blocks_for(p + 1)],
        };
        out.extend(
            m.forward(b, &mut cache, &[t], kv, &[0], None)
                .expect("decode step"),
        );
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        (0..45).map(|i| (i * 37 + 5) % 250).collect(), // spans two attention blocks
        vec![3, 1, 4, 1, 5, 9, 2, 6],
        (0..20).map(|i| (i * 11 + 2) % 250).collect(),
    ]
}

#[test]
fn gpu_logits_match_cpu_within_bf16_tolerance() {
    if !gpu_usable() {
        return;
    }
    for (arch, tag, numerics) in [
        (Arch::Llama, "llama", Numerics::Invariant),
        (Arch::Qwen2, "qwen2", Numerics::Invariant),
        (Arch::Qwen3, "qwen3", Numerics::Invariant),
        (Arch::Llama, "llama-fast", Numerics::Fast),
        (Arch::Qwen3, "qwen3-fast", Numerics::Fast),
    ] {
        let dir = tiny(arch, tag);
        let comm: Arc<dyn Communicator> = Arc::new(SingleComm);
        let cpu = CpuBackend::new(comm.clone());
        let gpu =
            CudaBackend::new(comm, numerics).unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        let (mc, mg) = (load(&cpu, &dir), load(&gpu, &dir));
        let p = prompts();
        let (lc, lg) = (prefill(&cpu, &mc, &p), prefill(&gpu, &mg, &p));
        assert_eq!(lc.len(), lg.len());
        let max_ref = lc.iter().fold(0f64, |a, &v| a.max((v as f64).abs()));
        let max_abs = lc
            .iter()
            .zip(&lg)
            .fold(0f64, |a, (&c, &g)| a.max((c as f64 - g as f64).abs()));
        let l2 = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let rel_l2 = l2(&mut lc.iter().zip(&lg).map(|(&c, &g)| c as f64 - g as f64))
            / l2(&mut lc.iter().map(|&c| c as f64));
        let rel_max = max_abs / max_ref;
        let same = lc
            .iter()
            .zip(&lg)
            .filter(|(c, g)| c.to_bits() == g.to_bits())
            .count();
        println!(
            "CPU vs GPU logits ({tag} tiny, {} values): max |diff| {max_abs:.3e}, max |diff| / max |logit| {rel_max:.3e}, \
             relative L2 {rel_l2:.3e}, bit-equal {same}",
            lc.len()
        );
        assert!(
            rel_max.is_finite() && rel_max < 2e-2,
            "{tag}: CPU and GPU differ beyond bf16 tolerance: {rel_max}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn gpu_prefill_decode_and_batch_are_bit_identical() {
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [
        (Arch::Llama, "llama-inv"),
        (Arch::Qwen3, "qwen3-inv"),
        (Arch::Qwen3Moe, "qwen3-moe-inv"),
        (Arch::Mixtral, "mixtral-inv"),
    ] {
        let dir = tiny(arch, tag);
        let gpu = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        let m = load(&gpu, &dir);
        let vocab = m.cfg.vocab_size;
        let p = prompts();
        let batch = prefill(&gpu, &m, &p);
        let mut row0 = 0;
        for (i, t) in p.iter().enumerate() {
            let alone = prefill(&gpu, &m, std::slice::from_ref(t));
            let in_batch = &batch[row0 * vocab..(row0 + t.len()) * vocab];
            assert_eq!(
                bits(&alone),
                bits(in_batch),
                "{tag}: prompt {i} alone ≠ in the batch"
            );
            let dec = decode(&gpu, &m, t);
            assert_eq!(
                bits(&dec),
                bits(&alone),
                "{tag}: prompt {i}: decode ≠ prefill"
            );
            row0 += t.len();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A generate's outputs as bits, for exact comparison.
type OutBits = Vec<(Vec<u32>, Vec<u32>, Vec<Vec<(u32, u32)>>, Vec<u64>)>;

fn out_bits(outs: &[arbor_model::GenOutput]) -> OutBits {
    outs.iter()
        .map(|o| {
            (
                o.tokens.clone(),
                bits(&o.logprobs),
                o.top
                    .iter()
                    .map(|t| t.iter().map(|x| (x.token, x.logprob.to_bits())).collect())
                    .collect(),
                o.logits_digest.clone(),
            )
        })
        .collect()
}

/// Decode steps replayed from CUDA graphs (padded to their batch bucket with copies of
/// row 0) give the bits of the same steps run op by op, and of each request alone; the
/// batch shrinks as requests finish, so several buckets are recorded. Covers greedy,
/// top-N log-probs and top-k candidates selected on the GPU, the GPU's Gumbel draw, and
/// a top-p draw whose rows come to the host.
#[test]
fn gpu_recorded_decode_steps_match_op_by_op() {
    use arbor_model::runner::{Device, GenRequest, LoadOptions, OfflineRunner, Worker};
    use arbor_model::Sampling;
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [(Arch::Llama, "llama-graph"), (Arch::Qwen3, "qwen3-graph")] {
        let dir = tiny(arch, tag);
        let engine = |record: bool| {
            let b = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
                .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
            b.set_recording(record);
            let opts = LoadOptions {
                model_dir: dir.clone(),
                device: Device::Cuda,
                max_seq_len: Some(256),
                shadow_tp1: false,
                numerics: Numerics::Invariant,
                rank_of_tp: None,
                // Two engines share the GPU: a small cache each.
                kv: arbor_model::KvOptions {
                    blocks: Some(64),
                    ..Default::default()
                },
            };
            Worker::new(b, &opts).unwrap_or_else(|e| panic!("{tag}: loading: {e}"))
        };
        let (mut rec, mut ops) = (engine(true), engine(false));
        let lens = [45usize, 8, 20, 3, 1];
        let news = [12usize, 7, 12, 3, 9];
        let reqs: Vec<GenRequest> = lens
            .iter()
            .zip(news)
            .enumerate()
            .map(|(i, (&len, new))| GenRequest {
                id: 100 + i as u64,
                prompt: (0..len)
                    .map(|j| ((j * 31 + i * 7 + 3) % 250) as u32)
                    .collect(),
                max_new_tokens: new,
            })
            .collect();
        let sampled = |temperature, top_k, top_p| Sampling {
            temperature,
            top_k,
            top_p,
            seed: 5,
        };
        let cases = [
            ("greedy", Sampling::greedy(), 0),
            ("greedy top-3", Sampling::greedy(), 3),
            ("top-k 20 top-p 0.9 top-2", sampled(0.8, 20, 0.9), 2),
            ("temperature", sampled(0.7, 0, 1.0), 0),
            ("top-p (host rows)", sampled(0.9, 0, 0.8), 0),
        ];
        for (what, s, n_top) in cases {
            let got = rec.generate(&reqs, &s, n_top).expect("generate, recorded");
            let want = ops.generate(&reqs, &s, n_top).expect("generate, op by op");
            assert_eq!(
                out_bits(&got),
                out_bits(&want),
                "{tag} {what}: recorded decode steps differ from op by op"
            );
            for (i, r) in reqs.iter().enumerate() {
                let alone = rec
                    .generate(std::slice::from_ref(r), &s, n_top)
                    .expect("generate alone");
                assert_eq!(
                    out_bits(&alone),
                    out_bits(&got[i..=i]),
                    "{tag} {what}: request {i} alone differs from the recorded batch"
                );
            }
        }
        let (recorded, replays) = rec.backend().recorded_steps().expect("recording is on");
        println!("{tag}: {recorded} decode shapes recorded, {replays} steps from recordings");
        assert!(
            recorded >= 3 && replays > recorded,
            "{tag}: {recorded} / {replays}"
        );
        assert_eq!(ops.backend().recorded_steps(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Long prompts on the GPU: prompts of 600 to 1100 tokens, half of them sharing
/// a 300-token prefix (prefill tiles, keys in up to three splits of 512), generated with
/// CUDA graphs and the prefix cache give the bits of op by op without it, cold and warm,
/// and of each request alone; their decode steps are recorded (at a split bucket of 4),
/// and the prefix cache served blocks.
#[test]
fn gpu_long_prompts_with_the_prefix_cache_match_recomputation() {
    use arbor_model::runner::{Device, GenRequest, LoadOptions, OfflineRunner, Worker};
    use arbor_model::{KvOptions, Sampling};
    if !gpu_usable() {
        return;
    }
    let dir = tiny(Arch::Llama, "llama-long");
    let engine = |record: bool, prefix_cache: bool| {
        let b = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        b.set_recording(record);
        let opts = LoadOptions {
            model_dir: dir.clone(),
            device: Device::Cuda,
            max_seq_len: Some(1200),
            shadow_tp1: false,
            numerics: Numerics::Invariant,
            rank_of_tp: None,
            // Two engines share the GPU: 1024 blocks each (a few MiB on the tiny model).
            kv: KvOptions {
                blocks: Some(1024),
                prefix_cache,
                ..Default::default()
            },
        };
        Worker::new(b, &opts).unwrap_or_else(|e| panic!("loading: {e}"))
    };
    let shared: Vec<u32> = (0..300).map(|j| ((j * 131 + 7) % 250) as u32).collect();
    let reqs: Vec<GenRequest> = [600usize, 1100, 700, 1000, 513, 900]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut prompt: Vec<u32> = if i % 2 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            prompt.extend((prompt.len()..len).map(|j| ((j * 31 + i * 7 + 3) % 250) as u32));
            GenRequest {
                id: 200 + i as u64,
                prompt,
                max_new_tokens: 30,
            }
        })
        .collect();
    let (mut rec, mut ops) = (engine(true, true), engine(false, false));
    let s = Sampling {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        seed: 4,
    };
    let got = rec
        .generate(&reqs, &s, 2)
        .expect("generate, graphs + prefix cache");
    let want = ops
        .generate(&reqs, &s, 2)
        .expect("generate, op by op, no cache");
    assert_eq!(
        out_bits(&got),
        out_bits(&want),
        "graphs + prefix cache differ from op by op without it"
    );
    // Again on the warm cache: every shared prefix is found now.
    let again = rec.generate(&reqs, &s, 2).expect("generate, warm cache");
    assert_eq!(out_bits(&again), out_bits(&want), "the warm prefix cache");
    for (i, r) in reqs.iter().enumerate().step_by(2) {
        let alone = ops.generate(std::slice::from_ref(r), &s, 2).expect("alone");
        assert_eq!(out_bits(&alone), out_bits(&got[i..=i]), "request {i} alone");
    }
    let (stats, cached) = rec.prefix_cache_stats().expect("the cache ran");
    println!(
        "long prompts: {} of {} prompt positions from the prefix cache, {cached} blocks cached",
        stats.hits, stats.queried
    );
    assert!(stats.hits >= 2 * 4 * 64, "{stats:?}");
    // The six requests start and end together: one batch bucket, one split bucket (their
    // longest context sets it), so one recorded shape serves the decode steps of both
    // generate calls (29 each): every one but the recording run is a replay.
    let (recorded, replays) = rec.backend().recorded_steps().expect("recording is on");
    assert!(
        recorded >= 1 && recorded + replays >= 2 * 29,
        "{recorded} shapes recorded, {replays} steps replayed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A constraint of the tests below: after `generated`, the ids `t` with `t % 7` equal to a
/// function of how many tokens came and the last one (so each step's mask differs).
struct Modular {
    vocab: usize,
    later: bool,
}

/// How [`session_outputs`] constrains its requests.
#[derive(Clone, Copy, PartialEq)]
enum Masks {
    None,
    /// A [`Modular`] mask computed with the plan.
    WithPlan,
    /// A [`Modular`] mask computed while the step runs (`mask_later`).
    Later,
}

impl Modular {
    fn class(generated: &[u32]) -> u32 {
        (generated.len() as u32 * 3 + generated.last().copied().unwrap_or(0)) % 7
    }
}

impl arbor_model::constraint::TokenConstraint for Modular {
    fn allowed(&mut self, generated: &[u32]) -> arbor_model::constraint::TokenMask {
        let k = Self::class(generated);
        let ids: Vec<u32> = (0..self.vocab as u32).filter(|t| t % 7 == k).collect();
        arbor_model::constraint::TokenMask::from_ids(&ids, self.vocab)
    }

    fn masks_later(&mut self, _generated: &[u32]) -> bool {
        self.later
    }
}

/// One request's records as they arrive: tokens, log-probs, top-N, digests.
type Collected = (
    Vec<u32>,
    Vec<f32>,
    Vec<Vec<arbor_model::TokenLogprob>>,
    Vec<u64>,
);

/// Each request's (tokens, log-prob bits, top-N bits, digests) from a serving session's
/// scheduler over `w`, all requests at once or each alone; `masks` gives each its own
/// [`Modular`] constraint or none. Checks that every constrained token was allowed.
fn session_outputs<B: Backend>(
    w: &mut arbor_model::runner::Worker<B>,
    prompts: &[Vec<u32>],
    s: &arbor_model::Sampling,
    n_top: usize,
    masks: Masks,
    together: bool,
) -> OutBits {
    use arbor_model::batching::{Event, Scheduler, SchedulerConfig, SeqSpec};
    use arbor_model::constraint::Constraint;
    use arbor_model::runner::{ModelInfo, SessionRunner};
    let vocab = w.config().vocab_size;
    let cap = w.kv_capacity().expect("a KV cache").clone();
    let cfg = SchedulerConfig {
        max_running: 16,
        max_seq_len: cap.max_seq_len,
        chunk: 64,
        step_tokens: 256,
        prefill_beside_decode: 256,
        row_multiple: 1,
        step_outputs: 1024,
        kv_blocks: cap.blocks,
        eos: w.eos_token_ids().to_vec(),
        preempt: false,
        prefill_first: false,
        prefix_cache: false,
    };
    let groups: Vec<Vec<usize>> = if together {
        vec![(0..prompts.len()).collect()]
    } else {
        (0..prompts.len()).map(|i| vec![i]).collect()
    };
    let mut out: Vec<Collected> = vec![Default::default(); prompts.len()];
    for group in groups {
        let mut sched = Scheduler::new(cfg.clone()).expect("scheduler");
        let mut of = std::collections::HashMap::new();
        for &i in &group {
            let mut spec = SeqSpec::greedy(300 + i as u64, prompts[i].clone(), 10);
            spec.sampling = *s;
            spec.n_top = n_top;
            spec.ignore_eos = true;
            spec.constraint = (masks != Masks::None).then(|| {
                Constraint::new(Modular {
                    vocab,
                    later: masks == Masks::Later,
                })
            });
            of.insert(sched.submit(spec).expect("submit"), i);
        }
        while !sched.is_idle() {
            let plan = sched.plan();
            let res = w
                .execute(&plan, &mut || sched.late_masks(&plan))
                .expect("execute");
            for ev in sched.apply(&plan, &res).expect("apply") {
                if let Event::Token { seq, record } = ev {
                    let o = &mut out[of[&seq]];
                    if masks != Masks::None {
                        assert_eq!(record.token % 7, Modular::class(&o.0), "a disallowed token");
                    }
                    o.0.push(record.token);
                    o.1.push(record.logprob);
                    o.2.push(record.top);
                    o.3.push(record.digest);
                }
            }
        }
    }
    out.into_iter()
        .map(|(t, lp, top, d)| {
            (
                t,
                bits(&lp),
                top.iter()
                    .map(|t| t.iter().map(|x| (x.token, x.logprob.to_bits())).collect())
                    .collect(),
                d,
            )
        })
        .collect()
}

fn constrained_prompts() -> Vec<Vec<u32>> {
    [30usize, 5, 70, 1]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|j| ((j * 13 + i * 5 + 1) % 250) as u32)
                .collect()
        })
        .collect()
}

fn constrained_cases() -> Vec<(&'static str, arbor_model::Sampling, usize)> {
    let sampled = |temperature, top_k, top_p| arbor_model::Sampling {
        temperature,
        top_k,
        top_p,
        seed: 9,
    };
    vec![
        ("greedy", arbor_model::Sampling::greedy(), 0),
        ("greedy top-3", arbor_model::Sampling::greedy(), 3),
        ("temperature", sampled(0.8, 0, 1.0), 0),
        ("top-k top-p top-2", sampled(1.0, 20, 0.9), 2),
        ("top-p", sampled(0.9, 0, 0.8), 1),
    ]
}

/// Constrained rows (structured output's token masks) on the CPU backend: each request
/// gives the same bits alone and among the others, draws only allowed tokens, and the
/// mask changes the output. The CPU twin of `gpu_constrained_rows_...` below.
#[test]
fn cpu_constrained_rows_are_the_same_alone_and_in_a_batch() {
    use arbor_model::runner::{Device, LoadOptions, Worker};
    let dir = tiny(Arch::Llama, "cpu-constrained");
    let opts = LoadOptions {
        model_dir: dir.clone(),
        device: Device::Cpu,
        max_seq_len: Some(256),
        shadow_tp1: false,
        numerics: Numerics::Invariant,
        rank_of_tp: None,
        kv: arbor_model::KvOptions {
            blocks: Some(64),
            ..Default::default()
        },
    };
    let mut w = Worker::new(CpuBackend::new(Arc::new(SingleComm)), &opts).expect("loading");
    arbor_model::runner::SessionRunner::start_session(&mut w).expect("session");
    let prompts = constrained_prompts();
    for (what, s, n_top) in constrained_cases() {
        let batch = session_outputs(&mut w, &prompts, &s, n_top, Masks::WithPlan, true);
        let alone = session_outputs(&mut w, &prompts, &s, n_top, Masks::WithPlan, false);
        assert_eq!(batch, alone, "{what}: alone differs from the batch");
        let later = session_outputs(&mut w, &prompts, &s, n_top, Masks::Later, true);
        assert_eq!(batch, later, "{what}: masks computed later differ");
        let free = session_outputs(&mut w, &prompts, &s, n_top, Masks::None, true);
        assert_ne!(batch, free, "{what}: the mask changed nothing");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Constrained rows on the GPU: their logits rows come to the host after the step (also
/// when the step replays a CUDA graph) and are drawn there from the masked row, so a
/// request gives the same bits from recorded steps, op by op, and alone; only allowed
/// tokens are drawn; the mask changes the output.
#[test]
fn gpu_constrained_rows_match_op_by_op_and_alone() {
    use arbor_model::runner::{Device, LoadOptions, Worker};
    if !gpu_usable() {
        return;
    }
    let dir = tiny(Arch::Llama, "gpu-constrained");
    let engine = |record: bool| {
        let b = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        b.set_recording(record);
        let opts = LoadOptions {
            model_dir: dir.clone(),
            device: Device::Cuda,
            max_seq_len: Some(256),
            shadow_tp1: false,
            numerics: Numerics::Invariant,
            rank_of_tp: None,
            kv: arbor_model::KvOptions {
                blocks: Some(64),
                ..Default::default()
            },
        };
        let mut w = Worker::new(b, &opts).unwrap_or_else(|e| panic!("loading: {e}"));
        arbor_model::runner::SessionRunner::start_session(&mut w).expect("session");
        w
    };
    let (mut rec, mut ops) = (engine(true), engine(false));
    let prompts = constrained_prompts();
    for (what, s, n_top) in constrained_cases() {
        let got = session_outputs(&mut rec, &prompts, &s, n_top, Masks::WithPlan, true);
        let want = session_outputs(&mut ops, &prompts, &s, n_top, Masks::WithPlan, true);
        assert_eq!(got, want, "{what}: recorded steps differ from op by op");
        let alone = session_outputs(&mut rec, &prompts, &s, n_top, Masks::WithPlan, false);
        assert_eq!(got, alone, "{what}: alone differs from the batch");
        let later = session_outputs(&mut rec, &prompts, &s, n_top, Masks::Later, true);
        assert_eq!(got, later, "{what}: masks computed later differ");
        let free = session_outputs(&mut rec, &prompts, &s, n_top, Masks::None, true);
        assert_ne!(got, free, "{what}: the mask changed nothing");
    }
    let (recorded, replays) = rec.backend().recorded_steps().expect("recording is on");
    println!("constrained: {recorded} decode shapes recorded, {replays} steps from recordings");
    assert!(replays > 0, "no step replayed a recording");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The GPU's masked draws (constrained rows drawn where the logits are) against the host
/// definition `constraint::draw_masked`, and the CPU backend's: exact for greedy rows;
/// for temperature rows the host's token or one whose key is within rounding of it (the
/// device's `logf` may differ from the host's `ln` in the last bit, as for the unmasked
/// draw). Rows of ties, NaN, ±∞, sparse and dense masks, a row with only −∞ allowed
/// (no draw: the host's fallback rules decide), padding columns past the vocabulary.
#[test]
fn gpu_masked_draws_match_the_host_definition() {
    use arbor_model::backend::MaskedRow;
    use arbor_model::constraint::{draw_masked, TokenMask};
    use arbor_model::sampling::{GumbelDraw, MaskedDraw};
    if !gpu_usable() {
        return;
    }
    let gpu = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
        .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
    let cpu = CpuBackend::new(Arc::new(SingleComm));
    let (vocab, cols, rows) = (50_000usize, 50_008usize, 12usize);
    let mut z = 5u64;
    let mut next = || {
        z = arbor_kernels::cpu::gumbel::splitmix64(z);
        z
    };
    let mut logits: Vec<f32> = (0..rows * cols)
        // Coarse values: many ties.
        .map(|_| ((next() >> 52) as f32 - 2048.0) / 128.0)
        .collect();
    logits[cols + 3] = f32::NAN;
    logits[cols + 9] = f32::INFINITY;
    logits[2 * cols + vocab + 1] = 1e30;
    let mut masks = Vec::new();
    for r in 0..rows {
        let ids: Vec<u32> = match r % 4 {
            0 => vec![1, 17, 31, 32, 33, 49_999],
            1 => (0..vocab as u32).filter(|i| i % 3 != 0).collect(),
            2 => (0..vocab as u32).filter(|_| next() % 50 == 0).collect(),
            _ => vec![(next() % vocab as u64) as u32],
        };
        masks.push(TokenMask::from_ids(&ids, vocab));
    }
    // Row 11: only −∞ allowed.
    if let TokenMask::Ids(ids) = &masks[11] {
        logits[11 * cols + ids[0] as usize] = f32::NEG_INFINITY;
    }
    let draws: Vec<MaskedDraw> = (0..rows)
        .map(|r| match r % 3 {
            0 => MaskedDraw::Argmax,
            _ => MaskedDraw::Gumbel(GumbelDraw {
                inv_t: [1.0, 1.0 / 0.7, 1.0 / 1e-4][r % 3],
                key: next(),
            }),
        })
        .collect();
    // Every row but 4 and 8, in a scrambled order.
    let order = [7usize, 0, 11, 2, 9, 1, 10, 3, 5, 6];
    let masked: Vec<MaskedRow> = order
        .iter()
        .map(|&r| MaskedRow {
            row: r,
            draw: draws[r],
            mask: &masks[r],
        })
        .collect();
    let on_gpu = gpu.act_from_host(&logits, rows, cols).expect("upload");
    let got = gpu
        .masked_draws(&on_gpu, vocab, &masked)
        .expect("GPU draws");
    let on_cpu = cpu.act_from_host(&logits, rows, cols).expect("CPU logits");
    let host = cpu
        .masked_draws(&on_cpu, vocab, &masked)
        .expect("CPU draws");
    for (j, m) in masked.iter().enumerate() {
        let row = &logits[m.row * cols..m.row * cols + vocab];
        let want = draw_masked(row, m.mask, m.draw);
        assert_eq!(host[j].map(|d| d.0), want, "row {}: the CPU backend", m.row);
        match (got[j], want, m.draw) {
            (None, None, _) => {}
            (Some((t, v)), Some(w), MaskedDraw::Argmax) => {
                assert_eq!(t, w, "row {}", m.row);
                assert_eq!(v.to_bits(), row[t as usize].to_bits(), "row {}", m.row);
            }
            (Some((t, v)), Some(w), MaskedDraw::Gumbel(d)) => {
                let key =
                    |i: u32| arbor_model::sampling::gumbel_key(row[i as usize], i as usize, d);
                assert!(m.mask.allows(t), "row {}: drew {t}, not allowed", m.row);
                assert!(
                    t == w || (key(t) - key(w)).abs() <= 1e-5 * key(w).abs(),
                    "row {}: drew {t} (key {}), host {w} (key {})",
                    m.row,
                    key(t),
                    key(w)
                );
                assert_eq!(v.to_bits(), row[t as usize].to_bits(), "row {}", m.row);
            }
            (g, w, _) => panic!("row {}: GPU {g:?}, host {w:?}", m.row),
        }
    }
    assert!(got[2].is_none(), "row 11 allows only −∞: no draw");
}

/// Mixture-of-experts models on the GPU against the CPU backend: a token whose router
/// logits differ in the last bits between the backends may take another expert, so the
/// bound is per row: nearly every row within bf16 noise, and the whole within a loose
/// relative L2.
#[test]
fn gpu_moe_logits_match_cpu_but_for_rerouted_rows() {
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [(Arch::Qwen3Moe, "qwen3-moe"), (Arch::Mixtral, "mixtral")] {
        let dir = tiny(arch, &format!("{tag}-cpu-gpu"));
        let comm: Arc<dyn Communicator> = Arc::new(SingleComm);
        let cpu = CpuBackend::new(comm.clone());
        let gpu = CudaBackend::new(comm, Numerics::Invariant)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        let (mc, mg) = (load(&cpu, &dir), load(&gpu, &dir));
        let vocab = mc.cfg.vocab_size;
        let p = prompts();
        let (lc, lg) = (prefill(&cpu, &mc, &p), prefill(&gpu, &mg, &p));
        assert_eq!(lc.len(), lg.len());
        let rows = lc.len() / vocab;
        let rel_of = |c: &[f32], g: &[f32]| {
            let max_ref = c.iter().fold(0f64, |a, &v| a.max((v as f64).abs()));
            let max_abs = c
                .iter()
                .zip(g)
                .fold(0f64, |a, (&c, &g)| a.max((c as f64 - g as f64).abs()));
            max_abs / max_ref
        };
        let rels: Vec<f64> = (0..rows)
            .map(|r| {
                rel_of(
                    &lc[r * vocab..(r + 1) * vocab],
                    &lg[r * vocab..(r + 1) * vocab],
                )
            })
            .collect();
        let close = rels.iter().filter(|&&x| x < 2e-2).count();
        let worst = rels.iter().copied().fold(0f64, f64::max);
        println!(
            "CPU vs GPU logits ({tag} tiny, {rows} rows): {close} rows within 2e-2 of the row's max |logit|, worst row {worst:.3e}"
        );
        assert!(
            rels.iter().all(|x| x.is_finite()),
            "{tag}: non-finite logits"
        );
        assert!(
            close * 10 >= rows * 9,
            "{tag}: only {close} of {rows} rows agree within bf16 tolerance"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A mixture-of-experts model's steps through `run_step` with recording on give the bits
/// of the same steps with recording off, and of each request alone. The routes are made
/// on the device each step, so decode steps are recorded and replayed like a dense
/// model's, and a replay routes its own rows (a replay that kept the first step's routes
/// would differ from op by op).
#[test]
fn gpu_moe_decode_steps_replay_with_their_own_routes() {
    use arbor_model::runner::{Device, GenRequest, LoadOptions, OfflineRunner, Worker};
    use arbor_model::Sampling;
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [(Arch::Qwen3Moe, "qwen3-moe"), (Arch::Mixtral, "mixtral")] {
        let dir = tiny(arch, &format!("{tag}-graph"));
        let engine = |record: bool| {
            let b = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
                .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
            b.set_recording(record);
            let opts = LoadOptions {
                model_dir: dir.clone(),
                device: Device::Cuda,
                max_seq_len: Some(256),
                shadow_tp1: false,
                numerics: Numerics::Invariant,
                rank_of_tp: None,
                kv: arbor_model::KvOptions {
                    blocks: Some(64),
                    ..Default::default()
                },
            };
            Worker::new(b, &opts).unwrap_or_else(|e| panic!("{tag}: loading: {e}"))
        };
        let (mut rec, mut ops) = (engine(true), engine(false));
        let reqs: Vec<GenRequest> = [45usize, 8, 20, 3, 1]
            .iter()
            .zip([12usize, 7, 12, 3, 9])
            .enumerate()
            .map(|(i, (&len, new))| GenRequest {
                id: 300 + i as u64,
                prompt: (0..len)
                    .map(|j| ((j * 29 + i * 5 + 1) % 250) as u32)
                    .collect(),
                max_new_tokens: new,
            })
            .collect();
        let s = Sampling {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            seed: 6,
        };
        for (what, s, n_top) in [("greedy", Sampling::greedy(), 2), ("sampled", s, 0)] {
            let got = rec
                .generate(&reqs, &s, n_top)
                .expect("generate, recording on");
            let want = ops.generate(&reqs, &s, n_top).expect("generate, op by op");
            assert_eq!(
                out_bits(&got),
                out_bits(&want),
                "{tag} {what}: recording on differs from op by op"
            );
            for (i, r) in reqs.iter().enumerate() {
                let alone = ops
                    .generate(std::slice::from_ref(r), &s, n_top)
                    .expect("generate alone");
                assert_eq!(
                    out_bits(&alone),
                    out_bits(&got[i..=i]),
                    "{tag} {what}: request {i} alone differs from the batch"
                );
            }
        }
        let (recorded, replays) = rec.backend().recorded_steps().expect("recording is on");
        println!("{tag}: {recorded} decode shapes recorded, {replays} steps from recordings");
        assert!(
            recorded > 0 && replays > 0,
            "{tag}: device-routed decode steps were not recorded ({recorded} shapes, {replays} replays)"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The device's routes (`moe_route`) are `layers::moe::route`'s: the same experts in
/// the same order, ties to the lower index, weights within f32 rounding of `exp`; and
/// the pairs' layout is by expert, then by row.
#[test]
fn gpu_moe_routes_match_the_host_routes() {
    use arbor_kernels::cuda::gemm::GroupedPath;
    use arbor_model::layers::route;
    if !gpu_usable() {
        return;
    }
    let gpu = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
        .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
    let dev = gpu.device();
    for (rows, experts, k, norm) in [
        (37usize, 128usize, 8usize, true),
        (300, 8, 2, false),
        (1, 8, 8, true),
    ] {
        // Spread logits with exact ties every 7th row (columns 3 and 5 equal to the max).
        let mut logits = Vec::with_capacity(rows * experts);
        for r in 0..rows {
            for e in 0..experts {
                let v = (((r * 131 + e * 71) % 97) as f32 - 48.0) / 9.0;
                logits.push(v);
            }
            if r % 7 == 0 {
                let row = &mut logits[r * experts..];
                let max = row[..experts].iter().copied().fold(f32::MIN, f32::max);
                row[3] = max;
                row[5] = max;
            }
        }
        let dl = dev.upload_f32(&logits).expect("upload");
        for path in GroupedPath::ALL {
            let got = dev
                .moe_route(&dl, rows, experts, k, norm, path)
                .unwrap_or_else(|e| panic!("moe_route: {e}"));
            let ids = got.experts_of_rows(dev).expect("experts");
            let w = dev.download_f32(&got.weights).expect("weights");
            for r in 0..rows {
                let want = route(&logits[r * experts..(r + 1) * experts], k, norm);
                let ids_r: Vec<usize> = ids[r * k..(r + 1) * k]
                    .iter()
                    .map(|&e| e as usize)
                    .collect();
                let want_ids: Vec<usize> = want.experts.iter().map(|x| x.0).collect();
                assert_eq!(
                    ids_r, want_ids,
                    "rows {rows} E {experts} k {k}: row {r}'s experts"
                );
                for (j, &(_, wp)) in want.experts.iter().enumerate() {
                    let g = w[r * k + j];
                    assert!(
                        (g - wp).abs() <= 4.0 * f32::EPSILON * wp.abs().max(1e-30),
                        "row {r} expert {}: weight {g} on the GPU, {wp} on the host",
                        want_ids[j]
                    );
                }
            }
        }
    }
}

/// The grouped GEMM's block shapes give the same bits: a long prompt's prefill (tiles
/// of 64 rows per expert here) has, in its first rows, the bits of its prefix prefilled
/// alone (tiles of 16 or 64), and every path forced with `ARBOR_MOE_GEMM` (on Hopper the
/// wgmma kernel too) gives the default choice's bits for both.
#[test]
fn gpu_moe_grouped_paths_give_the_same_bits() {
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [
        (Arch::Qwen3Moe, "qwen3-moe-paths"),
        (Arch::Mixtral, "mixtral-paths"),
    ] {
        let dir = tiny(arch, tag);
        let gpu = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
            .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
        let m = load(&gpu, &dir);
        let vocab = m.cfg.vocab_size;
        let long: Vec<u32> = (0..240).map(|j| ((j * 37 + 11) % 250) as u32).collect();
        let full = prefill(&gpu, &m, std::slice::from_ref(&long));
        for n in [3usize, 30, 100] {
            let part = prefill(&gpu, &m, &[long[..n].to_vec()]);
            assert_eq!(
                bits(&part),
                bits(&full[..n * vocab]),
                "{tag}: the first {n} rows of a 240-token prefill differ from the {n}-token prefill"
            );
        }
        // Hopper: every path forced in turn, the wgmma grouped kernel among them, gives the
        // default choice's bits (forcing cannot change another test's bits, only its speed).
        let hopper = gpu.device().ctx.compute_capability().ok() == Some((9, 0));
        let forced: &[&str] = if hopper {
            &["tree128", "split16", "wgtma128"]
        } else {
            &["tree128", "split16"]
        };
        for path in forced {
            std::env::set_var("ARBOR_MOE_GEMM", path);
            let got = prefill(&gpu, &m, std::slice::from_ref(&long));
            let part = prefill(&gpu, &m, &[long[..30].to_vec()]);
            std::env::remove_var("ARBOR_MOE_GEMM");
            assert_eq!(bits(&got), bits(&full), "{tag}: ARBOR_MOE_GEMM={path}");
            assert_eq!(
                bits(&part),
                bits(&full[..30 * vocab]),
                "{tag}: ARBOR_MOE_GEMM={path}, 30 tokens"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Routing on the device and on the host (`ARBOR_MOE=host`) give logits within bf16
/// tolerance of each other (the GEMM families differ, and a near-tie may reroute a row).
#[test]
fn gpu_moe_device_routing_matches_host_routing() {
    if !gpu_usable() {
        return;
    }
    for (arch, tag) in [
        (Arch::Qwen3Moe, "qwen3-moe-routing"),
        (Arch::Mixtral, "mixtral-routing"),
    ] {
        let dir = tiny(arch, tag);
        let open = || {
            CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
                .unwrap_or_else(|e| panic!("opening the GPU: {e}"))
        };
        let (gd, gh) = (open(), open());
        let md = load(&gd, &dir);
        std::env::set_var("ARBOR_MOE", "host");
        let mh = load(&gh, &dir);
        std::env::remove_var("ARBOR_MOE");
        let vocab = md.cfg.vocab_size;
        let p = prompts();
        let (ld, lh) = (prefill(&gd, &md, &p), prefill(&gh, &mh, &p));
        let rows = ld.len() / vocab;
        let close = (0..rows)
            .filter(|&r| {
                let (d, h) = (
                    &ld[r * vocab..(r + 1) * vocab],
                    &lh[r * vocab..(r + 1) * vocab],
                );
                let max_ref = h.iter().fold(0f32, |a, &v| a.max(v.abs()));
                let diff = d
                    .iter()
                    .zip(h)
                    .fold(0f32, |a, (&x, &y)| a.max((x - y).abs()));
                diff <= 2e-2 * max_ref
            })
            .count();
        println!("{tag}: device vs host routing, {close} of {rows} rows within 2e-2");
        assert!(
            ld.iter().all(|v| v.is_finite()) && close * 10 >= rows * 9,
            "{tag}: only {close} of {rows} rows of device routing near host routing"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The tiny model's tensors as a trainer pushes them, every tensor whole as `dtype` (the
/// checkpoint's bf16 values, exactly in f32, rounded in f16): held on the host (an HTTP
/// push) and in `b`'s memory (what a NCCL broadcast leaves there), the same bytes.
fn pushed_stores<B: Backend>(
    b: &B,
    dir: &Path,
    dtype: arbor_model::DType,
) -> (WeightStore, WeightStore) {
    use arbor_model::backend::DeviceTensor;
    use arbor_model::safetensors::SafeFile;
    let f = SafeFile::open(&dir.join("model.safetensors")).expect("the tiny checkpoint");
    let (mut host, mut device) = (Vec::new(), Vec::new());
    for (name, info) in &f.tensors {
        let (n, k) = match info.shape[..] {
            [n, k] => (n, k),
            [k] => (1, k),
            _ => panic!("{name}: shape {:?}", info.shape),
        };
        let vals = f.read_block(name, info, k, 0..n, 0..k).expect("host read");
        let bytes: Vec<u8> = match dtype {
            arbor_model::DType::F32 => vals
                .iter()
                .flat_map(|v| f32::from(*v).to_le_bytes())
                .collect(),
            arbor_model::DType::F16 => vals
                .iter()
                .flat_map(|v| half::f16::from_f32(f32::from(*v)).to_le_bytes())
                .collect(),
            arbor_model::DType::BF16 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let held = b.device_bytes(&bytes).expect("copying into device memory");
        let range = 0..held.len();
        let t = DeviceTensor::new(dtype, info.shape.clone(), held, range).expect("tensor");
        device.push((name.clone(), t));
        let label = Path::new("tensors pushed over HTTP");
        host.push(
            SafeFile::from_tensor(label, name, dtype, info.shape.clone(), bytes).expect("file"),
        );
    }
    let host = WeightStore::from_files(Path::new("tensors on the host"), host, Vec::new())
        .expect("a host store");
    let device = WeightStore::from_files(Path::new("tensors in device memory"), Vec::new(), device)
        .expect("a device store");
    (host, device)
}

/// `w` `[n, k]` as f32 on the host, read through the tree GEMM of an identity
/// activation: each output is one weight times 1 plus zeros, so exact.
fn reveal<B: Backend>(b: &B, w: &B::Mat, n: usize, k: usize) -> Vec<u32> {
    use arbor_kernels::tree::{SegmentLayout, SEGMENTS};
    let mut eye = vec![0f32; k * k];
    for i in 0..k {
        eye[i * k + i] = 1.0;
    }
    let x = b.act_from_host(&eye, k, k).expect("identity");
    let tree = arbor_model::backend::TreeSpec {
        seg_len: SegmentLayout::new(k).seg_len,
        n_seg: SEGMENTS,
        k,
    };
    let y = b.matmul(&x, w, tree).expect("matmul");
    let yt = b.act_to_host(&y).expect("download");
    // y = I · Wᵀ: y[i][j] = W[j][i].
    let mut out = vec![0u32; n * k];
    for j in 0..n {
        for i in 0..k {
            out[j * k + i] = yt[i * n + j].to_bits();
        }
    }
    out
}

/// A store of device-resident tensors gives the weights and the model a host load gives:
/// rows of a TP 2 rank (column-parallel, stacked and alternating gate/up), columns
/// (row-parallel), the padded head block, bf16, f32 and f16 sources; a value that is not
/// finite is refused naming the tensor, as the host load refuses it.
fn device_store_matches_host<B: Backend>(b: &B, tag: &str) {
    use arbor_model::layers::RowParallelLinear;
    use arbor_model::weights::{MatPart, MatPlan, RowOrder};
    use std::ops::Range;
    let dir = tiny(Arch::Llama, tag);
    let cfg = ModelConfig::from_dir(&dir).expect("config");
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    for dtype in [
        arbor_model::DType::BF16,
        arbor_model::DType::F32,
        arbor_model::DType::F16,
    ] {
        let (host, dev) = pushed_stores(b, &dir, dtype);
        for (rank, tp) in [(0usize, 1usize), (0, 2), (1, 2)] {
            let ctx = |store| LoadCtx {
                backend: b,
                store,
                rank,
                tp,
                row_tp: tp,
            };
            let inter_rows = RowParallelLinear::<B>::shard(inter, rank, tp);
            let cols = RowParallelLinear::<B>::shard(inter, rank, tp);
            let gate = "model.layers.0.mlp.gate_proj.weight";
            let up = "model.layers.0.mlp.up_proj.weight";
            let down = "model.layers.0.mlp.down_proj.weight";
            let vocab = cfg.vocab_size;
            let vblock = vocab.div_ceil(tp);
            let vrows = (rank * vblock).min(vocab)..((rank + 1) * vblock).min(vocab);
            let part =
                |name: &str, n: usize, k: usize, rows: Range<usize>, cols: Range<usize>| MatPart {
                    name: name.to_string(),
                    n,
                    k,
                    rows,
                    cols,
                };
            let gate_up = |order| MatPlan {
                parts: vec![
                    part(gate, inter, h, inter_rows.clone(), 0..h),
                    part(up, inter, h, inter_rows.clone(), 0..h),
                ],
                order,
                pad_rows: 0,
            };
            let cases: Vec<(&str, MatPlan)> = vec![
                ("stacked gate/up rows", gate_up(RowOrder::Stacked)),
                ("alternating gate/up rows", gate_up(RowOrder::Alternating)),
                (
                    "row-parallel columns",
                    MatPlan {
                        parts: vec![part(down, h, inter, 0..h, cols.clone())],
                        order: RowOrder::Stacked,
                        pad_rows: 0,
                    },
                ),
                (
                    "padded head block",
                    MatPlan {
                        parts: vec![part(
                            "model.embed_tokens.weight",
                            vocab,
                            h,
                            vrows.clone(),
                            0..h,
                        )],
                        order: RowOrder::Stacked,
                        pad_rows: vblock - vrows.len(),
                    },
                ),
            ];
            for (what, plan) in cases {
                let (n, k) = (plan.rows(), plan.width());
                // The device store frees a tensor at its last reader: one reader per case.
                for p in &plan.parts {
                    dev.set_readers(&p.name, 2);
                }
                let want = ctx(&host).mat(&plan).expect("host cut");
                let got = ctx(&dev).mat(&plan).expect("device cut");
                let (got, want) = (reveal(b, &got, n, k), reveal(b, &want, n, k));
                let first = got.iter().zip(&want).position(|(g, w)| g != w);
                assert_eq!(
                    first,
                    None,
                    "{what}, rank {rank} of {tp}, {dtype:?} source: first differing value (of {})",
                    want.len()
                );
            }
        }
        // The whole model: fresh stores, each tensor read by its layer and released.
        let (host, dev) = pushed_stores(b, &dir, dtype);
        let want = Model::load(
            &LoadCtx {
                backend: b,
                store: &host,
                rank: 0,
                tp: 1,
                row_tp: 1,
            },
            &cfg,
            256,
        )
        .expect("the model from host memory");
        let ctx = LoadCtx {
            backend: b,
            store: &dev,
            rank: 0,
            tp: 1,
            row_tp: 1,
        };
        let got = Model::load(&ctx, &cfg, 256).expect("the model from device memory");
        assert_eq!(
            bits(&prefill(b, &got, &prompts())),
            bits(&prefill(b, &want, &prompts())),
            "logits of the model loaded from {dtype:?} tensors in device memory"
        );
    }
    // A NaN in a row-parallel weight's columns: the host load's refusal, word for word
    // but for where the checkpoint came from.
    {
        use arbor_model::safetensors::SafeFile;
        let f = SafeFile::open(&dir.join("model.safetensors")).expect("checkpoint");
        let name = "model.layers.0.mlp.down_proj.weight";
        let info = &f.tensors[name];
        let mut vals = f
            .read_block(name, info, inter, 0..h, 0..inter)
            .expect("read");
        vals[3 * inter + inter - 1] = half::bf16::NAN;
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        let held = b.device_bytes(&bytes).expect("upload");
        let range = 0..held.len();
        let t = arbor_model::backend::DeviceTensor::new(
            arbor_model::DType::BF16,
            info.shape.clone(),
            held,
            range,
        )
        .expect("tensor");
        let dev = WeightStore::from_files(
            Path::new("tensors in device memory"),
            Vec::new(),
            vec![(name.to_string(), t)],
        )
        .expect("store");
        let ctx = LoadCtx {
            backend: b,
            store: &dev,
            rank: 1,
            tp: 2,
            row_tp: 2,
        };
        let cols = RowParallelLinear::<B>::shard(inter, 1, 2);
        let plan = MatPlan {
            parts: vec![MatPart {
                name: name.to_string(),
                n: h,
                k: inter,
                rows: 0..h,
                cols: cols.clone(),
            }],
            order: RowOrder::Stacked,
            pad_rows: 0,
        };
        let err = match ctx.mat(&plan) {
            Ok(_) => panic!("a NaN was accepted"),
            Err(e) => e.to_string(),
        };
        let flat = 3 * inter + inter - 1;
        assert!(
            err.contains(&format!(
                "tensor {name:?}: element {flat} ([3, {}]) is NaN",
                inter - 1
            )),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpu_device_store_matches_host() {
    device_store_matches_host(&CpuBackend::new(Arc::new(SingleComm)), "devstore-cpu");
}

#[test]
fn gpu_device_store_matches_host() {
    if !gpu_usable() {
        return;
    }
    let gpu = CudaBackend::new(Arc::new(SingleComm), Numerics::Invariant)
        .unwrap_or_else(|e| panic!("opening the GPU: {e}"));
    device_store_matches_host(&gpu, "devstore-gpu");
}
