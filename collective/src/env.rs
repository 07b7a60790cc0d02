//! Rank discovery: who am I, how many are we, where is the rendezvous.
//!
//! Launchers announce a process's rank in their own variables. The first family that is
//! present wins, in this order:
//!
//! | launcher            | rank                 | world size           | local rank                   | local world size              |
//! |---------------------|----------------------|----------------------|------------------------------|-------------------------------|
//! | arbor-launch, torchrun | `RANK`            | `WORLD_SIZE`         | `LOCAL_RANK`                 | `LOCAL_WORLD_SIZE`            |
//! | OpenMPI             | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | MPICH / Hydra (PMI) | `PMI_RANK`           | `PMI_SIZE`           | `MPI_LOCALRANKID`            | `MPI_LOCALNRANKS`             |
//! | Slurm (`srun`)      | `SLURM_PROCID`       | `SLURM_NTASKS`       | `SLURM_LOCALID`              | from `SLURM_STEP_TASKS_PER_NODE` / `SLURM_TASKS_PER_NODE` and `SLURM_NODEID` |
//!
//! None set: a single rank. The rendezvous address is always `MASTER_ADDR`/`MASTER_PORT`
//! (under mpirun: `mpirun -x MASTER_ADDR=host -x MASTER_PORT=29500 …`). When every rank
//! is on one host they default to 127.0.0.1:29500.

use std::time::Duration;

use crate::CommError;

/// Port of the rendezvous when `MASTER_PORT` is unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Default time for every rank to arrive at the rendezvous.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);
/// Default time for one collective operation after setup.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(300);

/// Where this process sits in the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this host (selects the GPU).
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    pub master_port: u16,
    /// Which variables the values came from (for logs): "torchrun", "openmpi", "pmi",
    /// "slurm" or "default".
    pub source: &'static str,
}

/// The variable names of one launcher family.
#[derive(Debug, PartialEq, Eq)]
struct Family {
    name: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const FAMILIES: [Family; 4] = [
    Family {
        name: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
    },
    Family {
        name: "openmpi",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    Family {
        name: "pmi",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_size: "MPI_LOCALNRANKS",
    },
    Family {
        name: "slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: "",
    },
];

fn config(msg: String) -> CommError {
    CommError::Config(msg)
}

fn parse_usize(var: &str, v: &str) -> Result<usize, CommError> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| config(format!("{var}={v:?} is not a non-negative integer")))
}

/// Where this process sits among the ranks, without the rendezvous address: what the GPU
/// choice needs (see [`crate::device_map`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    family: &'static Family,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
}

impl Position {
    /// Reads the launcher's variables; `None` when none are set (a single rank).
    pub fn from_env() -> Result<Option<Position>, CommError> {
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        Self::from_lookup(&get)
    }

    /// The variable the local rank came from (for messages).
    pub fn local_rank_var(&self) -> &'static str {
        self.family.local_rank
    }

    /// `get` returns `None` for unset and for blank variables.
    fn from_lookup(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Position>, CommError> {
        let Some(fam) = FAMILIES
            .iter()
            .find(|f| get(f.rank).is_some() || get(f.size).is_some())
        else {
            return Ok(None);
        };
        let need = |var: &str| -> Result<usize, CommError> {
            let v = get(var).ok_or_else(|| {
                config(format!(
                    "{} is set but {var} is not ({} launcher variables must come together)",
                    if var == fam.rank { fam.size } else { fam.rank },
                    fam.name
                ))
            })?;
            parse_usize(var, &v)
        };
        let rank = need(fam.rank)?;
        let world_size = need(fam.size)?;
        if world_size == 0 {
            return Err(config(format!(
                "{}=0: a group needs at least one rank",
                fam.size
            )));
        }
        if rank >= world_size {
            return Err(config(format!(
                "{}={rank} is not below {}={world_size}",
                fam.rank, fam.size
            )));
        }
        let local_rank = match get(fam.local_rank) {
            Some(v) => parse_usize(fam.local_rank, &v)?,
            None if world_size == 1 => 0,
            None => rank,
        };
        let local_world_size = if fam.name == "slurm" {
            slurm_local_size(get, world_size)?
        } else {
            match get(fam.local_size) {
                Some(v) => parse_usize(fam.local_size, &v)?,
                None => world_size,
            }
        };
        if local_world_size == 0 || local_world_size > world_size {
            return Err(config(format!(
                "local world size {local_world_size} (from {} variables) must be between 1 and the world size {world_size}",
                fam.name
            )));
        }
        if local_rank >= local_world_size {
            return Err(config(format!(
                "local rank {local_rank} ({}) is not below the local world size {local_world_size}",
                fam.local_rank
            )));
        }
        Ok(Some(Position {
            family: fam,
            rank,
            world_size,
            local_rank,
            local_world_size,
        }))
    }
}

