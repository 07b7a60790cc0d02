//! A small GGUF writer for the unit tests: a valid one-layer Llama (or Qwen3-MoE, or
//! Mixtral) with a byte-level tokenizer, which each test then breaks in one way.

use std::path::PathBuf;

/// A metadata value as the file stores it: type id and payload.
#[derive(Clone)]
pub struct Val(pub u32, pub Vec<u8>);

pub fn u32v(x: u32) -> Val {
    Val(4, x.to_le_bytes().to_vec())
}
pub fn f32v(x: f32) -> Val {
    Val(6, x.to_le_bytes().to_vec())
}
pub fn boolv(x: bool) -> Val {
    Val(7, vec![u8::from(x)])
}
fn string_bytes(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}
pub fn strv(s: &str) -> Val {
    Val(8, string_bytes(s))
}
pub fn str_array(items: &[String]) -> Val {
    let mut b = 8u32.to_le_bytes().to_vec();
    b.extend((items.len() as u64).to_le_bytes());
    for s in items {
        b.extend(string_bytes(s));
    }
    Val(9, b)
}
pub fn i32_array(items: &[i32]) -> Val {
    let mut b = 5u32.to_le_bytes().to_vec();
    b.extend((items.len() as u64).to_le_bytes());
    for x in items {
        b.extend(x.to_le_bytes());
    }
    Val(9, b)
}

pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

pub struct Builder {
    pub version: u32,
    pub kv: Vec<(String, Val)>,
    pub tensors: Vec<Tensor>,
}

pub const HIDDEN: usize = 16;
pub const FF: usize = 32;
pub const HEADS: usize = 2;
pub const VOCAB: usize = 258;

/// Element `i` (in file order) of the F32 test tensor made with `seed`.
pub fn value(i: usize, seed: u32) -> f32 {
    ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 10000.0 - 0.05
}

/// Experts of the Qwen3-MoE and Mixtral test models, used per token, and one Qwen3-MoE
/// expert's width (Mixtral's are [`FF`] wide).
pub const EXPERTS: usize = 4;
pub const EXPERTS_USED: usize = 2;
pub const EXPERT_FF: usize = 8;

pub fn f32_tensor(name: &str, dims: &[usize], seed: u32) -> Tensor {
    let n: usize = dims.iter().product();
    let data = (0..n).flat_map(|i| value(i, seed).to_le_bytes()).collect();
    Tensor {
        name: name.into(),
        dims: dims.iter().map(|&d| d as u64).collect(),
        ty: 0,
        data,
    }
}

