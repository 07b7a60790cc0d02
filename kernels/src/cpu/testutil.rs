//! Deterministic test data (no rand dependency needed for a few thousand numbers).
use half::bf16;

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// splitmix64
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Signed values spread over `2^-spread .. 2^spread`, so that the order of a sum shows
    /// in its rounding.
    pub fn wide(&mut self, spread: i32) -> f32 {
        let e = (self.next_u64() % (2 * spread as u64 + 1)) as i32 - spread;
        self.unit() * 2f32.powi(e)
    }

    pub fn bf16_vec(&mut self, n: usize, spread: i32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.wide(spread))).collect()
    }

    pub fn f32_vec(&mut self, n: usize, spread: i32) -> Vec<f32> {
        (0..n).map(|_| self.wide(spread)).collect()
    }
}

/// First index where two f32 slices differ bitwise.
pub fn first_bit_diff(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
        .map(|i| (i, a[i], b[i]))
}
