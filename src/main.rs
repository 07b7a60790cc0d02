//! `arbor`: the worker and CLI. Every subcommand that runs a model runs as one rank of a
//! tensor-parallel group (TP = world size), started by `arbor-launch` or `mpirun`.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "arbor",
    version,
    about = "TP-invariant LLM inference: bit-identical logits across TP 1/2/4/8, batch size, prefill and decode",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate continuations of prompts (one rank of a TP group).
    Generate(cli::generate::Args),
    /// Teacher-forced log-probs of given sequences (prefill only: the trainer's path).
    Score(cli::score::Args),
    /// Run every (TP, batch) configuration and compare outputs bit for bit.
    Check(cli::check::Args),
    /// OpenAI-compatible HTTP server (rank 0) over continuous batching; outputs do not depend on load.
    Serve(cli::serve::Args),
    /// Write a random-weight model in Hugging Face format.
    MakeModel(cli::make_model::Args),
    /// Make the tiny model if absent and run the invariance check over TP 1/2/4/8.
    Demo(cli::demo::Args),
    /// Exercise the collective stack: tree all-reduce of random data, checked bitwise.
    CollectiveCheck(cli::collective_check::Args),
    /// GPU benchmarks: tree GEMM vs cuBLAS, deterministic all-reduce vs NCCL (CPU matmul: `cargo bench`).
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() {
    cli::common::init_logging();
    let args = Cli::parse();
    let result = match args.command {
        Command::Generate(a) => cli::generate::run(a),
        Command::Score(a) => cli::score::run(a),
        Command::Check(a) => cli::check::run(a),
        Command::Serve(a) => cli::serve::run(a),
        Command::MakeModel(a) => cli::make_model::run(a),
        Command::Demo(a) => cli::demo::run(a),
        Command::CollectiveCheck(a) => cli::collective_check::run(a),
        Command::Bench(c) => cli::bench::run(c),
    };
    if let Err(e) = result {
        eprintln!("arbor: error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// The error and its causes, joined with ": ". Library errors often show their source in
/// their own message already; a cause the message so far already ends with is not repeated.
fn error_chain(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if msg.ends_with(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[test]
    fn error_chain_skips_causes_already_in_the_message() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(io).context("cannot read config.json: no such file");
        assert_eq!(error_chain(&e), "cannot read config.json: no such file");
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(io).context("cannot read config.json");
        assert_eq!(error_chain(&e), "cannot read config.json: no such file");
    }
}
