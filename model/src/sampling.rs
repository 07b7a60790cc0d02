//! Token choice on the full f32 logits row, identical on every rank (all ranks hold the
//! same logits) and independent of batch composition: the only randomness is a
//! counter-based draw keyed by (seed, request id, position).

use crate::error::{MResult, ModelError};

/// Temperatures below this are greedy (vLLM's and SGLang's bound too). Every draw scales
/// the logits by 1/T, which overflows f32 below ~3e-39 and pushes the scaled logits past
/// f32 long before: such draws picked unlikely tokens. Below 1e-5 a draw is the argmax
/// for any realistic logits anyway. [`Sampling::is_greedy`] is the one place this is
/// decided, for the host's draws and the backends' step inputs alike.
pub const GREEDY_BELOW: f32 = 1e-5;

/// How the next token is chosen. A `temperature` below [`GREEDY_BELOW`] (0 included) is
/// greedy.
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

    /// Greedy (argmax, lowest token id on ties): a temperature below [`GREEDY_BELOW`];
    /// top-k, top-p and seed then do not matter.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// A pure temperature (no top-k, no top-p cut): drawn by Gumbel max where the logits
    /// are ([`gumbel_draw`]); other non-greedy settings sort on the host ([`choose`]).
    pub fn draws_on_device(&self) -> bool {
        !self.is_greedy() && self.top_k == 0 && self.top_p >= 1.0
    }

    /// A top-p cut over the whole vocabulary (no top-k): its cut compares with the row's
    /// tempered sum, which the backend computes where the logits are ([`row_draw`]).
    pub fn is_nucleus(&self) -> bool {
        !self.is_greedy() && self.top_k == 0 && self.top_p < 1.0
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

pub use arbor_kernels::cpu::gumbel::gumbel_key;
use arbor_kernels::cpu::gumbel::splitmix64;
pub use arbor_kernels::cpu::{gumbel_argmax, tempered_sum, GumbelDraw, MaskedDraw, RowDraw};

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

/// What the backend computes for a sampled row where the logits are: the Gumbel-max draw
/// of a pure temperature, the tempered sum of a top-p draw over the whole vocabulary, or
/// nothing (greedy; top-k draws from candidates alone).
pub fn row_draw(s: &Sampling, id: u64, position: usize) -> RowDraw {
    match gumbel_draw(s, id, position) {
        Some(g) => RowDraw::Gumbel(g),
        None if s.is_nucleus() => RowDraw::Nucleus {
            inv_t: 1.0 / s.temperature,
        },
        None => RowDraw::None,
    }
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
/// `draws[r]`: the Gumbel-max draw to make on row r, or the tempered sum to compute.
pub fn host_row_stats(
    logits: &[f32],
    cols: usize,
    vocab: usize,
    pick: &[u32],
    draws: &[RowDraw],
) -> Vec<RowStats> {
    map_rows(pick.len(), pick.len() * vocab, |r, threads| {
        let row = &logits[r * cols..r * cols + vocab];
        let (lse, digest) = lse_and_digest(row, threads);
        let a = argmax(row);
        let draw = draws.get(r).copied().unwrap_or_default();
        let sampled = match draw {
            RowDraw::Gumbel(d) => gumbel_argmax(row, d) as u32,
            _ => u32::MAX,
        };
        let tempered = match draw {
            RowDraw::Nucleus { inv_t } => tempered_sum(row, inv_t),
            _ => f32::NAN,
        };
        RowStats {
            argmax: a as u32,
            max: row.get(a).copied().unwrap_or(f32::NAN),
            lse,
            picked: row.get(pick[r] as usize).copied().unwrap_or(f32::NAN),
            digest,
            sampled,
            sampled_value: row.get(sampled as usize).copied().unwrap_or(f32::NAN),
            tempered_sum: tempered,
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
/// host time per batch-64 step here, docs/step.md).
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

/// Chooses the token at `position` of request `id` from its full logits row, a top-p cut
/// over the whole vocabulary comparing with the host's [`tempered_sum`].
pub fn choose(row: &[f32], s: &Sampling, id: u64, position: usize) -> u32 {
    choose_with(row, s, id, position, None)
}

/// [`choose`] with the row's tempered sum as the backend computed it where the logits are
/// (`RowStats::tempered_sum`; `None`: the host's [`tempered_sum`]), which a top-p cut over
/// the whole vocabulary compares with.
pub fn choose_with(
    row: &[f32],
    s: &Sampling,
    id: u64,
    position: usize,
    tempered: Option<f32>,
) -> u32 {
    if s.is_greedy() || row.len() <= 1 {
        return argmax(row) as u32;
    }
    if let Some(d) = gumbel_draw(s, id, position) {
        return gumbel_argmax(row, d) as u32;
    }
    if s.is_nucleus() {
        // The nucleus is usually a small head of the row: sort a growing head (each try
        // a selection over the row, then a sort of the head) until it holds the cut. A
        // head that holds the cut draws what the whole sorted row draws.
        let total = Some(tempered.unwrap_or_else(|| tempered_sum(row, 1.0 / s.temperature)));
        let mut k = 4 * CANDIDATES_MAX;
        loop {
            let head = k.min(row.len());
            let cand = sorted_desc(row, head);
            let complete = cand.len() < head || head == row.len();
            match draw_index(
                cand.len(),
                |j| row[cand[j]],
                s,
                id,
                position,
                total,
                complete,
            ) {
                Drawn::Index(j) => return cand[j] as u32,
                Drawn::Empty => return 0,
                Drawn::Beyond => k *= 4,
            }
        }
    }
    let limit = if s.top_k == 0 {
        row.len()
    } else {
        s.top_k.min(row.len())
    };
    let cand = sorted_desc(row, limit);
    match draw_index(cand.len(), |j| row[cand[j]], s, id, position, None, true) {
        Drawn::Index(j) => cand[j] as u32,
        Drawn::Empty | Drawn::Beyond => 0,
    }
}

/// The token drawn from `cand` (the row's candidates, most likely first, lowest index on
/// ties: `choose`'s selection) with `s`'s temperature and top-p cut, by the request's
/// uniform at `position`. Public so the selection's benchmark can feed it another
/// selection's candidates.
pub fn draw_from(row: &[f32], cand: &[usize], s: &Sampling, id: u64, position: usize) -> u32 {
    let total = s
        .is_nucleus()
        .then(|| tempered_sum(row, 1.0 / s.temperature));
    match draw_index(cand.len(), |j| row[cand[j]], s, id, position, total, true) {
        Drawn::Index(j) => cand[j] as u32,
        Drawn::Empty | Drawn::Beyond => 0,
    }
}

/// Most candidates a backend selects where the logits are (the GPU kernel's limit); a
/// larger top-k takes the row to the host.
pub const CANDIDATES_MAX: usize = 1024;

/// How many candidates a sampled token needs from the backend instead of its whole row:
/// `top_k` for a top-k draw (with or without top-p) of at most [`CANDIDATES_MAX`],
/// [`CANDIDATES_MAX`] for a top-p draw over the whole vocabulary (its nucleus is usually
/// far smaller; when it is not, the row comes to the host after all), else 0 (greedy, the
/// device's pure-temperature draw, or a top-k beyond the limit).
pub fn candidates_needed(s: &Sampling) -> usize {
    if s.is_nucleus() {
        CANDIDATES_MAX
    } else if s.is_greedy() || s.draws_on_device() || s.top_k > CANDIDATES_MAX {
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

/// A draw from candidates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// The token and its value: those `choose_with` gives on the whole row.
    Token(u32, f32),
    /// No candidates (every value NaN): the caller takes the argmax, as `choose` does.
    Empty,
    /// A top-p cut over the whole vocabulary that the candidates do not reach: the draw
    /// needs the row.
    NeedsRow,
}

/// `choose_with` given the row's candidates (as [`top_k_candidates`] returns them: the
/// `candidates_needed(s)` most likely, or every non-NaN value when `complete`) instead of
/// the row. `tempered`: `RowStats::tempered_sum`, for a top-p cut over the whole vocabulary.
pub fn choose_from_candidates(
    cand: &[(u32, f32)],
    s: &Sampling,
    id: u64,
    position: usize,
    tempered: f32,
    complete: bool,
) -> Choice {
    let total = s.is_nucleus().then_some(tempered);
    match draw_index(cand.len(), |j| cand[j].1, s, id, position, total, complete) {
        Drawn::Index(j) => Choice::Token(cand[j].0, cand[j].1),
        Drawn::Empty => Choice::Empty,
        Drawn::Beyond => Choice::NeedsRow,
    }
}

enum Drawn {
    Index(usize),
    Empty,
    /// The top-p cut lies beyond the candidates given (not all of the row's).
    Beyond,
}

/// The arithmetic of every host draw over `n` candidates whose values `value(j)` gives,
/// most likely first: probabilities relative to the max, a top-p cut where the running
/// sum reaches `top_p` of `total` (the candidates' own sum unless given: a top-p cut over
/// the whole vocabulary compares with the row's tempered sum), then the request's uniform
/// over the kept ones. `complete`: the candidates are every non-NaN value of the row.
fn draw_index(
    n: usize,
    value: impl Fn(usize) -> f32,
    s: &Sampling,
    id: u64,
    position: usize,
    total: Option<f32>,
    complete: bool,
) -> Drawn {
    if n == 0 {
        return Drawn::Empty;
    }
    if s.is_greedy() {
        // The first candidate is the argmax (lowest index on ties).
        return Drawn::Index(0);
    }
    // Probabilities of the candidates (scaled logits, relative to the max), in
    // descending order: a fixed order, so the sums below are reproducible.
    let inv_t = 1.0f32 / s.temperature;
    let m = value(0) * inv_t;
    let w: Vec<f32> = (0..n).map(|j| (value(j) * inv_t - m).exp()).collect();
    let total = total.unwrap_or_else(|| w.iter().sum());
    let mut keep = w.len();
    if s.top_p < 1.0 {
        let target = s.top_p * total;
        let mut acc = 0.0f32;
        let mut reached = false;
        for (j, &x) in w.iter().enumerate() {
            acc += x;
            if acc >= target {
                keep = j + 1;
                reached = true;
                break;
            }
        }
        if !reached && !complete {
            return Drawn::Beyond;
        }
    }
    let kept_total: f32 = w[..keep].iter().sum();
    let u = uniform(s.seed, id, position as u64) as f32 * kept_total;
    let mut acc = 0.0f32;
    for (j, &x) in w[..keep].iter().enumerate() {
        acc += x;
        if u < acc {
            return Drawn::Index(j);
        }
    }
    Drawn::Index(keep - 1)
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
            let cand = top_k_candidates(&row, top_k);
            let got = match choose_from_candidates(&cand, &s, 17, position, f32::NAN, false) {
                Choice::Token(t, v) => {
                    assert_eq!(v.to_bits(), row[t as usize].to_bits());
                    t
                }
                Choice::Empty => argmax(&row) as u32,
                Choice::NeedsRow => panic!("a top-k draw never needs the row"),
            };
            proptest::prop_assert_eq!(got, want);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// A top-p draw over the whole vocabulary from a growing sorted head of the row is
        /// the draw from the whole sorted row, whatever the nucleus's size.
        #[test]
        fn a_nucleus_drawn_from_a_sorted_head_is_the_whole_rows(
            len in 4000usize..20_000,
            spread in proptest::sample::select(vec![0.01f32, 1.0, 8.0]),
            top_p in proptest::sample::select(vec![0.3f32, 0.9, 0.99]),
            temperature in proptest::sample::select(vec![0.5f32, 2.0]),
            seed in 0u64..1000,
        ) {
            let mut z = seed | 1;
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    z ^= z << 13;
                    z ^= z >> 7;
                    z ^= z << 17;
                    // Coarse values: many ties.
                    ((z >> 40) % 64) as f32 * spread / 8.0
                })
                .collect();
            let s = Sampling { temperature, top_k: 0, top_p, seed };
            let whole = sorted_desc_reference(&row, row.len());
            for position in [0usize, 7, 99] {
                proptest::prop_assert_eq!(
                    choose(&row, &s, 4, position),
                    draw_from(&row, &whole, &s, 4, position)
                );
            }
        }
    }

    proptest::proptest! {
        /// A top-p draw over the whole vocabulary from the row's k most likely tokens and the
        /// row's tempered sum is the draw from the whole row with that sum, whenever the
        /// candidates reach the cut, and says it needs the row only when they do not.
        #[test]
        fn a_nucleus_drawn_from_candidates_is_the_whole_rows(
            picks in proptest::collection::vec(0usize..12, 2..400),
            k in 1usize..60,
            top_p in proptest::sample::select(vec![0.95f32, 0.9, 0.5, 0.05]),
            temperature in proptest::sample::select(vec![0.3f32, 1.0, 2.5]),
            seed in 0u64..1000,
            position in 0usize..5000,
        ) {
            const VALUES: [f32; 12] =
                [0.0, -0.0, 1.5, -1.5, 3.25, 7.0, -7.0, 2.0, 9.5, -3.0, 0.25, f32::NAN];
            let row: Vec<f32> = picks.iter().map(|&p| VALUES[p]).collect();
            let s = Sampling { temperature, top_k: 0, top_p, seed };
            proptest::prop_assert!(s.is_nucleus());
            proptest::prop_assert_eq!(candidates_needed(&s), CANDIDATES_MAX);
            // Another backend's order of the same sum: a value of its own, used by both.
            let z = tempered_sum(&row, 1.0 / temperature) * 1.000_001;
            let want = choose_with(&row, &s, 9, position, Some(z));
            let cand = top_k_candidates(&row, k);
            let complete = cand.len() < k;
            match choose_from_candidates(&cand, &s, 9, position, z, complete) {
                Choice::Token(t, v) => {
                    proptest::prop_assert_eq!(t, want);
                    proptest::prop_assert_eq!(v.to_bits(), row[t as usize].to_bits());
                }
                Choice::NeedsRow => {
                    proptest::prop_assert!(!complete);
                    // The cut really lies beyond the k candidates (or the sum is NaN: a
                    // NaN logit, which the whole row's draw handles as the host does).
                    let inv_t = 1.0 / temperature;
                    let m = cand[0].1 * inv_t;
                    let acc: f32 = cand.iter().map(|c| (c.1 * inv_t - m).exp()).sum();
                    // Not "acc < top_p·z": a NaN sum must pass too.
                    let reaches = acc >= top_p * z;
                    proptest::prop_assert!(!reaches, "{acc} vs {}", top_p * z);
                }
                Choice::Empty => proptest::prop_assert!(row.iter().all(|v| v.is_nan())),
            }
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
            CANDIDATES_MAX,
            "top-p over the whole row: its nucleus from the candidates when they reach it"
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
    fn temperatures_below_the_greedy_bound_are_greedy() {
        // Token 6 is the argmax; 1/T of a tiny T overflows (or scales the logits past
        // f32), which made the draws pick low-probability tokens.
        let row = [0.0f32, 1.0, -2.0, 3.0, -5.0, 0.5, 3.5, -0.25];
        for t in [f32::from_bits(1), 1e-45, 1e-39, 1e-38, 1e-30, 9.9e-6, 0.0] {
            for (top_k, top_p) in [(0, 1.0f32), (3, 1.0), (0, 0.5), (3, 0.5), (2000, 0.99)] {
                let s = Sampling {
                    temperature: t,
                    top_k,
                    top_p,
                    seed: 9,
                };
                assert!(s.validate().is_ok() && s.is_greedy(), "{s:?}");
                assert_eq!(row_draw(&s, 3, 0), RowDraw::None, "{s:?}");
                assert_eq!(candidates_needed(&s), 0, "{s:?}");
                for pos in 0..64 {
                    assert_eq!(choose(&row, &s, 3, pos), 6, "{s:?} at {pos}");
                }
            }
        }
        let at_bound = Sampling {
            temperature: GREEDY_BELOW,
            ..Sampling::greedy()
        };
        assert!(!at_bound.is_greedy() && at_bound.draws_on_device());
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
            RowDraw::Gumbel(GumbelDraw {
                inv_t: 1.0 / t,
                key,
            })
        };
        let nucleus = RowDraw::Nucleus { inv_t: 1.0 / 0.8 };
        let draws = [RowDraw::None, d(0.7, 1), nucleus, d(1.0, 2), d(1.3, 3)];
        let stats = host_row_stats(&logits, cols, vocab, &pick, &draws);
        for (r, s) in stats.iter().enumerate() {
            let row = &logits[r * cols..r * cols + vocab];
            match draws[r] {
                RowDraw::None => assert!(s.sampled == u32::MAX && s.sampled_value.is_nan()),
                RowDraw::Nucleus { inv_t } => {
                    assert!(s.sampled == u32::MAX && s.sampled_value.is_nan());
                    assert_eq!(s.tempered_sum.to_bits(), tempered_sum(row, inv_t).to_bits());
                }
                RowDraw::Gumbel(d) => {
                    let t = gumbel_argmax(row, d);
                    assert_eq!(s.sampled as usize, t);
                    assert_eq!(s.sampled_value.to_bits(), logits[r * cols + t].to_bits());
                }
            }
            if !matches!(draws[r], RowDraw::Nucleus { .. }) {
                assert!(s.tempered_sum.is_nan());
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
