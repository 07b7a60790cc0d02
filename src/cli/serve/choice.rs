//! One choice of a request as its engine events arrive: its records, its text, and the
//! part of the text a stream may send now.

use std::sync::Arc;

use arbor_model::batching::Record;

/// One choice as its events arrive.
pub(super) struct ChoiceState {
    pub(super) index: usize,
    pub(super) prompt: Arc<Vec<u32>>,
    pub(super) records: Vec<Record>,
    pub(super) prompt_records: Vec<Record>,
    pub(super) text: String,
    /// Bytes of `text` already streamed, and that text.
    pub(super) sent: usize,
    pub(super) emitted: String,
    pub(super) finish: Option<&'static str>,
    /// The weights it ran on (from its first step).
    pub(super) version: Option<Arc<str>>,
    /// Something of it was streamed (a restart cannot take that back).
    pub(super) streamed: bool,
    /// What ended it with finish_reason "stop".
    pub(super) matched: Option<Matched>,
    /// Where its output constraint reports a failure (structured output).
    pub(super) failure: Option<super::structured::Failure>,
    /// The bytes of its text when it had `min_tokens` tokens: a stop string must end past
    /// them.
    pub(super) stop_floor: usize,
    /// The experts each fed position was routed to, `[positions, layers, top_k]` (where
    /// the request asked).
    pub(super) routes: Vec<u32>,
}

/// The stop a choice matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Matched {
    /// An end-of-sequence token or one of `stop_token_ids`.
    Token(u32),
    Str(String),
}

impl ChoiceState {
    pub(super) fn new(index: usize, prompt: Arc<Vec<u32>>) -> Self {
        ChoiceState {
            index,
            prompt,
            records: Vec::new(),
            prompt_records: Vec::new(),
            text: String::new(),
            sent: 0,
            emitted: String::new(),
            finish: None,
            version: None,
            streamed: false,
            matched: None,
            failure: None,
            stop_floor: 0,
            routes: Vec::new(),
        }
    }

    /// Back to before its first event: it runs again from its prompt.
    pub(super) fn reset(&mut self) {
        self.records.clear();
        self.prompt_records.clear();
        self.text.clear();
        self.sent = 0;
        self.emitted.clear();
        self.finish = None;
        self.version = None;
        self.matched = None;
        self.stop_floor = 0;
        self.routes.clear();
    }

    /// The routes of positions `pos0..` (`per_token` values each). A position fed again
    /// (after a preemption) is overwritten: its experts are the same.
    pub(super) fn set_routes(&mut self, pos0: usize, experts: &[u32], per_token: usize) {
        let at = pos0.saturating_mul(per_token);
        let end = at.saturating_add(experts.len());
        if self.routes.len() < end {
            self.routes.resize(end, 0);
        }
        self.routes[at..end].copy_from_slice(experts);
    }

    pub(super) fn tokens(&self) -> Vec<u32> {
        self.records.iter().map(|r| r.token).collect()
    }

    /// Text that can be streamed now. Held back: a trailing U+FFFD (the bytes of a
    /// character may still be arriving; decoding them later changes that text) and, with
    /// stop strings, the last bytes a stop string could start in.
    /// Nothing at or past byte `hold` of the text goes either (a tool call's start).
    pub(super) fn take_delta_until(&mut self, holdback: usize, hold: Option<usize>) -> String {
        let settled = match self.finish {
            Some(_) => self.text.len(),
            None => self
                .text
                .trim_end_matches('\u{FFFD}')
                .len()
                .saturating_sub(holdback),
        };
        let mut end = hold.map_or(settled, |h| settled.min(h));
        while end > self.sent && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.sent || !self.text.starts_with(self.emitted.as_str()) {
            return String::new();
        }
        let d = self.text[self.sent..end].to_string();
        self.emitted.push_str(&d);
        self.sent = end;
        d
    }
}
