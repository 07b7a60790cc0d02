//! `arbor serve` end to end on CPU ranks: a request's tokens, log-probs and logits digests
//! are the same bits alone, among ~200 concurrent requests, at TP 1 and 2, and equal to
//! `arbor generate` / `arbor score`; streaming, errors, cancellation and SIGTERM; and the
//! official `openai` Python client against the server.
//!
//! One test binary (`cargo test --test serve`): the tests share one tiny model, made once.

#[path = "../cli_support/mod.rs"]
mod cli_support;

#[path = "../../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

mod api;
mod bits;
mod faults;
mod server;