impl Builder {
    /// One layer, hidden 16, two heads of 8, untied head, a byte-level tokenizer of 256
    /// bytes plus two control tokens.
    pub fn llama() -> Self {
        let kv = vec![
            ("general.architecture".into(), strv("llama")),
            ("general.name".into(), strv("test")),
            ("llama.block_count".into(), u32v(1)),
            ("llama.context_length".into(), u32v(64)),
            ("llama.embedding_length".into(), u32v(HIDDEN as u32)),
            ("llama.feed_forward_length".into(), u32v(FF as u32)),
            ("llama.attention.head_count".into(), u32v(HEADS as u32)),
            ("llama.attention.head_count_kv".into(), u32v(1)),
            ("llama.attention.layer_norm_rms_epsilon".into(), f32v(1e-5)),
            ("llama.rope.freq_base".into(), f32v(10000.0)),
            ("tokenizer.ggml.model".into(), strv("gpt2")),
            ("tokenizer.ggml.pre".into(), strv("gpt-2")),
            ("tokenizer.ggml.tokens".into(), str_array(&tokens())),
            (
                "tokenizer.ggml.token_type".into(),
                i32_array(&[vec![1; 256], vec![3, 3]].concat()),
            ),
            ("tokenizer.ggml.bos_token_id".into(), u32v(256)),
            ("tokenizer.ggml.eos_token_id".into(), u32v(257)),
            (
                "tokenizer.chat_template".into(),
                strv("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ),
        ];
        let (h, f, kvd) = (HIDDEN, FF, HIDDEN / HEADS);
        let tensors = vec![
            f32_tensor("token_embd.weight", &[h, VOCAB], 1),
            f32_tensor("output_norm.weight", &[h], 2),
            f32_tensor("output.weight", &[h, VOCAB], 3),
            f32_tensor("blk.0.attn_norm.weight", &[h], 4),
            f32_tensor("blk.0.attn_q.weight", &[h, h], 5),
            f32_tensor("blk.0.attn_k.weight", &[h, kvd], 6),
            f32_tensor("blk.0.attn_v.weight", &[h, kvd], 7),
            f32_tensor("blk.0.attn_output.weight", &[h, h], 8),
            f32_tensor("blk.0.ffn_norm.weight", &[h], 9),
            f32_tensor("blk.0.ffn_gate.weight", &[h, f], 10),
            f32_tensor("blk.0.ffn_up.weight", &[h, f], 11),
            f32_tensor("blk.0.ffn_down.weight", &[f, h], 12),
        ];
        Builder {
            version: 3,
            kv,
            tensors,
        }
    }

    /// One layer of Qwen3-MoE: Qwen3's attention (per-head q/k norms), a router and
    /// [`EXPERTS`] experts of width [`EXPERT_FF`] stacked per projection, as llama.cpp's
    /// converter writes `qwen3moe` files; hidden 16, heads of 8.
    pub fn qwen3moe() -> Self {
        let mut b = Self::llama();
        b.kv.retain(|(k, _)| !k.starts_with("llama."));
        b = b.set("general.architecture", strv("qwen3moe"));
        for (k, v) in [
            ("block_count", u32v(1)),
            ("context_length", u32v(64)),
            ("embedding_length", u32v(HIDDEN as u32)),
            ("feed_forward_length", u32v(FF as u32)),
            ("attention.head_count", u32v(HEADS as u32)),
            ("attention.head_count_kv", u32v(1)),
            ("attention.layer_norm_rms_epsilon", f32v(1e-6)),
            ("rope.freq_base", f32v(1_000_000.0)),
            ("expert_count", u32v(EXPERTS as u32)),
            ("expert_used_count", u32v(EXPERTS_USED as u32)),
            ("expert_feed_forward_length", u32v(EXPERT_FF as u32)),
        ] {
            b = b.set(&format!("qwen3moe.{k}"), v);
        }
        let (h, f, e, hd) = (HIDDEN, EXPERT_FF, EXPERTS, HIDDEN / HEADS);
        b.tensors.retain(|t| !t.name.contains(".ffn_"));
        b.tensors.extend([
            f32_tensor("blk.0.attn_q_norm.weight", &[hd], 13),
            f32_tensor("blk.0.attn_k_norm.weight", &[hd], 14),
            f32_tensor("blk.0.ffn_norm.weight", &[h], 9),
            f32_tensor("blk.0.ffn_gate_inp.weight", &[h, e], 15),
            f32_tensor("blk.0.ffn_gate_exps.weight", &[h, f, e], 16),
            f32_tensor("blk.0.ffn_up_exps.weight", &[h, f, e], 17),
            f32_tensor("blk.0.ffn_down_exps.weight", &[f, h, e], 18),
        ]);
        b
    }

    /// One layer of Mixtral as llama.cpp's converter writes it (`LlamaModel` in
    /// convert_hf_to_gguf.py): a `llama` file with `llama.expert_count` and
    /// `llama.expert_used_count`, a router and [`EXPERTS`] experts of width [`FF`] stacked
    /// per projection, q/k rows permuted as for any `llama` file.
    pub fn mixtral() -> Self {
        let mut b = Self::llama()
            .set("llama.expert_count", u32v(EXPERTS as u32))
            .set("llama.expert_used_count", u32v(EXPERTS_USED as u32));
        let (h, f, e) = (HIDDEN, FF, EXPERTS);
        b.tensors
            .retain(|t| !t.name.contains(".ffn_") || t.name.ends_with(".ffn_norm.weight"));
        b.tensors.extend([
            f32_tensor("blk.0.ffn_gate_inp.weight", &[h, e], 15),
            f32_tensor("blk.0.ffn_gate_exps.weight", &[h, f, e], 16),
            f32_tensor("blk.0.ffn_up_exps.weight", &[h, f, e], 17),
            f32_tensor("blk.0.ffn_down_exps.weight", &[f, h, e], 18),
        ]);
        b
    }

    /// The stacked expert tensor `blk.0.<stem>_exps.weight` as the per-expert tensors of
    /// older llama.cpp files, `blk.0.<stem>.E.weight`: the same bytes, one slab each.
    pub fn per_expert(mut self, stem: &str) -> Self {
        let name = format!("blk.0.{stem}_exps.weight");
        let i = self
            .tensors
            .iter()
            .position(|t| t.name == name)
            .expect("a stacked test tensor");
        let t = self.tensors.remove(i);
        let (dims, count) = (&t.dims[..2], t.dims[2] as usize);
        let slab = t.data.len() / count;
        for (e, data) in t.data.chunks_exact(slab).enumerate() {
            self.tensors.push(Tensor {
                name: format!("blk.0.{stem}.{e}.weight"),
                dims: dims.to_vec(),
                ty: t.ty,
                data: data.to_vec(),
            });
        }
        self
    }

    pub fn drop_tensor(mut self, name: &str) -> Self {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert!(self.tensors.len() < before, "{name} is not a test tensor");
        self
    }

    pub fn set(mut self, key: &str, v: Val) -> Self {
        self.kv.retain(|(k, _)| k != key);
        self.kv.push((key.into(), v));
        self
    }

    pub fn remove(mut self, key: &str) -> Self {
        self.kv.retain(|(k, _)| k != key);
        self
    }

    pub fn tensor(mut self, name: &str, f: impl FnOnce(&mut Tensor)) -> Self {
        let t = self
            .tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("a tensor of the test model");
        f(t);
        self
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            b.extend(string_bytes(k));
            b.extend(v.0.to_le_bytes());
            b.extend(&v.1);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            b.extend(string_bytes(&t.name));
            b.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(t.ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offset += (t.data.len() as u64).div_ceil(32) * 32;
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        for t in &self.tensors {
            b.extend(&t.data);
            b.resize(b.len().div_ceil(32) * 32, 0);
        }
        b
    }

    /// Writes the file to a fresh temporary path.
    pub fn write(&self, tag: &str) -> PathBuf {
        write_bytes(tag, &self.bytes())
    }
}

pub fn write_bytes(tag: &str, bytes: &[u8]) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let p = std::env::temp_dir().join(format!(
        "arbor-gguf-{tag}-{}-{}.gguf",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&p, bytes).expect("write test GGUF");
    p
}

/// The 256 byte-level tokens and two control tokens.
fn tokens() -> Vec<String> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut by_byte = vec![String::new(); 256];
    for (b, c) in bs.iter().zip(cs) {
        by_byte[*b as usize] = char::from_u32(c).expect("a char").to_string();
    }
    by_byte.push("<|begin|>".into());
    by_byte.push("<|end|>".into());
    by_byte
}
