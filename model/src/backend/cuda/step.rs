//! A step's inputs and outputs on the device: one upload before the step, one download
//! after it (docs/step.md, "The device-resident step").
//!
//! Inputs, as u32 words: `[ids; R] [positions; R] [table offsets; R] [ks; O] (pad)
//! [params; 6·O] [block tables; T]` (R rows, O output rows; the row-stats parameters are 3
//! u64 per row, 8-byte aligned; the sequences' block tables concatenated, each row's table
//! offset pointing at its sequence's, last so that a recorded step's buffer can hold longer
//! tables than the step that recorded it).
//! Outputs: `[stats f32; 4·O] [stats u64; 3·O as 6·O words] [counts; O] [indices; O·S]
//! [values; O·S]` (S: the top-k stride, 0 when no row asks for candidates).
//!
//! The layouts and their packing are plain host code (tested here without a GPU); the
//! backend keeps the device buffers, and a recorded step keeps its own pair for life.

use std::sync::Arc;

use arbor_kernels::cuda::ops::{
    decode_row_stats, decode_top_k, dev_ptr, row_bounds, row_stats_params, ROW_STATS_F32,
    ROW_STATS_U64,
};
use arbor_kernels::cuda::paged_attention::AttnRouting;
use arbor_kernels::cuda::{DevU32, RowMeta};
use cudarc::driver::CudaStream;

use crate::backend::{KvRows, SeqRows, StepInputs, StepResults};
use crate::sampling::RowDraw;

/// Where each part of a step's input words lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InLayout {
    pub rows: usize,
    pub outs: usize,
    /// Block-table words the buffer holds (a recorded step's: its capacity).
    pub table: usize,
}

impl InLayout {
    pub fn ids(&self) -> usize {
        0
    }
    pub fn positions(&self) -> usize {
        self.rows
    }
    pub fn table_offs(&self) -> usize {
        2 * self.rows
    }
    pub fn ks(&self) -> usize {
        3 * self.rows
    }
    /// Word offset of the row-stats parameters (even: 8-byte aligned).
    pub fn params(&self) -> usize {
        (3 * self.rows + self.outs).next_multiple_of(2)
    }
    /// Word offset of the block tables (after everything else: it does not move with
    /// their length).
    pub fn tables(&self) -> usize {
        self.params() + 2 * ROW_STATS_U64 * self.outs
    }
    pub fn words(&self) -> usize {
        self.tables() + self.table
    }
}

/// Where each part of a step's output words lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutLayout {
    pub outs: usize,
    /// Candidates per row (0: no top-k).
    pub stride: usize,
}

impl OutLayout {
    pub fn stats_f32(&self) -> usize {
        0
    }
    /// Word offset of the u64 stats (even: the f32 part is 4 words a row).
    pub fn stats_u64(&self) -> usize {
        ROW_STATS_F32 * self.outs
    }
    pub fn counts(&self) -> usize {
        self.stats_u64() + 2 * ROW_STATS_U64 * self.outs
    }
    pub fn indices(&self) -> usize {
        self.counts() + self.outs
    }
    pub fn values(&self) -> usize {
        self.indices() + self.outs * self.stride
    }
    /// The words a step writes and downloads.
    pub fn words(&self) -> usize {
        if self.stride == 0 {
            self.counts()
        } else {
            self.values() + self.outs * self.stride
        }
    }
}

/// The top-k stride of a step whose rows ask for `ks`: 0 when none does, else a power of
/// two of at least 8 (so that recorded steps share strides).
pub fn stride_for(ks: &[usize]) -> usize {
    match ks.iter().copied().max() {
        None | Some(0) => 0,
        Some(k) => k.next_power_of_two().max(8),
    }
}

