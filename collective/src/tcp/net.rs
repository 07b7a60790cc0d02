//! Addressing: `host:port` parsing, resolution, and connecting with retries until a
//! deadline.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use crate::CommError;

/// Connects to the first of `addrs` that answers, retrying until `deadline`.
pub(super) fn connect_until(
    rank: usize,
    addrs: &[SocketAddr],
    what: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CommError> {
    let mut last_error = String::from("no address to try");
    loop {
        for a in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = remaining
                .min(Duration::from_secs(2))
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(a, attempt) {
                Ok(s) => return Ok(s),
                Err(e) => last_error = format!("{a}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::MasterUnreachable {
                rank,
                addr: what.to_string(),
                timeout,
                last_error,
            });
        }
        thread::sleep(Duration::from_millis(50));
    }
}

pub(super) fn split_host_port(rank: usize, target: &str) -> Result<(&str, u16), CommError> {
    let bad = || CommError::Config(format!("rank {rank}: {target:?} is not host:port"));
    let (host, port) = target.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((host, port.parse().map_err(|_| bad())?))
}

pub(super) fn resolve(rank: usize, host: &str, port: u16) -> Result<Vec<SocketAddr>, CommError> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            CommError::Config(format!(
                "rank {rank}: MASTER_ADDR {host:?} does not resolve: {e}"
            ))
        })?
        .collect();
    if addrs.is_empty() {
        return Err(CommError::Config(format!(
            "rank {rank}: MASTER_ADDR {host:?} resolves to no address"
        )));
    }
    Ok(addrs)
}
