//! Constrained decoding's side in the engine: a sequence may carry a [`Constraint`] that
//! says which tokens may come next, as a [`TokenMask`] the scheduler puts on the sequence's
//! sampled plan row. The engine knows nothing of grammars; the server's constraint
//! (`llguidance`, in `src/cli/serve/structured/`) computes the mask from the sequence's own
//! generated tokens alone, so a constrained row has the same mask alone, under load, after
//! a preemption and at every TP size.
//!
//! Every rank receives the mask with the plan. A greedy or pure-temperature row is drawn
//! where the logits are, over its allowed ids alone ([`draw_masked`],
//! `Backend::masked_draws`: on the GPU the masks go up, 4 bytes per 32 ids, and 8 bytes a
//! row come back, after the step's recording is replayed unchanged). A top-k or top-p row,
//! and the corner where no allowed value is above −∞, is drawn on the host from its row
//! ([`choose_masked`]), which comes down after the step as a top-p nucleus beyond the
//! candidates does (`wants_row`). The record's log-prob, top-N and digest are those of the
//! unmasked row: the model's own distribution, the same bits `arbor score` gives for the
//! same tokens.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::sampling::{self, MaskedDraw, Sampling};

/// The tokens a constrained row may sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenMask {
    /// The allowed ids, ascending (the shorter form when few are allowed, as inside a JSON
    /// string's keyword or a closing brace).
    Ids(Vec<u32>),
    /// One bit per id: id `i` is bit `i % 32` of word `i / 32`.
    Bits(Vec<u32>),
}

impl TokenMask {
    /// The mask of `words` (bit form, at least `vocab` bits; bits at or past `vocab` are
    /// dropped), in whichever form is smaller.
    pub fn from_bits(mut words: Vec<u32>, vocab: usize) -> Self {
        words.resize(vocab.div_ceil(32), 0);
        if !vocab.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (vocab % 32)) - 1;
            }
        }
        let count: usize = words.iter().map(|w| w.count_ones() as usize).sum();
        if count < words.len() {
            let ids = words
                .iter()
                .enumerate()
                .flat_map(|(w, &bits)| SetBits(bits).map(move |b| (w * 32 + b) as u32))
                .collect();
            TokenMask::Ids(ids)
        } else {
            TokenMask::Bits(words)
        }
    }

    /// The mask allowing exactly `ids` (any order; duplicates and ids at or past `vocab`
    /// dropped).
    pub fn from_ids(ids: &[u32], vocab: usize) -> Self {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &i in ids.iter().filter(|&&i| (i as usize) < vocab) {
            words[i as usize / 32] |= 1 << (i % 32);
        }
        Self::from_bits(words, vocab)
    }

    pub fn allows(&self, id: u32) -> bool {
        match self {
            TokenMask::Ids(ids) => ids.binary_search(&id).is_ok(),
            TokenMask::Bits(words) => bit(words, id),
        }
    }

    /// Every id of the vocabulary.
    pub fn all(vocab: usize) -> Self {
        Self::from_bits(vec![u32::MAX; vocab.div_ceil(32)], vocab)
    }

    /// This mask less `ids` (ids it does not allow are ignored).
    pub fn without(&self, ids: &[u32], vocab: usize) -> Self {
        match self {
            TokenMask::Ids(allowed) => TokenMask::Ids(
                allowed
                    .iter()
                    .copied()
                    .filter(|t| !ids.contains(t))
                    .collect(),
            ),
            TokenMask::Bits(words) => {
                let mut words = words.clone();
                for &i in ids {
                    if let Some(w) = words.get_mut(i as usize / 32) {
                        *w &= !(1 << (i % 32));
                    }
                }
                Self::from_bits(words, vocab)
            }
        }
    }

    /// How many ids it allows.
    pub fn count(&self) -> usize {
        match self {
            TokenMask::Ids(ids) => ids.len(),
            TokenMask::Bits(words) => words.iter().map(|w| w.count_ones() as usize).sum(),
        }
    }

    /// The allowed ids below `n`, ascending.
    pub fn iter_below(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        let (ids, words) = match self {
            TokenMask::Ids(ids) => (&ids[..], &[][..]),
            TokenMask::Bits(words) => (&[][..], &words[..]),
        };
        let from_ids = ids.iter().map(|&i| i as usize).filter(move |&i| i < n);
        let from_bits = words
            .iter()
            .enumerate()
            .take(n.div_ceil(32))
            .flat_map(|(w, &bits)| SetBits(bits).map(move |b| w * 32 + b))
            .filter(move |&i| i < n);
        from_ids.chain(from_bits)
    }

    /// How many allowed ids are below `n`.
    pub fn count_below(&self, n: usize) -> usize {
        match self {
            TokenMask::Ids(ids) => ids.iter().filter(|&&i| (i as usize) < n).count(),
            TokenMask::Bits(words) => {
                let full = (n / 32).min(words.len());
                let whole: usize = words[..full].iter().map(|w| w.count_ones() as usize).sum();
                let part = match words.get(full) {
                    Some(w) if !n.is_multiple_of(32) => {
                        (w & ((1u32 << (n % 32)) - 1)).count_ones() as usize
                    }
                    _ => 0,
                };
                whole + part
            }
        }
    }

    /// Why a mask from another rank cannot be one of this vocabulary's (ids out of order or
    /// past it, the wrong number of words, nothing allowed).
    pub fn check(&self, vocab: usize) -> Result<(), String> {
        match self {
            TokenMask::Ids(ids) => {
                if let Some(w) = ids.windows(2).find(|w| w[0] >= w[1]) {
                    return Err(format!(
                        "token mask ids are not ascending ({} then {})",
                        w[0], w[1]
                    ));
                }
                if let Some(&t) = ids.last().filter(|&&t| t as usize >= vocab) {
                    return Err(format!(
                        "token mask allows id {t}, outside the vocabulary of {vocab}"
                    ));
                }
            }
            TokenMask::Bits(words) if words.len() != vocab.div_ceil(32) => {
                return Err(format!(
                    "a token mask of {} words for a vocabulary of {vocab} (needs {})",
                    words.len(),
                    vocab.div_ceil(32)
                ))
            }
            TokenMask::Bits(_) => {}
        }
        if self.count() == 0 {
            return Err("a token mask that allows no token".into());
        }
        Ok(())
    }
}

