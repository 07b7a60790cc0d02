//! Weights pulled into L2 ahead of their GEMM ([`Backend::prefetch`]).
//!
//! At small batches a decode step's GEMMs stream their weights from HBM and the ops
//! between them (RoPE, the KV write, attention, the residual adds and norms) barely use
//! it. A prefetch issued before those ops lets the next GEMM read part of its weight from
//! L2. How much is worth fetching depends on how long the window is: `ARBOR_L2_PREFETCH`
//! sets the bytes for each window and the largest step (rows) that prefetches. Only time
//! changes: a prefetch writes nothing.
//!
//! [`Backend::prefetch`]: crate::backend::Backend::prefetch

use std::sync::OnceLock;

use crate::backend::PrefetchWindow;

pub const ENV: &str = "ARBOR_L2_PREFETCH";

/// Bytes fetched ahead of each window's GEMM, in steps of at most `max_rows` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchPolicy {
    pub attention: usize,
    pub norm: usize,
    pub max_rows: usize,
}

impl PrefetchPolicy {
    pub const OFF: Self = Self {
        attention: 0,
        norm: 0,
        max_rows: 0,
    };
    /// Unset or `auto`.
    pub const DEFAULT: Self = Self::OFF;

    /// From `ARBOR_L2_PREFETCH`: unset or `auto` (the default), `0` or `off`, or
    /// `ATTENTION_MIB,NORM_MIB,MAX_ROWS`; an error naming the variable otherwise.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        let bad = |v: &str| {
            format!(
                "{ENV}={v:?} is not auto, off, or ATTENTION_MIB,NORM_MIB,MAX_ROWS (e.g. 32,8,64)"
            )
        };
        match value.map(str::trim) {
            None | Some("auto") => Ok(Self::DEFAULT),
            Some("0" | "off") => Ok(Self::OFF),
            Some(v) => {
                let n: Vec<usize> = v
                    .split(',')
                    .map(|p| p.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad(v))?;
                match n[..] {
                    [a, b, r] if a <= 1 << 20 && b <= 1 << 20 => Ok(Self {
                        attention: a << 20,
                        norm: b << 20,
                        max_rows: r,
                    }),
                    _ => Err(bad(v)),
                }
            }
        }
    }

    /// The policy the environment names, read once.
    pub fn from_env() -> Result<Self, String> {
        static P: OnceLock<Result<PrefetchPolicy, String>> = OnceLock::new();
        P.get_or_init(|| Self::parse(std::env::var(ENV).ok().as_deref()))
            .clone()
    }

    /// Bytes to fetch ahead of `window`'s GEMM in a step of `rows` rows.
    pub fn budget(&self, window: PrefetchWindow, rows: usize) -> usize {
        if rows == 0 || rows > self.max_rows {
            return 0;
        }
        match window {
            PrefetchWindow::Attention => self.attention,
            PrefetchWindow::Norm => self.norm,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_sets_the_bytes_and_the_rows() {
        assert_eq!(PrefetchPolicy::parse(None), Ok(PrefetchPolicy::DEFAULT));
        assert_eq!(
            PrefetchPolicy::parse(Some("auto")),
            Ok(PrefetchPolicy::DEFAULT)
        );
        assert_eq!(PrefetchPolicy::parse(Some("off")), Ok(PrefetchPolicy::OFF));
        assert_eq!(PrefetchPolicy::parse(Some("0")), Ok(PrefetchPolicy::OFF));
        let p = PrefetchPolicy::parse(Some("32, 8,64")).unwrap();
        assert_eq!((p.attention, p.norm, p.max_rows), (32 << 20, 8 << 20, 64));
        assert_eq!(p.budget(PrefetchWindow::Attention, 1), 32 << 20);
        assert_eq!(p.budget(PrefetchWindow::Norm, 64), 8 << 20);
        assert_eq!(p.budget(PrefetchWindow::Norm, 65), 0);
        assert_eq!(p.budget(PrefetchWindow::Attention, 0), 0);
        assert_eq!(PrefetchPolicy::OFF.budget(PrefetchWindow::Attention, 1), 0);
    }

    #[test]
    fn other_values_are_errors_naming_the_variable_and_the_value() {
        for bad in [
            "1",
            "yes",
            "32,8",
            "32,8,64,1",
            "-1,8,64",
            "32,x,64",
            "99999999,8,64",
        ] {
            let e = PrefetchPolicy::parse(Some(bad)).unwrap_err();
            assert!(e.contains(ENV) && e.contains(&format!("{bad:?}")), "{e}");
        }
    }
}
