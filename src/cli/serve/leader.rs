//! Rank 0: the engine loop (scheduler, plan broadcast, step, results to the HTTP side) on
//! this thread, the HTTP server on a tokio runtime beside it.

use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arbor_collective::Communicator;
use arbor_model::engine::{PlanMsg, Scheduler, SchedulerConfig, StepPlan};

use super::control::{Control, ControlConfig, Ctx};
use super::http;
use super::msg::{Cmd, SeqEvent};
use super::registry::Registry;
use super::state::AppState;
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
    let cap = runner
        .kv_capacity()
        .cloned()
        .context("the runner made no KV cache")?;
    let sched_cfg = SchedulerConfig {
        max_running: args.max_num_seqs,
        max_seq_len: cap.max_seq_len,
        chunk: args.prefill_chunk,
        step_tokens: args.max_num_batched_tokens,
        step_outputs: super::step_outputs(args),
        kv_blocks: cap.blocks,
        eos: runner.eos_token_ids().to_vec(),
        preempt: !args.no_preempt,
        prefill_first: false,
        prefix_cache: !args.kv.no_prefix_cache,
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
        "arbor serve: listening on http://{bound} (TP {})",
        comm.world_size()
    );
    eprintln!(
        "arbor serve: KV cache {} blocks of {} = {} tokens, {:.2} GiB per rank ({}); max context {}; up to {} running sequences; {} tokens per step, prefill chunks of {}; prefix cache {}",
        cap.blocks,
        arbor_kernels::paged::KV_BLOCK,
        cap.tokens(),
        cap.gib(),
        cap.source,
        cap.max_seq_len,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.prefill_chunk,
        if args.kv.no_prefix_cache { "off" } else { "on" }
    );
    let drain = Duration::from_secs_f64(args.drain_timeout_s);
    let ctl = Control::new(
        args.weight_version.clone(),
        ControlConfig {
            update_wait: Duration::from_secs_f64(args.weight_update_wait_s),
            upload_idle: Duration::from_secs_f64(args.weight_upload_idle_s),
        },
        &stats,
    );
    let result = engine_loop(
        runner.as_mut(),
        comm.as_ref(),
        sched,
        rx,
        &stats,
        drain,
        ctl,
    );
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

/// Runs the engine until it is drained (or its command channel closes); when it fails (a
/// rank gone, a step's error), every running, queued or held request and every waiting
/// command is answered with the reason before the error is returned.
fn engine_loop(
    runner: &mut dyn Runner,
    comm: &dyn Communicator,
    mut sched: Scheduler,
    rx: Receiver<Cmd>,
    stats: &Stats,
    drain_timeout: Duration,
    mut ctl: Control,
) -> Result<()> {
    let mut reqs = Registry::default();
    let result = run_engine(
        runner,
        comm,
        &mut sched,
        &rx,
        stats,
        drain_timeout,
        &mut reqs,
        &mut ctl,
    );
    if let Err(e) = &result {
        let msg = format!("the server stopped: {e:#}");
        reqs.refuse_all(&mut sched, &msg, stats);
        ctl.refuse_waiting(&msg);
        for cmd in rx.try_iter() {
            match cmd {
                Cmd::Submit(sub) => refuse_submission(&sub, &msg),
                Cmd::Control { reply, .. } => {
                    let _ = reply.send(Err((503, msg.clone())));
                }
                Cmd::Drain => {}
            }
        }
    }
    result
}

fn refuse_submission(sub: &super::msg::Submission, msg: &str) {
    for tag in 0..sub.choices.len() {
        let _ = sub.events.try_send((
            tag,
            SeqEvent::Refused {
                shutting_down: true,
                msg: msg.to_string(),
            },
        ));
    }
}

#[allow(clippy::too_many_arguments)]
fn run_engine(
    runner: &mut dyn Runner,
    comm: &dyn Communicator,
    sched: &mut Scheduler,
    rx: &Receiver<Cmd>,
    stats: &Stats,
    drain_timeout: Duration,
    reqs: &mut Registry,
    ctl: &mut Control,
) -> Result<()> {
    let mut drain_deadline: Option<Instant> = None;
    let mut step_no = 0u64;
    loop {
        let mut cmds = Vec::new();
        if sched.is_idle() || !ctl.can_step() {
            if drain_deadline.is_some() && reqs.is_empty() {
                return Ok(());
            }
            let wait = if ctl.busy() {
                IDLE_TICK / 10
            } else {
                IDLE_TICK
            };
            match rx.recv_timeout(wait) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => {
                    broadcast(comm, &PlanMsg::Idle)?;
                    let mut cx = Ctx {
                        runner: &mut *runner,
                        comm,
                        sched: &mut *sched,
                        reqs: &mut *reqs,
                        stats,
                    };
                    cx.reqs.sweep(cx.sched, cx.stats);
                    ctl.tick(&mut cx)?;
                    if drain_deadline.is_some_and(|d| Instant::now() >= d) {
                        reqs.refuse_all(sched, "cancelled: the server is shutting down", stats);
                    }
                    stats.set_from(sched);
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
        cmds.extend(rx.try_iter());
        let mut cx = Ctx {
            runner: &mut *runner,
            comm,
            sched: &mut *sched,
            reqs: &mut *reqs,
            stats,
        };
        for cmd in cmds {
            match cmd {
                Cmd::Submit(sub) => {
                    if drain_deadline.is_some() {
                        refuse_submission(&sub, "the server is shutting down");
                        continue;
                    }
                    ctl.submit(&mut cx, sub);
                }
                Cmd::Control { op, reply } => {
                    if drain_deadline.is_some() {
                        let _ = reply.send(Err((503, "the server is shutting down".into())));
                        continue;
                    }
                    ctl.handle(&mut cx, op, reply)?;
                }
                Cmd::Drain => {
                    if drain_deadline.is_none() {
                        tracing::info!(
                            running = cx.sched.running(),
                            waiting = cx.sched.waiting(),
                            "draining"
                        );
                        drain_deadline = Some(Instant::now() + drain_timeout);
                        ctl.refuse_waiting("the server is shutting down");
                    }
                }
            }
        }
        // A handler that is gone (client disconnected, stop string, too far behind) frees
        // its KV now.
        cx.reqs.sweep(cx.sched, cx.stats);
        ctl.tick(&mut cx)?;
        if drain_deadline.is_some_and(|d| Instant::now() >= d) {
            reqs.refuse_all(sched, "cancelled: the server is shutting down", stats);
        }
        if !ctl.can_step() {
            stats.set_from(sched);
            continue;
        }
        let plan = sched.plan();
        if plan.is_empty() {
            stats.set_from(sched);
            continue;
        }
        reqs.on_plan(&plan, &ctl.version);
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
        for ev in events {
            reqs.dispatch(ev);
        }
        // A handler this far behind has a client that does not read its stream: stop its
        // sequences instead of holding their events (and KV) for it.
        reqs.sweep(sched, stats);
        stats.set_from(sched);
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
