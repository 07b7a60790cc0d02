//! The TCPStore client against PyTorch's own server: a Python process runs
//! `torch.distributed.TCPStore(is_master=True, world_size=2)` (the libuv server, torch's
//! default, and the legacy one), which waits for this client to check in; then keys go
//! both ways (set / get / add), and a value set through torch's `PrefixStore` chain is read
//! under the key this crate derives. Skipped, saying so, where Python has no torch.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use arbor_collective::tcp_store::{prefixed, StoreClient};

const SCRIPT: &str = r#"
import socket, sys
from datetime import timedelta
from torch.distributed import TCPStore, PrefixStore

use_libuv = sys.argv[1] == "libuv"
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
print("PORT", port, flush=True)
# Blocks until two members checked in: its own client and the Rust one.
store = TCPStore("127.0.0.1", port, world_size=2, is_master=True,
                 timeout=timedelta(seconds=30), use_libuv=use_libuv)
assert store.libuvBackend == use_libuv, store.libuvBackend
store.set("py_key", b"from python")
PrefixStore("cuda/", PrefixStore("g/", PrefixStore("g", store))).set("0", bytes(range(128)))
assert store.get("rs_key") == b"from rust \x00\xff"
store.wait(["rs_added"])
store.set("py_counter", str(store.add("counter", 4)).encode())
store.wait(["rs_done"])
print("OK", flush=True)
"#;

fn torch_missing() -> Option<String> {
    match Command::new("python3")
        .args(["-c", "import torch.distributed"])
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Some(format!("python3: {e}")),
    }
}

fn against_torch(server: &str) {
    if let Some(why) = torch_missing() {
        // `.ci/run` installs torch before the tests: there a missing torch is a failure.
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(!ci, "CI: python3 with torch is required ({why})");
        eprintln!("SKIPPED: torch's TCPStore needs python3 with torch ({why})");
        return;
    }
    let mut py = Command::new("python3")
        .args(["-c", SCRIPT, server])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start python3");
    let mut out = BufReader::new(py.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read the port");
    let port: u16 = line
        .strip_prefix("PORT ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("python printed {line:?}"));
    let t = Duration::from_secs(30);
    // The server may not listen yet: connect retries until it does.
    let mut c = StoreClient::connect("127.0.0.1", port, t).expect("connect");
    // The server's own client checks in too, before or after this one: 1 or 2. That the
    // count reached 2 shows in what follows: the master's constructor returns only then,
    // and only then sets py_key.
    let n = c.check_in().expect("check in");
    assert!(n == 1 || n == 2, "check-in count {n}");
    assert_eq!(c.get("py_key", t).expect("get"), b"from python");
    let id = c
        .get(&prefixed(&["g", "g/", "cuda/"], "0"), t)
        .expect("prefixed get");
    assert_eq!(id, (0u8..128).collect::<Vec<u8>>());
    c.set("rs_key", b"from rust \x00\xff").expect("set");
    assert_eq!(c.add("counter", 3).expect("add"), 3);
    c.set("rs_added", b"").expect("set");
    assert_eq!(c.get("py_counter", t).expect("get"), b"7");
    // add stores decimal text, as torch's does.
    assert_eq!(c.get("counter", t).expect("get"), b"7");
    assert!(c.check(&["py_key", "rs_key"]).expect("check"));
    assert!(!c.check(&["absent"]).expect("check"));
    let e = c.get("absent", Duration::from_millis(300)).unwrap_err();
    assert!(e.to_string().contains("\"absent\""), "{e}");
    // The wait was withdrawn cleanly: the connection goes on.
    c.set("rs_done", b"1").expect("set after a timed-out wait");
    line.clear();
    out.read_line(&mut line).expect("read the verdict");
    let status = py.wait().expect("python exit");
    assert!(
        status.success() && line.trim() == "OK",
        "python: {status} {line:?}"
    );
    std::io::stderr().flush().ok();
}

#[test]
fn set_get_add_both_ways_with_torchs_libuv_server() {
    against_torch("libuv");
}

#[test]
fn set_get_add_both_ways_with_torchs_legacy_server() {
    against_torch("legacy");
}
