//! Device buffers and the step workspace.
//!
//! A [`DevBuf`] is either owned (a stream-ordered allocation, freed on drop like cudarc's
//! `CudaSlice`) or lent by the device's [`Workspace`]: a block of memory the workspace
//! keeps for the device's lifetime, given back to it on drop without a CUDA call.
//!
//! Why lent buffers exist: a decode step recorded as a CUDA graph must not allocate. A
//! stream-ordered allocation inside a capture becomes a graph memory node, and such nodes
//! sit between the kernels and break their programmatic (PDL) edges; a free of memory the
//! graph did not allocate cannot be captured at all. While a step runs inside
//! [`Workspace::scope`], every buffer the ops allocate is lent, the kernels only ever see
//! the workspace's fixed addresses, and the graph is kernel nodes only (as PyTorch's graph
//! pool does). Blocks are reused in stream order: all work is on one stream, so a block
//! given back is rewritten only by work queued after its last reader.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result as dres, CudaContext, CudaSlice, CudaStream, DeviceRepr};

/// A device buffer of `T`: owned, or lent by a [`Workspace`] (see the module comment).
/// Dereferences to the `CudaSlice` the kernels and cudarc take.
pub struct DevBuf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    lease: Option<Lease>,
    /// Memory another library owns (a torch tensor's): never freed here.
    borrowed: bool,
}

struct Lease {
    pool: Arc<Mutex<Pool>>,
    addr: u64,
    class: usize,
}

impl<T> DevBuf<T> {
    /// An owned buffer: freed (stream-ordered) when dropped.
    pub fn owned(slice: CudaSlice<T>) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            lease: None,
            borrowed: false,
        }
    }

    /// A view of `len` values of `T` at `ptr`, memory another library owns and frees
    /// (a torch tensor's): dropping the view releases the handle only.
    ///
    /// # Safety
    /// `ptr` addresses `len` values of `T` on `stream`'s device, which stay allocated and
    /// are written by no other work while the view (and any kernel reading it) lives.
    pub unsafe fn borrowed(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Self {
        Self {
            slice: ManuallyDrop::new(stream.upgrade_device_ptr(ptr, len)),
            lease: None,
            borrowed: true,
        }
    }

    /// Whether the workspace lent this buffer.
    pub fn is_lent(&self) -> bool {
        self.lease.is_some()
    }
}

impl<T> Deref for DevBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DevBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.lease.take() {
            None if self.borrowed => {
                slice.leak();
            }
            None => drop(slice),
            Some(l) => {
                // The memory is the workspace's: release the handle without freeing it.
                slice.leak();
                lock(&l.pool).arena.give_back(l.addr, l.class);
            }
        }
    }
}

impl<T> std::fmt::Debug for DevBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevBuf")
            .field("len", &self.slice.len())
            .field("lent", &self.lease.is_some())
            .finish()
    }
}

fn lock(p: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// Smallest block, and the alignment of every block (TMA and vector loads need 16 bytes).
const MIN_BLOCK: usize = 256;
/// Fresh memory is taken from the driver in chunks of at least this many bytes.
const CHUNK_BYTES: usize = 64 << 20;

/// The block size a request of `bytes` gets: a multiple of [`MIN_BLOCK`], rounded up to
/// one of eight steps per power of two above 2 KiB (at most 12.5 % unused there), so that
/// requests of nearly the same size share free lists.
pub fn block_class(bytes: usize) -> usize {
    let b = bytes.max(MIN_BLOCK);
    let step = ((1usize << (usize::BITS - 1 - b.leading_zeros())) / 8).max(MIN_BLOCK);
    b.div_ceil(step) * step
}

/// The workspace's bookkeeping, apart from CUDA: chunks of address space, a bump pointer
/// in the newest chunk, and a free list per block class. Host-only, so it is tested
/// without a GPU.
#[derive(Debug, Default)]
pub struct Arena {
    /// (base, bytes) of every chunk, oldest first.
    chunks: Vec<(u64, usize)>,
    /// Next free byte of the newest chunk.
    bump: usize,
    free: HashMap<usize, Vec<u64>>,
    lent_bytes: usize,
}

impl Arena {
    /// A block of `class` bytes (a [`block_class`] value): the most recently given back
    /// one of that class, else carved from the newest chunk; `None` when a new chunk is
    /// needed.
    pub fn lend(&mut self, class: usize) -> Option<u64> {
        let addr = match self.free.get_mut(&class).and_then(Vec::pop) {
            Some(a) => a,
            None => {
                let &(base, bytes) = self.chunks.last()?;
                if bytes - self.bump < class {
                    return None;
                }
                let a = base + self.bump as u64;
                self.bump += class;
                a
            }
        };
        self.lent_bytes += class;
        Some(addr)
    }

    pub fn give_back(&mut self, addr: u64, class: usize) {
        self.lent_bytes -= class;
        self.free.entry(class).or_default().push(addr);
    }

    /// Makes `(base, bytes)` the chunk new blocks are carved from (the rest of the old
    /// newest chunk stays unused: blocks are never split).
    pub fn add_chunk(&mut self, base: u64, bytes: usize) {
        self.chunks.push((base, bytes));
        self.bump = 0;
    }

    pub fn reserved_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.1).sum()
    }

    pub fn lent_bytes(&self) -> usize {
        self.lent_bytes
    }

    /// Forgets every chunk and returns them for the caller to free, when no block is
    /// lent; `None` (nothing changed) while any is.
    pub fn take_chunks_if_idle(&mut self) -> Option<Vec<(u64, usize)>> {
        if self.lent_bytes != 0 {
            return None;
        }
        self.free.clear();
        self.bump = 0;
        Some(std::mem::take(&mut self.chunks))
    }
}

