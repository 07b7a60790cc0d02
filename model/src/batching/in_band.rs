//! prime-rl's NCCL weight broadcast, whose tensor list travels in band
//! (`src/prime_rl/transports/weights/nccl.py` sends, `src/prime_rl/inference/vllm/worker/nccl.py`
//! receives). Over the group, from the trainer at rank 0, in this order:
//!
//! 1. one `int64`: how many state dicts follow (the non-layer weights, then one per layer);
//! 2. per state dict: one `int64`, the length of its metadata; the metadata, a `uint8`
//!    tensor holding `pickle.dumps({torch.dtype: [(name, torch.Size, numel), ...]})`;
//!    then per dtype, in the dict's order, one tensor of that dtype with every listed
//!    tensor flattened and laid end to end.
//!
//! The metadata comes from the network, so nothing here runs a pickle: [`parse_metadata`]
//! reads it with arbor's restricted reader ([`arbor_collective::pickle`], protocols 2 to
//! 5) and takes exactly that shape, naming the first opcode, global or value it does not
//! take. The only globals it allows are `torch.Size` and torch's dtypes, as names.
//!
//! [`receive`] runs the order above against any source of broadcasts, so the CPU tests
//! drive it with the bytes a real trainer's calls produce; the GPU rank passes its NCCL
//! group. A broadcast is a byte copy in NCCL (it counts bytes whatever the type), so
//! each one is received as the bytes the trainer's tensor holds.

use std::ops::Range;

use arbor_collective::pickle::{self, Limits, Value};

use crate::safetensors::{DType, PackedPart};

/// The most bytes one state dict's metadata may take (a pickle of names and shapes).
pub const MAX_METADATA_BYTES: usize = 64 << 20;
/// The most state dicts one update may announce (the model's layers plus one).
pub const MAX_STATE_DICTS: i64 = 1 << 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InBandError<E: std::fmt::Display> {
    #[error("receiving {what} from the trainer: {cause}")]
    Receive { what: String, cause: E },
    #[error("the trainer announced {0} state dicts: expected 1 to {max}", max = MAX_STATE_DICTS)]
    Count(i64),
    #[error("state dict {dict}: the trainer announced {len} bytes of metadata: expected 1 to {max}", max = MAX_METADATA_BYTES)]
    MetadataLen { dict: usize, len: i64 },
    #[error("state dict {dict}: its metadata is not the pickle prime-rl sends ({{torch.dtype: [(name, torch.Size, numel)]}}): {msg}")]
    Metadata { dict: usize, msg: String },
    #[error("state dict {dict}: {dtype} tensors of {elements} elements ({bytes:?} bytes) are more than one update may hold ({max} bytes)")]
    TooLarge {
        dict: usize,
        dtype: String,
        elements: u64,
        bytes: Option<u64>,
        max: usize,
    },
    #[error("reading {what} on the host: {msg}")]
    Read { what: String, msg: String },
    #[error("the broadcast of {what} brought {got} bytes, not {want}")]
    Length {
        what: String,
        got: usize,
        want: usize,
    },
}

/// A tensor type as the metadata names it (`torch.bfloat16` pickles as the global
/// `torch bfloat16`): its element size, and arbor's type when arbor stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchDtype {
    pub name: &'static str,
    pub size: usize,
    pub dtype: Option<DType>,
}

/// torch's dtypes a state dict may hold. Those arbor does not store are still received
/// whole (a trainer's broadcast must never wait on a refusal) and refused at staging.
const TORCH_DTYPES: &[(&str, usize, Option<DType>)] = &[
    ("bfloat16", 2, Some(DType::BF16)),
    ("float16", 2, Some(DType::F16)),
    ("float32", 4, Some(DType::F32)),
    ("float64", 8, None),
    ("int64", 8, None),
    ("int32", 4, None),
    ("int16", 2, None),
    ("int8", 1, None),
    ("uint8", 1, None),
    ("bool", 1, None),
    ("float8_e4m3fn", 1, None),
    ("float8_e5m2", 1, None),
];

fn torch_dtype(name: &str) -> Option<TorchDtype> {
    TORCH_DTYPES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(name, size, dtype)| TorchDtype { name, size, dtype })
}

/// One entry of the metadata: `(name, torch.Size, numel)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub numel: usize,
}

/// The tensors of one dtype, in the order the trainer concatenates them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub dtype: TorchDtype,
    pub entries: Vec<Entry>,
}

