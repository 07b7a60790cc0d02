//! The deterministic all-reduce of the invariance contract: all-gather the ranks' f32
//! subtree roots, then every rank finishes the same fixed pairwise tree.

use arbor_kernels::tree::{combine_roots, is_valid_world};

use crate::{CommError, Communicator};

/// Sums `partial` (this rank's subtree root over its segments, one value per element)
/// across the group with the fixed tree `((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7))` (cut to the
/// world size). Every rank gets the same bits, equal to the single-process tree over the
/// same 8 segments. Needs a world size of 1, 2, 4 or 8 and equal lengths on all ranks.
pub fn tree_all_reduce(comm: &dyn Communicator, partial: &[f32]) -> Result<Vec<f32>, CommError> {
    let world = comm.world_size();
    if !is_valid_world(world) {
        return Err(CommError::UnsupportedWorld {
            rank: comm.rank(),
            op: "tree all-reduce".into(),
            world,
        });
    }
    if world == 1 {
        return Ok(partial.to_vec());
    }
    let gathered = comm.all_gather_f32(partial)?;
    if partial.is_empty() {
        return Ok(Vec::new());
    }
    let roots: Vec<&[f32]> = gathered.chunks_exact(partial.len()).collect();
    if roots.len() != world || gathered.len() != world * partial.len() {
        return Err(CommError::Other(format!(
            "rank {}: tree all-reduce: the {} transport returned {} values for {world} ranks of {}",
            comm.rank(),
            comm.transport(),
            gathered.len(),
            partial.len()
        )));
    }
    let mut out = vec![0.0f32; partial.len()];
    combine_roots(&roots, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::InProcGroup;
    use arbor_kernels::tree::{tree_sum, SegmentLayout, SEGMENTS};
    use std::thread;

    /// Segment sums where the association order changes the f32 result.
    fn segment_sums(n: usize) -> Vec<[f32; SEGMENTS]> {
        (0..n)
            .map(|j| {
                let b = j as f32;
                [1e8 + b, 1.0, -1e8, 1.0 + b, 3.5e-3, 7.0, -2.0e7 - b, 2.0e7]
            })
            .collect()
    }

    fn run_world(world: usize, sums: &[[f32; SEGMENTS]]) -> Vec<Vec<f32>> {
        let handles: Vec<_> = InProcGroup::new(world)
            .into_iter()
            .map(|comm| {
                let sums = sums.to_vec();
                thread::spawn(move || {
                    let segs = SegmentLayout::segments_of(comm.rank(), world);
                    let partial: Vec<f32> =
                        sums.iter().map(|s| tree_sum(&s[segs.clone()])).collect();
                    tree_all_reduce(&comm, &partial).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn bit_equal_to_the_single_process_tree_for_every_world() {
        let sums = segment_sums(37);
        let reference: Vec<u32> = sums.iter().map(|s| tree_sum(s).to_bits()).collect();
        for world in [1usize, 2, 4, 8] {
            for (rank, out) in run_world(world, &sums).into_iter().enumerate() {
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits, reference, "world {world} rank {rank}");
            }
        }
        // The data is order-sensitive: a left-to-right sum differs, so the test can fail.
        let sequential: Vec<u32> = sums
            .iter()
            .map(|s| s.iter().fold(0.0f32, |a, &b| a + b).to_bits())
            .collect();
        assert_ne!(sequential, reference);
        // So does combining the roots in another rank order (a+b == b+a in IEEE, so
        // the permutation must change the association: r0,r2,r1,r3 does).
        let swapped: Vec<u32> = sums
            .iter()
            .map(|s| {
                let roots = [
                    tree_sum(&s[0..2]),
                    tree_sum(&s[4..6]),
                    tree_sum(&s[2..4]),
                    tree_sum(&s[6..8]),
                ];
                tree_sum(&roots).to_bits()
            })
            .collect();
        assert_ne!(swapped, reference);
    }

    #[test]
    fn unsupported_world_is_a_clear_error() {
        let handles: Vec<_> = InProcGroup::new(3)
            .into_iter()
            .map(|c| thread::spawn(move || tree_all_reduce(&c, &[1.0]).unwrap_err().to_string()))
            .collect();
        for h in handles {
            let msg = h.join().unwrap();
            assert!(msg.contains("1, 2, 4 or 8, got 3"), "{msg}");
        }
    }

    #[test]
    fn empty_input_is_fine() {
        let out = run_world(2, &[]);
        assert!(out.iter().all(Vec::is_empty));
    }
}
