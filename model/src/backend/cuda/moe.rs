//! Mixture-of-experts blocks on the device: routes from the router's logits
//! (`ops::moe`), every expert's rows in one grouped GEMM per projection
//! (`gemm::TensorGemm::grouped_matmul`), the experts' partials through the tree
//! all-reduce, and each token's weighted sum, with nothing read back to the host; a
//! decode step is then recorded like a dense one (graphs.rs).
//!
//! `ARBOR_MOE=host` keeps the host routing of `layers::moe` (for comparison); GPUs
//! without the tensor GEMM always use it. The fast numerics route on the device too, with
//! the same grouped kernel for the experts (there is no vendor grouped GEMM behind it):
//! only their dense layers and all-reduce are cuBLAS's and NCCL's.

use std::env::VarError;

use arbor_kernels::cuda::gemm::GroupedPath;
use arbor_kernels::cuda::ops::moe::{MOE_EXPERTS_MAX, MOE_TOP_K_MAX};
use arbor_kernels::cuda::DevBuf;

use super::gemm::tensor_eligible;
use super::{CudaAct, CudaBackend, CudaMat};
use crate::backend::{BResult, Backend, BackendError, MoeSpec, TreeSpec};
use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

/// The environment variable that picks where MoE blocks route.
pub const ENV: &str = "ARBOR_MOE";

/// The environment variable that forces the experts' grouped GEMM path (`split16`,
/// `split64`, `tree128`, `wgtma128`; unset or `auto`: by the pairs per expert). Every
/// path gives the same bits, so this is for speed comparisons only.
pub const GEMM_ENV: &str = "ARBOR_MOE_GEMM";

/// A block's experts for the grouped GEMM: the addresses of every expert's gate/up and
/// down weight, in expert order, on the device.
pub struct CudaExperts {
    gate_up: DevBuf<u64>,
    down: DevBuf<u64>,
    /// The same weights as tensor maps for the wgmma grouped kernel (sm_90a; `None` where
    /// it cannot run them).
    gate_up_maps: Option<DevBuf<u64>>,
    down_maps: Option<DevBuf<u64>>,
    experts: usize,
    /// This rank's intermediate columns per expert.
    inter: usize,
    hidden: usize,
    spec: MoeSpec,
}

/// Whether `ARBOR_MOE` asks for the device routing (unset or `device`) or the host's.
/// The grouped GEMM path `ARBOR_MOE_GEMM` forces, if any.
fn forced_grouped_path() -> BResult<Option<GroupedPath>> {
    match std::env::var(GEMM_ENV) {
        Err(VarError::NotPresent) => Ok(None),
        Ok(v) if v == "auto" => Ok(None),
        Ok(v) => GroupedPath::from_name(&v).map(Some).ok_or_else(|| {
            BackendError::Unsupported(format!(
                "{GEMM_ENV}={v:?}: expected auto, split16, split64, tree128 or wgtma128"
            ))
        }),
        Err(VarError::NotUnicode(v)) => Err(BackendError::Unsupported(format!(
            "{GEMM_ENV}={v:?} is not valid UTF-8"
        ))),
    }
}

fn device_routing() -> BResult<bool> {
    match std::env::var(ENV) {
        Err(VarError::NotPresent) => Ok(true),
        Ok(v) if v == "device" => Ok(true),
        Ok(v) if v == "host" => Ok(false),
        Ok(v) => Err(BackendError::Unsupported(format!(
            "{ENV}={v:?}: expected \"device\" (the default) or \"host\""
        ))),
        Err(VarError::NotUnicode(v)) => Err(BackendError::Unsupported(format!(
            "{ENV}={v:?} is not valid UTF-8"
        ))),
    }
}

impl CudaBackend {
    /// Whether a block whose experts have these trees runs on the device (the routing
    /// kernel, the grouped GEMM, the combine kernel) rather than through the host routing
    /// of `layers::moe`.
    fn routes_on_device(&self, gate_up: TreeSpec, down: TreeSpec) -> BResult<bool> {
        Ok(self.gemm.is_some()
            && device_routing()?
            && tensor_eligible(gate_up)
            && tensor_eligible(down))
    }

