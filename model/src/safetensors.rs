//! A memory-mapped safetensors file with a validated header.
//!
//! Layout: 8-byte little-endian header length N, N bytes of JSON
//! (`name -> {dtype, shape, data_offsets: [begin, end]}`, offsets relative to the data
//! section), then the data. Nothing is read from the data section until a tensor (or a
//! slice of one) is asked for, so a rank touches only the pages of its own shard.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;

use crate::error::{MResult, ModelError};

/// Header sizes beyond this are refused before parsing (real headers are a few MB).
const MAX_HEADER: u64 = 100 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
        }
    }
    /// A dtype named as safetensors ("BF16") or torch ("bfloat16", "torch.bfloat16")
    /// names it: what a trainer lists for the tensors it broadcasts.
    pub fn from_any_name(s: &str) -> Option<Self> {
        match s.strip_prefix("torch.").unwrap_or(s) {
            "bfloat16" => Some(DType::BF16),
            "float16" | "half" => Some(DType::F16),
            "float32" | "float" => Some(DType::F32),
            other => Self::parse(&other.to_ascii_uppercase()),
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "F32" => Some(DType::F32),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub data: Range<usize>,
}

/// One tensor inside a buffer of many (`SafeFile::from_packed`): its name, type, shape
/// and the bytes it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedPart {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Range<usize>,
}

pub struct SafeFile {
    /// The file, or for bytes received over the network a label naming where they came
    /// from (errors name it as they name a file).
    pub path: PathBuf,
    data: Storage,
    data_start: usize,
    pub tensors: HashMap<String, TensorInfo>,
}

/// A file's bytes: mapped from disk, or held in memory (a checkpoint pushed by a trainer).
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

fn st_err(path: &Path, msg: String) -> ModelError {
    ModelError::Safetensors {
        path: path.to_path_buf(),
        msg,
    }
}