impl Group {
    /// The elements of the concatenated broadcast.
    pub fn elements(&self) -> u64 {
        self.entries.iter().map(|e| e.numel as u64).sum()
    }
}

/// The globals the metadata may name: `torch.Size` and torch's dtypes, as names.
fn allowed(module: &str, name: &str) -> bool {
    module == "torch" && (name == "Size" || torch_dtype(name).is_some())
}

fn count(v: i64, what: &str, name: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("tensor {name:?}: {what} {v}"))
}

/// The dimensions of a `torch.Size`, which pickles as `torch.Size((d0, d1, ...))`.
fn size(v: &Value) -> Option<Vec<i64>> {
    let Value::Reduce(f, args) = v else {
        return None;
    };
    if f.global() != Some(("torch", "Size")) {
        return None;
    }
    let Value::Tuple(a) = &**args else {
        return None;
    };
    let ([Value::Tuple(d)] | [Value::List(d)]) = a.as_slice() else {
        return None;
    };
    d.iter()
        .map(|x| match x {
            Value::Int(i) => Some(*i),
            _ => None,
        })
        .collect()
}

/// The dtype groups of one state dict's metadata: `pickle.dumps` of
/// `{torch.dtype: [(name, torch.Size, numel), ...]}`, as prime-rl's `broadcast_state_dict`
/// builds it. Every numel must be its shape's product.
pub fn parse_metadata(b: &[u8]) -> Result<Vec<Group>, String> {
    // Every tensor's entry is about ten values; a state dict is a layer's tensors.
    let limits = Limits {
        max_values: 1 << 22,
        ..Limits::new(MAX_METADATA_BYTES)
    };
    let v = pickle::read(b, &allowed, limits).map_err(|e| e.to_string())?;
    let Value::Dict(items) = v else {
        return Err(format!("the pickled value is {}, not a dict", v.kind()));
    };
    let mut out = Vec::with_capacity(items.len());
    for (k, v) in items {
        let dtype = match k.global() {
            Some(("torch", n)) => {
                torch_dtype(n).ok_or_else(|| format!("the key torch.{n} is not a dtype"))?
            }
            _ => return Err(format!("a key {}, not a torch dtype", k.kind())),
        };
        if out.iter().any(|g: &Group| g.dtype == dtype) {
            return Err(format!("torch.{} twice", dtype.name));
        }
        let Value::List(list) = v else {
            return Err(format!(
                "torch.{}'s value is {}, not a list",
                dtype.name,
                v.kind()
            ));
        };
        let mut entries = Vec::with_capacity(list.len());
        for e in list {
            let (name, dims, numel) = match e {
                Value::Tuple(t) => match <[Value; 3]>::try_from(t) {
                    Ok([Value::Str(name), dims, Value::Int(numel)]) => match size(&dims) {
                        Some(dims) => (name, dims, numel),
                        None => {
                            return Err(format!(
                                "tensor {name:?}: a shape of {}, not a torch.Size of ints",
                                dims.kind()
                            ))
                        }
                    },
                    Ok([a, b, c]) => {
                        return Err(format!(
                            "an entry ({}, {}, {}), not (name, torch.Size, numel)",
                            a.kind(),
                            b.kind(),
                            c.kind()
                        ))
                    }
                    Err(t) => return Err(format!("an entry of {} values, not 3", t.len())),
                },
                other => return Err(format!("an entry of {}, not a tuple", other.kind())),
            };
            let shape = dims
                .iter()
                .map(|&d| count(d, "has a dimension", &name))
                .collect::<Result<Vec<_>, _>>()?;
            let numel = count(numel, "has numel", &name)?;
            let product = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if product != Some(numel) {
                return Err(format!(
                    "tensor {name:?}: numel {numel} is not the product of its shape {shape:?}"
                ));
            }
            entries.push(Entry { name, shape, numel });
        }
        out.push(Group { dtype, entries });
    }
    Ok(out)
}

/// What the next broadcast carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Broadcast {
    /// One `int64`: the number of state dicts.
    Count,
    /// One `int64`: the length of state dict `dict`'s metadata.
    MetadataLen { dict: usize },
    /// State dict `dict`'s pickled metadata (`uint8`).
    Metadata { dict: usize, len: usize },
    /// The tensors of one dtype of state dict `dict`, concatenated.
    Tensors {
        dict: usize,
        dtype: TorchDtype,
        elements: usize,
    },
}

