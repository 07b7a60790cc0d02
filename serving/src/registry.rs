//! Rank 0's view of the requests in flight: each request's choices, the sequence each one
//! runs as, whether it has started, and the channel to its consumer. The loop dispatches
//! step events through it, and the control operations (control/) retract, abort or hold
//! whole requests through it, so that every choice of a request runs on one weight
//! version.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arbor_model::batching::{Event, Scheduler, SeqId, StepPlan};

use crate::handle::{refuse_choices, Delivery, EventTx, Request, SubmitChoice};
use crate::msg::SeqEvent;
use crate::stats::Stats;

struct Choice {
    choice: SubmitChoice,
    /// The sequence it runs as; None once finished or cancelled.
    seq: Option<SeqId>,
    /// Its consumer was told the weights it runs on (since its last (re)submission).
    announced: bool,
}

struct Entry {
    rid: String,
    events: EventTx,
    choices: Vec<Choice>,
    /// A step has run one of its choices (on the version then serving): from now on the
    /// weights cannot change until it ends, is re-run or is aborted.
    started: bool,
}

impl Entry {
    fn live(&self) -> bool {
        self.choices.iter().any(|c| c.seq.is_some())
    }

    /// Delivers `ev` to choice `tag`'s consumer. An event that does not fit (the consumer
    /// is its backlog behind) cancels the choice: its consumer must never see a later
    /// event without the ones before it (a version, a restart).
    fn send(&self, tag: usize, ev: SeqEvent) {
        deliver(
            &self.events,
            &self.choices[tag].choice.cancel,
            tag,
            Delivery::Event(ev),
        );
    }
}

fn deliver(events: &EventTx, cancel: &AtomicBool, tag: usize, ev: Delivery) {
    if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) = events.try_send((tag, ev)) {
        // Tells the consumer why its choice ends unfinished; the next sweep frees it.
        cancel.store(true, Ordering::SeqCst);
    }
}

#[derive(Default)]
pub struct Registry {
    reqs: HashMap<u64, Entry>,
    by_seq: HashMap<SeqId, (u64, usize)>,
    next: u64,
}

impl Registry {
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Requests that have started and have a choice still running or queued.
    pub fn started(&self) -> usize {
        self.reqs.values().filter(|r| r.started).count()
    }

    /// Queues every choice of `sub`; a choice the scheduler refuses refuses the whole
    /// request (its other choices are withdrawn).
    pub fn submit(&mut self, sched: &mut Scheduler, sub: Request) {
        let key = self.next;
        self.next += 1;
        let n = sub.choices.len();
        let mut choices = Vec::with_capacity(n);
        for c in sub.choices {
            match sched.submit(c.spec.clone()) {
                Ok(seq) => {
                    self.by_seq.insert(seq, (key, choices.len()));
                    choices.push(Choice {
                        choice: c,
                        seq: Some(seq),
                        announced: false,
                    });
                }
                Err(e) => {
                    for c in &choices {
                        if let Some(seq) = c.seq {
                            sched.cancel(seq);
                            self.by_seq.remove(&seq);
                        }
                    }
                    refuse_choices(&sub.events, n, false, &e.to_string());
                    return;
                }
            }
        }
        self.reqs.insert(
            key,
            Entry {
                rid: sub.rid,
                events: sub.events,
                choices,
                started: false,
            },
        );
    }

