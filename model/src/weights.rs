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

    /// A checkpoint held in memory (tensors a trainer pushed); `label` stands for the
    /// directory in errors.
    pub fn from_files(label: &Path, files: Vec<SafeFile>) -> MResult<Self> {
        SafeStore::from_files(label, files).map(|s| Self::with(Source::Safetensors(s)))
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
}

/// A model directory's safetensors files.
pub struct SafeStore {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// tensor name -> index into `files`.
    index: HashMap<String, usize>,
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
        })
    }

    /// A checkpoint held in memory (tensors a trainer pushed); `label` stands for the
    /// directory in errors. A tensor in two of the files is refused, naming both.
    pub fn from_files(label: &Path, files: Vec<SafeFile>) -> MResult<Self> {
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
        Ok(SafeStore {
            dir: label.to_path_buf(),
            files,
            index,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
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
        let (f, t) = self.check_shape(name, &[n, k])?;
        debug_assert!(rows.end <= n);
        f.read_block(name, t, k, rows, 0..k)
    }

    /// Columns `cols` of every row of the `[n, k]` matrix `name` (a strided read).
    pub fn cols(&self, name: &str, n: usize, k: usize, cols: Range<usize>) -> MResult<Vec<bf16>> {
        let (f, t) = self.check_shape(name, &[n, k])?;
        debug_assert!(cols.end <= k);
        f.read_block(name, t, k, 0..n, cols)
    }

    /// Elements `range` of the vector `name` of length `len`, as f32 (via bf16).
    pub fn vector(&self, name: &str, len: usize, range: Range<usize>) -> MResult<Vec<f32>> {
        let (f, t) = self.check_shape(name, &[len])?;
        Ok(f.read_block(name, t, len, 0..1, range)?
            .into_iter()
            .map(f32::from)
            .collect())
    }
}
