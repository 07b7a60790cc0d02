//! Device memory: uploads, downloads, allocations and copies.

use cudarc::driver::DeviceRepr;

use super::{check, DevBf16, DevF32, DevU32};
use crate::cuda::buf::DevBuf;
use crate::cuda::staging::Staged;
use crate::cuda::upload_ring::RowsUploadError;
use crate::cuda::{CudaError, GpuDevice};

impl GpuDevice {
    /// A copy of host data in a buffer of its own (never lent: uploads hold weights,
    /// tables and the inputs of steps, which outlive a step).
    pub fn upload<T: DeviceRepr>(&self, what: &str, data: &[T]) -> Result<DevBuf<T>, CudaError> {
        if data.is_empty() {
            // SAFETY: no elements to leave undefined.
            return self
                .drv(what, unsafe { self.stream.alloc::<T>(0) })
                .map(DevBuf::owned);
        }
        self.drv(what, self.stream.clone_htod(data))
            .map(DevBuf::owned)
    }

    pub fn upload_f32(&self, data: &[f32]) -> Result<DevF32, CudaError> {
        self.upload("uploading f32 data", data)
    }

    pub fn upload_bf16(&self, data: &[half::bf16]) -> Result<DevBf16, CudaError> {
        self.upload("uploading bf16 data", bytemuck::cast_slice::<_, u16>(data))
    }

    /// A weight of `n` rows of `k` bf16 that `fill(rows, dst)` writes a chunk at a time
    /// into page-locked memory, each chunk's copy overlapping the next one's fill
    /// (upload_ring.rs).
    pub fn upload_bf16_rows<E>(
        &self,
        n: usize,
        k: usize,
        fill: impl FnMut(std::ops::Range<usize>, &mut [half::bf16]) -> Result<(), E>,
    ) -> Result<DevBf16, RowsUploadError<E>> {
        self.uploads
            .upload_rows(&self.ctx, &self.stream, self.ordinal, n, k, fill)
            .map(DevBuf::owned)
    }

    pub fn upload_u32(&self, data: &[u32]) -> Result<DevU32, CudaError> {
        self.upload("uploading u32 data", data)
    }

    /// `words` u32 written by `fill` (into memory with undefined contents) and copied to
    /// the device beside the work queued on the stream, which waits for the copy before
    /// its next work (staging.rs): for uploads made while the device is busy.
    pub fn stage_beside(
        &self,
        words: usize,
        fill: impl FnOnce(&mut [u32]),
    ) -> Result<Staged<'_>, CudaError> {
        self.staging
            .stage(&self.ctx, &self.stream, self.ordinal, words, fill)
    }

    /// Overwrites the device memory at `dst` with `data` (stream-ordered).
    ///
    /// # Safety
    /// `dst` is device memory of this device with room for `data`.
    pub unsafe fn write_raw<T: DeviceRepr>(&self, dst: u64, data: &[T]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        self.drv("binding the context", self.ctx.bind_to_thread())?;
        self.drv("uploading", unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream())
        })
    }

    /// The first `len` values of `buf` on the host. A copy into pageable memory returns
    /// once it has completed, so this waits for the stream's earlier work.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        what: &str,
        buf: &DevBuf<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.download_range(what, buf, 0..len)
    }

    /// Values `range` of `buf` on the host (see `download`).
    pub fn download_range<T: DeviceRepr + Default + Clone>(
        &self,
        what: &str,
        buf: &DevBuf<T>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<T>, CudaError> {
        check(
            "download",
            range.start <= range.end && range.end <= buf.len(),
            || format!("values {range:?} from a buffer of {}", buf.len()),
        )?;
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = vec![T::default(); range.len()];
        self.drv(what, self.stream.memcpy_dtoh(&buf.slice(range), &mut out))?;
        Ok(out)
    }

    pub fn download_f32(&self, buf: &DevF32) -> Result<Vec<f32>, CudaError> {
        self.download("downloading f32 data", buf, buf.len())
    }

    pub fn download_bf16(&self, buf: &DevBf16) -> Result<Vec<half::bf16>, CudaError> {
        let bits = self.download("downloading bf16 data", buf, buf.len())?;
        Ok(bits.into_iter().map(half::bf16::from_bits).collect())
    }

    /// A buffer of `len` values with undefined contents: lent by the workspace while a
    /// step scope is open (buf.rs), else a stream-ordered allocation of its own.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DevBuf<T>, CudaError> {
        if let Some(b) = self.drv(
            "lending from the step workspace",
            self.workspace.lend::<T>(&self.stream, len),
        )? {
            return Ok(b);
        }
        // SAFETY: callers write every element before anything reads it (or zero it).
        self.drv("allocating", unsafe { self.stream.alloc::<T>(len) })
            .map(DevBuf::owned)
    }

    /// `alloc`, zeroed (stream-ordered).
    pub fn alloc_zeroed<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DevBuf<T>, CudaError> {
        let mut b = self.alloc::<T>(len)?;
        if len > 0 {
            self.drv("zeroing", self.stream.memset_zeros(&mut *b))?;
        }
        Ok(b)
    }

    /// An f32 buffer with undefined contents, for an output that a kernel writes in full:
    /// saves the memset a zeroed buffer costs on every op.
    pub fn empty_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        self.alloc(len)
    }

    /// Zeroes `buf`'s values from `from` on (stream-ordered).
    pub fn zero_from<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &mut DevBuf<T>,
        from: usize,
    ) -> Result<(), CudaError> {
        check("zero_from", from <= buf.len(), || {
            format!("zeroing from {from} in a buffer of {}", buf.len())
        })?;
        if from == buf.len() {
            return Ok(());
        }
        let len = buf.len();
        self.drv(
            "zeroing",
            self.stream.memset_zeros(&mut buf.slice_mut(from..len)),
        )
    }

    pub fn zeros_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        self.alloc_zeroed(len)
    }

    /// A bf16 buffer with undefined contents (see `empty_f32`).
    pub fn empty_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        self.alloc(len)
    }

    pub fn zeros_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        self.alloc_zeroed(len)
    }

    pub fn copy_f32(&self, src: &DevF32) -> Result<DevF32, CudaError> {
        let mut out = self.empty_f32(src.len())?;
        if !src.is_empty() {
            self.drv(
                "copying f32 buffer",
                self.stream.memcpy_dtod(&**src, &mut *out),
            )?;
        }
        Ok(out)
    }
}