impl SafeFile {
    pub fn open(path: &Path) -> MResult<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(st_err(
                path,
                format!("truncated: {len} bytes, shorter than the 8-byte header length"),
            ));
        }
        // SAFETY: the map is read-only; a checkpoint modified while arbor runs is outside
        // what we can defend against (as with every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (data_start, tensors) = parse_header(&mmap, path)?;
        Ok(SafeFile {
            path: path.to_path_buf(),
            data: Storage::Mapped(mmap),
            data_start,
            tensors,
        })
    }

    /// A whole safetensors image held in memory (validated as [`SafeFile::open`] does);
    /// `label` names it in errors.
    pub fn from_bytes(label: &Path, bytes: Vec<u8>) -> MResult<Self> {
        let (data_start, tensors) = parse_header(&bytes, label)?;
        Ok(SafeFile {
            path: label.to_path_buf(),
            data: Storage::Owned(bytes),
            data_start,
            tensors,
        })
    }

    /// One tensor's raw little-endian bytes (`shape` × `dtype`), held in memory.
    pub fn from_tensor(
        label: &Path,
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> MResult<Self> {
        let want = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(st_err(
                label,
                format!(
                    "tensor {name:?}: {} bytes, but shape {shape:?} × {} needs {want:?}",
                    bytes.len(),
                    dtype.name()
                ),
            ));
        }
        let info = TensorInfo {
            dtype,
            shape,
            data: 0..bytes.len(),
        };
        Ok(SafeFile {
            path: label.to_path_buf(),
            data: Storage::Owned(bytes),
            data_start: 0,
            tensors: HashMap::from([(name.to_string(), info)]),
        })
    }

    /// Many tensors' raw little-endian bytes held in one buffer, each at its part's
    /// range (a packed broadcast): no copy is cut out of it.
    pub fn from_packed(label: &Path, bytes: Vec<u8>, parts: Vec<PackedPart>) -> MResult<Self> {
        let mut infos = HashMap::with_capacity(parts.len());
        for t in parts {
            let want = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d));
            let data = t.data;
            if want != Some(data.len()) || data.end > bytes.len() {
                return Err(st_err(
                    label,
                    format!(
                        "tensor {:?}: bytes {data:?} of {}, but shape {:?} × {} needs {want:?}",
                        t.name,
                        bytes.len(),
                        t.shape,
                        t.dtype.name()
                    ),
                ));
            }
            let info = TensorInfo {
                dtype: t.dtype,
                shape: t.shape,
                data,
            };
            if infos.insert(t.name.clone(), info).is_some() {
                return Err(st_err(
                    label,
                    format!("tensor {:?} is listed twice", t.name),
                ));
            }
        }
        Ok(SafeFile {
            path: label.to_path_buf(),
            data: Storage::Owned(bytes),
            data_start: 0,
            tensors: infos,
        })
    }

    /// Bytes held (the whole image for an in-memory file, the mapping for a file).
    pub fn len_bytes(&self) -> usize {
        self.data.len()
    }

    /// Raw bytes of `range` (relative to the tensor's data) of tensor `info`.
    fn bytes(&self, info: &TensorInfo, range: Range<usize>) -> &[u8] {
        let base = self.data_start + info.data.start;
        &self.data[base + range.start..base + range.end]
    }

    /// Elements `[r0..r1) × [c0..c1)` of the 2-D tensor `name` `[n, k]` (or of a 1-D
    /// tensor with n = 1), converted to bf16, row-major. Only the bytes of those elements
    /// are read. A value that is not finite (NaN or ±inf in the file, or an f32 beyond
    /// bf16's range) is refused, naming the tensor and the first such element: it would
    /// make every log-prob that depends on it NaN. Large blocks are converted on several
    /// threads (an 8B checkpoint is 16 GB: one core converting and checking it was most
    /// of a weight update's time).
    pub fn read_block(
        &self,
        name: &str,
        info: &TensorInfo,
        k: usize,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> MResult<Vec<bf16>> {
        let width = cols.len();
        let mut out = vec![bf16::ZERO; rows.len() * width];
        par_rows(&mut out, width, |i, d| {
            self.read_row_into(name, info, k, rows.start + i, cols.clone(), d)
        })?;
        Ok(out)
    }

    /// Columns `cols` of row `r` of the 2-D tensor `name` `[n, k]`, converted to bf16 into
    /// `dst` (`cols.len()` values) and checked finite as [`SafeFile::read_block`] checks.
    pub fn read_row_into(
        &self,
        name: &str,
        info: &TensorInfo,
        k: usize,
        r: usize,
        cols: Range<usize>,
        dst: &mut [bf16],
    ) -> MResult<()> {
        let es = info.dtype.size();
        let b = self.bytes(info, (r * k + cols.start) * es..(r * k + cols.end) * es);
        convert_into(b, info.dtype, dst);
        match first_non_finite(dst) {
            Some(j) => Err(self.non_finite(name, info, b, r * k + cols.start + j, j)),
            None => Ok(()),
        }
    }

    /// The error for element `flat` of tensor `name`, the `j`-th of the row bytes `b`.
    fn non_finite(
        &self,
        name: &str,
        info: &TensorInfo,
        b: &[u8],
        flat: usize,
        j: usize,
    ) -> ModelError {
        let es = info.dtype.size();
        non_finite_error(
            &self.path,
            name,
            info.dtype,
            &info.shape,
            &b[j * es..(j + 1) * es],
            flat,
        )
    }
}

/// The refusal of element `flat` of tensor `name` (`raw`: its bytes), which is not finite
/// in bf16. `path` names where the tensor came from.
pub(crate) fn non_finite_error(
    path: &Path,
    name: &str,
    dtype: DType,
    shape: &[usize],
    raw: &[u8],
    flat: usize,
) -> ModelError {
    let mut v = [bf16::ZERO];
    convert_into(raw, dtype, &mut v);
    let shown = match (dtype, raw) {
        (DType::F32, [a, b, c, d]) => f32::from_le_bytes([*a, *b, *c, *d]).to_string(),
        _ => v[0].to_string(),
    };
    ModelError::Safetensors {
        path: path.to_path_buf(),
        msg: format!(
            "tensor {name:?}: element {flat} ({:?}) is {shown}; the weights must be finite in bf16",
            unravel(flat, shape),
        ),
    }
}