/// The set bits of a word, lowest first.
struct SetBits(u32);

impl Iterator for SetBits {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

fn bit(words: &[u32], id: u32) -> bool {
    words
        .get(id as usize / 32)
        .is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// A sequence's rule for its next token. The mask must depend only on `generated` (the
/// tokens the sequence has generated so far, in order): the engine may ask again for a
/// shorter or different `generated` after a restart from the prompt, and asks once per
/// sampled row otherwise.
pub trait TokenConstraint: Send {
    fn allowed(&mut self, generated: &[u32]) -> TokenMask;

    /// The mask after `generated`, or `None` where the row is not constrained at all: such
    /// a row is drawn as an unconstrained one is (on the device, its row never downloaded),
    /// which a constraint that ends part-way (`MinTokens`) needs to cost nothing after.
    fn mask(&mut self, generated: &[u32]) -> Option<TokenMask> {
        Some(self.allowed(generated))
    }

    /// Whether the mask after `generated` may be computed after the step's plan has gone
    /// out, while the step's forward runs (a grammar's mask, tens to hundreds of
    /// microseconds a row): then `mask` must give `Some` for it. A cheap mask, or one
    /// that may be `None`, is computed with the plan (the default).
    fn masks_later(&mut self, _generated: &[u32]) -> bool {
        false
    }
}

/// A shared handle on a sequence's [`TokenConstraint`]: the request that made it keeps a
/// clone (to read what the constraint saw, such as an error), the scheduler asks it for
/// masks. Two handles are equal when they are the same constraint.
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<dyn TokenConstraint>>);

impl Constraint {
    pub fn new(c: impl TokenConstraint + 'static) -> Self {
        Constraint(Arc::new(Mutex::new(c)))
    }

    /// The mask after `generated`.
    pub fn allowed(&self, generated: &[u32]) -> TokenMask {
        // A panic inside one call leaves the constraint as that call left it; the next
        // call still answers (the server's constraint records its own errors).
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allowed(generated)
    }

    /// The mask after `generated`, `None` where the row is not constrained
    /// ([`TokenConstraint::mask`]).
    pub fn mask(&self, generated: &[u32]) -> Option<TokenMask> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .mask(generated)
    }

    /// [`TokenConstraint::masks_later`].
    pub fn masks_later(&self, generated: &[u32]) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .masks_later(generated)
    }
}

