//! Property tests of the wire format: anything a stranger can send to a listener is read
//! by `wire::read_frame` and `wire::decode_msg`. Whatever the bytes, they must return (no
//! panic, no hang on a finite input), and a lying length field must be refused before it
//! is allocated: a counting allocator records the largest single allocation.
//!
//! Case counts are fixed so that the suite takes a few seconds in CI.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use arbor_collective::auth::{AuthChallenge, AuthHello, AuthProof};
use arbor_collective::wire::{
    self, Frame, Hello, Kind, MeshHello, ReadError, Welcome, HEADER_LEN, MAX_CONTROL_LEN,
    MAX_DATA_LEN,
};
use proptest::prelude::*;

struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // try_with: the allocator also runs while a thread's locals are torn down.
    let _ = LARGEST.try_with(|l| {
        if size > l.get() {
            l.set(size)
        }
    });
}

// SAFETY: every call is passed straight to the system allocator; only a size is recorded.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`; returns its result and the largest single allocation it made on this thread.
fn largest_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let r = f();
    (r, LARGEST.with(Cell::get))
}

/// What `read_frame` may allocate up front for a payload it has not seen (it grows the
/// buffer as bytes arrive beyond that).
const UPFRONT_CAP: usize = 64 << 20;

fn read(bytes: &[u8], max: u64) -> (Result<Frame, ReadError>, usize) {
    largest_during(|| wire::read_frame(&mut &bytes[..], max))
}

const KINDS: [Kind; 11] = [
    Kind::Hello,
    Kind::Welcome,
    Kind::Abort,
    Kind::MeshHello,
    Kind::Gather,
    Kind::Broadcast,
    Kind::Barrier,
    Kind::AuthHello,
    Kind::AuthChallenge,
    Kind::AuthProof,
    Kind::AuthOk,
];

/// A frame as a peer would send it.
fn valid_frame() -> impl Strategy<Value = (Kind, usize, u64, u32, Vec<u8>)> {
    (
        0..KINDS.len(),
        0usize..9,
        any::<u64>(),
        any::<u32>(),
        prop::collection::vec(any::<u8>(), 0..96),
    )
        .prop_map(|(k, r, s, a, p)| (KINDS[k], r, s, a, p))
}

/// Edits that turn a valid byte string into a near miss.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    /// Overwrite 8 bytes (e.g. the length field at offset 25) with a value.
    Word(usize, u64),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, x)| Edit::Flip(i, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Remove),
        any::<usize>().prop_map(Edit::Truncate),
        (
            prop_oneof![Just(25usize), any::<usize>()],
            prop_oneof![
                Just(u64::MAX),
                Just(1u64 << 40),
                Just(1u64 << 35),
                any::<u64>()
            ]
        )
            .prop_map(|(i, v)| Edit::Word(i, v)),
    ];
    prop::collection::vec(edit, 1..4)
}