/// Blocks of at least this many elements are converted on several threads.
const PARALLEL_ELEMENTS: usize = 1 << 22;
/// Memory bandwidth, not cores, bounds the conversion beyond this.
const MAX_THREADS: usize = 16;

/// Runs `row(i, dst_i)` for every row `i` of `out` (rows of `width` values), on several
/// threads when `out` is large, each thread a run of consecutive rows. The error of the
/// first failing row in order is returned: each thread stops at its first, and the
/// threads' runs are in row order.
pub(crate) fn par_rows(
    out: &mut [bf16],
    width: usize,
    row: impl Fn(usize, &mut [bf16]) -> MResult<()> + Sync,
) -> MResult<()> {
    if out.is_empty() || width == 0 {
        return Ok(());
    }
    let n = out.len() / width;
    let threads = if out.len() >= PARALLEL_ELEMENTS {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS)
            .min(n)
    } else {
        1
    };
    let run = |first: usize, dst: &mut [bf16]| -> MResult<()> {
        for (i, d) in dst.chunks_exact_mut(width).enumerate() {
            row(first + i, d)?;
        }
        Ok(())
    };
    if threads <= 1 {
        return run(0, out);
    }
    let rows_per = n.div_ceil(threads);
    let results: Vec<MResult<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(rows_per * width)
            .enumerate()
            .map(|(i, dst)| {
                let run = &run;
                s.spawn(move || run(i * rows_per, dst))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results
        .into_iter()
        .collect::<MResult<Vec<()>>>()
        .map(|_| ())
}

/// The index of the first NaN or ±inf of `v`. Scans without an early exit, in chunks, so
/// the loop vectorises (all-ones exponent bits: 0x7f80).
pub(crate) fn first_non_finite(v: &[bf16]) -> Option<usize> {
    const CHUNK: usize = 1024;
    let bad = |x: &bf16| x.to_bits() & 0x7f80 == 0x7f80;
    for (c, chunk) in v.chunks(CHUNK).enumerate() {
        if chunk.iter().fold(false, |a, x| a | bad(x)) {
            return chunk.iter().position(bad).map(|j| c * CHUNK + j);
        }
    }
    None
}

/// The index of element `flat` of a row-major tensor of `shape`.
fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[i] = flat % d;
            flat /= d;
        }
    }
    idx
}

pub(crate) fn convert_into(b: &[u8], dtype: DType, out: &mut [bf16]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = bf16::from_f32(f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32());
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
    }
}

