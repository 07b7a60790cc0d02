//! The NCCL unique id as vLLM's `StatelessProcessGroup.broadcast_obj` publishes it: the
//! `ncclUniqueId` ctypes struct of `pynccl_wrapper` (`internal: c_byte * 128`),
//! `pickle.dumps`-ed. A ctypes struct pickles as `_ctypes._unpickle(cls, ({}, raw))`.
//!
//! Nothing here runs a pickle: the restricted reader ([`crate::pickle`]) reads it with
//! only those two globals allowed, and this takes exactly that shape (protocols 3 to 5, as
//! Python's `pickle.dumps` writes them), naming what else it found.

use crate::pickle::{self, Value};

/// The globals a pickled id may name: `_ctypes._unpickle`, and the struct's class.
const UNPICKLE: (&str, &str) = ("_ctypes", "_unpickle");
const CLASS: &str = "ncclUniqueId";
/// vLLM's module, and the forks of it that keep the name (SGLang's).
const MODULE_SUFFIX: &str = "pynccl_wrapper";

/// The most bytes a pickled id may take (it takes ~240).
const MAX_LEN: usize = 4096;

fn id_global(module: &str, name: &str) -> bool {
    (module, name) == UNPICKLE
        || (name == CLASS
            && (module == MODULE_SUFFIX || module.ends_with(&format!(".{MODULE_SUFFIX}"))))
}

/// The 128 bytes of a pickled vLLM `ncclUniqueId`, or what is wrong with `b`.
pub fn nccl_id_from_pickle(b: &[u8]) -> Result<[u8; 128], String> {
    if b.len() > MAX_LEN {
        return Err(format!(
            "{} bytes, more than a pickled ncclUniqueId",
            b.len()
        ));
    }
    // Protocol 2 writes the bytes as a call of `_codecs.encode`, which this shape excludes.
    if !matches!(pickle::protocol(b), Some(3..=5)) {
        return Err(format!(
            "starts with {:02x?}, not a pickle of protocol 3 to 5",
            &b[..b.len().min(2)]
        ));
    }
    let result = pickle::read(b, &id_global, pickle::Limits::new(MAX_LEN)).map_err(|e| {
        if e.0.contains("not allowed") {
            format!("not the pickle of a ncclUniqueId: {e}")
        } else {
            e.0
        }
    })?;
    let shape = || {
        format!("not the pickle of a ncclUniqueId (_ctypes._unpickle(ncclUniqueId, ({{}}, 128 bytes))): {}", result.kind())
    };
    let Value::Reduce(f, args) = &result else {
        return Err(shape());
    };
    if f.global() != Some(UNPICKLE) {
        return Err(shape());
    }
    let Value::Tuple(args) = &**args else {
        return Err(shape());
    };
    match args.as_slice() {
        [Value::Global(_, class), Value::Tuple(state)] if class == CLASS => {
            match state.as_slice() {
                [Value::Dict(d), Value::Bytes(raw)] if d.is_empty() => {
                    <[u8; 128]>::try_from(raw.as_slice())
                        .map_err(|_| format!("the ncclUniqueId holds {} bytes, not 128", raw.len()))
                }
                _ => Err(shape()),
            }
        }
        _ => Err(shape()),
    }
}

/// vLLM's module of the struct, which the trainer's unpickler imports.
pub const VLLM_MODULE: &str = "vllm.distributed.device_communicators.pynccl_wrapper";

/// `pickle.dumps(id)` of a `ncclUniqueId` struct of `module` holding `id`, as
/// `PyNcclCommunicator`'s rank 0 publishes it (protocol 4, without the optional framing):
/// what [`nccl_id_from_pickle`] reads.
pub fn nccl_id_to_pickle(id: &[u8; 128], module: &str) -> Vec<u8> {
    let mut b = vec![0x80, 4];
    let short_str = |b: &mut Vec<u8>, s: &str| {
        // SHORT_BINUNICODE; the names here are far below 256 bytes.
        b.push(0x8c);
        b.push(s.len().min(255) as u8);
        b.extend_from_slice(&s.as_bytes()[..s.len().min(255)]);
    };
    short_str(&mut b, UNPICKLE.0);
    short_str(&mut b, UNPICKLE.1);
    b.push(0x93);
    short_str(&mut b, module);
    short_str(&mut b, CLASS);
    b.push(0x93);
    b.push(b'}');
    // SHORT_BINBYTES of the 128 bytes.
    b.push(b'C');
    b.push(128);
    b.extend_from_slice(id);
    b.extend_from_slice(&[0x86, 0x86, b'R', b'.']);
    b
}

/// `pickle.dumps(s)` of a Python `str` (protocol 4), as `broadcast_obj` publishes one.
pub fn str_to_pickle(s: &str) -> Vec<u8> {
    let mut b = vec![0x80, 4];
    if s.len() < 256 {
        b.push(0x8c);
        b.push(s.len() as u8);
    } else {
        b.push(b'X');
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    }
    b.extend_from_slice(s.as_bytes());
    b.push(b'.');
    b
}

