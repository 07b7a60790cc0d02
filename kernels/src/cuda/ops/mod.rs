//! Typed launch wrappers: shapes are checked here, on the host, before any launch, so a
//! kernel never reads or writes out of bounds because of a caller's mistake.
//!
//! One file per kernel family: device memory (memory.rs), the simple tree matmul
//! (matmul.rs), norms, element-wise ops, gathers (embedding, row selection, column
//! copies), per-row stats and top-k selection (row_stats.rs), the rows' map into the paged
//! KV cache (row_meta.rs), RoPE and the KV write (rope_kv.rs), and attention over the
//! paged cache (paged_attention.rs).

mod elementwise;
mod gather;
mod matmul;
mod memory;
pub mod moe;
mod norm;
pub mod paged_attention;
pub(crate) mod paged_tiles;
mod rope_kv;
mod row_meta;
mod row_stats;

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::buf::DevBuf;
use super::launch::Launch;
use super::{CudaError, GpuDevice};

pub use elementwise::{CutDest, CutSource, SourceType};
pub use paged_tiles::{DecodeBuild, DECODE_BUILD_ENV, DECODE_WIDE_ENV};
pub use row_meta::{row_bounds, RowMeta};
pub use row_stats::{
    decode_row_stats, decode_top_k, row_stats_params, ROW_STATS_F32, ROW_STATS_U64, TOP_K_MAX,
};

/// f32 device buffer (activations).
pub type DevF32 = DevBuf<f32>;
/// bf16 device buffer, stored as raw bits (weights, KV cache).
pub type DevBf16 = DevBuf<u16>;
/// u32 device buffer (token ids, row indices, positions).
pub type DevU32 = DevBuf<u32>;

const EW_THREADS: u32 = 256;
/// The device address of `buf`'s first element.
pub fn dev_ptr<T>(buf: &DevBuf<T>, stream: &cudarc::driver::CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    buf.device_ptr(stream).0
}

fn i32_of(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Launch {
        kernel,
        msg: format!("{what} = {v} does not fit the kernel's 32-bit index"),
    })
}

/// The output buffer of an op: `out` when the caller gives one (memory it lends, e.g. a
/// torch tensor's: the kernel writes there instead of a buffer of its own), checked to
/// hold exactly `len` values, else a fresh buffer of `len`.
fn output(
    dev: &GpuDevice,
    kernel: &'static str,
    out: Option<DevF32>,
    len: usize,
) -> Result<DevF32, CudaError> {
    match out {
        None => dev.empty_f32(len),
        Some(o) => {
            check(kernel, o.len() == len, || {
                format!(
                    "the output given has {} values, the op writes {len}",
                    o.len()
                )
            })?;
            Ok(o)
        }
    }
}

fn check(kernel: &'static str, ok: bool, msg: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Launch { kernel, msg: msg() })
    }
}

fn elementwise_cfg(count: usize) -> LaunchConfig {
    let blocks = count.div_ceil(EW_THREADS as usize).max(1);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (EW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks an optional bf16 companion output (see `rms_norm`) against its f32 output's
/// length: it holds at least as many values.
fn check_bf16_out(
    kernel: &'static str,
    outb: &Option<&mut DevBf16>,
    len: usize,
) -> Result<(), CudaError> {
    match outb {
        // Longer is fine: the buffer may be a GEMM's X padded to whole TMA boxes (gemm
        // `padded_rows`); the kernel writes its first `len` values.
        Some(o) => check(kernel, o.len() >= len, || {
            format!(
                "bf16 output has {} values, expected at least {len}",
                o.len()
            )
        }),
        None => Ok(()),
    }
}

/// Pushes an optional bf16 companion output: the buffer, or the null pointer the kernel
/// reads as "none".
fn arg_bf16_out(b: &mut Launch<'_>, outb: Option<&mut DevBf16>) {
    const NO_OUTPUT: u64 = 0;
    match outb {
        Some(o) => b.out(o),
        None => b.arg(&NO_OUTPUT),
    };
}

impl GpuDevice {
    /// A launch of one of the ops program's kernels (each begins with `pdl_enter()`), with
    /// the PDL attribute when the device allows it (launch.rs).
    fn launch<'a>(&'a self, f: &'a CudaFunction) -> Launch<'a> {
        Launch::new(&self.stream, f, self.pdl)
    }

    fn drv<T>(
        &self,
        what: &str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<T, CudaError> {
        r.map_err(|source| CudaError::Driver {
            ordinal: self.ordinal,
            what: what.to_string(),
            source,
        })
    }

    fn launched(
        &self,
        kernel: &'static str,
        r: Result<impl Sized, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        self.drv(&format!("launching {kernel}"), r).map(|_| ())
    }
}
