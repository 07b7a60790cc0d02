#!/usr/bin/env python3
"""`arbor.torch`'s mixture-of-experts models on a GPU: tiny Qwen3-MoE and Mixtral (and each
with 4 experts per token) as `CausalLM` on CUDA tensors, against `arbor score --device
cuda`.

`arbor.torch` runs a CUDA block's experts through the dense tree GEMM (the `tree_linear`
op) and routes on the host, which is the engine's `ARBOR_MOE=host` path: its log-probs
are checked bit for bit against `ARBOR_MOE=host arbor score --device cuda` at TP 1, 2
and 4 (ranks sharing the GPU). The engine's default device routing runs the experts
through its grouped GEMM (the mma.sync family; Hopper's dense GEMM is wgmma), so against
it the equal tokens and the largest |Δ log p| are reported, not required. Then the
backward against the plain f32 PyTorch forward's gradient.

Staged by scripts/gpu/build-device.sh (which copies the package into .device/py); run on
the device machine from the repository root:

    python3 scripts/gpu/torch-moe-parity.py --bin .device --out "$OUT"

Prints one line per check; exits 1 when a required check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

FAILED: list[str] = []


def bits(values: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def cli_score(
    b: Path, model: Path, seqs: list[list[int]], tp: int, work: Path, moe: str
) -> list[dict]:
    inp, out = work / f"in-{tp}-{moe}.jsonl", work / f"out-{tp}-{moe}.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"id": i, "tokens": s, "prompt_len": 1}) + "\n" for i, s in enumerate(seqs)
        )
    )
    cmd = [str(b / "arbor"), "score", "--device", "cuda", "--model", str(model)]
    cmd += ["--input", str(inp), "--out", str(out)]
    if tp > 1:
        cmd = [str(b / "arbor-launch"), "-n", str(tp), "--", *cmd]
    run(cmd, env={**os.environ, "ARBOR_RANKS_PER_GPU": "auto", "ARBOR_MOE": moe})
    recs = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return sorted(recs, key=lambda r: r["id"])


def make_models(b: Path, work: Path) -> dict[str, Path]:
    models = {}
    for name, arch in (("qwen3_moe", "qwen3-moe"), ("mixtral", "mixtral")):
        d = work / name
        run([str(b / "arbor"), "make-model", "--arch", arch, "--preset", "tiny", "--seed", "7",
             "--out", str(d)])  # fmt: skip
        models[name] = d
        k4 = work / f"{name}_k4"
        shutil.copytree(d, k4)
        config = json.loads((k4 / "config.json").read_text())
        config["num_experts_per_tok"] = 4
        if name == "qwen3_moe":
            config["norm_topk_prob"] = False
        (k4 / "config.json").write_text(json.dumps(config))
        models[f"{name}_k4"] = k4
    return models


def parity(b: Path, work: Path) -> dict:
    from arbor.torch import CausalLM, reference

    results: dict = {}
    g = torch.Generator().manual_seed(11)
    lengths = [600, 33, 7, 2]
    for name, model_dir in make_models(b, work).items():
        model = CausalLM.from_pretrained(model_dir, device="cuda")
        ids = torch.randint(0, 258, (len(lengths), max(lengths)), generator=g).cuda()
        mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long().cuda()
        lp = model.token_logprobs(ids, attention_mask=mask)
        seqs = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        ours = [lp[i, : n - 1].tolist() for i, n in enumerate(lengths)]
        total = sum(n - 1 for n in lengths)
        r: dict = {"tokens": total}
        for tp in (1, 2, 4):
            recs = cli_score(b, model_dir, seqs, tp, work, "host")
            equal = sum(
                a == c
                for i in range(len(lengths))
                for a, c in zip(bits(ours[i]), bits(recs[i]["logprobs"]), strict=True)
            )
            r[f"host_tp{tp}_equal"] = equal
            check(
                f"{name} token_logprobs == ARBOR_MOE=host arbor score --device cuda at TP {tp}",
                equal == total,
                f"{equal}/{total}",
            )
        recs = cli_score(b, model_dir, seqs, 1, work, "device")
        flat_ours = torch.tensor([v for row in ours for v in row])
        flat_dev = torch.tensor([v for rec in recs for v in rec["logprobs"]])
        equal = int((flat_ours.view(torch.int32) == flat_dev.view(torch.int32)).sum())
        diff = float((flat_ours - flat_dev).abs().max())
        r["device_tp1_equal"], r["device_tp1_max_abs_dlogp"] = equal, diff
        print(
            f"INFO {name} against the engine's device routing (grouped GEMM), TP 1: "
            f"{equal}/{total} bit-equal, max |Δ log p| {diff:.3g}",
            flush=True,
        )
        # The backward, against the plain f32 forward's gradient (the same weighting of
        # the real positions); a layer's experts compared together (a token near a
        # routing tie may take another expert in the plain forward).
        gen = torch.Generator("cuda").manual_seed(1)
        w = torch.randn(lp.shape, device="cuda", generator=gen) * mask[:, 1:].float()
        (lp * w).sum().backward()
        grads = {
            n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        f32 = CausalLM.from_pretrained(model_dir, device="cuda", dtype=torch.float32)
        (reference.token_logprobs(f32, ids, dtype=torch.float32) * w).sum().backward()
        groups: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for n, p in f32.named_parameters():
            key = n.split(".experts.")[0] + ".experts" if ".experts." in n else n
            a, c = groups.setdefault(key, ([], []))
            a.append(grads.get(n, torch.zeros_like(p)).flatten())
            c.append((p.grad if p.grad is not None else torch.zeros_like(p)).flatten())
        cos, worst = min(
            (float(F.cosine_similarity(torch.cat(a), torch.cat(c), dim=0)), k)
            for k, (a, c) in groups.items()
        )
        r["grad_min_cosine_vs_plain_f32"] = cos
        check(f"{name} gradient close to the plain f32 forward's", cos > 0.98, f"{cos:.5f} {worst}")
        results[name] = r
    return results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bin", type=Path, default=Path(".device"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    a = ap.parse_args()
    sys.path.insert(0, str((a.bin / "py").resolve()))
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        result["parity"] = parity(a.bin, Path(tmp))
    (a.out / "torch-moe-parity.json").write_text(json.dumps(result, indent=1))
    print("FAILED: " + ", ".join(FAILED) if FAILED else "ALL PASS")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
