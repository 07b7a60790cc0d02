//! Where each row of a ragged batch goes in the KV cache (slot, position), and the
//! cache's layout: what RoPE, the KV write and attention read.

use super::{check, dev_ptr, DevU32};
use crate::cuda::{CudaError, GpuDevice};

/// Shape of a KV cache buffer: `[layers, slots, max_len, width]`, width = kv heads × head_dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub slots: usize,
    pub max_len: usize,
    pub width: usize,
}

impl KvLayout {
    pub fn len(&self) -> usize {
        self.layers * self.slots * self.max_len * self.width
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where each row of a ragged batch goes: its KV slot and position, on the device.
///
/// Uploaded once per step (with the step's other inputs) and read by RoPE, the KV write
/// and attention of every layer; the bounds are checked on the host when it is built, and
/// every limit an op checks it against is remembered ([`RowMeta::limits`]), so that a
/// recorded step replayed with new positions can be checked against the same limits.
pub struct RowMeta {
    /// Device addresses of `[slot; rows]` and `[pos; rows]` (u32).
    pub(super) slots: u64,
    pub(super) positions: u64,
    /// The buffer behind them when this meta owns it (`GpuDevice::row_meta`).
    _owned: Option<DevU32>,
    pub(super) rows: usize,
    /// One past the largest slot and position (0 when there are no rows).
    slot_end: usize,
    pub(super) pos_end: usize,
    /// Launch shapes must not depend on the positions: the step is being recorded and
    /// will be replayed at other positions (attention then always runs ATTN_WARPS warps).
    pub(super) fixed_shape: bool,
    /// The smallest (slot, position) limits the ops checked this meta against.
    limits: std::cell::Cell<(usize, usize)>,
}

impl RowMeta {
    /// A row map over device memory that the caller keeps alive while the meta and the
    /// kernels queued with it are in use. `slot_end` / `pos_end`: one past the largest
    /// slot and position of the rows.
    ///
    /// # Safety
    /// `slots` and `positions` are device addresses of `rows` u32 each on the device the
    /// meta is used with, holding the slots and positions the two ends describe.
    pub unsafe fn from_device(
        slots: u64,
        positions: u64,
        rows: usize,
        slot_end: usize,
        pos_end: usize,
        fixed_shape: bool,
    ) -> Self {
        RowMeta {
            slots,
            positions,
            _owned: None,
            rows,
            slot_end,
            pos_end,
            fixed_shape,
            limits: std::cell::Cell::new((usize::MAX, usize::MAX)),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The tightest (slots, positions) limits that the ops run with this meta checked it
    /// against: a replay of their recording is valid for rows whose slots and positions
    /// stay below them.
    pub fn limits(&self) -> (usize, usize) {
        self.limits.get()
    }

    pub(super) fn limit_slots(&self, kernel: &'static str, slots: usize) -> Result<(), CudaError> {
        let (s, p) = self.limits.get();
        self.limits.set((s.min(slots), p));
        check(kernel, self.slot_end <= slots, || {
            format!(
                "slot {} of a cache with {slots} slots",
                self.slot_end.saturating_sub(1)
            )
        })
    }

    pub(super) fn limit_positions(
        &self,
        kernel: &'static str,
        what: &str,
        n: usize,
    ) -> Result<(), CudaError> {
        let (s, p) = self.limits.get();
        self.limits.set((s, p.min(n)));
        check(kernel, self.pos_end <= n, || {
            format!(
                "position {} beyond {what} ({n} positions)",
                self.pos_end.saturating_sub(1)
            )
        })
    }

    pub(super) fn check_cache(
        &self,
        kernel: &'static str,
        layout: KvLayout,
        layer: usize,
    ) -> Result<(), CudaError> {
        check(kernel, layer < layout.layers, || {
            format!("layer {layer} of a cache with {} layers", layout.layers)
        })?;
        self.limit_slots(kernel, layout.slots)?;
        self.limit_positions(kernel, "the cache length", layout.max_len)
    }
}

/// One past the largest value (0 for none): the bound a row map's slots or positions
/// are checked with.
pub fn end_of(v: &[u32]) -> usize {
    v.iter().map(|&x| x as usize + 1).max().unwrap_or(0)
}

impl GpuDevice {
    /// Uploads the per-row (slot, position) of a batch in one copy, into a buffer the
    /// meta owns.
    pub fn row_meta(&self, row_slot: &[u32], row_pos: &[u32]) -> Result<RowMeta, CudaError> {
        check("row_meta", row_slot.len() == row_pos.len(), || {
            format!("{} slots for {} positions", row_slot.len(), row_pos.len())
        })?;
        let rows = row_slot.len();
        let mut both = Vec::with_capacity(2 * rows);
        both.extend_from_slice(row_slot);
        both.extend_from_slice(row_pos);
        let buf = self.upload_u32(&both)?;
        let base = dev_ptr(&buf, &self.stream);
        // SAFETY: `buf` holds the slots then the positions, and the meta keeps it.
        let mut meta = unsafe {
            RowMeta::from_device(
                base,
                base + 4 * rows as u64,
                rows,
                end_of(row_slot),
                end_of(row_pos),
                false,
            )
        };
        meta._owned = Some(buf);
        Ok(meta)
    }
}