impl RankInfo {
    /// Reads the process environment (see the module docs).
    pub fn from_env() -> Result<RankInfo, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`RankInfo::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<RankInfo, CommError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let Some(Position {
            family,
            rank,
            world_size,
            local_rank,
            local_world_size,
        }) = Position::from_lookup(&get)?
        else {
            return Ok(RankInfo {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                master_port: DEFAULT_MASTER_PORT,
                source: "default",
            });
        };
        let fam = family;
        let all_local = local_world_size == world_size;
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a.trim().to_string(),
            None if all_local || world_size == 1 => "127.0.0.1".to_string(),
            None => {
                return Err(config(format!(
                    "MASTER_ADDR is not set and the {world_size} ranks span several hosts \
                     ({local_world_size} on this one): set MASTER_ADDR to rank 0's host"
                )))
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| config(format!("MASTER_PORT={p:?} is not a port (1-65535)")))?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(RankInfo {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source: fam.name,
        })
    }
}

/// Slurm gives tasks per node as a compressed list ("2(x3),1"); this node's entry is the
/// local world size.
fn slurm_local_size(
    get: &impl Fn(&str) -> Option<String>,
    world_size: usize,
) -> Result<usize, CommError> {
    let Some((var, list)) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .iter()
        .find_map(|v| get(v).map(|l| (*v, l)))
    else {
        return match get("SLURM_NNODES").as_deref().map(str::trim) {
            None | Some("1") => Ok(world_size),
            Some(n) => Err(config(format!(
                "SLURM_NNODES={n} but neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set"
            ))),
        };
    };
    let node = match get("SLURM_NODEID") {
        Some(v) => parse_usize("SLURM_NODEID", &v)?,
        None => 0,
    };
    let mut per_node = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        let bad = || config(format!("{var}={list:?}: cannot read {item:?}"));
        let (count, repeat) = match item.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (item, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        if per_node.len() + repeat > 1 << 16 {
            return Err(bad());
        }
        per_node.resize(per_node.len() + repeat, count);
    }
    per_node.get(node).copied().ok_or_else(|| {
        config(format!(
            "SLURM_NODEID={node} but {var}={list:?} lists {} node(s)",
            per_node.len()
        ))
    })
}

/// How long the collective layer waits before it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// For all ranks to arrive at the rendezvous and open their links
    /// (`ARBOR_TIMEOUT_SECS`, default 60 s).
    pub rendezvous: Duration,
    /// For one collective operation (`ARBOR_OP_TIMEOUT_SECS`, default 300 s).
    pub op: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            rendezvous: DEFAULT_RENDEZVOUS_TIMEOUT,
            op: DEFAULT_OP_TIMEOUT,
        }
    }
}

impl Timeouts {
    /// Reads `ARBOR_TIMEOUT_SECS` and `ARBOR_OP_TIMEOUT_SECS` (seconds, fractions allowed).
    pub fn from_env() -> Result<Timeouts, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Timeouts, CommError> {
        let read = |var: &str, default: Duration| -> Result<Duration, CommError> {
            match get(var) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| {
                        config(format!("{var}={v:?} is not a positive number of seconds"))
                    }),
            }
        };
        Ok(Timeouts {
            rendezvous: read("ARBOR_TIMEOUT_SECS", DEFAULT_RENDEZVOUS_TIMEOUT)?,
            op: read("ARBOR_OP_TIMEOUT_SECS", DEFAULT_OP_TIMEOUT)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn info(vars: &[(&str, &str)]) -> Result<RankInfo, CommError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankInfo::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn nothing_set_is_a_single_rank() {
        let i = info(&[]).unwrap();
        assert_eq!(
            (i.rank, i.world_size, i.local_rank, i.local_world_size),
            (0, 1, 0, 1)
        );
        assert_eq!(i.source, "default");
    }

    #[test]
    fn torchrun_variables() {
        let i = info(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            i,
            RankInfo {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "10.0.0.1".into(),
                master_port: 1234,
                source: "torchrun"
            }
        );
    }

    #[test]
    fn torchrun_wins_over_slurm_and_mpi_families_are_read() {
        let i = info(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ])
        .unwrap();
        assert_eq!((i.rank, i.source), (1, "torchrun"));
        assert_eq!((i.local_rank, i.local_world_size), (1, 2));
        assert_eq!(
            (i.master_addr.as_str(), i.master_port),
            ("127.0.0.1", DEFAULT_MASTER_PORT)
        );

        let i = info(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ])
        .unwrap();
        assert_eq!(
            (i.rank, i.world_size, i.local_rank, i.source),
            (3, 4, 3, "openmpi")
        );

        let i = info(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "h0"),
        ])
        .unwrap();
        assert_eq!(
            (i.rank, i.local_rank, i.local_world_size, i.source),
            (2, 0, 2, "pmi")
        );
    }

    /// The GPU choice reads only the positions: a group spanning hosts without
    /// MASTER_ADDR (fine under mpirun, whose transport needs none) still gets them, with
    /// the name of the local-rank variable for messages.
    #[test]
    fn positions_need_no_rendezvous_address() {
        let vars: HashMap<String, String> = [
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let get = |k: &str| vars.get(k).cloned();
        assert!(
            RankInfo::from_lookup(get).is_err(),
            "MASTER_ADDR is needed there"
        );
        let p = Position::from_lookup(&get).unwrap().unwrap();
        assert_eq!(
            (p.rank, p.world_size, p.local_rank, p.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(p.local_rank_var(), "OMPI_COMM_WORLD_LOCAL_RANK");
        assert_eq!(Position::from_lookup(&|_: &str| None).unwrap(), None);
    }

    #[test]
    fn slurm_tasks_per_node_list() {
        let i = info(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!(
            (i.rank, i.world_size, i.local_world_size, i.source),
            (6, 7, 1, "slurm")
        );
        let e = info(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_TASKS_PER_NODE"), "{e}");
    }

    #[test]
    fn inconsistent_values_are_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("RANK", "4"), ("WORLD_SIZE", "4")],
                "RANK=4 is not below WORLD_SIZE=4",
            ),
            (&[("RANK", "0")], "WORLD_SIZE is not"),
            (&[("WORLD_SIZE", "2")], "RANK is not"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "local rank 2",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "local world size 3",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "MASTER_ADDR is not set",
            ),
            (
                &[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")],
                "MASTER_PORT=\"99999\"",
            ),
        ];
        for (vars, want) in cases {
            let e = info(vars).unwrap_err().to_string();
            assert!(e.contains(want), "{vars:?}: {e}");
        }
    }

    #[test]
    fn timeouts_from_variables() {
        let t = Timeouts::from_lookup(|k| (k == "ARBOR_TIMEOUT_SECS").then(|| "0.5".to_string()))
            .unwrap();
        assert_eq!(t.rendezvous, Duration::from_millis(500));
        assert_eq!(t.op, DEFAULT_OP_TIMEOUT);
        let e = Timeouts::from_lookup(|k| (k == "ARBOR_OP_TIMEOUT_SECS").then(|| "-1".to_string()))
            .unwrap_err();
        assert!(
            e.to_string().contains("ARBOR_OP_TIMEOUT_SECS=\"-1\""),
            "{e}"
        );
    }
}
