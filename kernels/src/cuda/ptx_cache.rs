//! NVRTC's PTX kept on disk between processes. NVRTC compiles arbor's kernel programs at
//! every start: about a second on an H100 host, about 45 s for the GEMM's program on a
//! 2-core machine. A process whose program text, compile options, target and NVRTC
//! version equal an earlier one's reads that PTX back instead. The driver's own cache
//! (`CUDA_CACHE_PATH`) keeps the PTX's SASS, the larger part of a cold start on a GPU
//! host, so with both warm a start compiles nothing.
//!
//! The entry's name is the SHA-256 of everything the compile reads, so a changed source,
//! option or NVRTC release never meets an old entry; an entry's first line is the SHA-256
//! of its PTX, so a torn or edited file is compiled again, never loaded. Entries are
//! written to a temporary file and renamed into place: ranks starting together each
//! compile once and the last rename wins, with identical text. The cache never fails a
//! compile: an unwritable directory or a bad entry is logged and NVRTC runs as before.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The cache's directory (`off` keeps nothing); unset: `$XDG_CACHE_HOME/arbor/kernels`,
/// else `$HOME/.cache/arbor/kernels`.
pub const CACHE_ENV: &str = "ARBOR_KERNEL_CACHE";

const HEADER: &str = "// arbor ptx cache, sha256 of the text below: ";

/// Where entries live, from the environment's values (pure, for the tests): `None` when
/// the cache is off or no directory can be named.
pub fn dir_from(setting: Option<&str>, xdg: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    match setting.map(str::trim) {
        Some("off") | Some("0") => None,
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => match (
            xdg.filter(|x| !x.is_empty()),
            home.filter(|h| !h.is_empty()),
        ) {
            (Some(x), _) => Some(Path::new(x).join("arbor").join("kernels")),
            (None, Some(h)) => Some(Path::new(h).join(".cache").join("arbor").join("kernels")),
            (None, None) => None,
        },
    }
}

/// The cache directory this process uses.
pub fn dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var(k).ok();
    dir_from(
        var(CACHE_ENV).as_deref(),
        var("XDG_CACHE_HOME").as_deref(),
        var("HOME").as_deref(),
    )
}