    /// Frees the sequences whose consumer is gone (its stream dropped: a client
    /// disconnected) or asked to stop (a stop string matched), or fell too far behind.
    pub fn sweep(&mut self, sched: &mut Scheduler, stats: &Stats) {
        let by_seq = &mut self.by_seq;
        self.reqs.retain(|_, r| {
            let closed = r.events.is_closed();
            for c in &mut r.choices {
                if let Some(seq) = c.seq {
                    if closed || c.choice.cancel.load(Ordering::SeqCst) {
                        sched.cancel(seq);
                        by_seq.remove(&seq);
                        c.seq = None;
                        stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            r.live()
        });
    }

    /// Marks the requests of `plan`'s rows started, telling each choice's consumer the
    /// weights it runs on the first time it runs.
    pub fn on_plan(&mut self, plan: &StepPlan, version: &Arc<str>) {
        for row in &plan.rows {
            let Some(&(key, tag)) = self.by_seq.get(&row.seq) else {
                continue;
            };
            let Some(r) = self.reqs.get_mut(&key) else {
                continue;
            };
            r.started = true;
            if !r.choices[tag].announced {
                r.choices[tag].announced = true;
                r.send(
                    tag,
                    SeqEvent::Started {
                        weight_version: version.clone(),
                    },
                );
            }
        }
    }

    /// Hands a step's event to its consumer.
    pub fn dispatch(&mut self, ev: Event) {
        let (seq, msg) = match ev {
            Event::Scored { seq, records } => (seq, SeqEvent::Scored(records)),
            Event::Token { seq, record } => (seq, SeqEvent::Token(record)),
            Event::Finished { seq, reason } => (seq, SeqEvent::Finished(reason)),
            Event::Routed { seq, pos0, experts } => (seq, SeqEvent::Routed { pos0, experts }),
        };
        let done = matches!(msg, SeqEvent::Finished(_));
        let Some(&(key, tag)) = self.by_seq.get(&seq) else {
            return;
        };
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        r.send(tag, msg);
        if done {
            self.by_seq.remove(&seq);
            r.choices[tag].seq = None;
            if !r.live() {
                self.reqs.remove(&key);
            }
        }
    }

    /// Re-runs every started request from its prompts (all its choices, finished ones
    /// too, so that they share one version): their sequences leave the scheduler and are
    /// queued again as new ones. Returns how many requests.
    pub fn retract_started(&mut self, sched: &mut Scheduler) -> usize {
        let keys: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.started)
            .map(|(k, _)| *k)
            .collect();
        for key in &keys {
            let Some(r) = self.reqs.get_mut(key) else {
                continue;
            };
            r.started = false;
            for (tag, c) in r.choices.iter_mut().enumerate() {
                if let Some(seq) = c.seq.take() {
                    sched.cancel(seq);
                    self.by_seq.remove(&seq);
                }
                let cancel = Arc::new(AtomicBool::new(false));
                c.choice.cancel = cancel.clone();
                c.announced = false;
                deliver(&r.events, &c.choice.cancel, tag, Delivery::Restart(cancel));
                match sched.submit(c.choice.spec.clone()) {
                    Ok(seq) => {
                        c.seq = Some(seq);
                        self.by_seq.insert(seq, (*key, tag));
                    }
                    // It was admitted before, under the same limits.
                    Err(e) => {
                        let _ = r.events.try_send((
                            tag,
                            Delivery::Event(SeqEvent::Refused {
                                shutting_down: false,
                                msg: e.to_string(),
                            }),
                        ));
                    }
                }
            }
        }
        self.reqs.retain(|_, r| r.live());
        keys.len()
    }

    /// Ends the requests named `rid` (every request when None): their running and queued
    /// choices get finish_reason "abort". Returns how many requests.
    pub fn abort(
        &mut self,
        sched: &mut Scheduler,
        rid: Option<&str>,
        version: &Arc<str>,
        stats: &Stats,
    ) -> usize {
        let by_seq = &mut self.by_seq;
        let mut n = 0;
        self.reqs.retain(|_, r| {
            if rid.is_some_and(|id| id != r.rid) {
                return true;
            }
            n += 1;
            for (tag, c) in r.choices.iter_mut().enumerate() {
                if let Some(seq) = c.seq.take() {
                    sched.cancel(seq);
                    by_seq.remove(&seq);
                    stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    let _ = r.events.try_send((
                        tag,
                        Delivery::Event(SeqEvent::Aborted {
                            weight_version: version.clone(),
                        }),
                    ));
                }
            }
            false
        });
        n
    }

    /// Takes the requests that have not started out of the scheduler, to be submitted
    /// again later (`submit`): they will run on the weights serving then.
    pub fn take_unstarted(&mut self, sched: &mut Scheduler) -> Vec<Request> {
        let keys: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.started)
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(r) = self.reqs.remove(&key) else {
                continue;
            };
            let mut choices = Vec::with_capacity(r.choices.len());
            for c in r.choices {
                if let Some(seq) = c.seq {
                    sched.cancel(seq);
                    self.by_seq.remove(&seq);
                }
                choices.push(c.choice);
            }
            out.push(Request {
                rid: r.rid,
                choices,
                events: r.events,
            });
        }
        out
    }

    /// Ends every request with `msg` (shutdown).
    pub fn refuse_all(&mut self, sched: &mut Scheduler, msg: &str, stats: &Stats) {
        for (_, r) in self.reqs.drain() {
            for (tag, c) in r.choices.iter().enumerate() {
                if let Some(seq) = c.seq {
                    sched.cancel(seq);
                    stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    r.send(
                        tag,
                        SeqEvent::Refused {
                            shutting_down: true,
                            msg: msg.to_string(),
                        },
                    );
                }
            }
        }
        self.by_seq.clear();
    }
}