/// The input words of a step (see the module comment; its tables exactly), and one past
/// its largest position and block id.
pub fn pack_inputs(inputs: &StepInputs<'_>) -> Result<(Vec<u32>, usize, usize), String> {
    let rows = inputs.ids.len();
    let outs = inputs.out_rows.len();
    if inputs.pick.len() != outs || inputs.draws.len() != outs || inputs.ks.len() != outs {
        return Err(format!(
            "{outs} output rows with {} picks, {} draws and {} k's",
            inputs.pick.len(),
            inputs.draws.len(),
            inputs.ks.len()
        ));
    }
    if let Some(&r) = inputs.out_rows.iter().find(|&&r| r >= rows) {
        return Err(format!("output row {r} of a step of {rows} rows"));
    }
    let l = InLayout {
        rows,
        outs,
        table: inputs.table.len(),
    };
    let mut w = vec![0u32; l.words()];
    w[..rows].copy_from_slice(inputs.ids);
    let ends = fill_row_map(&mut w, l, inputs.kv_rows())?;
    for (d, &k) in w[l.ks()..l.ks() + outs].iter_mut().zip(inputs.ks) {
        *d = u32::try_from(k).map_err(|_| format!("top-k {k} out of range"))?;
    }
    for (j, p) in row_stats_params(inputs.pick, inputs.draws)
        .into_iter()
        .enumerate()
    {
        w[l.params() + 2 * j] = p as u32;
        w[l.params() + 2 * j + 1] = (p >> 32) as u32;
    }
    Ok((w, ends.0, ends.1))
}

/// Writes the row map of `rows` (layout `l`'s rows) into its positions, table offsets and
/// tables of `w` (which holds `l.words()`; the tables must fit `l.table`); returns one past
/// the largest position and block id, after checking that every row's table covers it.
pub fn fill_row_map(
    w: &mut [u32],
    l: InLayout,
    rows: KvRows<'_>,
) -> Result<(usize, usize), String> {
    let (pos, toff) = row_map(rows.seqs, l.rows)?;
    if rows.table.len() > l.table {
        return Err(format!(
            "{} block-table entries for a buffer of {}",
            rows.table.len(),
            l.table
        ));
    }
    let ends = row_bounds(&pos, &toff, rows.table)?;
    w[l.positions()..l.positions() + l.rows].copy_from_slice(&pos);
    w[l.table_offs()..l.table_offs() + l.rows].copy_from_slice(&toff);
    w[l.tables()..l.tables() + rows.table.len()].copy_from_slice(rows.table);
    Ok(ends)
}

/// Per-row (position, table offset) of a ragged batch of `rows` rows; every row must
/// belong to exactly one sequence.
pub fn row_map(seqs: &[SeqRows], rows: usize) -> Result<(Vec<u32>, Vec<u32>), String> {
    let mut pos = vec![u32::MAX; rows];
    let mut toff = vec![u32::MAX; rows];
    for s in seqs {
        let end = s
            .row0
            .checked_add(s.len)
            .filter(|&e| e <= rows)
            .ok_or_else(|| {
                format!(
                    "a sequence covers rows {}..{}+{} of a batch of {rows} rows",
                    s.row0, s.row0, s.len
                )
            })?;
        for (i, r) in (s.row0..end).enumerate() {
            if toff[r] != u32::MAX {
                return Err(format!("row {r} belongs to two sequences"));
            }
            let p = s.pos0 + i;
            match (u32::try_from(p), u32::try_from(s.table0)) {
                (Ok(a), Ok(b)) if a != u32::MAX && b != u32::MAX => {
                    pos[r] = a;
                    toff[r] = b;
                }
                _ => {
                    return Err(format!(
                        "position {p} / table offset {} out of range",
                        s.table0
                    ))
                }
            }
        }
    }
    if let Some(r) = toff.iter().position(|&t| t == u32::MAX) {
        return Err(format!("row {r} belongs to no sequence"));
    }
    Ok((pos, toff))
}

