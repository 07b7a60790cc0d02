//! Continuous batching on top of the ragged, batch-invariant forward.
//!
//! Rank 0's [`Scheduler`] decides each step's [`StepPlan`] (which sequences, which new
//! rows at which positions, which rows need outputs); every rank executes the same plan
//! (`Runner::execute`) on a persistent, paged KV cache: each row of the plan carries its
//! sequence's block table. Because every kernel is batch invariant, prefill equals decode
//! bit for bit and attention reads a sequence's keys in an order fixed by positions alone,
//! a row's results do not depend on what else is in the plan or where its blocks lie:
//! admission order, chunk sizes, block ids and load cannot change them. Offline `generate`
//! and `score` are the same scheduler with a budget for whole prompts.

pub mod control;
pub mod in_band;
pub mod ipc;
pub mod kv;
pub mod packed;
pub mod plan;
pub mod scheduler;

pub use control::{ControlMsg, IdFormat, Rendezvous, TensorMeta, UpdateSource};
pub use kv::BlockPool;
pub use plan::{PlanMsg, PlanRow, Record, RowResult, StepPlan};
pub use scheduler::{Event, FinishReason, Scheduler, SchedulerConfig, SeqId, SeqSpec};
