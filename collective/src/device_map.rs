//! Which GPU a rank uses, and how many ranks share it.
//!
//! One rank per GPU is the rule: the rank with local rank r (`LOCAL_RANK`, or the MPI /
//! Slurm equivalent, see [`crate::env`]) takes device r, counted as the driver counts, i.e.
//! within `CUDA_VISIBLE_DEVICES`. More local ranks than visible devices is an error.
//!
//! Ranks share a GPU only when asked: `arbor-launch --ranks-per-gpu N` (or `auto`) sets
//! [`RANKS_PER_GPU_ENV`] for every rank (set it by hand under mpirun or Slurm). Then local
//! rank r takes device r / N, with `auto` meaning N = ceil(local ranks / visible devices)
//! (one rank per GPU whenever there are enough GPUs). This is a checking mode: the GPU
//! collectives of a group whose ranks share a device are staged through the host
//! (`gpu::staged`), so a developer with one GPU runs TP 2, 4 and 8 with the real kernels.
//!
//! Everything here is a pure function of its inputs (the CUDA device count comes from the
//! caller), so the CPU tests cover every case.

use crate::env::Position;
use crate::CommError;

/// The variable `arbor-launch --ranks-per-gpu` sets for every rank.
pub const RANKS_PER_GPU_ENV: &str = "ARBOR_RANKS_PER_GPU";

/// How many local ranks may use one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RanksPerGpu {
    /// Not asked for (`ARBOR_RANKS_PER_GPU` unset): one rank per GPU, more ranks than GPUs
    /// is an error.
    Exclusive,
    /// N ranks per GPU (1: one each, as `Exclusive`).
    Fixed(usize),
    /// As many per GPU as it takes to place every local rank on the visible GPUs.
    Auto,
}

impl RanksPerGpu {
    /// Parses the value of [`RANKS_PER_GPU_ENV`] (`None` or blank: not set).
    pub fn parse(value: Option<&str>) -> Result<RanksPerGpu, String> {
        let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(RanksPerGpu::Exclusive);
        };
        if v.eq_ignore_ascii_case("auto") {
            return Ok(RanksPerGpu::Auto);
        }
        match v.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(RanksPerGpu::Fixed(n)),
            _ => Err(format!(
                "{RANKS_PER_GPU_ENV}={v:?}: expected a number of ranks per GPU (1 or more) or \
                 \"auto\""
            )),
        }
    }

    pub fn from_env() -> Result<RanksPerGpu, String> {
        Self::parse(std::env::var(RANKS_PER_GPU_ENV).ok().as_deref())
    }

    /// Whether the user allowed ranks to share a GPU.
    pub fn allows_sharing(self) -> bool {
        match self {
            RanksPerGpu::Exclusive | RanksPerGpu::Fixed(1) => false,
            RanksPerGpu::Fixed(_) | RanksPerGpu::Auto => true,
        }
    }
}

/// What the device choice depends on.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub local_rank: usize,
    pub local_world_size: usize,
    /// The variable the local rank came from, for messages ("LOCAL_RANK").
    pub local_rank_var: &'a str,
    pub ranks_per_gpu: RanksPerGpu,
    /// CUDA devices the driver reports (within CUDA_VISIBLE_DEVICES).
    pub visible: usize,
    /// The value of CUDA_VISIBLE_DEVICES, for messages.
    pub cuda_visible_devices: Option<&'a str>,
}

/// This rank's GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlot {
    /// Device ordinal as the driver counts (within CUDA_VISIBLE_DEVICES).
    pub ordinal: usize,
    /// Local ranks per GPU in effect (1 unless sharing was asked for and needed).
    pub ranks_per_gpu: usize,
    /// Ranks of this host on this rank's GPU, this one included: the share of the
    /// device's memory a rank may plan for is 1 / `ranks_on_device`.
    pub ranks_on_device: usize,
}

impl DeviceSlot {
    /// Whether another rank of this host uses the same GPU.
    pub fn shared(&self) -> bool {
        self.ranks_on_device > 1
    }
}

fn devices(n: usize) -> String {
    if n == 1 {
        "1 CUDA device is visible".into()
    } else {
        format!("{n} CUDA devices are visible")
    }
}

