//! One method per control operation. Each answers now (`Outcome::Done`) or, for an update
//! that must wait for the started requests, later (`Outcome::Waits`); `Err` only when the
//! group broke.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use arbor_model::batching::ipc::IpcBuffer;
use arbor_model::batching::{ControlMsg, Rendezvous, TensorMeta, UpdateSource};
use arbor_model::runner::weights_update::Origin;
use serde_json::{json, Value};

use super::{done, done_err, refused, Control, Ctx, Outcome};
use crate::error::ServeError;
use crate::msg::{Commit, PauseMode, RefusalKind, UpdateReq};

impl Control {
    /// New weights from a checkpoint on disk.
    pub(super) fn update_from_disk(
        &mut self,
        cx: &mut Ctx<'_>,
        path: PathBuf,
        update: UpdateReq,
    ) -> Result<Outcome, ServeError> {
        let (n, _) = self.staged(cx);
        if n > 0 {
            return done_err(RefusalKind::Conflict, format!("a push is in progress ({n} tensors staged by update_weights_from_tensor / _distributed): commit or discard it first"));
        }
        self.update(cx, UpdateSource::Disk(path), update)
    }

    /// Stages one pushed part; the last one (`commit`) applies everything staged.
    pub(super) fn stage(
        &mut self,
        cx: &mut Ctx<'_>,
        bytes: Vec<u8>,
        commit: Commit,
    ) -> Result<Outcome, ServeError> {
        let label = format!("update_weights_from_tensor body ({} bytes)", bytes.len());
        self.stage_part(cx, ControlMsg::Stage { label, bytes }, commit)
    }

    /// Stages one part handed over by CUDA IPC handle; `commit` as for [`Self::stage`].
    pub(super) fn stage_ipc(
        &mut self,
        cx: &mut Ctx<'_>,
        ranks: Vec<Vec<IpcBuffer>>,
        commit: Commit,
    ) -> Result<Outcome, ServeError> {
        self.stage_part(cx, ControlMsg::StageIpc { ranks }, commit)
    }

    /// Runs one staging command; a refused part drops everything staged (the ranks did).
    fn stage_part(
        &mut self,
        cx: &mut Ctx<'_>,
        msg: ControlMsg,
        commit: Commit,
    ) -> Result<Outcome, ServeError> {
        match self.run(cx, msg)? {
            Ok(()) => self.staged_then(cx, commit),
            Err(e) => {
                self.staged_at = None;
                Ok(Outcome::Done(refused(
                    &e,
                    format!("{e}; every tensor staged so far was dropped: push again from the first part"),
                )))
            }
        }
    }

    /// The staged tensors replace the weights.
    pub(super) fn commit(
        &mut self,
        cx: &mut Ctx<'_>,
        update: UpdateReq,
    ) -> Result<Outcome, ServeError> {
        let (n, _) = self.staged(cx);
        if n == 0 {
            return done_err(RefusalKind::Input, "nothing is staged: send the tensors first (update_weights_from_tensor with commit=false)");
        }
        self.update(cx, UpdateSource::Staged, update)
    }

    /// Commits what is staged, if anything.
    pub(super) fn finish(
        &mut self,
        cx: &mut Ctx<'_>,
        update: UpdateReq,
    ) -> Result<Outcome, ServeError> {
        match self.staged(cx) {
            (0, _) => done(
                json!({"success": true, "message": "nothing staged: the update applied when its last tensor arrived", "weight_version": &*self.version}),
            ),
            _ => self.update(cx, UpdateSource::Staged, update),
        }
    }

    /// Drops the staged tensors.
    pub(super) fn discard(&mut self, cx: &mut Ctx<'_>) -> Result<Outcome, ServeError> {
        self.run(cx, ControlMsg::Discard)?.ok();
        self.staged_at = None;
        done(json!({"success": true, "message": "the staged tensors were dropped"}))
    }

    /// Every rank joins the trainer's NCCL group.
    pub(super) fn init_group(
        &mut self,
        cx: &mut Ctx<'_>,
        name: String,
        rendezvous: Rendezvous,
        world: usize,
        rank_offset: usize,
        timeout_s: f64,
    ) -> Result<Outcome, ServeError> {
        let via_store = matches!(rendezvous, Rendezvous::Store { .. });
        let serves_store = match &rendezvous {
            Rendezvous::Serve { host, port } => Some(format!("{host}:{port}")),
            _ => None,
        };
        let msg = ControlMsg::JoinGroup {
            name: name.clone(),
            rendezvous,
            world,
            rank_offset,
            timeout_s,
        };
        Ok(Outcome::Done(match self.run(cx, msg)? {
            Ok(()) => {
                let ranks = format!(
                    "ranks {rank_offset}..{} of {world}",
                    rank_offset + cx.comm.world_size()
                );
                Ok(
                    json!({"success": true, "message": match (serves_store, via_store) {
                        (Some(at), _) => format!("rank 0 runs the weight-update group {name:?}'s TCPStore at {at} and published its NCCL id; arbor's ranks are {ranks}, the trainer the last: they join the NCCL communicator when the trainer does"),
                        (None, false) => format!("joined the weight-update group {name:?} as {ranks}"),
                        (None, true) => format!("checked in at the trainer's store as {ranks} of the weight-update group {name:?}; the ranks join the NCCL communicator when the trainer publishes its id (at its first collective), and the first update_weights_from_distributed waits for that"),
                    }}),
                )
            }
            Err(e) => refused(&e, e.to_string()),
        }))
    }

