//! Temperature sampling by the Gumbel-max trick, defined so that a GPU can draw the token
//! where the logits are: token = argmax_i (x_i · inv_t + g_i) over the row (lowest index on
//! ties, NaN never wins), with g_i = −ln(−ln u_i) and u_i a pure function of the row's key
//! and i. Every value is computed on its own and the argmax is exact, so the token depends
//! only on the row and the key: not on the batch, the TP size (every rank holds the whole
//! row) or how the reduction is split. This is the host definition `row_stats_kernel`
//! follows (its `logf` may differ from the host's `ln` in the last bit, so a backend's
//! draws are its own, like its logits).

/// One row's draw: the inverse temperature and the key of its noise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GumbelDraw {
    pub inv_t: f32,
    pub key: u64,
}

/// What a row's stats compute for the token it samples, where the logits are.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RowDraw {
    /// Nothing: a greedy or scored row, or a top-k draw (made on the host from the
    /// row's candidates).
    #[default]
    None,
    /// A pure temperature: the Gumbel-max draw.
    Gumbel(GumbelDraw),
    /// A top-p (nucleus) draw over the whole vocabulary: the tempered sum
    /// [`tempered_sum`] its cut compares with (the draw itself is made on the host from
    /// the row's candidates, or from the row when the nucleus is larger).
    Nucleus { inv_t: f32 },
}

/// The draw of a constrained row that a backend makes where the logits are, over the
/// row's allowed ids only: the allowed argmax of a greedy row, or the allowed Gumbel-max
/// of a pure temperature (the model crate's `constraint::draw_masked` is its host
/// definition).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaskedDraw {
    Argmax,
    Gumbel(GumbelDraw),
}

/// Σ exp(x·inv_t − max·inv_t) over the row's values, NaN included (max over the
/// non-NaN ones), in index order: the host's definition of the sum a top-p cut compares
/// with. A backend computes it in an order of its own (the GPU's row-stats kernel: strided
/// per thread, then a fixed tree), fixed per row, so each backend's draws are its own.
pub fn tempered_sum(row: &[f32], inv_t: f32) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return 0.0;
    }
    let mt = m * inv_t;
    let mut s = 0.0f32;
    for &x in row {
        s += (x * inv_t - mt).exp();
    }
    s
}

/// SplitMix64's finaliser (after the golden-ratio increment).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The noise of index `i`: u = (top 24 bits of splitmix64(key ^ i) + ½) / 2²⁴, in (0, 1)
/// and exact in f32; g = −ln(−ln u).
pub fn gumbel(key: u64, i: usize) -> f32 {
    let h = splitmix64(key ^ i as u64);
    let u = ((h >> 40) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32);
    -(-u.ln()).ln()
}

/// The perturbed value of `x` at index `i` (a multiply, then an add: no fma).
pub fn gumbel_key(x: f32, i: usize, draw: GumbelDraw) -> f32 {
    x * draw.inv_t + gumbel(draw.key, i)
}

/// The drawn index; 0 for an empty row or one of only NaN.
pub fn gumbel_argmax(row: &[f32], draw: GumbelDraw) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        let k = gumbel_key(x, i, draw);
        match best {
            Some((_, b)) if k.partial_cmp(&b) != Some(std::cmp::Ordering::Greater) => {}
            _ => best = Some((i, k)),
        }
    }
    best.map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_a_function_of_key_and_index() {
        assert_eq!(gumbel(7, 3).to_bits(), gumbel(7, 3).to_bits());
        assert_ne!(gumbel(7, 3).to_bits(), gumbel(8, 3).to_bits());
        assert_ne!(gumbel(7, 3).to_bits(), gumbel(7, 4).to_bits());
        for i in 0..10_000 {
            assert!(gumbel(99, i).is_finite(), "index {i}");
        }
    }

    #[test]
    fn draws_follow_the_tempered_softmax() {
        let row = [1.0f32, 2.0, 0.5, f32::NAN, 2.0];
        let inv_t = 1.0 / 0.8;
        let w: Vec<f64> = row
            .iter()
            .map(|&x| {
                if x.is_nan() {
                    0.0
                } else {
                    (x as f64 * inv_t as f64).exp()
                }
            })
            .collect();
        let z: f64 = w.iter().sum();
        let n = 40_000;
        let mut counts = [0usize; 5];
        for key in 0..n {
            counts[gumbel_argmax(
                &row,
                GumbelDraw {
                    inv_t,
                    key: splitmix64(key),
                },
            )] += 1;
        }
        assert_eq!(counts[3], 0, "NaN was drawn");
        for (i, &c) in counts.iter().enumerate() {
            let p = w[i] / z;
            let got = c as f64 / n as f64;
            assert!(
                (got - p).abs() < 0.01,
                "index {i}: drawn {got:.4}, probability {p:.4}"
            );
        }
    }

    #[test]
    fn empty_and_all_nan_rows_give_zero() {
        let d = GumbelDraw { inv_t: 1.0, key: 1 };
        assert_eq!(gumbel_argmax(&[], d), 0);
        assert_eq!(gumbel_argmax(&[f32::NAN, f32::NAN], d), 0);
    }
}
