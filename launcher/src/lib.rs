//! arbor-launch: starts one process per rank with RANK, WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. (Filled in by the launcher work.)

/// Entry point of the `arbor-launch` binary; returns the process exit code.
pub fn main() -> i32 {
    eprintln!("arbor-launch: not built yet");
    2
}
