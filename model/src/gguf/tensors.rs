//! A GGUF file's tensors under the Hugging Face names arbor's layers ask for, read slice by
//! slice and dequantized to bf16. llama.cpp's converter reorders the q/k rows of `llama`
//! models within each head for GGML's interleaved RoPE (pairs `(2i, 2i+1)`); arbor rotates
//! HF style (pairs `(i, i + d/2)`), so those rows are read back in HF order.

use std::collections::HashMap;
use std::ops::Range;

use half::bf16;

use super::config::GgufArch;
use super::dequant::{self, GgmlType};
use super::reader::{GgufFile, TensorInfo};
use crate::config::checkpoint_names;
use crate::config::Arch;
use crate::error::{MResult, ModelError};

/// How one HF tensor is found in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    gguf: String,
    /// Rows permuted by llama.cpp for interleaved RoPE, in heads of this many rows.
    permuted_head_dim: Option<usize>,
    /// One expert's matrix inside a tensor that stacks a layer's experts along its last
    /// GGUF dimension (`blk.N.ffn_gate_exps.weight`...).
    slab: Option<Slab>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slab {
    index: usize,
    count: usize,
}

pub struct GgufWeights {
    file: GgufFile,
    /// HF name -> where it is.
    map: HashMap<String, Source>,
    moe: Option<MoeNames>,
}

/// The HF name of a per-layer GGUF tensor suffix.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_gate.bias", "mlp.gate_proj.bias"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_up.bias", "mlp.up_proj.bias"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("ffn_down.bias", "mlp.down_proj.bias"),
];

/// A mixture-of-experts layer's router (an ordinary matrix).
const ROUTER: &str = "ffn_gate_inp.weight";

/// A mixture-of-experts layer's projections, in [`checkpoint_names`] order (gate, up,
/// down): the GGUF name of the tensor stacking every expert's matrix, and the stem of the
/// per-expert tensors older llama.cpp files have (`blk.N.ffn_gate.E.weight`).
const EXPERT_NAMES: [(&str, &str); 3] = [
    ("ffn_gate_exps.weight", "ffn_gate"),
    ("ffn_up_exps.weight", "ffn_up"),
    ("ffn_down_exps.weight", "ffn_down"),
];

/// A mixture-of-experts tensor of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MoeTensor {
    Router,
    /// Projection `p` (index into [`EXPERT_NAMES`]) of every expert, stacked.
    Stacked(usize),
    /// Projection `p` of expert `e` alone.
    Single(usize, usize),
}

/// Layer and kind of a mixture-of-experts GGUF tensor `name`.
fn moe_tensor(name: &str) -> Option<(usize, MoeTensor)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if suffix == ROUTER {
        return Some((layer, MoeTensor::Router));
    }
    if let Some(p) = EXPERT_NAMES.iter().position(|(g, _)| *g == suffix) {
        return Some((layer, MoeTensor::Stacked(p)));
    }
    let (stem, rest) = suffix.split_once('.')?;
    let e: usize = rest.strip_suffix(".weight")?.parse().ok()?;
    let p = EXPERT_NAMES.iter().position(|(_, s)| *s == stem)?;
    Some((layer, MoeTensor::Single(p, e)))
}

/// A mixture-of-experts file's experts: how many per layer, and the HF names its
/// architecture's checkpoints give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeNames {
    pub count: usize,
    /// The block under `model.layers.N` (`mlp`, Mixtral's `block_sparse_moe`).
    block: &'static str,
    /// Each expert's gate, up and down projections.
    proj: [&'static str; 3],
    /// Whether per-expert tensors are read (llama.cpp reads them for `llama` only).
    per_expert: bool,
}

impl MoeNames {
    pub fn new(arch: Arch, count: usize) -> Self {
        let (block, proj) = checkpoint_names(arch);
        MoeNames {
            count,
            block,
            proj,
            per_expert: arch == Arch::Mixtral,
        }
    }

    fn router(&self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.gate.weight", self.block)
    }

