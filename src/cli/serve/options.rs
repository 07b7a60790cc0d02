//! `arbor serve`'s flags, checked before anything starts (no rank joins, no weights load,
//! nothing listens): values that cannot work are refused with the flag and the value.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use anyhow::{bail, Context, Result};
use arbor_model::forward::HeadPlan;
use arbor_model::runner::Device;
use arbor_model::ModelConfig;

use super::Args;

pub use arbor_model::runner::capacity::host_available_bytes;

/// Longest `--drain-timeout-s`, `--header-timeout-s` or `--body-timeout-s` (a day): a
/// Duration and an Instant hold it.
pub const MAX_DRAIN_TIMEOUT_S: f64 = 86_400.0;

/// The checks that need nothing but the flags; returns where rank 0 listens (`--host`
/// resolved).
pub fn check_flags(args: &Args) -> Result<SocketAddr> {
    if args.max_num_seqs == 0
        || args.max_num_batched_tokens == 0
        || args.prefill_chunk == 0
        || args.prefill_beside_decode == 0
        || args.row_multiple == 0
    {
        bail!("--max-num-seqs, --max-num-batched-tokens, --prefill-chunk, --prefill-beside-decode and --row-multiple must be at least 1");
    }
    if args.max_queue == 0 || args.max_n == 0 {
        bail!("--max-queue and --max-n must be at least 1");
    }
    match args.kv.kv_blocks {
        Some(0) => bail!("--kv-blocks 0: the KV cache needs at least one block"),
        Some(b) if b > u32::MAX as usize => {
            bail!(
                "--kv-blocks {b}: block ids are 32-bit, at most {}",
                u32::MAX
            )
        }
        _ => {}
    }
    let u = args.kv.gpu_memory_utilization;
    if !(u.is_finite() && u > 0.0 && u <= 1.0) {
        bail!("--gpu-memory-utilization {u:?}: give a fraction in (0, 1]");
    }
    if let Some(g) = args.kv.kv_cache_gib {
        if !(g.is_finite() && g > 0.0) {
            bail!("--kv-cache-gib {g:?}: give a number of GiB above 0");
        }
    }
    let d = args.drain_timeout_s;
    if !(d.is_finite() && (0.0..=MAX_DRAIN_TIMEOUT_S).contains(&d)) {
        bail!("--drain-timeout-s {d:?}: give a number of seconds in [0, {MAX_DRAIN_TIMEOUT_S}]");
    }
    for (flag, t) in [
        ("--header-timeout-s", args.header_timeout_s),
        ("--body-timeout-s", args.body_timeout_s),
    ] {
        if !(t.is_finite() && t > 0.0 && t <= MAX_DRAIN_TIMEOUT_S) {
            bail!("{flag} {t:?}: give a number of seconds in (0, {MAX_DRAIN_TIMEOUT_S}]");
        }
    }
    if !(1..=super::conn::MAX_CONNECTIONS).contains(&args.max_connections) {
        bail!(
            "--max-connections {}: give 1 to {}",
            args.max_connections,
            super::conn::MAX_CONNECTIONS
        );
    }
    for (flag, v) in [
        ("--weight-update-wait-s", args.weight_update_wait_s),
        ("--weight-upload-idle-s", args.weight_upload_idle_s),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= MAX_DRAIN_TIMEOUT_S) {
            bail!("{flag} {v:?}: give a number of seconds in (0, {MAX_DRAIN_TIMEOUT_S}]");
        }
    }
    if args.max_weight_upload_bytes == Some(0) {
        bail!("--max-weight-upload-bytes 0: a push needs at least one byte");
    }
    super::admin::check_version(&args.weight_version)
        .map_err(|e| anyhow::anyhow!("--weight-version: {e}"))?;
    if let Some(key) = &args.api_key {
        if key.trim().is_empty() {
            bail!("--api-key (or ARBOR_API_KEY) is empty: every request would be refused; give a key, or unset ARBOR_API_KEY to serve without one");
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("--api-key (or ARBOR_API_KEY) holds whitespace or control characters, which an `Authorization: Bearer KEY` header cannot carry");
        }
    }
    listen_addr(&args.host, args.port)
}

