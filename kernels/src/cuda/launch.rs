//! Kernel launches with programmatic dependent launch (PDL, sm_90 and later).
//!
//! A decode step is ~300 launches on one stream. Launched plainly, each kernel starts only
//! after the previous one has drained: its launch latency and its prologue (shared-memory
//! setup, barrier init, a GEMM's first weight tiles) sit in the gap (profiled on an H100:
//! 0.8 µs per launch at batch 1, 1.9 µs at batch 64). With the
//! `PROGRAMMATIC_STREAM_SERIALIZATION` attribute a kernel may start once every block of
//! the previous kernel has executed `griddepcontrol.launch_dependents`, and it must then
//! execute `griddepcontrol.wait` (which returns when the previous grid has completed and
//! its memory is visible) before touching anything that grid, or any earlier one, writes
//! or reads. Every kernel of arbor's ops program and the TMA GEMMs does `pdl_enter()`
//! (wait, then trigger) before it touches memory an earlier kernel of the step writes, and
//! before its own first write, so the order of memory effects is exactly the plain launch
//! order; only the launch and the prologue overlap. Before the wait a kernel reads only
//! what no kernel writes: the TMA GEMMs' producers load their first weight tiles; the
//! decode attention kernels, `pa_combine` and RoPE + KV read the step's inputs (rows,
//! positions, block tables: uploaded before the step's first kernel) and the RoPE tables,
//! so their chains of dependent loads run while the kernel before still does.
//!
//! Kernels without the wait (cuBLAS, the collectives, the portable GEMM paths) are
//! launched without the attribute and keep full serialisation.
//!
//! Which steps use it ([`PdlPolicy`], `ARBOR_PDL`): by default the steps of fewer than
//! [`PDL_OFF_FROM_ROWS`] rows, recorded or run op by op. Decode steps, whose kernels are
//! microseconds long, gain from it (batch 128 on an H100: 8.26–8.35 ms a step with it,
//! 8.44–8.47 without). From 256 rows the GEMMs run the persistent kernels' narrow tiles
//! (gemm `tma_tile`), which lose with it: the batch-256 step took 12.39 ms with PDL and
//! 12.08 without (with the 128-column and quad tiles it took 12.16 with PDL, 12.30
//! without); a prefill of 8 × 1024 tokens 265 ms with and 233 without, and `arbor serve`'s
//! steps that carry prompt rows beside decode rows (~650 rows) 38.5 ms with and 37.5
//! without. Only time changes: the order of memory effects is the plain launch order
//! either way.
//! `ARBOR_PDL=0` turns the attribute off everywhere, `1` on in every step (both for
//! measuring what it buys), `below:ROWS` on in the steps of fewer than ROWS rows (for
//! re-measuring the rule beside `ARBOR_GEMM_NARROW=from:ROWS`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{
    self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DriverError, LaunchConfig,
};

pub const PDL_ENV: &str = "ARBOR_PDL";

/// Rows from which a step launches without PDL by default: where the GEMMs' narrow
/// persistent tiles start (gemm `NARROW_FROM_ROWS`).
pub const PDL_OFF_FROM_ROWS: usize = 256;

/// Which steps launch with PDL (`ARBOR_PDL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdlPolicy {
    /// `0`: no launch.
    Off,
    /// `1`: every launch that can.
    On,
    /// Unset or `auto`: the launches of steps of fewer than [`PDL_OFF_FROM_ROWS`] rows.
    Auto,
    /// `below:ROWS`: the launches of steps of fewer than ROWS rows (to re-measure the
    /// rule beside `ARBOR_GEMM_NARROW=from:ROWS`).
    Below(usize),
}

