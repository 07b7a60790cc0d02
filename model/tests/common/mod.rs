//! Helpers shared by the model's integration tests: temporary tiny models and TP groups
//! of threads over the in-process transport.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arbor_collective::InProcGroup;
use arbor_model::{
    load, Arch, Device, GenOutput, LoadOptions, ModelError, Preset, Runner, ScoreOutput,
    SynthOptions, TokenLogprob,
};

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "arbor-model-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn make(opts: SynthOptions) -> TempDir {
    let t = TempDir::new("m");
    let opts = SynthOptions {
        out_dir: t.path().to_path_buf(),
        ..opts
    };
    arbor_model::make_model(&opts).unwrap();
    t
}

pub fn tiny(arch: Arch, seed: u64) -> TempDir {
    make(SynthOptions::new(arch, Preset::Tiny, seed, ""))
}

pub fn opts(dir: &Path) -> LoadOptions {
    LoadOptions {
        model_dir: dir.to_path_buf(),
        device: Device::Cpu,
        max_seq_len: Some(256),
        shadow_tp1: false,
        numerics: Default::default(),
        rank_of_tp: None,
        kv: Default::default(),
    }
}

/// Runs `f` on every rank of a TP group of threads; results by rank.
pub fn on_ranks<T: Send + 'static>(
    tp: usize,
    opts: LoadOptions,
    f: impl Fn(Box<dyn Runner>) -> Result<T, ModelError> + Send + Sync + Clone + 'static,
) -> Vec<Result<T, ModelError>> {
    let handles: Vec<_> = InProcGroup::new(tp)
        .into_iter()
        .map(|c| {
            let f = f.clone();
            let opts = opts.clone();
            std::thread::spawn(move || f(load(&opts, Arc::new(c))?))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Every rank's result, asserting they are all Ok and bit-identical under `key`.
pub fn same_on_all_ranks<T, K: PartialEq + std::fmt::Debug>(
    rs: Vec<Result<T, ModelError>>,
    key: impl Fn(&T) -> K,
) -> T {
    let mut it = rs.into_iter().map(|r| r.unwrap());
    let first = it.next().unwrap();
    for (i, r) in it.enumerate() {
        assert_eq!(key(&r), key(&first), "rank {} differs from rank 0", i + 1);
    }
    first
}

/// Everything of a generation that must be bit-identical, as integers.
pub type GenKey = (
    u64,
    Vec<u32>,
    Vec<u32>,
    Vec<u64>,
    Vec<Vec<(u32, u32)>>,
    String,
);

/// The alternatives per position as (token, log-prob bits).
fn top_bits(top: &[Vec<TokenLogprob>]) -> Vec<Vec<(u32, u32)>> {
    top.iter()
        .map(|t| t.iter().map(|x| (x.token, x.logprob.to_bits())).collect())
        .collect()
}

pub fn gen_key(o: &GenOutput) -> GenKey {
    (
        o.id,
        o.tokens.clone(),
        o.logprobs.iter().map(|x| x.to_bits()).collect(),
        o.logits_digest.clone(),
        top_bits(&o.top),
        format!("{:?}", o.finish),
    )
}

pub fn gen_keys(v: &[GenOutput]) -> Vec<GenKey> {
    v.iter().map(gen_key).collect()
}

pub type ScoreKey = (u64, Vec<u32>, Vec<u64>, Vec<Vec<(u32, u32)>>);

pub fn score_key(o: &ScoreOutput) -> ScoreKey {
    (
        o.id,
        o.logprobs.iter().map(|x| x.to_bits()).collect(),
        o.logits_digest.clone(),
        top_bits(&o.top),
    )
}

pub fn score_keys(v: &[ScoreOutput]) -> Vec<ScoreKey> {
    v.iter().map(score_key).collect()
}

/// A deterministic prompt of `len` byte tokens.
pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
                >> 7)
                % 256
        })
        .collect()
}
