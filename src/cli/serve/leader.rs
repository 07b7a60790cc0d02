//! Rank 0: the engine loop (scheduler, plan broadcast, step, results to the HTTP side) on
//! this thread, the HTTP server on a tokio runtime beside it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arbor_collective::Communicator;
use arbor_model::engine::{Event, PlanMsg, Scheduler, SchedulerConfig, SeqId, StepPlan};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

use super::http::{self, AppState};
use super::msg::{Cmd, SeqEvent};
use super::stats::Stats;
use super::Args;
use crate::cli::model_api::Runner;

/// How long an idle engine waits for work before it pings the other ranks (their wait for
/// the next plan is a collective with a timeout).
const IDLE_TICK: Duration = Duration::from_millis(500);

pub fn lead(
    args: &Args,
    addr: SocketAddr,
    mut runner: Box<dyn Runner>,
    comm: Arc<dyn Communicator>,
) -> Result<()> {
    let max_len = runner.max_seq_len();
    let kv_blocks = args
        .kv_blocks
        .unwrap_or(args.max_num_seqs * max_len.div_ceil(args.kv_block_size));
    let sched_cfg = SchedulerConfig {
        slots: args.max_num_seqs,
        max_seq_len: max_len,
        chunk: args.prefill_chunk,
        step_tokens: args.max_num_batched_tokens,
        block_size: args.kv_block_size,
        kv_blocks,
        eos: runner.eos_token_ids().to_vec(),
        preempt: !args.no_preempt,
    };
    let sched = Scheduler::new(sched_cfg)?;
    let stats = Arc::new(Stats::default());
    stats.set_from(&sched);
    let (tx, rx) = std::sync::mpsc::channel::<Cmd>();
    let state = AppState::new(args, runner.as_ref(), tx, stats.clone())?;
    let stop_http = state.stop.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let http_thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || http::serve(state, addr, ready_tx))
        .context("starting the HTTP thread")?;
    let bound = match ready_rx.recv() {
        Ok(Ok(bound)) => bound,
        Ok(Err(e)) => {
            broadcast(comm.as_ref(), &PlanMsg::Shutdown)?;
            return Err(e);
        }
        Err(_) => {
            broadcast(comm.as_ref(), &PlanMsg::Shutdown)?;
            anyhow::bail!("the HTTP thread ended before binding {addr}");
        }
    };
    tracing::info!(%bound, tp = comm.world_size(), "serving");
    eprintln!(
        "arbor serve: listening on http://{bound} (TP {}, {} slots of {max_len} positions, {kv_blocks} KV blocks of {})",
        comm.world_size(),
        args.max_num_seqs,
        args.kv_block_size
    );
    let drain = Duration::from_secs_f64(args.drain_timeout_s);
    let result = engine_loop(runner.as_mut(), comm.as_ref(), sched, rx, &stats, drain);
    // The other ranks stop whatever happened here; a failed broadcast means one is gone.
    let bcast = broadcast(comm.as_ref(), &PlanMsg::Shutdown);
    // Every handler has its answer by now (its result, or a 503 naming the failure): the
    // HTTP side sends them and closes its connections before this process goes, also when
    // the engine failed.
    let _ = stop_http.send(true);
    let http = match http_thread.join() {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("the HTTP thread panicked")),
    };
    result?;
    bcast?;
    http?;
    eprintln!("arbor serve: drained, exiting");
    Ok(())
}

fn broadcast(comm: &dyn Communicator, msg: &PlanMsg) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut bytes = msg.encode()?;
    comm.broadcast_bytes(&mut bytes, 0)
        .context("broadcasting the step plan to the other ranks")
}

/// A sequence the engine runs for a handler.
struct Live {
    tag: usize,
    events: Sender<(usize, SeqEvent)>,
    cancel: Arc<AtomicBool>,
}

/// Runs the engine until it is drained (or its command channel closes); when it fails (a
/// rank gone, a step's error), every running or queued request is refused with the
/// reason before the error is returned.
fn engine_loop(
    runner: &mut dyn Runner,
    comm: &dyn Communicator,
    sched: Scheduler,
    rx: Receiver<Cmd>,
    stats: &Stats,
    drain_timeout: Duration,
) -> Result<()> {
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let result = run_engine(runner, comm, sched, &rx, stats, drain_timeout, &mut live);
    if let Err(e) = &result {
        let msg = format!("the server stopped: {e:#}");
        let refuse = |events: &Sender<(usize, SeqEvent)>, tag: usize| {
            let _ = events.try_send((
                tag,
                SeqEvent::Refused {
                    shutting_down: true,
                    msg: msg.clone(),
                },
            ));
        };
        for (_, l) in live.drain() {
            refuse(&l.events, l.tag);
        }
        for cmd in rx.try_iter() {
            if let Cmd::Submit { events, tag, .. } = cmd {
                refuse(&events, tag);
            }
        }
    }
    result
}

