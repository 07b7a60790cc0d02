//! NVRTC compilation of the kernel program, once per process per architecture (and once
//! per machine with the on-disk [`ptx_cache`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::{probe, ptx_cache, source, CudaError};

/// The NVRTC target for a compute capability: Hopper gets `sm_90a` (its own instructions),
/// others their plain `sm_XY`.
pub fn arch_for(major: i32, minor: i32) -> String {
    if major == 9 && minor == 0 {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    }
}

fn options(arch: &str) -> CompileOptions {
    CompileOptions {
        // No implicit contraction: every fused multiply-add is written in the source, so
        // the rounding sequence is the source's, whatever the compiler schedules.
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: {
            let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
            // Source lines in the PTX, for Nsight Compute's per-line stalls (no code change).
            if std::env::var("ARBOR_NVRTC_LINEINFO").is_ok_and(|v| v == "1") {
                o.push("--generate-line-info".into());
            }
            o
        },
        name: Some("arbor_kernels.cu".into()),
        ..Default::default()
    }
}

/// PTX text of the program compiled for `arch`; compiled once per process per arch.
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    {
        let guard = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ptx) = guard.get(arch) {
            return Ok(ptx.clone());
        }
    }
    let t0 = std::time::Instant::now();
    let text = compile_source(&source::program(), arch)?;
    tracing::info!(
        arch,
        ms = t0.elapsed().as_millis() as u64,
        "NVRTC compiled arbor's kernels"
    );
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), text.clone());
    Ok(text)
}

/// Compiles `src` with arbor's options, through the on-disk [`ptx_cache`].
fn compile_source(src: &str, arch: &str) -> Result<String, CudaError> {
    probe::nvrtc()?;
    ptx_cache::cached("arbor_kernels", src, arch, options(arch), |opts| {
        let res = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(src, opts))
            .map_err(|p| {
                CudaError::NoNvrtc(format!("libnvrtc is unusable: {}", probe::panic_text(&p)))
            })?;
        let ptx: Ptx = res.map_err(|e| CudaError::Compile {
            arch: arch.to_string(),
            log: describe(e),
        })?;
        Ok(ptx.to_src())
    })
}

fn describe(e: CompileError) -> String {
    match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => {
            format!(
                "{nvrtc:?} with options {options:?}\n{}",
                log.to_string_lossy()
            )
        }
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(10, 0), "sm_100");
    }

    /// The sources compile for Hopper with the local NVRTC; skipped (with the reason
    /// printed) where libnvrtc cannot be loaded, as on CI.
    #[test]
    fn sources_compile_for_sm_90a() {
        if let Err(e) = probe::nvrtc() {
            eprintln!("skipped: {e}");
            return;
        }
        let ptx = compile_ptx("sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert!(ptx.contains(".target sm_90a"), "PTX targets another arch");
        for k in source::KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "kernel {k} missing from the PTX"
            );
        }
    }

    /// With ARBOR_PTX_OUT set, writes the program's PTX there (scripts/bench/ptxas-report.sh
    /// assembles it with ptxas for the registers and spills of every kernel), for the arch
    /// ARBOR_PTX_ARCH names (sm_90a when unset; e.g. sm_80 for the mma.sync paths alone).
    #[test]
    fn write_ptx_when_asked() {
        let Ok(path) = std::env::var("ARBOR_PTX_OUT") else {
            return;
        };
        if let Err(e) = probe::nvrtc() {
            eprintln!("skipped: {e}");
            return;
        }
        let arch = std::env::var("ARBOR_PTX_ARCH").unwrap_or_else(|_| "sm_90a".into());
        let ptx = compile_ptx(&arch).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&path, ptx).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }

    /// `a*b + c` must stay a multiply and an add under arbor's options (the rounding
    /// sequence is the source's); an explicit __fmaf_rn stays one fma.
    #[test]
    fn no_implicit_contraction() {
        if let Err(e) = probe::nvrtc() {
            eprintln!("skipped: {e}");
            return;
        }
        let src = r#"extern "C" __global__ void f(float* o, const float* a) { o[0] = a[0] * a[1] + a[2]; o[1] = __fmaf_rn(a[0], a[1], a[2]); }"#;
        let ptx = compile_source(src, "sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ptx.matches("fma.rn.f32").count(), 1, "PTX:\n{ptx}");
        assert!(ptx.contains("mul.rn.f32"), "PTX:\n{ptx}");
    }
}
