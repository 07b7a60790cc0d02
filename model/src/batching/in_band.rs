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
//! reads the opcodes `pickle.dumps` writes for exactly that shape (protocols 2 to 5) and
//! refuses anything else, naming the first opcode, global or value it does not take. The
//! only globals it knows are `torch.Size` and torch's dtypes, as names.
//!
//! [`receive`] runs the order above against any source of broadcasts, so the CPU tests
//! drive it with the bytes a real trainer's calls produce; the GPU rank passes its NCCL
//! group. A broadcast is a byte copy in NCCL (it counts bytes whatever the type), so
//! each one is received as the bytes the trainer's tensor holds.

use std::ops::Range;

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

#[derive(Debug, Clone, PartialEq)]
enum V {
    Str(String),
    Int(i128),
    Global(String, String),
    Size(Vec<i128>),
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    Mark,
}

/// A memo slot: a copy of an immutable value, or a container (never read back in the
/// shape prime-rl pickles, so a GET of one is refused rather than aliased).
#[derive(Debug, Clone)]
enum Memo {
    Value(V),
    Container,
}

fn take<'a>(b: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], String> {
    let end = at
        .checked_add(n)
        .filter(|&e| e <= b.len())
        .ok_or_else(|| format!("truncated at byte {at} (wants {n} more)"))?;
    let s = &b[*at..end];
    *at = end;
    Ok(s)
}

fn le(s: &[u8]) -> u64 {
    s.iter()
        .rev()
        .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

fn text(s: &[u8]) -> Result<String, String> {
    String::from_utf8(s.to_vec()).map_err(|_| "a string that is not UTF-8".to_string())
}

fn pop(stack: &mut Vec<V>, op: &str) -> Result<V, String> {
    match stack.pop() {
        Some(V::Mark) | None => Err(format!("opcode {op} without a value to take")),
        Some(v) => Ok(v),
    }
}

/// The values above the topmost MARK, which is removed.
fn pop_mark(stack: &mut Vec<V>, op: &str) -> Result<Vec<V>, String> {
    let m = stack
        .iter()
        .rposition(|v| *v == V::Mark)
        .ok_or_else(|| format!("opcode {op} without a MARK"))?;
    let items = stack.split_off(m + 1);
    stack.pop();
    Ok(items)
}

fn push_items(target: &mut V, items: Vec<V>, op: &str) -> Result<(), String> {
    match target {
        V::List(l) => {
            l.extend(items);
            Ok(())
        }
        _ => Err(format!("opcode {op} on something that is not a list")),
    }
}

fn set_items(target: &mut V, items: Vec<V>, op: &str) -> Result<(), String> {
    let V::Dict(d) = target else {
        return Err(format!("opcode {op} on something that is not a dict"));
    };
    if !items.len().is_multiple_of(2) {
        return Err(format!("opcode {op} with an odd number of values"));
    }
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        d.push((k, v));
    }
    Ok(())
}

/// The global `module.name`, if the metadata may name it.
fn global(module: String, name: String) -> Result<V, String> {
    if module == "torch" && (name == "Size" || torch_dtype(&name).is_some()) {
        Ok(V::Global(module, name))
    } else {
        Err(format!(
            "the global {module}.{name}: the metadata names only torch.Size and torch's dtypes"
        ))
    }
}

