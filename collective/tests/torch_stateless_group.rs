//! A vLLM `StatelessProcessGroup` whose rank 0 is arbor (TRL's vLLM client puts the
//! trainer at the last rank): arbor runs the group's `TCPStore` and, as its ranks 0 and 1,
//! publishes a NCCL id the way `PyNcclCommunicator`'s rank 0 does and takes part in vLLM's
//! barrier; a Python process is rank 2, doing what TRL's `VLLMClient.init_communicator`
//! and `update_named_param` do on the store with real torch: `StatelessProcessGroup.create`
//! (a `TCPStore` client with `world_size`, `use_libuv=False`), `broadcast_obj(None, src=0)`
//! unpickled into vLLM's `ncclUniqueId` struct, then `group.barrier()` after each of three
//! tensors. Skipped, saying so, where Python has no torch.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use arbor_collective::pickled_id::{nccl_id_to_pickle, VLLM_MODULE};
use arbor_collective::stateless_group::StatelessMember;
use arbor_collective::store_server::StoreServer;
use arbor_collective::tcp_store::StoreClient;

/// The trainer: vLLM's `StatelessProcessGroup` (vllm/distributed/utils.py) as far as the
/// store goes, its methods written out (vLLM is not installed here): `create` for a rank
/// other than 0, `broadcast_obj` as a receiver, and the multi-phase `barrier`.
const TRAINER: &str = r#"
import ctypes, pickle, sys, time, types
from datetime import timedelta
from torch.distributed import TCPStore

port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# vLLM's module path, so that the pickle's global resolves as on a trainer with vLLM.
path = "vllm.distributed.device_communicators.pynccl_wrapper"
parts = path.split(".")
for i in range(1, len(parts) + 1):
    sys.modules[".".join(parts[:i])] = types.ModuleType(".".join(parts[:i]))
class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]
ncclUniqueId.__module__ = path
sys.modules[path].ncclUniqueId = ncclUniqueId

store = TCPStore(host_name="127.0.0.1", port=port, world_size=world, is_master=False,
                 timeout=timedelta(seconds=60), use_libuv=False)
recv = {i: 0 for i in range(world)}
def broadcast_recv(src):
    obj = pickle.loads(store.get(f"broadcast_from/{src}/{recv[src]}"))
    recv[src] += 1
    return obj

uid = broadcast_recv(0)
assert type(uid) is ncclUniqueId, type(uid)
print("ID", bytes(uid.internal).hex(), flush=True)

def barrier(timeout=30.0):
    barrier_id = broadcast_recv(0)
    store.set(f"arrival_{barrier_id}_{rank}", b"1")
    arrived, t0 = set(), time.time()
    while len(arrived) < world:
        assert time.time() - t0 < timeout, "barrier timed out"
        for i in range(world):
            if i not in arrived:
                try:
                    store.get(f"arrival_{barrier_id}_{i}")
                    arrived.add(i)
                except KeyError:
                    pass
    store.set(f"departure_{barrier_id}_{rank}", b"1")
    return barrier_id

for _ in range(3):
    print("BARRIER", barrier(), flush=True)
"#;

#[test]
fn arbor_runs_the_store_and_the_trainer_is_the_last_rank() {
    if let Err(why) = Command::new("python3")
        .args(["-c", "import torch.distributed"])
        .output()
        .map_err(|e| e.to_string())
        .and_then(|o| {
            o.status
                .success()
                .then_some(())
                .ok_or_else(|| String::from_utf8_lossy(&o.stderr).trim().to_string())
        })
    {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(!ci, "CI: python3 with torch is required ({why})");
        eprintln!("SKIPPED: needs python3 with torch ({why})");
        return;
    }
    let server = StoreServer::bind("127.0.0.1", 0).expect("bind");
    let port = server.local_addr().port();
    let world = 3;
    let t = Duration::from_secs(60);
    let id: [u8; 128] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5a);
    let mut py = Command::new("python3")
        .args(["-c", TRAINER, &port.to_string(), "2", &world.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start python3");
    let out = BufReader::new(py.stdout.take().expect("stdout"));
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let mut c = StoreClient::connect("127.0.0.1", port, t).expect("connect");
                c.check_in().expect("check in");
                let mut m = StatelessMember::new(c, r, world);
                if r == 0 {
                    m.broadcast_send(&nccl_id_to_pickle(&id, VLLM_MODULE))
                        .expect("publish the id");
                } else {
                    let v = m.broadcast_recv(0, t).expect("read the id");
                    assert_eq!(
                        arbor_collective::pickled_id::nccl_id_from_pickle(&v).expect("id"),
                        id
                    );
                }
                for _ in 0..3 {
                    m.barrier(t).expect("barrier");
                }
            })
        })
        .collect();
    let lines: Vec<String> = out.lines().map_while(Result::ok).collect();
    for h in ranks {
        h.join().expect("an arbor rank");
    }
    let status = py.wait().expect("python exit");
    assert!(status.success(), "python: {status}: {lines:?}");
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(lines.first(), Some(&format!("ID {hex}")), "{lines:?}");
    let barriers: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.strip_prefix("BARRIER barrier_").expect("a barrier line"))
        .collect();
    assert_eq!(barriers.len(), 3, "{lines:?}");
    assert!(barriers.iter().all(|u| u.len() == 36), "{barriers:?}");
    assert!(barriers[0] != barriers[1] && barriers[1] != barriers[2]);
    // Rank 0 deleted every barrier's keys: the four broadcasts and the check-ins remain.
    assert_eq!(server.len(), 4 + 1, "keys left in the store");
}
