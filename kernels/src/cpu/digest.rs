//! The logits digest: a 64-bit fingerprint of a row's bits that the GPU computes in
//! parallel (`cuda/rowstats.cu`) with the same value as this host definition.
//!
//! Three levels of one fold, `h ← (h ⊕ w) · FNV_PRIME` from `FNV_BASIS` (FNV-1a over whole
//! words instead of bytes): over each [`DIGEST_CHUNK`]-value chunk's bits, over each
//! group of [`DIGEST_GROUP`] chunk digests, over the group digests. Each step is a
//! bijection of `h` for a fixed word and of the word for a fixed `h`, so any changed bit of
//! any one value changes the digest. The levels are what the GPU parallelises (a thread
//! per chunk, a thread per group): the byte-wise fold of every chunk digest that this
//! replaced was ~4000 dependent steps on one thread, 60 % of a 100 µs kernel.

/// Values per chunk.
pub const DIGEST_CHUNK: usize = 256;
/// Chunk digests per group.
pub const DIGEST_GROUP: usize = 32;
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fold(words: impl IntoIterator<Item = u64>) -> u64 {
    words
        .into_iter()
        .fold(FNV_BASIS, |h, w| (h ^ w).wrapping_mul(FNV_PRIME))
}

/// The digest of a row (see the module's text).
pub fn digest(logits: &[f32]) -> u64 {
    fold(logits.chunks(DIGEST_CHUNK * DIGEST_GROUP).map(|group| {
        fold(
            group
                .chunks(DIGEST_CHUNK)
                .map(|chunk| fold(chunk.iter().map(|x| x.to_bits() as u64))),
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition written out step by step, for a row of 2 groups (the second short)
    /// and a short last chunk.
    #[test]
    fn digest_is_three_levels_of_word_folds() {
        let n = DIGEST_CHUNK * DIGEST_GROUP + 600;
        let row: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 100.0).collect();
        let step = |h: u64, w: u64| (h ^ w).wrapping_mul(FNV_PRIME);
        let mut chunks = Vec::new();
        let mut i = 0;
        while i < n {
            let end = (i + DIGEST_CHUNK).min(n);
            let mut h = FNV_BASIS;
            for x in &row[i..end] {
                h = step(h, x.to_bits() as u64);
            }
            chunks.push(h);
            i = end;
        }
        assert_eq!(chunks.len(), DIGEST_GROUP + 3);
        let mut groups = Vec::new();
        for g in chunks.chunks(DIGEST_GROUP) {
            groups.push(g.iter().fold(FNV_BASIS, |h, &d| step(h, d)));
        }
        let want = groups.iter().fold(FNV_BASIS, |h, &g| step(h, g));
        assert_eq!(digest(&row), want);
        assert_eq!(digest(&[]), FNV_BASIS);
    }

    #[test]
    fn digest_sees_every_bit() {
        let row: Vec<f32> = (0..DIGEST_CHUNK * DIGEST_GROUP * 2 + 7)
            .map(|i| (i as f32).sin())
            .collect();
        let d = digest(&row);
        for i in [
            0,
            1,
            DIGEST_CHUNK,
            DIGEST_CHUNK * DIGEST_GROUP,
            row.len() - 1,
        ] {
            for bit in [0, 17, 31] {
                let mut r = row.clone();
                r[i] = f32::from_bits(r[i].to_bits() ^ (1 << bit));
                assert_ne!(digest(&r), d, "value {i} bit {bit}");
            }
        }
        assert_ne!(digest(&[0.0]), digest(&[-0.0]));
        // Order matters: swapping two values changes it.
        let mut r = row.clone();
        r.swap(3, 4);
        assert_ne!(digest(&r), d);
    }
}
