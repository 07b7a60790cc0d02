//! Helpers the CLI integration tests share: the real binaries, scratch directories and
//! tiny models made by `arbor make-model`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn arbor() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_arbor"))
}

pub fn launcher() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_arbor-launch"))
}

/// A scratch directory under the target dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let p = base.join(format!(
            "{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create scratch dir");
        Scratch(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs `arbor args...` directly (a group of one).
pub fn run_arbor(args: &[&str]) -> Output {
    Command::new(arbor())
        .args(args)
        .output()
        .expect("start arbor")
}

/// Runs `arbor args...` as `tp` ranks under arbor-launch.
pub fn run_launched(tp: usize, args: &[&str]) -> Output {
    Command::new(launcher())
        .arg("-n")
        .arg(tp.to_string())
        .arg("--")
        .arg(arbor())
        .args(args)
        .output()
        .expect("start arbor-launch")
}

/// Makes a tiny model of `arch` ("llama" | "qwen3") in `dir` with `arbor make-model`.
pub fn make_tiny(arch: &str, dir: &Path) {
    let o = run_arbor(&[
        "make-model",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--seed",
        "7",
        "--out",
        dir.to_str().expect("utf-8 path"),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "make-model failed:\n{out}\n{err}");
    assert!(dir.join("config.json").is_file());
}

/// A tiny model shared by the tests of one test binary, at a fixed path (a static is never
/// dropped, so a per-process scratch dir would be left behind); remade on first use.
pub fn shared_tiny(name: &str, arch: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("shared-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    make_tiny(arch, &dir);
    dir
}

/// The JSON lines of a file.
pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}
