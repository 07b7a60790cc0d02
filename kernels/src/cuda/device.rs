//! One GPU of one rank: its context, stream and the loaded kernel module.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;

use super::buf::Workspace;
use super::{arch_for, compile_ptx, probe, source, CudaError};

/// A device with arbor's kernels loaded. All work goes to one stream, so the order of
/// launches is the program order (no cross-stream synchronisation to get wrong).
pub struct GpuDevice {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub arch: String,
    /// Launch the ops kernels with programmatic dependent launch (launch.rs).
    pub pdl: bool,
    /// Lends the buffers of a recorded step (buf.rs).
    pub workspace: Workspace,
    /// Streaming multiprocessors: how many CTAs run at once, for launch-size choices.
    pub sms: usize,
    /// Shared memory a block may opt in to, in bytes: which kernels can run here.
    pub smem_per_block: usize,
    /// Uploads copied beside the main stream's queued work (staging.rs).
    pub staging: super::staging::Staging,
    /// Weights uploaded in chunks through page-locked buffers (upload_ring.rs).
    pub uploads: super::upload_ring::UploadRing,
    funcs: HashMap<&'static str, CudaFunction>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .finish()
    }
}

impl GpuDevice {
    /// Opens CUDA device `ordinal` (relative to CUDA_VISIBLE_DEVICES, as the driver counts),
    /// compiles the kernels for its architecture (once per process) and loads them.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let count = probe::driver()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice {
                ordinal,
                visible: count,
                cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES")
                    .unwrap_or_else(|_| "<unset>".into()),
            });
        }
        let drv = |what: &str| {
            let what = what.to_string();
            move |source| CudaError::Driver {
                ordinal,
                what,
                source,
            }
        };
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the context"))?;
        // All work goes to one stream, so cudarc's per-buffer read/write events (two
        // cuEventCreate per allocation, records per launch) order nothing and only cost:
        // they were a large share of the host time of a decode step.
        // SAFETY: no buffer is ever used on a second stream of this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let arch = arch_for(major, minor);
        let ptx = compile_ptx(&arch)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(drv("loading the kernel module"))?;
        let mut funcs = HashMap::new();
        for &name in source::KERNELS {
            let f = module
                .load_function(name)
                .map_err(drv(&format!("loading kernel {name}")))?;
            funcs.insert(name, f);
        }
        let smem_per_block = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(drv("reading the opt-in shared memory per block"))?
            .max(0) as usize;
        for (name, bytes) in super::ops::paged_tiles::smem_attributes() {
            // A kernel that needs more than the device has is never launched there
            // (`DecodeBuild::runs`); the attribute would be refused.
            if bytes > smem_per_block {
                continue;
            }
            if let Some(f) = funcs.get(name) {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(drv(&format!("allowing {name} {bytes} bytes of shared memory")))?;
            }
        }
        // A stream of its own rather than the legacy default stream, whose implicit
        // synchronisation with other streams PDL gains nothing from.
        let stream = ctx.new_stream().map_err(drv("creating the stream"))?;
        let pdl = super::launch::pdl_enabled(&ctx).map_err(|msg| CudaError::Launch {
            kernel: "programmatic dependent launch",
            msg,
        })?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("reading the multiprocessor count"))?
            .max(1) as usize;
        tracing::info!(ordinal, arch = %arch, pdl, "CUDA device ready");
        Ok(Self {
            ordinal,
            workspace: Workspace::new(ctx.clone()),
            ctx,
            stream,
            arch,
            pdl,
            sms,
            smem_per_block,
            staging: Default::default(),
            uploads: Default::default(),
            funcs,
        })
    }

    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.funcs.get(name).ok_or(CudaError::Launch {
            kernel: name,
            msg: "not in the loaded module".into(),
        })
    }

    /// Gives memory this process holds but does not use back to the driver: the step
    /// workspace's chunks (when nothing is lent) and what the device's default memory pool
    /// keeps from stream-ordered frees. The pool returns memory on its own only at a
    /// synchronisation, and an idle server (released memory, waiting for resume) makes
    /// none. Returns the workspace bytes freed.
    pub fn trim_memory(&self) -> Result<usize, CudaError> {
        let err = |what: &str, source| CudaError::Driver {
            ordinal: self.ordinal,
            what: what.into(),
            source,
        };
        self.synchronize()?;
        let freed = self
            .workspace
            .trim()
            .map_err(|e| err("freeing the step workspace", e))?;
        // SAFETY: the context's own device; trimming keeps memory that is in use.
        unsafe {
            let pool = cudarc::driver::result::device::get_default_mem_pool(self.ctx.cu_device())
                .map_err(|e| err("getting the default memory pool", e))?;
            cudarc::driver::result::mem_pool::trim_to(pool, 0)
                .map_err(|e| err("trimming the default memory pool", e))?;
        }
        Ok(freed)
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|source| CudaError::Driver {
                ordinal: self.ordinal,
                what: "synchronizing the stream".into(),
                source,
            })
    }
}
