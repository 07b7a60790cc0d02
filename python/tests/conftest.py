"""Shared fixtures: the arbor binaries, tiny models made by `arbor make-model`, and the
CLI's own scores to compare with.

The binaries are `$ARBOR_BIN` and `$ARBOR_LAUNCH_BIN`, else `target/release/` of this
repository (`$CARGO_TARGET_DIR/release/` when set), built with `cargo build --release`
when missing.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHS = ["llama", "qwen2", "qwen3"]


def _binaries() -> tuple[Path, Path]:
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"
    arbor = Path(os.environ.get("ARBOR_BIN", target / "arbor"))
    launch = Path(os.environ.get("ARBOR_LAUNCH_BIN", target / "arbor-launch"))
    if not (arbor.is_file() and launch.is_file()):
        subprocess.run(
            ["cargo", "build", "--release", "--bin", "arbor", "--bin", "arbor-launch"],
            cwd=REPO,
            check=True,
        )
    return arbor, launch


@dataclass(frozen=True)
class Cli:
    arbor: Path
    launch: Path

    def run(self, tp: int, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.arbor), *args]
        if tp > 1:
            cmd = [str(self.launch), "-n", str(tp), "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
        return out

    def score(
        self, model: Path, seqs: list[list[int]], prompt_lens: list[int], tp: int, work: Path
    ) -> list[dict]:
        """`arbor score` at TP `tp`: one record per sequence (logprobs, logits_digest)."""
        work.mkdir(parents=True, exist_ok=True)
        inp, out = work / f"in-tp{tp}.jsonl", work / f"out-tp{tp}.jsonl"
        inp.write_text(
            "".join(
                json.dumps({"id": i, "tokens": s, "prompt_len": p}) + "\n"
                for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True))
            )
        )
        self.run(tp, "score", "--model", str(model), "--input", str(inp), "--out", str(out))
        recs = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        return sorted(recs, key=lambda r: r["id"])


def f32_bits(values: list[float]) -> list[int]:
    """The bits of each value as an f32 (JSON's shortest decimals round-trip exactly)."""
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


@pytest.fixture(scope="session")
def cli() -> Cli:
    return Cli(*_binaries())


@pytest.fixture(scope="session")
def tiny(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models of every architecture, by name."""
    root = tmp_path_factory.mktemp("models")
    models = {}
    for arch in ARCHS:
        models[arch] = root / arch
        cli.run(
            1,
            "make-model",
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--seed",
            "7",
            "--out",
            str(models[arch]),
        )
    return models


@pytest.fixture(scope="session")
def moe(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny mixture-of-experts models: Qwen3-MoE (layer 0 dense) and Mixtral, 8 experts,
    2 a token; and each with 4 a token (`*_k4`: the same weights, `num_experts_per_tok` 4
    in config.json; Qwen3-MoE's without renormalisation)."""
    root = tmp_path_factory.mktemp("moe")
    models = {}
    for name, arch in (("qwen3_moe", "qwen3-moe"), ("mixtral", "mixtral")):
        models[name] = root / name
        out = str(models[name])
        cli.run(1, "make-model", "--arch", arch, "--preset", "tiny", "--seed", "7", "--out", out)
        k4 = root / f"{name}_k4"
        shutil.copytree(models[name], k4)
        config = json.loads((k4 / "config.json").read_text())
        config["num_experts_per_tok"] = 4
        if name == "qwen3_moe":
            config["norm_topk_prob"] = False
        (k4 / "config.json").write_text(json.dumps(config))
        models[f"{name}_k4"] = k4
    return models
