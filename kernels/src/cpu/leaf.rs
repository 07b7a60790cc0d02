//! The CPU leaf: how one contiguous run of products is summed.
//!
//! Element i of the run goes to lane `i % LANES` (multiply, then add: no FMA), every lane
//! starts at +0.0, and the lanes are combined by the fixed pairwise tree. The result
//! depends only on the run's data, never on how the caller vectorises or tiles, because
//! each lane is a plain sequence of correctly rounded f32 operations.

use half::bf16;

/// Lanes of the leaf accumulator.
pub const LANES: usize = 16;

/// bf16 → f32 is exact: the bf16 bits are the high half of the f32.
#[inline(always)]
pub fn bf16_to_f32(b: bf16) -> f32 {
    f32::from_bits((b.to_bits() as u32) << 16)
}

/// Pairwise tree over the 16 lanes: `((l0+l1)+(l2+l3)) + …`, the same shape as
/// `tree::tree_sum` over 16 values.
#[inline(always)]
pub fn lanes_tree(a: &[f32; LANES]) -> f32 {
    let mut b = [0.0f32; 8];
    for i in 0..8 {
        b[i] = a[2 * i] + a[2 * i + 1];
    }
    let c = [b[0] + b[1], b[2] + b[3], b[4] + b[5], b[6] + b[7]];
    (c[0] + c[1]) + (c[2] + c[3])
}

/// The leaf over `a[i] * b[i]` (f32 × bf16), e.g. a query against one key.
#[inline(always)]
pub fn dot_f32_bf16(a: &[f32], b: &[bf16]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * bf16_to_f32(xb[l]);
        }
    }
    for (l, (xa, xb)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += xa * bf16_to_f32(*xb);
    }
    lanes_tree(&acc)
}

/// The leaf over `a[i] * a[i]` (RMSNorm's sum of squares).
#[inline(always)]
pub fn sum_squares(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    for xa in &mut ca {
        for l in 0..LANES {
            acc[l] += xa[l] * xa[l];
        }
    }
    for (l, x) in ca.remainder().iter().enumerate() {
        acc[l] += x * x;
    }
    lanes_tree(&acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tree_sum;

    #[test]
    fn lanes_tree_is_the_tree_shape() {
        let mut rng = crate::cpu::testutil::Rng::new(5);
        let a: [f32; LANES] = std::array::from_fn(|_| rng.wide(20));
        assert_eq!(lanes_tree(&a).to_bits(), tree_sum(&a).to_bits());
        let seq = a.iter().fold(0.0f32, |s, v| s + v);
        assert_ne!(
            seq.to_bits(),
            lanes_tree(&a).to_bits(),
            "data too tame to tell orders apart"
        );
    }

    #[test]
    fn bf16_conversion_is_exact() {
        for v in [0.0f32, -0.0, 1.0, -3.5, 1e-30, 6.5e4, f32::INFINITY] {
            let b = bf16::from_f32(v);
            assert_eq!(bf16_to_f32(b).to_bits(), b.to_f32().to_bits());
        }
    }
}