/// The GPU of the rank described by `i`, or an error that says what is wrong and which
/// flag allows ranks to share a GPU.
pub fn map_device(i: &Inputs<'_>) -> Result<DeviceSlot, String> {
    let cvd = i.cuda_visible_devices.unwrap_or("<unset>");
    if i.visible == 0 {
        return Err(format!(
            "no CUDA device is visible (CUDA_VISIBLE_DEVICES={cvd})"
        ));
    }
    let local_world = i.local_world_size.max(i.local_rank + 1);
    let per_gpu = match i.ranks_per_gpu {
        RanksPerGpu::Exclusive => 1,
        RanksPerGpu::Fixed(n) => n.max(1),
        RanksPerGpu::Auto => local_world.div_ceil(i.visible).max(1),
    };
    let ordinal = i.local_rank / per_gpu;
    if ordinal >= i.visible {
        let enough = local_world.div_ceil(i.visible);
        let gpus_needed = local_world.div_ceil(per_gpu);
        let at = if per_gpu == 1 {
            "at one rank per GPU".to_string()
        } else {
            format!("at {per_gpu} per GPU ({RANKS_PER_GPU_ENV}={per_gpu})")
        };
        let how = format!(
            "To let ranks share a GPU (a correctness check: the collectives then go through \
             the host, slowly), start them with `arbor-launch --ranks-per-gpu {enough}` (or \
             `--ranks-per-gpu auto`), or set {RANKS_PER_GPU_ENV}={enough} (or auto) for every \
             rank under mpirun or Slurm"
        );
        return Err(format!(
            "{}={} needs CUDA device {ordinal}, but {} (CUDA_VISIBLE_DEVICES={cvd}): the \
             {local_world} ranks on this host need {gpus_needed} GPUs {at}. {how}.",
            i.local_rank_var,
            i.local_rank,
            devices(i.visible),
        ));
    }
    let ranks_on_device = per_gpu.min(local_world - ordinal * per_gpu);
    Ok(DeviceSlot {
        ordinal,
        ranks_per_gpu: per_gpu,
        ranks_on_device,
    })
}

