//! The MPI transport (cargo feature `mpi`, rsmpi): under `mpirun`, rank and world size come
//! from MPI and every collective of [`Communicator`] is an MPI collective, so no rendezvous
//! (MASTER_ADDR / MASTER_PORT) is needed; the NCCL unique id travels through
//! [`Communicator::broadcast_bytes`] as with every other transport.
//!
//! MPI may be initialised once per process, so the world communicator lives in a process-wide
//! slot and [`MpiCommunicator::world`] hands out clones of one `Arc`. MPI is finished when the
//! process exits (not when the last handle drops): exit status 0 calls `MPI_Finalize`, any
//! other status calls `MPI_Abort`, so a rank that fails takes the whole job down at once
//! instead of leaving its peers blocked in a collective (MPI collectives have no timeout).

use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use mpi::collective::{CommunicatorCollectives, Root};
use mpi::environment::Threading;
use mpi::topology::{Communicator as _, SimpleCommunicator};

use crate::{CommError, Communicator, RankInfo};

/// Set to `0` to bootstrap through MASTER_ADDR / MASTER_PORT even under mpirun.
pub const DISABLE_ENV: &str = "ARBOR_MPI";

/// Variables an MPI launcher sets in every rank's environment (OpenMPI, MPICH/Hydra, PMIx).
const MPIRUN_MARKERS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