impl PdlPolicy {
    /// From the value of `ARBOR_PDL`; an error naming the variable and the value otherwise.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("auto") => Ok(Self::Auto),
            Some("0") => Ok(Self::Off),
            Some("1") => Ok(Self::On),
            Some(v) => match v.strip_prefix("below:").map(|r| r.trim().parse::<usize>()) {
                Some(Ok(rows)) => Ok(Self::Below(rows)),
                _ => Err(format!("{PDL_ENV}={v:?} is not 0, 1, auto or below:ROWS")),
            },
        }
    }

    /// The policy `ARBOR_PDL` names, read once; an error naming the variable and the value
    /// for any other value (opening a device reports it: [`pdl_enabled`]).
    pub fn from_env() -> Result<Self, String> {
        static P: std::sync::OnceLock<Result<PdlPolicy, String>> = std::sync::OnceLock::new();
        P.get_or_init(|| Self::parse(std::env::var(PDL_ENV).ok().as_deref()))
            .clone()
    }

    /// Whether a step of `rows` rows launches with PDL.
    pub fn for_step(self, rows: usize) -> bool {
        match self {
            Self::Off => false,
            Self::On => true,
            Self::Auto => rows < PDL_OFF_FROM_ROWS,
            Self::Below(limit) => rows < limit,
        }
    }
}

/// Whether the step now running wants PDL ([`set_step_pdl`]); read at every launch.
static STEP_PDL: AtomicBool = AtomicBool::new(true);

/// Sets whether the launches from now on use PDL (where the context allows it): the
/// backend sets it at the start of each step from [`PdlPolicy::for_step`]. One value per
/// process: the attribute only moves time, so a step of another device in the same
/// process that sees the other's value computes the same results.
pub fn set_step_pdl(on: bool) {
    STEP_PDL.store(on, Ordering::Relaxed);
}

/// Whether a launch now uses PDL on a context that allows it ([`pdl_enabled`]).
pub fn step_pdl() -> bool {
    STEP_PDL.load(Ordering::Relaxed)
}

/// Whether launches on this context may use PDL: compute capability 9.0 or later and not
/// turned off by `ARBOR_PDL=0`; an error naming the variable for a value it does not take.
pub fn pdl_enabled(ctx: &CudaContext) -> Result<bool, String> {
    let sm90 = ctx.compute_capability().is_ok_and(|(major, _)| major >= 9);
    Ok(sm90 && PdlPolicy::from_env()? != PdlPolicy::Off)
}

/// The launch attribute that allows the overlap (see the module comment).
pub fn pdl_attribute() -> CUlaunchAttribute {
    // SAFETY: plain data; the driver reads only the member the id names.
    let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    CUlaunchAttribute {
        id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    }
}

/// One kernel argument as the bytes the driver copies: device pointers and scalars of up
/// to 8 bytes, stored little-endian in a u64 slot (the driver reads the parameter's size
/// from the slot's address).
pub trait KernelArg {
    fn bits(&self, stream: &CudaStream) -> u64;
}

impl<T> KernelArg for CudaSlice<T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.device_ptr(stream);
        ptr
    }
}

impl<T> KernelArg for super::buf::DevBuf<T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        (**self).bits(stream)
    }
}

impl<T> KernelArg for CudaView<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.device_ptr(stream);
        ptr
    }
}

impl<T> KernelArg for CudaViewMut<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.device_ptr(stream);
        ptr
    }
}

/// A scalar argument's slot: its bytes at the start of a u64, little-endian, whatever
/// its sign (the driver reads the parameter's own size from the slot's address).
pub trait Scalar: Copy {
    fn slot(self) -> u64;
}

impl Scalar for i32 {
    fn slot(self) -> u64 {
        self as u32 as u64
    }
}
impl Scalar for u32 {
    fn slot(self) -> u64 {
        self as u64
    }
}
impl Scalar for f32 {
    fn slot(self) -> u64 {
        self.to_bits() as u64
    }
}
impl Scalar for i64 {
    fn slot(self) -> u64 {
        self as u64
    }
}
impl Scalar for u64 {
    fn slot(self) -> u64 {
        self
    }
}

impl<T: Scalar> KernelArg for T {
    fn bits(&self, _: &CudaStream) -> u64 {
        self.slot()
    }
}

const MAX_ARGS: usize = 16;

/// A launch builder with cudarc's `arg` shape that launches through `cuLaunchKernelEx`.
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    pdl: bool,
    slots: [u64; MAX_ARGS],
    n: usize,
}

