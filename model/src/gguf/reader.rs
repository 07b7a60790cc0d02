//! The GGUF container (versions 2 and 3, little-endian): header, metadata key/values,
//! tensor descriptors, and the memory-mapped data section. Every count, length and offset
//! is checked against the file before it is used, so a truncated or corrupt file is an
//! error naming what was wrong, never a panic or a huge allocation.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dequant::GgmlType;
use crate::error::{MResult, ModelError};

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// Where the data section starts when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

/// Arrays nested deeper than this are refused (real files nest none).
const MAX_ARRAY_DEPTH: usize = 4;

/// More dimensions than GGML has.
const MAX_DIMS: u32 = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF type name, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F32(_) => "float32",
            MetaValue::F64(_) => "float64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// A short rendering for messages (arrays by length only).
    pub fn brief(&self) -> String {
        match self {
            MetaValue::String(s) if s.chars().count() > 80 => {
                format!("{:?}...", s.chars().take(80).collect::<String>())
            }
            MetaValue::String(s) => format!("{s:?}"),
            MetaValue::Array(a) => format!("array of {}", a.len()),
            MetaValue::Bool(b) => b.to_string(),
            MetaValue::F32(v) => v.to_string(),
            MetaValue::F64(v) => v.to_string(),
            v => v
                .as_i64()
                .map_or_else(|| format!("{v:?}"), |i| i.to_string()),
        }
    }
}

/// One tensor's descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub ty: GgmlType,
    /// GGML order: `dims[0]` is the contiguous (innermost) one, so a PyTorch `[n, k]`
    /// matrix is `[k, n]` here.
    pub dims: Vec<usize>,
    /// Byte range inside the file.
    pub bytes: Range<usize>,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    /// Tensor names in file order.
    pub tensor_names: Vec<String>,
    pub tensors: HashMap<String, TensorInfo>,
    mmap: Mmap,
}

fn gguf_err(path: &Path, msg: String) -> ModelError {
    ModelError::Gguf {
        path: path.to_path_buf(),
        msg,
    }
}

/// Whether `path` is a file that starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == MAGIC
}

impl GgufFile {
    pub fn open(path: &Path) -> MResult<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file modified while arbor runs is outside what
        // we can defend against (as with every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = parse(&mmap, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensor_names: parsed.tensor_names,
            tensors: parsed.tensors,
            mmap,
        })
    }

    /// The raw bytes of tensor `info` (already checked to lie inside the file).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.bytes.clone()]
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
}

/// What [`parse`] reads from a whole file image.
pub struct Parsed {
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensor_names: Vec<String>,
    pub tensors: HashMap<String, TensorInfo>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: String) -> ModelError {
        gguf_err(self.path, format!("at byte {}: {msg}", self.pos))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> MResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes, {} left in the file",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> MResult<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> MResult<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> MResult<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_size` bytes long, checked against what is left.
    fn count(&mut self, what: &str, min_size: usize) -> MResult<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(min_size.max(1)) <= self.remaining());
        fits.ok_or_else(|| {
            self.err(format!(
                "{what} {n} cannot fit in the {} bytes left in the file (truncated or corrupt)",
                self.remaining()
            ))
        })
    }

    fn string(&mut self, what: &str) -> MResult<String> {
        let n = self.count(&format!("length of {what}"), 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.err(format!("{what} is not valid UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> MResult<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err(format!("{key}: bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let ety = self.u32(key)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.count(&format!("{key}: array length"), min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(ety, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(self.err(format!("{key}: unknown metadata value type {t}"))),
        })
    }
}

/// Parses and validates a whole file image: every tensor's bytes inside the data section,
/// sized as its type and dimensions say, aligned, and not overlapping another.
pub fn parse(file: &[u8], path: &Path) -> MResult<Parsed> {
    let mut c = Cursor {
        buf: file,
        pos: 0,
        path,
    };
    let magic = c.array::<4>("the magic")?;
    if &magic != MAGIC {
        return Err(gguf_err(
            path,
            format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""),
        ));
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err(gguf_err(
            path,
            "GGUF version 1 (32-bit counts) is not supported; convert it with a current llama.cpp"
                .into(),
        )),
        v if v.swap_bytes() <= 3 => {
            return Err(gguf_err(
                path,
                format!(
                    "big-endian GGUF (version {}) is not supported",
                    v.swap_bytes()
                ),
            ))
        }
        v => {
            return Err(gguf_err(
                path,
                format!("unknown GGUF version {v} (2 and 3 are supported)"),
            ))
        }
    }
    // A tensor descriptor is at least 8 + 4 + 4 + 8 bytes; a key/value at least 8 + 4.
    let n_tensors = c.count("tensor count", 24)?;
    let n_kv = c.count("metadata count", 12)?;
    let mut metadata = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("a metadata key")?;
        let ty = c.u32(&key)?;
        let v = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(c.err(format!("metadata key {key:?} appears twice")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(gguf_err(
                    path,
                    format!(
                        "general.alignment {} is not a power of two up to 1 MiB",
                        v.brief()
                    ),
                ))
            }
        },
    } as usize;
    let mut raw = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("a tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.err(format!(
                "tensor {name:?}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64(&name)?;
            dims.push(
                usize::try_from(d)
                    .map_err(|_| c.err(format!("tensor {name:?}: dimension {d} too large")))?,
            );
        }
        let ty = GgmlType::from_id(c.u32(&name)?);
        let offset = c.u64(&name)?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = c.pos.div_ceil(alignment) * alignment;
    if data_start > file.len() {
        return Err(gguf_err(
            path,
            format!(
                "truncated: the data section would start at byte {data_start}, past the end ({})",
                file.len()
            ),
        ));
    }
    let data_len = file.len() - data_start;
    let mut tensors = HashMap::with_capacity(raw.len());
    let mut tensor_names = Vec::with_capacity(raw.len());
    let mut spans: Vec<(usize, usize, String)> = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let bad = |msg: String| gguf_err(path, format!("tensor {name:?}: {msg}"));
        let n: Option<usize> = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let n = n.ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
        let size = ty
            .byte_size(dims[0], n)
            .map_err(|msg| bad(format!("type {}: {msg} (dimensions {dims:?})", ty.name())))?;
        if offset % alignment as u64 != 0 {
            return Err(bad(format!(
                "offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let start = usize::try_from(offset)
            .ok()
            .filter(|&o| o <= data_len && size <= data_len - o)
            .ok_or_else(|| {
                bad(format!(
                    "bytes {offset}..{} lie outside the data section ({data_len} bytes): the file is truncated or corrupt",
                    offset.saturating_add(size as u64)
                ))
            })?;
        spans.push((start, start + size, name.clone()));
        let info = TensorInfo {
            ty,
            dims,
            bytes: data_start + start..data_start + start + size,
        };
        if tensors.insert(name.clone(), info).is_some() {
            return Err(bad("appears twice".into()));
        }
        tensor_names.push(name);
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(gguf_err(
                path,
                format!("tensors {:?} and {:?} overlap", w[0].2, w[1].2),
            ));
        }
    }
    Ok(Parsed {
        version,
        metadata,
        tensor_names,
        tensors,
    })
}
