//! A fake rank for the loop's tests: no model, no device. Its token at a position depends
//! only on the weights it serves, the sequence's sample key and the position (as a real
//! rank's does), so a test knows every token a request must get on given weights. A gate
//! lets a test hold the loop between steps; faults make a command or a step fail. At TP > 1
//! every step ends with a collective over the ranks, as a real step's all-reduces do, so
//! the ranks go in lockstep and a rank that is gone fails the others' step.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use arbor_collective::Communicator;
use arbor_model::batching::kv::PrefixStats;
use arbor_model::batching::{ControlMsg, Record, RowResult, StepPlan, UpdateSource};
use arbor_model::config::in_memory_path;
use arbor_model::error::MResult;
use arbor_model::runner::weights_update::{Origin, WeightsState};
use arbor_model::runner::{GenTiming, KvCapacity, ScoreOutput, StepBudget};
use arbor_model::{
    GenOutput, GenRequest, GenerationConfig, ModelConfig, ModelError, ModelInfo, OfflineRunner,
    Sampling, ScoreRequest, SessionRunner, TokenizerConfig, WeightControl,
};

pub const VOCAB: u32 = 256;

const CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "max_position_embeddings": 4096, "tie_word_embeddings": false, "bos_token_id": 1,
  "eos_token_id": 0
}"#;

/// How many tensors the fake model reads: each staged part counts as one.
pub const FAKE_MODEL_TENSORS: usize = 3;

/// The directory the fake rank's weights were loaded from at start.
pub const START: &str = "/fake/start";

fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

/// The weights of a checkpoint directory.
pub fn disk_weights(path: &str) -> u64 {
    fnv(path.as_bytes(), FNV0)
}

/// The weights of pushed parts, in push order.
pub fn pushed_weights(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(FNV0 ^ 1, |h, p| fnv(p, h))
}

/// The token the fake model gives sequence `key` at position `pos` on weights `w`: never
/// 0 (the end-of-sequence id).
pub fn token(w: u64, key: u64, pos: usize) -> u32 {
    let mut x = w
        ^ key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (pos as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    1 + (x % u64::from(VOCAB - 1)) as u32
}

/// The tokens a sequence of `prompt` tokens generates on weights `w`.
pub fn tokens(w: u64, key: u64, prompt: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| token(w, key, prompt + i)).collect()
}

/// Holds the loop inside a step until the test lets it through.
pub struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

struct GateState {
    /// Steps that may still pass (None: any number).
    permits: Option<u64>,
    /// Steps that passed.
    passed: u64,
    /// A step waits at the gate now.
    waiting: bool,
}

const PATIENCE: Duration = Duration::from_secs(20);

impl Gate {
    fn new(permits: Option<u64>) -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new(GateState {
                permits,
                passed: 0,
                waiting: false,
            }),
            cv: Condvar::new(),
        })
    }

    pub fn open() -> Arc<Gate> {
        Gate::new(None)
    }

    pub fn closed() -> Arc<Gate> {
        Gate::new(Some(0))
    }

    /// Lets `n` more steps through.
    pub fn allow(&self, n: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(p) = &mut s.permits {
            *p += n;
        }
        self.cv.notify_all();
    }

    /// Lets every step through from now on.
    pub fn open_all(&self) {
        self.state.lock().unwrap().permits = None;
        self.cv.notify_all();
    }

    /// Waits until `n` steps have passed and the next one waits at the gate: the loop is
    /// inside step `n + 1`, and a command sent now is taken after that step.
    pub fn held_after(&self, n: u64) {
        let deadline = Instant::now() + PATIENCE;
        let mut s = self.state.lock().unwrap();
        while !(s.passed == n && s.waiting) {
            assert!(s.passed <= n, "{} steps passed, expected {n}", s.passed);
            let left = deadline
                .checked_duration_since(Instant::now())
                .unwrap_or_else(|| panic!("the loop never reached step {}", n + 1));
            s = self.cv.wait_timeout(s, left).unwrap().0;
        }
    }

    /// Steps that passed so far.
    pub fn passed(&self) -> u64 {
        self.state.lock().unwrap().passed
    }

    fn pass(&self) -> MResult<()> {
        let deadline = Instant::now() + PATIENCE;
        let mut s = self.state.lock().unwrap();
        while s.permits == Some(0) {
            s.waiting = true;
            self.cv.notify_all();
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(ModelError::Plan("the test never opened the gate".into()));
            };
            s = self.cv.wait_timeout(s, left).unwrap().0;
        }
        s.waiting = false;
        if let Some(p) = &mut s.permits {
            *p -= 1;
        }
        s.passed += 1;
        self.cv.notify_all();
        Ok(())
    }
}