/// A decode-shaped step (`StepInputs::is_decode_shaped`) of `n` rows padded to `to`
/// rows: every padding row is a copy of row 0 (same token, position and block table).
/// Each row's arithmetic is independent of the others, so a copy computes row 0's bits
/// and writes row 0's K and V, identical bytes to the same place: the cache is unchanged
/// by it. Padding rows draw nothing, report no pick and select no candidates.
pub struct Padded {
    pub ids: Vec<u32>,
    pub seqs: Vec<SeqRows>,
    pub table: Vec<u32>,
    pub out_rows: Vec<usize>,
    pub pick: Vec<u32>,
    pub draws: Vec<RowDraw>,
    pub ks: Vec<usize>,
}

impl Padded {
    pub fn new(inputs: &StepInputs<'_>, to: usize) -> Result<Self, String> {
        let n = inputs.ids.len();
        if !inputs.is_decode_shaped() || n == 0 || to < n {
            return Err(format!(
                "only a decode-shaped step of at least one row pads (rows {n} to {to})"
            ));
        }
        let extra = to - n;
        let seq0 = inputs.seqs[0];
        let mut seqs = inputs.seqs.to_vec();
        seqs.extend((n..to).map(|row0| SeqRows { row0, ..seq0 }));
        let pad = |v: &[u32], with: u32| {
            let mut v = v.to_vec();
            v.extend(std::iter::repeat_n(with, extra));
            v
        };
        let mut draws = inputs.draws.to_vec();
        draws.extend(std::iter::repeat_n(RowDraw::None, extra));
        let mut ks = inputs.ks.to_vec();
        ks.extend(std::iter::repeat_n(0, extra));
        Ok(Padded {
            ids: pad(inputs.ids, inputs.ids[0]),
            seqs,
            table: inputs.table.to_vec(),
            out_rows: (0..to).collect(),
            pick: pad(inputs.pick, u32::MAX),
            draws,
            ks,
        })
    }

    pub fn inputs<'a>(&'a self, like: &StepInputs<'_>) -> StepInputs<'a> {
        StepInputs {
            ids: &self.ids,
            seqs: &self.seqs,
            table: &self.table,
            out_rows: &self.out_rows,
            pick: &self.pick,
            draws: &self.draws,
            ks: &self.ks,
            vocab: like.vocab,
            cache: like.cache,
            rows_to_host: like.rows_to_host,
        }
    }
}

/// The step's results from its downloaded output words: the first `keep` rows.
pub fn decode_outputs(words: &[u32], l: OutLayout, keep: usize) -> Result<StepResults, String> {
    if words.len() < l.words() || keep > l.outs {
        return Err(format!(
            "{} output words for {} rows of stride {} ({} needed), {keep} kept",
            words.len(),
            l.outs,
            l.stride,
            l.words()
        ));
    }
    let f: Vec<f32> = words[l.stats_f32()..l.stats_u64()]
        .iter()
        .map(|&w| f32::from_bits(w))
        .collect();
    let u: Vec<u64> = words[l.stats_u64()..l.counts()]
        .chunks_exact(2)
        .map(|p| p[0] as u64 | (p[1] as u64) << 32)
        .collect();
    let mut stats = decode_row_stats(&f, &u);
    stats.truncate(keep);
    let cands = if l.stride == 0 {
        Vec::new()
    } else {
        let vals: Vec<f32> = words[l.values()..l.words()]
            .iter()
            .map(|&w| f32::from_bits(w))
            .collect();
        let mut c = decode_top_k(
            &words[l.counts()..l.indices()],
            &words[l.indices()..l.values()],
            &vals,
            l.stride,
        );
        c.truncate(keep);
        c
    };
    Ok(StepResults {
        stats,
        cands,
        rows: Vec::new(),
    })
}

