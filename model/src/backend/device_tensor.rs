//! Tensors that stay in a backend's device memory between a trainer's broadcast and the
//! weight update that cuts them into the new model's shards (docs/rl.md): the host code
//! sees their dtype, shape and size, never their bytes; only the backend that received
//! them reads them, through [`Backend::mat_from_device`](super::Backend::mat_from_device).

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use crate::safetensors::DType;

/// Bytes a backend holds in its own memory: one received broadcast (a tensor, or a packed
/// buffer of several). Freed when the last [`DeviceTensor`] that points into it goes.
pub trait DeviceBytes: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes `range` on the host: a vector's few values, the element an error names.
    fn read(&self, range: Range<usize>) -> Result<Vec<u8>, String>;

    /// For the backend that made them, to reach its own buffer.
    fn as_any(&self) -> &dyn Any;
}

/// One tensor of `dtype` and `shape` lying at `range` of `bytes`.
#[derive(Clone)]
pub struct DeviceTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Arc<dyn DeviceBytes>,
    pub range: Range<usize>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("range", &self.range)
            .finish_non_exhaustive()
    }
}

impl DeviceTensor {
    /// The tensor at `range` of `bytes`, which must hold exactly `shape` × `dtype` bytes
    /// (else the message says how many it holds and needs).
    pub fn new(
        dtype: DType,
        shape: Vec<usize>,
        bytes: Arc<dyn DeviceBytes>,
        range: Range<usize>,
    ) -> Result<Self, String> {
        let want = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if want != Some(range.len()) || range.end > bytes.len() {
            return Err(format!(
                "bytes {range:?} of {}, but shape {shape:?} × {} needs {want:?}",
                bytes.len(),
                dtype.name()
            ));
        }
        Ok(DeviceTensor {
            dtype,
            shape,
            bytes,
            range,
        })
    }

    pub fn len_bytes(&self) -> usize {
        self.range.len()
    }

    /// The whole tensor on the host (its little-endian bytes).
    pub fn to_host(&self) -> Result<Vec<u8>, String> {
        self.bytes.read(self.range.clone())
    }
}

/// A block of a device-resident tensor read as `[*, k]` (a vector as one row): rows
/// `rows` × columns `cols`, converted to bf16, landing at rows `dst_row0`,
/// `dst_row0 + dst_step`, … of the matrix being made.
#[derive(Debug, Clone)]
pub struct DeviceCut<'a> {
    pub src: &'a DeviceTensor,
    pub k: usize,
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    pub dst_row0: usize,
    pub dst_step: usize,
}

/// The first value of a cut that is not finite in bf16: the index of the cut, and the
/// element's flat index in its source tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFinite {
    pub cut: usize,
    pub flat: usize,
}

/// What one broadcast carries: elements of a dtype (a tensor), or raw bytes (a packed
/// buffer of vLLM's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Elements(DType),
    Bytes,
}

/// Bytes held in host memory: the CPU backend's "device" memory.
pub struct HostBytes(pub Vec<u8>);

impl DeviceBytes for HostBytes {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn read(&self, range: Range<usize>) -> Result<Vec<u8>, String> {
        self.0
            .get(range.clone())
            .map(<[u8]>::to_vec)
            .ok_or_else(|| format!("bytes {range:?} of a buffer of {}", self.0.len()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
