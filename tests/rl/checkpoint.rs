//! Checkpoints: safetensors files in memory (read, cut into parts, nudged as an optimizer
//! step would, written as a model directory), and the checkpoints A, B and C the tests
//! switch between.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};

use crate::cli_support::*;

/// A safetensors file in memory: its tensors by name (dtype, shape, bytes).
#[derive(Clone)]
pub(crate) struct Tensors(pub(crate) BTreeMap<String, (String, Vec<usize>, Vec<u8>)>);

impl Tensors {
    pub(crate) fn read(path: &Path) -> Tensors {
        let raw = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let n = u64::from_le_bytes(raw[..8].try_into().expect("8 bytes")) as usize;
        let header: Value = serde_json::from_slice(&raw[8..8 + n]).expect("header JSON");
        let data = &raw[8 + n..];
        let mut out = BTreeMap::new();
        for (name, t) in header.as_object().expect("header object") {
            if name == "__metadata__" {
                continue;
            }
            let offs: Vec<usize> = t["data_offsets"]
                .as_array()
                .expect("offsets")
                .iter()
                .map(|v| v.as_u64().expect("offset") as usize)
                .collect();
            let shape = t["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|v| v.as_u64().expect("dim") as usize)
                .collect();
            out.insert(
                name.clone(),
                (
                    t["dtype"].as_str().expect("dtype").to_string(),
                    shape,
                    data[offs[0]..offs[1]].to_vec(),
                ),
            );
        }
        Tensors(out)
    }

    /// A safetensors image of the tensors `names`.
    pub(crate) fn image(&self, names: &[&String]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for name in names {
            let (dtype, shape, bytes) = &self.0[*name];
            header.insert(
                (*name).clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend_from_slice(bytes);
        }
        safetensors_image(Value::Object(header).to_string().as_bytes(), &data)
    }

    pub(crate) fn names(&self) -> Vec<&String> {
        self.0.keys().collect()
    }

    /// `parts` safetensors images that hold every tensor once between them.
    pub(crate) fn parts(&self, parts: usize) -> Vec<Vec<u8>> {
        let names = self.names();
        let per = names.len().div_ceil(parts);
        names.chunks(per).map(|c| self.image(c)).collect()
    }

    /// Safetensors images of at most `max` bytes each, every tensor once between them.
    pub(crate) fn parts_below(&self, max: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut cur: Vec<&String> = Vec::new();
        for name in self.names() {
            cur.push(name);
            if self.image(&cur).len() > max {
                cur.pop();
                out.push(self.image(&cur));
                cur = vec![name];
            }
        }
        out.push(self.image(&cur));
        out
    }

    /// What an optimizer step does to the weights, in miniature: every 5th bf16 value of
    /// every tensor moves by one unit in the last place (deterministic in `step`).
    pub(crate) fn nudge(&mut self, step: u64) {
        for (dtype, _, bytes) in self.0.values_mut() {
            assert_eq!(dtype, "BF16", "the tiny models are bf16");
            for (i, c) in bytes.chunks_exact_mut(2).enumerate() {
                if (i as u64 + step).is_multiple_of(5) {
                    let b = u16::from_le_bytes([c[0], c[1]]);
                    // Toward or away from zero by one ulp: stays finite for these weights.
                    let b = if (i as u64 / 5 + step).is_multiple_of(2) {
                        b.wrapping_add(1)
                    } else {
                        b.wrapping_sub(1)
                    };
                    c.copy_from_slice(&b.to_le_bytes());
                }
            }
        }
    }

    /// A model directory: `like`'s config and tokenizer files, these weights.
    pub(crate) fn write_dir(&self, like: &Path, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create checkpoint dir");
        for f in std::fs::read_dir(like).expect("read model dir") {
            let f = f.expect("dir entry").path();
            let name = f.file_name().expect("file name").to_owned();
            if name != "model.safetensors" && f.is_file() {
                std::fs::copy(&f, dir.join(&name)).expect("copy model file");
            }
        }
        let names = self.names();
        std::fs::write(dir.join("model.safetensors"), self.image(&names)).expect("write weights");
    }
}

/// The checkpoints the tests switch between: A and B (two seeds of the tiny Llama) and
/// C (A nudged, written as a directory too), and their reference responses.
pub(crate) struct Models {
    pub(crate) a: PathBuf,
    pub(crate) b: PathBuf,
    pub(crate) c: PathBuf,
    pub(crate) c_tensors: Tensors,
}

pub(crate) fn models() -> &'static Models {
    static M: OnceLock<Models> = OnceLock::new();
    M.get_or_init(|| {
        let a = shared_tiny("rl-a", "llama");
        let b = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-rl-b");
        let _ = std::fs::remove_dir_all(&b);
        let o = run_arbor(&[
            "make-model",
            "--preset",
            "tiny",
            "--seed",
            "8",
            "--out",
            b.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "make-model B: {:?}", text(&o));
        let mut c_tensors = Tensors::read(&a.join("model.safetensors"));
        c_tensors.nudge(1);
        let c = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-rl-c");
        let _ = std::fs::remove_dir_all(&c);
        c_tensors.write_dir(&a, &c);
        Models { a, b, c, c_tensors }
    })
}

/// A safetensors file: `header` (JSON text, padded to 8 bytes) and the tensors' `data`.
pub(crate) fn safetensors_image(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut h = header.to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}