    /// Whether this backend runs a TP-1 MoE block of `experts` experts (`hidden` wide,
    /// `inter` intermediate columns each, `top_k` a token) on the device, as
    /// [`Backend::moe_experts`] decides it; `false` too for a block over the device
    /// kernels' limits (the engine refuses to load such a block while routing on the
    /// device).
    pub fn moe_routes_on_device(
        &self,
        hidden: usize,
        inter: usize,
        experts: usize,
        top_k: usize,
    ) -> BResult<bool> {
        let tree = |k: usize| TreeSpec {
            seg_len: SegmentLayout::new(k).seg_len,
            n_seg: SEGMENTS,
            k,
        };
        Ok(self.routes_on_device(tree(hidden), tree(inter))?
            && (1..=MOE_EXPERTS_MAX).contains(&experts)
            && (1..=experts.min(MOE_TOP_K_MAX)).contains(&top_k))
    }

    /// The device routing of the rows of `logits` (`[rows, experts]` f32): each row's
    /// `top_k` experts (i32, in expert order) at `ids` and their weights (f32, renormalised
    /// if `norm`) at `w`, both `[rows, top_k]` — the kernel [`Backend::moe_forward`] routes
    /// with, so its bits.
    ///
    /// # Safety
    /// `ids` and `w` address `rows·top_k` i32 and f32 values on this GPU, used by no other
    /// work until the kernel has run (order their owner's stream after it with
    /// [`CudaBackend::release_to_stream`]).
    pub unsafe fn moe_route_to(
        &self,
        logits: &CudaAct,
        top_k: usize,
        norm: bool,
        ids: u64,
        w: u64,
    ) -> BResult<()> {
        self.timed("moe route (into)", logits.rows, || {
            self.dev
                .moe_route_raw(&logits.buf, logits.rows, logits.cols, top_k, norm, ids, w)
                .map_err(|e| self.dev_err(e))
        })
    }

    pub(super) fn moe_experts_untimed(
        &self,
        gate_up: &[&CudaMat],
        down: &[&CudaMat],
        spec: MoeSpec,
    ) -> BResult<Option<CudaExperts>> {
        if !self.routes_on_device(spec.gate_up, spec.down)? {
            return Ok(None);
        }
        let experts = gate_up.len();
        let (Some(g0), Some(d0)) = (gate_up.first(), down.first()) else {
            return Ok(None);
        };
        if experts != down.len()
            || experts > MOE_EXPERTS_MAX
            || !(1..=experts.min(MOE_TOP_K_MAX)).contains(&spec.top_k)
        {
            return Err(self.shape_err(format!(
                "MoE block of {experts} gate/up and {} down weights, top-{} (at most {MOE_EXPERTS_MAX} experts and {MOE_TOP_K_MAX} per token on the GPU)",
                down.len(),
                spec.top_k
            )));
        }
        let (hidden, inter) = (g0.k, g0.n / 2);
        for (e, (g, d)) in gate_up.iter().zip(down).enumerate() {
            if (g.n, g.k, d.n, d.k) != (g0.n, g0.k, d0.n, d0.k)
                || !g.n.is_multiple_of(2)
                || (d.n, d.k) != (hidden, inter)
            {
                return Err(self.shape_err(format!(
                    "expert {e}: gate/up [{}, {}] and down [{}, {}] do not match expert 0's gate/up [{}, {}] and down [{hidden}, {inter}]",
                    g.n, g.k, d.n, d.k, g0.n, g0.k
                )));
            }
        }
        let ptrs = |ws: &[&CudaMat]| -> Vec<u64> {
            ws.iter()
                .map(|w| arbor_kernels::cuda::ops::dev_ptr(&w.buf, &self.dev.stream))
                .collect()
        };
        let table = |p: &[u64]| -> BResult<DevBuf<u64>> {
            self.dev
                .upload("expert weight table", p)
                .map_err(|e| self.dev_err(e))
        };
        let gemm = self.gemm.as_ref();
        let maps = |p: &[u64], n: usize, k: usize, tree| -> BResult<Option<DevBuf<u64>>> {
            let Some(g) = gemm else { return Ok(None) };
            g.expert_maps(&self.dev, p, n, k, tree)
                .map_err(|e| self.shape_err(format!("expert tensor maps: {e}")))
        };
        let (gp, dp) = (ptrs(gate_up), ptrs(down));
        Ok(Some(CudaExperts {
            gate_up: table(&gp)?,
            down: table(&dp)?,
            gate_up_maps: maps(&gp, 2 * inter, hidden, spec.gate_up)?,
            down_maps: maps(&dp, hidden, inter, spec.down)?,
            experts,
            inter,
            hidden,
            spec,
        }))
    }