    fn expert(&self, layer: usize, e: usize, p: usize) -> String {
        format!(
            "model.layers.{layer}.{}.experts.{e}.{}.weight",
            self.block, self.proj[p]
        )
    }

    /// The GGUF tensor behind HF `suffix` of layer `layer` (`block_sparse_moe.gate.weight`,
    /// `mlp.experts.3.up_proj.weight`...), for messages.
    fn hint(&self, layer: &str, suffix: &str) -> Option<String> {
        let rest = suffix.strip_prefix(self.block)?.strip_prefix('.')?;
        if rest == "gate.weight" {
            return Some(format!("blk.{layer}.{ROUTER}"));
        }
        let (e, x) = rest.strip_prefix("experts.")?.split_once('.')?;
        let p = self
            .proj
            .iter()
            .position(|h| x.strip_suffix(".weight") == Some(*h))?;
        let (stacked, single) = EXPERT_NAMES[p];
        Some(if self.per_expert {
            format!("blk.{layer}.{stacked}, expert {e}, or blk.{layer}.{single}.{e}.weight")
        } else {
            format!("blk.{layer}.{stacked}, expert {e}")
        })
    }
}

/// Tensors the config reads and no layer loads.
pub const CONFIG_TENSORS: &[&str] = &["rope_freqs.weight"];

/// The HF name of GGUF tensor `name`, if arbor knows it.
pub fn hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    LAYER_NAMES
        .iter()
        .find(|(g, _)| *g == suffix)
        .map(|(_, hf)| format!("model.layers.{layer}.{hf}"))
}

/// The GGUF row holding HF row `r` of a q/k projection permuted in heads of `hd` rows:
/// llama.cpp's `permute` sends HF row `(h, j, i)` (half `j` of head `h`, index `i` in it)
/// to `(h, i, j)`.
pub fn permuted_row(r: usize, hd: usize) -> usize {
    let (h, rr) = (r / hd, r % hd);
    let (j, i) = (rr / (hd / 2), rr % (hd / 2));
    h * hd + 2 * i + j
}