/// The current step's inputs on the device, with the host copies the ops compare their
/// own arguments with to find them (an op called with other rows uploads its own).
pub struct StepMeta {
    pub ids: Vec<u32>,
    pub seqs: Vec<SeqRows>,
    /// The block tables (`None`: a row map made for RoPE alone, without the tables).
    pub table: Option<Vec<u32>>,
    pub rows: usize,
    pub layout: InLayout,
    pub buf: Arc<DevU32>,
    pub meta: RowMeta,
    /// A recorded decode step's split bucket: attention runs every row through the
    /// decode kernel at this grid depth (`AttnRouting::split_bucket`).
    pub split_bucket: Option<usize>,
    /// Which rows which attention kernel computes, made by the first attention of the step.
    pub routing: Option<AttnRouting>,
}

impl StepMeta {
    /// Over `buf`, which holds the words of `pack_inputs` (ids first when `ids` is given);
    /// `ends`: one past the largest position and block id (`fill_row_map`'s check).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stream: &CudaStream,
        ids: Vec<u32>,
        rows: KvRows<'_>,
        has_table: bool,
        layout: InLayout,
        buf: Arc<DevU32>,
        ends: (usize, usize),
        split_bucket: Option<usize>,
    ) -> Self {
        let base = dev_ptr(&buf, stream);
        let at = |w: usize| base + 4 * w as u64;
        // SAFETY: `buf` holds the layout's words, written by `fill_row_map`, which checked
        // that every row's table lies in the tables and that `ends` bound them; the meta
        // keeps `buf` alive.
        let meta = unsafe {
            RowMeta::from_device(
                at(layout.positions()),
                at(layout.table_offs()),
                at(layout.tables()),
                layout.rows,
                ends.0,
                ends.1,
            )
        };
        StepMeta {
            ids,
            seqs: rows.seqs.to_vec(),
            table: has_table.then(|| rows.table.to_vec()),
            rows: layout.rows,
            layout,
            buf,
            meta,
            split_bucket,
            routing: None,
        }
    }

    /// Device address of the word at `w`.
    pub fn word(&self, stream: &CudaStream, w: usize) -> u64 {
        dev_ptr(&self.buf, stream) + 4 * w as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(table0: usize, row0: usize, len: usize, pos0: usize) -> SeqRows {
        SeqRows {
            row0,
            len,
            pos0,
            table0,
        }
    }

    #[test]
    fn row_map_maps_each_row_to_its_position_and_table() {
        let (pos, toff) = row_map(&[seq(2, 0, 3, 5), seq(0, 3, 1, 0)], 4).unwrap();
        assert_eq!(toff, [2, 2, 2, 0]);
        assert_eq!(pos, [5, 6, 7, 0]);
    }

    #[test]
    fn row_map_rejects_bad_batches() {
        let e = row_map(&[seq(0, 0, 2, 0), seq(1, 1, 2, 0)], 3).unwrap_err();
        assert!(e.contains("row 1 belongs to two sequences"), "{e}");
        let e = row_map(&[seq(0, 0, 2, 0)], 3).unwrap_err();
        assert!(e.contains("row 2 belongs to no sequence"), "{e}");
        let e = row_map(&[seq(0, 2, 2, 0)], 3).unwrap_err();
        assert!(e.contains("of a batch of 3 rows"), "{e}");
        let e = row_map(&[seq(0, usize::MAX, 2, 0)], 3).unwrap_err();
        assert!(e.contains("of a batch of 3 rows"), "{e}");
        let e = row_map(&[seq(0, 0, 1, u32::MAX as usize + 1)], 1).unwrap_err();
        assert!(e.contains("out of range"), "{e}");
    }

    fn decode_step<'a>(
        ids: &'a [u32],
        seqs: &'a [SeqRows],
        out_rows: &'a [usize],
        pick: &'a [u32],
        draws: &'a [RowDraw],
        ks: &'a [usize],
    ) -> StepInputs<'a> {
        StepInputs {
            ids,
            seqs,
            table: &[7, 8, 9, 5, 6, 70, 71],
            out_rows,
            pick,
            draws,
            ks,
            vocab: 100,
            cache: 7,
            rows_to_host: false,
        }
    }

    #[test]
    fn inputs_pack_into_their_layout() {
        let seqs = [seq(4, 0, 1, 9), seq(1, 1, 1, 3), seq(2, 2, 1, 0)];
        let draw = crate::sampling::GumbelDraw {
            inv_t: 0.5,
            key: 0x1234_5678_9abc_def0,
        };
        let draws = [
            RowDraw::None,
            RowDraw::Nucleus { inv_t: 2.0 },
            RowDraw::Gumbel(draw),
        ];
        let s = decode_step(
            &[11, 12, 13],
            &seqs,
            &[0, 1, 2],
            &[u32::MAX, 5, u32::MAX],
            &draws,
            &[0, 3, 8],
        );
        let (w, pos_end, block_end) = pack_inputs(&s).unwrap();
        let l = InLayout {
            rows: 3,
            outs: 3,
            table: 7,
        };
        assert_eq!(w.len(), l.words());
        assert_eq!(l.params() % 2, 0);
        assert_eq!(&w[l.ids()..l.ids() + 3], &[11, 12, 13]);
        assert_eq!(&w[l.table_offs()..l.table_offs() + 3], &[4, 1, 2]);
        assert_eq!(&w[l.positions()..l.positions() + 3], &[9, 3, 0]);
        assert_eq!(&w[l.ks()..l.ks() + 3], &[0, 3, 8]);
        assert_eq!(&w[l.tables()..], &[7, 8, 9, 5, 6, 70, 71]);
        // Blocks 6, 8 and 9 are the rows'; 70 and 71 belong to none.
        assert_eq!((pos_end, block_end), (10, 10));
        let u = |j: usize| w[l.params() + 2 * j] as u64 | (w[l.params() + 2 * j + 1] as u64) << 32;
        let want = row_stats_params(s.pick, s.draws);
        assert_eq!((0..9).map(u).collect::<Vec<_>>(), want);
        assert_eq!(u(7), draw.key);
        assert_eq!(u(8), 1 << 32 | 0.5f32.to_bits() as u64);
        assert_eq!(u(5), 2 << 32 | 2.0f32.to_bits() as u64);
        // A mismatch is named, not packed.
        let bad = decode_step(&[1], &seqs[..1], &[0], &[], &[RowDraw::None], &[0]);
        assert!(pack_inputs(&bad).unwrap_err().contains("0 picks"));
        let bad = decode_step(&[1], &seqs[..1], &[1], &[0], &[RowDraw::None], &[0]);
        assert!(pack_inputs(&bad).unwrap_err().contains("output row 1"));
        // A table that does not cover a row is named.
        let far = [seq(6, 0, 1, 64)];
        let bad = decode_step(&[1], &far, &[0], &[0], &[RowDraw::None], &[0]);
        assert!(pack_inputs(&bad)
            .unwrap_err()
            .contains("needs block-table entries 6..8, the step has 7"));
    }

    #[test]
    fn padding_copies_row_zero_and_asks_nothing_of_the_copies() {
        let seqs = [seq(3, 0, 1, 17), seq(0, 1, 1, 4)];
        let draw = RowDraw::Gumbel(crate::sampling::GumbelDraw { inv_t: 2.0, key: 9 });
        let draws = [draw, RowDraw::None];
        let s = decode_step(&[7, 8], &seqs, &[0, 1], &[1, 2], &draws, &[4, 0]);
        assert!(s.is_decode_shaped());
        let p = Padded::new(&s, 4).unwrap();
        assert_eq!(p.ids, [7, 8, 7, 7]);
        assert_eq!(p.out_rows, [0, 1, 2, 3]);
        assert_eq!(p.seqs[2], seq(3, 2, 1, 17));
        assert_eq!(p.seqs[3], seq(3, 3, 1, 17));
        assert_eq!(p.pick, [1, 2, u32::MAX, u32::MAX]);
        assert_eq!(p.draws, [draw, RowDraw::None, RowDraw::None, RowDraw::None]);
        assert_eq!(p.ks, [4, 0, 0, 0]);
        let padded = p.inputs(&s);
        assert!(padded.is_decode_shaped());
        let (w, pos_end, block_end) = pack_inputs(&padded).unwrap();
        assert_eq!((pos_end, block_end), (18, 8));
        let l = InLayout {
            rows: 4,
            outs: 4,
            table: 7,
        };
        assert_eq!(&w[l.table_offs()..l.table_offs() + 4], &[3, 0, 3, 3]);
        assert_eq!(&w[l.positions()..l.positions() + 4], &[17, 4, 17, 17]);
        // Not decode-shaped (a prefill chunk): refused.
        let chunk = [seq(0, 0, 2, 0)];
        let pre = decode_step(&[1, 2], &chunk, &[1], &[0], &[RowDraw::None], &[0]);
        assert!(!pre.is_decode_shaped());
        assert!(Padded::new(&pre, 4).is_err());
        assert!(Padded::new(&s, 1).is_err());
    }

    #[test]
    fn outputs_decode_from_their_layout_and_keep_the_real_rows() {
        let l = OutLayout { outs: 2, stride: 8 };
        let mut w = vec![0u32; l.words()];
        // Row 1: max 3.5, lse 4.0, picked -1.0, sampled value 2.0, tempered sum 7.5;
        // argmax 6, digest, draw 9.
        let f1 = [3.5f32, 4.0, -1.0, 2.0, 7.5, 0.0];
        for (j, v) in f1.iter().enumerate() {
            w[l.stats_f32() + ROW_STATS_F32 + j] = v.to_bits();
        }
        let u1 = [6u64, 0xdead_beef_0000_0001, 9];
        for (j, v) in u1.iter().enumerate() {
            let at = l.stats_u64() + 2 * (ROW_STATS_U64 + j);
            w[at] = *v as u32;
            w[at + 1] = (*v >> 32) as u32;
        }
        // Row 0: two candidates; row 1: one.
        w[l.counts()] = 2;
        w[l.counts() + 1] = 1;
        w[l.indices()] = 40;
        w[l.indices() + 1] = 41;
        w[l.indices() + 8] = 50;
        w[l.values()] = 1.5f32.to_bits();
        w[l.values() + 1] = 1.25f32.to_bits();
        w[l.values() + 8] = 0.5f32.to_bits();
        let r = decode_outputs(&w, l, 2).unwrap();
        assert_eq!(r.stats.len(), 2);
        let s1 = r.stats[1];
        assert_eq!(
            (s1.max, s1.lse, s1.picked, s1.sampled_value),
            (3.5, 4.0, -1.0, 2.0)
        );
        assert_eq!(
            (s1.argmax, s1.digest, s1.sampled),
            (6, 0xdead_beef_0000_0001, 9)
        );
        assert_eq!(r.cands, vec![vec![(40, 1.5), (41, 1.25)], vec![(50, 0.5)]]);
        let kept = decode_outputs(&w, l, 1).unwrap();
        assert_eq!((kept.stats.len(), kept.cands.len()), (1, 1));
        let none = OutLayout { outs: 2, stride: 0 };
        assert_eq!(none.words(), 2 * (ROW_STATS_F32 + 2 * ROW_STATS_U64));
        assert!(decode_outputs(&w[..none.words()], none, 2)
            .unwrap()
            .cands
            .is_empty());
        assert!(decode_outputs(&w[..3], l, 2).is_err());
    }

    #[test]
    fn strides_are_powers_of_two_from_eight() {
        assert_eq!(stride_for(&[]), 0);
        assert_eq!(stride_for(&[0, 0]), 0);
        assert_eq!(stride_for(&[1, 0]), 8);
        assert_eq!(stride_for(&[50, 5]), 64);
        assert_eq!(stride_for(&[1024]), 1024);
    }
}
