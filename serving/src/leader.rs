//! Rank 0's serving loop (`Leader`): commands from the handles, cancellation of closed or
//! stopped sequences, the control operations, the plan broadcast, the step, and the
//! events back to each request's stream. It runs on the thread that calls `run`.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_collective::Communicator;
use arbor_model::batching::{PlanMsg, Scheduler, SchedulerConfig, StepPlan};
use arbor_model::Runner;

use crate::control::{Control, ControlConfig, Ctx};
use crate::error::{chain, ServeError};
use crate::follower::{broadcast, send_masks, stop_followers};
use crate::handle::{Cmd, ServingHandle};
use crate::msg::{Refusal, RefusalKind};
use crate::registry::Registry;
use crate::stats::{Phase, Stats};

/// The loop's settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub scheduler: SchedulerConfig,
    /// The version responses report until the first update.
    pub weight_version: String,
    /// After a drain starts: how long running requests may finish before they are
    /// cancelled.
    pub drain_timeout: Duration,
    /// How long an update with policy `wait` waits for the started requests before it is
    /// refused.
    pub update_wait: Duration,
    /// Staged tensors with no new part or commit for this long are dropped.
    pub upload_idle: Duration,
    /// How long an idle loop waits for work before it pings the other ranks (their wait
    /// for the next plan is a collective with a timeout).
    pub idle_tick: Duration,
}

impl ServeConfig {
    /// `arbor serve`'s defaults around `scheduler`.
    pub fn new(scheduler: SchedulerConfig) -> Self {
        ServeConfig {
            scheduler,
            weight_version: "0".into(),
            drain_timeout: Duration::from_secs(30),
            update_wait: Duration::from_secs(300),
            upload_idle: Duration::from_secs(600),
            idle_tick: Duration::from_millis(500),
        }
    }
}

/// Rank 0's serving loop, before it runs.
pub struct Leader {
    sched: Scheduler,
    reqs: Registry,
    ctl: Control,
    stats: Arc<Stats>,
    inbox: Receiver<Cmd>,
    drain_timeout: Duration,
    idle_tick: Duration,
}

impl Leader {
    /// The loop and the handle that drives it (clone it for as many front ends as
    /// needed).
    pub fn new(cfg: ServeConfig) -> Result<(Leader, ServingHandle), ServeError> {
        let sched = Scheduler::new(cfg.scheduler)?;
        let stats = Arc::new(Stats::default());
        stats.set_from(&sched);
        let ctl = Control::new(
            cfg.weight_version,
            ControlConfig {
                update_wait: cfg.update_wait,
                upload_idle: cfg.upload_idle,
            },
            &stats,
        );
        let (tx, inbox) = std::sync::mpsc::channel();
        let leader = Leader {
            sched,
            reqs: Registry::default(),
            ctl,
            stats,
            inbox,
            drain_timeout: cfg.drain_timeout,
            idle_tick: cfg.idle_tick,
        };
        Ok((leader, ServingHandle::new(tx)))
    }

    /// The loop's metrics, updated every step.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Runs until drained, or until every handle is dropped; then tells the other ranks to
    /// stop. When it fails (a rank gone, a step's error), every running, queued or held
    /// request and every waiting operation is answered with the reason before the error is
    /// returned.
    pub fn run(
        mut self,
        runner: &mut dyn Runner,
        comm: &dyn Communicator,
    ) -> Result<(), ServeError> {
        let result = self.serve(runner, comm);
        if let Err(e) = &result {
            let msg = format!("the server stopped: {}", chain(e));
            self.reqs.refuse_all(&mut self.sched, &msg, &self.stats);
            self.ctl.refuse_waiting(&msg);
            for cmd in self.inbox.try_iter() {
                match cmd {
                    Cmd::Submit(sub) => sub.refuse(true, &msg),
                    Cmd::Control { reply, .. } => {
                        let _ = reply.send(Err(Refusal::new(RefusalKind::Unavailable, &msg)));
                    }
                    Cmd::Drain => {}
                }
            }
        }
        // The other ranks stop whatever happened here; a failed broadcast means one is gone.
        let stopped = stop_followers(comm);
        result.and(stopped)
    }