fn run_engine(
    runner: &mut dyn Runner,
    comm: &dyn Communicator,
    mut sched: Scheduler,
    rx: &Receiver<Cmd>,
    stats: &Stats,
    drain_timeout: Duration,
    live: &mut HashMap<SeqId, Live>,
) -> Result<()> {
    let mut drain_deadline: Option<Instant> = None;
    let mut step_no = 0u64;
    loop {
        let mut cmds = Vec::new();
        if sched.is_idle() {
            if drain_deadline.is_some() {
                return Ok(());
            }
            match rx.recv_timeout(IDLE_TICK) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => {
                    broadcast(comm, &PlanMsg::Idle)?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
        cmds.extend(rx.try_iter());
        for cmd in cmds {
            match cmd {
                Cmd::Submit {
                    spec,
                    tag,
                    events,
                    cancel,
                } => {
                    if drain_deadline.is_some() {
                        let _ = events.try_send((
                            tag,
                            SeqEvent::Refused {
                                shutting_down: true,
                                msg: "the server is shutting down".into(),
                            },
                        ));
                        continue;
                    }
                    match sched.submit(spec) {
                        Ok(seq) => {
                            live.insert(
                                seq,
                                Live {
                                    tag,
                                    events,
                                    cancel,
                                },
                            );
                        }
                        Err(e) => {
                            let _ = events.try_send((
                                tag,
                                SeqEvent::Refused {
                                    shutting_down: false,
                                    msg: e.to_string(),
                                },
                            ));
                        }
                    }
                }
                Cmd::Drain => {
                    if drain_deadline.is_none() {
                        tracing::info!(
                            running = sched.running(),
                            waiting = sched.waiting(),
                            "draining"
                        );
                        drain_deadline = Some(Instant::now() + drain_timeout);
                    }
                }
            }
        }
        // A handler that is gone (client disconnected, stop string) frees its KV now.
        live.retain(|&seq, l| {
            let keep = !l.events.is_closed() && !l.cancel.load(Ordering::SeqCst);
            if !keep {
                sched.cancel(seq);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            keep
        });
        if drain_deadline.is_some_and(|d| Instant::now() >= d) {
            for (seq, l) in live.drain() {
                sched.cancel(seq);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = l.events.try_send((
                    l.tag,
                    SeqEvent::Refused {
                        shutting_down: true,
                        msg: "cancelled: the server is shutting down".into(),
                    },
                ));
            }
        }
        let plan = sched.plan();
        if plan.is_empty() {
            stats.set_from(&sched);
            continue;
        }
        let t0 = Instant::now();
        broadcast(comm, &PlanMsg::Step(plan.clone()))?;
        let results = runner
            .execute(&plan)
            .with_context(|| format!("rank 0: executing step {step_no}"))?;
        let events = sched.apply(&plan, &results)?;
        let dt = t0.elapsed().as_secs_f64();
        let (prompt_rows, sampled) = counts(&plan);
        stats.record_step(dt, plan.n_tokens(), prompt_rows, sampled);
        step_no += 1;
        let mut unread = Vec::new();
        for ev in events {
            let (seq, msg) = match ev {
                Event::Scored { seq, records } => (seq, SeqEvent::Scored(records)),
                Event::Token { seq, record } => (seq, SeqEvent::Token(record)),
                Event::Finished { seq, reason } => (seq, SeqEvent::Finished(reason)),
            };
            let done = matches!(msg, SeqEvent::Finished(_));
            if let Some(l) = live.get(&seq) {
                // Closed: the handler is gone, and the next pass cancels the sequence.
                if let Err(TrySendError::Full(_)) = l.events.try_send((l.tag, msg)) {
                    // Tells the handler why its sequence ends unfinished.
                    l.cancel.store(true, Ordering::SeqCst);
                    unread.push((seq, done));
                }
            }
            if done {
                live.remove(&seq);
            }
        }
        // A handler this far behind has a client that does not read its stream: stop its
        // sequences instead of holding their events (and KV) for it.
        for (seq, done) in unread {
            if live.remove(&seq).is_some() && !done {
                sched.cancel(seq);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats.set_from(&sched);
    }
}

/// Prompt rows and sampled tokens of a plan.
fn counts(plan: &StepPlan) -> (usize, usize) {
    let prompt = plan
        .rows
        .iter()
        .filter(|r| r.prefill)
        .map(|r| r.tokens.len())
        .sum();
    let sampled = plan.rows.iter().filter(|r| r.sample).count();
    (prompt, sampled)
}