impl<'a> Launch<'a> {
    /// `pdl`: launch with the PDL attribute (while the step wants it: [`step_pdl`]); only
    /// for kernels that call `pdl_enter()` before touching what an earlier kernel writes.
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction, pdl: bool) -> Self {
        Self {
            stream,
            func,
            pdl: pdl && step_pdl(),
            slots: [0; MAX_ARGS],
            n: 0,
        }
    }

    /// Appends an argument. Panics past MAX_ARGS: a fixed property of the call site.
    pub fn arg<T: KernelArg + ?Sized>(&mut self, a: &T) -> &mut Self {
        assert!(
            self.n < MAX_ARGS,
            "kernel launch with more than {MAX_ARGS} arguments"
        );
        self.slots[self.n] = a.bits(self.stream);
        self.n += 1;
        self
    }

    /// Appends a buffer the kernel writes: the exclusive borrow keeps a launch from
    /// passing one buffer as both an output and another argument.
    pub fn out<T: KernelArg + ?Sized>(&mut self, a: &mut T) -> &mut Self {
        self.arg(&*a)
    }

    /// # Safety
    /// The arguments must match the kernel's parameters, and every buffer must stay alive
    /// until the kernel has run (as for any cudarc launch).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: [*mut c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
        for (p, s) in params.iter_mut().zip(self.slots.iter_mut()).take(self.n) {
            *p = s as *mut u64 as *mut c_void;
        }
        let mut attr = pdl_attribute();
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if self.pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(self.pdl),
        };
        sys::cuLaunchKernelEx(
            &config,
            self.func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn low_bytes<const N: usize>(slot: u64) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&slot.to_le_bytes()[..N]);
        out
    }

    #[test]
    fn scalars_are_their_bytes_at_the_start_of_the_slot() {
        assert_eq!(low_bytes::<4>((-7i32).slot()), (-7i32).to_le_bytes());
        assert_eq!(
            low_bytes::<4>(0xdead_beef_u32.slot()),
            0xdead_beef_u32.to_le_bytes()
        );
        assert_eq!(low_bytes::<4>((-1.5f32).slot()), (-1.5f32).to_le_bytes());
        assert_eq!(low_bytes::<8>((-3i64).slot()), (-3i64).to_le_bytes());
        assert_eq!(low_bytes::<8>(u64::MAX.slot()), u64::MAX.to_le_bytes());
    }

    #[test]
    fn the_attribute_allows_programmatic_serialisation() {
        let a = pdl_attribute();
        assert_eq!(
            a.id as u32,
            CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION as u32
        );
        // SAFETY: the member the id names.
        assert_eq!(unsafe { a.value.programmaticStreamSerializationAllowed }, 1);
    }
}

#[cfg(test)]
mod pdl_policy_tests {
    use super::*;

    #[test]
    fn policy_parses_strictly_and_spares_steps_of_many_rows() {
        assert_eq!(PdlPolicy::parse(None), Ok(PdlPolicy::Auto));
        assert_eq!(PdlPolicy::parse(Some(" auto")), Ok(PdlPolicy::Auto));
        assert_eq!(PdlPolicy::parse(Some("0")), Ok(PdlPolicy::Off));
        assert_eq!(PdlPolicy::parse(Some("1")), Ok(PdlPolicy::On));
        assert_eq!(
            PdlPolicy::parse(Some("below:160")),
            Ok(PdlPolicy::Below(160))
        );
        for bad in ["yes", "below:", "below:-1", "160"] {
            let e = PdlPolicy::parse(Some(bad)).unwrap_err();
            assert!(
                e.contains("ARBOR_PDL") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        assert!(PdlPolicy::Below(160).for_step(159));
        assert!(!PdlPolicy::Below(160).for_step(160));
        let auto = PdlPolicy::Auto;
        assert!(auto.for_step(1));
        assert!(auto.for_step(192));
        assert!(!auto.for_step(PDL_OFF_FROM_ROWS));
        assert!(!auto.for_step(8192));
        assert!(!PdlPolicy::Off.for_step(1));
        assert!(PdlPolicy::On.for_step(8192));
    }
}
