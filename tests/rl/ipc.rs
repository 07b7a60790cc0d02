//! Colocated weight updates by CUDA IPC handle (`/update_weights_from_tensor` with SGLang's
//! JSON, docs/rl.md) on CPU: the pickles are the real bytes Python's
//! `multiprocessing.reduction.ForkingPickler` writes for torch's reduction of a CUDA tensor
//! and for SGLang's patched one (`ipc_pickles.py`: torch/multiprocessing/reductions.py
//! `reduce_tensor`, sglang python/sglang/srt/patch_torch.py, FlattenedTensorBucket in
//! python/sglang/srt/weight_sync/tensor_bucket.py), read by arbor's restricted reader; a
//! CPU server refuses them with a 400 and keeps serving; torch's shared-memory ref-counter
//! layout, checked against a file torch made. The copy itself runs on a GPU
//! (scripts/gpu/ipc-check.sh).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use arbor_model::batching::ipc::{
    b64decode, parse_rank, release_ref_counter, IpcBuffer, IpcDevice, IpcLayout,
};
use arbor_model::DType;
use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::cli_support::python_has;
use crate::server::Server;

const TORCH: &str = "python3 -m pip install torch==2.11.0";

/// The JSON bodies `ipc_pickles.py` prints for `specs` ("form,layout,ranks,variant"),
/// made by one Python process (importing torch takes seconds).
fn bodies(specs: &[&str]) -> Vec<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rl/ipc_pickles.py");
    let o = Command::new("python3")
        .arg(&script)
        .args(specs)
        .output()
        .expect("run python3");
    assert!(
        o.status.success(),
        "ipc_pickles.py {specs:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON body"))
        .collect();
    assert_eq!(out.len(), specs.len());
    out
}

fn element(b: &Value, rank: usize) -> Vec<u8> {
    b64decode(
        b["serialized_named_tensors"][rank]
            .as_str()
            .expect("a string"),
    )
    .expect("base64")
}

fn layout(name: &str) -> IpcLayout {
    match name {
        "pairs" => IpcLayout::Pairs,
        _ => IpcLayout::FlattenedBucket,
    }
}

#[test]
fn reads_the_handles_torch_and_sglang_pickle() {
    if !python_has(&["torch"], TORCH) {
        return;
    }
    let uuid = "f1e2d3c4-b5a6-9788-6958-4a3b2c1d0e0f";
    let specs: Vec<String> = ["torch", "sglang16", "sglang15"]
        .iter()
        .flat_map(|f| ["pairs", "bucket"].map(|l| format!("{f},{l},2,ok")))
        .collect();
    let made = bodies(&specs.iter().map(String::as_str).collect::<Vec<_>>());
    for (spec, b) in specs.iter().zip(&made) {
        let mut it = spec.split(',');
        let (form, lay) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
        {
            for rank in 0..2 {
                let bufs = parse_rank(&element(b, rank), layout(lay))
                    .unwrap_or_else(|e| panic!("{form} {lay} rank {rank}: {e}"));
                let handle: Vec<u8> = (0..64).map(|i| ((rank * 64 + i) % 256) as u8).collect();
                let device = if form == "torch" {
                    IpcDevice::Index(0)
                } else {
                    IpcDevice::Uuid(uuid.into())
                };
                let event = (rank == 1).then(|| (0..64).collect::<Vec<u8>>());
                let refc = Some((format!("/torch_{rank}_77_0").into_bytes(), 3));
                let base = 1024 * (rank as u64 + 1);
                let check = |b: &IpcBuffer, offset: u64, len: u64| {
                    assert_eq!(b.device, device, "{form} {lay}");
                    assert_eq!(b.handle, handle);
                    assert_eq!((b.offset, b.len), (offset, len), "{form} {lay}");
                    assert_eq!(b.event, event);
                    assert_eq!(b.ref_counter, refc);
                };
                let emb = "model.embed_tokens.weight";
                let norm = "model.norm.weight";
                if lay == "pairs" {
                    // Each tensor its own buffer; the second at tensor_offset 4 (8 bytes).
                    assert_eq!(bufs.len(), 2);
                    check(&bufs[0], base, 256);
                    check(&bufs[1], base + 8, 16);
                    let p = &bufs[0].parts[0];
                    assert_eq!((p.name.as_str(), &p.shape[..]), (emb, &[16, 8][..]));
                    assert_eq!((p.dtype, p.start, p.end), (DType::BF16, 0, 256));
                    assert_eq!(bufs[1].parts[0].name, norm);
                } else {
                    assert_eq!(bufs.len(), 1);
                    check(&bufs[0], base, 272);
                    let parts: Vec<_> = bufs[0]
                        .parts
                        .iter()
                        .map(|p| (p.name.as_str(), p.shape.clone(), p.start, p.end))
                        .collect();
                    assert_eq!(
                        parts,
                        [(emb, vec![16, 8], 0, 256), (norm, vec![8], 256, 272)]
                    );
                }
            }
        }
    }
}

