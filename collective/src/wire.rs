//! The TCP wire format: every message is one frame, a fixed-size bincode header followed
//! by `len` payload bytes.
//!
//! The header starts with [`MAGIC`] and the protocol [`VERSION`] (fixed-width little-endian
//! integers, so the first 8 bytes have the same layout in every version): anything that is
//! not an arbor peer of this build is recognised before a single payload byte is trusted.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"ARBR";
/// Bumped whenever the header or a message changes shape.
pub const VERSION: u32 = 2;
/// Encoded size of [`Header`] (bincode, fixed-width integers).
pub const HEADER_LEN: usize = 33;
/// Largest payload of a rendezvous message (they are a few hundred bytes).
pub const MAX_CONTROL_LEN: u64 = 1 << 20;
/// Largest payload of a data frame; a corrupt length above it is rejected, not allocated.
pub const MAX_DATA_LEN: u64 = 1 << 36;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// rank r → rank 0: "I am rank r of a world of n; my data port is p".
    Hello = 1,
    /// rank 0 → rank r: the address of every rank and the session id.
    Welcome = 2,
    /// any → any: "I give up, here is why" (payload: UTF-8 reason).
    Abort = 3,
    /// rank j → rank i (0 < i < j): opens the data link between two non-zero ranks.
    MeshHello = 4,
    /// One rank's contribution to an all-gather.
    Gather = 5,
    /// The root's buffer of a broadcast (`aux` = root).
    Broadcast = 6,
    /// A barrier's (empty) token.
    Barrier = 7,
    /// Connector → acceptor: opens the job-token handshake (see `auth`).
    AuthHello = 8,
    /// Acceptor → connector: its nonce and proof.
    AuthChallenge = 9,
    /// Connector → acceptor: its proof.
    AuthProof = 10,
    /// Acceptor → connector: the proof holds; the protocol goes on.
    AuthOk = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Abort,
            4 => Kind::MeshHello,
            5 => Kind::Gather,
            6 => Kind::Broadcast,
            7 => Kind::Barrier,
            8 => Kind::AuthHello,
            9 => Kind::AuthChallenge,
            10 => Kind::AuthProof,
            11 => Kind::AuthOk,
            _ => return None,
        })
    }
}

/// The fixed-size frame header, as it travels.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Header {
    pub magic: [u8; 4],
    pub version: u32,
    pub kind: u8,
    /// The sender's rank.
    pub rank: u32,
    /// Collective operation counter (0 during rendezvous).
    pub seq: u64,
    /// Kind-specific: the root of a broadcast.
    pub aux: u32,
    /// Payload bytes that follow.
    pub len: u64,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub rank: usize,
    pub seq: u64,
    pub aux: u32,
    pub payload: Vec<u8>,
}

/// rank r → rank 0 during rendezvous.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub world_size: u32,
    /// Port of the rank's data listener (its IP is the one rank 0 sees it connect from).
    pub data_port: u16,
    /// Host name, for messages only.
    pub host: String,
}

/// rank 0 → rank r when every rank has arrived.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Welcome {
    /// Identifies this group, so that a stray connection from another run is rejected.
    pub session: u64,
    /// Data address of every rank ("ip:port"); entry 0 is unused (rank 0's links are the
    /// rendezvous connections themselves).
    pub peers: Vec<String>,
}

/// rank j → rank i when opening the data link between two non-zero ranks.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MeshHello {
    pub session: u64,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The connection ended inside a frame (`got` of `want` bytes of the header or payload).
    Truncated {
        got: usize,
        want: u64,
    },
    /// The read timeout expired.
    TimedOut,
    BadMagic([u8; 4]),
    BadVersion(u32),
    /// Header fields that no arbor peer would send.
    Malformed(String),
    Io(io::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => write!(f, "connection closed"),
            ReadError::Truncated { got, want } => {
                write!(f, "connection closed mid-frame ({got} of {want} bytes)")
            }
            ReadError::TimedOut => write!(f, "timed out"),
            ReadError::BadMagic(m) => write!(f, "bad magic {m:02x?}"),
            ReadError::BadVersion(v) => write!(f, "protocol version {v}, expected {VERSION}"),
            ReadError::Malformed(m) => write!(f, "malformed frame: {m}"),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads up to `buf.len()` bytes; returns how many arrived before end of stream.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<usize, ReadError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => return Err(ReadError::TimedOut),
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(got)
}

/// Reads one frame; rejects payloads longer than `max_len` before allocating them.
pub fn read_frame(r: &mut impl Read, max_len: u64) -> Result<Frame, ReadError> {
    let mut head = [0u8; HEADER_LEN];
    let got = read_full(r, &mut head)?;
    if got == 0 {
        return Err(ReadError::Closed);
    }
    // Check the magic as soon as it is there: garbage is named as garbage, not as a
    // truncated frame.
    if got >= 4 && head[..4] != MAGIC {
        return Err(ReadError::BadMagic([head[0], head[1], head[2], head[3]]));
    }
    if got >= 8 {
        let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if version != VERSION {
            return Err(ReadError::BadVersion(version));
        }
    }
    if got < HEADER_LEN {
        let mut m = [0u8; 4];
        m[..got.min(4)].copy_from_slice(&head[..got.min(4)]);
        if got < 4 && head[..got] != MAGIC[..got] {
            return Err(ReadError::BadMagic(m));
        }
        return Err(ReadError::Truncated {
            got,
            want: HEADER_LEN as u64,
        });
    }
    let h: Header = bincode::deserialize(&head)
        .map_err(|e| ReadError::Malformed(format!("undecodable header: {e}")))?;
    let kind = Kind::from_u8(h.kind)
        .ok_or_else(|| ReadError::Malformed(format!("unknown frame kind {}", h.kind)))?;
    if h.len > max_len {
        return Err(ReadError::Malformed(format!(
            "{kind:?} frame announces {} payload bytes, more than the limit {max_len}",
            h.len
        )));
    }
    // Grow the buffer as bytes arrive, so a lying length cannot make us allocate it upfront.
    let mut payload = Vec::with_capacity(h.len.min(64 << 20) as usize);
    let n = match r.take(h.len).read_to_end(&mut payload) {
        Ok(n) => n,
        Err(e) if is_timeout(&e) => return Err(ReadError::TimedOut),
        Err(e) => return Err(ReadError::Io(e)),
    };
    if (n as u64) < h.len {
        return Err(ReadError::Truncated {
            got: n,
            want: h.len,
        });
    }
    Ok(Frame {
        kind,
        rank: h.rank as usize,
        seq: h.seq,
        aux: h.aux,
        payload,
    })
}

