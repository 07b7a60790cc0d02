//! `/init_weights_update_group` by address (TP 2, CPU ranks) against real PyTorch: a
//! Python process makes the group's store exactly as a trainer does and publishes a fake
//! NCCL id where the trainer's rank 0 would; every arbor rank checks in at the store (the
//! trainer's rendezvous waits for that), reads the id, and — CPU ranks cannot join NCCL —
//! refuses, saying which id it read from which key. Also: a store nobody runs, and one
//! that never publishes, fail after `timeout_s` naming the address and the key; the
//! route's validation. Skipped, saying so, where Python has no torch.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::checkpoint::models;
use crate::cli_support::{free_port, python_has};
use crate::server::Server;

/// The trainer side of SGLang's `init_custom_process_group` (the copies in slime's
/// `slime/utils/distributed_utils.py`, AReaL and OpenRLHF are the same) up to where
/// `ProcessGroupNCCL` publishes the id: `rendezvous("tcp://…")` as rank 0 of `world`
/// (a `TCPStore` master that waits for every member to check in), `PrefixStore(group)`,
/// then `_new_process_group_helper`'s `PrefixStore(group + "/")` and its backend loop's
/// `PrefixStore("cuda/")`; `broadcastUniqueNCCLID` sets the id under
/// `ncclCommCounter_` 0. vLLM's side: `StatelessProcessGroup.create` (a legacy-server
/// `TCPStore` master with `world_size`) and `PyNcclCommunicator`'s
/// `broadcast_obj(unique_id, src=0)`, the `ncclUniqueId` ctypes struct pickled.
const TRAINER: &str = r#"
import ctypes, pickle, sys, types
from datetime import timedelta
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.rendezvous import rendezvous

style, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fake_id = bytes((7 * i + 3) % 256 for i in range(128))
if style == "torch":
    store, rank, world_size = next(
        rendezvous(f"tcp://127.0.0.1:{port}", 0, world, timeout=timedelta(seconds=60)))
    print("CHECKED_IN", flush=True)
    group = PrefixStore("grp-0", store)
    for_backend = PrefixStore("cuda/", PrefixStore("grp-0/", group))
    for_backend.set("0", fake_id)
else:
    store = TCPStore("127.0.0.1", port, world_size=world, is_master=True,
                     timeout=timedelta(seconds=60), use_libuv=False)
    print("CHECKED_IN", flush=True)
    # vLLM's module, without vLLM: pickle names the class by module and name.
    sys.modules["vllm_stub"] = types.ModuleType("vllm_stub")
    mod = types.ModuleType("vllm_stub.pynccl_wrapper")
    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]
    ncclUniqueId.__module__ = mod.__name__
    mod.ncclUniqueId = ncclUniqueId
    sys.modules[mod.__name__] = mod
    uid = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), fake_id, 128)
    store.set("broadcast_from/0/0", pickle.dumps(uid))
print("PUBLISHED", flush=True)
sys.stdin.read()
"#;

/// A Python trainer process (`python3 -c SCRIPT ARGS...`) whose stdout lines the test
/// reads; it lives until dropped (its stdin closes, then it is killed after 10 s).
pub(crate) struct Trainer {
    child: Child,
    stdin: Option<ChildStdin>,
    out: std::sync::mpsc::Receiver<String>,
}

impl Trainer {
    pub(crate) fn run(script: &str, args: &[&str]) -> Trainer {
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start python3");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, out) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stdin = child.stdin.take();
        Trainer { child, stdin, out }
    }

