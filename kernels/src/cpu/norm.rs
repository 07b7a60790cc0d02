//! RMSNorm with the sum of squares in the leaf's fixed order.
use super::leaf::sum_squares;

/// RMSNorm per row: out = x / sqrt(mean(x²) + eps) * weight. x, out: [rows, cols].
///
/// As HF Llama, in f32: `inv = 1 / sqrt(Σx²/cols + eps)`, then `(x · inv) · weight`
/// (HF rounds `x · inv` to the activation dtype before the weight; arbor keeps f32).
/// Σx² uses the 16-lane leaf over the row, so it depends on the row alone.
pub fn rms_norm(x: &[f32], cols: usize, weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(
        weight.len(),
        cols,
        "rms_norm: weight has {} values for {cols} columns",
        weight.len()
    );
    assert_eq!(
        out.len(),
        x.len(),
        "rms_norm: out has {} values, x has {}",
        out.len(),
        x.len()
    );
    if cols == 0 {
        assert!(x.is_empty(), "rms_norm: {} values with 0 columns", x.len());
        return;
    }
    assert_eq!(
        x.len() % cols,
        0,
        "rms_norm: {} values are not rows of {cols} columns",
        x.len()
    );
    for (xr, or) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let mean = sum_squares(xr) / cols as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * inv) * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{first_bit_diff, Rng};

    #[test]
    fn close_to_f64_and_row_invariant() {
        let mut rng = Rng::new(10);
        for cols in [1usize, 7, 16, 33, 4096] {
            let rows = 5;
            let x = rng.f32_vec(rows * cols, 6);
            let w = rng.f32_vec(cols, 1);
            let eps = 1e-5f32;
            let mut out = vec![0.0; rows * cols];
            rms_norm(&x, cols, &w, eps, &mut out);
            for r in 0..rows {
                let xr = &x[r * cols..(r + 1) * cols];
                let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                for c in 0..cols {
                    let want = xr[c] as f64 * inv * w[c] as f64;
                    let got = out[r * cols + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs() + 1e-30,
                        "cols={cols} r={r} c={c}: {got} vs {want}"
                    );
                }
                // The row alone gives the same bits.
                let mut alone = vec![0.0; cols];
                rms_norm(xr, cols, &w, eps, &mut alone);
                assert_eq!(
                    first_bit_diff(&alone, &out[r * cols..(r + 1) * cols]),
                    None,
                    "cols={cols} row {r}"
                );
            }
        }
    }

    #[test]
    fn empty_input_is_fine() {
        rms_norm(&[], 4, &[1.0; 4], 1e-6, &mut []);
        rms_norm(&[], 0, &[], 1e-6, &mut []);
    }
}
