//! Which algorithm `Algo::Auto` runs, by message size and world size.
//!
//! All algorithms give the same bits, so the choice is only about speed, but it must be
//! the same on every rank: it depends on nothing but (bytes, world, whether IPC buffers
//! are registered on all ranks, layout), which all ranks agree on.

use super::Algo;

/// Size thresholds, in bytes of the message (one rank's buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// One-shot up to this size (inclusive), per world size 2, 4, 8.
    pub oneshot_max: [usize; 3],
}

impl Default for Thresholds {
    /// From `arbor bench allreduce` on H200s (docs/allreduce.md); 8 ranks untested, set
    /// like 4 scaled by the W-fold read traffic of one-shot.
    fn default() -> Self {
        Self {
            oneshot_max: [2 << 20, 512 << 10, 256 << 10],
        }
    }
}

impl Thresholds {
    fn oneshot_max_for(&self, world: usize) -> usize {
        match world {
            0..=2 => self.oneshot_max[0],
            3..=4 => self.oneshot_max[1],
            _ => self.oneshot_max[2],
        }
    }
}

/// What the IPC kernels can take for this call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    /// IPC buffers are registered on every rank.
    pub ipc: bool,
    /// Pointers 16-byte aligned and the element count a whole number of 16-byte packs.
    pub packed: bool,
    /// The message fits one staging half.
    pub fits: bool,
}

pub fn select(bytes: usize, world: usize, fit: Fit, t: &Thresholds) -> Algo {
    if world == 1 {
        return Algo::AllGatherTree;
    }
    if !(fit.ipc && fit.packed && fit.fits) {
        return Algo::AllGatherTree;
    }
    if bytes <= t.oneshot_max_for(world) {
        Algo::OneShot
    } else {
        Algo::TwoShot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: Fit = Fit {
        ipc: true,
        packed: true,
        fits: true,
    };

    #[test]
    fn small_is_oneshot_large_is_twoshot() {
        let t = Thresholds::default();
        assert_eq!(select(8 << 10, 2, OK, &t), Algo::OneShot);
        assert_eq!(select(2 << 20, 2, OK, &t), Algo::OneShot);
        assert_eq!(select((2 << 20) + 16, 2, OK, &t), Algo::TwoShot);
        assert_eq!(select(512 << 10, 4, OK, &t), Algo::OneShot);
        assert_eq!(select(1 << 20, 4, OK, &t), Algo::TwoShot);
        assert_eq!(select(256 << 20, 8, OK, &t), Algo::TwoShot);
    }

    #[test]
    fn falls_back_when_ipc_cannot_take_it() {
        let t = Thresholds::default();
        for fit in [
            Fit { ipc: false, ..OK },
            Fit {
                packed: false,
                ..OK
            },
            Fit { fits: false, ..OK },
        ] {
            assert_eq!(select(8 << 10, 4, fit, &t), Algo::AllGatherTree);
        }
        assert_eq!(select(8 << 10, 1, OK, &t), Algo::AllGatherTree);
    }
}