    pub(crate) fn expect(&self, line: &str) {
        let got = self
            .out
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("the trainer did not print {line}: {e}"));
        assert_eq!(got, line);
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = s.flush();
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn message(v: &Value) -> &str {
    v["message"].as_str().expect("message")
}

/// The id's first bytes as the refusal names them.
const FAKE_ID_BEGINS: &str = "030a1118";

#[test]
fn joins_the_trainers_store_and_reads_the_id_torch_and_vllm_style() {
    if !python_has(
        &["torch.distributed"],
        "python3 -m pip install torch==2.11.0",
    ) {
        return;
    }
    let m = models();
    let s = Server::start(2, &m.a, &[], "rdzv");
    for style in ["torch", "vllm"] {
        let port = free_port();
        let trainer = Trainer::run(TRAINER, &[style, &port.to_string(), "3"]);
        // AReaL sends the port as a string; slime as a number.
        let port_field = if style == "torch" {
            json!(port.to_string())
        } else {
            json!(port)
        };
        let (st, v) = s.post(
            "/init_weights_update_group",
            &json!({"master_address": "127.0.0.1", "master_port": port_field,
                    "rank_offset": 1, "world_size": 3, "group_name": "grp-0",
                    "backend": "nccl", "rendezvous": style, "timeout_s": 60}),
        );
        // The store's master returned: both ranks checked in.
        trainer.expect("CHECKED_IN");
        trainer.expect("PUBLISHED");
        assert_eq!(st, 400, "{style}: {v}");
        let key = match style {
            "torch" => "grp-0/grp-0//cuda//0",
            _ => "broadcast_from/0/0",
        };
        let want = format!(
            "read the trainer's 128-byte NCCL unique id (beginning {FAKE_ID_BEGINS}) from key {key:?} in the TCPStore at 127.0.0.1:{port}"
        );
        let msg = message(&v);
        assert_eq!(
            msg.matches(&want).count(),
            2,
            "every rank read it ({style}): {want:?} in {msg}"
        );
        assert!(msg.contains("rank 0:") && msg.contains("rank 1:"), "{msg}");
        assert!(msg.contains("--device cuda"), "{msg}");
        assert_eq!(v["error"]["param"], Value::Null, "{v}");
    }
    // Nothing listens there: refused after timeout_s, naming the address.
    let port = free_port();
    let t0 = Instant::now();
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 3, "group_name": "g", "timeout_s": 1}),
    );
    let waited = t0.elapsed();
    assert_eq!(st, 400, "{v}");
    assert!(
        message(&v).contains(&format!("cannot reach the TCPStore at 127.0.0.1:{port}")),
        "{v}"
    );
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    // A store whose rank 0 never publishes: refused after timeout_s, naming the key.
    let port = free_port();
    let trainer = Trainer::run(TRAINER, &["torch", &port.to_string(), "3"]);
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"master_address": "localhost", "master_port": port, "rank_offset": 1,
                "world_size": 3, "group_name": "never", "timeout_s": 20}),
    );
    trainer.expect("CHECKED_IN");
    assert_eq!(st, 400, "{v}");
    let msg = message(&v);
    assert!(
        msg.contains("\"never/never//cuda//0\"")
            && msg.contains("did not answer within 20.0 s (ranks 0, 1)"),
        "{msg}"
    );
    drop(trainer);
    // The server keeps serving, and no group was left behind.
    let (st, v) = s.post(
        "/update_weights_from_distributed",
        &json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": "grp-0"}),
    );
    assert_eq!(st, 409, "{v}");
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
}

#[test]
fn init_group_bodies_are_checked() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "rdzv-bad");
    let nobody = free_port();
    let base = json!({"master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1,
                      "world_size": 3, "group_name": "g", "timeout_s": 1});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let without = |k: &str| {
        let mut b = base.clone();
        b.as_object_mut().expect("object").remove(k);
        b
    };
    for (body, param) in [
        (with("master_port", json!("29x")), "master_port"),
        (with("master_port", json!(0)), "master_port"),
        (with("master_port", json!(70000)), "master_port"),
        (with("master_port", json!(-1)), "master_port"),
        (with("master_address", json!("")), "master_address"),
        (with("master_address", json!("a b")), "master_address"),
        (without("master_port"), "master_port"),
        (without("master_address"), "master_address"),
        (
            without("master_address")
                .as_object()
                .map(|o| {
                    let mut o = o.clone();
                    o.remove("master_port");
                    Value::Object(o)
                })
                .expect("object"),
            "master_address",
        ),
        (with("unique_id", json!("00".repeat(128))), "unique_id"),
        (with("rendezvous", json!("gloo")), "rendezvous"),
        (with("backend", json!("gloo")), "backend"),
        (with("rank_offset", json!(0)), "rank_offset"),
        (with("world_size", json!(2)), "world_size"),
        (with("override_existing", json!(true)), "override_existing"),
        (with("group_name", json!("")), "group_name"),
        (with("timeout_s", json!(0)), "timeout_s"),
    ] {
        let (st, v) = s.post("/init_weights_update_group", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    // A unique_id with a rendezvous style makes no sense either.
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"unique_id": "00".repeat(128), "rendezvous": "vllm", "rank_offset": 1,
                "world_size": 3, "group_name": "g"}),
    );
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("rendezvous")),
        "{v}"
    );
    let (st, v) = s.post(
        "/init_weights_update_group",
        &with("master_host", json!("x")),
    );
    assert_eq!(st, 422, "unknown fields: {v}");
    // override_existing: false changes nothing (SkyRL sends it).
    let (st, v) = s.post(
        "/init_weights_update_group",
        &with("override_existing", json!(false)),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        message(&v).contains(&format!("cannot reach the TCPStore at 127.0.0.1:{nobody}")),
        "{v}"
    );
}
