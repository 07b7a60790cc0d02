//! Mixture-of-experts routing on the device (`kernels/cuda/moe.cu`): the rows' experts
//! from the router's logits, the (token, expert) pairs laid out by expert with the grouped
//! GEMM's tile tables, and the weighted sum of each token's expert outputs. Nothing comes
//! back to the host, so a step with these layers can be recorded.

use super::{check, dev_ptr, elementwise_cfg, i32_of, DevF32, DevU32};
use crate::cuda::gemm::{GroupedPath, MoeTiles};
use crate::cuda::{CudaError, GpuDevice};

/// The most experts one router may have, and the most a token may choose (the route
/// kernel's per-lane bitmask and its shared memory: `MOE_ROUTE_WARPS` and `MOE_TOP_K_MAX`
/// in moe.cu).
pub const MOE_EXPERTS_MAX: usize = 512;
pub const MOE_TOP_K_MAX: usize = 64;
const ROUTE_WARPS: usize = 4;

/// One step's routes and the pairs' layout, in one u32 buffer: per pair (row-major
/// `[rows, k]`) its expert, its rank among the expert's pairs, and its place in the
/// expert-major layout; per place the row it came from; per expert its count and first
/// place; the tile tables (`max_tiles` each) and the tile count. The weights are f32.
pub struct MoeRoute {
    pub rows: usize,
    pub k: usize,
    pub experts: usize,
    pub path: GroupedPath,
    pub max_tiles: usize,
    ints: DevU32,
    /// `[rows, k]`: each pair's routing weight, in expert order within a row.
    pub weights: DevF32,
}

/// Offsets (in u32s) of the parts of [`MoeRoute`]'s buffer.
struct Layout {
    ids: usize,
    rank: usize,
    pair_pos: usize,
    sorted_row: usize,
    counts: usize,
    offsets: usize,
    tile_expert: usize,
    tile_row0: usize,
    tile_end: usize,
    n_tiles: usize,
    len: usize,
}

impl Layout {
    fn new(pairs: usize, experts: usize, max_tiles: usize) -> Self {
        // Every part starts 16-byte aligned.
        let a = |n: usize| n.div_ceil(4) * 4;
        let ids = 0;
        let rank = ids + a(pairs);
        let pair_pos = rank + a(pairs);
        let sorted_row = pair_pos + a(pairs);
        let counts = sorted_row + a(pairs);
        let offsets = counts + a(experts);
        let tile_expert = offsets + a(experts);
        let tile_row0 = tile_expert + a(max_tiles);
        let tile_end = tile_row0 + a(max_tiles);
        let n_tiles = tile_end + a(max_tiles);
        Layout {
            ids,
            rank,
            pair_pos,
            sorted_row,
            counts,
            offsets,
            tile_expert,
            tile_row0,
            tile_end,
            n_tiles,
            len: n_tiles + 4,
        }
    }
}

impl MoeRoute {
    pub fn pairs(&self) -> usize {
        self.rows * self.k
    }

    fn layout(&self) -> Layout {
        Layout::new(self.pairs(), self.experts, self.max_tiles)
    }

    fn at(&self, stream: &cudarc::driver::CudaStream, offset: usize) -> u64 {
        dev_ptr(&self.ints, stream) + 4 * offset as u64
    }

    /// The tile tables for the grouped GEMM over experts `w_table`; `gather`: whether
    /// output row r reads the X row of its token (the gate/up projection) or X row r
    /// (the down projection, whose X is the gate/up output in the same layout).
    pub fn tiles(
        &self,
        stream: &cudarc::driver::CudaStream,
        gather: bool,
        w_table: u64,
    ) -> MoeTiles {
        let l = self.layout();
        MoeTiles {
            tile_expert: self.at(stream, l.tile_expert),
            tile_row0: self.at(stream, l.tile_row0),
            tile_end: self.at(stream, l.tile_end),
            n_tiles: self.at(stream, l.n_tiles),
            gather: if gather {
                self.at(stream, l.sorted_row)
            } else {
                0
            },
            w_table,
        }
    }

    /// Each row's experts, `[rows, k]` in expert order (for a response that reports them).
    pub fn experts_of_rows(&self, dev: &GpuDevice) -> Result<Vec<u32>, CudaError> {
        let l = self.layout();
        dev.download_range("routed experts", &self.ints, l.ids..l.ids + self.pairs())
    }
}

