//! The all-reduce kernels (`kernels/cuda/allreduce.cu`), compiled by NVRTC for the device's
//! architecture and loaded into its context.

use std::sync::Arc;

use cudarc::driver::{sys as dsys, CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions};

use super::GpuError;

pub const SOURCE: &str = include_str!("../../../kernels/cuda/allreduce.cu");

/// Entry points of the program (checked when it is loaded).
pub const ENTRY_POINTS: &[&str] = &[
    "tree_combine_f32",
    "tree_combine_bf16",
    "oneshot_f32",
    "oneshot_bf16",
    "twoshot_f32",
    "twoshot_bf16",
    "twoshot_direct_f32",
    "twoshot_direct_bf16",
];

/// Must match `ARBOR_MAX_BLOCKS` / `ARBOR_MAX_RANKS` and `struct Signal` in the source.
pub const MAX_BLOCKS: usize = 128;
pub const MAX_RANKS: usize = 8;
/// `Signal::spin_limit_ns` (u64) and `Signal::stalled` (u32): after the two flag arrays and
/// the `calls` and `done` counters.
pub const SPIN_LIMIT_OFFSET: usize = 2 * MAX_BLOCKS * MAX_RANKS * 4 + 8;
pub const STALLED_OFFSET: usize = SPIN_LIMIT_OFFSET + 8;
pub const SIGNAL_BYTES: usize = STALLED_OFFSET + 8;

pub struct Kernels {
    pub tree_combine_f32: CudaFunction,
    pub tree_combine_bf16: CudaFunction,
    pub oneshot_f32: CudaFunction,
    pub oneshot_bf16: CudaFunction,
    pub twoshot_f32: CudaFunction,
    pub twoshot_bf16: CudaFunction,
    pub twoshot_direct_f32: CudaFunction,
    pub twoshot_direct_bf16: CudaFunction,
}

/// The NVRTC target for a compute capability (Hopper gets its `a` variant).
pub fn arch_for(major: i32, minor: i32) -> String {
    if major == 9 && minor == 0 {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    }
}

pub fn compile_options(arch: &str) -> CompileOptions {
    CompileOptions {
        // Only additions here, but keep contraction off like every arbor kernel.
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("allreduce.cu".into()),
        ..Default::default()
    }
}

/// PTX of the program for `arch`; needs libnvrtc.
pub fn compile(arch: &str) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::Unavailable(
            "libnvrtc.so is not on the loader path (needed to compile the all-reduce kernels)"
                .into(),
        ));
    }
    let res = std::panic::catch_unwind(|| {
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, compile_options(arch))
    })
    .map_err(|_| {
        GpuError::Unavailable("libnvrtc is unusable (cudarc panicked loading it)".into())
    })?;
    res.map_err(|e| {
        GpuError::Compile(match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!(
                    "allreduce.cu for {arch}: {nvrtc:?}\n{}",
                    log.to_string_lossy()
                )
            }
            other => format!("allreduce.cu for {arch}: {other:?}"),
        })
    })
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, rank: usize) -> Result<Self, GpuError> {
        let cuda = |what: &str, e: cudarc::driver::DriverError| GpuError::Cuda {
            rank,
            msg: format!("{what}: {e:?}"),
        };
        let major = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| cuda("compute capability", e))?;
        let minor = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(|e| cuda("compute capability", e))?;
        let arch = arch_for(major, minor);
        let t0 = std::time::Instant::now();
        let ptx = compile(&arch)?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda("loading allreduce.cu", e))?;
        tracing::debug!(
            rank,
            arch,
            ms = t0.elapsed().as_millis() as u64,
            "all-reduce kernels ready"
        );
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda(&format!("kernel {name} missing from allreduce.cu"), e))
        };
        Ok(Self {
            tree_combine_f32: f("tree_combine_f32")?,
            tree_combine_bf16: f("tree_combine_bf16")?,
            oneshot_f32: f("oneshot_f32")?,
            oneshot_bf16: f("oneshot_bf16")?,
            twoshot_f32: f("twoshot_f32")?,
            twoshot_bf16: f("twoshot_bf16")?,
            twoshot_direct_f32: f("twoshot_direct_f32")?,
            twoshot_direct_bf16: f("twoshot_direct_bf16")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
    }

    #[test]
    fn signal_layout_matches_the_source() {
        assert!(SOURCE.contains(&format!("#define ARBOR_MAX_BLOCKS {MAX_BLOCKS}")));
        assert!(SOURCE.contains(&format!("#define ARBOR_MAX_RANKS {MAX_RANKS}")));
        // The watchdog fields follow the counters, in this order.
        let sig = &SOURCE[SOURCE.find("struct Signal {").unwrap()..];
        let sig = &sig[..sig.find("};").unwrap()];
        let fields: Vec<&str> = [
            "u32 calls;",
            "u32 done;",
            "u64 spin_limit_ns;",
            "u32 stalled;",
            "u32 pad;",
        ]
        .into_iter()
        .filter(|f| sig.contains(f))
        .collect();
        assert_eq!(fields.len(), 5, "{sig}");
        let pos: Vec<usize> = fields.iter().map(|f| sig.find(f).unwrap()).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]), "{sig}");
        assert_eq!(SPIN_LIMIT_OFFSET % 8, 0);
        for k in ENTRY_POINTS {
            assert!(
                SOURCE.contains(&format!("__global__ void {k}(")),
                "{k} missing"
            );
        }
    }

    /// Compiles for Hopper with the local NVRTC; skipped (saying why) where libnvrtc cannot
    /// be loaded, as on CI. Run with LD_LIBRARY_PATH=/opt/nvrtc/nvidia/cu13/lib here.
    #[test]
    fn source_compiles_for_sm_90a() {
        match compile("sm_90a") {
            Err(GpuError::Unavailable(why)) => eprintln!("skipped: {why}"),
            Err(e) => panic!("{e}"),
            Ok(ptx) => {
                let text = ptx.to_src();
                for k in ENTRY_POINTS {
                    assert!(
                        text.contains(&format!(".entry {k}(")),
                        "{k} missing from PTX"
                    );
                }
                // The barrier's memory ordering made it into the code.
                assert!(text.contains("st.release.sys.global.u32"));
                assert!(text.contains("ld.acquire.sys.global.u32"));
                // The watchdog reads the global timer.
                assert!(text.contains("%globaltimer"));
            }
        }
    }
}