/// What a test makes fail.
#[derive(Default)]
pub struct Faults {
    /// Phase one of every command fails with this message (a bad checkpoint).
    pub prepare: Mutex<Option<String>>,
    /// The step of this number (from 0) fails, as a rank that dies does.
    pub execute_at: Mutex<Option<u64>>,
}

impl Faults {
    pub fn fail_prepare(&self, msg: &str) {
        *self.prepare.lock().unwrap() = Some(msg.to_string());
    }

    pub fn fail_step(&self, n: u64) {
        *self.execute_at.lock().unwrap() = Some(n);
    }
}

/// One rank of a fake model.
pub struct FakeRunner {
    cfg: ModelConfig,
    rank: usize,
    tp: usize,
    weights: u64,
    origin: Origin,
    weights_loaded: bool,
    kv_loaded: bool,
    staged: Vec<Vec<u8>>,
    /// Phase one's result, until phase two.
    candidate: Option<(u64, Origin)>,
    staging: Option<Vec<u8>>,
    gate: Arc<Gate>,
    faults: Arc<Faults>,
    steps: u64,
    /// The group a step's collective runs over (TP > 1).
    comm: Option<Arc<dyn Communicator>>,
}

impl FakeRunner {
    pub fn new(comm: Arc<dyn Communicator>, gate: Arc<Gate>, faults: Arc<Faults>) -> Self {
        FakeRunner {
            cfg: ModelConfig::from_json_str(CONFIG, &in_memory_path()).expect("fake config"),
            rank: comm.rank(),
            tp: comm.world_size(),
            comm: (comm.world_size() > 1).then_some(comm),
            weights: disk_weights(START),
            origin: Origin::Disk(PathBuf::from(START)),
            weights_loaded: true,
            kv_loaded: true,
            staged: Vec::new(),
            candidate: None,
            staging: None,
            gate,
            faults,
            steps: 0,
        }
    }

    fn record(&self, token: u32, key: u64, pos: usize) -> Record {
        Record {
            token,
            logprob: -(token as f32) / 64.0,
            top: Vec::new(),
            digest: self.weights ^ key ^ pos as u64,
        }
    }

    fn load(&self, src: &UpdateSource) -> MResult<(u64, Origin)> {
        match src {
            UpdateSource::Disk(p) => {
                Ok((disk_weights(&p.to_string_lossy()), Origin::Disk(p.clone())))
            }
            UpdateSource::Staged if self.staged.is_empty() => {
                Err(ModelError::Unavailable("nothing is staged".into()))
            }
            UpdateSource::Staged => {
                let parts: Vec<&[u8]> = self.staged.iter().map(Vec::as_slice).collect();
                Ok((pushed_weights(&parts), Origin::Pushed))
            }
        }
    }
}

fn unsupported<T>(what: &str) -> MResult<T> {
    Err(ModelError::Unavailable(format!(
        "the fake rank cannot {what}"
    )))
}

impl ModelInfo for FakeRunner {
    fn tp(&self) -> usize {
        self.tp
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        None
    }
    fn tokenizer_config(&self) -> Option<&TokenizerConfig> {
        None
    }
    fn generation_config(&self) -> Option<&GenerationConfig> {
        None
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[0]
    }
    fn max_seq_len(&self) -> usize {
        1024
    }
    fn kv_capacity(&self) -> Option<&KvCapacity> {
        None
    }
    fn timing(&self) -> GenTiming {
        GenTiming::default()
    }
    fn recorded_steps(&self) -> Option<(u64, u64)> {
        None
    }
}

impl OfflineRunner for FakeRunner {
    fn reserve_steps(&mut self, _: StepBudget) -> MResult<()> {
        unsupported("reserve_steps")
    }
    fn generate(&mut self, _: &[GenRequest], _: &Sampling, _: usize) -> MResult<Vec<GenOutput>> {
        unsupported("generate")
    }
    fn score(&mut self, _: &[ScoreRequest], _: usize) -> MResult<Vec<ScoreOutput>> {
        unsupported("score")
    }
    fn prefix_cache_stats(&self) -> Option<(PrefixStats, usize)> {
        None
    }
    fn drop_prefix_cache(&mut self) {}
}

