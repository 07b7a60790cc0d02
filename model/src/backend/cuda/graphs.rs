//! Decode steps recorded as CUDA graphs, one per padded batch size (docs/step.md,
//! "The device-resident step").
//!
//! A decode-shaped step (one new row per sequence, every row's logits) of n rows is padded
//! to the bucket b ≥ n ([`bucket`]) with copies of row 0 (step.rs, `Padded`): every
//! kernel is batch invariant, so the real rows' bits are those of the unpadded step.
//! Attention runs every row through the split decode kernel at a grid depth of a power of
//! two of splits that covers the step's longest context (`AttnRouting::split_bucket`), so a
//! recording serves while contexts grow up to it; its input buffer holds the block tables
//! of that many splits for every row. Per (bucket, top-k stride, split bucket) on one KV
//! cache, the first step runs eagerly with the device's
//! allocations lent by its workspace (buf.rs), which grows every scratch buffer to what
//! this shape needs; the second is captured into a graph that reads its inputs from a
//! buffer of its own and writes its results into another; every later one is one upload,
//! one graph launch and one download. The graph holds kernel nodes only: no allocation
//! and no host work inside a step, except where ranks share a GPU: there each all-gather
//! is a copy to pinned host memory, a host function that exchanges it over TCP and a copy
//! back (`arbor_collective::gpu::staged`), which a graph holds as memcpy and host nodes.
//!
//! A step whose first run reads activations back to the host (a mixture-of-experts layer
//! whose routing runs there) is never captured: the host's decisions depend on the data,
//! and a replay would repeat the first step's. Its shape runs op by op (same bits).
//!
//! `ARBOR_CUDA_GRAPHS=0` runs every step eagerly (same bits: for measuring what the graphs
//! buy); `ARBOR_PROFILE=1` does too, since it synchronises around every op.

use std::collections::HashMap;
use std::sync::Arc;

use arbor_kernels::cuda::DevU32;
use cudarc::driver::CudaGraph;

pub const ENV: &str = "ARBOR_CUDA_GRAPHS";

/// Largest batch a decode step is recorded at; larger steps run eagerly.
pub const MAX_BUCKET: usize = 256;

/// The batch size a decode step of `rows` rows is padded to: 1, 2, 4, 8, then steps of 8
/// to 64, of 16 to 128 and of 32 to [`MAX_BUCKET`] (fewer than 8, 16, 32 padding rows:
/// at most a quarter of a step above 32 rows); `None` above.
pub fn bucket(rows: usize) -> Option<usize> {
    let step = match rows {
        0 => return None,
        1..=8 => return Some(rows.next_power_of_two()),
        9..=64 => 8,
        65..=128 => 16,
        129..=MAX_BUCKET => 32,
        _ => return None,
    };
    Some(rows.next_multiple_of(step))
}

/// Whether decode steps are recorded: `ARBOR_CUDA_GRAPHS` unset, `1` or `on` (the
/// default), or `0` / `off`; anything else is an error naming the value.
pub fn enabled(var: Option<&str>) -> Result<bool, String> {
    match var.map(str::trim) {
        None | Some("1") | Some("on") => Ok(true),
        Some("0") | Some("off") => Ok(false),
        Some(other) => Err(format!(
            "{ENV}={other:?}: expected 1 / on (record decode steps, the default) or 0 / off"
        )),
    }
}

/// One recorded shape: the padded batch, the top-k stride and the attention's split
/// bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub rows: usize,
    pub stride: usize,
    pub splits: usize,
    /// The recording keeps its logits buffer, for rows asked for whole after a replay
    /// (top-k candidates that do not settle the draw, constrained rows).
    pub keeps_logits: bool,
}

impl Key {
    /// Block-table words a step of this shape can need: every row's table up to its
    /// split bucket's positions (one sequence per row; padding rows share row 0's).
    pub fn table_capacity(&self) -> usize {
        self.rows * self.splits * arbor_kernels::paged::ATTN_SPLIT_BLOCKS
    }
}

