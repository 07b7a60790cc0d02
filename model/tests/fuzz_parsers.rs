//! Property tests of the parsers that read files a user may have been handed: the
//! safetensors header (`safetensors::parse_header`) and config.json
//! (`ModelConfig::from_json_str`). Whatever the bytes, they must return an error or a
//! value (no panic, no hang), and a lying length must not be allocated.
//!
//! Case counts are fixed so that the suite takes a few seconds in CI.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use arbor_model::safetensors::{build_header, parse_header};
use arbor_model::{DType, ModelConfig};
use proptest::prelude::*;
use serde_json::Value;

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

fn largest_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let r = f();
    (r, LARGEST.with(Cell::get))
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    Word(usize, u64),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, x)| Edit::Flip(i, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Remove),
        any::<usize>().prop_map(Edit::Truncate),
        (
            prop_oneof![Just(0usize), any::<usize>()],
            prop_oneof![Just(1u64 << 60), Just(u64::MAX), any::<u64>()]
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

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// A small but valid safetensors image: header, then zeroed data.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        (
            "[a-z.]{1,12}",
            0..DTYPES.len(),
            prop::collection::vec(0usize..5, 0..3),
        ),
        0..5,
    )
    .prop_map(|ts| {
        let entries: Vec<(String, DType, Vec<usize>)> = ts
            .into_iter()
            .enumerate()
            .map(|(i, (n, d, s))| (format!("{n}{i}"), DTYPES[d], s))
            .collect();
        let (mut file, data) = build_header(&entries);
        file.resize(file.len() + data, 0);
        file
    })
}

/// Any JSON value, a few levels deep.
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(1 << 40)].prop_map(Value::from),
        "[a-zA-Z_]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A config.json of the shape Hugging Face writes for a tiny Llama or Qwen3.
fn base_config(arch: usize) -> Value {
    let (arch, model_type) = [
        ("LlamaForCausalLM", "llama"),
        ("MistralForCausalLM", "mistral"),
        ("Qwen3ForCausalLM", "qwen3"),
    ][arch];
    serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "head_dim": 8,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128
        }
    })
}

const PATH: &str = "fuzz/config.json";

proptest! {
    #![proptest_config(config(1500))]

    #[test]
    fn safetensors_random_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
        let (r, largest) = largest_during(|| parse_header(&bytes, Path::new("fuzz.safetensors")));
        prop_assert!(largest <= 64 << 10, "allocated {largest}");
        if let Ok((start, tensors)) = r {
            prop_assert!(start <= bytes.len());
            for t in tensors.values() {
                prop_assert!(start + t.data.end <= bytes.len());
            }
        }
    }

    #[test]
    fn safetensors_mutated_files_are_read_or_refused(file in valid_file(), edits in edits()) {
        let path = Path::new("fuzz.safetensors");
        let (start, tensors) = parse_header(&file, path).unwrap();
        prop_assert_eq!(start + tensors.values().map(|t| t.data.len()).sum::<usize>(), file.len());
        let mut bytes = file;
        apply(&mut bytes, &edits);
        let (r, largest) = largest_during(|| parse_header(&bytes, path));
        prop_assert!(largest <= (64 << 10) + bytes.len() * 8, "allocated {largest}");
        if let Ok((start, tensors)) = r {
            for t in tensors.values() {
                prop_assert!(t.data.start <= t.data.end && start + t.data.end <= bytes.len());
            }
        }
    }

    #[test]
    fn safetensors_lying_header_length(n in prop_oneof![Just(1u64 << 60), Just(u64::MAX), any::<u64>()],
                                       tail in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend_from_slice(&tail);
        let (r, largest) = largest_during(|| parse_header(&bytes, Path::new("fuzz.safetensors")));
        if n > tail.len() as u64 {
            let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
            prop_assert!(msg.contains(&format!("header length {n}")), "{msg}");
        }
        prop_assert!(largest <= 64 << 10, "allocated {largest}");
    }

    #[test]
    fn config_with_random_values_is_read_or_refused(
        arch in 0usize..3,
        replace in prop::collection::vec(("[a-z_]{1,30}", json()), 1..4),
        remove in prop::collection::vec(0usize..20, 0..3),
    ) {
        let mut v = base_config(arch);
        let obj = v.as_object_mut().unwrap();
        let keys: Vec<String> = obj.keys().cloned().collect();
        for i in remove {
            obj.remove(&keys[i % keys.len()]);
        }
        for (i, (fresh, val)) in replace.into_iter().enumerate() {
            // Mostly a known key, so that the value checks are what is exercised.
            let key = if i % 3 == 2 { fresh } else { keys[fresh.len() % keys.len()].clone() };
            obj.insert(key, val);
        }
        let text = v.to_string();
        let (r, largest) = largest_during(|| ModelConfig::from_json_str(&text, Path::new(PATH)));
        prop_assert!(largest <= (64 << 10) + text.len() * 8, "allocated {largest}");
        if let Err(e) = r {
            prop_assert!(e.to_string().contains(PATH), "{e}");
        }
    }

    #[test]
    fn config_mutated_text_is_read_or_refused(arch in 0usize..3, edits in edits()) {
        let mut bytes = base_config(arch).to_string().into_bytes();
        let clean = std::str::from_utf8(&bytes).unwrap().to_string();
        prop_assert!(ModelConfig::from_json_str(&clean, Path::new(PATH)).is_ok());
        apply(&mut bytes, &edits);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let (r, largest) = largest_during(|| ModelConfig::from_json_str(&text, Path::new(PATH)));
        prop_assert!(largest <= (64 << 10) + text.len() * 8, "allocated {largest}");
        if let Err(e) = r {
            prop_assert!(e.to_string().contains(PATH), "{e}");
        }
    }
}

#[test]
fn a_safetensors_header_length_of_two_to_the_sixty_is_refused() {
    let mut bytes = (1u64 << 60).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let (r, largest) = largest_during(|| parse_header(&bytes, Path::new("big.safetensors")));
    let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains("big.safetensors") && msg.contains("1152921504606846976"),
        "{msg}"
    );
    assert!(largest <= 4096, "allocated {largest}");
}