    pub(super) fn moe_forward_untimed(
        &self,
        x: &CudaAct,
        logits: &CudaAct,
        ex: &CudaExperts,
        routes: Option<&mut Vec<u32>>,
    ) -> BResult<CudaAct> {
        let (rows, k) = (x.rows, ex.spec.top_k);
        if x.cols != ex.hidden || (logits.rows, logits.cols) != (rows, ex.experts) {
            return Err(self.shape_err(format!(
                "MoE block of {} experts over {} columns given x [{rows}, {}] and router logits [{}, {}]",
                ex.experts, ex.hidden, x.cols, logits.rows, logits.cols
            )));
        }
        let Some(gemm) = self.gemm.as_ref() else {
            return Err(self.shape_err("MoE experts prepared without the tensor GEMM".into()));
        };
        let pairs = rows * k;
        // One route (one tile height) serves both projections, so the wgmma kernel runs
        // only where both have their tensor maps.
        let wg = ex.gate_up_maps.is_some() && ex.down_maps.is_some();
        let path = match forced_grouped_path()? {
            Some(GroupedPath::WgTma128) if !wg => {
                return Err(BackendError::Unsupported(format!(
                    "{GEMM_ENV}=wgtma128: the wgmma grouped kernel is not available for this block (sm_90a and k = n_seg·seg_len in multiples of 8 needed)"
                )))
            }
            Some(p) => p,
            None => GroupedPath::choose(pairs, ex.experts, wg),
        };
        let route = self.timed("moe route", rows, || {
            self.dev
                .moe_route(
                    &logits.buf,
                    rows,
                    ex.experts,
                    k,
                    ex.spec.norm_topk_prob,
                    path,
                )
                .map_err(|e| self.dev_err(e))
        })?;
        // Only a request that reports its routes reads them back: the step then runs op by
        // op (runner::step), never recorded, so the read cannot freeze into a graph.
        if let Some(out) = routes {
            let ids = self.timed("moe routes to host", rows, || {
                route
                    .experts_of_rows(&self.dev)
                    .map_err(|e| self.dev_err(e))
            })?;
            out.extend(ids);
        }
        let grouped_err = |what: &str, e: super::gemm::TensorGemmError| BackendError::Device {
            rank: self.comm.rank(),
            msg: format!("MoE {what} over {pairs} (token, expert) pairs: {e}"),
        };
        let gate_up = self.timed("moe gate/up (grouped)", pairs, || {
            let converted;
            let xb = match &x.bf16 {
                Some(b) => b,
                None => {
                    let mut b = self
                        .dev
                        .empty_bf16(rows * ex.hidden)
                        .map_err(|e| self.dev_err(e))?;
                    self.dev
                        .f32_to_bf16_into(&x.buf, &mut b)
                        .map_err(|e| self.dev_err(e))?;
                    converted = b;
                    &converted
                }
            };
            gemm.grouped_matmul_silu(
                &self.dev,
                xb,
                ex.hidden,
                &route,
                &ex.gate_up,
                ex.gate_up_maps.as_ref(),
                2 * ex.inter,
                ex.spec.gate_up,
            )
            .map_err(|e| grouped_err("gate/up", e))
        })?;
        // silu(gate)·up of every pair, in bf16: all the down projection reads.
        let hb = &gate_up;
        let down = self.timed("moe down (grouped)", pairs, || {
            gemm.grouped_matmul(
                &self.dev,
                hb,
                ex.inter,
                &route,
                false,
                &ex.down,
                ex.down_maps.as_ref(),
                ex.hidden,
                ex.spec.down,
            )
            .map_err(|e| grouped_err("down", e))
        })?;
        let y = self.tree_all_reduce(self.act(down, pairs, ex.hidden))?;
        let out = self.timed("moe combine", rows, || {
            self.dev
                .moe_combine(&y.buf, &route, ex.hidden)
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act(out, rows, ex.hidden))
    }
}