/// The value of a pickle of the shape prime-rl's trainer writes, or what is wrong.
fn unpickle(b: &[u8]) -> Result<V, String> {
    let mut at = 0usize;
    let mut stack: Vec<V> = Vec::new();
    let mut memo: Vec<Memo> = Vec::new();
    match take(b, &mut at, 2)? {
        [0x80, 2..=5] => {}
        other => {
            return Err(format!(
                "starts with {other:02x?}, not a pickle of protocol 2 to 5"
            ))
        }
    }
    let memo_put = |memo: &mut Vec<Memo>, idx: usize, v: &V| -> Result<(), String> {
        if idx > memo.len() {
            return Err(format!(
                "memo slot {idx} written before slot {}",
                memo.len()
            ));
        }
        let slot = match v {
            V::List(_) | V::Dict(_) => Memo::Container,
            V::Mark => return Err("a MARK memoized".into()),
            other => Memo::Value(other.clone()),
        };
        if idx == memo.len() {
            memo.push(slot);
        } else {
            memo[idx] = slot;
        }
        Ok(())
    };
    let memo_get = |memo: &[Memo], idx: usize| -> Result<V, String> {
        match memo.get(idx) {
            Some(Memo::Value(v)) => Ok(v.clone()),
            Some(Memo::Container) => Err(format!(
                "memo slot {idx} is a list or dict read back: the metadata shares no container"
            )),
            None => Err(format!("memo slot {idx} read before it was written")),
        }
    };
    loop {
        let pos = at;
        let op = take(b, &mut at, 1)?[0];
        match op {
            // FRAME: the length of what follows; nothing to check.
            0x95 => {
                take(b, &mut at, 8)?;
            }
            // MEMOIZE, BINPUT, LONG_BINPUT.
            0x94 | b'q' | b'r' => {
                let idx = match op {
                    0x94 => memo.len(),
                    b'q' => le(take(b, &mut at, 1)?) as usize,
                    _ => le(take(b, &mut at, 4)?) as usize,
                };
                let top = stack.last().ok_or("a memo put on an empty stack")?;
                memo_put(&mut memo, idx, top)?;
            }
            // BINGET, LONG_BINGET.
            b'h' | b'j' => {
                let n = if op == b'h' { 1 } else { 4 };
                let idx = le(take(b, &mut at, n)?) as usize;
                stack.push(memo_get(&memo, idx)?);
            }
            // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8.
            0x8c | b'X' | 0x8d => {
                let w = match op {
                    0x8c => 1,
                    b'X' => 4,
                    _ => 8,
                };
                let n = usize::try_from(le(take(b, &mut at, w)?))
                    .map_err(|_| "a string longer than memory".to_string())?;
                stack.push(V::Str(text(take(b, &mut at, n)?)?));
            }
            // GLOBAL "module\nname\n".
            b'c' => {
                let mut parts = [String::new(), String::new()];
                for p in &mut parts {
                    let rest = &b[at..];
                    let nl = rest
                        .iter()
                        .position(|&c| c == b'\n')
                        .ok_or("GLOBAL without its newline")?;
                    *p = text(&rest[..nl])?;
                    at += nl + 1;
                }
                let [m, n] = parts;
                stack.push(global(m, n)?);
            }
            // STACK_GLOBAL.
            0x93 => {
                let name = pop(&mut stack, "STACK_GLOBAL")?;
                let module = pop(&mut stack, "STACK_GLOBAL")?;
                match (module, name) {
                    (V::Str(m), V::Str(n)) => stack.push(global(m, n)?),
                    _ => return Err("STACK_GLOBAL of values that are not strings".into()),
                }
            }
            // BININT1, BININT2 (unsigned), BININT (signed 32 bits).
            b'K' => stack.push(V::Int(i128::from(take(b, &mut at, 1)?[0]))),
            b'M' => stack.push(V::Int(le(take(b, &mut at, 2)?) as i128)),
            b'J' => stack.push(V::Int(i128::from(le(take(b, &mut at, 4)?) as u32 as i32))),
            // LONG1: a little-endian two's complement of n bytes (numels past 2^31).
            0x8a => {
                let n = take(b, &mut at, 1)?[0] as usize;
                if n > 8 {
                    return Err(format!("an integer of {n} bytes"));
                }
                let s = take(b, &mut at, n)?;
                let mut v = le(s) as i128;
                if n > 0 && s[n - 1] & 0x80 != 0 {
                    v -= 1i128 << (8 * n);
                }
                stack.push(V::Int(v));
            }
            b'(' => stack.push(V::Mark),
            b'}' => stack.push(V::Dict(Vec::new())),
            b']' => stack.push(V::List(Vec::new())),
            b')' => stack.push(V::Tuple(Vec::new())),
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack, "TUPLE1-3")?);
                }
                items.reverse();
                stack.push(V::Tuple(items));
            }
            b't' => {
                let items = pop_mark(&mut stack, "TUPLE")?;
                stack.push(V::Tuple(items));
            }
            b'l' => {
                let items = pop_mark(&mut stack, "LIST")?;
                stack.push(V::List(items));
            }
            b'a' => {
                let v = pop(&mut stack, "APPEND")?;
                let l = stack.last_mut().ok_or("APPEND on an empty stack")?;
                push_items(l, vec![v], "APPEND")?;
            }
            b'e' => {
                let items = pop_mark(&mut stack, "APPENDS")?;
                let l = stack.last_mut().ok_or("APPENDS on an empty stack")?;
                push_items(l, items, "APPENDS")?;
            }
            b's' => {
                let v = pop(&mut stack, "SETITEM")?;
                let k = pop(&mut stack, "SETITEM")?;
                let d = stack.last_mut().ok_or("SETITEM on an empty stack")?;
                set_items(d, vec![k, v], "SETITEM")?;
            }
            b'u' => {
                let items = pop_mark(&mut stack, "SETITEMS")?;
                let d = stack.last_mut().ok_or("SETITEMS on an empty stack")?;
                set_items(d, items, "SETITEMS")?;
            }
            // REDUCE: only torch.Size(tuple of ints), as a torch.Size pickles.
            b'R' => {
                let args = pop(&mut stack, "REDUCE")?;
                let f = pop(&mut stack, "REDUCE")?;
                match (&f, &args) {
                    (V::Global(m, n), V::Tuple(a)) if m == "torch" && n == "Size" => {
                        let dims = match a.as_slice() {
                            [V::Tuple(d)] | [V::List(d)] => d
                                .iter()
                                .map(|x| match x {
                                    V::Int(i) => Ok(*i),
                                    other => Err(format!("a torch.Size holding {other:?}")),
                                })
                                .collect::<Result<Vec<_>, _>>()?,
                            _ => return Err(format!("torch.Size called with {args:?}")),
                        };
                        stack.push(V::Size(dims));
                    }
                    _ => {
                        return Err(format!(
                            "REDUCE of {f:?} at byte {pos}: the metadata calls only torch.Size"
                        ))
                    }
                }
            }
            b'.' => {
                let top = pop(&mut stack, "STOP")?;
                if !stack.is_empty() {
                    return Err("STOP with more than one value on the stack".into());
                }
                if at != b.len() {
                    return Err(format!("{} bytes after STOP", b.len() - at));
                }
                return Ok(top);
            }
            other => {
                return Err(format!(
                    "opcode {other:#04x} at byte {pos}, which prime-rl's metadata does not hold"
                ))
            }
        }
    }
}

