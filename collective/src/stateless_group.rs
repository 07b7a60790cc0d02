//! One member of a vLLM `StatelessProcessGroup` (`vllm/distributed/utils.py`), over its
//! `TCPStore`: what arbor's ranks do in a group where the trainer is the last rank and
//! arbor's rank 0 is the group's rank 0 (TRL's vLLM client).
//!
//! vLLM's conventions, followed here key for key:
//! - `broadcast_obj(obj, src)`: `src` sets `broadcast_from/{src}/{n}` to the pickled
//!   object, `n` counting its broadcasts from 0; every other member reads its `n`th.
//!   `PyNcclCommunicator` makes its NCCL id at rank 0 and broadcasts it first (n = 0).
//! - `barrier()`: rank 0 broadcasts a fresh `barrier_{uuid}` id; every member sets
//!   `arrival_{id}_{rank}`, waits for every member's arrival, sets `departure_{id}_{rank}`;
//!   rank 0 then waits for every departure and deletes the keys.

use std::time::{Duration, Instant};

use crate::pickled_id::{str_from_pickle, str_to_pickle};
use crate::tcp_store::{stateless_broadcast_key, StoreClient, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the StatelessProcessGroup's {what}: {msg}")]
    Protocol { what: String, msg: String },
}

/// This process's membership: its store connection and vLLM's broadcast counters.
#[derive(Debug)]
pub struct StatelessMember {
    store: StoreClient,
    rank: usize,
    world: usize,
    /// Broadcasts this member made.
    sent: u64,
    /// Broadcasts read from each member.
    received: Vec<u64>,
}

impl StatelessMember {
    pub fn new(store: StoreClient, rank: usize, world: usize) -> Self {
        StatelessMember {
            store,
            rank,
            world,
            sent: 0,
            received: vec![0; world],
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn store_addr(&self) -> &str {
        self.store.addr()
    }

    /// `broadcast_obj(obj, src=self.rank)` of an already pickled object.
    pub fn broadcast_send(&mut self, pickled: &[u8]) -> Result<(), GroupError> {
        let key = stateless_broadcast_key(self.rank, self.sent);
        self.store.set(&key, pickled)?;
        self.sent += 1;
        Ok(())
    }

    /// `broadcast_obj(None, src)`: the pickled object `src` broadcast next.
    pub fn broadcast_recv(&mut self, src: usize, timeout: Duration) -> Result<Vec<u8>, GroupError> {
        let n = self
            .received
            .get(src)
            .copied()
            .ok_or_else(|| GroupError::Protocol {
                what: "broadcast".into(),
                msg: format!("no member {src} in a group of {}", self.world),
            })?;
        let v = self.store.get(&stateless_broadcast_key(src, n), timeout)?;
        self.received[src] += 1;
        Ok(v)
    }

    /// Counts a broadcast from `src` read through another connection (the NCCL id, which
    /// a rank waits for on a thread of its own).
    pub fn count_received(&mut self, src: usize) {
        if let Some(n) = self.received.get_mut(src) {
            *n += 1;
        }
    }

    /// vLLM's `StatelessProcessGroup.barrier`, each phase bounded by `timeout`.
    pub fn barrier(&mut self, timeout: Duration) -> Result<(), GroupError> {
        let id = if self.rank == 0 {
            let id = format!("barrier_{}", fresh_uuid());
            self.broadcast_send(&str_to_pickle(&id))?;
            id
        } else {
            let v = self.broadcast_recv(0, timeout)?;
            str_from_pickle(&v).map_err(|msg| GroupError::Protocol {
                what: "barrier id from rank 0".into(),
                msg,
            })?
        };
        let arrival = |r: usize| format!("arrival_{id}_{r}");
        let departure = |r: usize| format!("departure_{id}_{r}");
        self.store.set(&arrival(self.rank), b"1")?;
        self.wait_all(&arrival, timeout)?;
        self.store.set(&departure(self.rank), b"1")?;
        if self.rank != 0 {
            return Ok(());
        }
        // Rank 0 runs the store: it leaves last, so no member loses it mid-barrier.
        self.wait_all(&departure, timeout)?;
        for r in 0..self.world {
            self.store.delete(&arrival(r))?;
            self.store.delete(&departure(r))?;
        }
        Ok(())
    }

    fn wait_all(
        &mut self,
        key: &dyn Fn(usize) -> String,
        timeout: Duration,
    ) -> Result<(), GroupError> {
        let t0 = Instant::now();
        let keys: Vec<String> = (0..self.world).map(key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let left = timeout.saturating_sub(t0.elapsed());
        self.store.wait(&refs, left).map_err(GroupError::from)
    }
}

/// A version-4 UUID's text from the clock and the process (barrier ids need only be
/// unique among this group's barriers).
fn fresh_uuid() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ (u64::from(std::process::id()) << 32) ^ N.fetch_add(1, Ordering::Relaxed);
    let mut next = || {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let (a, b) = (next(), next());
    let a = (a & !0xF000) | 0x4000;
    let b = (b & !(0b11 << 62)) | (0b10 << 62);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xFFFF,
        a & 0xFFFF,
        b >> 48,
        b & 0xFFFF_FFFF_FFFF
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store_server::StoreServer;

    #[test]
    fn members_broadcast_and_pass_barriers() {
        let s = StoreServer::bind("127.0.0.1", 0).unwrap();
        let port = s.local_addr().port();
        let t = Duration::from_secs(10);
        let world = 3;
        let members: Vec<_> = (0..world)
            .map(|r| {
                std::thread::spawn(move || {
                    let c = StoreClient::connect("127.0.0.1", port, t).unwrap();
                    let mut m = StatelessMember::new(c, r, world);
                    if r == 0 {
                        m.broadcast_send(b"id").unwrap();
                    } else {
                        assert_eq!(m.broadcast_recv(0, t).unwrap(), b"id");
                    }
                    for _ in 0..3 {
                        m.barrier(t).unwrap();
                    }
                    m
                })
            })
            .collect();
        let ms: Vec<_> = members.into_iter().map(|h| h.join().unwrap()).collect();
        // One id and three barrier ids broadcast by rank 0; the barrier keys deleted.
        assert_eq!(ms[0].sent, 4);
        assert_eq!(ms[1].received[0], 4);
        assert_eq!(s.len(), 4, "the broadcasts stay, as vLLM's do");
        let u = fresh_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
    }
}
