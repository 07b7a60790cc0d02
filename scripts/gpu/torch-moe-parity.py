#!/usr/bin/env python3
"""`arbor.torch`'s mixture-of-experts models on a GPU: tiny Qwen3-MoE and Mixtral (and each
with 4 experts per token) as `CausalLM` on CUDA tensors, against `arbor score --device
cuda`.

`arbor.torch` routes a CUDA block where the engine does: by default with the engine's
device routing kernel (`CudaOps.moe_route`), its experts through the dense tree GEMM
(the engine's grouped expert GEMM gives the same bits) and the combine in PyTorch (one
multiply and one add per term, in expert order, as the engine's combine kernel); with
`ARBOR_MOE=host` on the host routing of `layers::moe`. Both are checked bit for bit: the
default against `arbor score --device cuda` (device routing, grouped GEMM) at TP 1 (and
the TP sizes of `--device-tp`), `ARBOR_MOE=host` against `ARBOR_MOE=host arbor score
--device cuda` at the TP sizes of `--host-tp` (ranks sharing the GPU). Then the backward
(of the default forward) against the plain f32 PyTorch forward's gradient.

Staged by scripts/gpu/build-device.sh (which copies the package into .device/py); run on
the device machine from the repository root:

    python3 scripts/gpu/torch-moe-parity.py --bin .device --out "$OUT"

`--models qwen3_moe mixtral --host-tp 1 --no-backward` keeps it short. Prints one line
per check; exits 1 when a check fails.
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


def same_bits(ours: list[list[float]], recs: list[dict]) -> tuple[int, float]:
    """Tokens whose log-probs have the same bits, and the largest |Δ log p|."""
    flat_ours = torch.tensor([v for row in ours for v in row])
    flat_cli = torch.tensor([v for rec in recs for v in rec["logprobs"]])
    equal = int((flat_ours.view(torch.int32) == flat_cli.view(torch.int32)).sum())
    return equal, float((flat_ours - flat_cli).abs().max())


def logprobs(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, moe: str
) -> torch.Tensor:
    """The model's token log-probs (with their graph) with `ARBOR_MOE=moe` in this process
    (read by arbor's backend at every block, as the engine reads it)."""
    os.environ["ARBOR_MOE"] = moe
    try:
        return model.token_logprobs(ids, attention_mask=mask)
    finally:
        del os.environ["ARBOR_MOE"]


def parity(b: Path, work: Path, opts: argparse.Namespace) -> dict:
    from arbor.torch import CausalLM, ops, reference

    results: dict = {}
    g = torch.Generator().manual_seed(11)
    lengths = [600, 33, 7, 2]
    for name, model_dir in make_models(b, work).items():
        if opts.models and name not in opts.models:
            continue
        model = CausalLM.from_pretrained(model_dir, device="cuda")
        ids = torch.randint(0, 258, (len(lengths), max(lengths)), generator=g).cuda()
        mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long().cuda()
        seqs = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        total = sum(n - 1 for n in lengths)
        r: dict = {"tokens": total}
        m = model.config.moe
        assert m is not None
        x = torch.zeros(1, model.config.hidden_size, device="cuda")
        os.environ["ARBOR_MOE"] = "device"
        on_device = ops.moe_routes_on_device(
            x, model.config.hidden_size, m.expert_intermediate, m.num_experts, m.top_k
        )
        os.environ["ARBOR_MOE"] = "host"
        on_host = not ops.moe_routes_on_device(
            x, model.config.hidden_size, m.expert_intermediate, m.num_experts, m.top_k
        )
        del os.environ["ARBOR_MOE"]
        check(f"{name} routes on the device by default, on the host with ARBOR_MOE=host",
              on_device and on_host, f"device {on_device}, host {on_host}")  # fmt: skip

        lp = logprobs(model, ids, mask, "host")
        ours = [lp[i, : n - 1].tolist() for i, n in enumerate(lengths)]
        for tp in opts.host_tp:
            equal, diff = same_bits(ours, cli_score(b, model_dir, seqs, tp, work, "host"))
            r[f"host_tp{tp}_equal"] = equal
            check(
                f"{name} ARBOR_MOE=host token_logprobs == ARBOR_MOE=host arbor score "
                f"--device cuda at TP {tp}",
                equal == total,
                f"{equal}/{total}, max |Δ log p| {diff:.3g}",
            )

        lp = logprobs(model, ids, mask, "device")
        ours = [lp[i, : n - 1].tolist() for i, n in enumerate(lengths)]
        for tp in opts.device_tp:
            equal, diff = same_bits(ours, cli_score(b, model_dir, seqs, tp, work, "device"))
            r[f"device_tp{tp}_equal"], r[f"device_tp{tp}_max_abs_dlogp"] = equal, diff
            check(
                f"{name} token_logprobs == arbor score --device cuda (device routing, "
                f"grouped GEMM) at TP {tp}",
                equal == total,
                f"{equal}/{total}, max |Δ log p| {diff:.3g}",
            )
        if opts.no_backward:
            results[name] = r
            continue
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
    ap.add_argument(
        "--models",
        nargs="*",
        default=None,
        help="qwen3_moe, mixtral, qwen3_moe_k4, mixtral_k4 (default: all four)",
    )
    ap.add_argument(
        "--host-tp",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="TP sizes of the ARBOR_MOE=host check (default 1 2 4)",
    )
    ap.add_argument(
        "--device-tp",
        type=int,
        nargs="*",
        default=[1],
        help="TP sizes of the default (device routing) check (default 1)",
    )
    ap.add_argument(
        "--no-backward",
        action="store_true",
        help="skip the gradient check against the plain f32 forward",
    )
    a = ap.parse_args()
    sys.path.insert(0, str((a.bin / "py").resolve()))
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        result["parity"] = parity(a.bin, Path(tmp), a)
    (a.out / "torch-moe-parity.json").write_text(json.dumps(result, indent=1))
    print("FAILED: " + ", ".join(FAILED) if FAILED else "ALL PASS")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
