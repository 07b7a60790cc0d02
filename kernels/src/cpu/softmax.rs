//! Softmax helpers over one row, in index order.

/// In-place softmax over one row, fixed order: max, then exp(x - max) and their sum in
/// index order, then each value divided by the sum.
pub fn softmax(row: &mut [f32]) {
    if row.is_empty() {
        return;
    }
    let max = row_max(row);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// log_softmax(row)[idx], fixed order (max, then sum of exp in index order).
pub fn log_softmax_at(row: &[f32], idx: usize) -> f32 {
    assert!(
        idx < row.len(),
        "log_softmax_at: index {idx} out of a row of {}",
        row.len()
    );
    let max = row_max(row);
    let sum = row.iter().fold(0.0f32, |s, &v| s + (v - max).exp());
    (row[idx] - max) - sum.ln()
}

/// What a step's record needs from one logits row, computed where the logits are (on the
/// GPU by `row_stats_kernel`, on the host by the model's sampling code), so that only these
/// bytes leave the device per row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// [`argmax`]: the greedy token.
    pub argmax: u32,
    /// The row's value at `argmax`.
    pub max: f32,
    /// log Σ exp over the row (the backend's fixed order).
    pub lse: f32,
    /// The row's value at the requested index (NaN when none was requested).
    pub picked: f32,
    /// [`crate::cpu::digest`] of the row.
    pub digest: u64,
    /// [`crate::cpu::gumbel_argmax`] when a draw was requested (`u32::MAX`: none).
    pub sampled: u32,
    /// The row's value at `sampled` (NaN when none was drawn).
    pub sampled_value: f32,
    /// [`crate::cpu::gumbel::tempered_sum`] in the backend's order, for a top-p draw
    /// (NaN when none was asked for).
    pub tempered_sum: f32,
}

/// Index of the largest value; the lowest index wins ties. NaN never wins; a row of
/// only NaN (or an empty row) gives 0.
pub fn argmax(row: &[f32]) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// The largest non-NaN value (−inf if none), in index order.
fn row_max(row: &[f32]) -> f32 {
    row.iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_f64() {
        let x = [1.0f32, -2.0, 3.5, 0.0, 3.5, f32::NEG_INFINITY, -50.0];
        let mut y = x;
        softmax(&mut y);
        let m = 3.5f64;
        let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        for i in 0..x.len() {
            let want = (x[i] as f64 - m).exp() / z;
            assert!(
                (y[i] as f64 - want).abs() <= 1e-6 * want + 1e-30,
                "{i}: {} vs {want}",
                y[i]
            );
            let lw = x[i] as f64 - m - z.ln();
            let lg = log_softmax_at(&x, i) as f64;
            assert!(
                lg == lw || (lg - lw).abs() <= 1e-6 * lw.abs(),
                "log {i}: {lg} vs {lw}"
            );
        }
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 1.0]), 1);
        assert_eq!(argmax(&[-1.0, f32::NAN, 5.0, f32::INFINITY]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        // -0.0 and +0.0 compare equal: the first wins.
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
    }
}
