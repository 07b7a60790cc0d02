//! Rank 0's side of the weight, memory and generation-control operations (docs/rl.md): the
//! serving weight version, pause state, an update waiting for started requests, the
//! requests held meanwhile, and the broadcast of each command to every rank. One method
//! per operation lives in ops.rs; this file holds the state and what the operations share.
//!
//! The rule that keeps every response exact: **the weights never change while a started
//! request is in flight**. A request has started once a step ran one of its choices; all
//! its choices then report that version. Before an update applies, each started request
//! either finishes (policy `wait`: requests that have not started are held and run on the
//! new weights), is re-run from its prompts (`retract`; arbor is deterministic, so the
//! re-run is the request as the new weights answer it), or ends (`abort`).

mod ops;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_collective::Communicator;
use arbor_model::batching::{ControlMsg, PlanMsg, Scheduler, UpdateSource};
use arbor_model::runner::weights_update::{run_control, ControlError};
use arbor_model::Runner;
use serde_json::json;
use tokio::sync::oneshot::Sender;

use crate::error::ServeError;
use crate::handle::Request;
use crate::msg::{ControlOp, ControlReply, PauseMode, Policy, Refusal, RefusalKind, UpdateReq};
use crate::registry::Registry;
use crate::stats::Stats;

/// Limits of the operations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ControlConfig {
    /// How long an update with policy `wait` waits for the started requests.
    pub update_wait: Duration,
    /// Staged tensors with no new part for this long are dropped.
    pub upload_idle: Duration,
}

/// What an operation works on: the loop's state, lent for one call.
pub(crate) struct Ctx<'a> {
    pub runner: &'a mut dyn Runner,
    pub comm: &'a dyn Communicator,
    pub sched: &'a mut Scheduler,
    pub reqs: &'a mut Registry,
    pub stats: &'a Stats,
}

/// What an operation did: answered, or made an update wait for the started requests.
enum Outcome {
    Done(ControlReply),
    Waits(WaitingUpdate),
}

/// An update that waits for the started requests to finish (policy `wait`).
struct WaitingUpdate {
    src: UpdateSource,
    req: UpdateReq,
    since: Instant,
}

/// A waiting update and where its answer goes.
struct Pending {
    update: WaitingUpdate,
    reply: Sender<ControlReply>,
}

pub(crate) struct Control {
    /// The version every response reports (the weights serving now).
    pub version: Arc<str>,
    updates: u64,
    paused: Option<PauseMode>,
    pending: Option<Pending>,
    /// Requests that arrived while an update waits: they run on the new weights.
    held: Vec<Request>,
    weights: bool,
    kv: bool,
    /// When the last part of a push was staged (None: nothing staged).
    staged_at: Option<Instant>,
    cfg: ControlConfig,
}

fn refuse(kind: RefusalKind, msg: impl Into<String>) -> ControlReply {
    Err(Refusal::new(kind, msg))
}

/// Every rank's failure, as a refusal of the operation.
fn refused(e: &ControlError, msg: impl Into<String>) -> ControlReply {
    refuse(e.kind.into(), msg)
}

fn done(body: serde_json::Value) -> Result<Outcome, ServeError> {
    Ok(Outcome::Done(Ok(body)))
}

fn done_err(kind: RefusalKind, msg: impl Into<String>) -> Result<Outcome, ServeError> {
    Ok(Outcome::Done(refuse(kind, msg)))
}

impl Control {
    pub fn new(version: String, cfg: ControlConfig, stats: &Stats) -> Self {
        stats.set_weight_version(&version);
        Control {
            version: version.into(),
            updates: 0,
            paused: None,
            pending: None,
            held: Vec::new(),
            weights: true,
            kv: true,
            staged_at: None,
            cfg,
        }
    }

    /// Whether steps may run: not paused, weights and KV cache present.
    pub fn can_step(&self) -> bool {
        self.paused.is_none() && self.weights && self.kv
    }

    /// Whether `tick` has something to watch (the loop must not sleep long then).
    pub fn busy(&self) -> bool {
        self.pending.is_some()
    }

    /// A new request: queued, or held while an update waits.
    pub fn submit(&mut self, cx: &mut Ctx<'_>, sub: Request) {
        if self.pending.is_some() {
            self.held.push(sub);
        } else {
            cx.reqs.submit(cx.sched, sub);
        }
    }

    /// Shutdown: the held requests and a waiting update are answered with `msg`.
    pub fn refuse_waiting(&mut self, msg: &str) {
        for sub in self.held.drain(..) {
            sub.refuse(true, msg);
        }
        if let Some(p) = self.pending.take() {
            let _ = p.reply.send(refuse(RefusalKind::Unavailable, msg));
        }
    }

