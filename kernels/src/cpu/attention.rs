//! Causal attention with GQA over the paged bf16 KV cache (`crate::paged`): keys in
//! blocks of [`ATTN_BLOCK`] aligned at absolute position 0, blocks in splits of
//! [`ATTN_SPLIT`] keys aligned at 0, each split reduced with the online softmax from an
//! empty state, the splits folded in split order. One code path serves many query rows
//! (prefill) and one row against a cache (decode), and a row reads its keys through its
//! sequence's block table, so neither the rows beside it nor where its blocks lie change
//! its bits.
//!
//! For one (row, head), within a split, with running max m, running sum l and accumulator
//! acc, each block of keys `[b·ATTN_BLOCK, min((b+1)·ATTN_BLOCK, split end, pos+1))` does
//!   s_j = leaf_dot(q, k_j) · scale                      (j in key order)
//!   m'  = max(m, max_j s_j);   c = exp(m − m')  (the first block: a copy)
//!   l   = l·c + Σ_j exp(s_j − m')                        (Σ in key order)
//!   acc = acc·c + Σ_j exp(s_j − m')·v_j                  (Σ in key order)
//! The splits' states (m, l, acc) are folded in split order into the row's state, as the
//! GPU kernels fold theirs (kernels/cuda/paged_attention.cu): an empty split changes
//! nothing; into an empty state a split is copied; otherwise M = max(m_a, m_b),
//! e = 1 where m == M else exp(m − M), l = fma(l_b, e_b, l_a·e_a),
//! acc = fma(acc_b, e_b, acc_a·e_a). The output is acc / l. A row of at most ATTN_SPLIT
//! keys has one split, so its bits are those of one online softmax over its blocks.
use half::bf16;

use super::leaf::{bf16_to_f32, dot_f32_bf16};
use super::threads::{for_each_chunk_mut, threads_for};
use crate::paged::{blocks_for, PagedKvLayout, KV_BLOCK};

pub use crate::paged::ATTN_SPLIT;

/// Keys per block. Fixed: changing it changes bits. Divides [`KV_BLOCK`], so a block's
/// keys are contiguous in the cache.
pub const ATTN_BLOCK: usize = 32;
const _: () = assert!(KV_BLOCK.is_multiple_of(ATTN_BLOCK) && ATTN_SPLIT.is_multiple_of(ATTN_BLOCK));

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// One layer of a paged cache as one sequence sees it: the K and V pools
/// (`[layers, blocks, n_kv_heads, KV_BLOCK, head_dim]` each, `layout`), the layer, and the
/// sequence's block table (position p is row `p % KV_BLOCK` of block `table[p / KV_BLOCK]`).
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a> {
    pub k: &'a [bf16],
    pub v: &'a [bf16],
    pub layout: PagedKvLayout,
    pub layer: usize,
    pub table: &'a [u32],
}

impl PagedKv<'_> {
    /// Index of the first value of the key (or value) at `pos` for KV head `kvh`.
    fn at(&self, pos: usize, kvh: usize) -> usize {
        let block = self.table[pos / KV_BLOCK] as usize;
        self.layout.at(self.layer, block, kvh, pos % KV_BLOCK)
    }
}

/// q: `[rows, n_heads*head_dim]` f32 for one sequence's query rows at positions
/// `pos0 .. pos0+rows`; `kv` holds the keys of positions `0..pos0+rows`. Row i attends
/// keys `0..=pos0+i`. out: like q.
///
/// Head h reads KV head `h / (n_heads / n_kv_heads)`. Panics naming the sizes if the
/// slices do not match `shape`, or if the table does not cover the rows or names a block
/// outside the pool (a caller's programming error).
pub fn attention(q: &[f32], pos0: usize, kv: &PagedKv, shape: AttnShape, out: &mut [f32]) {
    let width = shape.n_heads * shape.head_dim;
    let rows = q.len().checked_div(width).unwrap_or(0);
    // Multiply-adds: rows·heads·keys·head_dim for scores and again for values.
    let keys: usize = (0..rows).map(|i| pos0 + i + 1).sum();
    let work = 2 * keys * width;
    attention_on(
        q,
        pos0,
        kv,
        shape,
        out,
        threads_for(work, rows * shape.n_heads),
    );
}

