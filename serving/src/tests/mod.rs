//! The serving loop driven through its handle, with fake ranks (fake.rs): no HTTP, no
//! processes. A test starts the loop on a thread (TP 1, or TP 2 with a follower thread
//! over the in-process transport), holds it between steps with a gate where timing
//! matters, and checks every event each request gets.

mod fake;
mod faults;
mod generation;
mod updates;

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arbor_collective::{Communicator, InProcGroup, SingleComm};
use arbor_model::batching::{SchedulerConfig, SeqSpec};
use arbor_model::FinishReason;
use serde_json::Value;

use crate::{
    Commit, ControlOp, ControlReply, Leader, Policy, RefusalKind, RequestStream, SeqEvent,
    ServeConfig, ServeError, ServingHandle, Stats, Submission, UpdateReq,
};
use fake::{FakeRunner, Faults, Gate};

const PATIENCE: Duration = Duration::from_secs(20);

fn config() -> ServeConfig {
    ServeConfig {
        idle_tick: Duration::from_millis(20),
        ..ServeConfig::new(SchedulerConfig {
            max_running: 8,
            max_seq_len: 1024,
            chunk: 64,
            step_tokens: 256,
            prefill_beside_decode: 256,
            row_multiple: 1,
            step_outputs: 256,
            kv_blocks: 64,
            eos: vec![0],
            preempt: true,
            prefill_first: false,
            prefix_cache: true,
        })
    }
}

/// A rank's thread and how it ended.
type RankThread = JoinHandle<Result<(), ServeError>>;

/// A loop on a thread, with its fake rank's gate and faults.
struct Server {
    handle: ServingHandle,
    stats: Arc<Stats>,
    gate: Arc<Gate>,
    faults: Arc<Faults>,
    thread: RankThread,
    /// TP 2: the follower's thread and faults.
    follower: Option<(RankThread, Arc<Faults>)>,
}

impl Server {
    /// TP 1.
    fn start(cfg: ServeConfig, gate: Arc<Gate>) -> Server {
        Server::lead(cfg, gate, Arc::new(SingleComm))
    }

    /// Rank 0's loop on a thread, over `comm`.
    fn lead(cfg: ServeConfig, gate: Arc<Gate>, comm: Arc<dyn Communicator>) -> Server {
        let faults = Arc::new(Faults::default());
        let (leader, handle) = Leader::new(cfg).unwrap();
        let stats = leader.stats();
        let mut runner = FakeRunner::new(comm.clone(), gate.clone(), faults.clone());
        let thread = std::thread::spawn(move || leader.run(&mut runner, comm.as_ref()));
        Server {
            handle,
            stats,
            gate,
            faults,
            thread,
            follower: None,
        }
    }

    /// TP 2: rank 1 follows on a thread of its own, over the in-process transport.
    fn start_tp2(cfg: ServeConfig, gate: Arc<Gate>) -> Server {
        let mut comms = InProcGroup::with_timeout(2, Duration::from_secs(5)).into_iter();
        let (c0, c1) = (
            Arc::new(comms.next().unwrap()),
            Arc::new(comms.next().unwrap()),
        );
        let follower_faults = Arc::new(Faults::default());
        let ff = follower_faults.clone();
        let follower = std::thread::spawn(move || {
            let mut runner = FakeRunner::new(c1.clone(), Gate::open(), ff);
            // The follower's transport goes with it: a follower that fails is gone.
            crate::follow(&mut runner, c1.as_ref())
        });
        Server {
            follower: Some((follower, follower_faults)),
            ..Server::lead(cfg, gate, c0)
        }
    }

    fn submit(&self, sub: Submission) -> RequestStream {
        self.handle.submit(sub).expect("the loop takes requests")
    }

    fn control(&self, op: ControlOp) -> ControlReply {
        self.handle.control(op).wait()
    }

    /// Lets one step run and waits until the loop is held inside the next one: what is
    /// sent now is taken after that step.
    fn step_and_hold(&self) {
        let n = self.gate.passed();
        self.gate.allow(1);
        self.gate.held_after(n + 1);
    }

