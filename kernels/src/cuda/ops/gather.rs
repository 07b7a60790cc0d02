//! Gathers and layout copies: the embedding lookup, row selection, column blocks and
//! interleaved columns.

use super::{check, dev_ptr, elementwise_cfg, i32_of, DevBf16, DevF32};
use crate::cuda::{CudaError, GpuDevice};

/// The vocabulary of an embedding table of rows of `cols`.
fn embedding_vocab(table: &DevBf16, cols: usize) -> Result<usize, CudaError> {
    check(
        "embedding_kernel",
        cols > 0 && table.len().is_multiple_of(cols),
        || format!("table has {} values, not rows of {cols}", table.len()),
    )?;
    Ok(table.len() / cols)
}

impl GpuDevice {
    /// Columns `col0..col0 + cols` of `src` (`[rows, src_cols]`) as a `[rows, cols]` matrix.
    pub fn copy_cols(
        &self,
        src: &DevF32,
        rows: usize,
        src_cols: usize,
        col0: usize,
        cols: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "copy_cols_kernel";
        check(
            K,
            src.len() == rows * src_cols && col0 + cols <= src_cols,
            || {
                format!(
                    "columns {col0}..{} of a [{rows}, {src_cols}] matrix of {} values",
                    col0 + cols,
                    src.len()
                )
            },
        )?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let r = rows as i64;
        let (sc, c0, c) = (
            i32_of(K, "src_cols", src_cols)?,
            i32_of(K, "col0", col0)?,
            i32_of(K, "cols", cols)?,
        );
        let mut b = self.launch(self.func(K)?);
        b.arg(src).out(&mut out).arg(&r).arg(&sc).arg(&c0).arg(&c);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * cols)) })?;
        Ok(out)
    }

    /// Rows `ids` of `table` (`[vocab, cols]` bf16) as f32.
    pub fn embedding(
        &self,
        table: &DevBf16,
        cols: usize,
        ids: &[u32],
    ) -> Result<DevF32, CudaError> {
        let vocab = embedding_vocab(table, cols)?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(CudaError::Launch {
                kernel: "embedding_kernel",
                msg: format!("token id {bad} is out of range for a vocabulary of {vocab}"),
            });
        }
        if ids.is_empty() {
            return self.empty_f32(0);
        }
        let dids = self.upload_u32(ids)?;
        // SAFETY: `dids` holds the ids, checked against the vocabulary above.
        unsafe { self.embedding_raw(table, cols, dev_ptr(&dids, &self.stream), ids.len()) }
    }

    /// `embedding` of `rows` ids already on the device at `ids` (u32).
    ///
    /// # Safety
    /// `ids` is device memory of this device holding `rows` ids below the table's
    /// vocabulary, valid until the kernel has run.
    pub unsafe fn embedding_raw(
        &self,
        table: &DevBf16,
        cols: usize,
        ids: u64,
        rows: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "embedding_kernel";
        embedding_vocab(table, cols)?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 {
            return Ok(out);
        }
        let (ri, ci) = (i32_of(K, "rows", rows)?, i32_of(K, "cols", cols)?);
        let mut b = self.launch(self.func(K)?);
        b.arg(table).arg(&ids).out(&mut out).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * cols)) })?;
        Ok(out)
    }

    /// The given rows of `x` (`[rows, cols]`), in the given order.
    pub fn select_rows(&self, x: &DevF32, cols: usize, idx: &[usize]) -> Result<DevF32, CudaError> {
        const K: &str = "select_rows_kernel";
        check(K, cols > 0 && x.len().is_multiple_of(cols), || {
            format!("x has {} values, not rows of {cols}", x.len())
        })?;
        let rows = x.len() / cols;
        let mut idx32 = Vec::with_capacity(idx.len());
        for &i in idx {
            check(K, i < rows, || {
                format!("row {i} requested from a matrix of {rows} rows")
            })?;
            idx32.push(i as u32);
        }
        let mut out = self.empty_f32(idx.len() * cols)?;
        if idx.is_empty() {
            return Ok(out);
        }
        let didx = self.upload_u32(&idx32)?;
        let (ri, ci) = (i32_of(K, "rows", idx.len())?, i32_of(K, "cols", cols)?);
        let mut b = self.launch(self.func(K)?);
        b.arg(x).arg(&didx).out(&mut out).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(idx.len() * cols)) })?;
        Ok(out)
    }

    /// `[world, rows, cols]` (rank-major, as an all-gather returns it) → `[rows, world·cols]`.
    pub fn interleave_cols(
        &self,
        gathered: &DevF32,
        world: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "interleave_cols_kernel";
        check(K, gathered.len() == world * rows * cols, || {
            format!(
                "gathered has {} values, expected {world}×{rows}×{cols}",
                gathered.len()
            )
        })?;
        let mut out = self.empty_f32(gathered.len())?;
        if gathered.is_empty() {
            return Ok(out);
        }
        let (wi, ri, ci) = (
            i32_of(K, "world", world)?,
            i32_of(K, "rows", rows)?,
            i32_of(K, "cols", cols)?,
        );
        let mut b = self.launch(self.func(K)?);
        b.arg(gathered).out(&mut out).arg(&wi).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(gathered.len())) })?;
        Ok(out)
    }
}
