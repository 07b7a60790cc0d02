//! The logits digest: a 64-bit fingerprint of a row's bits that the GPU computes in
//! parallel (`cuda/rowstats.cu`) with the same value as this host definition.

/// Values per chunk.
pub const DIGEST_CHUNK: usize = 256;
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut h: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// FNV-1a over the little-endian bytes of the FNV-1a digests of consecutive
/// [`DIGEST_CHUNK`]-value chunks (each over its values' little-endian bytes). Any changed
/// bit of any value changes it.
pub fn digest(logits: &[f32]) -> u64 {
    logits.chunks(DIGEST_CHUNK).fold(FNV_BASIS, |h, chunk| {
        let d = fnv1a(
            FNV_BASIS,
            chunk.iter().flat_map(|x| x.to_bits().to_le_bytes()),
        );
        fnv1a(h, d.to_le_bytes())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_fnv_of_chunk_fnvs() {
        let row: Vec<f32> = (0..600).map(|i| i as f32 * 0.5 - 100.0).collect();
        let chunk = |c: &[f32]| fnv1a(FNV_BASIS, c.iter().flat_map(|x| x.to_bits().to_le_bytes()));
        let want = [&row[..256], &row[256..512], &row[512..]]
            .iter()
            .fold(FNV_BASIS, |h, c| fnv1a(h, chunk(c).to_le_bytes()));
        assert_eq!(digest(&row), want);
        assert_eq!(digest(&[]), FNV_BASIS);
    }

    #[test]
    fn digest_sees_every_bit() {
        let a = [1.0f32, 2.0, 3.0];
        let b = [1.0f32, 2.0, f32::from_bits(3.0f32.to_bits() ^ 1)];
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&[0.0]), digest(&[-0.0]));
    }
}
