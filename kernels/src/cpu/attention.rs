//! Causal attention with GQA over a bf16 KV cache: keys in fixed-size blocks aligned at
//! absolute position 0, blocks combined in key order with the online softmax. One code
//! path serves many query rows (prefill) and one row against a cache (decode).
//!
//! For one (row, head): with running max m, running sum l and accumulator acc, each block
//! of keys `[b·ATTN_BLOCK, min((b+1)·ATTN_BLOCK, pos+1))` does
//!   s_j = leaf_dot(q, k_j) · scale                      (j in key order)
//!   m'  = max(m, max_j s_j);   c = exp(m − m')  (0 for the first block)
//!   l   = l·c + Σ_j exp(s_j − m')                        (Σ in key order)
//!   acc = acc·c + Σ_j exp(s_j − m')·v_j                  (Σ in key order)
//! and the output is acc / l. Nothing depends on how many rows the call holds.
use half::bf16;

use super::leaf::{bf16_to_f32, dot_f32_bf16};
use super::threads::{for_each_chunk_mut, threads_for};

/// Keys per block. Fixed: changing it changes bits.
pub const ATTN_BLOCK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// q: [rows, n_heads*head_dim] f32 for one sequence's query rows at positions
/// `pos0 .. pos0+rows`; k, v: [len, n_kv_heads*head_dim] bf16, keys of positions `0..len`
/// with `len >= pos0 + rows`. Row i attends keys `0..=pos0+i`. out: like q.
///
/// Head h reads KV head `h / (n_heads / n_kv_heads)`. Panics naming the sizes if the
/// slices do not match `shape` (a caller's programming error).
pub fn attention(
    q: &[f32],
    pos0: usize,
    k: &[bf16],
    v: &[bf16],
    shape: AttnShape,
    out: &mut [f32],
) {
    let width = shape.n_heads * shape.head_dim;
    let rows = q.len().checked_div(width).unwrap_or(0);
    // Multiply-adds: rows·heads·keys·head_dim for scores and again for values.
    let keys: usize = (0..rows).map(|i| pos0 + i + 1).sum();
    let work = 2 * keys * width;
    attention_on(
        q,
        pos0,
        k,
        v,
        shape,
        out,
        threads_for(work, rows * shape.n_heads),
    );
}

/// [`attention`] on an explicit number of threads (the result does not depend on it).
pub fn attention_on(
    q: &[f32],
    pos0: usize,
    k: &[bf16],
    v: &[bf16],
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
    let kv_width = n_kv_heads * head_dim;
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
    assert_eq!(
        k.len(),
        v.len(),
        "attention: k has {} values, v has {}",
        k.len(),
        v.len()
    );
    assert_eq!(
        k.len() % kv_width,
        0,
        "attention: cache of {} values is not rows of {n_kv_heads}×{head_dim}",
        k.len()
    );
    let rows = q.len() / width;
    let len = k.len() / kv_width;
    assert!(
        pos0 + rows <= len,
        "attention: rows at positions {pos0}..{} need keys the cache of {len} does not hold",
        pos0 + rows
    );
    let group = n_heads / n_kv_heads;
    let kv = Kv {
        k,
        v,
        kv_width,
        head_dim,
    };
    for_each_chunk_mut(out, head_dim, threads, |j, o| {
        let (i, h) = (j / n_heads, j % n_heads);
        let qh = &q[i * width + h * head_dim..][..head_dim];
        head_row(qh, &kv, h / group, pos0 + i + 1, scale, o);
    });
}

struct Kv<'a> {
    k: &'a [bf16],
    v: &'a [bf16],
    kv_width: usize,
    head_dim: usize,
}

/// One query head against keys `0..n_keys` of KV head `kvh`; `out` is the accumulator.
fn head_row(qh: &[f32], kv: &Kv, kvh: usize, n_keys: usize, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        unsafe { head_row_avx512(qh, kv, kvh, n_keys, scale, out) };
        return;
    }
    head_row_impl(qh, kv, kvh, n_keys, scale, out);
}

// Wider vectors for the same per-lane operations (and the same libm `exp` calls): the
// bits do not change, only the speed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn head_row_avx512(qh: &[f32], kv: &Kv, kvh: usize, n_keys: usize, scale: f32, out: &mut [f32]) {
    head_row_impl(qh, kv, kvh, n_keys, scale, out);
}

