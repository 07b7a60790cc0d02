//! Tensors a trainer on the same GPU hands over by CUDA IPC handle (SGLang's
//! `update_weights_from_tensor` with `serialized_named_tensors`, as slime and verl send it
//! in colocated mode): what one rank's element says, read from its pickle.
//!
//! Each element is what SGLang's `MultiprocessingSerializer.serialize` writes: a
//! `multiprocessing.reduction.ForkingPickler` dump of either a list of `(name, tensor)`
//! pairs, or (`load_format: "flattened_bucket"`) a dict `{"flattened_tensor": tensor,
//! "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`
//! (sglang `python/sglang/srt/weight_sync/tensor_bucket.py`). A CUDA tensor pickles as
//! torch's reduction (`torch/multiprocessing/reductions.py` `reduce_tensor`):
//! `rebuild_cuda_tensor(tensor_cls, size, stride, tensor_offset, storage_cls, dtype,
//! device, handle, storage_size_bytes, storage_offset_bytes, requires_grad,
//! ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)`. SGLang's
//! patch (`python/sglang/srt/patch_torch.py`, `monkey_patch_torch_reductions`, which slime
//! and verl apply) names `_rebuild_cuda_tensor_modified` instead and gives the device as
//! the GPU's UUID string at index 6: older versions insert it before the index (16
//! arguments), newer ones replace the index (15).
//!
//! Nothing is unpickled: the restricted reader ([`arbor_collective::pickle`]) reads the
//! tree with only these globals allowed, and this takes exactly the shapes above.

use arbor_collective::pickle::{self, Limits, Value};
use serde::{Deserialize, Serialize};

use crate::safetensors::DType;

/// The most bytes one rank's pickle may take (a handle per tensor: a few hundred bytes
/// each).
pub const MAX_PICKLE_BYTES: usize = 64 << 20;

/// Which GPU a handle's memory lives on, as the trainer named it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpcDevice {
    /// torch's device index, in the trainer's numbering (its `CUDA_VISIBLE_DEVICES`).
    Index(u32),
    /// The GPU's UUID (`str(torch.cuda.get_device_properties(i).uuid)`), SGLang's patch.
    Uuid(String),
}

impl std::fmt::Display for IpcDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IpcDevice::Index(i) => write!(f, "cuda:{i}"),
            IpcDevice::Uuid(u) => write!(f, "{u}"),
        }
    }
}

/// One CUDA allocation a trainer shares (`cudaIpcMemHandle_t`) and where in it a
/// tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcBuffer {
    pub device: IpcDevice,
    /// The 64-byte `cudaIpcMemHandle_t` of the allocation.
    pub handle: Vec<u8>,
    /// Where the bytes start in the allocation (the storage's offset plus the tensor's).
    pub offset: u64,
    /// How many bytes the tensors take.
    pub len: u64,
    /// The 64-byte `cudaIpcEventHandle_t` to wait for before reading (torch records one
    /// on the producer's stream when `event_sync_required`).
    pub event: Option<Vec<u8>>,
    /// torch's shared-memory counter of consumers (`ref_counter_handle`, offset): the
    /// producer keeps the allocation until the consumers have taken themselves off it.
    pub ref_counter: Option<(Vec<u8>, u64)>,
    /// The tensors in these bytes (byte ranges relative to `offset`).
    pub parts: Vec<IpcPart>,
}

/// One named tensor in an [`IpcBuffer`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcPart {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range in the buffer's bytes.
    pub start: u64,
    pub end: u64,
}

/// How one rank's pickle is laid out (`load_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpcLayout {
    /// A list of `(name, tensor)` pairs (`load_format` null or `"direct"`).
    Pairs,
    /// SGLang's `FlattenedTensorBucket`: one tensor and the metadata of its parts.
    FlattenedBucket,
}

const REBUILD: (&str, &str) = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor");
const REBUILD_SGLANG: (&str, &str) = ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified");
const METADATA: &str = "FlattenedTensorMetadata";

