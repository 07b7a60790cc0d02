//! The [`Runner`] API on an [`Engine`]: `generate` and `score` as static batches driven
//! through the scheduler, and the serving session's `execute`.

use super::weights_update::WeightsState;
use super::{
    Engine, FinishReason, GenOutput, GenRequest, GenTiming, Runner, ScoreOutput, ScoreRequest,
};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::engine::{ControlMsg, Event, RowResult, Scheduler, SchedulerConfig, SeqSpec, StepPlan};
use crate::error::{MResult, ModelError};
use crate::generation_config::GenerationConfig;
use crate::sampling::Sampling;
use crate::tokenizer_config::TokenizerConfig;

impl<B: Backend> Runner for Engine<B> {
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
        self.max_seq_len
    }

    fn generate(
        &mut self,
        reqs: &[GenRequest],
        s: &Sampling,
        n_top: usize,
    ) -> MResult<Vec<GenOutput>> {
        s.validate()?;
        for r in reqs {
            if r.prompt.is_empty() {
                return Err(ModelError::BadRequest {
                    id: r.id,
                    msg: "empty prompt".into(),
                });
            }
            self.check_tokens(r.id, &r.prompt)?;
            let needed = r.prompt.len().saturating_add(r.max_new_tokens);
            if needed > self.max_seq_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed,
                    max: self.max_seq_len,
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
        let max_len = active
            .iter()
            .map(|&i| reqs[i].prompt.len() + reqs[i].max_new_tokens)
            .max()
            .unwrap_or(1);
        let mut caches = self.caches(active.len(), max_len)?;
        let cfg = SchedulerConfig::offline(active.len(), max_len, self.eos_token_ids.clone());
        let mut sched = Scheduler::new(cfg)?;
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
            })?;
            out_of.insert(seq, i);
        }
        self.drive(&mut caches, &mut sched, |ev| match ev {
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
            Event::Scored { .. } => {}
        })?;
        Ok(outs)
    }

    fn timing(&self) -> GenTiming {
        self.timing
    }

    fn recorded_steps(&self) -> Option<(u64, u64)> {
        self.backend.recorded_steps()
    }

    fn score(&mut self, reqs: &[ScoreRequest], n_top: usize) -> MResult<Vec<ScoreOutput>> {
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
            if r.tokens.len() > self.max_seq_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed: r.tokens.len(),
                    max: self.max_seq_len,
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
        let max_len = active
            .iter()
            .map(|&i| reqs[i].tokens.len())
            .max()
            .unwrap_or(1);
        let mut caches = self.caches(active.len(), max_len)?;
        let cfg = SchedulerConfig::offline(active.len(), max_len, Vec::new());
        let mut sched = Scheduler::new(cfg)?;
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
            })?;
            out_of.insert(seq, i);
        }
        self.drive(&mut caches, &mut sched, |ev| {
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

    fn start_session(&mut self, slots: usize, max_len: usize) -> MResult<()> {
        if max_len > self.max_seq_len {
            return Err(ModelError::Plan(format!(
                "a session of {max_len} positions per slot exceeds the context length {}",
                self.max_seq_len
            )));
        }
        self.session = None;
        self.backend.forget_recordings();
        let caches = self.caches(slots, max_len)?;
        self.session = Some((caches, slots, max_len));
        self.session_shape = Some((slots, max_len));
        Ok(())
    }

    fn control_prepare(&mut self, msg: &mut ControlMsg) -> MResult<()> {
        Engine::control_prepare(self, msg)
    }

    fn control_finish(&mut self, msg: &ControlMsg, apply: bool) {
        Engine::control_finish(self, msg, apply)
    }

    fn weights_state(&self) -> WeightsState {
        Engine::weights_state(self)
    }

    fn execute(&mut self, plan: &StepPlan) -> MResult<Vec<RowResult>> {
        let Some((mut caches, slots, max_len)) = self.session.take() else {
            return Err(match self.session_shape {
                Some(_) => ModelError::Unavailable(
                    "the KV cache is released (release_memory_occupation): resume it first".into(),
                ),
                None => ModelError::Plan("execute called before start_session".into()),
            });
        };
        let res = self
            .check_plan(plan, slots, max_len)
            .and_then(|()| self.execute_on(&mut caches, plan));
        self.session = Some((caches, slots, max_len));
        res
    }
}
