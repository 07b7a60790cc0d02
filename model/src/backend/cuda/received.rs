//! Tensors a trainer broadcast, kept in device memory ([`CudaBytes`]), and the weight
//! update's cuts of them into this rank's shards on the device: one kernel per block
//! (`cut_to_bf16_kernel`) takes a range of rows or columns, converts f16/f32 to bf16 as
//! the host does and finds the first value that is not finite; the flags of a weight's
//! blocks come back to the host once per weight.

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use arbor_kernels::cuda::{CutDest, CutSource, SourceType};
use cudarc::driver::CudaSlice;

use super::{CudaBackend, CudaMat};
use crate::backend::{BResult, BackendError, DeviceBytes, DeviceCut, NonFinite};
use crate::safetensors::DType;

/// One received broadcast in device memory (None: an empty one). Freed, stream-ordered
/// after its readers, when dropped.
pub(super) struct CudaBytes {
    buf: Option<CudaSlice<u8>>,
}

impl CudaBytes {
    pub(super) fn new(buf: CudaSlice<u8>) -> Self {
        CudaBytes { buf: Some(buf) }
    }

    pub(super) fn empty() -> Self {
        CudaBytes { buf: None }
    }
}

impl DeviceBytes for CudaBytes {
    fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, CudaSlice::len)
    }

    fn read(&self, range: Range<usize>) -> Result<Vec<u8>, String> {
        if range.start > range.end || range.end > self.len() {
            return Err(format!("bytes {range:?} of a buffer of {}", self.len()));
        }
        let Some(buf) = self.buf.as_ref().filter(|_| !range.is_empty()) else {
            return Ok(Vec::new());
        };
        let mut out = vec![0u8; range.len()];
        // Into pageable memory: returns once the copy (and the stream's earlier work, the
        // broadcast that wrote the bytes) is done.
        buf.stream()
            .memcpy_dtoh(&buf.slice(range.clone()), &mut out)
            .map_err(|e| format!("copying bytes {range:?} to the host: {e:?}"))?;
        Ok(out)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn source_type(d: DType) -> SourceType {
    match d {
        DType::BF16 => SourceType::Bf16,
        DType::F16 => SourceType::F16,
        DType::F32 => SourceType::F32,
    }
}

impl CudaBackend {
    pub(super) fn device_bytes_from_host(&self, data: &[u8]) -> BResult<Arc<dyn DeviceBytes>> {
        if data.is_empty() {
            return Ok(Arc::new(CudaBytes::empty()));
        }
        let buf = self
            .dev
            .stream
            .clone_htod(data)
            .map_err(|e| self.dev_err_msg("uploading a tensor's bytes", e))?;
        Ok(Arc::new(CudaBytes::new(buf)))
    }

    pub(super) fn cut_mat(
        &self,
        n: usize,
        k: usize,
        cuts: &[DeviceCut<'_>],
    ) -> BResult<Result<CudaMat, NonFinite>> {
        let covered: usize = cuts.iter().map(|c| c.rows.len()).sum();
        let mut buf = if covered < n {
            self.dev.zeros_bf16(n * k)
        } else {
            self.dev.empty_bf16(n * k)
        }
        .map_err(|e| self.dev_err(e))?;
        let mut flags = self
            .dev
            .stream
            .clone_htod(&vec![u64::MAX; cuts.len()])
            .map_err(|e| self.dev_err_msg("uploading the non-finite flags", e))?;
        for (i, c) in cuts.iter().enumerate() {
            let held = c
                .src
                .bytes
                .as_any()
                .downcast_ref::<CudaBytes>()
                .ok_or_else(|| {
                    BackendError::Unsupported(format!(
                        "rank {}: a device tensor the CUDA backend did not make",
                        self.comm.rank()
                    ))
                })?;
            let Some(src) = held.buf.as_ref() else {
                if c.rows.is_empty() || c.cols.is_empty() {
                    continue;
                }
                return Err(self.shape_err(format!(
                    "cut {i}: rows {:?} × columns {:?} of an empty tensor",
                    c.rows, c.cols
                )));
            };
            if c.src.range.end > src.len() {
                return Err(self.shape_err(format!(
                    "cut {i}: bytes {:?} of a buffer of {}",
                    c.src.range,
                    src.len()
                )));
            }
            let view = src.slice(c.src.range.clone());
            let from = CutSource {
                src: &view,
                dtype: source_type(c.src.dtype),
                k: c.k,
            };
            let to = CutDest {
                dst: &mut buf,
                k,
                row0: c.dst_row0,
                step: c.dst_step,
            };
            let mut flag = flags.slice_mut(i..i + 1);
            self.dev
                .cut_to_bf16(&from, c.rows.clone(), c.cols.clone(), to, &mut flag)
                .map_err(|e| self.dev_err(e))?;
        }
        // One read per weight: it also waits for the cuts, so the received buffers a
        // caller frees next are no longer read.
        let bad = self
            .dev
            .stream
            .clone_dtoh(&flags)
            .map_err(|e| self.dev_err_msg("reading the non-finite flags", e))?;
        if let Some((cut, &flat)) = bad.iter().enumerate().find(|(_, &f)| f != u64::MAX) {
            return Ok(Err(NonFinite {
                cut,
                flat: flat as usize,
            }));
        }
        Ok(Ok(CudaMat { buf, n, k }))
    }
}