/// Validates the header of a whole file image: length within the file, JSON well formed,
/// every tensor's byte range inside the data section, consistent with shape × dtype, and
/// no two tensors overlapping.
pub fn parse_header(file: &[u8], path: &Path) -> MResult<(usize, HashMap<String, TensorInfo>)> {
    let len = file.len() as u64;
    if len < 8 {
        return Err(st_err(
            path,
            format!("truncated: {len} bytes, shorter than the 8-byte header length"),
        ));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&file[..8]);
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > len - 8 {
        return Err(st_err(
            path,
            format!(
                "header length {n} does not fit in the file ({len} bytes) or exceeds {MAX_HEADER}"
            ),
        ));
    }
    let data_start = 8 + n as usize;
    let data_len = file.len() - data_start;
    let header = serde_json::from_slice::<Strict>(&file[8..data_start])
        .map_err(|e| st_err(path, format!("header is not valid JSON: {e}")))?
        .0;
    let obj = header
        .as_object()
        .ok_or_else(|| st_err(path, "header is not a JSON object".into()))?;
    let mut tensors = HashMap::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            check_metadata(v, path)?;
            continue;
        }
        let bad = |msg: String| st_err(path, format!("tensor {name:?}: {msg}"));
        let t = v
            .as_object()
            .ok_or_else(|| bad("entry is not an object".into()))?;
        let dtype_s = t
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing \"dtype\"".into()))?;
        let dtype = DType::parse(dtype_s).ok_or_else(|| ModelError::DtypeUnsupported {
            path: path.to_path_buf(),
            tensor: name.clone(),
            dtype: dtype_s.to_string(),
        })?;
        let shape: Vec<usize> = t
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing \"shape\"".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("\"shape\" holds a non-integer".into()))?;
        let offs: Vec<usize> = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("\"data_offsets\" is not a pair".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("\"data_offsets\" holds a non-integer".into()))?;
        let (b, e) = (offs[0], offs[1]);
        if b > e || e > data_len {
            return Err(bad(format!(
                "data_offsets [{b}, {e}] outside the data section of {data_len} bytes (file truncated or header lying)"
            )));
        }
        let want = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if e - b != want {
            return Err(bad(format!(
                "data_offsets [{b}, {e}] hold {} bytes but shape {shape:?} × {} needs {want}",
                e - b,
                dtype.name()
            )));
        }
        tensors.insert(
            name.clone(),
            TensorInfo {
                dtype,
                shape,
                data: b..e,
            },
        );
    }
    let mut spans: Vec<(&str, &Range<usize>)> = tensors
        .iter()
        .filter(|(_, t)| !t.data.is_empty())
        .map(|(n, t)| (n.as_str(), &t.data))
        .collect();
    spans.sort_by_key(|(n, r)| (r.start, *n));
    for w in spans.windows(2) {
        if w[1].1.start < w[0].1.end {
            return Err(st_err(
                path,
                format!(
                    "tensors {:?} {:?} and {:?} {:?} overlap",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ),
            ));
        }
    }
    Ok((data_start, tensors))
}

/// The format's `__metadata__`: a map of strings to strings.
fn check_metadata(v: &Value, path: &Path) -> MResult<()> {
    let m = v.as_object().ok_or_else(|| {
        st_err(
            path,
            format!("\"__metadata__\" must map strings to strings, got {v}"),
        )
    })?;
    match m.iter().find(|(_, x)| !x.is_string()) {
        Some((k, x)) => Err(st_err(
            path,
            format!("\"__metadata__\" must map strings to strings: {k:?} is {x}"),
        )),
        None => Ok(()),
    }
}

/// A JSON value in which no object repeats a key. serde_json keeps the last of repeated
/// keys without a word, so a header could say two things about one tensor, and which one
/// counts would depend on the reader: such a header is refused.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::from(n))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::from(n))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(Value::from(n))
    }
    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!(
                    "the key {k:?} appears twice in one object"
                )));
            }
            let Strict(v) = map.next_value()?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// Serialises a safetensors header for `(name, dtype, shape)` entries laid out back to