impl GgufWeights {
    /// Maps every tensor of `file` to its HF name; a tensor arbor does not know is an
    /// error naming it (it may be part of the model's math). `moe`: the experts of a
    /// mixture-of-experts file, whose stacked expert tensors must hold exactly that many
    /// (None: a dense file, where expert tensors are unknown).
    pub fn new(
        file: GgufFile,
        arch: GgufArch,
        num_heads: usize,
        num_kv_heads: usize,
        moe: Option<MoeNames>,
    ) -> MResult<Self> {
        let mut map: HashMap<String, Source> = HashMap::new();
        let gguf_err = |msg: String| ModelError::Gguf {
            path: file.path.clone(),
            msg,
        };
        for name in &file.tensor_names {
            if CONFIG_TENSORS.contains(&name.as_str()) {
                continue;
            }
            let found = moe.and_then(|x| moe_tensor(name).map(|t| (x, t)));
            if let Some((x, (layer, t))) = found {
                let count = x.count;
                let source = |slab| Source {
                    gguf: name.clone(),
                    permuted_head_dim: None,
                    slab,
                };
                let entries: Vec<(String, Source)> = match t {
                    MoeTensor::Router => vec![(x.router(layer), source(None))],
                    MoeTensor::Stacked(p) => {
                        let dims = &file.tensors[name].dims;
                        if dims.len() != 3 || dims[2] != count {
                            return Err(gguf_err(format!(
                                "tensor {name:?} has dimensions {dims:?}: it must stack the {count} experts of expert_count along its last of 3 dimensions"
                            )));
                        }
                        (0..count)
                            .map(|index| {
                                (
                                    x.expert(layer, index, p),
                                    source(Some(Slab { index, count })),
                                )
                            })
                            .collect()
                    }
                    MoeTensor::Single(_, _) if !x.per_expert => {
                        return Err(gguf_err(format!(
                            "tensor {name:?}: one expert's matrix in a {} file, whose experts llama.cpp stacks ({}): not supported",
                            arch.name(),
                            EXPERT_NAMES.map(|n| n.0).join(", ")
                        )))
                    }
                    MoeTensor::Single(_, e) if e >= count => {
                        return Err(gguf_err(format!(
                            "tensor {name:?} is expert {e}, but expert_count is {count}"
                        )))
                    }
                    MoeTensor::Single(p, e) => vec![(x.expert(layer, e, p), source(None))],
                };
                for (hf, src) in entries {
                    if let Some(old) = map.insert(hf.clone(), src) {
                        return Err(gguf_err(format!(
                            "tensors {:?} and {name:?} both hold {hf}: a projection's experts must be stacked or one tensor per expert, not both",
                            old.gguf
                        )));
                    }
                }
                continue;
            }
            let hf = hf_name(name).ok_or_else(|| ModelError::Gguf {
                path: file.path.clone(),
                msg: format!(
                    "tensor {name:?} is not one arbor knows for a {} model; refusing rather than ignoring it",
                    arch.name()
                ),
            })?;
            if moe.is_some_and(|x| x.per_expert) && hf.contains(".mlp.") {
                return Err(gguf_err(format!(
                    "tensor {name:?} is a dense MLP's, but expert_count says every layer of this {} file is experts",
                    arch.name()
                )));
            }
            let heads = if !arch.permuted_qk() {
                None
            } else if name.contains(".attn_q.") {
                Some(num_heads)
            } else if name.contains(".attn_k.") {
                Some(num_kv_heads)
            } else {
                None
            };
            let info = &file.tensors[name];
            let permuted_head_dim = match heads {
                None => None,
                Some(h) => {
                    let rows = if info.dims.len() >= 2 {
                        info.dims[1]
                    } else {
                        info.dims[0]
                    };
                    if h == 0 || rows % h != 0 || (rows / h) % 2 != 0 {
                        return Err(ModelError::Gguf {
                            path: file.path.clone(),
                            msg: format!("tensor {name:?}: {rows} rows do not split into {h} heads of even size"),
                        });
                    }
                    Some(rows / h)
                }
            };
            map.insert(
                hf,
                Source {
                    gguf: name.clone(),
                    permuted_head_dim,
                    slab: None,
                },
            );
        }
        Ok(GgufWeights { file, map, moe })
    }

