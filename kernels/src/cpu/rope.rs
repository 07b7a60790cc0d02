//! Rotary position embedding (HF "rotate_half" convention) with the frequency schedules the
//! supported families ship: default, linear, dynamic (within its original context), Llama-3
//! and YaRN. Every schedule is folded into one cos/sin table computed on the host, so every
//! backend rotates with the same numbers.

/// Llama-3 style frequency scaling (`rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// YaRN (`rope_type == "yarn"`, Qwen3's long-context setting), with every optional value
/// already resolved the way HF resolves it (`attention_factor` from `factor`/`mscale`,
/// `beta_fast` 32, `beta_slow` 1, `truncate` true).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub truncate: bool,
    /// Multiplies cos and sin (HF's `attention_scaling`).
    pub attention_factor: f64,
}

/// A non-default RoPE frequency schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `rope_type == "linear"`: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// `rope_type == "dynamic"`: HF rescales only once a sequence passes
    /// `original_max_position_embeddings`, which would make a row's numbers depend on the
    /// length of the call it is in; the table is therefore limited to that context, where
    /// dynamic equals default.
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    Llama3(Llama3Scaling),
    Yarn(YarnScaling),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RopeError {
    #[error("rope: head_dim must be even and positive, got {0}")]
    HeadDim(usize),
    #[error("rope: rope_theta must be finite and > 1, got {0}")]
    Theta(f64),
    #[error("rope: {kind} scaling parameter {name} is invalid: {value}")]
    Scaling {
        kind: &'static str,
        name: &'static str,
        value: f64,
    },
    #[error(
        "rope: \"dynamic\" scaling changes the frequencies once a sequence passes \
         {original} positions, which would make results depend on the call's length; \
         arbor runs it only within that context, and {max_pos} positions were asked for \
         (pass a context of at most {original})"
    )]
    DynamicBeyondOriginal { max_pos: usize, original: usize },
    #[error("rope: {max_pos} positions × {half} frequencies do not fit in memory")]
    TooLarge { max_pos: usize, half: usize },
}

/// cos/sin for positions `0..max_pos`, computed once in f64 and stored as f32, so every
/// backend uses the same table. Layout: `cos[pos * half + i]`, `sin[pos * half + i]`,
/// `half = rotary_dim / 2`.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub head_dim: usize,
    pub max_pos: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// [`RopeTable::try_new`] for parameters already validated; panics with the
    /// [`RopeError`] message otherwise.
    pub fn new(head_dim: usize, max_pos: usize, theta: f64, scaling: Option<RopeScaling>) -> Self {
        match Self::try_new(head_dim, max_pos, theta, scaling) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// The table for `head_dim` (all of it rotated), `rope_theta` and an optional
    /// schedule; parameters from a model config are checked, not trusted.
    pub fn try_new(
        head_dim: usize,
        max_pos: usize,
        theta: f64,
        scaling: Option<RopeScaling>,
    ) -> Result<Self, RopeError> {
        Self::check(head_dim, theta, scaling)?;
        let half = head_dim / 2;
        if max_pos
            .checked_mul(half)
            .is_none_or(|n| n > isize::MAX as usize / 8)
        {
            return Err(RopeError::TooLarge { max_pos, half });
        }
        if let Some(RopeScaling::Dynamic {
            original_max_position_embeddings: original,
            ..
        }) = scaling
        {
            if max_pos > original {
                return Err(RopeError::DynamicBeyondOriginal { max_pos, original });
            }
        }
        let mut inv_freq = default_inv_freq(head_dim, theta);
        let mut attention_factor = 1.0;
        match scaling {
            // Dynamic equals default within its original context, the only one it runs in.
            None | Some(RopeScaling::Dynamic { .. }) => {}
            Some(RopeScaling::Linear { factor }) => {
                inv_freq.iter_mut().for_each(|f| *f /= factor);
            }
            Some(RopeScaling::Llama3(s)) => {
                inv_freq.iter_mut().for_each(|f| *f = llama3_scale(*f, &s));
            }
            Some(RopeScaling::Yarn(s)) => {
                inv_freq = yarn_inv_freq(head_dim, theta, &s);
                attention_factor = s.attention_factor;
            }
        }
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for &f in &inv_freq {
                let angle = pos as f64 * f;
                cos.push((angle.cos() * attention_factor) as f32);
                sin.push((angle.sin() * attention_factor) as f32);
            }
        }
        Ok(Self {
            head_dim,
            max_pos,
            cos,
            sin,
        })
    }

    /// The parameters' own limits, checked without building anything (a config is
    /// checked with them when it is read, before any table is sized).
    pub fn check(
        head_dim: usize,
        theta: f64,
        scaling: Option<RopeScaling>,
    ) -> Result<(), RopeError> {
        if head_dim == 0 || head_dim % 2 == 1 {
            return Err(RopeError::HeadDim(head_dim));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(RopeError::Theta(theta));
        }
        match scaling {
            None => Ok(()),
            Some(RopeScaling::Linear { factor }) => check_factor("linear", factor),
            Some(RopeScaling::Dynamic { factor, .. }) => check_factor("dynamic", factor),
            Some(RopeScaling::Llama3(s)) => check_llama3(&s),
            Some(RopeScaling::Yarn(s)) => check_yarn(&s),
        }
    }

    /// Rotate `x` ([rows, n_heads * head_dim]) in place; row i is at position `positions[i]`.
    ///
    /// For i < half: `x[i], x[i+half] ← x[i]·cos − x[i+half]·sin, x[i+half]·cos + x[i]·sin`
    /// (HF's `x·cos + rotate_half(x)·sin`). Panics naming the position if it is outside
    /// the table.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[usize]) {
        let width = n_heads * self.head_dim;
        assert_eq!(
            x.len(),
            positions.len() * width,
            "rope: x has {} values for {} rows × {n_heads} heads × {}",
            x.len(),
            positions.len(),
            self.head_dim
        );
        if width == 0 {
            return;
        }
        let half = self.head_dim / 2;
        for (row, &pos) in x.chunks_exact_mut(width).zip(positions) {
            assert!(
                pos < self.max_pos,
                "rope: position {pos} beyond the table's {} positions",
                self.max_pos
            );
            let cos = &self.cos[pos * half..(pos + 1) * half];
            let sin = &self.sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(self.head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    }
}