    /// Runs `op` and answers on `reply` (now, or when a waiting update applies). `Err`
    /// only when the group broke (a rank is gone).
    pub fn handle(
        &mut self,
        cx: &mut Ctx<'_>,
        op: ControlOp,
        reply: Sender<ControlReply>,
    ) -> Result<(), ServeError> {
        let outcome = if self.pending.is_some()
            && !matches!(
                op,
                ControlOp::Pause(_) | ControlOp::Continue | ControlOp::Abort { .. }
            ) {
            Outcome::Done(refuse(
                RefusalKind::Conflict,
                "another weight update is waiting for the started requests to finish; retry when it has applied",
            ))
        } else {
            match op {
                ControlOp::FromDisk { path, update } => self.update_from_disk(cx, path, update)?,
                ControlOp::Stage { bytes, commit } => self.stage(cx, bytes, commit)?,
                ControlOp::StageIpc { ranks, commit } => self.stage_ipc(cx, ranks, commit)?,
                ControlOp::Commit(update) => self.commit(cx, update)?,
                ControlOp::Finish(update) => self.finish(cx, update)?,
                ControlOp::Discard => self.discard(cx)?,
                ControlOp::InitGroup {
                    name,
                    rendezvous,
                    world,
                    rank_offset,
                    timeout_s,
                } => self.init_group(cx, name, rendezvous, world, rank_offset, timeout_s)?,
                ControlOp::Receive {
                    group,
                    tensors,
                    timeout_s,
                    packed,
                    commit,
                } => self.receive(cx, group, tensors, timeout_s, packed, commit)?,
                ControlOp::ReceiveInBand {
                    group,
                    timeout_s,
                    max_bytes,
                    commit,
                } => {
                    let msg = ControlMsg::ReceiveInBand {
                        group,
                        timeout_s,
                        max_bytes,
                    };
                    self.receive_msg(cx, msg, "the tensors of this update".into(), commit)?
                }
                ControlOp::DestroyGroup { name } => self.destroy_group(cx, name)?,
                ControlOp::Pause(mode) => self.pause(cx, mode),
                ControlOp::Continue => self.continue_generation(cx),
                ControlOp::Abort { rid } => self.abort(cx, rid),
                ControlOp::Release { weights, kv } => self.release(cx, weights, kv)?,
                ControlOp::Resume {
                    weights,
                    kv,
                    from,
                    version,
                } => self.resume(cx, weights, kv, from, version)?,
                ControlOp::FlushCache => self.flush_cache(cx)?,
                ControlOp::SetVersion { version, abort_all } => {
                    self.set_version(cx, version, abort_all)
                }
            }
        };
        match outcome {
            Outcome::Done(r) => {
                let _ = reply.send(r);
            }
            Outcome::Waits(update) => self.pending = Some(Pending { update, reply }),
        }
        Ok(())
    }

    /// Broadcasts `msg` to the other ranks and runs it here; the outcome is every rank's.
    fn run(
        &self,
        cx: &mut Ctx<'_>,
        msg: ControlMsg,
    ) -> Result<Result<(), ControlError>, ServeError> {
        let what = msg.what();
        // What changes the weights or the KV memory makes the cached prefixes stale.
        let stale = matches!(
            msg,
            ControlMsg::Update(_)
                | ControlMsg::FlushCache
                | ControlMsg::Release { .. }
                | ControlMsg::Resume { .. }
        );
        let update = matches!(msg, ControlMsg::Update(_));
        let msg = if cx.comm.world_size() > 1 {
            // Encoded in place: a pushed part is not copied for the broadcast.
            let plan = PlanMsg::Control(msg);
            let mut bytes = plan.encode()?;
            cx.comm
                .broadcast_bytes(&mut bytes, 0)
                .map_err(ServeError::collective(format!(
                    "broadcasting a command ({what}) to the other ranks"
                )))?;
            match plan {
                PlanMsg::Control(m) => m,
                _ => unreachable!("built as a command above"),
            }
        } else {
            msg
        };
        let t0 = Instant::now();
        let r = run_control(cx.runner, cx.comm, msg).map_err(ServeError::model(format!(
            "{what}: the ranks could not agree"
        )))?;
        tracing::info!(
            what,
            ok = r.is_ok(),
            seconds = t0.elapsed().as_secs_f64(),
            "command"
        );
        // A failed update may have freed and remade the KV cache to load beside it
        // (`--update-memory`): its blocks' contents are gone either way.
        if stale && (r.is_ok() || update) {
            cx.sched.drop_prefix_cache();
        }
        Ok(r)
    }

    fn staged(&self, cx: &Ctx<'_>) -> (usize, usize) {
        let s = cx.runner.weights_state();
        (s.staged_tensors, s.staged_bytes)
    }

    fn set_released(&self, cx: &Ctx<'_>) {
        cx.stats
            .released
            .store(!(self.weights && self.kv), Ordering::Relaxed);
    }