/// `--host` as an address to bind: an IP literal (IPv6 with or without brackets) or a
/// name, resolved (`localhost`); the first address it resolves to.
pub fn listen_addr(host: &str, port: u16) -> Result<SocketAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (bare, port)
        .to_socket_addrs()
        .with_context(|| format!("--host {host}: not an IP address or a name this host resolves"))?
        .next()
        .with_context(|| format!("--host {host}: the name resolves to no address"))
}

/// Bytes of one KV block (64 positions, K and V, bf16, every layer, the rank's KV heads)
/// on one rank at TP `tp`.
pub fn kv_block_bytes(cfg: &ModelConfig, tp: usize) -> Result<u64> {
    let heads = HeadPlan::new(cfg, 0, tp)?;
    Ok([
        2 * 2,
        cfg.num_layers,
        heads.n_kv_heads,
        cfg.head_dim,
        arbor_kernels::paged::KV_BLOCK,
    ]
    .into_iter()
    .fold(1u64, |acc, x| acc.saturating_mul(x as u64)))
}

/// Checks the flags' context against the model (its config.json, or a GGUF file's
/// metadata) and a KV cache size given on the command line (`--kv-blocks`,
/// `--kv-cache-gib`) of a CPU run against the host's available memory shared by its
/// `local_ranks` ranks (`available`: [`host_available_bytes`]). The running sequences
/// (`--max-num-seqs`) take no memory of their own: each holds the blocks of its positions.
/// A CUDA cache is sized from the device's free memory when the rank has opened it.
pub fn check_kv(
    args: &Args,
    device: Device,
    tp: usize,
    local_ranks: usize,
    available: Option<u64>,
) -> Result<()> {
    let (cfg, path) = arbor_model::checkpoint::read_config(&args.model)?;
    cfg.context_len(args.max_seq_len, &path)?;
    let per_block = kv_block_bytes(&cfg, tp)
        .with_context(|| format!("sizing the KV cache of {} at TP {tp}", args.model.display()))?;
    if device != Device::Cpu {
        return Ok(());
    }
    let (what, need) = match (args.kv.kv_blocks, args.kv.kv_cache_gib) {
        (Some(b), _) => (
            format!("--kv-blocks {b}"),
            (b as u64).saturating_mul(per_block),
        ),
        (None, Some(g)) => (
            format!("--kv-cache-gib {g}"),
            (g * (1u64 << 30) as f64) as u64,
        ),
        // The default fits the host by construction.
        (None, None) => return Ok(()),
    };
    let Some(available) = available else {
        return Ok(());
    };
    let local = local_ranks.max(1) as u64;
    let share = available / local;
    if need > share {
        let fit = share / per_block.max(1);
        bail!(
            "{what} asks for a KV cache of {need} bytes ({}) per rank, {} for the {local} rank(s) on this host, which has {available} bytes ({}) available; {fit} blocks of {} positions ({per_block} bytes each) fit",
            gib(need),
            gib(need.saturating_mul(local)),
            gib(available),
            arbor_kernels::paged::KV_BLOCK
        );
    }
    Ok(())
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["serve", "--model", "/nonexistent"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).expect("flags parse").args
    }

    #[test]
    fn hosts_resolve_as_names_and_bare_or_bracketed_ipv6() {
        let lo6: SocketAddr = "[::1]:8000".parse().unwrap();
        assert_eq!(listen_addr("::1", 8000).unwrap(), lo6);
        assert_eq!(listen_addr("[::1]", 8000).unwrap(), lo6);
        assert_eq!(
            listen_addr("127.0.0.1", 8000).unwrap(),
            "127.0.0.1:8000".parse::<SocketAddr>().unwrap()
        );
        assert!(listen_addr("localhost", 8000).unwrap().ip().is_loopback());
        let e = listen_addr("no such host!", 1).unwrap_err();
        assert!(format!("{e:#}").contains("--host no such host!"), "{e:#}");
    }

    #[test]
    fn flags_that_cannot_work_are_refused() {
        assert!(check_flags(&args(&[])).is_ok());
        for (flags, needle) in [
            (
                &["--drain-timeout-s", "1e300"][..],
                "--drain-timeout-s 1e300",
            ),
            (&["--drain-timeout-s", "NaN"], "--drain-timeout-s NaN"),
            (&["--drain-timeout-s=-1"], "--drain-timeout-s -1"),
            (&["--api-key", ""], "empty"),
            (&["--api-key", "a b"], "whitespace"),
            (&["--kv-blocks", "0"], "--kv-blocks 0"),
            (&["--kv-blocks", "99999999999"], "--kv-blocks 99999999999"),
            (
                &["--gpu-memory-utilization", "1.5"],
                "--gpu-memory-utilization 1.5",
            ),
            (&["--kv-cache-gib", "0"], "--kv-cache-gib 0.0"),
            (&["--max-num-seqs", "0"], "--max-num-seqs"),
            (&["--header-timeout-s", "0"], "--header-timeout-s 0.0"),
            (&["--body-timeout-s", "inf"], "--body-timeout-s inf"),
            (&["--max-connections", "0"], "--max-connections 0"),
            (
                &["--max-connections", "2000000"],
                "--max-connections 2000000",
            ),
        ] {
            let e = check_flags(&args(flags)).expect_err(needle);
            assert!(format!("{e:#}").contains(needle), "{flags:?}: {e:#}");
        }
        let listen = check_flags(&args(&["--drain-timeout-s", "86400", "--host", "::1"])).unwrap();
        assert!(listen.is_ipv6());
    }

    #[test]
    fn kv_blocks_count_k_and_v_of_every_layer_and_the_ranks_heads() {
        let dir = std::env::temp_dir().join(format!("arbor-serve-kv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        arbor_model::make_model(&arbor_model::SynthOptions::new(
            arbor_model::Arch::Llama,
            arbor_model::Preset::Tiny,
            1,
            dir.to_str().unwrap(),
        ))
        .unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let per = 2 * 2 * cfg.num_layers * cfg.head_dim * 64;
        assert_eq!(
            kv_block_bytes(&cfg, 1).unwrap(),
            (per * cfg.num_kv_heads) as u64
        );
        assert_eq!(
            kv_block_bytes(&cfg, 2).unwrap(),
            (per * cfg.num_kv_heads / 2) as u64
        );
        // Any number of running sequences: they take no memory of their own.
        let mut a = args(&["--max-num-seqs", "100000000"]);
        a.model = dir.clone();
        assert!(check_kv(&a, Device::Cpu, 1, 1, Some(1 << 20)).is_ok());
        // A cache given on the command line is checked against the host's memory.
        let block = kv_block_bytes(&cfg, 1).unwrap();
        a.kv.kv_blocks = Some(1000);
        assert!(check_kv(&a, Device::Cpu, 1, 1, Some(1000 * block)).is_ok());
        let e = check_kv(&a, Device::Cpu, 1, 2, Some(1000 * block)).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("--kv-blocks 1000") && e.contains("500 blocks of 64 positions"),
            "{e}"
        );
        // A device's memory is checked where it is opened.
        assert!(check_kv(&a, Device::Cuda, 1, 2, Some(block)).is_ok());
        a.kv.kv_blocks = None;
        a.kv.kv_cache_gib = Some(2.0);
        let e = check_kv(&a, Device::Cpu, 1, 1, Some(1 << 30)).unwrap_err();
        assert!(format!("{e:#}").contains("--kv-cache-gib 2"), "{e:#}");
        a.max_seq_len = Some(1 << 30);
        assert!(
            check_kv(&a, Device::Cuda, 1, 1, None).is_err(),
            "a context past the model's"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