/// back in the given order; returns the header bytes (length prefix included, padded to
/// 8 bytes) and the data size.
pub fn build_header(entries: &[(String, DType, Vec<usize>)]) -> (Vec<u8>, usize) {
    let mut map = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dtype, shape) in entries {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        map.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [off, off + bytes]}),
        );
        off += bytes;
    }
    let mut json = Value::Object(map).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    (out, off)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_tensors_read_back_at_unaligned_offsets() {
        // A bf16 [3] (6 bytes), then an f32 [2, 2] at offset 6, then an f16 [1]: laid as
        // a trainer's `torch.cat` of their uint8 views does.
        let a = [1.5f32, -2.0, 0.25].map(|v| bf16::from_f32(v).to_bits().to_le_bytes());
        let b = [3.0f32, 4.0, -5.5, 6.0].map(f32::to_le_bytes);
        let h = f16::from_f32(7.0).to_bits().to_le_bytes();
        let bytes: Vec<u8> = a
            .iter()
            .flatten()
            .chain(b.iter().flatten())
            .chain(h.iter())
            .copied()
            .collect();
        let part = |name: &str, dtype, shape: &[usize], data: Range<usize>| PackedPart {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
        };
        let parts = vec![
            part("a", DType::BF16, &[3], 0..6),
            part("b", DType::F32, &[2, 2], 6..22),
            part("h", DType::F16, &[1], 22..24),
        ];
        let f = SafeFile::from_packed(Path::new("packed"), bytes, parts.clone()).unwrap();
        let read = |name: &str, k: usize, rows: usize| {
            let info = &f.tensors[name];
            f.read_block(name, info, k, 0..rows, 0..k)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect::<Vec<_>>()
        };
        assert_eq!(read("a", 3, 1), [1.5, -2.0, 0.25]);
        assert_eq!(read("b", 2, 2), [3.0, 4.0, -5.5, 6.0]);
        assert_eq!(read("h", 1, 1), [7.0]);
        // A range that disagrees with the tensor's shape names it.
        let wrong = vec![part("a", DType::BF16, &[3], 0..8)];
        let e = SafeFile::from_packed(Path::new("packed"), vec![0; 8], wrong)
            .err()
            .unwrap();
        assert!(e.to_string().contains("tensor \"a\""), "{e}");
    }

    fn file_with(header: &str, data_len: usize) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend(std::iter::repeat_n(0u8, data_len));
        f
    }

    fn p() -> PathBuf {
        PathBuf::from("t.safetensors")
    }

    /// A one-tensor file `[n, k]` of bf16 values `f(i)`.
    fn bf16_file(n: usize, k: usize, f: impl Fn(usize) -> bf16) -> SafeFile {
        let bytes = (0..n * k)
            .flat_map(|i| f(i).to_bits().to_le_bytes())
            .collect();
        SafeFile::from_tensor(&p(), "w", DType::BF16, vec![n, k], bytes).unwrap()
    }

    /// A block big enough for the threads reads the same values as one small read per row,
    /// and a non-finite value is reported at its first place whichever thread saw it.
    #[test]
    fn threaded_blocks_match_row_reads_and_name_the_first_bad_element() {
        let (n, k) = (1100, 4096); // 4.5 M elements: above PARALLEL_ELEMENTS
        let val = |i: usize| bf16::from_f32(((i * 2_654_435_761) % 1000) as f32 / 7.0 - 50.0);
        let f = bf16_file(n, k, val);
        let t = f.tensors["w"].clone();
        let cols = 5..4001;
        let all = f.read_block("w", &t, k, 3..n, cols.clone()).unwrap();
        assert_eq!(all.len(), (n - 3) * cols.len());
        for r in [3, 4, 550, 551, n - 1] {
            let one = f.read_block("w", &t, k, r..r + 1, cols.clone()).unwrap();
            let at = (r - 3) * cols.len();
            assert_eq!(&all[at..at + cols.len()], &one[..], "row {r}");
            assert_eq!(one[0], val(r * k + cols.start));
        }
        let bad = |i: usize| match i {
            i if i == 700 * k + 9 => bf16::INFINITY,
            i if i == 1000 * k + 20 => bf16::NAN,
            i => val(i),
        };
        let f = bf16_file(n, k, bad);
        let e = f
            .read_block("w", &t, k, 0..n, 0..k)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("element {}", 700 * k + 9)), "{e}");
        assert!(e.contains("[700, 9]") && e.contains("inf"), "{e}");
        assert!(
            f.read_block("w", &t, k, 0..n, 10..k).is_err(),
            "column 9 is outside the block, but row 1000 column 20 is in it"
        );
        assert!(
            f.read_block("w", &t, k, 0..700, 0..k).is_ok(),
            "rows before the bad ones"
        );
        assert!(f.read_block("w", &t, k, 0..0, 0..k).unwrap().is_empty());
    }

    #[test]
    fn first_non_finite_finds_the_first_across_chunks() {
        let mut v = vec![bf16::ONE; 5000];
        assert_eq!(first_non_finite(&v), None);
        v[4321] = bf16::NEG_INFINITY;
        v[4999] = bf16::NAN;
        assert_eq!(first_non_finite(&v), Some(4321));
        v[2] = bf16::NAN;
        assert_eq!(first_non_finite(&v), Some(2));
        // The largest finite bf16 is finite.
        assert_eq!(first_non_finite(&[bf16::MAX, bf16::MIN]), None);
    }

    /// `cargo test --release -p arbor-model read_block_throughput -- --ignored --nocapture`:
    /// GB/s of reading and checking a 1 GiB bf16 tensor (a weight update's host side).
    #[test]
    #[ignore]
    fn read_block_throughput() {
        let (n, k) = (1 << 17, 4096);
        let f = bf16_file(n, k, |i| bf16::from_f32((i % 251) as f32));
        let t = f.tensors["w"].clone();
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            let v = f.read_block("w", &t, k, 0..n, 0..k).unwrap();
            let s = t0.elapsed().as_secs_f64();
            println!(
                "read_block: {:.2} GB/s ({} elements, {s:.3} s)",
                (v.len() * 2) as f64 / s / 1e9,
                v.len()
            );
        }
    }

    #[test]
    fn roundtrip_header() {
        let (h, n) = build_header(&[
            ("a".into(), DType::BF16, vec![2, 3]),
            ("b".into(), DType::F32, vec![4]),
        ]);
        let mut f = h;
        f.extend(std::iter::repeat_n(0u8, n));
        let (_, t) = parse_header(&f, &p()).unwrap();
        assert_eq!(t["a"].data, 0..12);
        assert_eq!(t["b"].data, 12..28);
        assert_eq!(t["b"].dtype, DType::F32);
    }

    #[test]
    fn accepts_string_metadata_and_nested_values() {
        let h = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
        let (_, t) = parse_header(&file_with(h, 4), &p()).unwrap();
        assert_eq!(t["a"].shape, vec![2]);
    }

    #[test]
    fn rejects_bad_headers() {
        let cases: &[(&str, usize, &str)] = &[
            (
                r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#,
                3,
                "outside the data section",
            ),
            (
                r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}}"#,
                8,
                "needs 6",
            ),
            (
                r#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#,
                8,
                "I64",
            ),
            (
                r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}}"#,
                8,
                "overlap",
            ),
            (r#"{"a":{"dtype":"BF16","shape":[2]}}"#, 8, "data_offsets"),
            (r#"{"a": 3"#, 8, "not valid JSON"),
            // A repeated key, at the top or inside an entry, is read two ways by JSON
            // parsers (serde_json keeps the last): refused.
            (
                r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}"#,
                8,
                "the key \"a\" appears twice",
            ),
            (
                r#"{"a":{"dtype":"F32","dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#,
                8,
                "the key \"dtype\" appears twice",
            ),
            // The format's metadata maps strings to strings.
            (
                r#"{"__metadata__":{"format":"pt","step":3}}"#,
                0,
                "\"step\" is 3",
            ),
            (r#"{"__metadata__":[1]}"#, 0, "\"__metadata__\" must map"),
        ];
        for (h, n, want) in cases {
            let e = parse_header(&file_with(h, *n), &p())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{h}: {e}");
        }
        let mut f = file_with("{}", 0);
        f[..8].copy_from_slice(&1000u64.to_le_bytes());
        let e = parse_header(&f, &p()).unwrap_err().to_string();
        assert!(e.contains("header length 1000"), "{e}");
        let e = parse_header(&[1, 2, 3], &p()).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
