//! One call's operands ([`GemmArgs`]), what it writes ([`Epilogue`], [`OutDtype`]), and
//! the checks against the kernels' requirements.

use cudarc::driver::sys::CUdeviceptr;

use super::error::GemmError;
use super::path::{Path, QUAD128_BNS, QUAD_BNS, WHOLE_BNS};
use crate::cpu::matmul::TreeMatmul;
use crate::tree::SEGMENTS;

/// Output element type; both are rounded only after the tree's root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    F32,
    Bf16,
}

/// Raw device operands of one call. `x` is [m, ldx] and `w` [n, ldw] bf16 (only columns
/// `[0, shape.k)` are read, so a TP shard of K is a pointer offset plus the full row
/// stride); `out` is [m, n] of `out_dtype`; `ws` has `ws_len` f32 elements (scratch);
/// `counters` has `counters_len` u32 elements, zeroed once at allocation and left at zero
/// by every call (see [`Path::counters_len`]). Neither may be used by two streams at once.
#[derive(Debug, Clone, Copy)]
pub struct GemmArgs {
    pub shape: TreeMatmul,
    pub x: CUdeviceptr,
    pub ldx: usize,
    /// Rows of X that may be read (at least `shape.m`): a TMA path loads X in boxes of 64
    /// or 128 rows, and a box that reaches past the rows its tensor map holds costs the
    /// TMA unit time (a 160-row gate/up call took 1.4× a 256-row one). Rows from `m` on
    /// are read, never stored: each output row depends only on its own row of X, so
    /// their contents change no result. `m` where nothing lies past X.
    pub x_rows: usize,
    pub w: CUdeviceptr,
    pub ldw: usize,
    pub out: CUdeviceptr,
    pub out_dtype: OutDtype,
    pub ws: CUdeviceptr,
    pub ws_len: usize,
    pub counters: CUdeviceptr,
    pub counters_len: usize,
    /// W is not written by any kernel that may still run on the stream (model weights,
    /// uploaded operands): under programmatic dependent launch the small-M TMA kernel then
    /// loads its first W tiles before waiting for the previous kernel (launch.rs).
    pub w_constant: bool,
    pub epilogue: Epilogue,
}

/// The largest X box a TMA path loads, in rows: X buffers of a multiple of this many rows
/// (rows past `m` of any content, [`GemmArgs::x_rows`]) are never read past their end.
pub const X_ROW_BOX: usize = 128;

/// Rows to give an X buffer of `m` rows so that no TMA box reads past it.
pub fn padded_rows(m: usize) -> usize {
    m.next_multiple_of(X_ROW_BOX)
}

/// The rows above which the model's bf16 X buffers hold whole 128-row boxes
/// ([`x_rows_to_allocate`]) and the GEMMs read all of them ([`x_rows_to_read`]): above one
/// 64-row warpgroup's rows, where the 128-row tiles take over from the 64-row ones.
pub const PAD_ABOVE_ROWS: usize = 64;

/// Rows to allocate for an X buffer of `m` rows that [`x_rows_to_read`] reads whole:
/// [`padded_rows`] above `pad_above` rows, else `m` (nothing past `m` would be read).
pub fn x_rows_to_allocate(m: usize, pad_above: usize) -> usize {
    if m > pad_above {
        padded_rows(m)
    } else {
        m
    }
}

/// [`GemmArgs::x_rows`] for a call of `m` rows whose X buffer holds `available` rows:
/// all of them above `pad_above` rows ([`PAD_ABOVE_ROWS`] by default), else `m`.
/// Measured on an H100 (gemm-log runs 23 and 25): with X of exactly `m` rows the last row
/// tile's boxes reach past X and cost the TMA unit time (160 rows of the gate/up layer
/// 185 µs against 151 with X padded to 256; the decode step at 96 rows 8.53 ms against
/// 9.21, at 224 rows 12.11 against 12.40, all with TMA stores clipped at M); at one row
/// the zero-filled box is the cheaper one (down 47.2 against 48.6 µs, the decode step at
/// batch 1 0.12 ms).
pub fn x_rows_to_read(m: usize, available: usize, pad_above: usize) -> usize {
    if m > pad_above && available > m {
        available
    } else {
        m
    }
}

