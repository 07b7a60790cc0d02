//! The token embedding (replicated: a lookup is exact) and the vocab-parallel LM head
//! (vocab rows split in equal blocks of `ceil(V / tp)`, the last block zero-padded;
//! logits all-gathered, an exact concatenation, and the padding columns dropped).

use std::ops::Range;

use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

use super::LoadCtx;
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;
use crate::weights::{MatPart, MatPlan, RowOrder};

pub struct Embedding<B: Backend> {
    table: B::Mat,
    pub vocab: usize,
}

impl<B: Backend> Embedding<B> {
    pub fn load(ctx: &LoadCtx<B>, name: &str, vocab: usize, hidden: usize) -> MResult<Self> {
        let table = ctx.mat_rows(name, vocab, hidden, 0..vocab)?;
        Ok(Embedding { table, vocab })
    }

    /// Ids must have been checked against `vocab` by the caller.
    pub fn forward(&self, b: &B, ids: &[u32]) -> BResult<B::Act> {
        b.embedding(&self.table, ids)
    }
}

pub struct VocabParallelHead<B: Backend> {
    w: B::Mat,
    tree: TreeSpec,
    pub vocab: usize,
    /// Rows per rank (the padded block size).
    pub block: usize,
}

impl<B: Backend> VocabParallelHead<B> {
    /// Vocab rows of `rank`'s block (the part inside the real vocabulary).
    pub fn rows(vocab: usize, rank: usize, tp: usize) -> Range<usize> {
        let block = vocab.div_ceil(tp);
        (rank * block).min(vocab)..((rank + 1) * block).min(vocab)
    }

    /// `name` is `lm_head.weight`, or `model.embed_tokens.weight` when tied.
    pub fn load(ctx: &LoadCtx<B>, name: &str, vocab: usize, hidden: usize) -> MResult<Self> {
        let block = vocab.div_ceil(ctx.tp);
        let rows = Self::rows(vocab, ctx.rank, ctx.tp);
        let w = ctx.mat(&MatPlan {
            pad_rows: block - rows.len(),
            parts: vec![MatPart {
                name: name.to_string(),
                n: vocab,
                k: hidden,
                rows,
                cols: 0..hidden,
            }],
            order: RowOrder::Stacked,
        })?;
        Ok(VocabParallelHead {
            w,
            tree: TreeSpec {
                seg_len: SegmentLayout::new(hidden).seg_len,
                n_seg: SEGMENTS,
                k: hidden,
            },
            vocab,
            block,
        })
    }

    /// Logits `[rows, cols ≥ vocab]` on the device, identical on every rank (columns past
    /// the vocabulary are the padding of the last rank's block).
    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let local = b.matmul(x, &self.w, self.tree)?;
        // A group of one holds every column already: the gather would only copy the logits.
        if b.world_size() == 1 {
            Ok(local)
        } else {
            b.all_gather_cols(&local)
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The logits `[rows, vocab]` on the host.
    pub fn to_host(&self, b: &B, all: &B::Act) -> BResult<Vec<f32>> {
        let (rows, cols) = b.shape(all);
        let host = b.act_to_host(all)?;
        if cols == self.vocab {
            return Ok(host);
        }
        let mut out = Vec::with_capacity(rows * self.vocab);
        for r in 0..rows {
            out.extend_from_slice(&host[r * cols..r * cols + self.vocab]);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn vocab_blocks_cover_the_vocabulary_once() {
        for (vocab, tp) in [(258usize, 8usize), (258, 4), (10, 8), (7, 1), (128256, 8)] {
            let mut next = 0;
            for r in 0..tp {
                let rows = VocabParallelHead::<CpuBackend>::rows(vocab, r, tp);
                assert_eq!(rows.start, next.min(vocab));
                assert!(rows.len() <= vocab.div_ceil(tp));
                next = rows.end;
            }
            assert_eq!(next, vocab, "vocab {vocab} tp {tp}");
        }
    }
}