impl SessionRunner for FakeRunner {
    fn start_session(&mut self) -> MResult<()> {
        Ok(())
    }
    fn execute(
        &mut self,
        plan: &StepPlan,
        _late: &mut arbor_model::runner::LateMasks<'_>,
    ) -> MResult<Vec<RowResult>> {
        self.gate.pass()?;
        let n = self.steps;
        self.steps += 1;
        if *self.faults.execute_at.lock().unwrap() == Some(n) {
            return Err(ModelError::Unavailable(format!(
                "rank {} died at step {n}",
                self.rank
            )));
        }
        if !(self.weights_loaded && self.kv_loaded) {
            return unsupported("step without its weights and KV cache");
        }
        if let Some(c) = &self.comm {
            c.all_gather_u64(n)
                .map_err(|e| ModelError::Unavailable(format!("the step's all-reduce: {e}")))?;
        }
        Ok(plan
            .rows
            .iter()
            .map(|r| {
                let next = r.pos0 + r.tokens.len();
                RowResult {
                    seq: r.seq,
                    scored: r
                        .targets
                        .iter()
                        .map(|&(off, t)| self.record(t, r.sample_key, r.pos0 + off as usize + 1))
                        .collect(),
                    sampled: r.sample.then(|| {
                        self.record(token(self.weights, r.sample_key, next), r.sample_key, next)
                    }),
                    routes: Vec::new(),
                }
            })
            .collect())
    }
}

impl WeightControl for FakeRunner {
    fn control_prepare(&mut self, msg: &mut ControlMsg) -> MResult<()> {
        if let Some(m) = self.faults.prepare.lock().unwrap().clone() {
            return Err(ModelError::Config {
                path: Path::new("<fake>").to_path_buf(),
                msg: m,
            });
        }
        match msg {
            ControlMsg::Stage { bytes, .. } => {
                self.staging = Some(std::mem::take(bytes));
                Ok(())
            }
            ControlMsg::Update(src) => {
                self.candidate = Some(self.load(src)?);
                Ok(())
            }
            ControlMsg::Resume { weights, from, .. } => {
                if *weights && !self.weights_loaded {
                    let src = match (from.as_ref(), &self.origin) {
                        (Some(p), _) | (None, Origin::Disk(p)) => UpdateSource::Disk(p.clone()),
                        (None, Origin::Pushed) => {
                            return Err(ModelError::Unavailable(
                                "pushed weights have no copy on disk".into(),
                            ))
                        }
                    };
                    self.candidate = Some(self.load(&src)?);
                }
                Ok(())
            }
            ControlMsg::Discard | ControlMsg::FlushCache | ControlMsg::Release { .. } => Ok(()),
            ControlMsg::Receive { .. } | ControlMsg::ReceiveInBand { .. } => {
                unsupported("receive over NCCL")
            }
            ControlMsg::StageIpc { .. } => unsupported("read CUDA IPC handles"),
            ControlMsg::JoinGroup { .. } | ControlMsg::LeaveGroup { .. } => {
                unsupported("join a NCCL group")
            }
        }
    }
    fn control_finish(&mut self, msg: &ControlMsg, apply: bool) {
        let candidate = self.candidate.take();
        let staging = self.staging.take();
        match msg {
            ControlMsg::Stage { .. } => match (apply, staging) {
                (true, Some(part)) => self.staged.push(part),
                _ => self.staged.clear(),
            },
            ControlMsg::Discard => self.staged.clear(),
            ControlMsg::Update(src) => {
                if apply {
                    if let Some((w, origin)) = candidate {
                        self.weights = w;
                        self.origin = origin;
                        self.weights_loaded = true;
                    }
                }
                if *src == UpdateSource::Staged {
                    self.staged.clear();
                }
            }
            ControlMsg::Release { weights, kv } if apply => {
                self.weights_loaded &= !weights;
                self.kv_loaded &= !kv;
            }
            &ControlMsg::Resume { kv, .. } if apply => {
                if let Some((w, origin)) = candidate {
                    self.weights = w;
                    self.origin = origin;
                    self.weights_loaded = true;
                }
                self.kv_loaded |= kv;
            }
            _ => {}
        }
    }
    fn weights_state(&self) -> WeightsState {
        WeightsState {
            weights_loaded: self.weights_loaded,
            kv_loaded: self.kv_loaded,
            origin: self.origin.clone(),
            staged_tensors: self.staged.len(),
            staged_bytes: self.staged.iter().map(Vec::len).sum(),
            group: None,
            model_tensors: FAKE_MODEL_TENSORS,
            model_elements: 1 << 20,
            largest_tensor_elements: 1 << 16,
        }
    }
    fn weight_shapes(&self) -> std::collections::BTreeMap<String, Vec<usize>> {
        std::collections::BTreeMap::new()
    }
}
