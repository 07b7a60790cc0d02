//! Helpers the CLI integration tests share: the real binaries, scratch directories, tiny
//! models made by `arbor make-model`, token-id prompts, and what a started rank must not
//! inherit from an enclosing launcher.
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

/// Makes a tiny model of `arch` ("llama" | "qwen2" | "qwen3" | "qwen3-moe" | "mixtral") in `dir` with `arbor make-model`.
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

/// Launcher variables (torchrun style) the test process may have inherited: in a started
/// rank they would change what it thinks its rank and group are.
pub const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// A local TCP port that was free a moment ago, drawn as arbor-launch draws its rendezvous
/// port (outside the OS's ephemeral range, so the suite's own client connections cannot
/// take it before the test's rank binds it).
pub fn free_port() -> u16 {
    match arbor_launch::free_port("127.0.0.1", false) {
        Ok(p) => p,
        Err(e) => panic!("no free local port: {e}"),
    }
}

/// Writes `<dir>/prompts.jsonl`: three prompts of different lengths as token ids (no
/// tokenizer needed).
pub fn write_token_prompts(dir: &Path) -> PathBuf {
    let p = dir.join("prompts.jsonl");
    let lines = [
        r#"{"id":0,"tokens":[1,2,3,4,5,6,7]}"#,
        r#"{"id":1,"tokens":[200]}"#,
        r#"{"id":2,"tokens":[17,99,3,250,8,8,8,12,40,41,42,43,44]}"#,
    ];
    if let Err(e) = std::fs::write(&p, lines.join("\n") + "\n") {
        panic!("cannot write {}: {e}", p.display());
    }
    p
}

/// `arbor generate` arguments: 6 sampled tokens (temperature 0.8) per prompt of `prompts`,
/// as JSONL on stdout.
pub fn sampled_generate_args(model: &Path, prompts: &Path, seed: u64, batch: usize) -> Vec<String> {
    [
        "generate",
        "--model",
        &model.to_string_lossy(),
        "--prompts",
        &prompts.to_string_lossy(),
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        &seed.to_string(),
        "--batch",
        &batch.to_string(),
        "--jsonl",
    ]
    .map(String::from)
    .to_vec()
}

/// Writes `script` to `path` and makes it executable (a launcher wrapper for `--launcher`).
pub fn write_executable(path: &Path, script: &str) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Err(e) = std::fs::write(path, script) {
        panic!("cannot write {}: {e}", path.display());
    }
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755));
}

/// `arbor check` over TP 1, 2, 4, 8 and batches 1, 3 (6 new tokens), every configuration
/// started by `launcher`, the report written to `json`.
pub fn check_command(model: &Path, launcher: &Path, json: &Path) -> Command {
    let mut cmd = Command::new(arbor());
    cmd.args(["check", "--model"])
        .arg(model)
        .args([
            "--tp",
            "1,2,4,8",
            "--batch",
            "1,3",
            "--max-tokens",
            "6",
            "--launcher",
        ])
        .arg(launcher)
        .arg("--json")
        .arg(json);
    cmd
}

/// Whether `CI` is set (`.ci/run` sets it): optional tools become required there.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Whether python3 can import every module of `modules`. When it cannot, the calling test
/// is skipped with a printed reason locally, and fails in CI, where `.ci/run` installs
/// them (`install` says how).
pub fn python_has(modules: &[&str], install: &str) -> bool {
    let probe = format!("import {}", modules.join(", "));
    let ok = Command::new("python3")
        .args(["-c", &probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            !in_ci(),
            "CI: python3 with {modules:?} is required ({install})"
        );
        eprintln!("SKIPPED: python3 -c '{probe}' failed ({install})");
    }
    ok
}

/// Runs `python3 script args...` and returns its stdout; a failure shows its stderr.
pub fn run_python(script: &Path, args: &[&std::ffi::OsStr]) -> String {
    let o = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("start python3");
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "python3 {} failed:\n{out}\n{err}",
        script.display()
    );
    out
}

/// A script of `tests/gguf_ref/`.
pub fn gguf_ref_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/gguf_ref")
        .join(name)
}