fn apply(bytes: &mut Vec<u8>, edits: &[Edit]) {
    for e in edits {
        let n = bytes.len();
        match *e {
            Edit::Flip(i, x) if n > 0 => bytes[i % n] ^= x,
            Edit::Insert(i, b) => bytes.insert(i % (n + 1), b),
            Edit::Remove(i) if n > 0 => {
                bytes.remove(i % n);
            }
            Edit::Truncate(i) => bytes.truncate(i % (n + 1)),
            Edit::Word(i, v) if n >= 8 => {
                let at = i % (n - 7);
                bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
}

/// Every message type a listener decodes, fed `frame`'s payload.
fn decode_all(frame: &Frame) {
    let _ = wire::decode_msg::<Hello>(frame);
    let _ = wire::decode_msg::<Welcome>(frame);
    let _ = wire::decode_msg::<MeshHello>(frame);
    let _ = wire::decode_msg::<AuthHello>(frame);
    let _ = wire::decode_msg::<AuthChallenge>(frame);
    let _ = wire::decode_msg::<AuthProof>(frame);
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(3000))]

    #[test]
    fn random_bytes_are_read_or_refused(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
        for max in [MAX_CONTROL_LEN, MAX_DATA_LEN] {
            let (r, largest) = read(&bytes, max);
            prop_assert!(largest <= bytes.len().max(1024), "allocated {largest}");
            if let Ok(f) = r {
                prop_assert!(HEADER_LEN + f.payload.len() <= bytes.len());
                decode_all(&f);
            }
        }
    }

    #[test]
    fn mutated_frames_are_read_or_refused(
        (kind, rank, seq, aux, payload) in valid_frame(),
        edits in edits(),
    ) {
        let mut bytes = Vec::new();
        wire::write_frame(&mut bytes, kind, rank, seq, aux, &payload).unwrap();
        let clean = wire::read_frame(&mut &bytes[..], MAX_CONTROL_LEN).unwrap();
        prop_assert_eq!(
            clean,
            Frame { kind, rank, seq, aux, payload: payload.clone() }
        );
        apply(&mut bytes, &edits);
        for max in [MAX_CONTROL_LEN, MAX_DATA_LEN] {
            let (r, largest) = read(&bytes, max);
            prop_assert!(largest <= UPFRONT_CAP.min(max as usize) + 4096, "allocated {largest}");
            if let Ok(f) = r {
                prop_assert!(HEADER_LEN + f.payload.len() <= bytes.len());
                let (_, largest) = largest_during(|| decode_all(&f));
                prop_assert!(largest <= (2 << 20), "decoding allocated {largest}");
            }
        }
    }

    #[test]
    fn a_lying_length_is_refused_before_it_is_allocated(
        kind in 0..KINDS.len(),
        len in prop_oneof![Just(1u64 << 40), Just(u64::MAX), MAX_DATA_LEN + 1.., any::<u64>()],
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = wire::encode_header(KINDS[kind], 1, 0, 0, 0);
        bytes[HEADER_LEN - 8..].copy_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&tail);
        for max in [MAX_CONTROL_LEN, MAX_DATA_LEN] {
            let (r, largest) = read(&bytes, max);
            if len > max {
                prop_assert!(matches!(r, Err(ReadError::Malformed(_))), "{r:?}");
                prop_assert!(largest <= 4096, "len {len}: allocated {largest}");
            } else {
                prop_assert!(largest <= UPFRONT_CAP.min(len as usize) + 4096, "allocated {largest}");
                if len as usize > tail.len() {
                    let truncated = matches!(r, Err(ReadError::Truncated { .. }));
                    prop_assert!(truncated, "{r:?}");
                }
            }
        }
    }

    #[test]
    fn mutated_messages_decode_or_fail_without_big_allocations(
        peers in prop::collection::vec("[0-9.:]{0,21}", 0..9),
        edits in edits(),
    ) {
        let welcome = Welcome { session: 7, peers };
        let mut payload = Vec::new();
        wire::write_msg(&mut payload, Kind::Welcome, 0, &welcome).unwrap();
        let mut frame = wire::read_frame(&mut &payload[..], MAX_CONTROL_LEN).unwrap();
        prop_assert_eq!(wire::decode_msg::<Welcome>(&frame).unwrap(), welcome);
        apply(&mut frame.payload, &edits);
        let (_, largest) = largest_during(|| decode_all(&frame));
        prop_assert!(largest <= (2 << 20), "decoding allocated {largest}");
    }
}

#[test]
fn a_header_claiming_two_to_the_forty_bytes_allocates_nothing_big() {
    let mut bytes = wire::encode_header(Kind::Gather, 1, 0, 0, 0);
    bytes[HEADER_LEN - 8..].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (r, largest) = read(&bytes, MAX_DATA_LEN);
    assert!(
        matches!(&r, Err(ReadError::Malformed(m)) if m.contains("1099511627776")),
        "{r:?}"
    );
    assert!(largest <= 4096, "allocated {largest}");
}

#[test]
fn the_allocation_counter_sees_a_big_allocation() {
    let (v, largest) = largest_during(|| vec![1u8; 3 << 20]);
    assert_eq!(v.len(), 3 << 20);
    assert!(largest >= 3 << 20, "{largest}");
    // A valid frame with a 2 MiB payload is read, and its buffer is counted.
    let mut bytes = Vec::new();
    wire::write_frame(&mut bytes, Kind::Gather, 1, 0, 0, &v[..2 << 20]).unwrap();
    let (r, largest) = read(&bytes, MAX_DATA_LEN);
    assert_eq!(r.unwrap().payload.len(), 2 << 20);
    assert!(largest >= 2 << 20, "{largest}");
}