fn allowed(module: &str, name: &str) -> bool {
    (module, name) == REBUILD
        || (module, name) == REBUILD_SGLANG
        || matches!(
            (module, name),
            ("torch", "Tensor" | "Size")
                | ("torch._tensor", "Tensor")
                | ("torch.nn.parameter", "Parameter")
                | ("torch.storage", "TypedStorage" | "UntypedStorage")
                | ("torch", "UntypedStorage")
        )
        // A dtype (`torch.bfloat16`): checked against the ones arbor takes below, so that
        // the refusal names the dtype.
        || (module == "torch" && dtype_name(name))
        // FlattenedTensorMetadata lived in model_runner.py before weight_sync/.
        || (name == METADATA && module.starts_with("sglang."))
}

fn dtype_name(name: &str) -> bool {
    matches!(
        name,
        "bfloat16"
            | "float16"
            | "float32"
            | "float64"
            | "int8"
            | "uint8"
            | "int16"
            | "int32"
            | "int64"
            | "bool"
            | "float8_e4m3fn"
            | "float8_e5m2"
            | "complex64"
    )
}

/// What is wrong with a rank's element, worded for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IpcError(pub String);

fn bad<T>(msg: impl Into<String>) -> Result<T, IpcError> {
    Err(IpcError(msg.into()))
}

/// Reads one rank's element (the pickle, base64 already decoded).
pub fn parse_rank(b: &[u8], layout: IpcLayout) -> Result<Vec<IpcBuffer>, IpcError> {
    let v = pickle::read(b, &allowed, Limits::new(MAX_PICKLE_BYTES))
        .map_err(|e| IpcError(format!("not a pickle this route reads: {e}")))?;
    match layout {
        IpcLayout::Pairs => pairs(&v),
        IpcLayout::FlattenedBucket => flattened(&v),
    }
}

fn pairs(v: &Value) -> Result<Vec<IpcBuffer>, IpcError> {
    let (Value::List(items) | Value::Tuple(items)) = v else {
        return bad(format!(
            "a list of (name, tensor) pairs, got {} (with load_format \"flattened_bucket\" the element is a dict)",
            v.kind()
        ));
    };
    if items.is_empty() {
        return bad("an empty list of tensors");
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let (Value::Tuple(p) | Value::List(p)) = item else {
                return bad(format!(
                    "item {i}: {}, not a (name, tensor) pair",
                    item.kind()
                ));
            };
            let [Value::Str(name), t] = p.as_slice() else {
                return bad(format!("item {i}: not a (name: str, tensor) pair"));
            };
            let t = cuda_tensor(t).map_err(|e| IpcError(format!("tensor {name:?}: {}", e.0)))?;
            t.whole(name.clone())
        })
        .collect()
}

fn flattened(v: &Value) -> Result<Vec<IpcBuffer>, IpcError> {
    let Value::Dict(d) = v else {
        return bad(format!(
            "a dict {{\"flattened_tensor\": tensor, \"metadata\": [FlattenedTensorMetadata]}} (load_format \"flattened_bucket\"), got {}",
            v.kind()
        ));
    };
    let get = |k: &str| {
        d.iter()
            .find(|(key, _)| matches!(key, Value::Str(s) if s == k))
            .map(|(_, v)| v)
            .ok_or_else(|| IpcError(format!("the bucket has no {k:?}")))
    };
    let t = cuda_tensor(get("flattened_tensor")?)
        .map_err(|e| IpcError(format!("flattened_tensor: {}", e.0)))?;
    if t.shape.len() != 1 {
        return bad(format!(
            "flattened_tensor has shape {:?}, not one dimension",
            t.shape
        ));
    }
    let Value::List(metas) = get("metadata")? else {
        return bad("metadata is not a list");
    };
    if metas.is_empty() {
        return bad("metadata lists no tensor");
    }
    let elem = t.dtype.size() as u64;
    let numel = t.shape[0] as u64;
    let mut parts = Vec::with_capacity(metas.len());
    for (i, m) in metas.iter().enumerate() {
        let f = metadata(m).map_err(|e| IpcError(format!("metadata[{i}]: {}", e.0)))?;
        let name = &f.name;
        if f.dtype != t.dtype {
            return bad(format!(
                "metadata[{i}] ({name:?}): dtype {:?} in a flattened_tensor of {:?} (arbor takes buckets of one dtype)",
                f.dtype, t.dtype
            ));
        }
        let n: Option<u64> = f
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        if f.end < f.start || f.end > numel || Some(f.end - f.start) != n || f.numel != n {
            return bad(format!(
                "metadata[{i}] ({name:?}): elements {}..{} (numel {:?}) do not hold shape {:?} inside the {numel} elements of flattened_tensor",
                f.start, f.end, f.numel, f.shape
            ));
        }
        parts.push(IpcPart {
            name: f.name,
            dtype: f.dtype,
            shape: f.shape,
            start: f.start * elem,
            end: f.end * elem,
        });
    }
    let len = numel * elem;
    Ok(vec![IpcBuffer {
        device: t.device,
        handle: t.handle,
        offset: t.offset,
        len,
        event: t.event,
        ref_counter: t.ref_counter,
        parts,
    }])
}