pub enum State {
    /// Not run yet: the next step of this shape runs eagerly in the workspace.
    New,
    /// Run once: the next step of this shape is captured.
    Warm,
    /// `limits`: the (positions, blocks) bounds its ops were checked against at capture; a
    /// step whose rows reach beyond them runs eagerly (and is checked there).
    Recorded {
        graph: CudaGraph,
        limits: (usize, usize),
    },
    /// The capture failed (logged once): this shape runs eagerly.
    Failed,
    /// Its first run read activations back to the host between kernels (a
    /// mixture-of-experts layer routing its rows there): a graph would replay that
    /// step's host decisions on other data, so this shape runs eagerly.
    HostBound,
}

/// A shape's device buffers (kept for its life: the graph reads and writes them) and
/// where its recording stands.
pub struct Entry {
    pub inputs: Arc<DevU32>,
    pub outputs: DevU32,
    /// The logits its recording writes (lent by the workspace and kept) when its rows
    /// select candidates: the rows a top-p step brings to the host after its stats come
    /// from here. Shapes without candidates never ask for rows and keep none.
    pub logits: Option<super::CudaAct>,
    pub state: State,
}

/// The recorded steps of one backend, all on the KV cache `cache`.
pub struct Graphs {
    pub enabled: bool,
    cache: u64,
    entries: HashMap<Key, Entry>,
    /// Steps replayed and shapes recorded, for the log.
    pub replays: u64,
    pub recorded: u64,
}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            cache: 0,
            entries: HashMap::new(),
            replays: 0,
            recorded: 0,
        }
    }

    /// The entry of `key` on KV cache `cache`, made by `make` if missing. A step on
    /// another cache than the last drops every recording: they write the old cache's
    /// memory (cache keys are never reused, so a dropped cache's graphs never run again).
    pub fn entry(
        &mut self,
        cache: u64,
        key: Key,
        make: impl FnOnce() -> Result<Entry, String>,
    ) -> Result<&mut Entry, String> {
        if cache != self.cache {
            self.entries.clear();
            self.cache = cache;
        }
        match self.entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => Ok(v.insert(make()?)),
        }
    }

    /// Drops every recording.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_batch_with_little_padding() {
        assert_eq!(bucket(0), None);
        let want = [
            (1, 1),
            (2, 2),
            (3, 4),
            (5, 8),
            (8, 8),
            (9, 16),
            (17, 24),
            (64, 64),
        ];
        for (rows, b) in want {
            assert_eq!(bucket(rows), Some(b), "rows {rows}");
        }
        assert_eq!(bucket(65), Some(80));
        assert_eq!(bucket(129), Some(160));
        assert_eq!(bucket(MAX_BUCKET), Some(MAX_BUCKET));
        assert_eq!(bucket(MAX_BUCKET + 1), None);
        let mut shapes = std::collections::BTreeSet::new();
        for rows in 1..=MAX_BUCKET {
            let b = bucket(rows).unwrap();
            assert!(b >= rows && bucket(b) == Some(b), "rows {rows} -> {b}");
            if rows > 32 {
                assert!((b - rows) * 4 <= b, "rows {rows} -> {b}: too much padding");
            }
            shapes.insert(b);
        }
        assert!(shapes.len() <= 24, "{} shapes to record", shapes.len());
    }

    #[test]
    fn the_switch_is_on_by_default_and_bad_values_are_named() {
        assert_eq!(enabled(None), Ok(true));
        assert_eq!(enabled(Some("1")), Ok(true));
        assert_eq!(enabled(Some("on")), Ok(true));
        assert_eq!(enabled(Some("0")), Ok(false));
        assert_eq!(enabled(Some(" off ")), Ok(false));
        let e = enabled(Some("yes")).unwrap_err();
        assert!(e.contains("ARBOR_CUDA_GRAPHS=\"yes\""), "{e}");
    }
}