/// What a call writes at `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// The roots, `[m, n]` of `out_dtype`.
    Store,
    /// The MLP's gate/up projection with W's rows alternating gate and up (row 2j gate j,
    /// 2j + 1 up j; `n` even): `silu(gate)·up`, `[m, n/2]` f32 at `out` where `out` is not
    /// 0 and, where `bf16` is not 0, rounded to bf16 there (at least one of the two). The
    /// bits of the stored roots followed by the element-wise `silu_mul_pairs` kernel; the
    /// TMA paths only ([`Path::is_tma`]).
    SiluMulPairs { bf16: CUdeviceptr },
}

/// The tree and strides every kernel needs (gemm_tree.cu): 1, 2, 4 or 8 segments whose
/// length is a multiple of 8, K a multiple of 8 within them, row strides multiples of 8.
pub(super) fn check_tree(s: &TreeMatmul, ldx: usize, ldw: usize) -> Result<(), GemmError> {
    let bad = |msg: String| Err(GemmError::Shape { shape: *s, msg });
    if !(s.n_seg.is_power_of_two() && s.n_seg <= SEGMENTS) {
        return bad(format!("n_seg = {} is not 1, 2, 4 or 8", s.n_seg));
    }
    if s.seg_len == 0 || !s.seg_len.is_multiple_of(8) {
        return bad(format!(
            "seg_len = {} must be a positive multiple of 8",
            s.seg_len
        ));
    }
    if !s.k.is_multiple_of(8) || s.k > s.n_seg * s.seg_len {
        return bad(format!(
            "k = {} must be a multiple of 8 and at most n_seg·seg_len = {}",
            s.k,
            s.n_seg * s.seg_len
        ));
    }
    if ldx < s.k || ldw < s.k || !ldx.is_multiple_of(8) || !ldw.is_multiple_of(8) {
        return bad(format!(
            "row strides ldx = {ldx}, ldw = {ldw} must be multiples of 8 and at least k"
        ));
    }
    Ok(())
}