/// HF `_compute_default_rope_parameters`: `1 / theta^(2i/d)` for i in 0..d/2, in f64.
fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect()
}

fn check_factor(kind: &'static str, factor: f64) -> Result<(), RopeError> {
    if factor.is_finite() && factor >= 1.0 {
        Ok(())
    } else {
        Err(RopeError::Scaling {
            kind,
            name: "factor",
            value: factor,
        })
    }
}

fn check_llama3(s: &Llama3Scaling) -> Result<(), RopeError> {
    let bad = |name, value: f64| {
        Err(RopeError::Scaling {
            kind: "llama3",
            name,
            value,
        })
    };
    if !(s.factor.is_finite() && s.factor > 0.0) {
        return bad("factor", s.factor);
    }
    if !(s.low_freq_factor.is_finite() && s.low_freq_factor > 0.0) {
        return bad("low_freq_factor", s.low_freq_factor);
    }
    if !(s.high_freq_factor.is_finite() && s.high_freq_factor > s.low_freq_factor) {
        return bad("high_freq_factor", s.high_freq_factor);
    }
    if s.original_max_position_embeddings == 0 {
        return bad("original_max_position_embeddings", 0.0);
    }
    Ok(())
}

fn check_yarn(s: &YarnScaling) -> Result<(), RopeError> {
    let bad = |name, value: f64| {
        Err(RopeError::Scaling {
            kind: "yarn",
            name,
            value,
        })
    };
    if !(s.factor.is_finite() && s.factor > 0.0) {
        return bad("factor", s.factor);
    }
    if s.original_max_position_embeddings == 0 {
        return bad("original_max_position_embeddings", 0.0);
    }
    if !(s.beta_fast.is_finite() && s.beta_fast > 0.0) {
        return bad("beta_fast", s.beta_fast);
    }
    if !(s.beta_slow.is_finite() && s.beta_slow > 0.0) {
        return bad("beta_slow", s.beta_slow);
    }
    if !(s.attention_factor.is_finite() && s.attention_factor > 0.0) {
        return bad("attention_factor", s.attention_factor);
    }
    Ok(())
}