    pub fn path(&self) -> &std::path::Path {
        &self.file.path
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn err(&self, tensor: &str, msg: String) -> ModelError {
        ModelError::Gguf {
            path: self.file.path.clone(),
            msg: format!("tensor {tensor:?}: {msg}"),
        }
    }

    /// The tensor behind HF `name`, checked to be `hf_shape` (PyTorch order) and of a type
    /// arbor dequantizes.
    fn get(&self, name: &str, hf_shape: &[usize]) -> MResult<(&Source, &TensorInfo)> {
        let src = self
            .map
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                dir: self.file.path.clone(),
                tensor: format!("{name} (GGUF {})", gguf_name_hint(name, self.moe)),
            })?;
        let info = &self.file.tensors[&src.gguf];
        let mut want: Vec<usize> = hf_shape.iter().rev().copied().collect();
        if let Some(slab) = src.slab {
            want.push(slab.count);
        }
        if info.dims != want {
            return Err(ModelError::ShapeMismatch {
                path: self.file.path.clone(),
                tensor: src.gguf.clone(),
                expected: want,
                found: info.dims.clone(),
            });
        }
        if !info.ty.supported() {
            return Err(self.err(
                &src.gguf,
                format!(
                    "type {} is not one arbor dequantizes (supported: {})",
                    info.ty.name(),
                    dequant::SUPPORTED
                ),
            ));
        }
        Ok((src, info))
    }

    fn row_bytes<'a>(&'a self, info: &TensorInfo, k: usize, row: usize) -> &'a [u8] {
        let rb = info.ty.row_bytes(k);
        &self.file.data(info)[row * rb..(row + 1) * rb]
    }

    /// Appends the values of `bytes` (whole blocks of type `ty`, starting at element
    /// `first` of the tensor in file order) to `out`. A value that is not finite is
    /// refused, naming the tensor and the element: it would make every log-prob that
    /// depends on it NaN.
    fn dequant(
        &self,
        src: &Source,
        ty: GgmlType,
        bytes: &[u8],
        first: usize,
        scratch: &mut Vec<f32>,
        out: &mut Vec<bf16>,
    ) -> MResult<()> {
        let from = out.len();
        dequant::dequantize_bf16(ty, bytes, scratch, out).map_err(|m| self.err(&src.gguf, m))?;
        match out[from..].iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(j) => Err(self.err(
                &src.gguf,
                format!(
                    "element {} (in file order) is {}; the weights must be finite in bf16",
                    first + j,
                    out[from + j]
                ),
            )),
        }
    }

    /// Rows `rows` (all columns) of the `[n, k]` matrix `name`, in HF row order.
    pub fn rows(&self, name: &str, n: usize, k: usize, rows: Range<usize>) -> MResult<Vec<bf16>> {
        let (src, info) = self.get(name, &[n, k])?;
        debug_assert!(rows.end <= n);
        let mut out = Vec::with_capacity(rows.len() * k);
        let mut scratch = Vec::with_capacity(k);
        for r in rows {
            let g = file_row(src, r, n);
            self.dequant(
                src,
                info.ty,
                self.row_bytes(info, k, g),
                g * k,
                &mut scratch,
                &mut out,
            )?;
        }
        Ok(out)
    }

    /// Columns `cols` of every row of the `[n, k]` matrix `name`. Whole blocks are
    /// dequantized; only the wanted columns are kept.
    pub fn cols(&self, name: &str, n: usize, k: usize, cols: Range<usize>) -> MResult<Vec<bf16>> {
        let (src, info) = self.get(name, &[n, k])?;
        debug_assert!(cols.end <= k);
        let (be, bb) = info.ty.block().unwrap_or((1, 0));
        let b0 = cols.start / be;
        let b1 = cols.end.div_ceil(be);
        let skip = cols.start - b0 * be;
        let mut out = Vec::with_capacity(n * cols.len());
        let mut scratch = Vec::new();
        let mut row = Vec::new();
        for r in 0..n {
            let g = file_row(src, r, n);
            let bytes = &self.row_bytes(info, k, g)[b0 * bb..b1 * bb];
            row.clear();
            self.dequant(src, info.ty, bytes, g * k + b0 * be, &mut scratch, &mut row)?;
            out.extend_from_slice(&row[skip..skip + cols.len()]);
        }
        Ok(out)
    }

    /// Elements `range` of the vector `name` of length `len`, as f32 (via bf16, as the
    /// safetensors path reads them).
    pub fn vector(&self, name: &str, len: usize, range: Range<usize>) -> MResult<Vec<f32>> {
        let (src, info) = self.get(name, &[len])?;
        if src.slab.is_some() {
            return Err(self.err(
                &src.gguf,
                format!("read as a vector of {len} for {name}: it stacks experts' matrices"),
            ));
        }
        let mut all = Vec::with_capacity(len);
        let mut scratch = Vec::new();
        self.dequant(
            src,
            info.ty,
            self.file.data(info),
            0,
            &mut scratch,
            &mut all,
        )?;
        Ok(range
            .map(|i| {
                let g = src.permuted_head_dim.map_or(i, |hd| permuted_row(i, hd));
                f32::from(all[g])
            })
            .collect())
    }
}

/// The row of the file's tensor (rows of every stacked expert counted) that holds HF row
/// `r` of the `n`-row matrix `src`.
fn file_row(src: &Source, r: usize, n: usize) -> usize {
    let r = src.permuted_head_dim.map_or(r, |hd| permuted_row(r, hd));
    src.slab.map_or(r, |s| s.index * n + r)
}

