//! `--device cuda` on a machine without a usable GPU: a clear error naming the cause and a
//! non-zero exit, never a panic. On a machine with a GPU the test prints why it is skipped
//! (the GPU path is exercised by scripts/gpu/gpu-check.sh on the lent machines).

use std::process::Command;

fn arbor() -> Command {
    Command::new(env!("CARGO_BIN_EXE_arbor"))
}

#[test]
fn device_cuda_without_gpu_fails_cleanly() {
    if arbor_kernels::cuda::probe::gpu_present() {
        eprintln!("skipped: a CUDA device is present here");
        return;
    }
    let dir = std::env::temp_dir().join(format!("arbor-gpu-device-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let made = arbor()
        .args(["make-model", "--out"])
        .arg(&dir)
        .output()
        .expect("running arbor make-model");
    assert!(
        made.status.success(),
        "make-model failed: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let input = dir.join("score-input.jsonl");
    std::fs::write(&input, "{\"id\":0,\"tokens\":[1,2,3],\"prompt_len\":1}\n")
        .expect("writing the score input");
    for sub in ["generate", "score"] {
        let mut cmd = arbor();
        cmd.arg(sub)
            .arg("--model")
            .arg(&dir)
            .args(["--device", "cuda"]);
        if sub == "generate" {
            cmd.args(["--prompt", "hello", "--max-tokens", "2"]);
        } else {
            cmd.arg("--input").arg(&input);
        }
        let out = cmd.output().expect("running arbor");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{sub} --device cuda succeeded without a GPU"
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "{sub}: exit status {:?}\n{stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{sub} panicked:\n{stderr}");
        assert!(
            stderr.contains("CUDA"),
            "{sub}: the error does not name CUDA:\n{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