    /// Receives the tensors a trainer broadcasts and stages them; `commit` then applies
    /// everything staged.
    pub(super) fn receive(
        &mut self,
        cx: &mut Ctx<'_>,
        group: String,
        tensors: Vec<TensorMeta>,
        timeout_s: f64,
        packed: Option<usize>,
        commit: Commit,
    ) -> Result<Outcome, ServeError> {
        let n = tensors.len();
        let msg = ControlMsg::Receive {
            group,
            tensors,
            timeout_s,
            packed,
        };
        self.receive_msg(cx, msg, format!("the {n} tensors of this call"), commit)
    }

    /// Runs a receive (`what` names its tensors in an error) and commits as `commit` says.
    pub(super) fn receive_msg(
        &mut self,
        cx: &mut Ctx<'_>,
        msg: ControlMsg,
        what: String,
        commit: Commit,
    ) -> Result<Outcome, ServeError> {
        match self.run(cx, msg)? {
            Ok(()) => self.staged_then(cx, commit),
            Err(e) => {
                self.staged_at = None;
                Ok(Outcome::Done(refused(
                    &e,
                    format!("{e}; {what} and every one staged before were dropped"),
                )))
            }
        }
    }

    /// After a part was staged: commit, or say what is staged.
    fn staged_then(&mut self, cx: &mut Ctx<'_>, commit: Commit) -> Result<Outcome, ServeError> {
        self.staged_at = Some(Instant::now());
        match commit {
            Commit::Now(u) => self.update(cx, UpdateSource::Staged, u),
            Commit::WhenComplete(u) if self.staged_all(cx) => {
                self.update(cx, UpdateSource::Staged, u)
            }
            Commit::WhenComplete(_) | Commit::No => done(self.staged_body(cx)),
        }
    }

    /// Whether every tensor the model reads is staged (then a push is complete).
    fn staged_all(&self, cx: &Ctx<'_>) -> bool {
        let s = cx.runner.weights_state();
        s.staged_tensors > 0 && s.staged_tensors == s.model_tensors
    }

    fn staged_body(&self, cx: &Ctx<'_>) -> Value {
        let s = cx.runner.weights_state();
        let (n, bytes, of) = (s.staged_tensors, s.staged_bytes, s.model_tensors);
        json!({"success": true, "message": format!("{n} of the {of} tensors the model reads staged ({bytes} bytes); they apply once all are staged, or at a commit"), "staged_tensors": n, "staged_bytes": bytes, "model_tensors": of})
    }

    /// Every rank leaves the trainer's group.
    pub(super) fn destroy_group(
        &mut self,
        cx: &mut Ctx<'_>,
        name: String,
    ) -> Result<Outcome, ServeError> {
        let r = self.run(cx, ControlMsg::LeaveGroup { name: name.clone() })?;
        Ok(Outcome::Done(match r {
            Ok(()) => Ok(
                json!({"success": true, "message": format!("left the weight-update group {name:?}")}),
            ),
            Err(e) => refused(&e, e.to_string()),
        }))
    }

    /// Stops stepping; `mode` says what happens to the requests in flight.
    pub(super) fn pause(&mut self, cx: &mut Ctx<'_>, mode: PauseMode) -> Outcome {
        let (aborted, retracted) = match mode {
            PauseMode::Abort => (cx.reqs.abort(cx.sched, None, &self.version, cx.stats), 0),
            PauseMode::Retract => (0, cx.reqs.retract_started(cx.sched)),
            PauseMode::InPlace => (0, 0),
        };
        self.paused = Some(mode);
        cx.stats.paused.store(true, Ordering::Relaxed);
        Outcome::Done(Ok(
            json!({"success": true, "message": "generation paused", "aborted": aborted, "retracted": retracted}),
        ))
    }

    /// Steps again. A push left incomplete stays staged (its tensors do not apply): the
    /// answer says so.
    pub(super) fn continue_generation(&mut self, cx: &mut Ctx<'_>) -> Outcome {
        self.paused = None;
        cx.stats.paused.store(false, Ordering::Relaxed);
        let s = cx.runner.weights_state();
        if s.staged_tensors > 0 {
            let msg = format!(
                "generation continues on weight version {}; {} of the {} tensors the model reads are staged and not applied: push the rest (they apply once all are staged) or discard them",
                self.version, s.staged_tensors, s.model_tensors
            );
            tracing::warn!("{msg}");
            return Outcome::Done(Ok(
                json!({"success": true, "message": msg, "staged_tensors": s.staged_tensors, "model_tensors": s.model_tensors}),
            ));
        }
        Outcome::Done(Ok(
            json!({"success": true, "message": "generation continues"}),
        ))
    }

