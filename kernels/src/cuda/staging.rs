//! A pinned (page-locked) host buffer for uploads made while the stream is busy: a copy
//! from pageable memory waits for the stream to reach it (the driver stages it in pieces),
//! so the host would sit out the work queued before it; from pinned memory the copy is
//! queued and the host goes on.

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::result as dres;

use crate::cuda::CudaError;

/// Page-locked host memory of `words` u32, grown on demand and kept for the device's
/// lifetime.
struct Block {
    ptr: *mut u32,
    words: usize,
}

// SAFETY: plain host memory; `Staging`'s lock keeps one user at a time, and each use
// waits for its copy to finish before the lock is let go (see `Staging::lock`).
unsafe impl Send for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `Staging::lock` and freed once.
        if let Err(e) = unsafe { dres::free_host(self.ptr.cast()) } {
            tracing::warn!(
                "cuMemFreeHost of {} words of upload staging: {e:?}",
                self.words
            );
        }
    }
}

/// The device's upload staging (see the module comment).
#[derive(Default)]
pub struct Staging(Mutex<Option<Block>>);

/// `words` u32 of pinned memory, held until dropped.
pub struct Staged<'a> {
    guard: MutexGuard<'a, Option<Block>>,
    words: usize,
}

impl Staging {
    /// The buffer with room for `words` u32 (contents undefined). The caller binds the
    /// device's context to this thread first, and must have waited for every copy it
    /// queued from the buffer (a synchronous download after it) before dropping it.
    pub fn lock(&self, ordinal: usize, words: usize) -> Result<Staged<'_>, CudaError> {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|b| b.words < words) {
            *guard = None;
            let grown = words.next_power_of_two().max(1024);
            // SAFETY: a plain allocation of `grown` u32.
            let ptr =
                unsafe { dres::malloc_host(grown * 4, 0) }.map_err(|source| CudaError::Driver {
                    ordinal,
                    what: format!("cuMemHostAlloc of {} bytes of upload staging", grown * 4),
                    source,
                })?;
            *guard = Some(Block {
                ptr: ptr.cast(),
                words: grown,
            });
        }
        Ok(Staged { guard, words })
    }
}

impl Staged<'_> {
    pub fn as_mut_slice(&mut self) -> &mut [u32] {
        match self.guard.as_mut() {
            // SAFETY: the block holds at least `words` u32 (`lock`), and the guard gives
            // this one user alone access to it.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.ptr, self.words) },
            None => &mut [],
        }
    }
}