struct Meta {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    start: u64,
    end: u64,
    numel: Option<u64>,
}

/// A `FlattenedTensorMetadata` dataclass: `NEWOBJ(cls, ())` then `BUILD` with its
/// `__dict__`.
fn metadata(v: &Value) -> Result<Meta, IpcError> {
    let Value::Build(obj, state) = v else {
        return bad(format!("{}, not a FlattenedTensorMetadata", v.kind()));
    };
    match &**obj {
        Value::NewObj(cls, _) if cls.global().is_some_and(|(_, n)| n == METADATA) => {}
        other => return bad(format!("{}, not a FlattenedTensorMetadata", other.kind())),
    }
    let Value::Dict(d) = &**state else {
        return bad("the state of a FlattenedTensorMetadata is not a dict");
    };
    let get = |k: &str| {
        d.iter()
            .find(|(key, _)| matches!(key, Value::Str(s) if s == k))
            .map(|(_, v)| v)
            .ok_or_else(|| IpcError(format!("no field {k:?}")))
    };
    let int = |k: &str| match get(k)? {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        other => bad(format!("{k} is {}, not an int of 0 or more", other.kind())),
    };
    let Value::Str(name) = get("name")? else {
        return bad("name is not a str");
    };
    Ok(Meta {
        name: name.clone(),
        shape: size(get("shape")?).map_err(|e| IpcError(format!("shape: {}", e.0)))?,
        dtype: dtype(get("dtype")?)?,
        start: int("start_idx")?,
        end: int("end_idx")?,
        numel: Some(int("numel")?),
    })
}

/// A CUDA tensor's reduction, read.
struct CudaTensor {
    shape: Vec<usize>,
    dtype: DType,
    device: IpcDevice,
    handle: Vec<u8>,
    /// Bytes from the allocation's start to the tensor's first element.
    offset: u64,
    event: Option<Vec<u8>>,
    ref_counter: Option<(Vec<u8>, u64)>,
}

impl CudaTensor {
    fn bytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(self.dtype.size() as u64, |a, &d| a.saturating_mul(d as u64))
    }

    /// The tensor as a buffer of its own.
    fn whole(self, name: String) -> Result<IpcBuffer, IpcError> {
        let len = self.bytes();
        Ok(IpcBuffer {
            device: self.device,
            handle: self.handle,
            offset: self.offset,
            len,
            event: self.event,
            ref_counter: self.ref_counter,
            parts: vec![IpcPart {
                name,
                dtype: self.dtype,
                shape: self.shape,
                start: 0,
                end: len,
            }],
        })
    }
}

fn int_of(v: &Value, what: &str) -> Result<i64, IpcError> {
    match v {
        Value::Int(i) => Ok(*i),
        other => bad(format!("{what} is {}, not an int", other.kind())),
    }
}

fn uint_of(v: &Value, what: &str) -> Result<u64, IpcError> {
    let i = int_of(v, what)?;
    u64::try_from(i).or_else(|_| bad(format!("{what} is {i}, below 0")))
}

/// `torch.Size((d0, d1, …))`.
fn size(v: &Value) -> Result<Vec<usize>, IpcError> {
    let Value::Reduce(f, args) = v else {
        return bad(format!("{}, not a torch.Size", v.kind()));
    };
    let dims = match (f.global(), &**args) {
        (Some(("torch", "Size")), Value::Tuple(a)) => match a.as_slice() {
            [Value::Tuple(d) | Value::List(d)] => d,
            _ => return bad("torch.Size of other than one tuple"),
        },
        _ => return bad(format!("{}, not a torch.Size", v.kind())),
    };
    dims.iter()
        .map(|d| uint_of(d, "a dimension").map(|d| d as usize))
        .collect()
}

