//! The GEMM's own NVRTC program: its sources, the device probe, and the compile.

use cudarc::driver::CudaContext;
use cudarc::nvrtc::{CompileError, CompileOptions};

use super::error::GemmError;

/// The kernel sources, compiled together as their own NVRTC program: the portable
/// mma.sync kernels (sm_80+) and the Hopper wgmma kernels (compiled only for sm_90a).
pub const SOURCES: &[(&str, &str)] = &[
    ("pdl.cuh", include_str!("../../../cuda/pdl.cuh")),
    ("silu.cuh", include_str!("../../../cuda/silu.cuh")),
    ("wgmma.cuh", include_str!("../../../cuda/wgmma.cuh")),
    ("gemm_tree.cu", include_str!("../../../cuda/gemm_tree.cu")),
    ("gemm_moe.cu", include_str!("../../../cuda/gemm_moe.cu")),
    ("gemm_sm90.cu", include_str!("../../../cuda/gemm_sm90.cu")),
    (
        "gemm_sm90_tma.cu",
        include_str!("../../../cuda/gemm_sm90_tma.cu"),
    ),
    (
        "gemm_sm90_swap.cu",
        include_str!("../../../cuda/gemm_sm90_swap.cu"),
    ),
    (
        "gemm_moe_sm90.cu",
        include_str!("../../../cuda/gemm_moe_sm90.cu"),
    ),
];

/// The program: the sources concatenated, each under a `#line` so messages name the file.
pub fn program() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n{text}\n"));
    }
    s
}

/// Checks that libcuda and libnvrtc open before cudarc touches them (its loader panics).
pub fn probe() -> Result<(), GemmError> {
    // SAFETY: only dlopens the library names cudarc itself would use.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GemmError::NoGpu(
            "libcuda.so could not be loaded (no NVIDIA driver on this machine)".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GemmError::NoGpu(
            "libnvrtc.so is not on the loader path (set LD_LIBRARY_PATH)".into(),
        ));
    }
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| GemmError::NoGpu("the CUDA driver library is unusable".into()))?
        .map_err(|e| GemmError::NoGpu(format!("cuInit/cuDeviceGetCount failed: {e}")))?;
    if count <= 0 {
        return Err(GemmError::NoGpu("the driver reports no CUDA device".into()));
    }
    Ok(())
}

/// NVRTC target: Hopper gets `sm_90a`; the kernel itself needs sm_80 or newer.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Compiles [`SOURCE`] for `arch` and returns the PTX text, through the on-disk
/// [`ptx_cache`](crate::cuda::ptx_cache).
pub fn compile(arch: &str) -> Result<String, GemmError> {
    let opts = CompileOptions {
        fmad: Some(false),
        ftz: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("gemm_tree.cu".into()),
        ..Default::default()
    };
    let src = program();
    crate::cuda::ptx_cache::cached("gemm_tree", &src, arch, opts, |opts| {
        let res = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(&src, opts))
            .map_err(|_| GemmError::NoGpu("libnvrtc is unusable".into()))?;
        let ptx = res.map_err(|e| GemmError::Compile {
            arch: arch.to_string(),
            log: match e {
                CompileError::CompileError { nvrtc, log, .. } => {
                    format!("{nvrtc:?}\n{}", log.to_string_lossy())
                }
                other => format!("{other:?}"),
            },
        })?;
        Ok(ptx.to_src())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm::path::{Family, Path};

    /// The source compiles for Hopper with the local NVRTC, and the tensor-core MMA is in
    /// the PTX; skipped (with the reason printed) where libnvrtc cannot be loaded.
    #[test]
    fn source_compiles_for_sm_90a() {
        // SAFETY: only dlopens libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc.so is not loadable here (set LD_LIBRARY_PATH)");
            return;
        }
        let ptx = match compile("sm_90a") {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        assert!(ptx.contains(".target sm_90a"), "PTX targets another arch");
        // scripts/bench/ptxas-report.sh (PROGRAM=gemm) assembles it for registers and spills.
        if let Ok(path) = std::env::var("ARBOR_GEMM_PTX_OUT") {
            std::fs::write(&path, &ptx).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        }
        let paths = Path::all(Family::Mma)
            .iter()
            .chain(Path::all(Family::Wgmma));
        for k in paths.map(|p| p.kernel()) {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX"
            );
        }
        assert!(ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
        assert!(ptx.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"));
        assert!(ptx.contains("cp.async.bulk.tensor.3d"));
        assert!(ptx.contains("ld.shared::cluster.v4.f32"));
        // The Hopper kernels are left out of a non-Hopper build rather than failing it.
        let ptx80 = compile("sm_80").unwrap_or_else(|e| panic!("{e}"));
        assert!(!ptx80.contains("wgmma"));
        assert!(ptx80.contains(".entry arbor_gemm_tree_128x128("));
        for path in crate::cuda::gemm::GroupedPath::ALL {
            for (ptx, silu) in [(&ptx, false), (&ptx80, false), (&ptx, true), (&ptx80, true)] {
                assert!(ptx.contains(&format!(".entry {}(", path.kernel(silu))));
            }
        }
        // The wgmma grouped kernel is Hopper's only; the gather it reads is everywhere.
        for path in crate::cuda::gemm::GroupedPath::WGMMA {
            for silu in [false, true] {
                let entry = format!(".entry {}(", path.kernel(silu));
                assert!(ptx.contains(&entry), "{entry} missing from the sm_90a PTX");
                assert!(!ptx80.contains(&entry), "{entry} in the sm_80 PTX");
            }
        }
        assert!(ptx.contains("fence.proxy.tensormap::generic.acquire.sys"));
        for p in [&ptx, &ptx80] {
            assert!(p.contains(".entry arbor_moe_gather_rows("));
        }
    }
}