    /// Drains, and returns how the loop (and a follower) ended.
    fn stop(self) -> Result<(), ServeError> {
        let _ = self.handle.drain();
        self.gate.open_all();
        drop(self.handle);
        let r = join(self.thread);
        if let Some((f, _)) = self.follower {
            join(f).expect("the follower stops cleanly");
        }
        r
    }
}

fn join(t: RankThread) -> Result<(), ServeError> {
    let deadline = Instant::now() + PATIENCE;
    while !t.is_finished() {
        assert!(Instant::now() < deadline, "the thread never ended");
        std::thread::sleep(Duration::from_millis(2));
    }
    t.join().expect("no panic")
}

/// Waits for `cond` (the loop runs on its own thread).
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A request of `n` choices (sample keys `key0..key0 + n`), a prompt of `prompt` tokens,
/// `max_new` new tokens, and room for every event.
fn request(rid: &str, key0: u64, n: usize, prompt: usize, max_new: usize) -> Submission {
    Submission {
        rid: rid.to_string(),
        choices: (0..n as u64)
            .map(|i| SeqSpec::greedy(key0 + i, (1..=prompt as u32).collect(), max_new))
            .collect(),
        backlog: 4096,
    }
}

/// How a choice ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    Finished(FinishReason),
    Aborted(String),
    Refused { shutting_down: bool, msg: String },
}

/// One choice as its consumer saw it (what came after its last restart).
#[derive(Debug, Clone, Default, PartialEq)]
struct Choice {
    version: Option<String>,
    tokens: Vec<u32>,
    end: Option<End>,
    restarts: usize,
}

/// Reads `stream` until every choice has ended, or the stream does.
fn collect(stream: &mut RequestStream) -> Vec<Choice> {
    let mut out = vec![Choice::default(); stream.choices()];
    let deadline = Instant::now() + PATIENCE;
    while out.iter().any(|c| c.end.is_none()) {
        let (tag, ev) = match stream.try_next() {
            Ok(x) => x,
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => break,
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "timed out reading: {out:?}");
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
        };
        let c = &mut out[tag];
        assert!(c.end.is_none(), "choice {tag}: {ev:?} after {:?}", c.end);
        match ev {
            SeqEvent::Started { weight_version } => c.version = Some(weight_version.to_string()),
            SeqEvent::Scored(_) | SeqEvent::Routed { .. } => {}
            SeqEvent::Token(r) => c.tokens.push(r.token),
            SeqEvent::Finished(f) => c.end = Some(End::Finished(f)),
            SeqEvent::Aborted { weight_version } => {
                c.version.get_or_insert(weight_version.to_string());
                c.end = Some(End::Aborted(weight_version.to_string()));
            }
            SeqEvent::Restart => {
                *c = Choice {
                    restarts: c.restarts + 1,
                    ..Choice::default()
                }
            }
            SeqEvent::Refused { shutting_down, msg } => {
                c.end = Some(End::Refused { shutting_down, msg })
            }
        }
    }
    out
}

/// A choice that ran to its length on `version`, with these tokens.
fn finished(version: &str, tokens: Vec<u32>) -> Choice {
    Choice {
        version: Some(version.to_string()),
        tokens,
        end: Some(End::Finished(FinishReason::Length)),
        restarts: 0,
    }
}

fn from_disk(path: &str, policy: Policy, version: Option<&str>) -> ControlOp {
    ControlOp::FromDisk {
        path: PathBuf::from(path),
        update: UpdateReq {
            version: version.map(str::to_string),
            policy,
        },
    }
}

/// The reply's body; panics on a refusal.
fn ok(r: ControlReply) -> Value {
    match r {
        Ok(v) => v,
        Err(e) => panic!("refused: {e:?}"),
    }
}

/// The refusal's kind and message; panics on success.
fn refused(r: ControlReply) -> (RefusalKind, String) {
    match r {
        Ok(v) => panic!("applied: {v}"),
        Err(e) => (e.kind, e.message),
    }
}
