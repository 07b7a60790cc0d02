//! Uploads made while the stream is busy: written into pinned (page-locked) host memory and
//! copied on a side stream, so that the copy runs beside the work queued on the main
//! stream, which waits for it only where it reads it. (From pageable memory a copy waits
//! for the stream to reach it, the host with it.)

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result as dres, CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::cuda::CudaError;

/// Page-locked host memory and a device buffer of `words` u32 each, grown on demand and
/// kept for the device's lifetime, and the side stream that copies one to the other.
struct Blocks {
    host: *mut u32,
    words: usize,
    dev: CudaSlice<u32>,
    side: Arc<CudaStream>,
}

// SAFETY: plain host memory; `Staging`'s lock keeps one user at a time, and each use waits
// for the work that reads the memory before the lock is let go (see `Staged`).
unsafe impl Send for Blocks {}

impl Drop for Blocks {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `Staging::stage` and freed once.
        if let Err(e) = unsafe { dres::free_host(self.host.cast()) } {
            tracing::warn!(
                "cuMemFreeHost of {} words of upload staging: {e:?}",
                self.words
            );
        }
    }
}

/// The device's upload staging (see the module comment).
#[derive(Default)]
pub struct Staging(Mutex<Option<Blocks>>);

/// An upload in flight: its device copy's address, held until dropped. Drop it only after
/// waiting for the main stream's work that reads it (a synchronous download after it).
pub struct Staged<'a> {
    _guard: MutexGuard<'a, Option<Blocks>>,
    pub addr: u64,
}

impl Staging {
    /// `words` u32 written by `fill` (into memory with undefined contents), copied to the
    /// device on the side stream; `main` (a stream of `ctx`, device `ordinal`) waits for
    /// the copy before its next work (`GpuDevice::stage_beside`).
    pub fn stage(
        &self,
        ctx: &Arc<CudaContext>,
        main: &CudaStream,
        ordinal: usize,
        words: usize,
        fill: impl FnOnce(&mut [u32]),
    ) -> Result<Staged<'_>, CudaError> {
        let drv = |what: &str, e: cudarc::driver::DriverError| CudaError::Driver {
            ordinal,
            what: what.to_string(),
            source: e,
        };
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        ctx.bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        if guard.as_ref().is_none_or(|b| b.words < words) {
            let side = match guard.take() {
                Some(b) => b.side.clone(),
                None => ctx
                    .new_stream()
                    .map_err(|e| drv("creating the upload stream", e))?,
            };
            let grown = words.next_power_of_two().max(1024);
            // SAFETY: a plain allocation of `grown` u32.
            let host = unsafe { dres::malloc_host(grown * 4, 0) }
                .map_err(|e| drv("allocating pinned upload staging", e))?;
            // SAFETY: written by every upload before any read.
            let dev = unsafe { side.alloc::<u32>(grown) }
                .map_err(|e| drv("allocating the device's upload staging", e))?;
            side.synchronize()
                .map_err(|e| drv("allocating the device's upload staging", e))?;
            *guard = Some(Blocks {
                host: host.cast(),
                words: grown,
                dev,
                side,
            });
        }
        let b = guard.as_mut().ok_or_else(|| CudaError::Launch {
            kernel: "upload staging",
            msg: "no staging after growing it".into(),
        })?;
        // SAFETY: the block holds at least `words` u32, and the guard gives this caller
        // alone access to it; the previous upload's readers were waited for before its
        // guard was dropped.
        let host = unsafe { std::slice::from_raw_parts_mut(b.host, words) };
        fill(host);
        let addr = b.dev.device_ptr(&b.side).0;
        // SAFETY: the device block holds `words` u32; the host memory is pinned and stays
        // unchanged until the guard is dropped.
        unsafe { dres::memcpy_htod_async(addr, &*host, b.side.cu_stream()) }
            .map_err(|e| drv("uploading from pinned staging", e))?;
        main.join(&b.side)
            .map_err(|e| drv("ordering the main stream after the upload", e))?;
        Ok(Staged {
            _guard: guard,
            addr,
        })
    }
}
