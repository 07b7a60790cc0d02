//! arbor's serving loop, apart from any transport: rank 0's loop over the
//! continuous-batching scheduler (`arbor_model::batching`), the requests in flight, the
//! weight, memory and generation-control commands (docs/rl.md), and the loop of the other
//! ranks, which execute what rank 0 broadcasts.
//!
//! A front end (the HTTP server of `arbor serve`, a Python binding, a test) drives it
//! through a [`ServingHandle`]:
//! - [`ServingHandle::submit`] queues a request and returns its [`RequestStream`] of
//!   [`SeqEvent`]s, one stream for all its choices;
//! - [`ServingHandle::control`] sends a [`ControlOp`] and returns its [`ControlReply`];
//! - [`ServingHandle::drain`] lets what runs finish, then stops the loop.
//!
//! ```text
//! front end ──submit / control / drain──► Leader (rank 0's thread)
//!           ◄──SeqEvents, ControlReply───   │ Scheduler::plan
//!                                           ▼
//!                        PlanMsg ──broadcast──► follow (ranks 1..t-1)
//!                        every rank: Runner::execute(plan)
//! ```
//!
//! [`Leader::new`] makes the loop and its handle; [`Leader::run`] runs it on the calling
//! thread until it is drained or every handle is gone. Ranks other than 0 run [`follow`].
//! Nothing here knows HTTP: refusals carry a [`RefusalKind`] that a front end maps to its
//! own statuses.

mod control;
mod error;
mod follower;
mod handle;
mod leader;
mod msg;
mod registry;
mod stats;

pub use error::ServeError;
pub use follower::{follow, stop_followers};
pub use handle::{PendingReply, RequestStream, ServingHandle, Stopped, Submission};
pub use leader::{Leader, ServeConfig};
pub use msg::{
    Commit, ControlOp, ControlReply, PauseMode, Policy, Refusal, RefusalKind, SeqEvent, UpdateReq,
};
pub use stats::{Stats, DECODE_ROW_BANDS};

#[cfg(test)]
mod tests;
