//! `arbor bench …`: each benchmark prints measured ratios side by side in one run.

pub mod allreduce;
pub mod attention;
pub mod decode;
pub mod gemm;
pub mod serve;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Tree GEMM vs cuBLAS on the GPU (TFLOP/s, ratio, invariance bits).
    Gemm(gemm::Args),
    /// The engine's decode step and prefill per batch size (ms/step, tok/s), model loaded
    /// once; run under arbor-launch for TP > 1. scripts/bench/bench-decode.sh puts it next to
    /// the PyTorch reference loop and the weights roofline.
    Decode(decode::Args),
    /// The paged attention kernels alone (one layer, prefill and decode shapes, one GPU);
    /// scripts/bench/bench-attention.sh puts them next to PyTorch's flash attention.
    ///
    /// Each row names the kernel build that ran. `ARBOR_ATTN_PREFILL_ROWS=64|96|wgmma` and
    /// `ARBOR_ATTN_DECODE=1|2|wide|par` force a build, `ARBOR_ATTN_DECODE_WIDE=0` keeps the
    /// decode rule to one-warp builds; every build gives the same bits (docs/attention.md).
    Attention(attention::Args),
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
        BenchCommand::Attention(a) => attention::run(a),
        BenchCommand::Decode(a) => decode::run(a),
        BenchCommand::Serve(a) => serve::run(a),
    }
}