/// The GGUF name an HF tensor name would have, for "missing tensor" messages.
fn gguf_name_hint(hf: &str, moe: Option<MoeNames>) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let Some(rest) = hf.strip_prefix("model.layers.") else {
        return "?".into();
    };
    let Some((layer, suffix)) = rest.split_once('.') else {
        return "?".into();
    };
    if let Some(h) = moe.and_then(|x| x.hint(layer, suffix)) {
        return h;
    }
    LAYER_NAMES
        .iter()
        .find(|(_, h)| *h == suffix)
        .map_or_else(|| "?".into(), |(g, _)| format!("blk.{layer}.{g}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` in numpy terms: reshape(heads, 2, hd/2, k).swapaxes(1, 2).
    fn llama_cpp_permute(rows: &[usize], heads: usize) -> Vec<usize> {
        let hd = rows.len() / heads;
        let mut out = Vec::with_capacity(rows.len());
        for h in 0..heads {
            for i in 0..hd / 2 {
                for j in 0..2 {
                    out.push(rows[h * hd + j * (hd / 2) + i]);
                }
            }
        }
        out
    }

    #[test]
    fn permuted_row_undoes_llama_cpp_permute() {
        for (heads, hd) in [(1, 2), (3, 8), (9, 64)] {
            let hf: Vec<usize> = (0..heads * hd).collect();
            let gguf = llama_cpp_permute(&hf, heads);
            for r in 0..heads * hd {
                assert_eq!(
                    gguf[permuted_row(r, hd)],
                    r,
                    "heads {heads} hd {hd} row {r}"
                );
            }
        }
    }

    #[test]
    fn names_map_both_ways() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.0.ffn_gate_exps.weight"), None);
        for (g, _) in LAYER_NAMES {
            let hf = hf_name(&format!("blk.7.{g}")).unwrap();
            assert_eq!(gguf_name_hint(&hf, None), format!("blk.7.{g}"));
        }
        assert_eq!(
            moe_tensor("blk.3.ffn_down_exps.weight"),
            Some((3, MoeTensor::Stacked(2)))
        );
        assert_eq!(
            moe_tensor("blk.0.ffn_gate_inp.weight"),
            Some((0, MoeTensor::Router))
        );
        assert_eq!(
            moe_tensor("blk.1.ffn_up.7.weight"),
            Some((1, MoeTensor::Single(1, 7)))
        );
        assert_eq!(moe_tensor("blk.0.ffn_gate.weight"), None);
        assert_eq!(moe_tensor("blk.0.ffn_gate.x.weight"), None);
        let qwen = Some(MoeNames::new(Arch::Qwen3Moe, 8));
        assert_eq!(
            gguf_name_hint("model.layers.2.mlp.experts.5.up_proj.weight", qwen),
            "blk.2.ffn_up_exps.weight, expert 5"
        );
        assert_eq!(
            gguf_name_hint("model.layers.2.mlp.gate.weight", qwen),
            "blk.2.ffn_gate_inp.weight"
        );
        // Mixtral: w1 gate, w3 up, w2 down, as convert_hf_to_gguf.py's tensor map
        // (gguf-py/gguf/tensor_mapping.py, "mixtral (merged)") names them.
        let mixtral = Some(MoeNames::new(Arch::Mixtral, 8));
        for (w, g) in [("w1", "gate"), ("w3", "up"), ("w2", "down")] {
            assert_eq!(
                gguf_name_hint(
                    &format!("model.layers.4.block_sparse_moe.experts.6.{w}.weight"),
                    mixtral
                ),
                format!("blk.4.ffn_{g}_exps.weight, expert 6, or blk.4.ffn_{g}.6.weight")
            );
        }
        assert_eq!(
            gguf_name_hint("model.layers.0.block_sparse_moe.gate.weight", mixtral),
            "blk.0.ffn_gate_inp.weight"
        );
    }
}
