//! Where each row of a ragged batch goes in the paged KV cache (its position, and its
//! sequence's block table): what RoPE, the KV write and attention read.

use super::{check, dev_ptr, DevU32};
use crate::cuda::paged_attention::PagedRows;
use crate::cuda::{CudaError, GpuDevice};
use crate::paged::{PagedKvLayout, KV_BLOCK};

/// Where each row of a ragged batch goes, on the device: its position and the offset of
/// its sequence's block table in the step's tables (concatenated).
///
/// Uploaded once per step (with the step's other inputs) and read by RoPE, the KV write
/// and attention of every layer; the tables are checked on the host when it is built, and
/// every limit an op checks it against is remembered ([`RowMeta::limits`]), so that a
/// recorded step replayed with new positions and tables can be checked against the same
/// limits.
pub struct RowMeta {
    /// Device addresses of `[pos; rows]`, `[table offset; rows]` (u32) and the tables.
    pub(super) positions: u64,
    pub(super) table_off: u64,
    pub(super) table: u64,
    /// The buffer behind them when this meta owns it (`GpuDevice::row_meta`).
    _owned: Option<DevU32>,
    pub(super) rows: usize,
    /// One past the largest position and the largest block id the rows' tables name (0
    /// when there are no rows).
    pub(super) pos_end: usize,
    block_end: usize,
    /// The smallest (positions, blocks) limits the ops checked this meta against.
    limits: std::cell::Cell<(usize, usize)>,
}

/// One past the largest position and block id of rows at `pos` whose tables start at
/// `table_off` in `table`, after checking that every row's table covers its position
/// (`table[off .. off + pos / KV_BLOCK + 1]` exists).
pub fn row_bounds(pos: &[u32], table_off: &[u32], table: &[u32]) -> Result<(usize, usize), String> {
    if pos.len() != table_off.len() {
        return Err(format!(
            "{} positions for {} table offsets",
            pos.len(),
            table_off.len()
        ));
    }
    let (mut pos_end, mut block_end) = (0usize, 0usize);
    for (r, (&p, &t)) in pos.iter().zip(table_off).enumerate() {
        let (p, t) = (p as usize, t as usize);
        let end = t + p / KV_BLOCK + 1;
        let Some(blocks) = table.get(t..end) else {
            return Err(format!(
                "row {r} at position {p} needs block-table entries {t}..{end}, the step has {}",
                table.len()
            ));
        };
        pos_end = pos_end.max(p + 1);
        block_end = block_end.max(blocks.iter().map(|&b| b as usize + 1).max().unwrap_or(0));
    }
    Ok((pos_end, block_end))
}

impl RowMeta {
    /// A row map over device memory that the caller keeps alive while the meta and the
    /// kernels queued with it are in use. `pos_end` / `block_end`: one past the largest
    /// position and block id of the rows ([`row_bounds`]).
    ///
    /// # Safety
    /// `positions` and `table_off` are device addresses of `rows` u32 each, and `table` of
    /// u32 block ids, on the device the meta is used with, such that for every row r the
    /// entries `table[table_off[r] .. table_off[r] + positions[r] / KV_BLOCK + 1]` exist,
    /// every position is below `pos_end` and every one of those entries below `block_end`
    /// (what [`row_bounds`] checks of the host copies).
    pub unsafe fn from_device(
        positions: u64,
        table_off: u64,
        table: u64,
        rows: usize,
        pos_end: usize,
        block_end: usize,
    ) -> Self {
        RowMeta {
            positions,
            table_off,
            table,
            _owned: None,
            rows,
            pos_end,
            block_end,
            limits: std::cell::Cell::new((usize::MAX, usize::MAX)),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The tightest (positions, blocks) limits that the ops run with this meta checked it
    /// against: a replay of their recording is valid for rows whose positions and block
    /// ids stay below them.
    pub fn limits(&self) -> (usize, usize) {
        self.limits.get()
    }

    /// Checks the positions against a limit `n` of `what` (remembered).
    pub fn limit_positions(
        &self,
        kernel: &'static str,
        what: &str,
        n: usize,
    ) -> Result<(), CudaError> {
        let (p, b) = self.limits.get();
        self.limits.set((p.min(n), b));
        check(kernel, self.pos_end <= n, || {
            format!(
                "position {} beyond {what} ({n} positions)",
                self.pos_end.saturating_sub(1)
            )
        })
    }

    /// Checks the rows' block ids against a cache of `blocks` blocks (remembered).
    pub fn limit_blocks(&self, kernel: &'static str, blocks: usize) -> Result<(), CudaError> {
        let (p, b) = self.limits.get();
        self.limits.set((p, b.min(blocks)));
        check(kernel, self.block_end <= blocks, || {
            format!(
                "block {} of a cache with {blocks} blocks",
                self.block_end.saturating_sub(1)
            )
        })
    }

    pub(super) fn check_cache(
        &self,
        kernel: &'static str,
        layout: PagedKvLayout,
        layer: usize,
    ) -> Result<(), CudaError> {
        check(kernel, layer < layout.layers, || {
            format!("layer {layer} of a cache with {} layers", layout.layers)
        })?;
        self.limit_blocks(kernel, layout.blocks)
    }

    /// The rows as the paged attention kernels read them.
    pub fn paged(&self) -> PagedRows {
        // SAFETY: the meta's own contract (`from_device`) is the rows'.
        unsafe { PagedRows::from_device(self.rows, self.positions, self.table_off, self.table) }
    }
}

impl GpuDevice {
    /// Uploads the per-row positions and table offsets and the tables of a batch in one
    /// copy, into a buffer the meta owns (checked first: [`row_bounds`]).
    pub fn row_meta(
        &self,
        row_pos: &[u32],
        table_off: &[u32],
        table: &[u32],
    ) -> Result<RowMeta, CudaError> {
        let (pos_end, block_end) =
            row_bounds(row_pos, table_off, table).map_err(|msg| CudaError::Launch {
                kernel: "row_meta",
                msg,
            })?;
        let rows = row_pos.len();
        let mut all = Vec::with_capacity(2 * rows + table.len());
        all.extend_from_slice(row_pos);
        all.extend_from_slice(table_off);
        all.extend_from_slice(table);
        let buf = self.upload_u32(&all)?;
        let base = dev_ptr(&buf, &self.stream);
        let at = |w: usize| base + 4 * w as u64;
        // SAFETY: `buf` holds the positions, the offsets and the tables just checked, and
        // the meta keeps it.
        let mut meta = unsafe {
            RowMeta::from_device(at(0), at(rows), at(2 * rows), rows, pos_end, block_end)
        };
        meta._owned = Some(buf);
        Ok(meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_cover_every_row_and_name_a_short_table() {
        // Row 0 at 70 (blocks 5, 6), row 1 at 3 (block 9).
        assert_eq!(row_bounds(&[70, 3], &[0, 2], &[5, 6, 9]), Ok((71, 10)));
        let e = row_bounds(&[130], &[0], &[5, 6]).unwrap_err();
        assert!(
            e.contains("needs block-table entries 0..3, the step has 2"),
            "{e}"
        );
        assert!(row_bounds(&[1], &[], &[]).is_err());
        assert_eq!(row_bounds(&[], &[], &[]), Ok((0, 0)));
    }
}
