//! A request in flight on rank 0 (`Job`): its choices handed to the serving loop as
//! sequences, the bound on the queue, and the loop's events folded into each choice as they
//! arrive (stop strings, restarts after a weight update, aborts).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use arbor_model::batching::{Record, SeqSpec};
use arbor_model::FinishReason;
use arbor_serving::{RequestStream, SeqEvent, Submission};
use axum::http::StatusCode;

use super::api::{ApiError, Params, StopTrim};
use super::choice::{ChoiceState, Matched};
use super::state::AppState;

/// Events a stream's handler may hold unread before its sequences are cancelled: a
/// client that does not read its stream (far past the socket's buffers) costs the server
/// this much, not its whole output.
pub const STREAM_BACKLOG: usize = 1024;

/// A request's choices on their way through the engine, as one response or stream.
pub struct Job {
    events: RequestStream,
    pub(super) choices: Vec<ChoiceState>,
    pub(super) p: Params,
    pub(super) chat: bool,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) st: Arc<AppState>,
    _guard: InflightGuard,
}

/// What one engine event did to a choice (for streaming).
pub(super) enum Update {
    Scored(usize, Vec<Record>),
    Token(usize, Record),
    Finished(usize),
    Nothing,
}

/// The choice's `finish_reason` when it was aborted.
const ABORT: &str = "abort";

impl Job {
    /// Hands every (prompt, choice) to the engine as one sequence.
    pub(super) fn submit(
        st: &Arc<AppState>,
        prompts: Vec<Vec<u32>>,
        p: Params,
        chat: bool,
    ) -> Result<Job, ApiError> {
        let total = p.sequences(prompts.len(), st.max_queue)?;
        let before = st.inflight.fetch_add(total, Ordering::SeqCst);
        let guard = InflightGuard {
            st: st.clone(),
            n: total,
        };
        if before + total > st.max_queue {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                "the queue is full ({before} sequences waiting or running, limit {}); retry later",
                st.max_queue
            ),
            ));
        }
        // A plain response's handler reads every event as it comes (the response holds
        // them all anyway: room for a whole run of every choice twice, as an update with
        // policy retract re-runs it, with its version, restart and finish events); a
        // stream's reads only as fast as its client does.
        let backlog = if p.stream {
            STREAM_BACKLOG
        } else {
            // A choice that reports its routes has one more event per step: at most one
            // per prompt token (its prefill chunks) and one per new token.
            let routes = if p.routes {
                prompts.iter().map(Vec::len).max().unwrap_or(0) + p.max_tokens
            } else {
                0
            };
            total.saturating_mul(
                p.max_tokens
                    .saturating_add(routes)
                    .saturating_add(6)
                    .saturating_mul(2),
            )
        };
        let mut choices = Vec::with_capacity(total);
        let mut specs = Vec::with_capacity(total);
        let score = p.prompt_logprobs || (p.echo && p.logprobs.is_some());
        // What `min_tokens` bans, as vLLM's: end-of-sequence (also with `ignore_eos`) and
        // the request's stop tokens.
        let stops: Vec<u32> = st
            .eos_token_ids
            .iter()
            .chain(&p.stop_token_ids)
            .copied()
            .collect();
        for (pi, prompt) in prompts.into_iter().enumerate() {
            let prompt = Arc::new(prompt);
            for j in 0..p.n {
                let index = pi * p.n + j;
                // Each choice follows the constraint from its own tokens.
                let (constraint, failure) = match &p.constraint {
                    Some(c) => {
                        let (c, f) = c.start();
                        (Some(c), Some(f))
                    }
                    None => (None, None),
                };
                let constraint = arbor_model::constraint::MinTokens::wrap(
                    p.min_tokens,
                    &stops,
                    st.vocab,
                    constraint,
                );
                specs.push(SeqSpec {
                    sample_key: p.sample_id.wrapping_add(index as u64),
                    tokens: prompt.to_vec(),
                    score_from: score.then_some(1),
                    max_new: p.max_tokens,
                    sampling: p.sampling,
                    n_top: p.logprobs.unwrap_or(0),
                    ignore_eos: p.ignore_eos,
                    constraint,
                    routes: p.routes,
                });
                let mut choice = ChoiceState::new(index, prompt.clone());
                choice.failure = failure;
                choices.push(choice);
            }
        }
        let prefix = if chat { "chatcmpl" } else { "cmpl" };
        let id = match &p.rid {
            Some(rid) => rid.clone(),
            None => format!("{prefix}-{}", st.next_id.fetch_add(1, Ordering::Relaxed)),
        };
        // One submission for the whole request: its choices run on one weight version.
        let events = st
            .handle
            .submit(Submission {
                rid: id.clone(),
                choices: specs,
                backlog,
            })
            .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
        st.stats.requests.fetch_add(1, Ordering::Relaxed);
        Ok(Job {
            events,
            choices,
            p,
            chat,
            id,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: st.model_name.clone(),
            st: st.clone(),
            _guard: guard,
        })
    }

    pub(super) fn done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    pub(super) async fn next(&mut self) -> Result<Update, ApiError> {
        let Some((i, ev)) = self.events.next().await else {
            // The loop let go of every sequence without finishing some: it cancelled them
            // because this handler fell too far behind, or it stopped.
            let behind = self
                .choices
                .iter()
                .enumerate()
                .any(|(i, c)| c.finish.is_none() && self.events.is_cancelled(i));
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                if behind {
                    format!("cancelled: the client left more than {STREAM_BACKLOG} events of its stream unread")
                } else {
                    "the engine has stopped".to_string()
                },
            ));
        };
        let stream = self.p.stream;
        let Some(c) = self.choices.get_mut(i) else {
            return Ok(Update::Nothing);
        };
        if let SeqEvent::Restart = ev {
            if stream && c.streamed {
                // What was streamed came from the weights being replaced and cannot be
                // taken back: the choice ends instead of running again.
                self.events.cancel(i);
                if c.finish.is_none() {
                    c.finish = Some(ABORT);
                    return Ok(Update::Finished(i));
                }
                return Ok(Update::Nothing);
            }
            c.reset();
            return Ok(Update::Nothing);
        }
        if c.finish.is_some() {
            return Ok(Update::Nothing);
        }
        match ev {
            SeqEvent::Started { weight_version } => {
                c.version = Some(weight_version);
                Ok(Update::Nothing)
            }
            SeqEvent::Aborted { weight_version } => {
                c.version.get_or_insert(weight_version);
                c.finish = Some(ABORT);
                Ok(Update::Finished(i))
            }
            SeqEvent::Restart => Ok(Update::Nothing),
            SeqEvent::Routed { pos0, experts } => {
                let per_token = self.st.routed.map_or(0, |(l, k)| l * k);
                c.set_routes(pos0, &experts, per_token);
                Ok(Update::Nothing)
            }
            SeqEvent::Scored(recs) => {
                c.prompt_records.extend(recs.iter().cloned());
                Ok(Update::Scored(i, recs))
            }
            SeqEvent::Token(rec) => {
                c.records.push(rec.clone());
                let p = &self.p;
                let tokens = c.tokens();
                if p.stop_token_ids.contains(&rec.token) {
                    // The stop token's own text goes unless the request keeps it.
                    let keep = if p.stop_trim == StopTrim::Before {
                        tokens.len() - 1
                    } else {
                        tokens.len()
                    };
                    c.text = self.st.decode_with(&tokens[..keep], p.skip_special);
                    c.finish = Some("stop");
                    c.matched = Some(Matched::Token(rec.token));
                    self.events.cancel(i);
                    return Ok(Update::Token(i, rec));
                }
                let eos = !p.ignore_eos && self.st.eos_token_ids.contains(&rec.token);
                if eos && !p.skip_special && p.stop_trim == StopTrim::Before {
                    // The end of the sequence is no text of the reply, as a stop token's
                    // is not (it shows only where special tokens are kept).
                    c.text = self.st.decode_with(&tokens[..tokens.len() - 1], false);
                    return Ok(Update::Token(i, rec));
                }
                c.text = self.st.decode_with(&tokens, p.skip_special);
                if tokens.len() == p.min_tokens {
                    c.stop_floor = c.text.len();
                }
                // As vLLM: no stop string before `min_tokens` tokens, and then only one
                // that ends past their text.
                let hit = p
                    .stop
                    .iter()
                    .filter(|_| tokens.len() > p.min_tokens)
                    .filter_map(|s| stop_after(&c.text, s, c.stop_floor).map(|at| (at, s)))
                    .min_by_key(|&(at, _)| at);
                if let Some((at, s)) = hit {
                    match p.stop_trim {
                        StopTrim::Before => c.text.truncate(at),
                        StopTrim::After => c.text.truncate(at + s.len()),
                        StopTrim::Keep => {}
                    }
                    c.finish = Some("stop");
                    c.matched = Some(Matched::Str(s.clone()));
                    // The loop frees the sequence at its next step.
                    self.events.cancel(i);
                }
                Ok(Update::Token(i, rec))
            }
            SeqEvent::Finished(reason) => {
                if let Some(why) = c.failure.as_ref().and_then(|f| f.get()) {
                    // The grammar failed mid-way (llguidance's limits): the output does
                    // not follow it, so it is no answer.
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("structured output failed in choice {}: {why}", c.index),
                    )
                    .with_code("structured_output_failed"));
                }
                c.finish = Some(match reason {
                    FinishReason::Eos => {
                        c.matched = c.records.last().map(|r| Matched::Token(r.token));
                        "stop"
                    }
                    FinishReason::Length => "length",
                });
                Ok(Update::Finished(i))
            }
            SeqEvent::Refused { shutting_down, msg } => Err(if shutting_down {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg)
            } else {
                ApiError::new(StatusCode::BAD_REQUEST, msg)
            }),
        }
    }

    pub(super) fn holdback(&self) -> usize {
        self.p.stop.iter().map(|s| s.len()).max().unwrap_or(1) - 1
    }
}