/// HF `_compute_yarn_parameters`: each frequency blends its interpolated (`/ factor`) and
/// extrapolated value by a linear ramp over the dimensions between the rotation counts
/// `beta_fast` and `beta_slow` at the original context.
fn yarn_inv_freq(head_dim: usize, theta: f64, s: &YarnScaling) -> Vec<f64> {
    let dim = head_dim as f64;
    let original = s.original_max_position_embeddings as f64;
    let correction_dim = |rotations: f64| {
        dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(s.beta_fast), correction_dim(s.beta_slow));
    if s.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let high = high.min(dim - 1.0);
    // HF nudges an empty ramp to avoid dividing by zero.
    let span = if low == high { 0.001 } else { high - low };
    default_inv_freq(head_dim, theta)
        .into_iter()
        .enumerate()
        .map(|(i, extrapolated)| {
            let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            (extrapolated / s.factor) * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

/// HF's YaRN `get_mscale`: the default attention factor for a context stretched by `scale`.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// HF `_compute_llama3_parameters` for one frequency: long wavelengths are divided by
/// `factor`, short ones kept, and the band between interpolated smoothly.
fn llama3_scale(inv_freq: f64, s: &Llama3Scaling) -> f64 {
    let old_ctx = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = old_ctx / s.low_freq_factor;
    let high_freq_wavelen = old_ctx / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
    let scaled = if wavelen > low_freq_wavelen {
        inv_freq / s.factor
    } else {
        inv_freq
    };
    // HF: ~(wavelen < high) & ~(wavelen > low); wavelen is never NaN here.
    let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
    if is_medium {
        let smooth =
            (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * scaled / s.factor + smooth * scaled
    } else {
        scaled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::Rng;

    const LLAMA31: Llama3Scaling = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    #[test]
    fn llama3_inv_freq_matches_known_values() {
        // Llama-3.1-8B (theta 5e5, head_dim 128), computed separately in Python from HF's
        // `_compute_llama3_parameters` in float64: (i, inv_freq before, inv_freq after).
        let known = [
            (0usize, 1.0f64, 1.0f64),
            (1, 0.8146172338565447, 0.8146172338565447),
            (28, 0.0032114459947525913, 0.0032114459947525913),
            (29, 0.0026160992529250353, 0.002166570763503359),
            (30, 0.0021311195369119653, 0.0013718935677611381),
            (32, 0.001414213562373095, 0.0005248461609929547),
            (34, 0.0009384738703573801, 0.00017850781276799638),
            (35, 0.0007644969883171747, 9.556212353964683e-05),
            (63, 2.455140791131609e-06, 3.068925988914511e-07),
        ];
        let plain = default_inv_freq(128, 500000.0);
        for (i, before, after) in known {
            let rel = |a: f64, b: f64| (a - b).abs() / b;
            assert!(
                rel(plain[i], before) < 1e-13,
                "i={i}: {} vs {before}",
                plain[i]
            );
            let got = llama3_scale(plain[i], &LLAMA31);
            assert!(rel(got, after) < 1e-13, "i={i}: {got} vs {after}");
        }
        // The table holds cos/sin of pos·inv_freq.
        let t = RopeTable::new(128, 3000, 500000.0, Some(RopeScaling::Llama3(LLAMA31)));
        let (pos, i) = (2999usize, 30usize);
        let want = (pos as f64 * 0.0013718935677611381).cos();
        assert!(
            (t.cos[pos * 64 + i] as f64 - want).abs() < 1e-6,
            "{} vs {want}",
            t.cos[pos * 64 + i]
        );
    }

    #[test]
    fn yarn_inv_freq_matches_known_values() {
        // Qwen3 long context (theta 1e6, head_dim 128, factor 4 over 32768), computed
        // separately in Python (float64) from HF's `_compute_yarn_parameters`: the ramp
        // runs over dimensions 23..40; (i, inv_freq after).
        let s = YarnScaling {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: yarn_mscale(4.0, 1.0),
        };
        let known = [
            (0usize, 1.0f64),
            (22, 0.008659643233600653),
            (23, 0.006978305848598663),
            (24, 0.005375321490790102),
            (31, 0.0008029597275452302),
            (39, 6.490394320837028e-05),
            (40, 4.445698525097307e-05),
            (63, 3.102344401879299e-07),
        ];
        let got = yarn_inv_freq(128, 1e6, &s);
        for (i, want) in known {
            assert!(
                (got[i] - want).abs() / want < 1e-12,
                "i={i}: {} vs {want}",
                got[i]
            );
        }
        assert!((s.attention_factor - 1.138629436111989).abs() < 1e-15);
        // The attention factor scales both cos and sin.
        let t = RopeTable::new(128, 100, 1e6, Some(RopeScaling::Yarn(s)));
        let (pos, i) = (99usize, 31usize);
        let angle = pos as f64 * 0.0008029597275452302;
        assert!((t.cos[pos * 64 + i] as f64 - angle.cos() * s.attention_factor).abs() < 1e-6);
        assert!((t.sin[pos * 64 + i] as f64 - angle.sin() * s.attention_factor).abs() < 1e-6);
    }

    #[test]
    fn linear_and_dynamic_tables() {
        // Linear factor 2 halves every frequency: position 2p has position p's angle, and
        // halving is exact in binary, so the bits agree.
        let plain = RopeTable::new(16, 40, 1e4, None);
        let linear = RopeTable::new(16, 80, 1e4, Some(RopeScaling::Linear { factor: 2.0 }));
        for p in 0..40 {
            for i in 0..8 {
                assert_eq!(
                    plain.cos[p * 8 + i].to_bits(),
                    linear.cos[2 * p * 8 + i].to_bits()
                );
                assert_eq!(
                    plain.sin[p * 8 + i].to_bits(),
                    linear.sin[2 * p * 8 + i].to_bits()
                );
            }
        }
        // Within its original context, dynamic is the default schedule, bit for bit.
        let dynamic = RopeTable::new(
            16,
            40,
            1e4,
            Some(RopeScaling::Dynamic {
                factor: 4.0,
                original_max_position_embeddings: 40,
            }),
        );
        assert_eq!(plain.cos, dynamic.cos);
        assert_eq!(plain.sin, dynamic.sin);
    }

    #[test]
    fn apply_rotates_halves_like_hf() {
        let (hd, heads) = (8usize, 3usize);
        let t = RopeTable::new(hd, 50, 10000.0, None);
        let mut rng = Rng::new(20);
        let positions = [0usize, 7, 49, 7];
        let x = rng.f32_vec(positions.len() * heads * hd, 2);
        let mut y = x.clone();
        t.apply(&mut y, heads, &positions);
        for (r, &pos) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (r * heads + h) * hd;
                for i in 0..hd / 2 {
                    let ang = pos as f64 / 10000f64.powf((2 * i) as f64 / hd as f64);
                    let (c, s) = (ang.cos(), ang.sin());
                    let (x1, x2) = (x[base + i] as f64, x[base + i + hd / 2] as f64);
                    let w1 = x1 * c - x2 * s;
                    let w2 = x2 * c + x1 * s;
                    assert!((y[base + i] as f64 - w1).abs() < 1e-5, "r={r} h={h} i={i}");
                    assert!(
                        (y[base + i + hd / 2] as f64 - w2).abs() < 1e-5,
                        "r={r} h={h} i={i}+half"
                    );
                }
            }
        }
        // Rows 1 and 3 share a position and data: same bits.
        let mut z = x[heads * hd..2 * heads * hd].to_vec();
        t.apply(&mut z, heads, &[7]);
        for (a, b) in z.iter().zip(&y[heads * hd..2 * heads * hd]) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert_eq!(
            RopeTable::try_new(7, 4, 1e4, None).err(),
            Some(RopeError::HeadDim(7))
        );
        assert!(matches!(
            RopeTable::try_new(8, 4, f64::NAN, None),
            Err(RopeError::Theta(_))
        ));
        let bad = Llama3Scaling {
            high_freq_factor: 1.0,
            ..LLAMA31
        };
        assert!(matches!(
            RopeTable::try_new(8, 4, 1e4, Some(RopeScaling::Llama3(bad))),
            Err(RopeError::Scaling {
                name: "high_freq_factor",
                ..
            })
        ));
        let dynamic = RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 16,
        };
        assert!(RopeTable::try_new(8, 16, 1e4, Some(dynamic)).is_ok());
        assert_eq!(
            RopeTable::try_new(8, 17, 1e4, Some(dynamic)).err(),
            Some(RopeError::DynamicBeyondOriginal {
                max_pos: 17,
                original: 16
            })
        );
        assert!(matches!(
            RopeTable::try_new(8, 4, 1e4, Some(RopeScaling::Linear { factor: 0.5 })),
            Err(RopeError::Scaling { name: "factor", .. })
        ));
        assert!(matches!(
            RopeTable::try_new(8, usize::MAX, 1e4, None),
            Err(RopeError::TooLarge { .. })
        ));
    }
}
