//! Rank 0's side of the weight, memory and generation-control commands (docs/rl.md): the
//! serving weight version, pause state, an update waiting for started requests, the
//! requests held meanwhile, and the broadcast of each command to every rank.
//!
//! The rule that keeps every response exact: **the weights never change while a started
//! request is in flight**. A request has started once a step ran one of its choices; all
//! its choices then report that version. Before an update applies, each started request
//! either finishes (policy `wait`: requests that have not started are held and run on the
//! new weights), is re-run from its prompts (`retract`; arbor is deterministic, so the
//! re-run is the request as the new weights answer it), or ends (`abort`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arbor_collective::Communicator;
use arbor_model::engine::{ControlMsg, PlanMsg, Scheduler, UpdateSource};
use arbor_model::runner::weights_update::{run_control, ControlError, FailureKind, Origin};
use serde_json::{json, Value};
use tokio::sync::oneshot::Sender;

use super::msg::{ControlOp, ControlReply, PauseMode, Policy, SeqEvent, Submission, UpdateReq};
use super::registry::Registry;
use super::stats::Stats;
use crate::cli::model_api::Runner;

/// Limits of the commands.
#[derive(Debug, Clone, Copy)]
pub struct ControlConfig {
    /// How long an update with policy `wait` waits for the started requests.
    pub update_wait: Duration,
    /// Staged tensors with no new part for this long are dropped.
    pub upload_idle: Duration,
}

/// What a command works on: the engine loop's state, lent for one call.
pub struct Ctx<'a> {
    pub runner: &'a mut dyn Runner,
    pub comm: &'a dyn Communicator,
    pub sched: &'a mut Scheduler,
    pub reqs: &'a mut Registry,
    pub stats: &'a Stats,
}

/// An update waiting for the started requests to finish (policy `wait`).
struct Pending {
    src: UpdateSource,
    req: UpdateReq,
    reply: Sender<ControlReply>,
    since: Instant,
}

pub struct Control {
    /// The version every response reports (the weights serving now).
    pub version: Arc<str>,
    updates: u64,
    paused: Option<PauseMode>,
    pending: Option<Pending>,
    /// Requests that arrived while an update waits: they run on the new weights.
    held: Vec<Submission>,
    weights: bool,
    kv: bool,
    /// When the last part of a push was staged (None: nothing staged).
    staged_at: Option<Instant>,
    cfg: ControlConfig,
}

fn refuse(status: u16, msg: impl Into<String>) -> ControlReply {
    Err((status, msg.into()))
}

fn status_of(kind: FailureKind) -> u16 {
    match kind {
        FailureKind::Input => 400,
        FailureKind::State => 409,
        FailureKind::Server => 500,
    }
}