/// Checks a shape against the kernel's requirements (see gemm_tree.cu).
pub fn validate(a: &GemmArgs, path: Path) -> Result<(), GemmError> {
    let s = a.shape;
    let bad = |msg: String| Err(GemmError::Shape { shape: s, msg });
    match path {
        Path::WgWhole { bn } if !WHOLE_BNS.contains(&bn) => {
            return bad(format!(
                "wgwhole has no {bn}-column tile (one of {WHOLE_BNS:?})"
            ));
        }
        Path::WgQuad { bn } if !QUAD_BNS.contains(&bn) => {
            return bad(format!(
                "wgquad has no {bn}-column tile (one of {QUAD_BNS:?})"
            ));
        }
        Path::WgQuad128 { bn } if !QUAD128_BNS.contains(&bn) => {
            return bad(format!(
                "wgquad128 has no {bn}-column tile (one of {QUAD128_BNS:?})"
            ));
        }
        _ => {}
    }
    check_tree(&s, a.ldx, a.ldw)?;
    if a.x_rows < s.m {
        return bad(format!("x_rows = {} is below m = {}", a.x_rows, s.m));
    }
    if !a.x.is_multiple_of(16) || !a.w.is_multiple_of(16) {
        return bad(format!(
            "x ({:#x}) and w ({:#x}) must be 16-byte aligned",
            a.x, a.w
        ));
    }
    if let Epilogue::SiluMulPairs { bf16 } = a.epilogue {
        if !path.is_tma() {
            return bad(format!(
                "path {} has no fused SiLU·mul epilogue (the TMA paths have)",
                path.name()
            ));
        }
        if !s.n.is_multiple_of(2) || a.out_dtype != OutDtype::F32 {
            return bad(format!(
                "the SiLU·mul epilogue needs an even n (gate/up pairs) and f32 output, got n = {} and {:?}",
                s.n, a.out_dtype
            ));
        }
        if !bf16.is_multiple_of(16) {
            return bad(format!("bf16 output {bf16:#x} must be 16-byte aligned"));
        }
        if a.out == 0 && bf16 == 0 {
            return bad(
                "the SiLU·mul epilogue needs an f32 output, a bf16 one or both; both are null"
                    .into(),
            );
        }
    }
    if path.is_tma() && s.k != s.n_seg * s.seg_len {
        return bad(format!(
            "path {} needs k == n_seg·seg_len = {} (full segments), got k = {}",
            path.name(),
            s.n_seg * s.seg_len,
            s.k
        ));
    }
    let limit = i32::MAX as usize;
    if s.m > limit || s.n > limit || s.n_seg * s.seg_len > limit || a.ldx > limit || a.ldw > limit {
        return bad("a dimension exceeds i32".into());
    }
    // The persistent kernels' workspace is optional (`Path::workspace_len`).
    if !path.is_split() {
        return Ok(());
    }
    let need = path.workspace_len(s.m, s.n, s.n_seg);
    if need > 0 && (a.ws == 0 || !a.ws.is_multiple_of(16)) {
        return bad(format!(
            "path {} needs a 16-byte aligned workspace, got {:#x}",
            path.name(),
            a.ws
        ));
    }
    if a.ws_len < need {
        return bad(format!(
            "path {} needs {need} f32 of workspace, got {}",
            path.name(),
            a.ws_len
        ));
    }
    let need = path.counters_len(s.m, s.n);
    if a.counters_len < need {
        return bad(format!(
            "path {} needs {need} u32 tile counters, got {}",
            path.name(),
            a.counters_len
        ));
    }
    if need > 0 && (a.counters == 0 || !a.counters.is_multiple_of(4)) {
        return bad(format!(
            "counters ({:#x}) must be a 4-byte aligned device pointer",
            a.counters
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm::path::Family;

    fn args(shape: TreeMatmul) -> GemmArgs {
        GemmArgs {
            shape,
            x: 0x1000,
            ldx: shape.k,
            x_rows: shape.m,
            w: 0x2000,
            ldw: shape.k,
            out: 0x3000,
            out_dtype: OutDtype::F32,
            ws: 0x4000,
            ws_len: 8 * shape.m * shape.n,
            counters: 0x5000,
            counters_len: 1024,
            w_constant: true,
            epilogue: Epilogue::Store,
        }
    }

    #[test]
    fn x_is_read_in_whole_boxes_above_one_box_of_rows() {
        assert_eq!(padded_rows(1), X_ROW_BOX);
        assert_eq!(padded_rows(128), 128);
        assert_eq!(padded_rows(129), 256);
        assert_eq!(padded_rows(0), 0);
        // Up to one warpgroup's rows the TMA unit's zero fill is the cheaper way (batch 1).
        let above = PAD_ABOVE_ROWS;
        for m in [1, 8, 63, 64] {
            assert_eq!(x_rows_to_read(m, padded_rows(m), above), m);
            assert_eq!(x_rows_to_allocate(m, above), m);
        }
        for m in [
            65, 72, 96, 127, 128, 129, 160, 192, 200, 224, 255, 256, 1000, 1024,
        ] {
            assert_eq!(
                x_rows_to_read(m, x_rows_to_allocate(m, above), above),
                padded_rows(m)
            );
            assert_eq!(x_rows_to_allocate(m, above), padded_rows(m));
        }
        // Another threshold pads from there on.
        assert_eq!(x_rows_to_allocate(96, 128), 96);
        assert_eq!(x_rows_to_read(96, 128, 128), 96);
        assert_eq!(x_rows_to_read(160, 256, 128), 256);
        // A buffer of exactly M rows is read as it is.
        assert_eq!(x_rows_to_read(200, 200, above), 200);
    }

    #[test]
    fn validation_names_the_bad_value() {
        let good = TreeMatmul {
            m: 4,
            n: 64,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        assert!(validate(&args(good), Path::Split16).is_ok());
        let shard = TreeMatmul {
            k: 1024,
            n_seg: 2,
            ..good
        };
        assert!(validate(&args(shard), Path::Tree128).is_ok());
        let cases = [
            (TreeMatmul { n_seg: 3, ..good }, "n_seg = 3"),
            (
                TreeMatmul {
                    seg_len: 500,
                    ..good
                },
                "seg_len = 500",
            ),
            (TreeMatmul { k: 4100, ..good }, "k = 4100"),
            (
                TreeMatmul {
                    k: 2048,
                    n_seg: 2,
                    ..good
                },
                "k = 2048",
            ),
        ];
        assert!(validate(&args(good), Path::WgWhole { bn: 224 }).is_ok());
        let short_x = GemmArgs {
            x_rows: 3,
            ..args(good)
        };
        let e = validate(&short_x, Path::WgTma { bn: 128 }).unwrap_err();
        assert!(e.to_string().contains("x_rows = 3 is below m = 4"), "{e}");
        let long_x = GemmArgs {
            x_rows: 128,
            ..args(good)
        };
        assert!(validate(&long_x, Path::WgTma { bn: 128 }).is_ok());
        let e = validate(&args(good), Path::WgWhole { bn: 100 }).unwrap_err();
        assert!(e.to_string().contains("100-column"), "{e}");
        let e = validate(&args(good), Path::WgQuad { bn: 224 }).unwrap_err();
        assert!(e.to_string().contains("224-column"), "{e}");
        for (shape, want) in cases {
            let e = validate(&args(shape), Path::Split16)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut a = args(good);
        a.ws_len = 10;
        let e = validate(&a, Path::Split64).unwrap_err().to_string();
        assert!(e.contains("workspace"), "{e}");
        let mut c = args(good);
        c.counters_len = 0;
        let e = validate(&c, Path::WgSplit64).unwrap_err().to_string();
        assert!(e.contains("tile counters"), "{e}");
        assert!(
            validate(&c, Path::WgTree128).is_ok(),
            "tree paths need no counters"
        );
        a.ldx = 4000;
        assert!(validate(&a, Path::Tree128).is_err());
        // The SiLU·mul epilogue: f32, bf16 or both, never neither.
        let mut s = args(good);
        s.epilogue = Epilogue::SiluMulPairs { bf16: 0x6000 };
        assert!(validate(&s, Path::WgTma { bn: 128 }).is_ok());
        s.out = 0;
        assert!(validate(&s, Path::WgTma { bn: 128 }).is_ok(), "bf16 alone");
        s.epilogue = Epilogue::SiluMulPairs { bf16: 0 };
        let e = validate(&s, Path::WgTma { bn: 128 })
            .unwrap_err()
            .to_string();
        assert!(e.contains("both are null"), "{e}");
    }

    #[test]
    fn every_shape_has_a_valid_path_of_its_family() {
        let full = TreeMatmul {
            m: 1,
            n: 64,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        // k < n_seg·seg_len: a short last segment, which the TMA view cannot describe.
        let short = TreeMatmul { k: 4088, ..full };
        for fam in [Family::Mma, Family::Wgmma] {
            for m in [1usize, 16, 17, 64, 256, 257, 4096] {
                for base in [full, short] {
                    let shape = TreeMatmul { m, ..base };
                    let p = Path::for_shape(&shape, fam);
                    assert_eq!(p.family(), fam);
                    assert!(Path::all(fam).contains(&p));
                    let small = if p.is_tma() { m <= 64 } else { m <= 256 };
                    let split_k = p.is_split()
                        || matches!(
                            p,
                            Path::WgCluster64 | Path::WgCluster64x2 | Path::WgCluster64x2N256
                        );
                    assert_eq!(split_k, small, "m = {m}");
                    assert_eq!(
                        p.is_tma(),
                        fam == Family::Wgmma && base.k == 4096,
                        "{shape:?}"
                    );
                    let mut a = args(shape);
                    a.ws_len = p.workspace_len(m, shape.n, shape.n_seg);
                    a.counters_len = p.counters_len(m, shape.n);
                    assert!(validate(&a, p).is_ok(), "{shape:?} {p:?}");
                }
            }
        }
        let e = validate(
            &args(TreeMatmul { m: 4096, ..short }),
            Path::WgTma { bn: 128 },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("k == n_seg·seg_len = 4096"), "{e}");
        // The tree paths keep their partials on the chip: no workspace at any shape, but
        // for the persistent kernel's tail, at most half of a grid of at most 256 blocks.
        assert_eq!(
            Path::WgTma { bn: 128 }.workspace_len(4096, 14336, 8),
            128 * 4 * 64 * 128
        );
        assert_eq!(Path::WgTma { bn: 128 }.counters_len(4096, 14336), 256);
        assert_eq!(
            Path::WgTma { bn: 64 }.workspace_len(128, 512, 4),
            4 * 4 * 64 * 64
        );
        assert_eq!(Path::WgCluster64.counters_len(64, 4096), 0);
    }
}
