//! The host-side tree every GPU algorithm must match bit for bit, for f32 and bf16.
//!
//! bf16 follows the contract "inputs bf16, tree in f32, output rounded once": each rank's
//! value is widened exactly, the ranks are combined by `arbor_kernels::tree::combine_roots`,
//! and the root is rounded to bf16 to nearest-even (the same rounding as
//! `half::bf16::from_f32` and the CUDA kernels).

use arbor_kernels::tree::combine_roots;

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

pub fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (rounded >> 16) as u16
}

/// Element-wise tree over the ranks' f32 buffers (rank order); 1, 2, 4 or 8 ranks.
pub fn tree_reference_f32(inputs: &[&[f32]]) -> Vec<f32> {
    let n = inputs.first().map_or(0, |b| b.len());
    let mut out = vec![0.0f32; n];
    combine_roots(inputs, &mut out);
    out
}

/// Element-wise tree over the ranks' bf16 buffers: widen, combine in f32, round once.
pub fn tree_reference_bf16(inputs: &[&[u16]]) -> Vec<u16> {
    let wide: Vec<Vec<f32>> = inputs
        .iter()
        .map(|b| b.iter().map(|&h| bf16_to_f32(h)).collect())
        .collect();
    let refs: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
    tree_reference_f32(&refs)
        .into_iter()
        .map(f32_to_bf16)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3f81);
        assert_eq!(f32_to_bf16(-2.0), 0xc000);
        assert_eq!(bf16_to_f32(0x3f81), 1.0 + 2f32.powi(-7));
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn bf16_reference_rounds_once_after_the_tree() {
        // In bf16, 256 + 1 + 1 rounds to 256 at every step when rounded per addition;
        // widened and summed in f32 it is 258, exactly representable in bf16.
        let a = [f32_to_bf16(256.0)];
        let b = [f32_to_bf16(1.0)];
        let out = tree_reference_bf16(&[&a, &b, &b, &[f32_to_bf16(0.0)]]);
        assert_eq!(bf16_to_f32(out[0]), 258.0);
    }

    #[test]
    fn f32_reference_is_the_tree() {
        let r: Vec<[f32; 1]> = vec![[1e8], [1.0], [-1e8], [1.0]];
        let refs: Vec<&[f32]> = r.iter().map(|x| x.as_slice()).collect();
        // ((1e8 + 1) + (-1e8 + 1)) = 1e8 + -1e8 = 0 in f32; a sequential sum gives 1.
        assert_eq!(tree_reference_f32(&refs)[0].to_bits(), 0.0f32.to_bits());
    }
}
