//! The weights of a checkpoint: a model directory's `model.safetensors` (or the shards
//! listed in `model.safetensors.index.json`), or a GGUF file's tensors under their HF
//! names. Tensors are read slice by slice (a rank's rows or columns), converted to bf16;
//! the checkpoint is never materialised whole.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use half::bf16;

use crate::backend::DeviceTensor;
use crate::error::{MResult, ModelError};
use crate::gguf::GgufWeights;
use crate::safetensors::{par_rows, SafeFile, TensorInfo};

/// Columns `cols` of rows `rows` of the `[n, k]` checkpoint matrix `name`: one piece of a
/// weight a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatPart {
    pub name: String,
    pub n: usize,
    pub k: usize,
    pub rows: Range<usize>,
    pub cols: Range<usize>,
}

/// How the parts of a [`MatPlan`] lie in the weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Each part's rows after the previous part's.
    Stacked,
    /// Two parts of equal height, row by row: part 0's row j at 2j, part 1's at 2j + 1.
    Alternating,
}

/// A weight `[rows(), width()]` made of checkpoint blocks: the parts' rows in `order`,
/// then `pad_rows` rows of zeros. Described rather than read, so that a backend can have
/// it written chunk by chunk straight into the memory it uploads from
/// ([`crate::backend::Backend::mat_from_rows`]), with no whole-weight host copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatPlan {
    pub parts: Vec<MatPart>,
    pub order: RowOrder,
    pub pad_rows: usize,
}

impl MatPlan {
    /// Values per row: every part's column count.
    pub fn width(&self) -> usize {
        self.parts.first().map_or(0, |p| p.cols.len())
    }

