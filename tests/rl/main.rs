//! RL rollouts against `arbor serve` on CPU ranks (docs/rl.md): weights updated from disk
//! and pushed over HTTP while requests run, at TP 1, 2 and 4. Every response must carry
//! the weight version it ran on and be bit-identical to a fresh TP 1 server started on
//! those weights (requests that finish, wait or are re-run per the policy; none lost);
//! a bad checkpoint is refused and the old weights keep serving; pause / continue /
//! abort / release / resume; and the trainer loop of `examples/rl_loop.py` without torch:
//! nudge the weights, push them at TP 2, roll out with log-probs, and check them against
//! `arbor score` at TP 1 on a checkpoint of the same weights, bit for bit.
//!
//! One test binary (`cargo test --test rl`): the tests share the checkpoints and the
//! reference responses of fresh servers on them, made once.

#[path = "../cli_support/mod.rs"]
mod cli_support;

#[path = "../../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

#[path = "../../model/src/gguf/testfile.rs"]
#[allow(dead_code)]
mod gguf_testfile;

mod bits;
mod buckets;
mod checkpoint;
mod control;
mod frameworks;
mod ipc;
mod prime_rl;
mod rendezvous;
mod routed;
mod server;
mod sources;
mod trainer;
mod trl;
mod updates;
mod vllm;
