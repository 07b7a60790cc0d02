//! A job's response: the whole JSON body once every choice has finished, or an SSE
//! stream of chunks as they run, in the OpenAI formats with arbor's extensions (token ids,
//! logits digests, prompt log-probs, the weight version).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use arbor_model::batching::Record;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api::ApiError;
use super::choice::ChoiceState;
use super::job::{Job, Update};
use super::tools;

fn hex(d: u64) -> String {
    format!("{d:016x}")
}

impl Job {
    pub(super) fn usage(&self) -> Value {
        let mut seen = std::collections::HashSet::new();
        let prompt: usize = self
            .choices
            .iter()
            .filter(|c| seen.insert(Arc::as_ptr(&c.prompt)))
            .map(|c| c.prompt.len())
            .sum();
        let completion: usize = self.choices.iter().map(|c| c.records.len()).sum();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    /// Log-probs of `recs` in the endpoint's format.
    pub(super) fn logprobs_json(
        &self,
        recs: &[Record],
        echo_prompt: Option<&ChoiceState>,
        text_offset0: usize,
    ) -> Value {
        let st = &self.st;
        if self.chat {
            let entry = |id: u32, lp: f32| {
                let s = st.token_str(id);
                json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
            };
            let content: Vec<Value> = recs
                .iter()
                .map(|r| {
                    let mut e = entry(r.token, r.logprob);
                    e["top_logprobs"] = r.top.iter().map(|t| entry(t.token, t.logprob)).collect();
                    e
                })
                .collect();
            return json!({"content": content});
        }
        let mut tokens = Vec::new();
        let mut lps: Vec<Value> = Vec::new();
        let mut tops: Vec<Value> = Vec::new();
        let mut offsets = Vec::new();
        let mut off = text_offset0;
        let mut push = |id: u32, lp: Value, top: Value| {
            let s = st.token_str(id);
            offsets.push(off);
            off += s.len();
            tokens.push(s);
            lps.push(lp);
            tops.push(top);
        };
        let top_map = |r: &Record| {
            let m: serde_json::Map<String, Value> = r
                .top
                .iter()
                .map(|t| (st.token_str(t.token), json!(t.logprob)))
                .collect();
            Value::Object(m)
        };
        if let Some(c) = echo_prompt {
            for (k, &id) in c.prompt.iter().enumerate() {
                match k.checked_sub(1).and_then(|j| c.prompt_records.get(j)) {
                    Some(r) => push(id, json!(r.logprob), top_map(r)),
                    None => push(id, Value::Null, Value::Null),
                }
            }
        }
        for r in recs {
            push(r.token, json!(r.logprob), top_map(r));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// arbor's extensions on a choice: token ids and logits digests (and prompt log-probs).
    pub(super) fn extensions(
        &self,
        v: &mut Value,
        c: &ChoiceState,
        recs: &[Record],
        with_prompt: bool,
    ) {
        if let Some(ver) = &c.version {
            v["weight_version"] = json!(&**ver);
        }
        v["token_ids"] = json!(recs.iter().map(|r| r.token).collect::<Vec<_>>());
        v["logits_digest"] = json!(recs.iter().map(|r| hex(r.digest)).collect::<Vec<_>>());
        if with_prompt {
            v["prompt_token_ids"] = json!(c.prompt.as_slice());
        }
        if self.p.prompt_logprobs && with_prompt {
            v["prompt_logprobs"] = json!(c
                .prompt_records
                .iter()
                .map(|r| r.logprob)
                .collect::<Vec<_>>());
            v["prompt_logits_digest"] = json!(c
                .prompt_records
                .iter()
                .map(|r| hex(r.digest))
                .collect::<Vec<_>>());
        }
    }

    pub(super) fn final_body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|c| {
                let mut v = if self.chat {
                    let (message, finish) = self.message(c);
                    json!({"index": c.index, "message": message, "finish_reason": finish})
                } else {
                    let prompt_text = if self.p.echo { self.st.decode(&c.prompt) } else { String::new() };
                    json!({"index": c.index, "text": format!("{prompt_text}{}", c.text), "finish_reason": c.finish})
                };
                v["logprobs"] = match self.p.logprobs {
                    Some(_) => self.logprobs_json(&c.records, (self.p.echo && !self.chat).then_some(c), 0),
                    None => Value::Null,
                };
                self.extensions(&mut v, c, &c.records, true);
                v
            })
            .collect();
        let mut body = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "seed": self.p.sampling.seed,
        });
        // Every choice that ran, ran on one version (docs/rl.md).
        if let Some(v) = self.choices.iter().find_map(|c| c.version.as_deref()) {
            body["weight_version"] = json!(v);
            body["metadata"] = json!({"weight_version": v});
        }
        body
    }

    /// A chat choice's calls, when the request has tools and the reply holds some.
    fn calls(&self, c: &ChoiceState) -> Option<tools::Parsed> {
        let format = self.p.tool_format?;
        let parsed = tools::parse(&c.text, format);
        (!parsed.calls.is_empty()).then_some(parsed)
    }

    /// The `tool_calls` entries of a choice's calls.
    fn calls_json(&self, c: &ChoiceState, parsed: &tools::Parsed, indexed: bool) -> Vec<Value> {
        parsed
            .calls
            .iter()
            .enumerate()
            .map(|(k, call)| {
                let mut v = tools::call_json(&self.id, c.index, k, call);
                if indexed {
                    v["index"] = json!(k);
                }
                v
            })
            .collect()
    }

    /// A chat choice's message and finish reason: with tools, the calls the reply holds
    /// as `tool_calls` and the rest as `content`, finished with "tool_calls".
    fn message(&self, c: &ChoiceState) -> (Value, Option<&'static str>) {
        match self.calls(c) {
            Some(parsed) => (
                json!({"role": "assistant", "content": parsed.content,
                       "tool_calls": self.calls_json(c, &parsed, false)}),
                call_finish(c.finish),
            ),
            None => (json!({"role": "assistant", "content": c.text}), c.finish),
        }
    }

    pub(super) fn chunk(&self, choices: Vec<Value>) -> Event {
        let mut v = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "seed": self.p.sampling.seed,
        });
        if self.p.continuous_usage {
            v["usage"] = self.usage();
        }
        Event::default().data(v.to_string())
    }

    /// The chunk for one choice: a text delta, new records and maybe the finish.
    pub(super) fn choice_chunk(&mut self, i: usize, recs: Vec<Record>, first: bool) -> Event {
        let holdback = self.holdback();
        // With tools, what may be a call is held back until the choice ends, then sent
        // as `tool_calls` (or, if it is no call, as content).
        let calls = match self.choices[i].finish {
            Some(_) => self.calls(&self.choices[i]),
            None => None,
        };
        let hold = match (self.p.tool_format, &calls) {
            (_, Some(_)) => Some(self.choices[i].sent),
            (Some(f), None) if self.choices[i].finish.is_none() => {
                tools::hold_from(&self.choices[i].text, f)
            }
            _ => None,
        };
        let delta = self.choices[i].take_delta_until(holdback, hold);
        let c = &self.choices[i];
        let mut v = if self.chat {
            let mut d = json!({"content": delta});
            if first {
                d["role"] = json!("assistant");
            }
            let mut finish = c.finish;
            if let Some(parsed) = &calls {
                d["tool_calls"] = json!(self.calls_json(c, parsed, true));
                if delta.is_empty() {
                    d["content"] = Value::Null;
                }
                finish = call_finish(c.finish);
            }
            json!({"index": c.index, "delta": d, "finish_reason": finish})
        } else {
            json!({"index": c.index, "text": delta, "finish_reason": c.finish})
        };
        v["logprobs"] = match (self.p.logprobs, recs.is_empty()) {
            (Some(_), false) => self.logprobs_json(&recs, None, 0),
            _ => Value::Null,
        };
        self.extensions(&mut v, c, &recs, false);
        self.chunk(vec![v])
    }

    pub(super) fn error_event(e: &ApiError) -> Event {
        Event::default().data(e.body().to_string())
    }
}