/// Encodes a header for `kind` from `rank`.
pub fn encode_header(kind: Kind, rank: usize, seq: u64, aux: u32, len: usize) -> Vec<u8> {
    let h = Header {
        magic: MAGIC,
        version: VERSION,
        kind: kind as u8,
        rank: rank as u32,
        seq,
        aux,
        len: len as u64,
    };
    // Serialising a struct of plain integers into a Vec cannot fail.
    bincode::serialize(&h).unwrap_or_default()
}

/// Writes one frame.
pub fn write_frame(
    w: &mut impl Write,
    kind: Kind,
    rank: usize,
    seq: u64,
    aux: u32,
    payload: &[u8],
) -> io::Result<()> {
    let mut head = encode_header(kind, rank, seq, aux, payload.len());
    // Small frames go out in one write: one segment on a TCP_NODELAY socket, not two.
    if payload.len() <= 64 << 10 {
        head.extend_from_slice(payload);
        w.write_all(&head)?;
    } else {
        w.write_all(&head)?;
        w.write_all(payload)?;
    }
    w.flush()
}

/// Writes a rendezvous message (bincode payload).
pub fn write_msg<T: Serialize>(
    w: &mut impl Write,
    kind: Kind,
    rank: usize,
    msg: &T,
) -> io::Result<()> {
    let payload = bincode::serialize(msg).map_err(|e| io::Error::other(e.to_string()))?;
    write_frame(w, kind, rank, 0, 0, &payload)
}

/// Decodes a rendezvous message's payload.
pub fn decode_msg<T: for<'de> Deserialize<'de>>(frame: &Frame) -> Result<T, String> {
    bincode::deserialize(&frame.payload)
        .map_err(|e| format!("undecodable {:?} message: {e}", frame.kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_has_fixed_size_and_magic_first() {
        let h = encode_header(Kind::Gather, 3, 7, 0, 12);
        assert_eq!(h.len(), HEADER_LEN);
        assert_eq!(&h[..4], &MAGIC);
        assert_eq!(u32::from_le_bytes([h[4], h[5], h[6], h[7]]), VERSION);
    }

    #[test]
    fn frame_round_trips() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Broadcast, 5, 9, 2, b"hello").unwrap();
        let f = read_frame(&mut buf.as_slice(), MAX_DATA_LEN).unwrap();
        assert_eq!(
            f,
            Frame {
                kind: Kind::Broadcast,
                rank: 5,
                seq: 9,
                aux: 2,
                payload: b"hello".to_vec()
            }
        );
    }

    #[test]
    fn garbage_wrong_version_and_truncation_are_named() {
        let garbage = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789";
        assert!(matches!(
            read_frame(&mut garbage.as_slice(), MAX_CONTROL_LEN),
            Err(ReadError::BadMagic(m)) if &m == b"GET "
        ));
        // Fewer than 4 bytes, already not the magic.
        assert!(matches!(
            read_frame(&mut b"xy".as_slice(), MAX_CONTROL_LEN),
            Err(ReadError::BadMagic(_))
        ));
        let mut v = encode_header(Kind::Hello, 1, 0, 0, 0);
        v[4..8].copy_from_slice(&99u32.to_le_bytes());
        assert!(matches!(
            read_frame(&mut v.as_slice(), MAX_CONTROL_LEN),
            Err(ReadError::BadVersion(99))
        ));
        let mut full = Vec::new();
        write_frame(&mut full, Kind::Gather, 1, 1, 0, &[1, 2, 3, 4]).unwrap();
        assert!(matches!(
            read_frame(&mut &full[..full.len() - 1], MAX_DATA_LEN),
            Err(ReadError::Truncated { got: 3, want: 4 })
        ));
        assert!(matches!(
            read_frame(&mut &full[..10], MAX_DATA_LEN),
            Err(ReadError::Truncated { got: 10, .. })
        ));
        assert!(matches!(
            read_frame(&mut &full[..0], MAX_DATA_LEN),
            Err(ReadError::Closed)
        ));
        let big = encode_header(Kind::Hello, 1, 0, 0, 1 << 30);
        assert!(matches!(
            read_frame(&mut big.as_slice(), MAX_CONTROL_LEN),
            Err(ReadError::Malformed(_))
        ));
        let mut bad_kind = encode_header(Kind::Hello, 1, 0, 0, 0);
        bad_kind[8] = 200;
        assert!(matches!(
            read_frame(&mut bad_kind.as_slice(), MAX_CONTROL_LEN),
            Err(ReadError::Malformed(_))
        ));
    }
}
