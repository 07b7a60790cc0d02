//! `arbor serve` end to end on CPU ranks: a request's tokens, log-probs and logits digests
//! are the same bits alone, among ~200 concurrent requests, at TP 1 and 2, and equal to
//! `arbor generate` / `arbor score`; streaming, errors, cancellation and SIGTERM; chat
//! templates (macros; one that cannot be parsed turns chat off, not the server); and the
//! official `openai` Python client against the server; the routes and request shapes of
//! other clients (lm-eval-harness, guidellm).
//!
//! One test binary (`cargo test --test serve`): the tests share one tiny model, made once.

#[path = "../cli_support/mod.rs"]
mod cli_support;

#[path = "../../src/cli/serve/client.rs"]
#[allow(dead_code)]
mod client;

#[path = "../../model/src/gguf/testfile.rs"]
#[allow(dead_code)]
mod gguf_testfile;

mod api;
mod bits;
mod clients;
mod faults;
mod server;
mod structured;
mod templates;
