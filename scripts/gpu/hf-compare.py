#!/usr/bin/env python3
"""arbor's teacher-forced log-probs against transformers' own forward.

Run on a machine with torch + transformers (the lent GPU machines have both):
    python3 scripts/gpu/hf-compare.py --arbor .device/arbor --out $OUT/hf-compare.json
or on a CPU-only machine (HF runs on the CPU):
    python3 scripts/gpu/hf-compare.py --arbor target/release/arbor --devices cpu

For each configuration it:
  1. builds the model with transformers' own config class and random weights, rounds the
     weights to bf16 and saves it with `save_pretrained` (this transformers' config format,
     v5 on the lent machines); a twin directory holds the same weights with the config
     rewritten in the other generation's form (rope_theta + rope_scaling);
  2. runs transformers' forward in float32 on the bf16-rounded weights (the reference), and
     in bfloat16 (what "bf16 noise" means for this model);
  3. runs `arbor score` on both directories (CUDA and CPU) and compares log-probs.

Printed per configuration: max and mean |arbor - HF f32| over all scored positions, the
same for HF bf16 vs HF f32, the spread of the log-probs, and - for configurations with a
RoPE schedule - the error of a run that ignores the schedule (what the transformers-5 bug
did), to show the comparison is sensitive to it. For mixture-of-experts configurations it
also prints both differences over the positions whose routes are decided (every layer's
k-th chosen router logit at least ROUTE_MARGIN above the best left out), which no precision
flips. Exit status 1 if any configuration fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 512,
             "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "initializer_range": 0.08}

CASES = [
    ("llama-default", LlamaConfig, {"rope_theta": 10000.0}),
    ("llama-llama3", LlamaConfig, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    ("llama-linear", LlamaConfig, {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama-tied-bias", LlamaConfig, {"rope_theta": 10000.0, "tie_word_embeddings": True,
                                          "attention_bias": True, "mlp_bias": True}),
    ("mistral-default", MistralConfig, {"rope_theta": 1000000.0, "sliding_window": None}),
    ("mistral-window", MistralConfig, {"rope_theta": 10000.0, "sliding_window": 1024}),
    ("qwen2-default", Qwen2Config, {"rope_theta": 1000000.0}),
    ("qwen2-tied", Qwen2Config, {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    ("qwen3-default", Qwen3Config, {"rope_theta": 1000000.0}),
    ("qwen3-yarn", Qwen3Config, {"rope_theta": 1000000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen3-tied", Qwen3Config, {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    ("qwen3moe-default", Qwen3MoeConfig, {"rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 128, "norm_topk_prob": True}),
    ("mixtral-default", MixtralConfig, {"rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2}),
    # Not renormalised: the chosen experts' softmax weights as they are.
    ("qwen3moe-nonorm", Qwen3MoeConfig, {"rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": 128, "norm_topk_prob": False}),
    # Every expert used: no choice for precision to flip, so the rest of the block (softmax,
    # weights, experts, weighted sum) is compared alone.
    ("qwen3moe-all", Qwen3MoeConfig, {"rope_theta": 1000000.0, "num_experts": 4, "num_experts_per_tok": 4,
                                           "moe_intermediate_size": 128, "norm_topk_prob": False}),
    ("mixtral-all", MixtralConfig, {"rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 4}),
]

# A position is "decided" when, in every layer, HF f32's router logits put its k-th chosen
# expert at least this far above the best one left out: far beyond what bf16 rounding
# moves a logit (~1e-2 here), so no run flips its route.
ROUTE_MARGIN = 0.1

# Configurations arbor runs on its CPU backend only (none: MoE runs on the GPU too).
CPU_ONLY = set()

V5 = int(transformers.__version__.split(".")[0]) >= 5


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def make_config(cls, extra):
    args = dict(SMALL)
    args.update(extra)
    theta = args.pop("rope_theta")
    scaling = args.pop("rope_scaling", None)
    if V5:
        rp = dict(scaling or {"rope_type": "default"})
        rp["rope_theta"] = theta
        args["rope_parameters"] = rp
    else:
        args["rope_theta"] = theta
        args["rope_scaling"] = scaling
    cfg = cls(**args)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def other_generation(config_path, twin_path):
    """The same config in the other generation's RoPE form."""
    c = read_json(config_path)
    if "rope_parameters" in c:
        rp = dict(c.pop("rope_parameters"))
        c["rope_theta"] = rp.pop("rope_theta")
        c["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
        if "dtype" in c:
            c["torch_dtype"] = c.pop("dtype")
    else:
        rp = dict(c.pop("rope_scaling") or {"rope_type": "default"})
        rp["rope_theta"] = c.pop("rope_theta")
        c["rope_parameters"] = rp
    write_json(c, twin_path)


def without_schedule(config_path, out_path):
    """What the transformers-5 bug computed: theta 10000, no scaling."""
    c = read_json(config_path)
    c.pop("rope_parameters", None)
    c.pop("rope_scaling", None)
    c["rope_theta"] = 10000.0
    write_json(c, out_path)


def weights_of(d, name, root):
    """A directory `root/name` holding `d`'s files (linked) but its config.json."""
    out = os.path.join(root, name)
    os.makedirs(out)
    for f in os.listdir(d):
        if f != "config.json":
            os.symlink(os.path.join(d, f), os.path.join(out, f))
    return out


def hf_logprobs(model_dir, seqs, dtype, device, margins=None):
    """HF's log-prob of every token after the first. With `margins` (a list, for a
    mixture-of-experts model) it also gets, per sequence and scored position, the smallest
    gap over the layers between the router logits of the k-th chosen expert and the best
    expert left out."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    k = getattr(m.config, "num_experts_per_tok", None)
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            o = m(ids, output_router_logits=margins is not None)
            lp = torch.log_softmax(o.logits[0].float(), dim=-1)
            out.append([lp[p - 1, s[p]].item() for p in range(1, len(s))])
            if margins is not None:
                gaps = []
                for r in o.router_logits:
                    top = torch.topk(r.float(), min(k + 1, r.shape[-1]), dim=-1).values
                    gap = top[:, k - 1] - top[:, k] if k < r.shape[-1] else torch.full_like(top[:, 0], float("inf"))
                    gaps.append(gap)
                margin = torch.stack(gaps).min(dim=0).values
                margins.append([margin[p - 1].item() for p in range(1, len(s))])
    del m
    return out


def arbor_logprobs(arbor, model_dir, seqs, device, work):
    inp = os.path.join(work, "in.jsonl")
    outp = os.path.join(work, f"out-{device}.jsonl")
    with open(inp, "w") as f:
        f.writelines(json.dumps({"id": i, "tokens": s, "prompt_len": 1}) + "\n" for i, s in enumerate(seqs))
    r = subprocess.run([arbor, "score", "--model", model_dir, "--input", inp, "--out", outp,
                        "--device", device, "--max-seq-len", "512"],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"arbor score ({device}) failed: {r.stderr[-2000:]}")
    recs = {}
    with open(outp) as f:
        for line in f:
            rec = json.loads(line)
            recs[rec["id"]] = [float(x) for x in rec["logprobs"]]
    return [recs[i] for i in range(len(seqs))]


def diff(a, b, keep=None):
    """max and mean |a - b|, over the positions where `keep` (same layout) is true."""
    flat = [abs(x - y) for i, (ra, rb) in enumerate(zip(a, b)) for j, (x, y) in enumerate(zip(ra, rb))
            if keep is None or keep[i][j]]
    return max(flat), sum(flat) / len(flat)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arbor", default=".device/arbor")
    ap.add_argument("--out", default="hf-compare.json")
    ap.add_argument("--devices", default="cuda,cpu", help="arbor devices to run")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=300)
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, HF on {dev}", flush=True)
    results, failed = [], 0
    root = tempfile.mkdtemp(prefix="hf-compare-")
    for name, cls, extra in CASES:
        if args.only and name not in args.only.split(","):
            continue
        try:
            row = compare(name, cls, extra, args, root, dev)
        except Exception as e:  # noqa: BLE001 (one broken case must not hide the others)
            row = {"name": name, "ok": False, "error": str(e)}
            print(f"FAIL {name:16s} {e}", flush=True)
        failed += not row["ok"]
        results.append(row)
    write_json({"transformers": transformers.__version__, "torch": torch.__version__, "results": results},
               args.out)
    print(f"{len(results) - failed}/{len(results)} configurations agree (max/mean |Δ log-prob| vs HF f32)")
    sys.exit(1 if failed else 0)


def compare(name, cls, extra, args, root, dev):
    """One configuration: build, save, run HF and arbor, compare."""
    t0 = time.time()
    torch.manual_seed(1234)
    cfg = make_config(cls, extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norm weights are ones and biases zeros at init; perturb them so a wrong norm or a
    # missing bias would show.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    d = os.path.join(root, name)
    model.to(torch.bfloat16).save_pretrained(d)
    del model
    twin = weights_of(d, name + "-twin", root)
    other_generation(os.path.join(d, "config.json"), os.path.join(twin, "config.json"))
    g = torch.Generator().manual_seed(99)
    seqs = [torch.randint(0, SMALL["vocab_size"], (args.len,), generator=g).tolist() for _ in range(args.seqs)]
    moe = hasattr(cfg, "num_experts_per_tok")
    margins = [] if moe else None
    ref = hf_logprobs(d, seqs, torch.float32, dev, margins)
    bf16 = hf_logprobs(d, seqs, torch.bfloat16, dev)
    flat = [x for r in ref for x in r]
    mean = sum(flat) / len(flat)
    spread = (sum((x - mean) ** 2 for x in flat) / len(flat)) ** 0.5
    row = {"name": name, "config": read_json(os.path.join(d, "config.json")).get("rope_parameters")
               or read_json(os.path.join(d, "config.json")).get("rope_scaling"),
               "positions": len(flat), "logprob_std": spread, "hf_bf16_vs_f32": diff(bf16, ref)}
    decided = None
    if moe:
        decided = [[g > ROUTE_MARGIN for g in r] for r in margins]
        row["decided_positions"] = sum(map(sum, decided))
        row["hf_bf16_vs_f32_decided"] = diff(bf16, ref, decided)
    ok = True
    devices = [d for d in args.devices.split(",") if d == "cpu" or name not in CPU_ONLY]
    for device in devices:
        a = arbor_logprobs(args.arbor, d, seqs, device, d)
        b = arbor_logprobs(args.arbor, twin, seqs, device, twin)
        same_bits = all(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        row[f"arbor_{device}_vs_f32"] = diff(a, ref)
        row[f"arbor_{device}_twin_same_bits"] = same_bits
        if decided is not None:
            row[f"arbor_{device}_vs_f32_decided"] = diff(a, ref, decided)
        # "Within bf16 noise": no worse than 2x HF's own bf16 run, on max and mean.
        bound_max, bound_mean = 2 * row["hf_bf16_vs_f32"][0], 2 * row["hf_bf16_vs_f32"][1]
        good = diff(a, ref)[0] <= max(bound_max, 2e-2) and diff(a, ref)[1] <= max(bound_mean, 2e-3) and same_bits
        ok &= good
    if "rope_scaling" in extra or name.startswith("qwen3-yarn"):
        wrong = weights_of(d, name + "-noscale", root)
        without_schedule(os.path.join(d, "config.json"), os.path.join(wrong, "config.json"))
        row["schedule_ignored_vs_f32"] = diff(hf_logprobs(wrong, seqs, torch.float32, dev), ref)
    row["ok"] = ok
    fmt = lambda p: f"{p[0]:.2e}/{p[1]:.2e}"
    cols = " ".join(f"arbor-{dv} {fmt(row[f'arbor_{dv}_vs_f32'])} twin-bits={'same' if row[f'arbor_{dv}_twin_same_bits'] else 'DIFFER'}"
                    for dv in devices)
    extra_col = f" | schedule ignored {fmt(row['schedule_ignored_vs_f32'])}" if "schedule_ignored_vs_f32" in row else ""
    if decided is not None:
        extra_col += (f" | decided routes ({row['decided_positions']}/{len(flat)}): HF-bf16 "
                      f"{fmt(row['hf_bf16_vs_f32_decided'])} "
                      + " ".join(f"arbor-{dv} {fmt(row[f'arbor_{dv}_vs_f32_decided'])}" for dv in devices))
    print(f"{'ok  ' if ok else 'FAIL'} {name:16s} std {spread:.2f} | HF-bf16 {fmt(row['hf_bf16_vs_f32'])} | {cols}{extra_col}  ({time.time()-t0:.0f} s)", flush=True)
    return row


if __name__ == "__main__":
    main()