    /// Rows of the weight, padding included.
    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows.len()).sum::<usize>() + self.pad_rows
    }

    /// Where part `i`'s rows land: its first row of the weight, and the step between
    /// its rows (stacked parts follow each other; two alternating parts interleave).
    pub fn landing(&self, i: usize) -> (usize, usize) {
        match self.order {
            RowOrder::Alternating => (i, 2),
            RowOrder::Stacked => (self.parts[..i].iter().map(|p| p.rows.len()).sum(), 1),
        }
    }

    /// Why the parts cannot make one weight, if they cannot.
    pub(crate) fn check(&self) -> Result<(), String> {
        let w = self.width();
        for p in &self.parts {
            if p.cols.len() != w {
                return Err(format!(
                    "{} gives {} columns where the weight's rows have {w}",
                    p.name,
                    p.cols.len()
                ));
            }
            if p.rows.start > p.rows.end
                || p.rows.end > p.n
                || p.cols.start > p.cols.end
                || p.cols.end > p.k
            {
                return Err(format!(
                    "{}: rows {:?} × columns {:?} of a [{}, {}] matrix",
                    p.name, p.rows, p.cols, p.n, p.k
                ));
            }
        }
        if self.order == RowOrder::Alternating
            && (self.parts.len() != 2 || self.parts[0].rows.len() != self.parts[1].rows.len())
        {
            return Err(format!(
                "alternating rows need two parts of equal height, not {:?}",
                self.parts.iter().map(|p| p.rows.len()).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }

    /// The part and the checkpoint row behind row `r` of the weight; `None` for padding.
    fn source(&self, r: usize) -> Option<(usize, usize)> {
        match self.order {
            RowOrder::Alternating => {
                let (p, j) = (r % 2, r / 2);
                let part = self.parts.get(p)?;
                (j < part.rows.len()).then(|| (p, part.rows.start + j))
            }
            RowOrder::Stacked => {
                let mut r = r;
                for (i, part) in self.parts.iter().enumerate() {
                    if r < part.rows.len() {
                        return Some((i, part.rows.start + r));
                    }
                    r -= part.rows.len();
                }
                None
            }
        }
    }
}

pub struct WeightStore {
    source: Source,
    /// Every tensor a load asked for, with the shape it expected: what a later weight
    /// update must provide (runner/weights_update.rs).
    read: Mutex<BTreeMap<String, Vec<usize>>>,
    /// Nanoseconds spent reading and converting blocks to bf16 (on the host): with a
    /// load's total time, what bounds it.
    read_ns: AtomicU64,
}

enum Source {
    Safetensors(SafeStore),
    Gguf(GgufWeights),
}

impl WeightStore {
    /// The safetensors checkpoint of model directory `dir`.
    pub fn open(dir: &Path) -> MResult<Self> {
        SafeStore::open(dir).map(|s| Self::with(Source::Safetensors(s)))
    }

    /// A GGUF file's tensors.
    pub fn gguf(g: GgufWeights) -> Self {
        Self::with(Source::Gguf(g))
    }

    /// A checkpoint held in memory (tensors a trainer pushed): in host memory (`files`)
    /// or in the backend's (`device`, by name); `label` stands for the directory in errors.
    pub fn from_files(
        label: &Path,
        files: Vec<SafeFile>,
        device: Vec<(String, DeviceTensor)>,
    ) -> MResult<Self> {
        SafeStore::from_files(label, files, device).map(|s| Self::with(Source::Safetensors(s)))
    }

    fn with(source: Source) -> Self {
        WeightStore {
            source,
            read: Mutex::default(),
            read_ns: AtomicU64::new(0),
        }
    }

    /// Seconds spent so far reading blocks and converting them to bf16.
    pub fn read_seconds(&self) -> f64 {
        self.read_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = f();
        self.read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// The tensors read so far and the shapes they were read as, by name.
    pub fn tensors_read(&self) -> BTreeMap<String, Vec<usize>> {
        self.read.lock().map(|m| m.clone()).unwrap_or_default()
    }

    fn note(&self, name: &str, shape: &[usize]) {
        if let Ok(mut m) = self.read.lock() {
            m.insert(name.to_string(), shape.to_vec());
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Safetensors(s) => s.contains(name),
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// Rows `rows` (all columns) of the `[n, k]` matrix `name`.
    pub fn rows(&self, name: &str, n: usize, k: usize, rows: Range<usize>) -> MResult<Vec<bf16>> {
        self.note(name, &[n, k]);
        self.timed(|| match &self.source {
            Source::Safetensors(s) => s.rows(name, n, k, rows),
            Source::Gguf(g) => g.rows(name, n, k, rows),
        })
    }

    /// Columns `cols` of every row of the `[n, k]` matrix `name` (a strided read).
    pub fn cols(&self, name: &str, n: usize, k: usize, cols: Range<usize>) -> MResult<Vec<bf16>> {
        self.note(name, &[n, k]);
        self.timed(|| match &self.source {
            Source::Safetensors(s) => s.cols(name, n, k, cols),
            Source::Gguf(g) => g.cols(name, n, k, cols),
        })
    }

    /// Elements `range` of the vector `name` of length `len`, as f32 (via bf16).
    pub fn vector(&self, name: &str, len: usize, range: Range<usize>) -> MResult<Vec<f32>> {
        self.note(name, &[len]);
        self.timed(|| match &self.source {
            Source::Safetensors(s) => s.vector(name, len, range),
            Source::Gguf(g) => g.vector(name, len, range),
        })
    }

    /// The tensor `name` of `shape`, where it lies in the backend's memory (`None`: it is
    /// read from the host). A tensor already released is refused.
    pub fn device(&self, name: &str, shape: &[usize]) -> MResult<Option<DeviceTensor>> {
        match &self.source {
            Source::Safetensors(s) if s.device.contains_key(name) => {
                self.note(name, shape);
                s.device_tensor(name, shape).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// `name` will be read `readers` times (default once): a device-resident tensor is
    /// freed at its last [`WeightStore::release`] (a tied embedding is read twice).
    pub fn set_readers(&self, name: &str, readers: usize) {
        if let Source::Safetensors(s) = &self.source {
            if let Some(e) = s.device.get(name) {
                if let Ok(mut slot) = e.held.lock() {
                    slot.1 = readers;
                }
            }
        }
    }

    /// One reader of `name` has taken what it needs: a device-resident tensor whose
    /// readers are all done is freed now (its memory goes back while the rest of the
    /// model is made). Host tensors stay.
    pub fn release(&self, name: &str) {
        if let Source::Safetensors(s) = &self.source {
            if let Some(e) = s.device.get(name) {
                if let Ok(mut slot) = e.held.lock() {
                    slot.1 = slot.1.saturating_sub(1);
                    if slot.1 == 0 {
                        slot.0 = None;
                    }
                }
            }
        }
    }

    /// Where the checkpoint came from, for errors.
    pub fn label(&self) -> &Path {
        match &self.source {
            Source::Safetensors(s) => &s.dir,
            Source::Gguf(g) => g.path(),
        }
    }

    /// Checks that every tensor of `plan` is in the checkpoint with the shape it is read
    /// as, and notes it as read: a missing or misshapen tensor is refused before any row
    /// of the weight is made (the errors `rows` / `cols` give).
    pub fn check_plan(&self, plan: &MatPlan) -> MResult<()> {
        plan.check().map_err(ModelError::Plan)?;
        for p in &plan.parts {
            self.note(&p.name, &[p.n, p.k]);
            match &self.source {
                Source::Safetensors(s) => s.check_shape(&p.name, &[p.n, p.k]).map(|_| ())?,
                // GGUF checks shapes as it reads (its whole parts: see `fill`).
                Source::Gguf(_) => {}
            }
        }
        Ok(())
    }

    /// Rows `rows` of the weight `plan` describes, into `dst` (`rows.len()` × width),
    /// converted to bf16 and checked finite as `rows` / `cols` do. Safetensors rows are
    /// converted straight into `dst`, on several threads for large blocks; GGUF parts
    /// are dequantized whole and copied (small models: no chunking to save).
    pub fn fill(&self, plan: &MatPlan, rows: Range<usize>, dst: &mut [bf16]) -> MResult<()> {
        plan.check().map_err(ModelError::Plan)?;
        let width = plan.width();
        if dst.len() != rows.len() * width || rows.end > plan.rows() {
            return Err(ModelError::Plan(format!(
                "rows {rows:?} of a [{}, {width}] weight into {} values",
                plan.rows(),
                dst.len()
            )));
        }
        self.timed(|| match &self.source {
            Source::Safetensors(s) => {
                let parts = plan
                    .parts
                    .iter()
                    .map(|p| s.get(&p.name))
                    .collect::<MResult<Vec<_>>>()?;
                par_rows(dst, width, |i, d| match plan.source(rows.start + i) {
                    Some((p, r)) => {
                        let (f, t) = parts[p];
                        let part = &plan.parts[p];
                        f.read_row_into(&part.name, t, part.k, r, part.cols.clone(), d)
                    }
                    None => {
                        d.fill(bf16::ZERO);
                        Ok(())
                    }
                })
            }
            Source::Gguf(g) => {
                let blocks = plan
                    .parts
                    .iter()
                    .map(|p| {
                        if p.cols == (0..p.k) {
                            g.rows(&p.name, p.n, p.k, p.rows.clone())
                        } else {
                            let all = g.cols(&p.name, p.n, p.k, p.cols.clone())?;
                            Ok(all[p.rows.start * width..p.rows.end * width].to_vec())
                        }
                    })
                    .collect::<MResult<Vec<_>>>()?;
                for (i, d) in dst.chunks_exact_mut(width).enumerate() {
                    match plan.source(rows.start + i) {
                        Some((p, r)) => {
                            let at = (r - plan.parts[p].rows.start) * width;
                            d.copy_from_slice(&blocks[p][at..at + width]);
                        }
                        None => d.fill(bf16::ZERO),
                    }
                }
                Ok(())
            }
        })
    }

    /// Whether `fill` reads a few rows for the cost of a few rows (a backend may then
    /// fill a weight in chunks); GGUF parts are dequantized whole on every call.
    pub fn fills_by_rows(&self) -> bool {
        matches!(self.source, Source::Safetensors(_))
    }
}

/// A tensor held in the backend's memory, until its readers are done with it.
struct DeviceEntry {
    dtype: crate::safetensors::DType,
    shape: Vec<usize>,
    /// The tensor (None once released) and how many readers are still to come.
    held: Mutex<(Option<DeviceTensor>, usize)>,
}

/// A model directory's safetensors files.
pub struct SafeStore {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// tensor name -> index into `files`.
    index: HashMap<String, usize>,
    /// Tensors in the backend's memory, by name (a pushed checkpoint's).
    device: HashMap<String, DeviceEntry>,
}

impl SafeStore {
    pub fn open(dir: &Path) -> MResult<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut files = Vec::new();
        let mut index = HashMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                source,
            })?;
            let bad = |msg: String| ModelError::Safetensors {
                path: index_path.clone(),
                msg,
            };
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad("missing object \"weight_map\"".into()))?;
            let mut by_file: HashMap<String, usize> = HashMap::new();
            let mut names: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            names.sort_by(|a, b| a.0.cmp(b.0));
            for (tensor, file) in names {
                let file = file
                    .as_str()
                    .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a file name")))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(bad(format!(
                        "weight_map[{tensor:?}] = {file:?} is not a plain file name"
                    )));
                }
                let fi = match by_file.get(file) {
                    Some(&i) => i,
                    None => {
                        files.push(SafeFile::open(&dir.join(file))?);
                        by_file.insert(file.to_string(), files.len() - 1);
                        files.len() - 1
                    }
                };
                if !files[fi].tensors.contains_key(tensor) {
                    return Err(ModelError::MissingTensor {
                        dir: files[fi].path.clone(),
                        tensor: tensor.clone(),
                    });
                }
                index.insert(tensor.clone(), fi);
            }
        } else if single.exists() {
            let f = SafeFile::open(&single)?;
            for name in f.tensors.keys() {
                index.insert(name.clone(), 0);
            }
            files.push(f);
        } else {
            return Err(ModelError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors nor model.safetensors.index.json in the model directory",
                ),
            });
        }
        Ok(SafeStore {
            dir: dir.to_path_buf(),
            files,
            index,
            device: HashMap::new(),
        })
    }

    /// A checkpoint held in memory (tensors a trainer pushed), in host memory (`files`)
    /// or the backend's (`device`); `label` stands for the directory in errors. A tensor
    /// given twice is refused, naming both places.
    pub fn from_files(
        label: &Path,
        files: Vec<SafeFile>,
        device: Vec<(String, DeviceTensor)>,
    ) -> MResult<Self> {
        let mut index = HashMap::new();
        for (fi, f) in files.iter().enumerate() {
            for name in f.tensors.keys() {
                if let Some(&other) = index.get(name) {
                    let other: &SafeFile = &files[other];
                    return Err(ModelError::Safetensors {
                        path: f.path.clone(),
                        msg: format!("tensor {name:?} was also given in {}", other.path.display()),
                    });
                }
                index.insert(name.clone(), fi);
            }
        }
        let mut held = HashMap::with_capacity(device.len());
        for (name, t) in device {
            let twice = match index.get(&name) {
                Some(&fi) => Some(files[fi].path.display().to_string()),
                None if held.contains_key(&name) => Some("device memory".to_string()),
                None => None,
            };
            if let Some(other) = twice {
                return Err(ModelError::Safetensors {
                    path: label.to_path_buf(),
                    msg: format!(
                        "tensor {name:?} was received into device memory and also given in {other}"
                    ),
                });
            }
            let entry = DeviceEntry {
                dtype: t.dtype,
                shape: t.shape.clone(),
                held: Mutex::new((Some(t), 1)),
            };
            held.insert(name, entry);
        }
        Ok(SafeStore {
            dir: label.to_path_buf(),
            files,
            index,
            device: held,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.device.contains_key(name)
    }

    /// The device-resident tensor `name`, checked to be of `expected` shape.
    fn device_tensor(&self, name: &str, expected: &[usize]) -> MResult<DeviceTensor> {
        let e = self
            .device
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })?;
        if e.shape != expected {
            return Err(ModelError::ShapeMismatch {
                path: self.dir.clone(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        let held = e.held.lock().map(|h| h.0.clone()).unwrap_or_default();
        held.ok_or_else(|| {
            ModelError::Plan(format!(
                "tensor {name:?} ({} {:?}) was read after its last reader released it",
                e.dtype.name(),
                e.shape
            ))
        })
    }

    /// A device-resident tensor brought to the host whole and read as a host tensor is
    /// (a vector, or a layer whose other parts came over HTTP): the same conversion,
    /// checks and errors.
    fn device_on_host(&self, name: &str, expected: &[usize]) -> MResult<Option<SafeFile>> {
        if !self.device.contains_key(name) {
            return Ok(None);
        }
        let t = self.device_tensor(name, expected)?;
        let bytes = t.to_host().map_err(|msg| ModelError::Safetensors {
            path: self.dir.clone(),
            msg: format!("tensor {name:?}: bringing it from device memory: {msg}"),
        })?;
        SafeFile::from_tensor(&self.dir, name, t.dtype, t.shape.clone(), bytes).map(Some)
    }

    /// Elements `rows` × `cols` of the `[n, k]` tensor `name` (a vector: n = 1), from
    /// the host or device memory.
    fn block(
        &self,
        name: &str,
        shape: &[usize],
        k: usize,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> MResult<Vec<bf16>> {
        if let Some(f) = self.device_on_host(name, shape)? {
            return f.read_block(name, &f.tensors[name], k, rows, cols);
        }
        let (f, t) = self.check_shape(name, shape)?;
        f.read_block(name, t, k, rows, cols)
    }

    fn get(&self, name: &str) -> MResult<(&SafeFile, &TensorInfo)> {
        let fi = *self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })?;
        let f = &self.files[fi];
        Ok((f, &f.tensors[name]))
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> MResult<(&SafeFile, &TensorInfo)> {
        let (f, t) = self.get(name)?;
        if t.shape != expected {
            return Err(ModelError::ShapeMismatch {
                path: f.path.clone(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok((f, t))
    }

    /// Rows `rows` (all columns) of the `[n, k]` matrix `name`.
    pub fn rows(&self, name: &str, n: usize, k: usize, rows: Range<usize>) -> MResult<Vec<bf16>> {
        debug_assert!(rows.end <= n);
        self.block(name, &[n, k], k, rows, 0..k)
    }

    /// Columns `cols` of every row of the `[n, k]` matrix `name` (a strided read).
    pub fn cols(&self, name: &str, n: usize, k: usize, cols: Range<usize>) -> MResult<Vec<bf16>> {
        debug_assert!(cols.end <= k);
        self.block(name, &[n, k], k, 0..n, cols)
    }

    /// Elements `range` of the vector `name` of length `len`, as f32 (via bf16).
    pub fn vector(&self, name: &str, len: usize, range: Range<usize>) -> MResult<Vec<f32>> {
        Ok(self
            .block(name, &[len], len, 0..1, range)?
            .into_iter()
            .map(f32::from)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::DType;

    /// A store of `[n, k]` tensors whose element i is `f(i)` plus the tensor's index
    /// (bf16 or f32 in the file).
    fn store(tensors: &[(&str, usize, usize, DType)]) -> WeightStore {
        let files = tensors
            .iter()
            .enumerate()
            .map(|(t, &(name, n, k, dtype))| {
                let v = |i: usize| ((i * 7919 + t * 104_729) % 2003) as f32 / 16.0 - 60.0;
                let bytes = (0..n * k)
                    .flat_map(|i| match dtype {
                        DType::F32 => v(i).to_le_bytes().to_vec(),
                        _ => bf16::from_f32(v(i)).to_bits().to_le_bytes().to_vec(),
                    })
                    .collect();
                SafeFile::from_tensor(Path::new(name), name, dtype, vec![n, k], bytes).unwrap()
            })
            .collect();
        WeightStore::from_files(Path::new("mem"), files, Vec::new()).unwrap()
    }

    fn part(name: &str, n: usize, k: usize, rows: Range<usize>, cols: Range<usize>) -> MatPart {
        MatPart {
            name: name.into(),
            n,
            k,
            rows,
            cols,
        }
    }

    /// The weight filled whole and in chunks of `chunk` rows.
    fn filled(s: &WeightStore, plan: &MatPlan, chunk: usize) -> (Vec<bf16>, Vec<bf16>) {
        s.check_plan(plan).unwrap();
        let (n, w) = (plan.rows(), plan.width());
        let mut whole = vec![bf16::ONE; n * w];
        s.fill(plan, 0..n, &mut whole).unwrap();
        let mut chunked = vec![bf16::ONE; n * w];
        for (c, d) in chunked.chunks_mut(chunk * w).enumerate() {
            let r0 = c * chunk;
            s.fill(plan, r0..r0 + d.len() / w, d).unwrap();
        }
        (whole, chunked)
    }

    /// Every arrangement a layer asks for gives the values reading each block and
    /// arranging the blocks on the host gives (stacking, alternating rows, a column
    /// range, zero padding), filled whole or in chunks of any size.
    #[test]
    fn plans_fill_what_reading_and_arranging_gives() {
        let s = store(&[
            ("q", 40, 24, DType::BF16),
            ("k", 16, 24, DType::F32),
            ("v", 16, 24, DType::BF16),
            ("gate", 30, 24, DType::BF16),
            ("up", 30, 24, DType::F32),
        ]);
        let stacked = MatPlan {
            parts: vec![
                part("q", 40, 24, 10..30, 0..24),
                part("k", 16, 24, 4..12, 0..24),
                part("v", 16, 24, 4..12, 0..24),
            ],
            order: RowOrder::Stacked,
            pad_rows: 0,
        };
        let want: Vec<bf16> = [
            s.rows("q", 40, 24, 10..30).unwrap(),
            s.rows("k", 16, 24, 4..12).unwrap(),
            s.rows("v", 16, 24, 4..12).unwrap(),
        ]
        .concat();
        let alternating = MatPlan {
            parts: vec![
                part("gate", 30, 24, 15..30, 0..24),
                part("up", 30, 24, 15..30, 0..24),
            ],
            order: RowOrder::Alternating,
            pad_rows: 0,
        };
        let (g, u) = (
            s.rows("gate", 30, 24, 15..30).unwrap(),
            s.rows("up", 30, 24, 15..30).unwrap(),
        );
        let alt: Vec<bf16> = g
            .chunks(24)
            .zip(u.chunks(24))
            .flat_map(|(a, b)| a.iter().chain(b).copied())
            .collect();
        let cols = MatPlan {
            parts: vec![part("gate", 30, 24, 0..30, 9..21)],
            order: RowOrder::Stacked,
            pad_rows: 0,
        };
        let padded = MatPlan {
            parts: vec![part("q", 40, 24, 30..40, 0..24)],
            order: RowOrder::Stacked,
            pad_rows: 3,
        };
        let mut pad = s.rows("q", 40, 24, 30..40).unwrap();
        pad.resize(13 * 24, bf16::ZERO);
        for (plan, want) in [
            (&stacked, want),
            (&alternating, alt),
            (&cols, s.cols("gate", 30, 24, 9..21).unwrap()),
            (&padded, pad),
        ] {
            for chunk in [1, 3, 7, 64] {
                let (whole, chunked) = filled(&s, plan, chunk);
                assert_eq!(whole, want, "{plan:?}");
                assert_eq!(chunked, want, "{plan:?} in chunks of {chunk}");
            }
        }
    }

    /// A missing tensor, a wrong shape and a non-finite value are refused with the
    /// errors a read gives, naming the tensor (and the element).
    #[test]
    fn plans_refuse_what_reads_refuse() {
        let nan = {
            let mut b: Vec<u8> = (0..8).flat_map(|_| 1.0f32.to_le_bytes()).collect();
            b[5 * 4..6 * 4].copy_from_slice(&f32::NAN.to_le_bytes());
            SafeFile::from_tensor(Path::new("f"), "bad", DType::F32, vec![2, 4], b).unwrap()
        };
        let s = WeightStore::from_files(Path::new("mem"), vec![nan], Vec::new()).unwrap();
        let plan = |name: &str, n: usize| MatPlan {
            parts: vec![part(name, n, 4, 0..n, 0..4)],
            order: RowOrder::Stacked,
            pad_rows: 0,
        };
        let e = s.check_plan(&plan("gone", 2)).unwrap_err().to_string();
        assert!(e.contains("gone"), "{e}");
        let e = s.check_plan(&plan("bad", 3)).unwrap_err().to_string();
        assert!(e.contains("bad") && e.contains("[3, 4]"), "{e}");
        let p = plan("bad", 2);
        s.check_plan(&p).unwrap();
        let mut d = vec![bf16::ZERO; 8];
        let e = s.fill(&p, 0..2, &mut d).unwrap_err().to_string();
        let want = s.rows("bad", 2, 4, 0..2).unwrap_err().to_string();
        assert_eq!(e, want);
        assert!(e.contains("element 5") && e.contains("NaN"), "{e}");
        // The first row alone is fine.
        s.fill(&p, 0..1, &mut d[..4]).unwrap();
        let mut short = vec![bf16::ZERO; 3];
        assert!(
            s.fill(&p, 0..1, &mut short).is_err(),
            "a buffer of the wrong size"
        );
    }

    /// `ARBOR_LOAD_PROFILE=<model dir> cargo test --release -p arbor-model load_profile --
    /// --ignored --nocapture`: the host side of a load, per pass over every matrix of the
    /// checkpoint: reading into a fresh buffer per tensor (what a load did), and filling
    /// reused upload-sized chunks (what a backend's chunked upload does).
    #[test]
    #[ignore]
    fn load_profile() {
        let Ok(dir) = std::env::var("ARBOR_LOAD_PROFILE") else {
            eprintln!("set ARBOR_LOAD_PROFILE to a model directory");
            return;
        };
        let s = WeightStore::open(Path::new(&dir)).unwrap();
        let Source::Safetensors(ss) = &s.source else {
            panic!("a safetensors directory")
        };
        let mut mats: Vec<(String, usize, usize)> = ss
            .index
            .keys()
            .filter_map(|name| {
                let (_, t) = ss.get(name).ok()?;
                (t.shape.len() == 2).then(|| (name.clone(), t.shape[0], t.shape[1]))
            })
            .collect();
        mats.sort();
        let bytes: usize = mats.iter().map(|(_, n, k)| n * k * 2).sum();
        let gbs = |t: Instant| bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        let chunk = 32 << 20; // elements: 64 MiB of bf16
        let mut buf = vec![bf16::ZERO; chunk];
        for pass in 0..3 {
            let t = Instant::now();
            for (name, n, k) in &mats {
                let v = s.rows(name, *n, *k, 0..*n).unwrap();
                std::hint::black_box(v.to_vec());
            }
            let old = gbs(t);
            let t = Instant::now();
            for (name, n, k) in &mats {
                let plan = MatPlan {
                    parts: vec![MatPart {
                        name: name.clone(),
                        n: *n,
                        k: *k,
                        rows: 0..*n,
                        cols: 0..*k,
                    }],
                    order: RowOrder::Stacked,
                    pad_rows: 0,
                };
                let per = (chunk / k).max(1);
                let mut r = 0;
                while r < *n {
                    let rows = r..(r + per).min(*n);
                    s.fill(&plan, rows.clone(), &mut buf[..rows.len() * k])
                        .unwrap();
                    r = rows.end;
                }
            }
            let new = gbs(t);
            println!(
                "pass {pass}: {:.2} GB of matrices; fresh buffer per tensor + copy: {old:.2} GB/s; \
                 reused 64 MiB chunks: {new:.2} GB/s ({} threads)",
                bytes as f64 / 1e9,
                std::thread::available_parallelism().map_or(1, |n| n.get())
            );
        }
    }
}