/// [`attention`] on an explicit number of threads (the result does not depend on it).
pub fn attention_on(
    q: &[f32],
    pos0: usize,
    kv: &PagedKv,
    shape: AttnShape,
    out: &mut [f32],
    threads: usize,
) {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        scale,
    } = shape;
    assert!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        "attention: {n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
    );
    let width = n_heads * head_dim;
    assert_eq!(
        out.len(),
        q.len(),
        "attention: out has {} values, q has {}",
        out.len(),
        q.len()
    );
    if width == 0 || q.is_empty() {
        return;
    }
    assert_eq!(
        q.len() % width,
        0,
        "attention: q of {} values is not rows of {n_heads}×{head_dim}",
        q.len()
    );
    let l = kv.layout;
    assert!(
        l.n_kv_heads == n_kv_heads && l.head_dim == head_dim,
        "attention: a cache of {} KV heads of {} for {n_kv_heads} KV heads of {head_dim}",
        l.n_kv_heads,
        l.head_dim
    );
    assert!(
        kv.k.len() == l.len() && kv.v.len() == l.len() && kv.layer < l.layers,
        "attention: k/v of {}/{} values and layer {} for a cache of {l:?}",
        kv.k.len(),
        kv.v.len(),
        kv.layer
    );
    let rows = q.len() / width;
    let need = blocks_for(pos0 + rows);
    assert!(
        kv.table.len() >= need,
        "attention: rows at positions {pos0}..{} need {need} blocks, the table has {}",
        pos0 + rows,
        kv.table.len()
    );
    if let Some(b) = kv.table[..need].iter().find(|&&b| b as usize >= l.blocks) {
        panic!("attention: block {b} of a cache of {} blocks", l.blocks);
    }
    let group = n_heads / n_kv_heads;
    for_each_chunk_mut(out, head_dim, threads, |j, o| {
        let (i, h) = (j / n_heads, j % n_heads);
        let qh = &q[i * width + h * head_dim..][..head_dim];
        head_row(qh, kv, h / group, pos0 + i + 1, scale, o);
    });
}

/// One query head against keys `0..n_keys` of KV head `kvh`; `out` is the accumulator.
fn head_row(qh: &[f32], kv: &PagedKv, kvh: usize, n_keys: usize, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        unsafe { head_row_avx512(qh, kv, kvh, n_keys, scale, out) };
        return;
    }
    head_row_impl(qh, kv, kvh, n_keys, scale, out);
}

// Wider vectors for the same per-lane operations (and the same libm `exp` calls, and
// correctly rounded fused multiply-adds either way): the bits do not change, only the speed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn head_row_avx512(
    qh: &[f32],
    kv: &PagedKv,
    kvh: usize,
    n_keys: usize,
    scale: f32,
    out: &mut [f32],
) {
    head_row_impl(qh, kv, kvh, n_keys, scale, out);
}

/// The online softmax's state over some keys: (max, sum, accumulator); empty before the
/// first key.
struct State<'a> {
    m: f32,
    l: f32,
    acc: &'a mut [f32],
    empty: bool,
}

#[inline(always)]
fn head_row_impl(qh: &[f32], kv: &PagedKv, kvh: usize, n_keys: usize, scale: f32, out: &mut [f32]) {
    let hd = qh.len();
    let mut split_acc = vec![0.0f32; hd];
    let mut block_acc = vec![0.0f32; hd];
    let mut scores = [0.0f32; ATTN_BLOCK];
    let mut row = State {
        m: f32::NEG_INFINITY,
        l: 0.0,
        acc: out,
        empty: true,
    };
    row.acc.fill(0.0);
    for s0 in (0..n_keys).step_by(ATTN_SPLIT) {
        let s_end = (s0 + ATTN_SPLIT).min(n_keys);
        let mut split = State {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: &mut split_acc,
            empty: true,
        };
        for b0 in (s0..s_end).step_by(ATTN_BLOCK) {
            let n = (b0 + ATTN_BLOCK).min(s_end) - b0;
            // A block of ATTN_BLOCK keys lies inside one KV block: contiguous keys.
            let base = kv.at(b0, kvh);
            let (ks, vs) = (&kv.k[base..base + n * hd], &kv.v[base..base + n * hd]);
            let sc = &mut scores[..n];
            for (s, k) in sc.iter_mut().zip(ks.chunks_exact(hd)) {
                *s = dot_f32_bf16(qh, k) * scale;
            }
            block(&mut split, sc, vs, &mut block_acc);
        }
        fold(&mut row, &split);
    }
    for o in row.acc.iter_mut() {
        *o /= row.l;
    }
}