/// NVRTC's version as `major.minor`, part of every key; `unknown` where it cannot be read
/// (the compile that follows then reports the library's problem itself).
fn nvrtc_version() -> String {
    let read = || {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-pointers to live locals; cudarc loads the symbol and panics
        // (caught) when the library is missing.
        let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        (rc == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
    };
    std::panic::catch_unwind(read)
        .ok()
        .flatten()
        .unwrap_or_else(|| "unknown".into())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What an entry's header holds for its PTX.
fn checksum(ptx: &str) -> String {
    hex(&Sha256::digest(ptx.as_bytes()))
}

/// The entry's file for a program and the parts its compile reads (each part
/// length-prefixed, so no two lists hash alike by concatenation).
pub fn entry_path(dir: &Path, program: &str, parts: &[&str]) -> PathBuf {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    dir.join(format!(
        "{}{}.ptx",
        entry_prefix(program),
        &hex(&h.finalize())[..32]
    ))
}

/// What every entry of `program` is named with first: the name made filename-safe, a dash.
fn entry_prefix(program: &str) -> String {
    let name: String = program
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{name}-")
}

/// The entry's PTX, or `None` when it is missing or does not match its header.
fn read_entry(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let (first, ptx) = text.split_once('\n')?;
    let want = first.strip_prefix(HEADER)?;
    if checksum(ptx) == want {
        Some(ptx.to_string())
    } else {
        tracing::warn!(path = %path.display(), "PTX cache entry does not match its checksum; compiling again");
        None
    }
}

fn write_entry(path: &Path, ptx: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // One name per writer: ranks may be processes or threads of one process.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{n}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    let text = format!("{HEADER}{}\n{ptx}", checksum(ptx));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Entries a program keeps: the newest few (by the time they were written), so that
/// upgrades and other targets do not grow the directory without end.
pub const KEEP_PER_PROGRAM: usize = 8;

/// Removes all but the [`KEEP_PER_PROGRAM`] newest entries of `program` (its prefix, 32
/// hex digits, `.ptx`); `kept` stays.
fn prune(dir: &Path, program: &str, kept: &Path) {
    let prefix = entry_prefix(program);
    let is_entry = |n: &str| {
        n.strip_prefix(prefix.as_str())
            .and_then(|r| r.strip_suffix(".ptx"))
            .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    let Ok(list) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = list
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(is_entry))
        .filter(|e| e.path() != kept)
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, old) in entries.into_iter().skip(KEEP_PER_PROGRAM - 1) {
        match std::fs::remove_file(&old) {
            Ok(()) => tracing::debug!(path = %old.display(), "old PTX cache entry removed"),
            Err(e) => {
                tracing::debug!(path = %old.display(), error = %e, "could not remove an old PTX cache entry")
            }
        }
    }
}

/// `compile`'s PTX for `program` and the `parts` it reads, through the cache in `dir`
/// (`None`: no cache). Only a successful compile is kept.
pub fn cached_in<E>(
    dir: Option<&Path>,
    program: &str,
    parts: &[&str],
    compile: impl FnOnce() -> Result<String, E>,
) -> Result<String, E> {
    let Some(dir) = dir else {
        return compile();
    };
    let path = entry_path(dir, program, parts);
    if let Some(ptx) = read_entry(&path) {
        tracing::info!(program, path = %path.display(), "PTX from the kernel cache");
        return Ok(ptx);
    }
    let ptx = compile()?;
    match write_entry(&path, &ptx) {
        Ok(()) => {
            tracing::debug!(program, path = %path.display(), "PTX kept in the kernel cache");
            prune(dir, program, &path);
        }
        Err(e) => tracing::warn!(
            program,
            path = %path.display(),
            error = %e,
            "could not write the kernel cache (set {CACHE_ENV}=off to stop trying)"
        ),
    }
    Ok(ptx)
}

/// `compile(opts)`'s PTX of `src` for `arch`, through this process's cache directory
/// ([`dir`]); the key is everything that compile reads, NVRTC's version too.
pub fn cached<E>(
    program: &str,
    src: &str,
    arch: &str,
    opts: cudarc::nvrtc::CompileOptions,
    compile: impl FnOnce(cudarc::nvrtc::CompileOptions) -> Result<String, E>,
) -> Result<String, E> {
    let key = [src, arch, &format!("{opts:?}"), &nvrtc_version()];
    cached_in(dir().as_deref(), program, &key, || compile(opts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("arbor-ptx-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_directory_follows_the_environment() {
        assert_eq!(dir_from(Some("off"), Some("/x"), Some("/h")), None);
        assert_eq!(dir_from(Some("0"), None, Some("/h")), None);
        assert_eq!(
            dir_from(Some("/c"), Some("/x"), Some("/h")),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            dir_from(None, Some("/x"), Some("/h")),
            Some(PathBuf::from("/x/arbor/kernels"))
        );
        assert_eq!(
            dir_from(Some(""), Some(""), Some("/h")),
            Some(PathBuf::from("/h/.cache/arbor/kernels"))
        );
        assert_eq!(dir_from(None, None, None), None);
    }

    #[test]
    fn a_second_compile_of_the_same_parts_reads_the_first() {
        let d = scratch("hit");
        let calls = Cell::new(0);
        let compile = || -> Result<String, String> {
            calls.set(calls.get() + 1);
            Ok(format!(
                ".version 9.0\n.target sm_90a\n// {}\n",
                calls.get()
            ))
        };
        let a = cached_in(Some(&d), "prog", &["src", "sm_90a"], compile).unwrap();
        let b = cached_in(Some(&d), "prog", &["src", "sm_90a"], compile).unwrap();
        assert_eq!((a.as_str(), calls.get()), (b.as_str(), 1));
        // Any part changed, or parts split differently, is another entry.
        cached_in(Some(&d), "prog", &["src", "sm_80"], compile).unwrap();
        cached_in(Some(&d), "prog", &["srcsm_90a"], compile).unwrap();
        cached_in(Some(&d), "prog", &["sr", "csm_90a"], compile).unwrap();
        assert_eq!(calls.get(), 4);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_damaged_entry_is_compiled_again_and_an_error_is_not_kept() {
        let d = scratch("bad");
        let calls = Cell::new(0);
        let compile = || -> Result<String, String> {
            calls.set(calls.get() + 1);
            Ok("ptx text\n".to_string())
        };
        cached_in(Some(&d), "p", &["a"], compile).unwrap();
        let path = entry_path(&d, "p", &["a"]);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("ptx text", "ptx test")).unwrap();
        assert_eq!(
            cached_in(Some(&d), "p", &["a"], compile).unwrap(),
            "ptx text\n"
        );
        assert_eq!(calls.get(), 2);
        // The rewritten entry is good again.
        cached_in(Some(&d), "p", &["a"], compile).unwrap();
        assert_eq!(calls.get(), 2);

        let failing = || -> Result<String, String> { Err("nvrtc: syntax error".into()) };
        assert!(cached_in(Some(&d), "p", &["b"], failing).is_err());
        assert!(!entry_path(&d, "p", &["b"]).exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn writers_racing_on_one_entry_leave_a_good_one() {
        let d = scratch("race");
        let ptx = "x".repeat(1 << 20);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| cached_in(Some(&d), "p", &["a"], || Ok::<_, String>(ptx.clone())));
            }
        });
        let leftovers: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
        assert_eq!(
            read_entry(&entry_path(&d, "p", &["a"])).as_deref(),
            Some(ptx.as_str())
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_program_keeps_its_newest_entries_and_no_other_programs_are_touched() {
        let d = scratch("prune");
        std::fs::create_dir_all(&d).unwrap();
        let other = entry_path(&d, "other", &["x"]);
        std::fs::write(&other, "kept").unwrap();
        std::fs::write(d.join("p-notahash.ptx"), "kept").unwrap();
        let mut paths = Vec::new();
        for i in 0..KEEP_PER_PROGRAM + 3 {
            let part = i.to_string();
            cached_in(Some(&d), "p", &[&part], || Ok::<_, String>(part.clone())).unwrap();
            paths.push(entry_path(&d, "p", &[&part]));
            // Modification times one step apart, oldest first.
            let t =
                std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            std::fs::File::options()
                .write(true)
                .open(paths.last().unwrap())
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        let alive: Vec<bool> = paths.iter().map(|p| p.exists()).collect();
        let kept = alive.iter().filter(|a| **a).count();
        assert_eq!(kept, KEEP_PER_PROGRAM, "{alive:?}");
        assert!(alive[KEEP_PER_PROGRAM + 2], "the newest entry was removed");
        assert!(
            !alive[0] && !alive[1],
            "the oldest entries stayed: {alive:?}"
        );
        assert!(other.exists() && d.join("p-notahash.ptx").exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_unwritable_directory_still_compiles() {
        // A regular file where the directory should be: create_dir_all fails.
        let f = scratch("file");
        std::fs::write(&f, b"not a directory").unwrap();
        let out = cached_in(Some(&f.join("sub")), "p", &["a"], || {
            Ok::<_, String>("x".into())
        });
        assert_eq!(out.unwrap(), "x");
        let _ = std::fs::remove_file(&f);
    }
}
