//! Token choice on the full f32 logits row, identical on every rank (all ranks hold the
//! same logits) and independent of batch composition: the only randomness is a
//! counter-based draw keyed by (seed, request id, position).

use crate::error::{MResult, ModelError};

/// How the next token is chosen. `temperature == 0` is greedy.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    pub seed: u64,
}

impl Sampling {
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// A pure temperature (no top-k, no top-p cut): drawn by Gumbel max where the logits
    /// are ([`gumbel_draw`]); other non-greedy settings sort on the host ([`choose`]).
    pub fn draws_on_device(&self) -> bool {
        self.temperature != 0.0 && self.top_k == 0 && self.top_p >= 1.0
    }

    pub fn validate(&self) -> MResult<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::BadSampling(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::BadSampling(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

/// A token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

use arbor_kernels::cpu::gumbel::splitmix64;
pub use arbor_kernels::cpu::{gumbel_argmax, GumbelDraw};

/// The 64-bit key of (seed, request id, position): a pure function of the triple, so it
/// does not depend on the batch slot or how many steps ran before.
pub fn draw_key(seed: u64, id: u64, position: u64) -> u64 {
    splitmix64(splitmix64(splitmix64(seed) ^ id) ^ position)
}

/// The uniform draw in [0, 1) for (seed, request id, position).
pub fn uniform(seed: u64, id: u64, position: u64) -> f64 {
    (draw_key(seed, id, position) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The Gumbel-max draw of a pure temperature sampling (no top-k, no top-p cut), which a
/// backend runs where the logits are; None for greedy rows and for top-k / top-p, whose
/// sort stays on the host ([`choose`]).
pub fn gumbel_draw(s: &Sampling, id: u64, position: usize) -> Option<GumbelDraw> {
    s.draws_on_device().then(|| GumbelDraw {
        inv_t: 1.0 / s.temperature,
        key: draw_key(s.seed, id, position as u64),
    })
}

pub use arbor_kernels::cpu::digest::{digest, DIGEST_CHUNK};

pub use arbor_kernels::cpu::RowStats;

/// The host's cores, read once (std reads cgroup files on every call, and the records of
/// every step ask).
pub fn host_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Below this many logits a step's rows are handled on the calling thread.
const PARALLEL_MIN_VALUES: usize = 1 << 18;

/// `f(r, threads)` for every row `r < rows`, in row order. Rows are spread over the host's
/// cores when they hold at least `PARALLEL_MIN_VALUES` values in all (`values`);
/// `threads` is how many a row may use itself (all of them for one row, a share when rows
/// are fewer than cores). Each row is computed as alone, so the split changes no bits.
pub fn map_rows<T: Send>(
    rows: usize,
    values: usize,
    f: impl Fn(usize, usize) -> T + Sync,
) -> Vec<T> {
    let cores = host_cores();
    if rows <= 1 || cores <= 1 || values < PARALLEL_MIN_VALUES {
        return (0..rows).map(|r| f(r, cores)).collect();
    }
    let per_row = (cores / rows).max(1);
    let per = rows.div_ceil(cores.min(rows));
    let mut out = Vec::with_capacity(rows);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..rows)
            .step_by(per)
            .map(|r0| {
                let f = &f;
                scope.spawn(move || {
                    (r0..(r0 + per).min(rows))
                        .map(|r| f(r, per_row))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(v) => out.extend(v),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    out
}

/// [`RowStats`] of `rows` rows of `vocab` values (row stride `cols`), on the host: the
/// sequential log-sum-exp, so the CPU backend's log-probs keep their bits. `pick[r]` is
/// the index whose value is returned in `picked` (`u32::MAX`: none).
/// `draws[r]`: the Gumbel-max draw to make on row r.
pub fn host_row_stats(
    logits: &[f32],
    cols: usize,
    vocab: usize,
    pick: &[u32],
    draws: &[Option<GumbelDraw>],
) -> Vec<RowStats> {
    map_rows(pick.len(), pick.len() * vocab, |r, threads| {
        let row = &logits[r * cols..r * cols + vocab];
        let (lse, digest) = lse_and_digest(row, threads);
        let a = argmax(row);
        let sampled = draws
            .get(r)
            .copied()
            .flatten()
            .map_or(u32::MAX, |d| gumbel_argmax(row, d) as u32);
        RowStats {
            argmax: a as u32,
            max: row.get(a).copied().unwrap_or(f32::NAN),
            lse,
            picked: row.get(pick[r] as usize).copied().unwrap_or(f32::NAN),
            digest,
            sampled,
            sampled_value: row.get(sampled as usize).copied().unwrap_or(f32::NAN),
        }
    })
}

/// Index of the largest value, lowest index on ties; NaN never wins (index 0 if all NaN):
/// the kernels' host definition, which the GPU's row statistics are tested against.
pub use arbor_kernels::cpu::argmax;

/// log(sum(exp(row))) in f32, fixed order: max first, then the sum of exp(x - max) in index order.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY || m.is_nan() {
        return m;
    }
    let mut s = 0.0f32;
    for &x in row {
        s += (x - m).exp();
    }
    m + s.ln()
}

/// [`log_sum_exp`] and [`digest`] of one row on up to `threads` threads, with their bits:
/// the exponentials are computed in parallel and summed in index order, and the digest
/// runs alongside. For the rows of small batches, where the host's other cores are idle.
pub fn lse_and_digest(row: &[f32], threads: usize) -> (f32, u64) {
    const MIN_PER_THREAD: usize = 8192;
    let threads = threads.min(row.len() / MIN_PER_THREAD);
    if threads < 2 {
        return (log_sum_exp(row), digest(row));
    }
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY || m.is_nan() {
        return (m, digest(row));
    }
    let mut e = vec![0.0f32; row.len()];
    let chunk = row.len().div_ceil(threads - 1);
    let h = std::thread::scope(|scope| {
        let h = scope.spawn(|| digest(row));
        for (src, dst) in row.chunks(chunk).zip(e.chunks_mut(chunk)) {
            scope.spawn(move || {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = (x - m).exp();
                }
            });
        }
        h.join()
    });
    let h = match h {
        Ok(h) => h,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    let mut sum = 0.0f32;
    for &x in &e {
        sum += x;
    }
    (m + sum.ln(), h)
}

/// log_softmax(row)[idx] given `lse = log_sum_exp(row)`.
pub fn logprob(row: &[f32], lse: f32, idx: usize) -> f32 {
    row[idx] - lse
}

/// The `n` most likely tokens, most likely first, lowest id first on ties.
pub fn top_n(row: &[f32], lse: f32, n: usize) -> Vec<TokenLogprob> {
    if n == 0 {
        return Vec::new();
    }
    let order = sorted_desc(row, n);
    order
        .into_iter()
        .map(|i| TokenLogprob {
            token: i as u32,
            logprob: row[i] - lse,
        })
        .collect()
}

/// Indices of the `limit` largest values (NaN excluded), descending by `f32::total_cmp`,
/// lowest index on ties.
///
/// Each value becomes one u64 whose order is that order (the value's total-order key
/// above the complemented index), so the selection compares integers, not values behind
/// indices. A small `limit` (top-k) keeps a buffer of at most 2·limit candidates and drops
/// everything below the current k-th best with one comparison: one pass over the row
/// instead of a selection over all of it (sampled decode with top-k 50 spent 4.5 ms of
/// host time per batch-64 step here, docs/engine.md).
fn sorted_desc(row: &[f32], limit: usize) -> Vec<usize> {
    let limit = limit.min(row.len());
    if limit == 0 {
        return Vec::new();
    }
    let keys = row
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| order_key(v, i));
    let mut top: Vec<u64> = if limit.saturating_mul(8) < row.len() {
        let mut buf = Vec::with_capacity(2 * limit);
        // Every key ≤ `floor` has `limit` better keys already: it cannot make the cut.
        let mut floor = 0u64;
        for k in keys {
            if k <= floor {
                continue;
            }
            buf.push(k);
            if buf.len() == 2 * limit {
                buf.select_nth_unstable_by(limit - 1, |a, b| b.cmp(a));
                buf.truncate(limit);
                floor = buf.iter().copied().min().unwrap_or(0);
            }
        }
        buf
    } else {
        keys.collect()
    };
    if limit < top.len() {
        top.select_nth_unstable_by(limit - 1, |a, b| b.cmp(a));
        top.truncate(limit);
    }
    top.sort_unstable_by(|a, b| b.cmp(a));
    top.into_iter()
        .map(|k| (!k & 0xffff_ffff) as usize)
        .collect()
}

/// A u64 that orders (value by `f32::total_cmp`, then lower index first) as integers do:
/// the value's bits mapped to an order-preserving u32 (negatives flipped, positives above
/// them), then the complemented index, so that of equal values the lower index is larger.
/// Never 0 for a non-NaN value, which `sorted_desc`'s initial floor relies on.
fn order_key(v: f32, i: usize) -> u64 {
    debug_assert!(i <= u32::MAX as usize, "row index {i} past u32");
    let b = v.to_bits();
    let key = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    ((key as u64) << 32) | u64::from(!(i as u32))
}

/// Chooses the token at `position` of request `id` from its full logits row.
pub fn choose(row: &[f32], s: &Sampling, id: u64, position: usize) -> u32 {
    if s.temperature == 0.0 || row.len() <= 1 {
        return argmax(row) as u32;
    }
    if let Some(d) = gumbel_draw(s, id, position) {
        return gumbel_argmax(row, d) as u32;
    }
    let limit = if s.top_k == 0 {
        row.len()
    } else {
        s.top_k.min(row.len())
    };
    draw_from(row, &sorted_desc(row, limit), s, id, position)
}

/// The token drawn from `cand` (the row's candidates, most likely first, lowest index on
/// ties: `choose`'s selection) with `s`'s temperature and top-p cut, by the request's
/// uniform at `position`. Public so the selection's benchmark can feed it another
/// selection's candidates.
pub fn draw_from(row: &[f32], cand: &[usize], s: &Sampling, id: u64, position: usize) -> u32 {
    match draw_index(cand.len(), |j| row[cand[j]], s, id, position) {
        Some(j) => cand[j] as u32,
        None => 0,
    }
}

/// Most candidates a backend selects where the logits are (the GPU kernel's limit); a
/// larger top-k takes the row to the host.
pub const CANDIDATES_MAX: usize = 1024;

/// How many candidates a sampled token needs from the backend instead of its whole row:
/// `top_k` for a top-k draw (with or without top-p) of at most [`CANDIDATES_MAX`], else 0
/// (greedy, the device's pure-temperature draw, or a selection over the whole row).
pub fn candidates_needed(s: &Sampling) -> usize {
    if s.temperature == 0.0 || s.draws_on_device() || s.top_k > CANDIDATES_MAX {
        0
    } else {
        s.top_k
    }
}

/// The `k` largest values of `row` as (index, value), in `choose`'s candidate order: the
/// host definition of `Backend::top_k`.
pub fn top_k_candidates(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    sorted_desc(row, k.min(row.len()))
        .into_iter()
        .map(|i| (i as u32, row[i]))
        .collect()
}

/// [`top_n`] from the row's candidates (as [`top_k_candidates`] returns them, at least `n`
/// of them or every non-NaN value): the same tokens and log-probabilities, since the
/// first `n` of the `k` most likely are the `n` most likely.
pub fn top_n_of_candidates(cand: &[(u32, f32)], lse: f32, n: usize) -> Vec<TokenLogprob> {
    cand.iter()
        .take(n)
        .map(|&(token, v)| TokenLogprob {
            token,
            logprob: v - lse,
        })
        .collect()
}

/// `choose` for a top-k sampling given the row's `s.top_k` candidates (as
/// [`top_k_candidates`] returns them) instead of the row: the same token and value.
/// `None` when there are none (every value NaN); the caller then takes the argmax, as
/// `choose` does.
pub fn choose_from_candidates(
    cand: &[(u32, f32)],
    s: &Sampling,
    id: u64,
    position: usize,
) -> Option<(u32, f32)> {
    draw_index(cand.len(), |j| cand[j].1, s, id, position).map(|j| cand[j])
}

/// `draw_from`'s arithmetic over `n` candidates whose values `value(j)` gives, most likely
/// first: the position of the drawn one, or `None` for no candidates.
fn draw_index(
    n: usize,
    value: impl Fn(usize) -> f32,
    s: &Sampling,
    id: u64,
    position: usize,
) -> Option<usize> {
    if n == 0 {
        return None;
    }
    // Probabilities of the candidates (scaled logits, relative to the max), in
    // descending order: a fixed order, so the sums below are reproducible.
    let inv_t = 1.0f32 / s.temperature;
    let m = value(0) * inv_t;
    let w: Vec<f32> = (0..n).map(|j| (value(j) * inv_t - m).exp()).collect();
    let total: f32 = w.iter().sum();
    let mut keep = w.len();
    if s.top_p < 1.0 {
        let target = s.top_p * total;
        let mut acc = 0.0f32;
        for (j, &x) in w.iter().enumerate() {
            acc += x;
            if acc >= target {
                keep = j + 1;
                break;
            }
        }
    }
    let kept_total: f32 = w[..keep].iter().sum();
    let u = uniform(s.seed, id, position as u64) as f32 * kept_total;
    let mut acc = 0.0f32;
    for (j, &x) in w[..keep].iter().enumerate() {
        acc += x;
        if u < acc {
            return Some(j);
        }
    }
    Some(keep - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition `sorted_desc` must keep: all indices sorted by value (total order,
    /// descending), lowest index on ties, NaN left out, the first `limit`.
    fn sorted_desc_reference(row: &[f32], limit: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..row.len()).filter(|&i| !row[i].is_nan()).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        idx.truncate(limit);
        idx
    }

    proptest::proptest! {
        #[test]
        fn candidate_selection_is_the_sorted_order(
            // Few distinct values (ties), signed zeros, infinities and NaN among them.
            picks in proptest::collection::vec(0usize..12, 0..400),
            limit in 0usize..60,
        ) {
            const VALUES: [f32; 12] = [
                0.0, -0.0, 1.5, -1.5, 3.25, f32::INFINITY, f32::NEG_INFINITY, f32::NAN,
                7.0, -7.0, 1e-30, -1e-30,
            ];
            let row: Vec<f32> = picks.iter().map(|&p| VALUES[p]).collect();
            proptest::prop_assert_eq!(sorted_desc(&row, limit), sorted_desc_reference(&row, limit));
            proptest::prop_assert_eq!(
                sorted_desc(&row, row.len()),
                sorted_desc_reference(&row, row.len())
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn top_n_of_the_candidates_is_top_n_of_the_row(
            picks in proptest::collection::vec(0usize..9, 0..300),
            n in 0usize..40,
            extra in 0usize..20,
        ) {
            const VALUES: [f32; 9] = [0.0, -0.0, 1.5, -1.5, 3.25, 7.0, f32::NEG_INFINITY, f32::NAN, 2.0];
            let row: Vec<f32> = picks.iter().map(|&p| VALUES[p]).collect();
            let lse = log_sum_exp(&row);
            // The backend selects max(top-k, n) candidates: more than n must not matter.
            let cand = top_k_candidates(&row, n + extra);
            let got = top_n_of_candidates(&cand, lse, n);
            let want = top_n(&row, lse, n);
            proptest::prop_assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                proptest::prop_assert_eq!(g.token, w.token);
                proptest::prop_assert_eq!(g.logprob.to_bits(), w.logprob.to_bits());
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn drawing_from_the_top_k_candidates_is_choose(
            picks in proptest::collection::vec(0usize..9, 2..300),
            top_k in 1usize..40,
            top_p in proptest::sample::select(vec![1.0f32, 0.9, 0.5, 0.05]),
            temperature in proptest::sample::select(vec![0.3f32, 1.0, 2.5]),
            seed in 0u64..1000,
            position in 0usize..5000,
        ) {
            const VALUES: [f32; 9] = [0.0, -0.0, 1.5, -1.5, 3.25, 7.0, -7.0, f32::NAN, 2.0];
            let row: Vec<f32> = picks.iter().map(|&p| VALUES[p]).collect();
            let s = Sampling { temperature, top_k, top_p, seed };
            proptest::prop_assert_eq!(candidates_needed(&s), top_k);
            let want = choose(&row, &s, 17, position);
            let got = choose_from_candidates(&top_k_candidates(&row, top_k), &s, 17, position)
                .map_or(argmax(&row) as u32, |(t, v)| {
                    assert_eq!(v.to_bits(), row[t as usize].to_bits());
                    t
                });
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn candidates_are_needed_only_for_a_bounded_top_k() {
        let s = |temperature, top_k, top_p| Sampling {
            temperature,
            top_k,
            top_p,
            seed: 1,
        };
        assert_eq!(candidates_needed(&s(0.0, 50, 1.0)), 0, "greedy");
        assert_eq!(candidates_needed(&s(1.0, 0, 1.0)), 0, "drawn on the device");
        assert_eq!(
            candidates_needed(&s(1.0, 0, 0.9)),
            0,
            "top-p over the whole row"
        );
        assert_eq!(candidates_needed(&s(1.0, 50, 0.9)), 50);
        assert_eq!(
            candidates_needed(&s(1.0, CANDIDATES_MAX, 1.0)),
            CANDIDATES_MAX
        );
        assert_eq!(candidates_needed(&s(1.0, CANDIDATES_MAX + 1, 1.0)), 0);
    }

    #[test]
    fn candidate_selection_on_a_vocabulary_row() {
        let mut s = 7u64;
        let row: Vec<f32> = (0..50_000)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // 2^12 distinct values: many ties, as bf16-rounded logits have.
                ((s >> 52) as f32 - 2048.0) / 64.0
            })
            .collect();
        for limit in [1, 2, 50, 1000, 6249, 6250, 49_999, 50_000, 60_000] {
            assert_eq!(
                sorted_desc(&row, limit),
                sorted_desc_reference(&row, limit),
                "limit {limit}"
            );
        }
    }

    #[test]
    fn argmax_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn logprobs_are_normalised() {
        let row = [0.5f32, -1.0, 2.0, 0.0];
        let lse = log_sum_exp(&row);
        let total: f64 = (0..4).map(|i| (logprob(&row, lse, i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let t = top_n(&row, lse, 2);
        assert_eq!(t.iter().map(|x| x.token).collect::<Vec<_>>(), vec![2, 0]);
    }

    #[test]
    fn draws_depend_on_the_key_only() {
        let a = uniform(7, 3, 10);
        assert_eq!(a.to_bits(), uniform(7, 3, 10).to_bits());
        assert_ne!(a.to_bits(), uniform(7, 3, 11).to_bits());
        assert_ne!(a.to_bits(), uniform(7, 4, 10).to_bits());
        assert_ne!(a.to_bits(), uniform(8, 3, 10).to_bits());
        assert!((0.0..1.0).contains(&a));
    }

    #[test]
    fn sampling_respects_top_k_and_follows_probabilities() {
        let row = [0.0f32, 1.0, 2.0, 3.0, -5.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 1,
        };
        let mut counts = [0usize; 5];
        for pos in 0..2000 {
            counts[choose(&row, &s, 0, pos) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[1] + counts[4], 0, "{counts:?}");
        // p(3) = e/(1+e) ≈ 0.73
        assert!((1300..1620).contains(&counts[3]), "{counts:?}");
        // top_p small enough keeps only the argmax.
        let s = Sampling {
            top_k: 0,
            top_p: 0.1,
            ..s
        };
        assert!((0..200).all(|p| choose(&row, &s, 5, p) == 3));
        // Greedy.
        assert_eq!(choose(&row, &Sampling::greedy(), 0, 0), 3);
    }

    #[test]
    fn pure_temperature_draws_by_gumbel_max_and_cuts_sort() {
        let row = [0.0f32, 1.0, 2.0, 3.0, -5.0];
        let t = Sampling {
            temperature: 0.9,
            top_k: 0,
            top_p: 1.0,
            seed: 4,
        };
        for pos in 0..50 {
            let d = gumbel_draw(&t, 6, pos).expect("pure temperature draws");
            assert_eq!(d.key, draw_key(4, 6, pos as u64));
            assert_eq!(choose(&row, &t, 6, pos), gumbel_argmax(&row, d) as u32);
        }
        assert_eq!(gumbel_draw(&Sampling::greedy(), 6, 0), None);
        assert_eq!(gumbel_draw(&Sampling { top_k: 2, ..t }, 6, 0), None);
        assert_eq!(gumbel_draw(&Sampling { top_p: 0.9, ..t }, 6, 0), None);
    }

    #[test]
    fn parallel_lse_and_digest_have_the_sequential_bits() {
        let row: Vec<f32> = (0..100_003)
            .map(|i| ((i as f32) * 0.37).sin() * 9.0 + (i % 7) as f32)
            .collect();
        let want = (log_sum_exp(&row).to_bits(), digest(&row));
        for threads in [1, 2, 3, 8, 16] {
            let (lse, h) = lse_and_digest(&row, threads);
            assert_eq!((lse.to_bits(), h), want, "{threads} threads");
        }
        let inf = vec![f32::NEG_INFINITY; 40_000];
        assert_eq!(lse_and_digest(&inf, 4).0, f32::NEG_INFINITY);
    }

    #[test]
    fn host_row_stats_match_the_row_functions() {
        let (rows, vocab, cols) = (5usize, 70_000usize, 70_003usize);
        let logits: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32) * 0.013).sin() * 7.0)
            .collect();
        let pick = [0u32, 69_999, 5, u32::MAX, 123];
        let d = |t: f32, key: u64| {
            Some(GumbelDraw {
                inv_t: 1.0 / t,
                key,
            })
        };
        let draws = [None, d(0.7, 1), None, d(1.0, 2), d(1.3, 3)];
        let stats = host_row_stats(&logits, cols, vocab, &pick, &draws);
        for (r, s) in stats.iter().enumerate() {
            match draws[r] {
                None => assert!(s.sampled == u32::MAX && s.sampled_value.is_nan()),
                Some(d) => {
                    let t = gumbel_argmax(&logits[r * cols..r * cols + vocab], d);
                    assert_eq!(s.sampled as usize, t);
                    assert_eq!(s.sampled_value.to_bits(), logits[r * cols + t].to_bits());
                }
            }
            let row = &logits[r * cols..r * cols + vocab];
            assert_eq!(s.argmax as usize, argmax(row));
            assert_eq!(s.max.to_bits(), row[argmax(row)].to_bits());
            assert_eq!(s.lse.to_bits(), log_sum_exp(row).to_bits());
            assert_eq!(s.digest, digest(row));
            match pick[r] {
                u32::MAX => assert!(s.picked.is_nan()),
                p => assert_eq!(s.picked.to_bits(), row[p as usize].to_bits()),
            }
        }
    }
}