/// vLLM's `min_tokens` (SGLang's `min_new_tokens`): until a sequence has generated `min`
/// tokens, its stop tokens (end-of-sequence and the request's `stop_token_ids`) cannot be
/// drawn, as vLLM's min-tokens logits processor sets their logits to −∞ before sampling.
/// The ban depends on the count of the sequence's own tokens alone. It composes with the
/// sequence's own constraint (structured output): the ban is taken out of that mask,
/// unless the constraint allows nothing else (a grammar whose only way on is to end),
/// where the constraint wins and the sequence ends short of `min`. From `min` tokens on it
/// is the inner constraint alone, or no mask at all: the row goes back to the device's
/// draw, so a `min_tokens` of 1 costs one host-drawn token.
pub struct MinTokens {
    min: usize,
    /// Sorted, deduplicated, inside the vocabulary.
    stop: Vec<u32>,
    vocab: usize,
    inner: Option<Constraint>,
}

impl MinTokens {
    /// The constraint of a sequence that must generate `min` tokens before any of `stop`,
    /// over its own constraint `inner`: `inner` itself when `min` is 0 or nothing is banned.
    pub fn wrap(
        min: usize,
        stop: &[u32],
        vocab: usize,
        inner: Option<Constraint>,
    ) -> Option<Constraint> {
        let mut stop: Vec<u32> = stop
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        stop.sort_unstable();
        stop.dedup();
        if min == 0 || stop.is_empty() {
            return inner;
        }
        Some(Constraint::new(MinTokens {
            min,
            stop,
            vocab,
            inner,
        }))
    }
}

impl TokenConstraint for MinTokens {
    fn allowed(&mut self, generated: &[u32]) -> TokenMask {
        self.mask(generated)
            .unwrap_or_else(|| TokenMask::all(self.vocab))
    }

    fn mask(&mut self, generated: &[u32]) -> Option<TokenMask> {
        let inner = self.inner.as_ref().and_then(|c| c.mask(generated));
        if generated.len() >= self.min {
            return inner;
        }
        let base = inner.unwrap_or_else(|| TokenMask::all(self.vocab));
        let banned = base.without(&self.stop, self.vocab);
        Some(if banned.count() == 0 { base } else { banned })
    }

    /// Later when the inner constraint's mask is: then this one is `Some` too.
    fn masks_later(&mut self, generated: &[u32]) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|c| c.masks_later(generated))
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The token of a masked row: the row with every disallowed logit at −∞, drawn as
/// [`sampling::choose_with`] draws an unmasked row on the host (greedy: the allowed argmax,
/// lowest id on ties; a pure temperature: the Gumbel-max draw keyed by (seed, id,
/// position, token); top-k / top-p: among the allowed tokens, the top-p cut against their
/// own tempered sum). The draw over the kept −∞ entries can only land on one in a rounding
/// corner, or where every allowed logit is −∞ or NaN: then the allowed argmax (the lowest
/// allowed id when none is finite). The result is always allowed when the mask allows any.
///
/// Greedy and pure-temperature rows visit only the allowed ids ([`draw_masked`], which a
/// backend may compute where the logits are: a mask inside a JSON value allows a few
/// hundred of a vocabulary's 128k); the −∞ entries are accounted for where they could
/// change the result. Top-k and top-p sort a masked copy of the row.
pub fn choose_masked(row: &[f32], mask: &TokenMask, s: &Sampling, id: u64, position: usize) -> u32 {
    let n = row.len();
    if mask.count_below(n) == 0 {
        return choose_masked_copy(row, mask, s, id, position);
    }
    let draw = if s.is_greedy() || n <= 1 {
        MaskedDraw::Argmax
    } else if let Some(d) = sampling::gumbel_draw(s, id, position) {
        MaskedDraw::Gumbel(d)
    } else {
        return choose_masked_copy(row, mask, s, id, position);
    };
    if let Some(t) = draw_masked(row, mask, draw) {
        return t;
    }
    match draw {
        // The masked row's argmax is then some −∞ entry, which the check rejects.
        MaskedDraw::Argmax => allowed_argmax(row, mask),
        MaskedDraw::Gumbel(_) => {
            // Every key is −∞: the masked row's draw is its first non-NaN entry, kept when
            // it is allowed and above −∞ (a finite logit whose scaled value overflowed).
            let first = (0..n).find(|&i| !mask.allows(i as u32) || !row[i].is_nan());
            match first {
                Some(i) if mask.allows(i as u32) && row[i] > f32::NEG_INFINITY => i as u32,
                _ => allowed_argmax(row, mask),
            }
        }
    }
}