struct Pool {
    arena: Arena,
    /// Open [`Workspace::scope`]s.
    scopes: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // Work queued on the blocks may still run.
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronising before freeing the step workspace: {e:?}");
        }
        for &(base, _) in &self.arena.chunks {
            // SAFETY: each chunk came from cuMemAlloc below and is freed once; every block
            // of it was given back (a lent DevBuf holds the pool alive).
            if let Err(e) = unsafe { dres::free_sync(base) } {
                tracing::warn!("freeing a workspace chunk: {e:?}");
            }
        }
    }
}

/// The device's step workspace (see the module comment).
pub struct Workspace {
    pool: Arc<Mutex<Pool>>,
}

/// While alive, the device's allocations are lent by its workspace.
pub struct WorkspaceScope {
    pool: Arc<Mutex<Pool>>,
}

impl Drop for WorkspaceScope {
    fn drop(&mut self) {
        lock(&self.pool).scopes -= 1;
    }
}

impl Workspace {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Self {
            pool: Arc::new(Mutex::new(Pool {
                arena: Arena::default(),
                scopes: 0,
                ctx,
            })),
        }
    }

    /// Lends every allocation the device makes until the returned scope is dropped.
    pub fn scope(&self) -> WorkspaceScope {
        lock(&self.pool).scopes += 1;
        WorkspaceScope {
            pool: self.pool.clone(),
        }
    }

    /// Gives every chunk back to the driver when nothing is lent and no scope is open
    /// (`release_memory_occupation`: the recordings that held the blocks' addresses are
    /// gone). Returns the bytes freed; 0 when blocks are still lent (they are kept).
    pub fn trim(&self) -> Result<usize, dres::DriverError> {
        let mut p = lock(&self.pool);
        if p.scopes != 0 {
            return Ok(0);
        }
        let Some(chunks) = p.arena.take_chunks_if_idle() else {
            return Ok(0);
        };
        p.ctx.bind_to_thread()?;
        // Work queued on the blocks may still run.
        p.ctx.synchronize()?;
        let mut freed = 0;
        for (base, bytes) in chunks {
            // SAFETY: each chunk came from cuMemAlloc in `lend` and left the arena above,
            // so it is freed once; no block of it is lent.
            unsafe { dres::free_sync(base) }?;
            freed += bytes;
        }
        Ok(freed)
    }

    /// Bytes taken from the driver, and bytes lent now.
    pub fn usage(&self) -> (usize, usize) {
        let p = lock(&self.pool);
        (p.arena.reserved_bytes(), p.arena.lent_bytes())
    }

    /// A lent buffer of `len` elements when a scope is open, else `None`. Grows by a
    /// chunk (`cuMemAlloc`, allowed in a relaxed capture) when no block fits.
    pub fn lend<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Option<DevBuf<T>>, dres::DriverError> {
        let mut p = lock(&self.pool);
        if p.scopes == 0 {
            return Ok(None);
        }
        let class = block_class(len * std::mem::size_of::<T>());
        let addr = match p.arena.lend(class) {
            Some(a) => a,
            None => {
                let bytes = class.max(CHUNK_BYTES);
                p.ctx.bind_to_thread()?;
                // SAFETY: a plain allocation on the bound context, freed by Pool::drop.
                let base = unsafe { dres::malloc_sync(bytes) }?;
                tracing::debug!(bytes, "step workspace grows");
                p.arena.add_chunk(base, bytes);
                p.arena.lend(class).ok_or(dres::DriverError(
                    cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                ))?
            }
        };
        drop(p);
        // SAFETY: `addr` is a block of at least `len` elements of T that nothing else uses
        // until this buffer is dropped; the slice never frees it (DevBuf::drop leaks it).
        let slice = unsafe { stream.upgrade_device_ptr::<T>(addr, len) };
        Ok(Some(DevBuf {
            slice: ManuallyDrop::new(slice),
            lease: Some(Lease {
                pool: self.pool.clone(),
                addr,
                class,
            }),
            borrowed: false,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_aligned_and_waste_at_most_an_eighth() {
        let mut last = 0;
        for bytes in (0..5000).chain([65_536, 65_537, 1 << 20, (1 << 20) + 1, 29_360_128]) {
            let c = block_class(bytes);
            assert!(c >= bytes && c >= MIN_BLOCK, "{bytes} -> {c}");
            assert_eq!(c % MIN_BLOCK, 0, "{bytes} -> {c}");
            if bytes > 2048 {
                assert!(c - bytes <= bytes / 8, "{bytes} -> {c}");
            }
            if bytes < 5000 {
                assert!(c >= last, "classes grow with the request");
                last = c;
            }
        }
        assert_eq!(block_class(1), 256);
        assert_eq!(block_class(257), 512);
        assert_eq!(block_class(2049), 2304);
        assert_eq!(block_class(1 << 20), 1 << 20);
    }

    #[test]
    fn blocks_are_reused_last_in_first_out_and_never_overlap() {
        let mut a = Arena::default();
        assert_eq!(a.lend(256), None, "no chunk yet");
        a.add_chunk(0x10_0000, 4096);
        let x = a.lend(1024).unwrap();
        let y = a.lend(1024).unwrap();
        let z = a.lend(512).unwrap();
        assert_eq!((x, y, z), (0x10_0000, 0x10_0400, 0x10_0800));
        assert_eq!(a.lent_bytes(), 2560);
        a.give_back(x, 1024);
        a.give_back(y, 1024);
        assert_eq!(
            a.lend(1024),
            Some(y),
            "the block given back last comes first"
        );
        assert_eq!(a.lend(1024), Some(x));
        // 1536 bytes left in the chunk: a 2048-byte block needs a new chunk.
        assert_eq!(a.lend(2048), None);
        a.add_chunk(0x20_0000, 8192);
        assert_eq!(a.lend(2048), Some(0x20_0000));
        assert_eq!(a.reserved_bytes(), 4096 + 8192);
        assert_eq!(a.lent_bytes(), 1024 * 2 + 512 + 2048);
    }

    #[test]
    fn chunks_are_given_up_only_when_nothing_is_lent() {
        let mut a = Arena::default();
        a.add_chunk(0x10_0000, 4096);
        let x = a.lend(1024).unwrap();
        assert_eq!(a.take_chunks_if_idle(), None, "a block is lent");
        assert_eq!(a.reserved_bytes(), 4096);
        a.give_back(x, 1024);
        assert_eq!(a.take_chunks_if_idle(), Some(vec![(0x10_0000, 4096)]));
        assert_eq!(a.reserved_bytes(), 0);
        assert_eq!(a.lend(1024), None, "no chunk and no free block is left");
        a.add_chunk(0x30_0000, 4096);
        assert_eq!(a.lend(1024), Some(0x30_0000), "the free lists were cleared");
    }

    /// The same sequence of lends and give-backs yields the same addresses: what lets a
    /// recorded step replay on the buffers its capture saw.
    #[test]
    fn a_repeated_sequence_gets_the_same_addresses() {
        let mut a = Arena::default();
        a.add_chunk(0x1000_0000, 1 << 20);
        let run = |a: &mut Arena| {
            let mut got = Vec::new();
            let p = a.lend(block_class(4096)).unwrap();
            let q = a.lend(block_class(100)).unwrap();
            got.extend([p, q]);
            a.give_back(p, block_class(4096));
            let r = a.lend(block_class(4000)).unwrap();
            got.push(r);
            a.give_back(q, block_class(100));
            a.give_back(r, block_class(4000));
            got
        };
        let first = run(&mut a);
        assert_eq!(
            first[2], first[0],
            "a freed block is taken by the next fitting lend"
        );
        assert_eq!(run(&mut a), first);
        assert_eq!(a.lent_bytes(), 0);
    }
}
