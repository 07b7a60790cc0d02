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
use crate::safetensors::{SafeFile, TensorInfo};

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
