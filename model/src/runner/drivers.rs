//! The [`Runner`] API on a [`Worker`]: `generate` and `score` as static batches driven
//! through the scheduler, and the serving session's `execute`.

use super::weights_update::WeightsState;
use super::{
    FinishReason, GenOutput, GenRequest, GenTiming, KvCapacity, LateMasks, ModelInfo,
    OfflineRunner, ScoreOutput, ScoreRequest, SessionRunner, StepBudget, WeightControl, Worker,
};
use crate::backend::Backend;
use crate::batching::{
    ControlMsg, Event, RowResult, Scheduler, SchedulerConfig, SeqSpec, StepPlan,
};
use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::generation_config::GenerationConfig;
use crate::sampling::Sampling;
use crate::tokenizer_config::TokenizerConfig;

impl<B: Backend> ModelInfo for Worker<B> {
    fn tp(&self) -> usize {
        self.backend.world_size()
    }

    fn rank(&self) -> usize {
        self.backend.rank()
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        self.tokenizer.as_ref()
    }

    fn tokenizer_config(&self) -> Option<&TokenizerConfig> {
        self.tokenizer_config.as_ref()
    }

    fn generation_config(&self) -> Option<&GenerationConfig> {
        self.generation_config.as_ref()
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    fn max_seq_len(&self) -> usize {
        match &self.kv_shape {
            Some(cap) => cap.max_seq_len,
            None => self.max_seq_len,
        }
    }

    fn kv_capacity(&self) -> Option<&KvCapacity> {
        self.kv_shape.as_ref()
    }

    fn timing(&self) -> GenTiming {
        self.timing
    }

    fn recorded_steps(&self) -> Option<(u64, u64)> {
        self.backend.recorded_steps()
    }
}

impl<B: Backend> OfflineRunner for Worker<B> {
    fn reserve_steps(&mut self, step: StepBudget) -> MResult<()> {
        self.check_offline()?;
        step.validate()
            .map_err(|m| ModelError::Plan(format!("step budget: {m}")))?;
        if self.step_asked == Some(step) && self.cache.is_some() {
            return Ok(());
        }
        self.step_asked = Some(step);
        self.kv_opts.step = Some(step);
        // Free the old cache before measuring what is left for the new one.
        self.cache = None;
        self.kv_shape = None;
        self.make_cache(true)
    }

    fn generate(
        &mut self,
        reqs: &[GenRequest],
        s: &Sampling,
        n_top: usize,
    ) -> MResult<Vec<GenOutput>> {
        s.validate()?;
        self.check_offline()?;
        let max_len = self.max_seq_len();
        for r in reqs {
            if r.prompt.is_empty() {
                return Err(ModelError::BadRequest {
                    id: r.id,
                    msg: "empty prompt".into(),
                });
            }
            self.check_tokens(r.id, &r.prompt)?;
            let needed = r.prompt.len().saturating_add(r.max_new_tokens);
            if needed > max_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed,
                    max: max_len,
                    prompt_len: r.prompt.len(),
                });
            }
        }
        let mut outs: Vec<GenOutput> = reqs
            .iter()
            .map(|r| GenOutput {
                id: r.id,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                top: Vec::new(),
                logits_digest: Vec::new(),
                finish: FinishReason::Length,
            })
            .collect();
        // Requests that generate something; sequence j of the scheduler is active[j].
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].max_new_tokens > 0)
            .collect();
        if active.is_empty() {
            return Ok(outs);
        }
        let mut sched = self.offline_scheduler(self.eos_token_ids.clone())?;
        let mut out_of = std::collections::HashMap::new();
        for &i in &active {
            let r = &reqs[i];
            let seq = sched.submit(SeqSpec {
                sample_key: r.id,
                tokens: r.prompt.clone(),
                score_from: None,
                max_new: r.max_new_tokens,
                sampling: *s,
                n_top,
                ignore_eos: false,
                constraint: None,
                routes: false,
            })?;
            out_of.insert(seq, i);
        }
        self.drive_offline(sched, |ev| match ev {
            Event::Token { seq, record } => {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    o.tokens.push(record.token);
                    o.logprobs.push(record.logprob);
                    o.top.push(record.top);
                    o.logits_digest.push(record.digest);
                }
            }
            Event::Finished { seq, reason } => {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    o.finish = reason;
                }
            }
            Event::Scored { .. } | Event::Routed { .. } => {}
        })?;
        Ok(outs)
    }

    fn score(&mut self, reqs: &[ScoreRequest], n_top: usize) -> MResult<Vec<ScoreOutput>> {
        self.check_offline()?;
        let max_len = self.max_seq_len();
        for r in reqs {
            if r.prompt_len == 0 || r.prompt_len > r.tokens.len() {
                return Err(ModelError::BadRequest {
                    id: r.id,
                    msg: format!(
                        "prompt_len {} must be between 1 and the sequence length {}",
                        r.prompt_len,
                        r.tokens.len()
                    ),
                });
            }
            self.check_tokens(r.id, &r.tokens)?;
            if r.tokens.len() > max_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed: r.tokens.len(),
                    max: max_len,
                    prompt_len: r.prompt_len,
                });
            }
        }
        let mut outs: Vec<ScoreOutput> = reqs
            .iter()
            .map(|r| ScoreOutput {
                id: r.id,
                logprobs: Vec::new(),
                top: Vec::new(),
                logits_digest: Vec::new(),
            })
            .collect();
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].tokens.len() > reqs[i].prompt_len)
            .collect();
        if active.is_empty() {
            return Ok(outs);
        }
        let mut sched = self.offline_scheduler(Vec::new())?;
        let mut out_of = std::collections::HashMap::new();
        for &i in &active {
            let r = &reqs[i];
            let seq = sched.submit(SeqSpec {
                sample_key: r.id,
                tokens: r.tokens.clone(),
                score_from: Some(r.prompt_len),
                max_new: 0,
                sampling: Sampling::greedy(),
                n_top,
                ignore_eos: true,
                constraint: None,
                routes: false,
            })?;
            out_of.insert(seq, i);
        }
        self.drive_offline(sched, |ev| {
            if let Event::Scored { seq, records } = ev {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    for rec in records {
                        o.logprobs.push(rec.logprob);
                        o.top.push(rec.top);
                        o.logits_digest.push(rec.digest);
                    }
                }
            }
        })?;
        Ok(outs)
    }

    fn prefix_cache_stats(&self) -> Option<(crate::batching::kv::PrefixStats, usize)> {
        self.offline_pool.as_ref().map(|p| (p.stats(), p.cached()))
    }

    fn drop_prefix_cache(&mut self) {
        self.offline_pool = None;
    }
}