#[inline(always)]
fn head_row_impl(qh: &[f32], kv: &Kv, kvh: usize, n_keys: usize, scale: f32, out: &mut [f32]) {
    let hd = kv.head_dim;
    let at = |pos: usize| pos * kv.kv_width + kvh * hd;
    out.fill(0.0);
    let mut block_acc = vec![0.0f32; hd];
    let mut scores = [0.0f32; ATTN_BLOCK];
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    let mut first = true;
    for b0 in (0..n_keys).step_by(ATTN_BLOCK) {
        let keys = b0..(b0 + ATTN_BLOCK).min(n_keys);
        let sc = &mut scores[..keys.len()];
        for (s, pos) in sc.iter_mut().zip(keys.clone()) {
            *s = dot_f32_bf16(qh, &kv.k[at(pos)..at(pos) + hd]) * scale;
        }
        let block_max = sc
            .iter()
            .fold(f32::NEG_INFINITY, |a, &s| if s > a { s } else { a });
        let m_new = if block_max > m { block_max } else { m };
        block_acc.fill(0.0);
        let mut block_sum = 0.0f32;
        for (&s, pos) in sc.iter().zip(keys) {
            let p = (s - m_new).exp();
            block_sum += p;
            for (a, &vv) in block_acc.iter_mut().zip(&kv.v[at(pos)..at(pos) + hd]) {
                *a += p * bf16_to_f32(vv);
            }
        }
        if first {
            l = block_sum;
            out.copy_from_slice(&block_acc);
            first = false;
        } else {
            let c = (m - m_new).exp();
            l = l * c + block_sum;
            for (o, &a) in out.iter_mut().zip(&block_acc) {
                *o = *o * c + a;
            }
        }
        m = m_new;
    }
    for o in out.iter_mut() {
        *o /= l;
    }
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

    #[test]
    fn close_to_f64() {
        let len = 75;
        let (q, k, v) = data(len, 30);
        let mut out = vec![0.0; q.len()];
        attention(&q, 0, &k, &v, SHAPE, &mut out);
        let want = f64_ref(&q, 0, &k, &v, SHAPE);
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn prefill_equals_decode_bitwise() {
        let len = 75; // more than two blocks, the last one partial
        let (q, k, v) = data(len, 31);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let kw = SHAPE.n_kv_heads * SHAPE.head_dim;
        let mut prefill = vec![0.0; q.len()];
        attention_on(&q, 0, &k, &v, SHAPE, &mut prefill, 1);
        for threads in [2, 3] {
            let mut again = vec![0.0; q.len()];
            attention_on(&q, 0, &k, &v, SHAPE, &mut again, threads);
            assert_eq!(first_bit_diff(&again, &prefill), None, "threads {threads}");
        }
        for p in 0..len {
            let row = &q[p * w..(p + 1) * w];
            // Decode against a cache holding exactly p+1 keys, and against a longer one.
            for cache_len in [p + 1, len] {
                let mut one = vec![0.0; w];
                attention_on(
                    row,
                    p,
                    &k[..cache_len * kw],
                    &v[..cache_len * kw],
                    SHAPE,
                    &mut one,
                    1,
                );
                assert_eq!(
                    first_bit_diff(&one, &prefill[p * w..(p + 1) * w]),
                    None,
                    "position {p}, cache {cache_len}"
                );
            }
        }
        // A chunked prefill (rows 33..50 after a cached prefix) gives the same rows.
        let mut chunk = vec![0.0; 17 * w];
        attention_on(&q[33 * w..50 * w], 33, &k, &v, SHAPE, &mut chunk, 2);
        assert_eq!(
            first_bit_diff(&chunk, &prefill[33 * w..50 * w]),
            None,
            "chunk 33..50"
        );
    }

    #[test]
    fn vector_width_does_not_change_bits() {
        let len = 40;
        let (q, k, v) = data(len, 33);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let mut fast = vec![0.0; q.len()];
        attention_on(&q, 0, &k, &v, SHAPE, &mut fast, 1);
        let kv = Kv {
            k: &k,
            v: &v,
            kv_width: SHAPE.n_kv_heads * SHAPE.head_dim,
            head_dim: SHAPE.head_dim,
        };
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
    #[should_panic(expected = "need keys the cache of 4 does not hold")]
    fn short_cache_is_named() {
        let (q, k, v) = data(4, 32);
        let w = SHAPE.n_heads * SHAPE.head_dim;
        let mut out = vec![0.0; w];
        attention(&q[..w], 4, &k, &v, SHAPE, &mut out);
    }
}
