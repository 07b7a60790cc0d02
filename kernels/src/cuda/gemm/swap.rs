//! Where the default path takes a swapped-operand kernel (`Path::WgSwap`): the rule of
//! [`SWAP_ENV`] and the form [`swap_form`] picks for a call.

use super::error::GemmError;
use super::path::{packs_waves, Path, SwapForm, SWAP_FORMS, SWAP_XR};

/// The variable that sets where the default path takes a swapped-operand kernel
/// ([`swap_form`]): `1` where its blocks make one wave at least 7/8 full, `wave` where
/// they make one wave at least 2/3 full or, too wide for one wave, the fewest waves (to
/// measure the narrower grids and the LM head), `0` never; unset
/// [`SWAP_BY_DEFAULT`].
pub const SWAP_ENV: &str = "ARBOR_GEMM_SWAP";

/// [`SWAP_ENV`]'s rule when it is unset.
pub const SWAP_BY_DEFAULT: SwapRule = SwapRule::Packed;

/// Where the default path takes a swapped-operand kernel ([`swap_form`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapRule {
    /// Never.
    Off,
    /// Where the form's blocks fill one wave at least 7/8 full (`1`).
    Packed,
    /// Where they fill one wave at least 2/3 full, and for an N too wide for one wave
    /// of any form, the form of the fewest waves (`wave`; to measure these forms).
    Wave,
}

/// [`SWAP_ENV`]'s value (`None`: unset) as a rule.
pub fn swap_rule(value: Option<&str>) -> Result<SwapRule, GemmError> {
    match value.map(str::trim) {
        None | Some("") => Ok(SWAP_BY_DEFAULT),
        Some("1") => Ok(SwapRule::Packed),
        Some("wave") => Ok(SwapRule::Wave),
        Some("0") => Ok(SwapRule::Off),
        Some(v) => Err(GemmError::Env {
            var: SWAP_ENV,
            value: v.to_string(),
            msg: "expected 1 (W as the wgmma's 64-row side and X's rows its N side, up to 8 rows, where the blocks fill one wave 7/8 full), wave (2/3 full, or the fewest waves where none fits one) or 0",
        }),
    }
}

