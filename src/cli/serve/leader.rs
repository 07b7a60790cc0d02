//! Rank 0: the serving loop (`arbor_serving::Leader`) on this thread, the HTTP server on a
//! tokio runtime beside it, driving the loop through its handle.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use arbor_collective::Communicator;
use arbor_model::batching::SchedulerConfig;
use arbor_serving::{Leader, ServeConfig};

use super::http;
use super::state::AppState;
use super::Args;
use crate::cli::model_api::Runner;

pub fn lead(
    args: &Args,
    addr: SocketAddr,
    mut runner: Box<dyn Runner>,
    comm: Arc<dyn Communicator>,
) -> Result<()> {
    let cap = runner
        .kv_capacity()
        .cloned()
        .context("the runner made no KV cache")?;
    let scheduler = SchedulerConfig {
        max_running: args.max_num_seqs,
        max_seq_len: cap.max_seq_len,
        chunk: args.prefill_chunk,
        step_tokens: args.max_num_batched_tokens,
        prefill_beside_decode: args.prefill_beside_decode,
        row_multiple: args.row_multiple,
        step_outputs: super::step_outputs(args),
        kv_blocks: cap.blocks,
        eos: runner.eos_token_ids().to_vec(),
        preempt: !args.no_preempt,
        prefill_first: false,
        prefix_cache: !args.kv.no_prefix_cache,
    };
    let (leader, handle) = Leader::new(ServeConfig {
        weight_version: args.weight_version.clone(),
        drain_timeout: Duration::from_secs_f64(args.drain_timeout_s),
        update_wait: Duration::from_secs_f64(args.weight_update_wait_s),
        upload_idle: Duration::from_secs_f64(args.weight_upload_idle_s),
        ..ServeConfig::new(scheduler)
    })?;
    let state = AppState::new(args, runner.as_ref(), handle, leader.stats())?;
    let stop_http = state.stop.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let http_thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || http::serve(state, addr, ready_tx))
        .context("starting the HTTP thread")?;
    let bound = match ready_rx.recv() {
        Ok(Ok(bound)) => bound,
        Ok(Err(e)) => {
            arbor_serving::stop_followers(comm.as_ref())?;
            return Err(e);
        }
        Err(_) => {
            arbor_serving::stop_followers(comm.as_ref())?;
            anyhow::bail!("the HTTP thread ended before binding {addr}");
        }
    };
    tracing::info!(%bound, tp = comm.world_size(), "serving");
    eprintln!(
        "arbor serve: listening on http://{bound} (TP {})",
        comm.world_size()
    );
    eprintln!(
        "arbor serve: KV cache {} blocks of {} = {} tokens, {:.2} GiB per rank ({}); max context {}; up to {} running sequences; {} tokens per step, prefill chunks of {}; prefix cache {}",
        cap.blocks,
        arbor_kernels::paged::KV_BLOCK,
        cap.tokens(),
        cap.gib(),
        cap.source,
        cap.max_seq_len,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.prefill_chunk,
        if args.kv.no_prefix_cache { "off" } else { "on" }
    );
    // Ends with the other ranks told to stop, whatever happened.
    let result = leader.run(runner.as_mut(), comm.as_ref());
    // Every handler has its answer by now (its result, or a 503 naming the failure): the
    // HTTP side sends them and closes its connections before this process goes, also when
    // the engine failed.
    let _ = stop_http.send(true);
    let http = match http_thread.join() {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("the HTTP thread panicked")),
    };
    result?;
    http?;
    eprintln!("arbor serve: drained, exiting");
    Ok(())
}