fn count(v: i128, what: &str, name: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("tensor {name:?}: {what} {v}"))
}

/// The dtype groups of one state dict's metadata: `pickle.dumps` of
/// `{torch.dtype: [(name, torch.Size, numel), ...]}`, as prime-rl's `broadcast_state_dict`
/// builds it. Every numel must be its shape's product.
pub fn parse_metadata(b: &[u8]) -> Result<Vec<Group>, String> {
    let V::Dict(items) = unpickle(b)? else {
        return Err("the pickled value is not a dict".into());
    };
    let mut out = Vec::with_capacity(items.len());
    for (k, v) in items {
        let dtype = match &k {
            V::Global(m, n) if m == "torch" => {
                torch_dtype(n).ok_or_else(|| format!("the key torch.{n} is not a dtype"))?
            }
            other => return Err(format!("a key {other:?}, not a torch dtype")),
        };
        if out.iter().any(|g: &Group| g.dtype == dtype) {
            return Err(format!("torch.{} twice", dtype.name));
        }
        let V::List(list) = v else {
            return Err(format!("torch.{}'s value is not a list", dtype.name));
        };
        let mut entries = Vec::with_capacity(list.len());
        for e in list {
            let (name, dims, numel) = match e {
                V::Tuple(t) => match <[V; 3]>::try_from(t) {
                    Ok([V::Str(name), V::Size(dims), V::Int(numel)]) => (name, dims, numel),
                    Ok(other) => {
                        return Err(format!("an entry {other:?}, not (name, torch.Size, numel)"))
                    }
                    Err(t) => return Err(format!("an entry of {} values, not 3", t.len())),
                },
                other => return Err(format!("an entry {other:?}, not a tuple")),
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