#[test]
fn refuses_what_is_not_a_cuda_tensor_arbor_takes() {
    if !python_has(&["torch"], TORCH) {
        return;
    }
    let cases = [
        (
            "evil_global",
            "pairs",
            "the global posix.system, which is not allowed",
        ),
        ("float64", "pairs", "dtype torch.float64"),
        ("truncated", "pairs", "truncated"),
        ("strided", "pairs", "not contiguous"),
        ("ok", "bucket", "a list of (name, tensor) pairs, got a dict"),
    ];
    let specs: Vec<String> = cases
        .iter()
        .map(|(v, l, _)| format!("torch,{l},1,{v}"))
        .collect();
    let made = bodies(&specs.iter().map(String::as_str).collect::<Vec<_>>());
    for ((variant, lay, want), b) in cases.into_iter().zip(&made) {
        // The bucket case reads a bucket as pairs: the layout must match load_format.
        let read_as = if variant == "ok" { "pairs" } else { lay };
        let e = parse_rank(&element(b, 0), layout(read_as)).unwrap_err();
        assert!(e.0.contains(want), "{variant}: {e}");
    }
}

#[test]
fn a_cpu_server_refuses_ipc_with_400_and_keeps_serving() {
    if !python_has(&["torch"], TORCH) {
        return;
    }
    let made = bodies(&[
        "torch,pairs,1,ok",
        "torch,bucket,1,ok",
        "sglang16,pairs,1,ok",
        "sglang16,bucket,1,ok",
        "torch,pairs,2,ok",
        "torch,pairs,1,evil_global",
        "torch,pairs,1,float64",
        "torch,pairs,1,truncated",
    ]);
    let m = models();
    let s = Server::start(1, &m.a, &[], "ipc");
    let before = s.version();
    let path = "/update_weights_from_tensor";
    let refused = |body: &Value, param: &str, needles: &[&str]| {
        let (status, v) = s.post(path, body);
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["success"], json!(false), "{v}");
        assert_eq!(v["error"]["param"], json!(param), "{v}");
        let msg = v["message"].as_str().unwrap_or_default();
        for n in needles {
            assert!(msg.contains(n), "{n:?} in {msg}");
        }
    };
    for ok in &made[..4] {
        let (status, v) = s.post(path, ok);
        assert_eq!(status, 400, "{v}");
        let msg = v["message"].as_str().unwrap_or_default();
        assert!(msg.contains("CUDA IPC needs a CUDA rank"), "{msg}");
        assert!(msg.contains("dropped"), "{msg}");
    }
    refused(
        &made[4],
        "serialized_named_tensors",
        &["2 elements", "1 TP ranks"],
    );
    refused(
        &made[5],
        "serialized_named_tensors[0]",
        &["posix.system", "not allowed"],
    );
    refused(&made[6], "serialized_named_tensors[0]", &["torch.float64"]);
    refused(&made[7], "serialized_named_tensors[0]", &["truncated"]);
    let mut wrong_format = made[0].clone();
    wrong_format["load_format"] = json!("flattened_bucket");
    refused(
        &wrong_format,
        "serialized_named_tensors[0]",
        &["a dict", "got a list of 2"],
    );
    wrong_format["load_format"] = json!("safetensors");
    refused(&wrong_format, "load_format", &["\"safetensors\""]);
    refused(
        &json!({"serialized_named_tensors": ["not base64!"]}),
        "serialized_named_tensors[0]",
        &["not base64"],
    );
    // Nothing was staged, nothing changed, and the server answers.
    assert_eq!(s.version(), before);
    let (status, v) = s.post(path, &json!({}));
    assert_eq!(status, 422, "{v}");
    let (status, v) = s.post(
        "/generate",
        &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(status, 200, "{v}");
}

/// torch's CUDA ref-counter files are `RefcountedMapAllocator` shared memory, as its
/// `file_system` CPU sharing makes them: a torch int64 tensor in such a file, one counter
/// taken off by arbor, read back by torch.
#[test]
fn releases_torchs_ref_counter_in_shared_memory() {
    if !python_has(&["torch"], TORCH) {
        return;
    }
    const SCRIPT: &str = r#"
import sys, torch, torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
t = torch.zeros(16, dtype=torch.int64)
t.share_memory_()
t[5] = 3
t[6] = 7
_, name, _ = t.untyped_storage()._share_filename_cpu_()
print(name.decode(), flush=True)
sys.stdin.readline()
print(int(t[5]), int(t[6]), flush=True)
"#;
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut name = String::new();
    out.read_line(&mut name).expect("name");
    let name = name.trim().to_string();
    release_ref_counter(name.as_bytes(), 5).expect("release");
    let mut stdin = child.stdin.take().expect("stdin");
    writeln!(stdin).expect("go on");
    let mut after = String::new();
    out.read_line(&mut after).expect("values");
    assert_eq!(after.trim(), "2 7", "{name}");
    assert!(child.wait().expect("python3").success());
}