impl Broadcast {
    /// The bytes the broadcast holds.
    pub fn bytes(&self) -> usize {
        match self {
            Broadcast::Count | Broadcast::MetadataLen { .. } => 8,
            Broadcast::Metadata { len, .. } => *len,
            Broadcast::Tensors {
                dtype, elements, ..
            } => dtype.size * elements,
        }
    }

    /// arbor's type of the broadcast's elements, where arbor has one.
    pub fn dtype(&self) -> Option<DType> {
        match self {
            Broadcast::Tensors { dtype, .. } => dtype.dtype,
            _ => None,
        }
    }

    fn what(&self) -> String {
        match self {
            Broadcast::Count => "the number of state dicts".into(),
            Broadcast::MetadataLen { dict } => format!("state dict {dict}'s metadata length"),
            Broadcast::Metadata { dict, len } => {
                format!("state dict {dict}'s metadata ({len} bytes)")
            }
            Broadcast::Tensors {
                dict,
                dtype,
                elements,
            } => format!(
                "state dict {dict}'s {} tensors ({elements} elements)",
                dtype.name
            ),
        }
    }
}

/// What a broadcast was received into: host bytes, or a backend's device memory (the
/// tensors' broadcasts stay there; the count and the metadata are read on the host).
pub trait Payload {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes on the host.
    fn host(&self) -> Result<Vec<u8>, String>;
}

impl Payload for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn host(&self) -> Result<Vec<u8>, String> {
        Ok(self.clone())
    }
}

impl Payload for std::sync::Arc<dyn crate::backend::DeviceBytes> {
    fn len(&self) -> usize {
        crate::backend::DeviceBytes::len(self.as_ref())
    }

    fn host(&self) -> Result<Vec<u8>, String> {
        self.read(0..Payload::len(self))
    }
}

/// One received dtype group: its broadcast and where each tensor lies in it.
#[derive(Debug)]
pub struct Received<P> {
    pub dtype: TorchDtype,
    pub bytes: P,
    pub tensors: Vec<(Entry, Range<usize>)>,
}

impl<P> Received<P> {
    /// The tensors as parts of one staged buffer, or the first one arbor cannot store.
    pub fn parts(&self) -> Result<Vec<PackedPart>, String> {
        let Some(dtype) = self.dtype.dtype else {
            let first = self.tensors.first().map_or("", |(e, _)| e.name.as_str());
            return Err(format!(
                "tensor {first:?} is torch.{}: arbor takes bfloat16, float16 and float32 weights",
                self.dtype.name
            ));
        };
        Ok(self
            .tensors
            .iter()
            .map(|(e, r)| PackedPart {
                name: e.name.clone(),
                dtype,
                shape: e.shape.clone(),
                data: r.clone(),
            })
            .collect())
    }
}

fn int64(b: &[u8]) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    i64::from_le_bytes(a)
}