/// The routing kernel (`moe.cu`), the name its errors carry.
const ROUTE: &str = "moe_route_kernel";

/// What `moe_route_kernel` takes: `[rows, experts]` logits, at most [`MOE_EXPERTS_MAX`]
/// experts and `1 ≤ k ≤ min(experts, MOE_TOP_K_MAX)`.
fn check_route(logits: &DevF32, rows: usize, experts: usize, k: usize) -> Result<(), CudaError> {
    check(ROUTE, logits.len() == rows * experts, || {
        format!(
            "router logits of {} values for [{rows}, {experts}]",
            logits.len()
        )
    })?;
    check(
        ROUTE,
        (1..=MOE_EXPERTS_MAX).contains(&experts) && (1..=experts.min(MOE_TOP_K_MAX)).contains(&k),
        || {
            format!("top-{k} of {experts} experts (at most {MOE_EXPERTS_MAX} experts and {MOE_TOP_K_MAX} per token, 1 ≤ k ≤ experts)")
        },
    )
}

impl GpuDevice {
    /// Routes the rows of `logits` (`[rows, experts]` f32): each row's `k` most probable
    /// experts (renormalised if `norm`), and the pairs laid out for `path`'s tiles.
    pub fn moe_route(
        &self,
        logits: &DevF32,
        rows: usize,
        experts: usize,
        k: usize,
        norm: bool,
        path: GroupedPath,
    ) -> Result<MoeRoute, CudaError> {
        check_route(logits, rows, experts, k)?;
        let pairs = rows * k;
        let max_tiles = path.max_tiles(pairs, experts);
        let l = Layout::new(pairs, experts, max_tiles);
        let ints: DevU32 = self.alloc(l.len)?;
        let weights = self.empty_f32(pairs)?;
        let route = MoeRoute {
            rows,
            k,
            experts,
            path,
            max_tiles,
            ints,
            weights,
        };
        if rows == 0 {
            // SAFETY: the buffer holds the tile count at n_tiles.
            unsafe { self.write_raw(route.at(&self.stream, l.n_tiles), &[0u32])? };
            return Ok(route);
        }
        let s = &self.stream;
        let (r32, e32, k32) = (
            i32_of(ROUTE, "rows", rows)?,
            i32_of(ROUTE, "experts", experts)?,
            i32_of(ROUTE, "k", k)?,
        );
        let p32 = i32_of(ROUTE, "pairs", pairs)?;
        let at = |o: usize| route.at(s, o);
        let (ids, rank, pair_pos, sorted_row, counts, offsets) = (
            at(l.ids),
            at(l.rank),
            at(l.pair_pos),
            at(l.sorted_row),
            at(l.counts),
            at(l.offsets),
        );
        let (tile_expert, tile_row0, tile_end, n_tiles) = (
            at(l.tile_expert),
            at(l.tile_row0),
            at(l.tile_end),
            at(l.n_tiles),
        );
        let w = dev_ptr(&route.weights, s);
        // SAFETY: every pointer lies in `route`'s buffers at the offsets of its layout,
        // sized for these rows, k and experts; the logits hold [rows, experts].
        unsafe {
            self.route_kernel(logits, rows, experts, k, norm, ids, w)?;

            const C: &str = "moe_count_kernel";
            let mut b = self.launch(self.func(C)?);
            b.arg(&ids).arg(&r32).arg(&k32).arg(&rank).arg(&counts);
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (experts as u32, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launched(C, b.launch(cfg))?;

            const S: &str = "moe_schedule_kernel";
            let (bm, mt) = (
                i32_of(S, "bm", path.bm())?,
                i32_of(S, "max_tiles", max_tiles)?,
            );
            let mut b = self.launch(self.func(S)?);
            b.arg(&counts).arg(&e32).arg(&bm).arg(&mt).arg(&offsets);
            b.arg(&tile_expert)
                .arg(&tile_row0)
                .arg(&tile_end)
                .arg(&n_tiles);
            self.launched(S, b.launch(elementwise_cfg(1)))?;

            const X: &str = "moe_scatter_kernel";
            let mut b = self.launch(self.func(X)?);
            b.arg(&ids).arg(&rank).arg(&offsets).arg(&p32).arg(&k32);
            b.arg(&sorted_row).arg(&pair_pos);
            self.launched(X, b.launch(elementwise_cfg(pairs)))?;
        }
        Ok(route)
    }

    /// `moe_route_kernel` alone: each row's `k` experts (i32, expert order) at `ids` and
    /// their weights (f32) at `w`, both `[rows, k]`, in memory another library owns
    /// (`arbor.torch`'s tensors). The same kernel and launch as [`GpuDevice::moe_route`], so
    /// the same bits; no pair layout is made.
    ///
    /// # Safety
    /// `ids` and `w` address `rows·k` i32 and f32 values on this GPU, used by no other work
    /// until the kernel has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn moe_route_raw(
        &self,
        logits: &DevF32,
        rows: usize,
        experts: usize,
        k: usize,
        norm: bool,
        ids: u64,
        w: u64,
    ) -> Result<(), CudaError> {
        check_route(logits, rows, experts, k)?;
        if rows == 0 {
            return Ok(());
        }
        self.route_kernel(logits, rows, experts, k, norm, ids, w)
    }