/// One block of keys (their scores `sc`, their values `vs`) into a split's state.
#[inline(always)]
fn block(st: &mut State, sc: &[f32], vs: &[bf16], block_acc: &mut [f32]) {
    let hd = block_acc.len();
    let block_max = sc
        .iter()
        .fold(f32::NEG_INFINITY, |a, &s| if s > a { s } else { a });
    let m_new = if block_max > st.m { block_max } else { st.m };
    block_acc.fill(0.0);
    let mut block_sum = 0.0f32;
    for (&s, v) in sc.iter().zip(vs.chunks_exact(hd)) {
        let p = (s - m_new).exp();
        block_sum += p;
        for (a, &vv) in block_acc.iter_mut().zip(v) {
            *a += p * bf16_to_f32(vv);
        }
    }
    if st.empty {
        st.l = block_sum;
        st.acc.copy_from_slice(block_acc);
        st.empty = false;
    } else {
        let c = (st.m - m_new).exp();
        st.l = st.l * c + block_sum;
        for (o, &a) in st.acc.iter_mut().zip(block_acc.iter()) {
            *o = *o * c + a;
        }
    }
    st.m = m_new;
}

/// Folds split `b` into the row's state `a` (the module comment's fold).
#[inline(always)]
fn fold(a: &mut State, b: &State) {
    if b.empty {
        return;
    }
    if a.empty {
        a.m = b.m;
        a.l = b.l;
        a.acc.copy_from_slice(b.acc);
        a.empty = false;
        return;
    }
    let m = if b.m > a.m { b.m } else { a.m };
    let ea = if a.m == m { 1.0 } else { (a.m - m).exp() };
    let eb = if b.m == m { 1.0 } else { (b.m - m).exp() };
    a.l = b.l.mul_add(eb, a.l * ea);
    for (x, &y) in a.acc.iter_mut().zip(b.acc.iter()) {
        *x = y.mul_add(eb, *x * ea);
    }
    a.m = m;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{first_bit_diff, Rng};

    const SHAPE: AttnShape = AttnShape {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 20,
        scale: 0.2236068,
    };

    /// A sequence's keys and values (`[len, n_kv_heads·head_dim]`, contiguous) written
    /// into a pool of `blocks` blocks through `table`, the other blocks NaN.
    struct Pool {
        k: Vec<bf16>,
        v: Vec<bf16>,
        layout: PagedKvLayout,
        table: Vec<u32>,
    }

    impl Pool {
        fn new(k: &[bf16], v: &[bf16], s: AttnShape, layers: usize, table: Vec<u32>) -> Self {
            let kw = s.n_kv_heads * s.head_dim;
            let len = k.len() / kw;
            let blocks = table.iter().map(|&b| b as usize + 1).max().unwrap_or(0) + 1;
            let layout = PagedKvLayout {
                layers,
                blocks,
                n_kv_heads: s.n_kv_heads,
                head_dim: s.head_dim,
            };
            let mut pk = vec![bf16::NAN; layout.len()];
            let mut pv = vec![bf16::NAN; layout.len()];
            for layer in 0..layers {
                for p in 0..len {
                    for h in 0..s.n_kv_heads {
                        let at = layout.at(layer, table[p / KV_BLOCK] as usize, h, p % KV_BLOCK);
                        let src = p * kw + h * s.head_dim;
                        pk[at..at + s.head_dim].copy_from_slice(&k[src..src + s.head_dim]);
                        pv[at..at + s.head_dim].copy_from_slice(&v[src..src + s.head_dim]);
                    }
                }
            }
            Pool {
                k: pk,
                v: pv,
                layout,
                table,
            }
        }

        fn kv(&self, layer: usize) -> PagedKv<'_> {
            PagedKv {
                k: &self.k,
                v: &self.v,
                layout: self.layout,
                layer,
                table: &self.table,
            }
        }
    }

    fn f64_ref(q: &[f32], pos0: usize, k: &[bf16], v: &[bf16], s: AttnShape) -> Vec<f64> {
        let (w, kw) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let rows = q.len() / w;
        let mut out = vec![0.0; q.len()];
        for i in 0..rows {
            for h in 0..s.n_heads {
                let kvh = h / (s.n_heads / s.n_kv_heads);
                let n = pos0 + i + 1;
                let sc: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..s.head_dim)
                            .map(|d| {
                                q[i * w + h * s.head_dim + d] as f64
                                    * k[j * kw + kvh * s.head_dim + d].to_f64()
                            })
                            .sum::<f64>()
                            * s.scale as f64
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for d in 0..s.head_dim {
                    out[i * w + h * s.head_dim + d] = (0..n)
                        .map(|j| (sc[j] - mx).exp() / z * v[j * kw + kvh * s.head_dim + d].to_f64())
                        .sum();
                }
            }
        }
        out
    }

    fn data(len: usize, seed: u64) -> (Vec<f32>, Vec<bf16>, Vec<bf16>) {
        let mut rng = Rng::new(seed);
        let q = rng.f32_vec(len * SHAPE.n_heads * SHAPE.head_dim, 2);
        let kk = rng.bf16_vec(len * SHAPE.n_kv_heads * SHAPE.head_dim, 2);
        let vv = rng.bf16_vec(len * SHAPE.n_kv_heads * SHAPE.head_dim, 2);
        (q, kk, vv)
    }

    /// Block ids 0..n in a scrambled order.
    fn shuffled(n: usize, seed: u64) -> Vec<u32> {
        let mut t: Vec<u32> = (0..n as u32).collect();
        let mut rng = Rng::new(seed);
        for i in (1..n).rev() {
            t.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        t
    }

    fn close(got: &[f32], want: &[f64], tol: f64) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn close_to_f64() {
        let len = 75;
        let (q, k, v) = data(len, 30);
        let pool = Pool::new(&k, &v, SHAPE, 1, shuffled(blocks_for(len), 1));
        let mut out = vec![0.0; q.len()];
        attention(&q, 0, &pool.kv(0), SHAPE, &mut out);
        close(&out, &f64_ref(&q, 0, &k, &v, SHAPE), 1e-5);
    }

    /// Every row computed alone (decode) against caches holding exactly its keys and more,
    /// in chunks, and on several threads: the same bits as the prefill of all rows.
    fn check_prefill_equals_decode(len: usize, seed: u64, decode_rows: &[usize]) {
        let (q, k, v) = data(len, seed);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let kw = SHAPE.n_kv_heads * SHAPE.head_dim;
        let pool = Pool::new(&k, &v, SHAPE, 2, shuffled(blocks_for(len), seed));
        let kv = pool.kv(1);
        let mut prefill = vec![0.0; q.len()];
        attention_on(&q, 0, &kv, SHAPE, &mut prefill, 1);
        for threads in [2, 3] {
            let mut again = vec![0.0; q.len()];
            attention_on(&q, 0, &kv, SHAPE, &mut again, threads);
            assert_eq!(first_bit_diff(&again, &prefill), None, "threads {threads}");
        }
        for &p in decode_rows {
            let row = &q[p * w..(p + 1) * w];
            let mut one = vec![0.0; w];
            attention_on(row, p, &kv, SHAPE, &mut one, 1);
            assert_eq!(
                first_bit_diff(&one, &prefill[p * w..(p + 1) * w]),
                None,
                "position {p}"
            );
            // The same keys in a pool of their own, laid out in order, with only the
            // blocks the row needs: the table, not the pool, decides what a row reads.
            let n = p + 1;
            let own = Pool::new(
                &k[..n * kw],
                &v[..n * kw],
                SHAPE,
                1,
                (0..blocks_for(n) as u32).collect(),
            );
            let mut alone = vec![0.0; w];
            attention_on(row, p, &own.kv(0), SHAPE, &mut alone, 1);
            assert_eq!(first_bit_diff(&alone, &one), None, "position {p}, own pool");
        }
        // Chunked prefills after a cached prefix give the same rows.
        for (a, b) in [(33, 50), (len / 2, len)] {
            let mut chunk = vec![0.0; (b - a) * w];
            attention_on(&q[a * w..b * w], a, &kv, SHAPE, &mut chunk, 2);
            assert_eq!(
                first_bit_diff(&chunk, &prefill[a * w..b * w]),
                None,
                "chunk {a}..{b}"
            );
        }
    }

    #[test]
    fn prefill_equals_decode_bitwise() {
        // More than two key blocks, the last one partial: one split.
        check_prefill_equals_decode(75, 31, &(0..75).collect::<Vec<_>>());
    }

    #[test]
    fn split_boundaries_and_a_shuffled_table_keep_prefill_equal_to_decode() {
        // Three splits, the last partial; rows on both sides of each split boundary.
        let rows = [0, 63, 64, 510, 511, 512, 513, 700, 1023, 1024, 1025, 1199];
        check_prefill_equals_decode(1200, 35, &rows);
    }

    #[test]
    fn split_rows_are_close_to_f64() {
        // Rows whose keys span two and three splits (fewer heads: the reference is slow).
        let s = AttnShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 16,
            scale: 0.25,
        };
        let len = 1100;
        let mut rng = Rng::new(36);
        let k = rng.bf16_vec(len * s.head_dim, 2);
        let v = rng.bf16_vec(len * s.head_dim, 2);
        let pool = Pool::new(&k, &v, s, 1, shuffled(blocks_for(len), 7));
        for p in [511, 512, 900, 1099] {
            let q = rng.f32_vec(s.n_heads * s.head_dim, 2);
            let mut out = vec![0.0; q.len()];
            attention(&q, p, &pool.kv(0), s, &mut out);
            close(
                &out,
                &f64_ref(&q, p, &k[..(p + 1) * s.head_dim], &v, s),
                1e-5,
            );
        }
    }

    #[test]
    fn one_split_keeps_the_contiguous_online_softmax() {
        // Up to ATTN_SPLIT keys the fold is a copy: the plain online softmax over blocks of
        // ATTN_BLOCK, written out here on contiguous keys.
        let len = ATTN_SPLIT;
        let (q, k, v) = data(len, 37);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let kw = SHAPE.n_kv_heads * SHAPE.head_dim;
        let pool = Pool::new(&k, &v, SHAPE, 1, shuffled(blocks_for(len), 3));
        let p = len - 1;
        let mut got = vec![0.0; w];
        attention_on(&q[p * w..], p, &pool.kv(0), SHAPE, &mut got, 1);
        let group = SHAPE.n_heads / SHAPE.n_kv_heads;
        for h in 0..SHAPE.n_heads {
            let hd = SHAPE.head_dim;
            let qh = &q[p * w + h * hd..][..hd];
            let kvh = h / group;
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            let mut acc = vec![0.0f32; hd];
            for b0 in (0..len).step_by(ATTN_BLOCK) {
                let sc: Vec<f32> = (b0..b0 + ATTN_BLOCK)
                    .map(|j| dot_f32_bf16(qh, &k[j * kw + kvh * hd..][..hd]) * SHAPE.scale)
                    .collect();
                let bm = sc
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &s| if s > a { s } else { a });
                let mn = if bm > m { bm } else { m };
                let mut ba = vec![0.0f32; hd];
                let mut bs = 0.0f32;
                for (i, &s) in sc.iter().enumerate() {
                    let e = (s - mn).exp();
                    bs += e;
                    for (a, &vv) in ba.iter_mut().zip(&v[(b0 + i) * kw + kvh * hd..][..hd]) {
                        *a += e * vv.to_f32();
                    }
                }
                if b0 == 0 {
                    l = bs;
                    acc = ba;
                } else {
                    let c = (m - mn).exp();
                    l = l * c + bs;
                    for (o, a) in acc.iter_mut().zip(ba) {
                        *o = *o * c + a;
                    }
                }
                m = mn;
            }
            let want: Vec<f32> = acc.iter().map(|a| a / l).collect();
            assert_eq!(
                first_bit_diff(&got[h * hd..(h + 1) * hd], &want),
                None,
                "head {h}"
            );
        }
    }

    #[test]
    fn vector_width_does_not_change_bits() {
        let len = 600;
        let (q, k, v) = data(len, 33);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let pool = Pool::new(&k, &v, SHAPE, 1, shuffled(blocks_for(len), 4));
        let kv = pool.kv(0);
        let mut fast = vec![0.0; q.len()];
        attention_on(&q, 0, &kv, SHAPE, &mut fast, 1);
        let group = SHAPE.n_heads / SHAPE.n_kv_heads;
        let mut plain = vec![0.0; q.len()];
        for (j, o) in plain.chunks_mut(SHAPE.head_dim).enumerate() {
            let (i, h) = (j / SHAPE.n_heads, j % SHAPE.n_heads);
            let qh = &q[i * w + h * SHAPE.head_dim..][..SHAPE.head_dim];
            // Compiled for the baseline target, without the AVX-512 wrapper.
            head_row_impl(qh, &kv, h / group, i + 1, SHAPE.scale, o);
        }
        assert_eq!(first_bit_diff(&plain, &fast), None);
    }

    #[test]
    #[should_panic(expected = "need 2 blocks, the table has 1")]
    fn short_table_is_named() {
        let (q, k, v) = data(64, 32);
        let pool = Pool::new(&k, &v, SHAPE, 1, vec![0]);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let mut out = vec![0.0; w];
        attention(&q[..w], 64, &pool.kv(0), SHAPE, &mut out);
    }

    #[test]
    #[should_panic(expected = "block 9 of a cache of 2 blocks")]
    fn foreign_block_is_named() {
        let (q, k, v) = data(4, 34);
        let pool = Pool::new(&k, &v, SHAPE, 1, vec![0]);
        let kv = PagedKv {
            table: &[9],
            ..pool.kv(0)
        };
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let mut out = vec![0.0; w];
        attention(&q[..w], 0, &kv, SHAPE, &mut out);
    }
}