/// Receives one update in prime-rl's order from `recv` (which brings the next broadcast's
/// bytes) and returns every dtype group of every state dict. `max_bytes` bounds each
/// concatenated broadcast. A metadata that does not parse ends it: what follows cannot be
/// known (the trainer's next broadcast then never completes, as with vLLM's own receiver).
pub fn receive<P: Payload, E: std::fmt::Display>(
    mut recv: impl FnMut(&Broadcast) -> Result<P, E>,
    max_bytes: usize,
) -> Result<Vec<Received<P>>, InBandError<E>> {
    let mut get = |w: Broadcast| -> Result<P, InBandError<E>> {
        let data = recv(&w).map_err(|cause| InBandError::Receive {
            what: w.what(),
            cause,
        })?;
        if data.len() != w.bytes() {
            return Err(InBandError::Length {
                what: w.what(),
                got: data.len(),
                want: w.bytes(),
            });
        }
        Ok(data)
    };
    let host = |w: Broadcast, p: P| -> Result<Vec<u8>, InBandError<E>> {
        p.host().map_err(|msg| InBandError::Read {
            what: w.what(),
            msg,
        })
    };
    let n = int64(&host(Broadcast::Count, get(Broadcast::Count)?)?);
    if !(1..=MAX_STATE_DICTS).contains(&n) {
        return Err(InBandError::Count(n));
    }
    let mut out = Vec::new();
    for dict in 0..n as usize {
        let len = int64(&host(
            Broadcast::MetadataLen { dict },
            get(Broadcast::MetadataLen { dict })?,
        )?);
        if len < 1 || len as u64 > MAX_METADATA_BYTES as u64 {
            return Err(InBandError::MetadataLen { dict, len });
        }
        let what = Broadcast::Metadata {
            dict,
            len: len as usize,
        };
        let meta = host(what.clone(), get(what)?)?;
        let groups = parse_metadata(&meta).map_err(|msg| InBandError::Metadata { dict, msg })?;
        for g in groups {
            let elements = g.elements();
            let bytes = elements.checked_mul(g.dtype.size as u64);
            if bytes.is_none_or(|b| b > max_bytes as u64) {
                return Err(InBandError::TooLarge {
                    dict,
                    dtype: g.dtype.name.into(),
                    elements,
                    bytes,
                    max: max_bytes,
                });
            }
            let data = get(Broadcast::Tensors {
                dict,
                dtype: g.dtype,
                elements: elements as usize,
            })?;
            let mut at = 0usize;
            let tensors = g
                .entries
                .into_iter()
                .map(|e| {
                    let end = at + e.numel * g.dtype.size;
                    let r = at..end;
                    at = end;
                    (e, r)
                })
                .collect();
            out.push(Received {
                dtype: g.dtype,
                bytes: data,
                tensors,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_the_metadata_never_holds() {
        // os.system, the classic: STACK_GLOBAL of a module other than torch.
        let evil = b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R.";
        let e = parse_metadata(evil).unwrap_err();
        assert!(e.contains("the global os.system"), "{e}");
        // torch.load is a torch global, but not one the metadata names.
        let e = parse_metadata(b"\x80\x04\x8c\x05torch\x8c\x04load\x93.").unwrap_err();
        assert!(e.contains("torch.load"), "{e}");
        // Not a pickle at all.
        assert!(parse_metadata(b"{}").unwrap_err().contains("protocol"));
        // A dict of the right shape whose numel disagrees with the shape.
        let bad = b"\x80\x04}(\x8c\x05torch\x8c\x07float32\x93](\x8c\x01x\x8c\x05torch\x8c\x04Size\x93K\x02\x85\x85RK\x03\x87eu.";
        let e = parse_metadata(bad).unwrap_err();
        assert!(e.contains("numel 3 is not the product"), "{e}");
        let good = b"\x80\x04}(\x8c\x05torch\x8c\x07float32\x93](\x8c\x01x\x8c\x05torch\x8c\x04Size\x93K\x02\x85\x85RK\x02\x87eu.";
        let e = parse_metadata(&good[..good.len() - 3]).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        let g = parse_metadata(good).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].dtype.dtype, Some(DType::F32));
        assert_eq!(
            g[0].entries,
            vec![Entry {
                name: "x".into(),
                shape: vec![2],
                numel: 2
            }]
        );
    }

    #[test]
    fn the_order_is_count_then_length_metadata_tensors_per_dict() {
        let good: &[u8] = b"\x80\x04}(\x8c\x05torch\x8c\x07float32\x93](\x8c\x01x\x8c\x05torch\x8c\x04Size\x93K\x02\x85\x85RK\x02\x87eu.";
        let mut script: Vec<Vec<u8>> = vec![
            2i64.to_le_bytes().to_vec(),
            (good.len() as i64).to_le_bytes().to_vec(),
            good.to_vec(),
            [1f32.to_le_bytes(), 2f32.to_le_bytes()].concat(),
            (good.len() as i64).to_le_bytes().to_vec(),
            good.to_vec(),
            [3f32.to_le_bytes(), 4f32.to_le_bytes()].concat(),
        ];
        script.reverse();
        let mut asked = Vec::new();
        let got = receive(
            |w| {
                asked.push(w.clone());
                script.pop().ok_or("no more broadcasts")
            },
            1 << 20,
        )
        .unwrap();
        assert!(script.is_empty());
        assert_eq!(asked.len(), 7);
        assert_eq!(asked[3].dtype(), Some(DType::F32));
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[1].bytes,
            [3f32.to_le_bytes(), 4f32.to_le_bytes()].concat()
        );
        assert_eq!(got[1].parts().unwrap()[0].data, 0..8);
        // A count out of range, and a broadcast bound.
        let e = receive(|_| Ok::<_, String>(0i64.to_le_bytes().to_vec()), 1).unwrap_err();
        assert_eq!(e, InBandError::Count(0));
        let mut s = vec![
            good.to_vec(),
            (good.len() as i64).to_le_bytes().to_vec(),
            1i64.to_le_bytes().to_vec(),
        ];
        let e = receive(|_| s.pop().ok_or("none".to_string()), 7).unwrap_err();
        assert!(matches!(e, InBandError::TooLarge { max: 7, .. }), "{e}");
    }
}