impl<B: Backend> SessionRunner for Worker<B> {
    fn start_session(&mut self) -> MResult<()> {
        // Made now if it was not: every rank starts its session together.
        let (caches, cap) = self.take_cache()?;
        self.cache = Some((caches, cap));
        self.session = true;
        self.offline_pool = None;
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, late: &mut LateMasks<'_>) -> MResult<Vec<RowResult>> {
        if !self.session {
            return Err(ModelError::Plan(
                "execute called before start_session".into(),
            ));
        }
        let (mut caches, cap) = self.take_cache()?;
        let res = self
            .check_plan(plan, cap.blocks, cap.max_seq_len)
            .and_then(|()| self.execute_on(&mut caches, plan, late));
        self.cache = Some((caches, cap));
        res
    }
}

impl<B: Backend> WeightControl for Worker<B> {
    fn control_prepare(&mut self, msg: &mut ControlMsg) -> MResult<()> {
        Worker::control_prepare(self, msg)
    }

    fn control_finish(&mut self, msg: &ControlMsg, apply: bool) {
        Worker::control_finish(self, msg, apply)
    }

    fn weights_state(&self) -> WeightsState {
        Worker::weights_state(self)
    }

    fn weight_shapes(&self) -> std::collections::BTreeMap<String, Vec<usize>> {
        Worker::weight_shapes(self)
    }
}

impl<B: Backend> Worker<B> {
    /// `generate` and `score` own the cache's blocks while they run: not during a session.
    fn check_offline(&self) -> MResult<()> {
        if self.session {
            return Err(ModelError::Plan(
                "generate/score after start_session: the KV cache's blocks belong to the serving session's plans".into(),
            ));
        }
        Ok(())
    }

    /// The scheduler of a static batch on the whole cache (made now if it was not), with
    /// the blocks the last call cached.
    fn offline_scheduler(&mut self, eos: Vec<u32>) -> MResult<Scheduler> {
        let (caches, cap) = self.take_cache()?;
        let step = self.kv_opts.step.ok_or_else(|| {
            ModelError::Plan("the KV cache was made without a step budget".into())
        })?;
        let mut cfg = SchedulerConfig::offline(cap.max_seq_len, cap.blocks, step.tokens, eos);
        cfg.step_outputs = step.outputs;
        cfg.prefix_cache = self.kv_opts.prefix_cache;
        self.cache = Some((caches, cap));
        match self.offline_pool.take() {
            Some(pool) => Scheduler::with_pool(cfg.clone(), pool).or_else(|_| Scheduler::new(cfg)),
            None => Scheduler::new(cfg),
        }
    }

    /// `drive` on the engine's cache; the blocks it cached are kept for the next call
    /// when it ran to the end.
    fn drive_offline(&mut self, mut sched: Scheduler, on_event: impl FnMut(Event)) -> MResult<()> {
        let (mut caches, cap) = self.take_cache()?;
        let res = self.drive(&mut caches, &mut sched, on_event);
        self.cache = Some((caches, cap));
        if res.is_ok() {
            self.offline_pool = sched.into_pool();
        }
        res
    }
}