/// This process's GPU, from the launcher's variables, [`RANKS_PER_GPU_ENV`] and
/// CUDA_VISIBLE_DEVICES, given the number of devices the driver reports. A process started
/// without launcher variables is local rank 0 of 1.
pub fn from_env(visible: usize) -> Result<DeviceSlot, CommError> {
    let pos = Position::from_env()?;
    let ranks_per_gpu = RanksPerGpu::from_env().map_err(CommError::Config)?;
    let cvd = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let (local_rank, local_world_size, var) = match &pos {
        Some(p) => (p.local_rank, p.local_world_size, p.local_rank_var()),
        None => (0, 1, "LOCAL_RANK"),
    };
    map_device(&Inputs {
        local_rank,
        local_world_size,
        local_rank_var: var,
        ranks_per_gpu,
        visible,
        cuda_visible_devices: cvd.as_deref(),
    })
    .map_err(CommError::Config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(
        local_rank: usize,
        local_world_size: usize,
        rpg: RanksPerGpu,
        visible: usize,
    ) -> Inputs<'static> {
        Inputs {
            local_rank,
            local_world_size,
            local_rank_var: "LOCAL_RANK",
            ranks_per_gpu: rpg,
            visible,
            cuda_visible_devices: None,
        }
    }

    #[test]
    fn the_flag_value_parses_and_bad_values_are_named() {
        assert_eq!(RanksPerGpu::parse(None), Ok(RanksPerGpu::Exclusive));
        assert_eq!(RanksPerGpu::parse(Some("  ")), Ok(RanksPerGpu::Exclusive));
        assert_eq!(RanksPerGpu::parse(Some("4")), Ok(RanksPerGpu::Fixed(4)));
        assert_eq!(RanksPerGpu::parse(Some(" auto ")), Ok(RanksPerGpu::Auto));
        assert_eq!(RanksPerGpu::parse(Some("AUTO")), Ok(RanksPerGpu::Auto));
        for bad in ["0", "-1", "two", "1.5"] {
            let e = RanksPerGpu::parse(Some(bad)).unwrap_err();
            assert!(e.contains(RANKS_PER_GPU_ENV) && e.contains(bad), "{e}");
        }
        assert!(!RanksPerGpu::Exclusive.allows_sharing());
        assert!(!RanksPerGpu::Fixed(1).allows_sharing());
        assert!(RanksPerGpu::Fixed(2).allows_sharing());
        assert!(RanksPerGpu::Auto.allows_sharing());
    }

    #[test]
    fn one_rank_per_gpu_by_default() {
        for r in 0..8 {
            let s = map_device(&inputs(r, 8, RanksPerGpu::Exclusive, 8)).unwrap();
            assert_eq!(
                s,
                DeviceSlot {
                    ordinal: r,
                    ranks_per_gpu: 1,
                    ranks_on_device: 1
                }
            );
            assert!(!s.shared());
        }
    }

    #[test]
    fn more_ranks_than_gpus_without_the_flag_is_an_error_that_names_the_fix() {
        let mut i = inputs(1, 2, RanksPerGpu::Exclusive, 1);
        i.cuda_visible_devices = Some("3");
        let e = map_device(&i).unwrap_err();
        for want in [
            "LOCAL_RANK=1",
            "CUDA device 1",
            "1 CUDA device is visible",
            "CUDA_VISIBLE_DEVICES=3",
            "2 ranks on this host need 2 GPUs at one rank per GPU",
            "--ranks-per-gpu 2",
            "ARBOR_RANKS_PER_GPU=2",
        ] {
            assert!(e.contains(want), "missing {want:?} in: {e}");
        }
        // Rank 0 of the same group fits: only the ranks beyond the devices fail.
        assert_eq!(
            map_device(&inputs(0, 2, RanksPerGpu::Exclusive, 1))
                .unwrap()
                .ordinal,
            0
        );
        let e = map_device(&inputs(5, 8, RanksPerGpu::Exclusive, 2)).unwrap_err();
        assert!(
            e.contains("2 CUDA devices are visible (CUDA_VISIBLE_DEVICES=<unset>)")
                && e.contains("--ranks-per-gpu 4"),
            "{e}"
        );
        // The local-rank variable of the launcher family is named.
        let mut i = inputs(3, 4, RanksPerGpu::Exclusive, 1);
        i.local_rank_var = "OMPI_COMM_WORLD_LOCAL_RANK";
        assert!(map_device(&i)
            .unwrap_err()
            .starts_with("OMPI_COMM_WORLD_LOCAL_RANK=3 needs CUDA device 3"));
    }

    #[test]
    fn ranks_per_gpu_packs_consecutive_local_ranks() {
        // 8 ranks, 2 per GPU, 4 GPUs: 0,1 -> 0; 2,3 -> 1; ...
        let got: Vec<usize> = (0..8)
            .map(|r| {
                map_device(&inputs(r, 8, RanksPerGpu::Fixed(2), 4))
                    .unwrap()
                    .ordinal
            })
            .collect();
        assert_eq!(got, [0, 0, 1, 1, 2, 2, 3, 3]);
        // All 8 on one GPU.
        for r in 0..8 {
            let s = map_device(&inputs(r, 8, RanksPerGpu::Fixed(8), 1)).unwrap();
            assert_eq!((s.ordinal, s.ranks_on_device, s.ranks_per_gpu), (0, 8, 8));
            assert!(s.shared());
        }
        // 3 ranks at 2 per GPU: the last GPU has one rank.
        let s = map_device(&inputs(2, 3, RanksPerGpu::Fixed(2), 2)).unwrap();
        assert_eq!((s.ordinal, s.ranks_on_device), (1, 1));
        assert!(!s.shared());
        // Too few GPUs even at N per GPU: an error naming the count that fits.
        let e = map_device(&inputs(7, 8, RanksPerGpu::Fixed(2), 2)).unwrap_err();
        assert!(
            e.contains("needs CUDA device 3")
                && e.contains("need 4 GPUs at 2 per GPU (ARBOR_RANKS_PER_GPU=2)")
                && e.contains("--ranks-per-gpu 4"),
            "{e}"
        );
        // Asking for sharing where there are enough GPUs still packs N per GPU.
        let s = map_device(&inputs(1, 2, RanksPerGpu::Fixed(2), 8)).unwrap();
        assert_eq!((s.ordinal, s.ranks_on_device), (0, 2));
    }

    #[test]
    fn auto_shares_only_as_much_as_needed() {
        // One GPU: everyone on it.
        for tp in [1usize, 2, 4, 8] {
            for r in 0..tp {
                let s = map_device(&inputs(r, tp, RanksPerGpu::Auto, 1)).unwrap();
                assert_eq!((s.ordinal, s.ranks_on_device), (0, tp), "tp {tp} rank {r}");
            }
        }
        // Enough GPUs: one each, exactly as without the flag (scripts run unchanged there).
        for r in 0..8 {
            let s = map_device(&inputs(r, 8, RanksPerGpu::Auto, 8)).unwrap();
            assert_eq!(
                s,
                map_device(&inputs(r, 8, RanksPerGpu::Exclusive, 8)).unwrap()
            );
        }
        // 8 ranks on 3 GPUs: 3 per GPU, the last one holds 2.
        let got: Vec<(usize, usize)> = (0..8)
            .map(|r| {
                let s = map_device(&inputs(r, 8, RanksPerGpu::Auto, 3)).unwrap();
                (s.ordinal, s.ranks_on_device)
            })
            .collect();
        assert_eq!(
            got,
            [
                (0, 3),
                (0, 3),
                (0, 3),
                (1, 3),
                (1, 3),
                (1, 3),
                (2, 2),
                (2, 2)
            ]
        );
    }

    #[test]
    fn no_device_is_its_own_error() {
        let e = map_device(&inputs(0, 1, RanksPerGpu::Auto, 0)).unwrap_err();
        assert!(e.contains("no CUDA device is visible"), "{e}");
    }
}