/// The draw of a constrained row that a backend makes where the logits are: the allowed
/// argmax of a greedy row, the allowed Gumbel-max of a pure temperature; `None` for top-k
/// and top-p rows, which sort on the host ([`choose_masked`]).
pub fn masked_draw(s: &Sampling, id: u64, position: usize) -> Option<MaskedDraw> {
    if s.is_greedy() {
        Some(MaskedDraw::Argmax)
    } else {
        sampling::gumbel_draw(s, id, position).map(MaskedDraw::Gumbel)
    }
}

/// `d` over the ids `mask` allows (below `row.len()`): the largest allowed value (or
/// Gumbel key `sampling::gumbel_key`), NaN never winning, lowest id on ties; `None` where
/// none is above −∞, the corner where [`choose_masked`]'s fallback rules decide. Where it
/// is `Some`, it is [`choose_masked`]'s token for that row and sampling: a backend that
/// computes it where the logits are (the CUDA masked-draw kernel) draws the same token
/// without the row leaving the device.
pub fn draw_masked(row: &[f32], mask: &TokenMask, d: MaskedDraw) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for i in mask.iter_below(row.len()) {
        let x = row[i];
        if x.is_nan() {
            continue;
        }
        let k = match d {
            MaskedDraw::Argmax => x,
            MaskedDraw::Gumbel(g) => sampling::gumbel_key(x, i, g),
        };
        match best {
            Some((_, b)) if k.partial_cmp(&b) != Some(std::cmp::Ordering::Greater) => {}
            _ => best = Some((i, k)),
        }
    }
    best.filter(|&(_, k)| k > f32::NEG_INFINITY)
        .map(|(i, _)| i as u32)
}

/// [`choose_masked`] on a masked copy of the row: the definition, which top-k and top-p
/// draws use as it is.
fn choose_masked_copy(
    row: &[f32],
    mask: &TokenMask,
    s: &Sampling,
    id: u64,
    position: usize,
) -> u32 {
    let mut masked = vec![f32::NEG_INFINITY; row.len()];
    for i in mask.iter_below(row.len()) {
        masked[i] = row[i];
    }
    let t = sampling::choose_with(&masked, s, id, position, None);
    if mask.allows(t)
        && masked
            .get(t as usize)
            .is_some_and(|&x| x > f32::NEG_INFINITY)
    {
        return t;
    }
    match mask.count_below(row.len()) {
        0 => t,
        _ => allowed_argmax(row, mask),
    }
}