/// A reply with calls that ended on its own ends with "tool_calls" (OpenAI's reason);
/// one cut by `max_tokens` keeps "length".
fn call_finish(finish: Option<&'static str>) -> Option<&'static str> {
    match finish {
        Some("stop") => Some("tool_calls"),
        other => other,
    }
}

/// The header that carries the request's sampling seed (also `seed` in the body and in
/// every chunk), there before the first token of a stream.
pub const SEED_HEADER: &str = "x-arbor-seed";

pub(super) async fn run_job(mut job: Job) -> Result<Response, ApiError> {
    let seed = [(SEED_HEADER, job.p.sampling.seed.to_string())];
    if job.p.stream {
        return Ok((seed, stream_job(job)).into_response());
    }
    while !job.done() {
        job.next().await?;
    }
    Ok((seed, Json(job.final_body())).into_response())
}

fn stream_job(job: Job) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    struct S {
        job: Job,
        pending: VecDeque<Event>,
        started: bool,
        ended: bool,
    }
    let s = S {
        job,
        pending: VecDeque::new(),
        started: false,
        ended: false,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.pending.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            if !s.started {
                s.started = true;
                for i in 0..s.job.choices.len() {
                    let c = &s.job.choices[i];
                    if s.job.chat {
                        let v = json!({"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
                        s.pending.push_back(s.job.chunk(vec![v]));
                    } else if s.job.p.echo {
                        let v = json!({"index": c.index, "text": s.job.st.decode(&c.prompt), "finish_reason": null, "prompt_token_ids": c.prompt.as_slice()});
                        s.pending.push_back(s.job.chunk(vec![v]));
                    }
                }
                continue;
            }
            if s.job.done() {
                if s.job.p.include_usage {
                    let v = json!({"id": s.job.id, "object": if s.job.chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": s.job.created, "model": s.job.model, "choices": [], "usage": s.job.usage(), "seed": s.job.p.sampling.seed});
                    s.pending.push_back(Event::default().data(v.to_string()));
                }
                s.pending.push_back(Event::default().data("[DONE]"));
                s.ended = true;
                continue;
            }
            match s.job.next().await {
                Ok(Update::Token(i, rec)) => {
                    s.job.choices[i].streamed = true;
                    let e = s.job.choice_chunk(i, vec![rec], false);
                    s.pending.push_back(e);
                }
                Ok(Update::Finished(i)) => {
                    s.job.choices[i].streamed = true;
                    let e = s.job.choice_chunk(i, Vec::new(), false);
                    s.pending.push_back(e);
                }
                Ok(Update::Scored(i, recs)) if s.job.p.prompt_logprobs => {
                    s.job.choices[i].streamed = true;
                    let c = &s.job.choices[i];
                    let mut v = json!({"index": c.index, "text": "", "finish_reason": null,
                        "prompt_logprobs": recs.iter().map(|r| r.logprob).collect::<Vec<_>>(),
                        "prompt_logits_digest": recs.iter().map(|r| hex(r.digest)).collect::<Vec<_>>()});
                    if let Some(ver) = &c.version {
                        v["weight_version"] = json!(&**ver);
                    }
                    s.pending.push_back(s.job.chunk(vec![v]));
                }
                Ok(_) => {}
                Err(e) => {
                    s.pending.push_back(Job::error_event(&e));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