/// Where the first `stop` in `text` that ends past byte `floor` starts.
fn stop_after(text: &str, stop: &str, floor: usize) -> Option<usize> {
    let mut from = floor
        .saturating_sub(stop.len().saturating_sub(1))
        .min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    text[from..]
        .match_indices(stop)
        .map(|(at, _)| from + at)
        .find(|&at| at + stop.len() > floor)
}

/// Counts a job's sequences against `--max-queue` for as long as the job lives.
struct InflightGuard {
    st: Arc<AppState>,
    n: usize,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.st.inflight.fetch_sub(self.n, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::stop_after;

    #[test]
    fn stop_strings_must_end_past_the_min_tokens_text() {
        // No floor: the first match.
        assert_eq!(stop_after("ab.cd.", ".", 0), Some(2));
        // A match inside the first tokens' text does not count; one after does.
        assert_eq!(stop_after("ab.cd.", ".", 3), Some(5));
        assert_eq!(stop_after("ab.cd", ".", 3), None);
        // One that starts inside and ends past it does (vLLM looks back a stop's length).
        assert_eq!(stop_after("abXYcd", "XY", 3), Some(2));
        assert_eq!(stop_after("abXYcd", "XY", 4), None);
        // The look-back stops at a character boundary.
        assert_eq!(stop_after("é.é.", "é.", 3), Some(3));
        assert_eq!(stop_after("é.", "é.", 3), None);
    }
}