/// Whether this process was started by an MPI launcher and MPI bootstrap is not disabled.
pub fn under_mpirun() -> bool {
    if std::env::var(DISABLE_ENV).is_ok_and(|v| v == "0") {
        return false;
    }
    MPIRUN_MARKERS
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

/// What `init_from_env` returns under mpirun: the world communicator and where this process
/// sits, all from MPI (the local rank is the rank among the processes sharing this node's
/// memory). There is no rendezvous: `master_addr` is empty and `master_port` 0.
pub fn init_from_mpi() -> Result<(Arc<dyn Communicator>, RankInfo), CommError> {
    let comm = MpiCommunicator::world()?;
    let info = RankInfo {
        rank: comm.rank,
        world_size: comm.world_size,
        local_rank: comm.local_rank,
        local_world_size: comm.local_world_size,
        master_addr: String::new(),
        master_port: 0,
        source: "mpi",
    };
    Ok((comm, info))
}

/// `MPI_COMM_WORLD` as a [`Communicator`].
pub struct MpiCommunicator {
    comm: Mutex<WorldHandle>,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
}

/// The raw communicator, only ever touched under `MpiCommunicator::comm`'s lock.
struct WorldHandle(SimpleCommunicator);

// SAFETY: MPI is initialised with at least MPI_THREAD_SERIALIZED (checked in `init_world`),
// which allows calls from any thread as long as they do not overlap; every call goes through
// the mutex around this handle, and MPI_COMM_WORLD itself is valid until MPI is finished at
// process exit.
unsafe impl Send for WorldHandle {}

static WORLD: OnceLock<Result<Arc<MpiCommunicator>, String>> = OnceLock::new();

impl MpiCommunicator {
    /// Initialises MPI on first use and returns the world communicator (the same one on every
    /// call: MPI cannot be initialised twice in a process).
    pub fn world() -> Result<Arc<MpiCommunicator>, CommError> {
        WORLD
            .get_or_init(init_world)
            .clone()
            .map_err(CommError::Config)
    }

    fn with_comm<T>(
        &self,
        op: &str,
        f: impl FnOnce(&SimpleCommunicator) -> T,
    ) -> Result<T, CommError> {
        let guard = self.comm.lock().map_err(|_| CommError::Poisoned {
            rank: self.rank,
            reason: format!("an MPI call panicked before this {op}"),
        })?;
        Ok(f(&guard.0))
    }
}

fn invalid(rank: usize, op: &str, what: impl std::fmt::Display) -> CommError {
    CommError::InvalidArgument {
        rank,
        detail: format!("mpi {op}: {what}"),
    }
}

fn init_world() -> Result<Arc<MpiCommunicator>, String> {
    let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
        .ok_or("MPI was already initialised by something other than arbor's MPI transport")?;
    if provided < Threading::Serialized {
        return Err(format!(
            "the MPI library provides thread level {provided:?}, arbor needs at least Serialized \
             (MPI calls from several threads, one at a time)"
        ));
    }
    // Finishing MPI is left to the exit hook, which knows the exit status (see module docs).
    std::mem::forget(universe);
    register_exit_hook();
    let comm = SimpleCommunicator::world();
    let count = |what: &str, n: mpi::Rank| {
        usize::try_from(n).map_err(|_| format!("MPI gave a negative {what}: {n}"))
    };
    let rank = count("rank", comm.rank())?;
    let world_size = count("world size", comm.size())?;
    // The ranks that share this node's memory: the GPU choice needs the rank among them.
    let node = comm.split_shared(comm.rank());
    let local_rank = count("local rank", node.rank())?;
    let local_world_size = count("local world size", node.size())?;
    tracing::info!(
        rank,
        world_size,
        local_rank,
        local_world_size,
        "bootstrapped through MPI"
    );
    Ok(Arc::new(MpiCommunicator {
        comm: Mutex::new(WorldHandle(comm)),
        rank,
        world_size,
        local_rank,
        local_world_size,
    }))
}

extern "C" {
    /// glibc's `on_exit`: like `atexit`, but the handler sees the exit status.
    fn on_exit(handler: extern "C" fn(c_int, *mut c_void), arg: *mut c_void) -> c_int;
}

fn register_exit_hook() {
    // SAFETY: `finish_mpi` is a plain `extern "C"` function that ignores its argument.
    let rc = unsafe { on_exit(finish_mpi, std::ptr::null_mut()) };
    if rc != 0 {
        tracing::warn!("could not register the MPI exit hook; MPI will not be finalised at exit");
    }
}

extern "C" fn finish_mpi(status: c_int, _arg: *mut c_void) {
    if mpi::environment::is_finalized() {
        return;
    }
    if status == 0 {
        // SAFETY: MPI was initialised by `init_world` and not finalised (checked above); no
        // other thread runs arbor code any more once `exit` runs its handlers.
        unsafe {
            mpi::ffi::MPI_Finalize();
        }
    } else {
        // Peers may be blocked in a collective that this rank will never join.
        use mpi::topology::Communicator as _;
        SimpleCommunicator::world().abort(status);
    }
}

/// Rejects lengths that MPI's `int` counts cannot carry (rsmpi would panic on them).
fn mpi_count(rank: usize, op: &str, len: usize) -> Result<(), CommError> {
    if i32::try_from(len).is_err() {
        return Err(invalid(
            rank,
            op,
            format!(
                "{len} bytes exceed MPI's count limit of {} per call",
                i32::MAX
            ),
        ));
    }
    Ok(())
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<u8>, CommError> {
        const OP: &str = "all_gather";
        mpi_count(self.rank, OP, data.len())?;
        let total = data
            .len()
            .checked_mul(self.world_size)
            .ok_or_else(|| invalid(self.rank, OP, "result size overflows usize"))?;
        mpi_count(self.rank, OP, total)?;
        self.with_comm(OP, |comm| {
            // MPI_Allgather with unequal counts is undefined (or a fatal truncation); agree on
            // the lengths first so every rank reports the same clear error instead.
            let len = data.len() as u64;
            let mut lens = vec![0u64; self.world_size];
            comm.all_gather_into(&len, &mut lens[..]);
            if let Some(peer) = lens.iter().position(|&l| l != len) {
                return Err(CommError::LengthMismatch {
                    rank: self.rank,
                    peer,
                    op: OP.to_string(),
                    got: usize::try_from(lens[peer]).unwrap_or(usize::MAX),
                    expected: data.len(),
                });
            }
            let mut out = vec![0u8; total];
            comm.all_gather_into(data, &mut out[..]);
            Ok(out)
        })?
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        const OP: &str = "broadcast";
        if root >= self.world_size {
            return Err(invalid(
                self.rank,
                OP,
                format!(
                    "root rank {root} is outside the world of {} ranks",
                    self.world_size
                ),
            ));
        }
        let root_rank = root as mpi::Rank;
        self.with_comm(OP, |comm| {
            // The length goes first: receivers may enter with any length.
            let mut len = data.len() as u64;
            comm.process_at_rank(root_rank).broadcast_into(&mut len);
            let len = usize::try_from(len)
                .map_err(|_| invalid(self.rank, OP, format!("root {root} sent length {len}")))?;
            mpi_count(self.rank, OP, len)?;
            data.resize(len, 0);
            comm.process_at_rank(root_rank)
                .broadcast_into(&mut data[..]);
            Ok(())
        })?
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.with_comm("barrier", |comm| comm.barrier())
    }

    fn transport(&self) -> &'static str {
        "mpi"
    }
}

