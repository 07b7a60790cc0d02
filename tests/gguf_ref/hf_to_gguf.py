"""Converts one of arbor's tiny random HF models (config.json, model.safetensors,
tokenizer.json) to GGUF the way llama.cpp's convert_hf_to_gguf.py does for Llama, Qwen2,
Qwen3 and Mixtral (its q/k permutation for `llama`, its tensor and metadata names; Mixtral
as `llama` with expert counts and each projection's experts stacked, as its
`LlamaModel.modify_tensors` does), written by the `gguf` package's GGUFWriter. For tests/gguf.rs, which checks that arbor gives the same
bits from both files.

usage: hf_to_gguf.py HF_DIR OUT.gguf TYPE
TYPE: F32 or BF16 (both hold bf16 weights exactly), or Q8_0 (lossy).
"""
import json
import struct
import sys

import gguf
import numpy as np
from gguf.quants import quantize

src, out, ttype = sys.argv[1:4]
with open(f"{src}/config.json") as f:
    cfg = json.load(f)
arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "MixtralForCausalLM": "llama"}[cfg["architectures"][0]]
experts = cfg.get("num_local_experts")


def safetensors(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        assert t["dtype"] == "BF16", t["dtype"]
        bits = np.frombuffer(raw[base + a:base + b], dtype="<u2").astype(np.uint32) << 16
        out[name] = bits.view(np.float32).reshape(t["shape"])
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half rows -> GGML interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
w = gguf.GGUFWriter(out, arch)
w.add_name("arbor tiny " + arch)
w.add_context_length(cfg["max_position_embeddings"])
w.add_embedding_length(cfg["hidden_size"])
w.add_block_count(cfg["num_hidden_layers"])
w.add_feed_forward_length(cfg["intermediate_size"])
w.add_head_count(heads)
w.add_head_count_kv(kv)
w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
w.add_key_length(hd)
w.add_value_length(hd)
if experts:
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
if arch == "llama":
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(hd)
w.add_file_type({"F32": 0, "BF16": 32, "Q8_0": 7}[ttype])

with open(f"{src}/tokenizer.json") as f:
    tok = json.load(f)
vocab = dict(tok["model"]["vocab"])
special = {t["id"]: t["content"] for t in tok["added_tokens"]}
for i, c in special.items():
    vocab[c] = i
tokens = [None] * cfg["vocab_size"]
for t, i in vocab.items():
    tokens[i] = t
types = [3 if i in special else 1 for i in range(len(tokens))]
for i in range(len(tokens)):
    if tokens[i] is None:
        tokens[i], types[i] = f"[PAD{i}]", 4
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("gpt-2")
w.add_token_list(tokens)
w.add_token_types(types)
w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
w.add_bos_token_id(cfg["bos_token_id"])
w.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
w.add_add_bos_token(False)

names = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
layer = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Mixtral's experts: w1 gate, w3 up, w2 down (gguf-py's tensor_mapping.py, "mixtral
# (merged)"), each projection's experts stacked along a new first axis.
moe = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}
weights = safetensors(f"{src}/model.safetensors")
stacked = {}
for name in [n for n in weights if ".block_sparse_moe.experts." in n]:
    i, rest = name[len("model.layers."):].split(".", 1)
    e, wid = rest[len("block_sparse_moe.experts."):].split(".")[:2]
    stacked.setdefault(f"blk.{i}.{moe[wid]}", {})[int(e)] = weights.pop(name)
for gname, per in stacked.items():
    weights[gname] = np.stack([per[e] for e in range(experts)], axis=0)
layer["block_sparse_moe.gate.weight"] = "ffn_gate_inp.weight"
for name, t in sorted(weights.items()):
    if name.startswith("blk."):
        gname = name
    elif name.startswith("model.layers."):
        i, rest = name[len("model.layers."):].split(".", 1)
        gname = f"blk.{i}.{layer[rest]}"
    else:
        gname = names[name]
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        t = permute(t, heads)
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        t = permute(t, kv)
    t = np.ascontiguousarray(t, dtype=np.float32)
    if t.ndim == 1 or ttype == "F32" or (ttype == "Q8_0" and t.shape[-1] % 32):
        w.add_tensor(gname, t)
    elif ttype == "BF16":
        bits = (t.view(np.uint32) >> 16).astype("<u2")
        w.add_tensor(gname, bits.view(np.uint8).reshape(*t.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor(gname, quantize(t, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
rs = cfg.get("rope_scaling") or {}
if rs.get("rope_type") == "llama3":
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in float32 as there.
    base = cfg.get("rope_theta", 10000.0)
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    factors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
elif rs:
    raise SystemExit(f"rope_scaling {rs} is not converted by this script")
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