/// The fallback of [`choose_masked`]: the largest allowed value, lowest id on ties, a
/// non-NaN one over NaN (the lowest allowed id when all are NaN); 0 when the mask allows
/// no id of the row.
fn allowed_argmax(row: &[f32], mask: &TokenMask) -> u32 {
    let mut best: Option<usize> = None;
    for i in mask.iter_below(row.len()) {
        let x = row[i];
        match best {
            None => best = Some(i),
            Some(b) if x > row[b] || row[b].is_nan() && !x.is_nan() => best = Some(i),
            Some(_) => {}
        }
    }
    best.map_or(0, |b| b as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize) -> Vec<f32> {
        // A varied row whose unmasked argmax is id 7.
        (0..n)
            .map(|i| if i == 7 { 5.0 } else { (i as f32 * 0.37).sin() })
            .collect()
    }

    /// The masked draw as first written: a copy of the row with the disallowed entries at
    /// −∞, `choose_with` on it, and the allowed argmax where that lands on a −∞ entry.
    /// `choose_masked` must give its token for every row, mask and sampling.
    fn choose_masked_reference(
        row: &[f32],
        mask: &TokenMask,
        s: &Sampling,
        id: u64,
        position: usize,
    ) -> u32 {
        let masked: Vec<f32> = row
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                if mask.allows(i as u32) {
                    x
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let t = sampling::choose_with(&masked, s, id, position, None);
        if mask.allows(t) && masked[t as usize] > f32::NEG_INFINITY {
            return t;
        }
        let mut best: Option<u32> = None;
        for (i, &x) in masked.iter().enumerate() {
            if !mask.allows(i as u32) {
                continue;
            }
            match best {
                None => best = Some(i as u32),
                Some(b) if x > masked[b as usize] || masked[b as usize].is_nan() && !x.is_nan() => {
                    best = Some(i as u32)
                }
                Some(_) => {}
            }
        }
        best.unwrap_or(t)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn the_allowed_ids_draw_what_the_masked_copy_draws(
            // Few distinct values (ties), ±∞, NaN, and logits whose scaled value
            // overflows f32 at a small temperature.
            picks in proptest::collection::vec(0usize..14, 1..400),
            // Or a row of only −∞, NaN and logits whose scaled value overflows to −∞: every
            // allowed key −∞, the masked copy's corner cases.
            bleak in proptest::bool::ANY,
            density in proptest::sample::select(vec![0u32, 1, 8, 128, 250, 256]),
            mask_seed in 0u64..u64::MAX,
            temperature in proptest::sample::select(vec![0.0f32, 1e-5, 0.3, 1.0, 2.5]),
            top_k in proptest::sample::select(vec![0usize, 1, 3, 50]),
            top_p in proptest::sample::select(vec![1.0f32, 0.9, 0.3]),
            seed in 0u64..1000,
            position in 0usize..5000,
        ) {
            const VALUES: [f32; 14] = [
                0.0, -0.0, 1.5, -1.5, 3.25, 7.0, -7.0, 2.0, f32::INFINITY,
                f32::NEG_INFINITY, f32::NAN, 3.0e38, -3.0e38, 1e-30,
            ];
            const BLEAK: [f32; 4] = [f32::NEG_INFINITY, f32::NAN, -3.0e38, -1.0e38];
            let row: Vec<f32> = picks
                .iter()
                .map(|&p| if bleak { BLEAK[p % 4] } else { VALUES[p] })
                .collect();
            // Each id allowed with probability density/256 (0: only ids the hash picks
            // rarely, often none), in whichever form is smaller.
            let ids: Vec<u32> = (0..row.len() as u32)
                .filter(|&i| {
                    let h = arbor_kernels::cpu::gumbel::splitmix64(mask_seed ^ u64::from(i));
                    ((h >> 56) as u32) < density || density == 0 && h.is_multiple_of(97)
                })
                .collect();
            let mask = TokenMask::from_ids(&ids, row.len());
            let s = Sampling { temperature, top_k, top_p, seed };
            let want = choose_masked_reference(&row, &mask, &s, 5, position);
            proptest::prop_assert_eq!(
                choose_masked(&row, &mask, &s, 5, position), want, "{:?} {:?}", s, mask
            );
            // A backend's masked draw, where it finds one, is that token.
            let drawn = masked_draw(&s, 5, position).and_then(|d| draw_masked(&row, &mask, d));
            if let Some(t) = drawn {
                proptest::prop_assert_eq!(t, want, "masked draw: {:?} {:?}", s, mask);
            }
            proptest::prop_assert_eq!(
                masked_draw(&s, 5, position).is_some(),
                s.is_greedy() || s.draws_on_device(),
                "{:?}", s
            );
        }
    }

    #[test]
    fn a_vocabulary_row_draws_what_the_masked_copy_draws() {
        let mut z = 11u64;
        let row: Vec<f32> = (0..128_256)
            .map(|_| {
                z = arbor_kernels::cpu::gumbel::splitmix64(z);
                // bf16-like coarse logits: ties.
                ((z >> 52) as f32 - 2048.0) / 256.0
            })
            .collect();
        let sparse = TokenMask::from_ids(&[3, 98, 99, 1000, 64_000, 128_255], row.len());
        let wide: Vec<u32> = (0..row.len() as u32).filter(|i| i % 3 != 0).collect();
        let wide = TokenMask::from_ids(&wide, row.len());
        assert!(matches!(sparse, TokenMask::Ids(_)) && matches!(wide, TokenMask::Bits(_)));
        let settings = [
            Sampling::greedy(),
            Sampling {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                seed: 3,
            },
            Sampling {
                temperature: 0.7,
                top_k: 40,
                top_p: 1.0,
                seed: 4,
            },
            Sampling {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
                seed: 5,
            },
        ];
        for mask in [&sparse, &wide] {
            for s in &settings {
                for pos in 0..20 {
                    assert_eq!(
                        choose_masked(&row, mask, s, 9, pos),
                        choose_masked_reference(&row, mask, s, 9, pos),
                        "{s:?} at {pos}"
                    );
                }
            }
        }
    }

    #[test]
    fn iterating_a_mask_gives_its_ids() {
        for ids in [
            vec![],
            vec![0u32],
            vec![31, 32, 33],
            vec![5, 63, 64, 95, 99],
        ] {
            for vocab in [100usize, 96] {
                let m = TokenMask::from_ids(&ids, vocab);
                let want: Vec<usize> = ids
                    .iter()
                    .map(|&i| i as usize)
                    .filter(|&i| i < vocab)
                    .collect();
                for n in [vocab, 64, 33] {
                    let below: Vec<usize> = want.iter().copied().filter(|&i| i < n).collect();
                    assert_eq!(
                        m.iter_below(n).collect::<Vec<_>>(),
                        below,
                        "{m:?} below {n}"
                    );
                    assert_eq!(m.count_below(n), below.len());
                }
            }
        }
        // The bit form past the word of the last id.
        let m = TokenMask::from_bits(vec![u32::MAX; 4], 100);
        assert_eq!(
            m.iter_below(100).collect::<Vec<_>>(),
            (0..100).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_smaller_form_and_membership() {
        let m = TokenMask::from_ids(&[5, 3, 99, 3], 90);
        assert_eq!(m, TokenMask::Ids(vec![3, 5]));
        assert!(m.allows(3) && m.allows(5) && !m.allows(4) && !m.allows(99));
        // As many ids as words: the words.
        assert!(matches!(
            TokenMask::from_ids(&[3, 5], 40),
            TokenMask::Bits(_)
        ));
        let all = TokenMask::from_bits(vec![u32::MAX; 2], 40);
        let TokenMask::Bits(words) = &all else {
            panic!("{all:?}")
        };
        // Bits past the vocabulary are dropped.
        assert_eq!(words, &vec![u32::MAX, 0xff]);
        assert_eq!(all.count(), 40);
        assert!(all.allows(39) && !all.allows(40));
        assert!(all.check(40).is_ok());
        assert!(all.check(96).unwrap_err().contains("2 words"));
        assert!(TokenMask::Ids(vec![4, 2]).check(8).is_err());
        assert!(TokenMask::Ids(vec![9])
            .check(8)
            .unwrap_err()
            .contains("id 9"));
        assert!(TokenMask::Ids(vec![])
            .check(8)
            .unwrap_err()
            .contains("no token"));
    }

    #[test]
    fn every_sampling_lands_on_an_allowed_token() {
        let r = row(300);
        let mask = TokenMask::from_ids(&[2, 40, 41, 250], 300);
        let settings = [
            Sampling::greedy(),
            Sampling {
                temperature: 0.8,
                top_k: 0,
                top_p: 1.0,
                seed: 3,
            },
            Sampling {
                temperature: 1.3,
                top_k: 2,
                top_p: 1.0,
                seed: 4,
            },
            Sampling {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                seed: 5,
            },
        ];
        for s in &settings {
            for pos in 0..200 {
                let t = choose_masked(&r, &mask, s, 11, pos);
                assert!(mask.allows(t), "{s:?} at {pos} chose {t}");
            }
        }
        // Unmasked, greedy takes 7; masked, the best allowed one.
        assert_eq!(
            sampling::choose_with(&r, &Sampling::greedy(), 0, 0, None),
            7
        );
        let want = [2u32, 40, 41, 250]
            .into_iter()
            .max_by(|&a, &b| r[a as usize].total_cmp(&r[b as usize]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(choose_masked(&r, &mask, &Sampling::greedy(), 0, 0), want);
    }

    #[test]
    fn a_mask_of_everything_draws_what_the_row_draws() {
        let r = row(300);
        let all = TokenMask::from_bits(vec![u32::MAX; 10], 300);
        let s = Sampling {
            temperature: 0.9,
            top_k: 0,
            top_p: 1.0,
            seed: 8,
        };
        for pos in 0..50 {
            assert_eq!(
                choose_masked(&r, &all, &s, 2, pos),
                sampling::choose_with(&r, &s, 2, pos, None)
            );
        }
    }

    /// A constraint of a fixed mask.
    struct Fixed(TokenMask);

    impl TokenConstraint for Fixed {
        fn allowed(&mut self, _: &[u32]) -> TokenMask {
            self.0.clone()
        }
    }

    #[test]
    fn min_tokens_bans_the_stop_ids_until_met_then_unmasks() {
        let vocab = 300;
        // Stops out of order, repeated and past the vocabulary.
        let c = MinTokens::wrap(2, &[7, 2, 7, 999], vocab, None).expect("a constraint");
        for generated in [&[][..], &[4]] {
            let m = c.mask(generated).expect("masked below min");
            assert_eq!(m.count(), vocab - 2, "{generated:?}");
            assert!(!m.allows(7) && !m.allows(2) && m.allows(3) && m.allows(299));
            assert!(m.check(vocab).is_ok());
        }
        // Met: no mask at all (the device's draw), whatever the tokens were.
        assert_eq!(c.mask(&[4, 5]), None);
        assert_eq!(c.mask(&[4, 5, 6]), None);
        // Asked for a mask anyway, it is everything.
        assert_eq!(c.allowed(&[4, 5]).count(), vocab);
        // Asked again from a shorter run (a restart): banned again.
        assert!(!c.mask(&[]).expect("masked").allows(7));
        // Nothing to do: no constraint, or the inner one as it is.
        assert!(MinTokens::wrap(0, &[7], vocab, None).is_none());
        assert!(MinTokens::wrap(3, &[], vocab, None).is_none());
        assert!(MinTokens::wrap(3, &[400], vocab, None).is_none());
        let inner = Constraint::new(Fixed(TokenMask::Ids(vec![1])));
        assert!(MinTokens::wrap(0, &[7], vocab, Some(inner.clone())) == Some(inner));
    }

    #[test]
    fn min_tokens_composes_with_a_structured_constraint() {
        // Large enough that three ids are the smaller form.
        let vocab = 640;
        let inner = Constraint::new(Fixed(TokenMask::from_ids(&[2, 5, 9], vocab)));
        let c = MinTokens::wrap(1, &[5, 40], vocab, Some(inner)).expect("a constraint");
        assert_eq!(c.mask(&[]), Some(TokenMask::Ids(vec![2, 9])));
        // Met: the structured constraint alone.
        assert_eq!(c.mask(&[2]), Some(TokenMask::Ids(vec![2, 5, 9])));
        // A grammar that can only end: it wins over the ban (the choice ends short).
        let only_end = Constraint::new(Fixed(TokenMask::Ids(vec![5])));
        let c = MinTokens::wrap(4, &[5], vocab, Some(only_end)).expect("a constraint");
        assert_eq!(c.mask(&[1]), Some(TokenMask::Ids(vec![5])));
        // A bit-form inner mask loses the banned bits and nothing else.
        let wide = Constraint::new(Fixed(TokenMask::all(vocab)));
        let c = MinTokens::wrap(1, &[0, 63], vocab, Some(wide)).expect("a constraint");
        let m = c.mask(&[]).expect("masked");
        assert_eq!(m.count(), vocab - 2);
        assert!(!m.allows(0) && !m.allows(63) && m.allows(1) && m.allows(62));
    }

    #[test]
    fn a_banned_stop_draws_the_best_other_token_and_an_unbanned_draw_is_unchanged() {
        let r = row(300);
        let c = MinTokens::wrap(1, &[7], 300, None).expect("a constraint");
        let ban = c.mask(&[]).expect("masked");
        // Greedy: 7 is the argmax; banned, the next best.
        let want = (0..300u32)
            .filter(|&t| t != 7)
            .max_by(|&a, &b| r[a as usize].total_cmp(&r[b as usize]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(choose_masked(&r, &ban, &Sampling::greedy(), 0, 0), want);
        // A pure temperature: where the unmasked draw is not 7, the ban changes nothing
        // (the Gumbel-max winner among the rest is the same token); where it is, another.
        let s = Sampling {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            seed: 9,
        };
        let mut moved = 0;
        for pos in 0..200 {
            let free = sampling::choose_with(&r, &s, 3, pos, None);
            let banned = choose_masked(&r, &ban, &s, 3, pos);
            assert_ne!(banned, 7);
            if free == 7 {
                moved += 1;
            } else {
                assert_eq!(banned, free, "at {pos}");
            }
        }
        assert!(moved > 0, "the row never drew its argmax");
    }

    #[test]
    fn non_finite_allowed_logits_still_give_an_allowed_token() {
        let mut r = row(64);
        r[10] = f32::NAN;
        r[20] = f32::NEG_INFINITY;
        let mask = TokenMask::from_ids(&[10, 20], 64);
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        };
        assert!(mask.allows(choose_masked(&r, &mask, &s, 0, 0)));
        assert!(mask.allows(choose_masked(&r, &mask, &Sampling::greedy(), 0, 0)));
    }
}