/// The `str` of a pickle Python wrote of one (protocols 2 to 5), or what is wrong.
pub fn str_from_pickle(b: &[u8]) -> Result<String, String> {
    if b.len() > MAX_LEN {
        return Err(format!("{} bytes, more than a pickled barrier id", b.len()));
    }
    let no_globals = |_: &str, _: &str| false;
    match pickle::read(b, &no_globals, pickle::Limits::new(MAX_LEN)).map_err(|e| e.0)? {
        Value::Str(s) => Ok(s),
        other => Err(format!("{}, not a pickled str", other.kind())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// `pickle.dumps(ncclUniqueId(internal=[255 - i for i in range(128)]), protocol=p)`
    /// with the struct imported from `vllm.distributed.device_communicators.pynccl_wrapper`
    /// (CPython 3.11).
    const ID: &str = "fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0efeeedecebeae9e8e7e6e5e4e3e2e1e0dfdedddcdbdad9d8d7d6d5d4d3d2d1d0cfcecdcccbcac9c8c7c6c5c4c3c2c1c0bfbebdbcbbbab9b8b7b6b5b4b3b2b1b0afaeadacabaaa9a8a7a6a5a4a3a2a1a09f9e9d9c9b9a999897969594939291908f8e8d8c8b8a898887868584838281 80";

    fn id_hex() -> String {
        ID.replace(' ', "")
    }

    fn protocol_4() -> Vec<u8> {
        hex(&format!("800495ec000000000000008c075f637479706573948c095f756e7069636b6c659493948c34766c6c6d2e64697374726962757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f77726170706572948c0c6e63636c556e6971756549649493947d944380{}948694869452942e", id_hex()))
    }

    fn want() -> [u8; 128] {
        std::array::from_fn(|i| 255 - i as u8)
    }

    #[test]
    fn reads_the_ids_python_pickles() {
        assert_eq!(nccl_id_from_pickle(&protocol_4()).unwrap(), want());
        let p5 = {
            let mut p = protocol_4();
            p[1] = 5;
            p
        };
        assert_eq!(nccl_id_from_pickle(&p5).unwrap(), want());
        let p3 = hex(&format!("8003635f6374797065730a5f756e7069636b6c650a710063766c6c6d2e64697374726962757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f777261707065720a6e63636c556e6971756549640a71017d71024380{}71038671048671055271062e", id_hex()));
        assert_eq!(nccl_id_from_pickle(&p3).unwrap(), want());
    }

    #[test]
    fn writes_what_python_writes_less_the_framing() {
        let w = nccl_id_to_pickle(&want(), VLLM_MODULE);
        assert_eq!(nccl_id_from_pickle(&w).unwrap(), want());
        // Python's protocol-4 pickle less its FRAME (9 bytes) and MEMOIZEs (0x94).
        let mut py = protocol_4();
        py.drain(2..11);
        let mut i = 0;
        let mut plain = Vec::new();
        // The 128 id bytes hold 0x94 too: skip the memo opcodes only outside them.
        let id_at = py.windows(2).position(|p| p == [0x43, 0x80]).unwrap();
        while i < py.len() {
            if py[i] == 0x94 && !(id_at + 2..id_at + 130).contains(&i) {
                i += 1;
                continue;
            }
            plain.push(py[i]);
            i += 1;
        }
        assert_eq!(w, plain);
        assert_eq!(
            str_from_pickle(&str_to_pickle("barrier_x")).unwrap(),
            "barrier_x"
        );
        let long = "b".repeat(300);
        assert_eq!(str_from_pickle(&str_to_pickle(&long)).unwrap(), long);
        // pickle.dumps("barrier_1", protocol=4) (CPython 3.11).
        let py4 = hex("8004950d000000000000008c09626172726965725f31942e");
        assert_eq!(str_from_pickle(&py4).unwrap(), "barrier_1");
        assert!(str_from_pickle(&w).is_err());
    }

    #[test]
    fn refuses_every_other_shape() {
        let good = protocol_4();
        let swap = |from: &[u8], to: &[u8]| {
            let i = good
                .windows(from.len())
                .position(|w| w == from)
                .expect("pattern");
            let mut b = good[..i].to_vec();
            b.extend_from_slice(to);
            b.extend_from_slice(&good[i + from.len()..]);
            b
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            // Another callable than _ctypes._unpickle (same length, so the frame holds).
            (swap(b"\x09_unpickle", b"\x09_evilfunc"), "not the pickle"),
            // Another class.
            (
                swap(b"\x0cncclUniqueId", b"\x0cncclOtherIds"),
                "not the pickle",
            ),
            (swap(b"pynccl_wrapper", b"pynccl_wrappez"), "not the pickle"),
            // An opcode the shape does not hold (BINGET in place of a MEMOIZE).
            (swap(b"\x7d\x94", b"\x7d\x68"), "opcode 0x68"),
            // Protocol 2 (`_codecs.encode` of a latin-1 string for the bytes).
            (swap(b"\x80\x04", b"\x80\x02"), "protocol 3 to 5"),
            (good[..good.len() - 1].to_vec(), "truncated"),
            ([good.clone(), vec![0]].concat(), "after STOP"),
            // 127 bytes: the last id byte (0x80) is then read as an opcode.
            (swap(b"\x43\x80", b"\x43\x7f"), "opcode 0x80"),
        ];
        for (b, want) in cases {
            let e = nccl_id_from_pickle(&b).unwrap_err();
            assert!(e.contains(want), "{want:?} in {e}");
        }
        assert!(nccl_id_from_pickle(&vec![0x80; 5000])
            .unwrap_err()
            .contains("bytes"));
    }
}