    fn serve(
        &mut self,
        runner: &mut dyn Runner,
        comm: &dyn Communicator,
    ) -> Result<(), ServeError> {
        let mut drain_deadline: Option<Instant> = None;
        let mut step_no = 0u64;
        let mut last_step_end: Option<Instant> = None;
        loop {
            let mut cmds = Vec::new();
            if self.sched.is_idle() || !self.ctl.can_step() {
                if drain_deadline.is_some() && self.reqs.is_empty() {
                    return Ok(());
                }
                let wait = if self.ctl.busy() {
                    self.idle_tick / 10
                } else {
                    self.idle_tick
                };
                match self.inbox.recv_timeout(wait) {
                    Ok(c) => cmds.push(c),
                    Err(RecvTimeoutError::Timeout) => {
                        broadcast(comm, &PlanMsg::Idle)?;
                        self.housekeeping(runner, comm, drain_deadline)?;
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            }
            cmds.extend(self.inbox.try_iter());
            for cmd in cmds {
                self.take(runner, comm, cmd, &mut drain_deadline)?;
            }
            // A stream that is gone (client disconnected, stop string, too far behind)
            // frees its KV now.
            self.housekeeping(runner, comm, drain_deadline)?;
            if !self.ctl.can_step() {
                continue;
            }
            let t = Instant::now();
            let plan = self.sched.plan();
            if plan.is_empty() {
                self.stats.set_from(&self.sched);
                continue;
            }
            if let Some(end) = last_step_end {
                self.stats
                    .add_phase(Phase::Between, t.duration_since(end).as_secs_f64());
            }
            self.stats.add_phase(Phase::Plan, t.elapsed().as_secs_f64());
            self.step(runner, comm, plan, step_no)?;
            last_step_end = Some(Instant::now());
            step_no += 1;
        }
    }

    /// One command from a handle; a drain sets `drain_deadline`.
    fn take(
        &mut self,
        runner: &mut dyn Runner,
        comm: &dyn Communicator,
        cmd: Cmd,
        drain_deadline: &mut Option<Instant>,
    ) -> Result<(), ServeError> {
        let drain_timeout = self.drain_timeout;
        let (mut cx, ctl) = self.parts(runner, comm);
        match cmd {
            Cmd::Submit(sub) => {
                if drain_deadline.is_some() {
                    sub.refuse(true, "the server is shutting down");
                } else {
                    ctl.submit(&mut cx, sub);
                }
            }
            Cmd::Control { op, reply } => {
                if drain_deadline.is_some() {
                    let _ = reply.send(Err(Refusal::new(
                        RefusalKind::Unavailable,
                        "the server is shutting down",
                    )));
                } else {
                    ctl.handle(&mut cx, op, reply)?;
                }
            }
            Cmd::Drain => {
                if drain_deadline.is_none() {
                    tracing::info!(
                        running = cx.sched.running(),
                        waiting = cx.sched.waiting(),
                        "draining"
                    );
                    *drain_deadline = Some(Instant::now() + drain_timeout);
                    ctl.refuse_waiting("the server is shutting down");
                }
            }
        }
        Ok(())
    }

    /// Between steps: frees the sequences nobody waits for, lets the control operations
    /// watch their clocks, cancels what outlived a drain, and updates the gauges.
    fn housekeeping(
        &mut self,
        runner: &mut dyn Runner,
        comm: &dyn Communicator,
        drain_deadline: Option<Instant>,
    ) -> Result<(), ServeError> {
        let (mut cx, ctl) = self.parts(runner, comm);
        cx.reqs.sweep(cx.sched, cx.stats);
        ctl.tick(&mut cx)?;
        if drain_deadline.is_some_and(|d| Instant::now() >= d) {
            self.reqs.refuse_all(
                &mut self.sched,
                "cancelled: the server is shutting down",
                &self.stats,
            );
        }
        self.stats.set_from(&self.sched);
        Ok(())
    }

    /// The state a control operation works on, and the operations' own.
    fn parts<'a>(
        &'a mut self,
        runner: &'a mut dyn Runner,
        comm: &'a dyn Communicator,
    ) -> (Ctx<'a>, &'a mut Control) {
        let cx = Ctx {
            runner,
            comm,
            sched: &mut self.sched,
            reqs: &mut self.reqs,
            stats: &self.stats,
        };
        (cx, &mut self.ctl)
    }

    /// Broadcasts `plan`, runs it here, and hands its events to the streams.
    fn step(
        &mut self,
        runner: &mut dyn Runner,
        comm: &dyn Communicator,
        plan: StepPlan,
        step_no: u64,
    ) -> Result<(), ServeError> {
        self.reqs.on_plan(&plan, &self.ctl.version);
        let t0 = Instant::now();
        let plan = PlanMsg::Step(plan);
        broadcast(comm, &plan)?;
        let PlanMsg::Step(plan) = plan else {
            unreachable!("built as a step above")
        };
        let (sched, stats) = (&self.sched, &self.stats);
        // Asked for while the step's forward runs: the masks' host work overlaps it.
        let mut late = || {
            let t = Instant::now();
            let masks = send_masks(comm, sched.late_masks(&plan)?);
            stats.add_phase(Phase::Masks, t.elapsed().as_secs_f64());
            masks
        };
        let results = runner
            .execute(&plan, &mut late)
            .map_err(ServeError::model(format!(
                "rank 0: executing step {step_no}"
            )))?;
        let t_apply = Instant::now();
        self.stats
            .add_phase(Phase::Execute, t_apply.duration_since(t0).as_secs_f64());
        let events = self.sched.apply(&plan, &results)?;
        let dt = t0.elapsed().as_secs_f64();
        let (prompt_rows, sampled) = counts(&plan);
        self.stats
            .record_step(dt, plan.n_tokens(), prompt_rows, sampled);
        for ev in events {
            self.reqs.dispatch(ev);
        }
        // A stream this far behind has a consumer that does not read: stop its sequences
        // instead of holding their events (and KV) for it.
        self.reqs.sweep(&mut self.sched, &self.stats);
        self.stats.set_from(&self.sched);
        self.stats
            .add_phase(Phase::Apply, t_apply.elapsed().as_secs_f64());
        Ok(())
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