fn dtype(v: &Value) -> Result<DType, IpcError> {
    match v.global() {
        Some(("torch", "bfloat16")) => Ok(DType::BF16),
        Some(("torch", "float16")) => Ok(DType::F16),
        Some(("torch", "float32")) => Ok(DType::F32),
        Some(("torch", other)) => bad(format!(
            "dtype torch.{other}: arbor takes bfloat16, float16 or float32 weights"
        )),
        _ => bad(format!("dtype is {}, not a torch dtype", v.kind())),
    }
}

fn bytes_of(v: &Value, what: &str, len: Option<usize>) -> Result<Vec<u8>, IpcError> {
    match v {
        Value::Bytes(b) if len.is_none_or(|l| b.len() == l) => Ok(b.clone()),
        Value::Bytes(b) => bad(format!(
            "{what} holds {} bytes, not {}",
            b.len(),
            len.unwrap_or(0)
        )),
        other => bad(format!("{what} is {}, not bytes", other.kind())),
    }
}

/// The `cudaIpcMemHandle_t` in a storage handle as torch's caching allocator writes it
/// (`CUDACachingAllocator::shareIpcHandle`): a version byte (2 in torch 2.11, 3 from 2.13),
/// a type byte — `c`, a `cudaMalloc` block, followed by the 64-byte handle; `e`, an
/// expandable segment, shared by file descriptor, which a CUDA IPC handle cannot carry —
/// and the payload. A bare 64-byte handle is taken as it is.
fn cuda_malloc_handle(b: &[u8]) -> Result<Vec<u8>, IpcError> {
    const HANDLE: usize = 64;
    match b {
        _ if b.len() == HANDLE => Ok(b.to_vec()),
        [1..=3, b'c', rest @ ..] if rest.len() == HANDLE => Ok(rest.to_vec()),
        [1..=3, b'e', ..] => bad(
            "handle: the tensor lies in an expandable segment of torch's allocator \
             (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which torch shares by file \
             descriptor, not by CUDA IPC handle: turn expandable segments off in the trainer",
        ),
        [v, t, ..] => bad(format!(
            "handle: {} bytes of version {v} and type {:?}, not torch's `cudaMalloc` handle \
             (version 1 to 3, type 'c', then 64 bytes) nor a bare 64-byte one",
            b.len(),
            *t as char
        )),
        _ => bad(format!("handle: {} bytes, not a CUDA IPC handle", b.len())),
    }
}