    /// Ends the requests named `rid` (every request when `None`), held ones included.
    pub(super) fn abort(&mut self, cx: &mut Ctx<'_>, rid: Option<String>) -> Outcome {
        let mut n = cx
            .reqs
            .abort(cx.sched, rid.as_deref(), &self.version, cx.stats);
        let version = self.version.clone();
        self.held.retain(|sub| {
            if rid.as_deref().is_some_and(|r| r != sub.rid) {
                return true;
            }
            n += 1;
            sub.abort(&version);
            false
        });
        Outcome::Done(Ok(json!({"success": true, "aborted": n})))
    }

    /// Frees the weights and/or the KV cache on every rank; no request may be running.
    pub(super) fn release(
        &mut self,
        cx: &mut Ctx<'_>,
        weights: bool,
        kv: bool,
    ) -> Result<Outcome, ServeError> {
        let started = cx.reqs.started();
        if started > 0 {
            return done_err(RefusalKind::Conflict, format!("{started} requests are running: pause_generation with mode abort or retract (or abort them) first"));
        }
        match self.run(cx, ControlMsg::Release { weights, kv })? {
            Ok(()) => {
                self.weights &= !weights;
                self.kv &= !kv;
                self.set_released(cx);
                done(
                    json!({"success": true, "message": format!("released:{}{}", if weights { " weights" } else { "" }, if kv { " kv_cache" } else { "" })}),
                )
            }
            Err(e) => Ok(Outcome::Done(refused(&e, e.to_string()))),
        }
    }

    /// Loads what was released again; weights read from elsewhere than where they came
    /// from are a new version.
    pub(super) fn resume(
        &mut self,
        cx: &mut Ctx<'_>,
        weights: bool,
        kv: bool,
        from: Option<PathBuf>,
        version: Option<String>,
    ) -> Result<Outcome, ServeError> {
        if from.is_some() && self.weights {
            return done_err(RefusalKind::Conflict, "model_path reloads released weights, and the weights are in memory: use update_weights_from_disk to change them");
        }
        let reload = weights && !self.weights;
        let origin = cx.runner.weights_state().origin;
        let t0 = Instant::now();
        let msg = ControlMsg::Resume {
            weights,
            kv,
            from: from.clone(),
        };
        match self.run(cx, msg)? {
            Ok(()) => {
                self.weights |= weights;
                self.kv |= kv;
                self.set_released(cx);
                let moved = reload
                    && from
                        .as_ref()
                        .is_some_and(|p| origin != Origin::Disk(p.clone()));
                if moved || (reload && version.is_some()) {
                    self.new_version(cx, version, t0.elapsed().as_secs_f64());
                }
                done(
                    json!({"success": true, "message": "resumed", "weight_version": &*self.version}),
                )
            }
            Err(e) => Ok(Outcome::Done(refused(&e, e.to_string()))),
        }
    }

    /// Drops the cached state that depends on the weights; no request may be running.
    pub(super) fn flush_cache(&mut self, cx: &mut Ctx<'_>) -> Result<Outcome, ServeError> {
        let started = cx.reqs.started();
        if started > 0 {
            return done_err(
                RefusalKind::Conflict,
                format!("the cache was not flushed: {started} requests are running"),
            );
        }
        Ok(Outcome::Done(
            match self.run(cx, ControlMsg::FlushCache)? {
                Ok(()) => Ok(json!({"success": true, "message": "cache flushed"})),
                Err(e) => refused(&e, e.to_string()),
            },
        ))
    }

    /// Renames the serving weights. A started request reports one version for all its
    /// choices, so the name changes only when none is running (or after aborting them).
    pub(super) fn set_version(
        &mut self,
        cx: &mut Ctx<'_>,
        version: String,
        abort_all: bool,
    ) -> Outcome {
        if abort_all {
            // Its answer (the count) is not this operation's.
            let _ = self.abort(cx, None);
        }
        let started = cx.reqs.started();
        if started > 0 {
            return Outcome::Done(Err(crate::msg::Refusal::new(
                RefusalKind::Conflict,
                format!("{started} requests are running on version {}: pause_generation first, or send abort_all_requests: true", self.version),
            )));
        }
        let old = std::mem::replace(&mut self.version, version.into());
        cx.stats.set_weight_version(&self.version);
        Outcome::Done(Ok(json!({
            "success": true,
            "message": format!("weight version {old} -> {}", self.version),
            "weight_version": &*self.version,
            "previous_weight_version": &*old,
        })))
    }
}