/// The swapped-operand kernel a call of `m` rows, `n` columns over `n_seg` segments takes
/// under `rule` on `sms` SMs that hold `clusters[i]` of its clusters of 2^i blocks at
/// once, if any: at most 8 rows, and of the [`SWAP_FORMS`] that sum at most `n_seg`
/// segments a block and whose blocks make one wave (every cluster resident) at least
/// 7/8 full ([`SwapRule::Packed`]) or 2/3 full ([`SwapRule::Wave`]), the one with the
/// most blocks, the most W rows a block on a tie (fewer blocks a tile: TP 1's q/k/v took
/// 19.4 µs as `wgswap128s4` against 20.0 as `wgswap64s8` at one row, H200).
///
/// The cluster kernels run the narrow layers on half the SMs or fewer at one row
/// (`wgcluster64x2n256`: o and down on 64 blocks), so the swapped kernel's one wave
/// streams W on nearly all of them: TP 1's o and down (`wgswap64s4`, 128 blocks) and
/// gate/up (`wgswap448s4`), the o and down shards at TP 2 and 4 (`wgswap64s2`,
/// `wgswap64s1`). Under [`SwapRule::Wave`] a call so wide that no form's blocks fit the
/// SMs once (the LM head: 4.3 waves of `wgswap448s4`, 253.6 µs alone against the cluster
/// kernel's 271.4 at one row, H200) takes the form of the fewest waves, each at least 2/3
/// full.
pub fn swap_form(
    m: usize,
    n: usize,
    n_seg: usize,
    sms: usize,
    clusters: &[u32; 4],
    rule: SwapRule,
) -> Option<Path> {
    if m == 0 || m > SWAP_XR || sms == 0 || rule == SwapRule::Off {
        return None;
    }
    // (path, blocks, W rows a block, blocks resident at once) of each form the call can take.
    let forms = SWAP_FORMS
        .iter()
        .filter(|f| f.spc <= n_seg && n_seg.is_multiple_of(f.spc))
        .map(|&SwapForm { tw, spc, .. }| {
            let path = Path::WgSwap { tw, spc };
            let ((blocks, _, _), _) = path.launch_dims(m, n, n_seg);
            let ns = n_seg / spc;
            let wave = if ns == 1 {
                sms
            } else {
                sms.min(clusters[ns.trailing_zeros().min(3) as usize] as usize * ns)
            };
            (path, blocks, tw, wave)
        });
    let one_wave = forms
        .clone()
        .filter(|&(_, blocks, _, wave)| {
            let full = match rule {
                SwapRule::Wave => 3 * blocks >= 2 * sms,
                _ => packs_waves(blocks, sms),
            };
            blocks <= wave && full
        })
        .max_by(|a, b| a.1.cmp(&b.1).then(a.2.cmp(&b.2)))
        .map(|(path, ..)| path);
    if one_wave.is_some() || rule != SwapRule::Wave || forms.clone().any(|f| f.1 <= sms) {
        return one_wave;
    }
    // `wave` only, for an N so wide that no form's blocks fit the SMs once (the LM head):
    // the form of the fewest waves, each at least 2/3 full, to measure against the
    // cluster kernel.
    forms
        .filter(|&(_, blocks, _, wave)| wave > 0 && 3 * blocks >= 2 * blocks.div_ceil(wave) * wave)
        .min_by(|a, b| {
            (a.1.div_ceil(a.3))
                .cmp(&b.1.div_ceil(b.3))
                .then(b.1.cmp(&a.1))
        })
        .map(|(path, ..)| path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm::path::Family;

    /// Swapped-kernel clusters of 1, 2, 4 and 8 blocks resident at once, as an H200 reports
    /// them (`bench gemm`).
    const H200_SWAP: [u32; 4] = [132, 66, 30, 15];

    #[test]
    fn the_form_is_the_one_wave_with_the_most_blocks_and_wave_measures_the_others() {
        let cap = H200_SWAP;
        // The rule: TP 1's o, down and gate/up, the o and down shards at TP 2 and 4.
        for (m, n, n_seg, want) in [
            (1, 4096, 8, (64, 4)),
            (8, 28672, 8, (448, 4)),
            (1, 4096, 4, (64, 2)),
            (1, 4096, 2, (64, 1)),
        ] {
            assert_eq!(
                swap_form(m, n, n_seg, 132, &cap, SwapRule::Packed),
                Some(Path::WgSwap {
                    tw: want.0,
                    spc: want.1
                }),
                "M = {m}, N = {n}, {n_seg} segments"
            );
        }
        // One wave at least 2/3 full: the 96- and 112-block forms.
        assert_eq!(
            swap_form(1, 6144, 8, 132, &cap, SwapRule::Wave),
            Some(Path::WgSwap { tw: 128, spc: 4 })
        );
        assert_eq!(
            swap_form(1, 14336, 8, 132, &cap, SwapRule::Wave),
            Some(Path::WgSwap { tw: 128, spc: 8 })
        );
        assert_eq!(
            swap_form(1, 1536, 8, 132, &cap, SwapRule::Wave),
            Some(Path::WgSwap { tw: 64, spc: 2 })
        );
        // The LM head: several waves of any form; `wave` takes the fewest (five of 448 rows).
        assert_eq!(swap_form(1, 128256, 8, 132, &cap, SwapRule::Packed), None);
        assert_eq!(
            swap_form(1, 128256, 8, 132, &cap, SwapRule::Wave),
            Some(Path::WgSwap { tw: 448, spc: 4 })
        );
        // Fewer resident clusters than the grid's: a second wave.
        let short = [132, 63, 30, 15];
        assert_eq!(swap_form(1, 4096, 8, 132, &short, SwapRule::Packed), None);
        // Clusters of four beyond those resident: TP 4's q/k/v needs 24, and 23 fit.
        assert_eq!(
            swap_form(1, 1536, 8, 132, &[132, 66, 23, 15], SwapRule::Wave),
            None
        );
        assert_eq!(swap_form(1, 4096, 8, 0, &cap, SwapRule::Packed), None);
        assert_eq!(swap_form(0, 4096, 8, 132, &cap, SwapRule::Packed), None);
    }

    #[test]
    fn the_rule_comes_from_its_variable() {
        assert_eq!(swap_rule(None).unwrap(), SWAP_BY_DEFAULT);
        assert_eq!(swap_rule(Some("0")).unwrap(), SwapRule::Off);
        assert_eq!(swap_rule(Some(" wave ")).unwrap(), SwapRule::Wave);
        let e = swap_rule(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("ARBOR_GEMM_SWAP") && e.contains("yes"), "{e}");
    }

    #[test]
    fn every_swapped_form_is_a_path_with_its_own_kernel_and_grid() {
        let all = Path::all(Family::Wgmma);
        for SwapForm { tw, spc, .. } in SWAP_FORMS {
            let p = Path::WgSwap { tw, spc };
            assert!(all.contains(&p), "{p:?}");
            assert_eq!(p.name(), format!("wgswap{tw}s{spc}"));
            assert_eq!(p.kernel(), format!("arbor_gemm_wg_swap_{tw}x8_s{spc}"));
            // One block an SM: the ring fills the same 224 KB whatever the form.
            assert!(
                p.smem_bytes() <= 227 * 1024 && p.smem_bytes() > 170 * 1024,
                "{p:?}"
            );
            // A block of n_seg / spc segments' tile, 8 rows of X.
            assert_eq!(
                p.launch_dims(9, 4096, 8).0,
                (4096usize.div_ceil(tw) * (8 / spc), 2, 1)
            );
            // A call of fewer segments than the form sums is one block a tile.
            assert_eq!(p.launch_dims(1, 4096, 1).0 .0, 4096usize.div_ceil(tw));
        }
    }
}
