//! The ranks other than 0: execute every plan and command rank 0 broadcasts, until it says
//! stop. And rank 0's side of that broadcast.

use arbor_collective::Communicator;
use arbor_model::batching::PlanMsg;
use arbor_model::constraint::TokenMask;
use arbor_model::error::MResult;
use arbor_model::runner::weights_update::run_control;
use arbor_model::ModelError;
use arbor_model::Runner;

use crate::error::ServeError;

/// Sends `msg` from rank 0 to the other ranks (nothing at TP 1).
pub(crate) fn broadcast(comm: &dyn Communicator, msg: &PlanMsg) -> Result<(), ServeError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut bytes = msg.encode()?;
    comm.broadcast_bytes(&mut bytes, 0)
        .map_err(ServeError::collective(
            "broadcasting the step plan to the other ranks",
        ))
}

/// Rank 0: sends the current step's late masks (`PlanMsg::Masks`) to the other ranks,
/// and gives them back for its own step.
pub(crate) fn send_masks(
    comm: &dyn Communicator,
    masks: Vec<TokenMask>,
) -> MResult<Vec<TokenMask>> {
    if comm.world_size() == 1 {
        return Ok(masks);
    }
    let msg = PlanMsg::Masks(masks);
    let mut bytes = msg.encode()?;
    comm.broadcast_bytes(&mut bytes, 0).map_err(|e| {
        ModelError::Unavailable(format!(
            "rank 0: sending the step's masks to the other ranks: {e}"
        ))
    })?;
    let PlanMsg::Masks(masks) = msg else {
        unreachable!("built as masks above")
    };
    Ok(masks)
}

/// Ranks other than 0: the current step's late masks from rank 0.
fn receive_masks(comm: &dyn Communicator) -> MResult<Vec<TokenMask>> {
    let rank = comm.rank();
    let mut buf = Vec::new();
    comm.broadcast_bytes(&mut buf, 0).map_err(|e| {
        ModelError::Unavailable(format!(
            "rank {rank}: receiving the step's masks from rank 0: {e}"
        ))
    })?;
    match PlanMsg::decode(&buf)? {
        PlanMsg::Masks(m) => Ok(m),
        _ => Err(ModelError::Plan(format!(
            "rank {rank}: rank 0 sent another message where the step's masks were due"
        ))),
    }
}

/// Rank 0: tells the other ranks to stop (`Leader::run` does it when it ends; a front end
/// that fails before the loop runs calls it itself).
pub fn stop_followers(comm: &dyn Communicator) -> Result<(), ServeError> {
    broadcast(comm, &PlanMsg::Shutdown)
}

/// Ranks other than 0: executes every plan rank 0 broadcasts, and runs every command with
/// it (rank 0 reports the outcome, the same on every rank), until rank 0 says stop or is
/// gone.
pub fn follow(runner: &mut dyn Runner, comm: &dyn Communicator) -> Result<(), ServeError> {
    let rank = comm.rank();
    let mut steps = 0u64;
    loop {
        let mut buf = Vec::new();
        comm.broadcast_bytes(&mut buf, 0)
            .map_err(ServeError::collective(format!(
                "rank {rank}: receiving step plan {steps} from rank 0"
            )))?;
        match PlanMsg::decode(&buf)? {
            PlanMsg::Step(plan) => {
                runner
                    .execute(&plan, &mut || receive_masks(comm))
                    .map_err(ServeError::model(format!(
                        "rank {rank}: executing step {steps}"
                    )))?;
                steps += 1;
            }
            PlanMsg::Idle => {}
            PlanMsg::Masks(_) => {
                return Err(ServeError::model(format!("rank {rank}"))(ModelError::Plan(
                    "rank 0 sent step masks between steps".into(),
                )))
            }
            PlanMsg::Control(msg) => {
                let what = msg.what();
                let _ = run_control(runner, comm, msg)
                    .map_err(ServeError::model(format!("rank {rank}: {what}")))?;
            }
            PlanMsg::Shutdown => {
                tracing::info!(rank, steps, "shutdown from rank 0");
                return Ok(());
            }
        }
    }
}
