//! Continuous batching on top of the ragged, batch-invariant forward.
//!
//! Rank 0's [`Scheduler`] decides each step's [`StepPlan`] (which sequences, which new
//! rows at which positions, which rows need outputs); every rank executes the same plan
//! (`Runner::execute`) on a persistent, slot-addressed KV cache. Because every kernel is
//! batch invariant and prefill equals decode bit for bit, a row's results do not depend on
//! what else is in the plan: admission order, chunk sizes and load cannot change them.
//! Offline `generate` and `score` are the same scheduler with one step's worth of budget.

pub mod control;
pub mod kv;
pub mod plan;
pub mod scheduler;

pub use control::{ControlMsg, TensorMeta, UpdateSource};
pub use kv::{BlockPool, SlotPool};
pub use plan::{PlanMsg, PlanRow, Record, RowResult, StepPlan};
pub use scheduler::{Event, FinishReason, Scheduler, SchedulerConfig, SeqId, SeqSpec};