    fn new_version(&mut self, cx: &Ctx<'_>, given: Option<String>, seconds: f64) {
        self.updates += 1;
        let v = given.unwrap_or_else(|| self.updates.to_string());
        cx.stats.set_weight_version(&v);
        cx.stats.record_update(seconds);
        self.version = v.into();
    }

    /// An update: the requests in flight follow its policy, then it applies (now, or once
    /// the started requests have finished).
    fn update(
        &mut self,
        cx: &mut Ctx<'_>,
        src: UpdateSource,
        req: UpdateReq,
    ) -> Result<Outcome, ServeError> {
        let (aborted, retracted) = match req.policy {
            Policy::Abort => (cx.reqs.abort(cx.sched, None, &self.version, cx.stats), 0),
            Policy::Retract => (0, cx.reqs.retract_started(cx.sched)),
            Policy::Wait => (0, 0),
        };
        let started = cx.reqs.started();
        if started > 0 {
            if self.paused == Some(PauseMode::InPlace) {
                return done_err(RefusalKind::Conflict, format!("{started} requests are held in place by pause_generation: continue_generation first (they finish on the current weights), or send the update with policy \"retract\" or \"abort\""));
            }
            // Requests not started yet run on the new weights: out of the queue until then.
            let unstarted = cx.reqs.take_unstarted(cx.sched);
            self.held.splice(0..0, unstarted);
            tracing::info!(
                started,
                held = self.held.len(),
                "update waits for the started requests"
            );
            return Ok(Outcome::Waits(WaitingUpdate {
                src,
                req,
                since: Instant::now(),
            }));
        }
        let r = self.apply(cx, src, req, 0.0, aborted, retracted)?;
        Ok(Outcome::Done(r))
    }

    fn apply(
        &mut self,
        cx: &mut Ctx<'_>,
        src: UpdateSource,
        req: UpdateReq,
        waited: f64,
        aborted: usize,
        retracted: usize,
    ) -> Result<ControlReply, ServeError> {
        let old = self.version.clone();
        let t0 = Instant::now();
        let pushed = src == UpdateSource::Staged;
        let r = self.run(cx, ControlMsg::Update(src))?;
        self.staged_at = None;
        // A KV cache freed for the update (`--update-memory`) is made again after it; where
        // that failed, generation waits for resume_memory_occupation.
        self.kv = self.kv && cx.runner.weights_state().kv_loaded;
        self.weights |= r.is_ok();
        self.set_released(cx);
        let seconds = t0.elapsed().as_secs_f64();
        let reply = match r {
            Ok(()) => {
                self.new_version(cx, req.version, seconds);
                tracing::info!(from = %old, to = %self.version, seconds, "weights updated");
                Ok(json!({
                    "success": true,
                    "message": format!("weights updated in {seconds:.3} s"),
                    "weight_version": &*self.version,
                    "previous_weight_version": &*old,
                    "seconds": seconds,
                    "waited_seconds": waited,
                    "aborted": aborted,
                    "retracted": retracted,
                }))
            }
            Err(e) => refused(
                &e,
                format!(
                    "{e}; nothing changed: version {old} keeps serving{}",
                    if pushed {
                        " (the staged tensors were dropped: push them again)"
                    } else {
                        ""
                    }
                ),
            ),
        };
        for sub in std::mem::take(&mut self.held) {
            cx.reqs.submit(cx.sched, sub);
        }
        Ok(reply)
    }

    /// Applies a waiting update once no started request is left (or refuses it when it
    /// waited too long), and drops staged tensors nobody commits.
    pub fn tick(&mut self, cx: &mut Ctx<'_>) -> Result<(), ServeError> {
        if let Some(p) = self.pending.take() {
            let started = cx.reqs.started();
            let waited = p.update.since.elapsed();
            if started == 0 {
                let WaitingUpdate { src, req, .. } = p.update;
                let r = self.apply(cx, src, req, waited.as_secs_f64(), 0, 0)?;
                let _ = p.reply.send(r);
            } else if waited > self.cfg.update_wait {
                let _ = p.reply.send(refuse(RefusalKind::Unavailable, format!(
                    "timed out after {:.0} s waiting for {started} started requests to finish; nothing changed (send the update with policy \"retract\" or \"abort\", or raise --weight-update-wait-s)",
                    waited.as_secs_f64()
                )));
                for sub in std::mem::take(&mut self.held) {
                    cx.reqs.submit(cx.sched, sub);
                }
            } else {
                self.pending = Some(p);
            }
        }
        if self
            .staged_at
            .is_some_and(|t| t.elapsed() > self.cfg.upload_idle)
        {
            let (n, _) = self.staged(cx);
            tracing::warn!(
                tensors = n,
                "dropping staged tensors: no part or commit for {:.0} s",
                self.cfg.upload_idle.as_secs_f64()
            );
            self.run(cx, ControlMsg::Discard)?.ok();
            self.staged_at = None;
        }
        Ok(())
    }
}