    /// Launches `moe_route_kernel` over `rows` rows (at least one).
    ///
    /// # Safety
    /// As [`GpuDevice::moe_route_raw`]; `experts` and `k` within the kernel's limits.
    #[allow(clippy::too_many_arguments)]
    unsafe fn route_kernel(
        &self,
        logits: &DevF32,
        rows: usize,
        experts: usize,
        k: usize,
        norm: bool,
        ids: u64,
        w: u64,
    ) -> Result<(), CudaError> {
        let (r32, e32, k32) = (
            i32_of(ROUTE, "rows", rows)?,
            i32_of(ROUTE, "experts", experts)?,
            i32_of(ROUTE, "k", k)?,
        );
        let norm = i32::from(norm);
        let mut b = self.launch(self.func(ROUTE)?);
        b.arg(logits).arg(&r32).arg(&e32).arg(&k32).arg(&norm);
        b.arg(&ids).arg(&w);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows.div_ceil(ROUTE_WARPS) as u32, 1, 1),
            block_dim: (32 * ROUTE_WARPS as u32, 1, 1),
            shared_mem_bytes: (ROUTE_WARPS * (experts + MOE_TOP_K_MAX) * 4) as u32,
        };
        self.launched(ROUTE, b.launch(cfg))
    }

    /// Each row's output: its experts' rows of `y` (`[pairs, cols]` in the route's
    /// expert-major layout) weighted and added in expert order, `[rows, cols]`.
    pub fn moe_combine(
        &self,
        y: &DevF32,
        route: &MoeRoute,
        cols: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "moe_combine_kernel";
        check(K, y.len() == route.pairs() * cols, || {
            format!(
                "expert outputs of {} values for {} pairs of {cols}",
                y.len(),
                route.pairs()
            )
        })?;
        let mut out = self.empty_f32(route.rows * cols)?;
        if route.rows == 0 || cols == 0 {
            return Ok(out);
        }
        let l = route.layout();
        let pair_pos = route.at(&self.stream, l.pair_pos);
        let (rows, k32, c32) = (
            route.rows as i64,
            i32_of(K, "k", route.k)?,
            i32_of(K, "cols", cols)?,
        );
        let mut b = self.launch(self.func(K)?);
        b.arg(y)
            .arg(&pair_pos)
            .arg(&route.weights)
            .arg(&rows)
            .arg(&k32)
            .arg(&c32);
        b.out(&mut out);
        // SAFETY: y holds the route's pairs × cols, pair_pos its pairs, out rows × cols.
        self.launched(K, unsafe { b.launch(elementwise_cfg(route.rows * cols)) })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_parts_are_aligned_and_disjoint() {
        let l = Layout::new(13, 5, 7);
        let starts = [
            l.ids,
            l.rank,
            l.pair_pos,
            l.sorted_row,
            l.counts,
            l.offsets,
            l.tile_expert,
            l.tile_row0,
            l.tile_end,
            l.n_tiles,
        ];
        let sizes = [13, 13, 13, 13, 5, 5, 7, 7, 7, 1];
        for (i, (&s, &n)) in starts.iter().zip(&sizes).enumerate() {
            assert!(s.is_multiple_of(4), "part {i} at {s}");
            let end = starts.get(i + 1).copied().unwrap_or(l.len);
            assert!(s + n <= end, "part {i} [{s}, {}) overlaps {end}", s + n);
        }
    }
}