#[cfg(test)]
mod tests {
    //! A singleton MPI world (this process alone), and four ranks: `four_ranks_under_mpirun`
    //! runs this test binary under `mpirun -np 4`, each copy running `rank_of_four`.
    use super::*;
    use crate::tree_all_reduce;
    use arbor_kernels::tree::{tree_sum, SegmentLayout, SEGMENTS};
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    #[test]
    fn singleton_world_round_trips_bytes() {
        let comm = match MpiCommunicator::world() {
            Ok(c) => c,
            Err(e) => panic!("MPI singleton init failed: {e}"),
        };
        assert_eq!(comm.rank(), 0);
        assert_eq!(comm.world_size(), 1);
        assert_eq!(comm.transport(), "mpi");
        let data = [3u8, 1, 4, 1, 5];
        assert_eq!(comm.all_gather_bytes(&data).ok(), Some(data.to_vec()));
        let mut buf = vec![9u8, 8, 7];
        assert!(comm.broadcast_bytes(&mut buf, 0).is_ok());
        assert_eq!(buf, vec![9, 8, 7]);
        assert!(
            comm.broadcast_bytes(&mut buf, 1).is_err(),
            "root outside the world"
        );
        assert!(comm.barrier().is_ok());
        // A second call must not re-initialise MPI.
        let again = MpiCommunicator::world()
            .ok()
            .map(|c| Arc::ptr_eq(&c, &comm));
        assert_eq!(again, Some(true));
    }