/// `rebuild_cuda_tensor(*args)` (or SGLang's patched form) of a contiguous tensor.
fn cuda_tensor(v: &Value) -> Result<CudaTensor, IpcError> {
    let Value::Reduce(f, args) = v else {
        return bad(format!(
            "{}, not a CUDA tensor as torch's ForkingPickler reduces it (rebuild_cuda_tensor)",
            v.kind()
        ));
    };
    let Value::Tuple(a) = &**args else {
        return bad("the arguments of rebuild_cuda_tensor are not a tuple");
    };
    let sglang = match f.global() {
        Some(g) if g == REBUILD => false,
        Some(g) if g == REBUILD_SGLANG => true,
        _ => {
            return bad(format!(
                "a call of {}, not torch's rebuild_cuda_tensor (a CPU tensor is not handed over by IPC: send a safetensors body)",
                f.kind()
            ))
        }
    };
    // The device as the UUID (SGLang) and the rest as torch writes them.
    let (device, a): (IpcDevice, Vec<&Value>) = match (sglang, a.len()) {
        (false, 15) => {
            let i = uint_of(&a[6], "device")?;
            let i = u32::try_from(i).or_else(|_| bad(format!("device {i}")))?;
            (IpcDevice::Index(i), a.iter().collect())
        }
        (true, 15 | 16) => {
            let Value::Str(uuid) = &a[6] else {
                return bad(format!(
                    "argument 6 of _rebuild_cuda_tensor_modified is {}, not the GPU's UUID",
                    a[6].kind()
                ));
            };
            let mut rest: Vec<&Value> = a.iter().collect();
            if a.len() == 16 {
                // The inserting patch keeps the index after the UUID: the UUID decides.
                int_of(&a[7], "device")?;
                rest.remove(6);
            }
            (IpcDevice::Uuid(uuid.clone()), rest)
        }
        (_, n) => {
            return bad(format!(
                "{n} arguments to {}, not the {} of torch's reduction",
                f.kind(),
                if sglang { "15 or 16" } else { "15" }
            ))
        }
    };
    match a[0].global() {
        Some(("torch" | "torch._tensor", "Tensor") | ("torch.nn.parameter", "Parameter")) => {}
        _ => return bad(format!("tensor class {}", a[0].kind())),
    }
    let shape = size(a[1]).map_err(|e| IpcError(format!("size: {}", e.0)))?;
    let Value::Tuple(stride) = a[2] else {
        return bad("stride is not a tuple");
    };
    let stride: Vec<i64> = stride
        .iter()
        .map(|s| int_of(s, "a stride"))
        .collect::<Result<_, _>>()?;
    let tensor_offset = uint_of(a[3], "tensor_offset")?;
    match a[4].global() {
        Some((_, "TypedStorage" | "UntypedStorage")) => {}
        _ => return bad(format!("storage class {}", a[4].kind())),
    }
    let dtype = dtype(a[5])?;
    let handle = cuda_malloc_handle(&bytes_of(a[7], "handle", None)?)?;
    let storage_size = uint_of(a[8], "storage_size_bytes")?;
    let storage_offset = uint_of(a[9], "storage_offset_bytes")?;
    let ref_counter = match (a[11], a[12]) {
        (Value::Bytes(h), Value::Int(o)) if !h.is_empty() && *o >= 0 => {
            Some((h.clone(), *o as u64))
        }
        (Value::None, _) | (Value::Bytes(_), _) => None,
        (other, _) => return bad(format!("ref_counter_handle is {}", other.kind())),
    };
    let event = match (a[13], a[14]) {
        (_, Value::Bool(false)) => None,
        (e, Value::Bool(true)) => Some(bytes_of(e, "event_handle", Some(64))?),
        (_, other) => {
            return bad(format!(
                "event_sync_required is {}, not a bool",
                other.kind()
            ))
        }
    };
    if stride.len() != shape.len() {
        return bad(format!(
            "stride {stride:?} for size {shape:?} (not the same length)"
        ));
    }
    let mut want = 1i64;
    for (d, (&s, &n)) in stride.iter().zip(&shape).enumerate().rev() {
        if n > 1 && s != want {
            return bad(format!(
                "stride {stride:?} of size {shape:?} is not contiguous (dimension {d}): send .contiguous() tensors"
            ));
        }
        want = want.saturating_mul(n as i64);
    }
    let t = CudaTensor {
        shape,
        dtype,
        device,
        handle,
        offset: 0,
        event,
        ref_counter,
    };
    let start = tensor_offset.saturating_mul(dtype.size() as u64);
    if start.saturating_add(t.bytes()) > storage_size {
        return bad(format!(
            "{} bytes at byte {start} of a storage of {storage_size} bytes",
            t.bytes()
        ));
    }
    Ok(CudaTensor {
        offset: storage_offset.saturating_add(start),
        ..t
    })
}

/// Standard base64 with padding (RFC 4648 §4), what Python's `base64.b64encode` and
/// `pybase64.b64encode` write; whitespace is not allowed.
pub fn b64decode(s: &str) -> Result<Vec<u8>, String> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return Err(format!(
            "{} characters, not a multiple of 4 (base64 with padding)",
            b.len()
        ));
    }
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    for (i, q) in b.chunks(4).enumerate() {
        let last = (i + 1) * 4 == b.len();
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return Err(format!("padding inside the text (at character {})", i * 4));
        }
        let mut n = 0u32;
        for (j, &c) in q.iter().enumerate() {
            let v = if j >= 4 - pad {
                0
            } else {
                val(c).ok_or_else(|| {
                    format!("character {:?} at {} is not base64", c as char, i * 4 + j)
                })?
            };
            n = (n << 6) | v;
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Ok(out)
}

