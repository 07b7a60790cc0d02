//! `arbor bench …`: each benchmark prints measured ratios side by side in one run.

pub mod allreduce;
pub mod gemm;
pub mod serve;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Tree GEMM vs cuBLAS on the GPU (TFLOP/s, ratio, invariance bits).
    Gemm(gemm::Args),
    /// Deterministic all-reduce algorithms vs NCCL (run under arbor-launch).
    Allreduce(allreduce::Args),
    /// Load generator against a loopback `arbor serve`: throughput, TTFT and inter-token
    /// latency percentiles, and distinct outputs per repeated prompt (must be 1).
    Serve(serve::Args),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Gemm(a) => gemm::run(a),
        BenchCommand::Allreduce(a) => allreduce::run(a),
        BenchCommand::Serve(a) => serve::run(a),
    }
}
