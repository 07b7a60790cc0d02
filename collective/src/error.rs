//! The collective layer's error type. Every variant names the rank(s) involved so that a
//! failure in a group of 8 processes can be traced to the process that caused it.

use std::time::Duration;

/// Errors of the collective layer; each names the rank(s) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A free-form error (kept for callers outside this crate; prefer a specific variant).
    #[error("{0}")]
    Other(String),

    /// Bad or inconsistent rank/address configuration (environment variables, arguments).
    #[error("collective configuration: {0}")]
    Config(String),

    /// An operating-system I/O error while talking to a peer.
    #[error("rank {rank}: I/O error {context}: {source}")]
    Io {
        rank: usize,
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A peer closed its connection (it exited, crashed or was killed).
    #[error("rank {rank}: peer rank {peer} disconnected {context}")]
    PeerDisconnected {
        rank: usize,
        peer: usize,
        context: String,
    },

    /// Rendezvous did not complete in time; `missing` are the ranks that never arrived.
    #[error(
        "rank {rank}: rendezvous at {addr} timed out after {}s: rank(s) {} never arrived \
         (raise ARBOR_TIMEOUT_SECS if they are just slow to start){refused}",
        timeout.as_secs_f64(),
        fmt_ranks(missing)
    )]
    RendezvousTimeout {
        rank: usize,
        addr: String,
        timeout: Duration,
        missing: Vec<usize>,
        /// Connections turned away meanwhile ("; refused N connection(s), the last from
        /// ADDR: why"), or empty: a rank with the wrong token shows up here.
        refused: String,
    },

    /// Rank 0's rendezvous store could not be reached in time.
    #[error(
        "rank {rank}: could not reach the rendezvous of rank 0 at {addr} within {}s: {last_error} \
         (is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?)",
        timeout.as_secs_f64()
    )]
    MasterUnreachable {
        rank: usize,
        addr: String,
        timeout: Duration,
        last_error: String,
    },

    /// A collective operation did not complete in time; `missing` are the ranks whose data
    /// never came.
    #[error(
        "rank {rank}: {op} timed out after {}s waiting for rank(s) {} \
         (raise ARBOR_OP_TIMEOUT_SECS if they are just slow)",
        timeout.as_secs_f64(),
        fmt_ranks(missing)
    )]
    OpTimeout {
        rank: usize,
        op: String,
        timeout: Duration,
        missing: Vec<usize>,
    },

    /// Bytes from `peer` did not start with arbor's magic: not an arbor process, or garbage.
    #[error(
        "rank {rank}: {peer} sent bytes that are not an arbor frame (they start with \"{}\", not \"{}\"); \
         is something else using this port?",
        .got.escape_ascii(),
        .expected.escape_ascii()
    )]
    BadMagic {
        rank: usize,
        peer: String,
        got: [u8; 4],
        expected: [u8; 4],
    },

    /// A peer speaks another version of the wire protocol (a different arbor build).
    #[error(
        "rank {rank}: {peer} speaks wire protocol version {got}, this build speaks {expected}"
    )]
    VersionMismatch {
        rank: usize,
        peer: String,
        got: u32,
        expected: u32,
    },

    /// A well-formed frame arrived that does not fit the protocol at this point (a peer
    /// calling a different collective, a malformed message, a wrong rank or world size...).
    #[error("rank {rank}: protocol error with {peer}: {detail}")]
    Protocol {
        rank: usize,
        peer: String,
        detail: String,
    },

    /// The peer turned this rank away in the job-token handshake (see `auth`).
    #[error("rank {rank}: {peer} refused this rank: {reason}")]
    Refused {
        rank: usize,
        peer: String,
        reason: String,
    },

    /// The peer failed the job-token handshake on this rank's side.
    #[error("rank {rank}: job token check with {peer} failed: {detail}")]
    Auth {
        rank: usize,
        peer: String,
        detail: String,
    },

    /// Another rank gave up and told the group why.
    #[error("rank {rank}: rank {peer} aborted the group: {reason}")]
    PeerAborted {
        rank: usize,
        peer: usize,
        reason: String,
    },

    /// The operation needs a world size this group does not have.
    #[error("rank {rank}: {op} needs a world size of 1, 2, 4 or 8, got {world}")]
    UnsupportedWorld {
        rank: usize,
        op: String,
        world: usize,
    },

    /// Ranks disagree on the size of an operation's buffer.
    #[error("rank {rank}: {op}: rank {peer} contributed {got} bytes, this rank {expected}")]
    LengthMismatch {
        rank: usize,
        peer: usize,
        op: String,
        got: usize,
        expected: usize,
    },

    /// An argument that is wrong whatever the peers do (bad root, misaligned buffer...).
    #[error("rank {rank}: {detail}")]
    InvalidArgument { rank: usize, detail: String },

    /// The communicator failed earlier; it cannot be used any more.
    #[error("rank {rank}: communicator unusable after an earlier error: {reason}")]
    Poisoned { rank: usize, reason: String },
}

/// "1, 3 and 5" style list for messages.
pub(crate) fn fmt_ranks(ranks: &[usize]) -> String {
    let parts: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match parts.len() {
        0 => "(none)".to_string(),
        1 => parts[0].clone(),
        n => format!("{} and {}", parts[..n - 1].join(", "), parts[n - 1]),
    }
}