/// How many counters a torch ref-counter file holds (`CUDA_IPC_REF_COUNTER_FILE_SIZE`,
/// torch/csrc/CudaIPCTypes.h).
const REF_COUNTERS_PER_FILE: u64 = 10000;
/// Where a `RefcountedMapAllocator` file's data starts (`map_alloc_alignment`,
/// aten/src/ATen/MapAllocator.cpp): its header (the file's own refcount) comes first.
const MAP_ALLOC_ALIGNMENT: u64 = 64;

/// Takes this consumer off torch's count of a shared CUDA tensor's consumers, as torch's
/// receiver does when its rebuilt storage is freed (torch/csrc/StorageSharing.cpp,
/// `THPStorage_newSharedCuda`'s deleter: the `int64` at `ref_counter_offset` of the
/// shared-memory file `ref_counter_handle`, less one). Until every consumer has, the
/// trainer's caching allocator keeps the block in its limbo and cannot reuse it.
pub fn release_ref_counter(name: &[u8], offset: u64) -> Result<(), String> {
    release_ref_counter_in(std::path::Path::new("/dev/shm"), name, offset)
}

fn release_ref_counter_in(dir: &std::path::Path, name: &[u8], offset: u64) -> Result<(), String> {
    use std::sync::atomic::{AtomicI64, Ordering};
    let shown = String::from_utf8_lossy(name);
    // shm_open's names: one leading slash, no other.
    let file = match name {
        [b'/', rest @ ..]
            if !rest.is_empty()
                && rest[0] != b'.'
                && rest.len() < 255
                && rest
                    .iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')) =>
        {
            dir.join(std::str::from_utf8(rest).map_err(|_| "not UTF-8".to_string())?)
        }
        _ => {
            return Err(format!(
                "ref_counter_handle {shown:?} is not a shared-memory name"
            ))
        }
    };
    if offset >= REF_COUNTERS_PER_FILE {
        return Err(format!(
            "ref_counter_offset {offset} is past the {REF_COUNTERS_PER_FILE} counters of a file"
        ));
    }
    let at = (MAP_ALLOC_ALIGNMENT + 8 * offset) as usize;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .map_err(|e| {
            format!(
                "releasing the trainer's CUDA IPC ref counter {}: {e}",
                file.display()
            )
        })?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0) as usize;
    if len < at + 8 {
        return Err(format!(
            "the ref counter file {} holds {len} bytes, not a counter at {offset}",
            file.display()
        ));
    }
    // SAFETY: a shared mapping of a file torch maps the same way; the counter is read and
    // written only through an atomic.
    let mut map = unsafe { memmap2::MmapOptions::new().len(at + 8).map_mut(&f) }
        .map_err(|e| format!("mapping the ref counter file {}: {e}", file.display()))?;
    let p = map[at..at + 8].as_mut_ptr();
    // SAFETY: 8-aligned (the mapping is page-aligned, `at` a multiple of 8), inside it.
    let counter = unsafe { AtomicI64::from_ptr(p.cast()) };
    counter.fetch_sub(1, Ordering::AcqRel);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_handles_are_read_as_torch_writes_them() {
        let h: Vec<u8> = (0..64).collect();
        assert_eq!(cuda_malloc_handle(&h).unwrap(), h);
        for version in [1u8, 2, 3] {
            let mut torch = vec![version, b'c'];
            torch.extend(&h);
            assert_eq!(cuda_malloc_handle(&torch).unwrap(), h, "version {version}");
        }
        let mut expandable = vec![2u8, b'e'];
        expandable.extend(&h);
        let e = format!("{:?}", cuda_malloc_handle(&expandable).unwrap_err());
        assert!(e.contains("expandable"), "{e}");
        let mut future = vec![4u8, b'c'];
        future.extend(&h);
        let e = format!("{:?}", cuda_malloc_handle(&future).unwrap_err());
        assert!(e.contains("version 4"), "{e}");
        assert!(cuda_malloc_handle(&h[..10]).is_err());
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// `ForkingPickler.dump([("a.weight", t), ("b.weight", t)])` (CPython 3.11, torch
    /// 2.11) of an object reducing as `rebuild_cuda_tensor(torch.Tensor, Size([4, 8]),
    /// (8, 1), 16, TypedStorage, bfloat16, 0, bytes(range(64)), 1024, 512, False,
    /// b"/torch_123_456", 7, None, False)`: the second pair reads the first's arguments
    /// back from the memo. (tests/rl/ipc.rs makes more shapes with Python.)
    #[test]
    fn reads_torchs_reduction() {
        let b = hex(concat!(
            "8004952c010000000000005d94288c08612e776569676874948c20746f7263682e6d756c74697072",
            "6f63657373696e672e726564756374696f6e73948c1372656275696c645f637564615f74656e736f",
            "72949394288c05746f726368948c0654656e736f7294939468058c0453697a659493944b044b0886",
            "94859452944b084b0186944b108c0d746f7263682e73746f72616765948c0c547970656453746f72",
            "6167659493948c05746f726368948c0862666c6f617431369493944b004340000102030405060708",
            "090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f30",
            "3132333435363738393a3b3c3d3e3f944d00044d000289430e2f746f7263685f3132335f34353694",
            "4b074e897494529486948c08622e776569676874946804681652948694652e",
        ));
        let bufs = parse_rank(&b, IpcLayout::Pairs).unwrap();
        assert_eq!(bufs.len(), 2);
        let want = IpcBuffer {
            device: IpcDevice::Index(0),
            handle: (0..64).collect(),
            offset: 512 + 32,
            len: 64,
            event: None,
            ref_counter: Some((b"/torch_123_456".to_vec(), 7)),
            parts: vec![IpcPart {
                name: "a.weight".into(),
                dtype: DType::BF16,
                shape: vec![4, 8],
                start: 0,
                end: 64,
            }],
        };
        assert_eq!(bufs[0], want);
        assert_eq!(bufs[1].parts[0].name, "b.weight");
        assert_eq!(bufs[1].handle, want.handle);
        // The same pickle read as a bucket is refused, naming what it found.
        let e = parse_rank(&b, IpcLayout::FlattenedBucket).unwrap_err();
        assert!(e.0.contains("a dict") && e.0.contains("a list of 2"), "{e}");
    }

    #[test]
    fn base64_as_python_writes_it() {
        // base64.b64encode of b"", b"f", b"fo", b"foo", b"\xff\x00\xfe\x01".
        for (text, want) in [
            ("", &b""[..]),
            ("Zg==", b"f"),
            ("Zm8=", b"fo"),
            ("Zm9v", b"foo"),
            ("/wD+AQ==", b"\xff\x00\xfe\x01"),
        ] {
            assert_eq!(b64decode(text).unwrap(), want, "{text}");
        }
        assert!(b64decode("Zm9").unwrap_err().contains("multiple of 4"));
        assert!(b64decode("Zg==Zm9v")
            .unwrap_err()
            .contains("padding inside"));
        assert!(b64decode("Zm9*").unwrap_err().contains("'*' at 3"));
    }

    #[test]
    fn releases_a_ref_counter_as_torchs_receiver_does() {
        let dir = std::env::temp_dir().join(format!("arbor-refc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("torch_1_2_3");
        let mut bytes = vec![0u8; 64 + 8 * 8];
        bytes[64 + 8 * 5..64 + 8 * 6].copy_from_slice(&2i64.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        release_ref_counter_in(&dir, b"/torch_1_2_3", 5).unwrap();
        let after = std::fs::read(&path).unwrap();
        assert_eq!(&after[64 + 8 * 5..64 + 8 * 6], &1i64.to_le_bytes());
        assert_eq!(after[..64 + 8 * 5], bytes[..64 + 8 * 5]);
        for bad in [&b"torch_1"[..], b"/../etc/passwd", b"/a/b", b"/", b"/.."] {
            assert!(release_ref_counter_in(&dir, bad, 0)
                .unwrap_err()
                .contains("not a shared-memory name"));
        }
        assert!(release_ref_counter_in(&dir, b"/torch_1_2_3", 8)
            .unwrap_err()
            .contains("not a counter at 8"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