    fn find_mpirun() -> Option<std::path::PathBuf> {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|d| d.join("mpirun"))
            .find(|p| p.is_file())
    }

    /// Runs `worker` (an ignored test of this module) as 4 ranks under mpirun; `None` when
    /// there is no mpirun. Killed after 120 s so that a hang fails instead of blocking.
    fn run_four(worker: &str) -> Option<(std::process::Output, Duration)> {
        let Some(mpirun) = find_mpirun() else {
            // Straight to stderr: the test harness would swallow eprintln! of a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no mpirun on PATH (install openmpi-bin)"
            );
            return None;
        };
        let exe = match std::env::current_exe() {
            Ok(e) => e,
            Err(e) => panic!("no path to this test binary: {e}"),
        };
        let mut cmd = Command::new(mpirun);
        cmd.args(["-np", "4", "--oversubscribe", "--allow-run-as-root"])
            .arg(exe)
            .args([
                "--exact",
                worker,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The singleton test may have initialised MPI in this process, which sets OpenMPI
        // variables that would confuse a nested mpirun.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy().into_owned();
            if ["OMPI_", "PMIX_", "OPAL_", "PMI_"]
                .iter()
                .any(|p| name.starts_with(p))
            {
                cmd.env_remove(name);
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => panic!("starting mpirun: {e}"),
        };
        let start = Instant::now();
        while matches!(child.try_wait(), Ok(None)) {
            if start.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let elapsed = start.elapsed();
        match child.wait_with_output() {
            Ok(o) => Some((o, elapsed)),
            Err(e) => panic!("waiting for mpirun: {e}"),
        }
    }

    #[test]
    fn four_ranks_under_mpirun() {
        let Some((out, _)) = run_four("mpi::tests::rank_of_four") else {
            return;
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "mpirun failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        for rank in 0..4 {
            assert!(
                stdout.contains(&format!("mpi rank {rank} of 4: all checks passed")),
                "rank {rank} did not report:\n{stdout}\n{stderr}"
            );
        }
    }

    #[test]
    fn a_failing_rank_ends_the_job_instead_of_hanging() {
        let Some((out, elapsed)) = run_four("mpi::tests::rank_of_four_that_fails") else {
            return;
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && out.status.code().is_some(),
            "mpirun should fail by itself ({}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            elapsed < Duration::from_secs(30),
            "took {elapsed:?}:\n{stdout}\n{stderr}"
        );
        assert!(
            stdout.contains("rank 1 fails on purpose"),
            "{stdout}\n{stderr}"
        );
        assert!(!stdout.contains("passed the barrier"), "{stdout}\n{stderr}");
    }

    #[test]
    #[ignore = "a rank of a_failing_rank_ends_the_job_instead_of_hanging; only under mpirun"]
    fn rank_of_four_that_fails() {
        let comm = match MpiCommunicator::world() {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        if comm.rank() == 1 {
            println!("rank 1 fails on purpose");
            // As the arbor binary does on an error: exit non-zero while the others wait.
            std::process::exit(3);
        }
        let _ = comm.barrier();
        println!("rank {} passed the barrier", comm.rank());
    }

    #[test]
    #[ignore = "one rank of four_ranks_under_mpirun; meaningful only under mpirun -np 4"]
    fn rank_of_four() {
        assert!(under_mpirun(), "run me under mpirun -np 4");
        let (comm, info) = match init_from_mpi() {
            Ok(c) => c,
            Err(e) => panic!("init_from_mpi: {e}"),
        };
        let rank = comm.rank();
        assert_eq!(comm.world_size(), 4);
        assert_eq!(comm.transport(), "mpi");
        assert_eq!((info.rank, info.world_size, info.source), (rank, 4, "mpi"));
        // One host: every rank is local, and the MPI node rank matches OpenMPI's variable.
        assert_eq!(info.local_world_size, 4);
        let ompi_local = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK").ok();
        assert_eq!(ompi_local, Some(info.local_rank.to_string()));

        // All-gather: rank order, rank-specific bytes.
        let mine = vec![rank as u8, 10 * rank as u8, 0xA5];
        let want: Vec<u8> = (0..4u8).flat_map(|r| [r, 10 * r, 0xA5]).collect();
        assert_eq!(comm.all_gather_bytes(&mine).ok(), Some(want));

        // Broadcast: receivers enter with other lengths.
        let mut buf = if rank == 2 {
            b"from rank two".to_vec()
        } else {
            vec![7u8; rank * 50]
        };
        assert!(comm.broadcast_bytes(&mut buf, 2).is_ok());
        assert_eq!(buf, b"from rank two".to_vec());

        // Unequal lengths: the same clear error on every rank, and the group stays usable.
        let len = if rank == 3 { 5 } else { 4 };
        match comm.all_gather_bytes(&vec![0u8; len]) {
            Err(CommError::LengthMismatch { peer, got, .. }) => {
                let (want_peer, want_got) = if rank == 3 { (0, 4) } else { (3, 5) };
                assert_eq!((peer, got), (want_peer, want_got), "rank {rank}");
            }
            other => panic!("rank {rank}: expected a length mismatch, got {other:?}"),
        }
        assert!(comm.barrier().is_ok());

        // The deterministic all-reduce over MPI equals the single-process tree, bit for bit.
        let sums: Vec<[f32; SEGMENTS]> = (0..33)
            .map(|j| {
                let b = j as f32;
                [1e8 + b, 1.0, -1e8, 1.0 + b, 3.5e-3, 7.0, -2.0e7 - b, 2.0e7]
            })
            .collect();
        let segs = SegmentLayout::segments_of(rank, 4);
        let partial: Vec<f32> = sums.iter().map(|s| tree_sum(&s[segs.clone()])).collect();
        let got = match tree_all_reduce(comm.as_ref(), &partial) {
            Ok(v) => v,
            Err(e) => panic!("tree_all_reduce over MPI: {e}"),
        };
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = sums.iter().map(|s| tree_sum(s).to_bits()).collect();
        assert_eq!(got, want, "rank {rank}");
        // The data is order-sensitive, so a wrong combine order would have been caught.
        let sequential: Vec<u32> = sums
            .iter()
            .map(|s| s.iter().fold(0.0f32, |a, &b| a + b).to_bits())
            .collect();
        assert_ne!(sequential, want);

        println!("mpi rank {rank} of 4: all checks passed");
    }
}
