//! Weights uploaded chunk by chunk through two page-locked host buffers: while the device
//! copies one chunk, the host fills the other. A copy of a whole tensor from pageable
//! memory goes through the driver's own bounce buffer and returns only once done, so the
//! host's reading and the copy take turns and the copy runs at the pageable rate; here
//! they overlap, and the copy runs at the pinned rate, well above what the host reads.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{result as dres, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut};
use half::bf16;

use crate::cuda::CudaError;

/// Bytes of each of the two buffers: large enough that a chunk's fixed costs (a copy
/// launch, the host threads that fill it) are small beside its fill, small enough that
/// the first fill, which nothing overlaps, is short.
pub const CHUNK_BYTES: usize = 64 << 20;

/// One page-locked buffer of `elems` bf16 and the event recorded after the last copy
/// from it.
struct Slot {
    host: *mut bf16,
    elems: usize,
    done: CudaEvent,
    pending: bool,
}

// SAFETY: plain host memory; `UploadRing`'s lock keeps one user at a time, and a slot is
// written only after its last copy's event has completed.
unsafe impl Send for Slot {}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.pending {
            if let Err(e) = self.done.synchronize() {
                tracing::warn!("waiting for a weight copy before freeing its buffer: {e:?}");
            }
        }
        // SAFETY: allocated by cuMemHostAlloc in `UploadRing::slots` and freed once, after
        // the copy reading it completed.
        if let Err(e) = unsafe { dres::free_host(self.host.cast()) } {
            tracing::warn!(
                "cuMemFreeHost of {} bf16 of upload buffer: {e:?}",
                self.elems
            );
        }
    }
}

/// Why a chunked upload failed: the caller's fill, or the driver.
#[derive(Debug)]
pub enum RowsUploadError<E> {
    Fill(E),
    Cuda(CudaError),
}

/// The device's two upload buffers (made on first use, kept for the device's lifetime:
/// 2 × [`CHUNK_BYTES`] of page-locked host memory), and the time spent waiting for them.
#[derive(Default)]
pub struct UploadRing {
    slots: Mutex<Option<(Slot, Slot)>>,
    wait_ns: AtomicU64,
}

impl UploadRing {
    /// Seconds the host waited for a copy to free a buffer (the uploads' share of a load
    /// that the host's filling did not hide).
    pub fn wait_seconds(&self) -> f64 {
        self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// A device buffer of `n` rows of `k` bf16, written by `fill(rows, dst)` a chunk of
    /// rows at a time into page-locked memory and copied on `stream` (of `ctx`, device
    /// `ordinal`) while the next chunk is filled. The copies are ordered on `stream`
    /// before its later work; the call returns once the last chunk is queued.
    pub fn upload_rows<E>(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ordinal: usize,
        n: usize,
        k: usize,
        mut fill: impl FnMut(Range<usize>, &mut [bf16]) -> Result<(), E>,
    ) -> Result<CudaSlice<u16>, RowsUploadError<E>> {
        let drv = |what: &str| {
            let what = what.to_string();
            move |source| {
                RowsUploadError::Cuda(CudaError::Driver {
                    ordinal,
                    what,
                    source,
                })
            }
        };
        ctx.bind_to_thread().map_err(drv("binding the context"))?;
        let total = n.checked_mul(k).ok_or_else(|| {
            RowsUploadError::Cuda(CudaError::Launch {
                kernel: "weight upload",
                msg: format!("[{n}, {k}] overflows"),
            })
        })?;
        // SAFETY: every element is written by the copies below before anything reads it.
        let mut dev = unsafe { stream.alloc::<u16>(total) }.map_err(drv("allocating a weight"))?;
        if total == 0 {
            return Ok(dev);
        }
        let mut guard = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let elems = (CHUNK_BYTES / 2).max(k);
        if guard.as_ref().is_none_or(|(a, _)| a.elems < elems) {
            // Dropping the old pair waits for the copies from it.
            *guard = None;
            let slot = || -> Result<Slot, RowsUploadError<E>> {
                // SAFETY: a plain allocation of `elems` bf16 (flags 0: cached, not
                // write-combined, since the host reads back what it writes to check it).
                let host = unsafe { dres::malloc_host(elems * 2, 0) }
                    .map_err(drv("allocating a page-locked upload buffer"))?;
                let done = ctx
                    .new_event(None)
                    .map_err(drv("creating an upload event"))?;
                Ok(Slot {
                    host: host.cast(),
                    elems,
                    done,
                    pending: false,
                })
            };
            *guard = Some((slot()?, slot()?));
        }
        let (a, b) = guard.as_mut().ok_or_else(|| {
            RowsUploadError::Cuda(CudaError::Launch {
                kernel: "weight upload",
                msg: "no upload buffers after making them".into(),
            })
        })?;
        let slots = [a, b];
        let rows_per = (slots[0].elems / k).max(1);
        let (base, record) = dev.device_ptr_mut(stream);
        let mut next = 0;
        let mut r = 0;
        while r < n {
            let rows = r..(r + rows_per).min(n);
            let slot = &mut *slots[next];
            next ^= 1;
            if slot.pending {
                let t0 = Instant::now();
                slot.done
                    .synchronize()
                    .map_err(drv("waiting for a weight copy"))?;
                slot.pending = false;
                self.wait_ns
                    .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            // SAFETY: the slot holds at least `rows_per * k` values, no copy reads it (its
            // event completed), and the lock gives this caller alone access to it.
            let host = unsafe { std::slice::from_raw_parts_mut(slot.host, rows.len() * k) };
            fill(rows.clone(), host).map_err(RowsUploadError::Fill)?;
            let dst = base + (rows.start * k * 2) as u64;
            // SAFETY: `dst` lies inside `dev` with room for the chunk; the host memory is
            // page-locked and unchanged until the event recorded next completes.
            unsafe { dres::memcpy_htod_async(dst, &*host, stream.cu_stream()) }
                .map_err(drv("copying weight rows to the device"))?;
            slot.done
                .record(stream)
                .map_err(drv("recording an upload event"))?;
            slot.pending = true;
            r = rows.end;
        }
        drop(record);
        Ok(dev)
    }
}