fn send(reply: Sender<ControlReply>, r: ControlReply) {
    let _ = reply.send(r);
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

    /// A new request: queued, or held while an update waits.
    pub fn submit(&mut self, cx: &mut Ctx<'_>, sub: Submission) {
        if self.pending.is_some() {
            self.held.push(sub);
        } else {
            cx.reqs.submit(cx.sched, sub);
        }
    }

    /// Shutdown: the held requests and a waiting update are answered with `msg`.
    pub fn refuse_waiting(&mut self, msg: &str) {
        for sub in self.held.drain(..) {
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
        if let Some(p) = self.pending.take() {
            send(p.reply, refuse(503, msg));
        }
    }

    /// Broadcasts `msg` to the other ranks and runs it here; the outcome is every rank's.
    fn run(&self, cx: &mut Ctx<'_>, msg: ControlMsg) -> Result<Result<(), ControlError>> {
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
                .with_context(|| format!("broadcasting a command ({what}) to the other ranks"))?;
            match plan {
                PlanMsg::Control(m) => m,
                _ => unreachable!("built as a command above"),
            }
        } else {
            msg
        };
        let t0 = Instant::now();
        let r = run_control(cx.runner, cx.comm, msg)
            .with_context(|| format!("{what}: the ranks could not agree"))?;
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

    /// Runs `op` and answers on `reply` (now, or when a waiting update applies). `Err`
    /// only when the group broke (a rank is gone).
    pub fn handle(
        &mut self,
        cx: &mut Ctx<'_>,
        op: ControlOp,
        reply: Sender<ControlReply>,
    ) -> Result<()> {
        if self.pending.is_some()
            && !matches!(
                op,
                ControlOp::Pause(_) | ControlOp::Continue | ControlOp::Abort { .. }
            )
        {
            send(
                reply,
                refuse(409, "another weight update is waiting for the started requests to finish; retry when it has applied"),
            );
            return Ok(());
        }
        match op {
            ControlOp::FromDisk { path, update } => {
                let (n, _) = self.staged(cx);
                if n > 0 {
                    send(reply, refuse(409, format!("a push is in progress ({n} tensors staged by update_weights_from_tensor / _distributed): commit or discard it first")));
                    return Ok(());
                }
                self.update(cx, UpdateSource::Disk(path), update, reply)?;
            }
            ControlOp::Stage { bytes, commit } => {
                let label = format!("update_weights_from_tensor body ({} bytes)", bytes.len());
                match self.run(cx, ControlMsg::Stage { label, bytes })? {
                    Ok(()) => {
                        self.staged_at = Some(Instant::now());
                        match commit {
                            Some(u) => self.update(cx, UpdateSource::Staged, u, reply)?,
                            None => send(reply, Ok(self.staged_body(cx))),
                        }
                    }
                    Err(e) => {
                        self.staged_at = None;
                        send(reply, refuse(status_of(e.kind), format!("{e}; every tensor staged so far was dropped: push again from the first part")));
                    }
                }
            }
            ControlOp::Commit(u) => {
                let (n, _) = self.staged(cx);
                if n == 0 {
                    send(reply, refuse(400, "nothing is staged: send the tensors first (update_weights_from_tensor with commit=false)"));
                    return Ok(());
                }
                self.update(cx, UpdateSource::Staged, u, reply)?;
            }
            ControlOp::Discard => {
                self.run(cx, ControlMsg::Discard)?.ok();
                self.staged_at = None;
                send(
                    reply,
                    Ok(json!({"success": true, "message": "the staged tensors were dropped"})),
                );
            }
            ControlOp::InitGroup {
                name,
                unique_id,
                world,
                rank_offset,
                timeout_s,
            } => {
                let r = self.run(
                    cx,
                    ControlMsg::JoinGroup {
                        name: name.clone(),
                        unique_id,
                        world,
                        rank_offset,
                        timeout_s,
                    },
                )?;
                send(
                    reply,
                    match r {
                        Ok(()) => Ok(
                            json!({"success": true, "message": format!("joined the weight-update group {name:?} as ranks {rank_offset}..{} of {world}", rank_offset + cx.comm.world_size())}),
                        ),
                        Err(e) => refuse(status_of(e.kind), e.to_string()),
                    },
                );
            }
            ControlOp::DestroyGroup { name } => {
                let r = self.run(cx, ControlMsg::LeaveGroup { name: name.clone() })?;
                send(
                    reply,
                    match r {
                        Ok(()) => Ok(
                            json!({"success": true, "message": format!("left the weight-update group {name:?}")}),
                        ),
                        Err(e) => refuse(status_of(e.kind), e.to_string()),
                    },
                );
            }
            ControlOp::Receive {
                group,
                tensors,
                timeout_s,
                commit,
            } => {
                let n = tensors.len();
                match self.run(
                    cx,
                    ControlMsg::Receive {
                        group,
                        tensors,
                        timeout_s,
                    },
                )? {
                    Ok(()) => {
                        self.staged_at = Some(Instant::now());
                        match commit {
                            Some(u) => self.update(cx, UpdateSource::Staged, u, reply)?,
                            None => send(reply, Ok(self.staged_body(cx))),
                        }
                    }
                    Err(e) => {
                        self.staged_at = None;
                        send(reply, refuse(status_of(e.kind), format!("{e}; the {n} tensors of this call and every one staged before were dropped")));
                    }
                }
            }
            ControlOp::Pause(mode) => {
                let (aborted, retracted) = match mode {
                    PauseMode::Abort => (cx.reqs.abort(cx.sched, None, &self.version, cx.stats), 0),
                    PauseMode::Retract => (0, cx.reqs.retract_started(cx.sched)),
                    PauseMode::InPlace => (0, 0),
                };
                self.paused = Some(mode);
                cx.stats.paused.store(true, Ordering::Relaxed);
                send(
                    reply,
                    Ok(
                        json!({"success": true, "message": "generation paused", "aborted": aborted, "retracted": retracted}),
                    ),
                );
            }
            ControlOp::Continue => {
                self.paused = None;
                cx.stats.paused.store(false, Ordering::Relaxed);
                send(
                    reply,
                    Ok(json!({"success": true, "message": "generation continues"})),
                );
            }
            ControlOp::Abort { rid } => {
                let mut n = cx
                    .reqs
                    .abort(cx.sched, rid.as_deref(), &self.version, cx.stats);
                let version = self.version.clone();
                self.held.retain(|sub| {
                    if rid.as_deref().is_some_and(|r| r != sub.rid) {
                        return true;
                    }
                    n += 1;
                    for tag in 0..sub.choices.len() {
                        let _ = sub.events.try_send((
                            tag,
                            SeqEvent::Aborted {
                                weight_version: version.clone(),
                            },
                        ));
                    }
                    false
                });
                send(reply, Ok(json!({"success": true, "aborted": n})));
            }
            ControlOp::Release { weights, kv } => {
                let started = cx.reqs.started();
                if started > 0 {
                    send(reply, refuse(409, format!("{started} requests are running: pause_generation with mode abort or retract (or abort them) first")));
                    return Ok(());
                }
                match self.run(cx, ControlMsg::Release { weights, kv })? {
                    Ok(()) => {
                        self.weights &= !weights;
                        self.kv &= !kv;
                        self.set_released(cx);
                        send(
                            reply,
                            Ok(
                                json!({"success": true, "message": format!("released:{}{}", if weights { " weights" } else { "" }, if kv { " kv_cache" } else { "" })}),
                            ),
                        );
                    }
                    Err(e) => send(reply, refuse(status_of(e.kind), e.to_string())),
                }
            }
            ControlOp::Resume { from: Some(_), .. } if self.weights => {
                send(reply, refuse(409, "model_path reloads released weights, and the weights are in memory: use update_weights_from_disk to change them"));
            }
            ControlOp::Resume {
                weights,
                kv,
                from,
                version,
            } => {
                let reload = weights && !self.weights;
                let origin = cx.runner.weights_state().origin;
                let t0 = Instant::now();
                match self.run(
                    cx,
                    ControlMsg::Resume {
                        weights,
                        kv,
                        from: from.clone(),
                    },
                )? {
                    Ok(()) => {
                        self.weights |= weights;
                        self.kv |= kv;
                        self.set_released(cx);
                        // Weights read from elsewhere than where they came from are new weights.
                        let moved = reload
                            && from
                                .as_ref()
                                .is_some_and(|p| origin != Origin::Disk(p.clone()));
                        if moved || (reload && version.is_some()) {
                            self.new_version(cx, version, t0.elapsed().as_secs_f64());
                        }
                        send(
                            reply,
                            Ok(
                                json!({"success": true, "message": "resumed", "weight_version": &*self.version}),
                            ),
                        );
                    }
                    Err(e) => send(reply, refuse(status_of(e.kind), e.to_string())),
                }
            }
            ControlOp::FlushCache => {
                let started = cx.reqs.started();
                if started > 0 {
                    send(
                        reply,
                        refuse(
                            409,
                            format!("the cache was not flushed: {started} requests are running"),
                        ),
                    );
                    return Ok(());
                }
                let r = self.run(cx, ControlMsg::FlushCache)?;
                send(
                    reply,
                    match r {
                        Ok(()) => Ok(json!({"success": true, "message": "cache flushed"})),
                        Err(e) => refuse(status_of(e.kind), e.to_string()),
                    },
                );
            }
        }
        Ok(())
    }

    fn set_released(&self, cx: &Ctx<'_>) {
        cx.stats
            .released
            .store(!(self.weights && self.kv), Ordering::Relaxed);
    }

    fn staged_body(&self, cx: &Ctx<'_>) -> Value {
        let (n, bytes) = self.staged(cx);
        json!({"success": true, "message": format!("{n} tensors staged ({bytes} bytes); commit to apply them"), "staged_tensors": n, "staged_bytes": bytes})
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
        reply: Sender<ControlReply>,
    ) -> Result<()> {
        let (aborted, retracted) = match req.policy {
            Policy::Abort => (cx.reqs.abort(cx.sched, None, &self.version, cx.stats), 0),
            Policy::Retract => (0, cx.reqs.retract_started(cx.sched)),
            Policy::Wait => (0, 0),
        };
        let started = cx.reqs.started();
        if started > 0 {
            if self.paused == Some(PauseMode::InPlace) {
                send(reply, refuse(409, format!("{started} requests are held in place by pause_generation: continue_generation first (they finish on the current weights), or send the update with policy \"retract\" or \"abort\"")));
                return Ok(());
            }
            // Requests not started yet run on the new weights: out of the queue until then.
            let unstarted = cx.reqs.take_unstarted(cx.sched);
            self.held.splice(0..0, unstarted);
            tracing::info!(
                started,
                held = self.held.len(),
                "update waits for the started requests"
            );
            self.pending = Some(Pending {
                src,
                req,
                reply,
                since: Instant::now(),
            });
            return Ok(());
        }
        let r = self.apply(cx, src, req, 0.0, aborted, retracted)?;
        send(reply, r);
        Ok(())
    }

    fn apply(
        &mut self,
        cx: &mut Ctx<'_>,
        src: UpdateSource,
        req: UpdateReq,
        waited: f64,
        aborted: usize,
        retracted: usize,
    ) -> Result<ControlReply> {
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
                eprintln!(
                    "arbor serve: weights updated in {seconds:.2} s: version {old} -> {}",
                    self.version
                );
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
            Err(e) => refuse(
                status_of(e.kind),
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
    pub fn tick(&mut self, cx: &mut Ctx<'_>) -> Result<()> {
        if let Some(p) = &self.pending {
            let started = cx.reqs.started();
            let waited = p.since.elapsed();
            if started == 0 {
                let p = self.pending.take().context("pending update")?;
                let r = self.apply(cx, p.src, p.req, waited.as_secs_f64(), 0, 0)?;
                send(p.reply, r);
            } else if waited > self.cfg.update_wait {
                let p = self.pending.take().context("pending update")?;
                send(p.reply, refuse(503, format!(
                    "timed out after {:.0} s waiting for {started} started requests to finish; nothing changed (send the update with policy \"retract\" or \"abort\", or raise --weight-update-wait-s)",
                    waited.as_secs_f64()
                )));
                for sub in std::mem::take(&mut self.held) {
                    cx.reqs.submit(cx.sched, sub);
                }
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

    /// Whether `tick` has something to watch (the loop must not sleep long then).
    pub fn busy(&self) -> bool {
        self.pending.is_some()
    }
}
