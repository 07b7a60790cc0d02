"""examples/rl_grpo.py end to end on CPU (the GPU run is scripts/gpu/rl-grpo-gpu.sh): one
trainer process and FSDP2 over two gloo ranks against `arbor serve` at TP 2 on a tiny
model; every token's ratio is exactly 1 and each push changes the weights the next
rollouts run on. A server on other weights than the trainer's must make it fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Cli

SCRIPT = REPO / "examples" / "rl_grpo.py"


def _run(cli: Cli, model: Path, work: Path, *extra: str, ranks: int = 1) -> tuple[int, str]:
    cmd = [str(SCRIPT), "--model", str(model), "--workdir", str(work), "--tp", "2"]
    cmd += ["--arbor", str(cli.arbor), "--launcher", str(cli.launch), "--reward", "even-ids"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*launcher, f"--nproc-per-node={ranks}", *cmd]
    else:
        cmd = [sys.executable, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [*cmd, *extra], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    return out.returncode, out.stdout + out.stderr


def _check_steps(log: str, steps: int) -> None:
    exact = re.findall(r"(\d+)/(\d+) exactly 1\.0, (\d+)/(\d+) log-probs bit-equal", log)
    assert len(exact) == steps, log
    for ones, n, equal, n2 in exact:
        assert ones == n == equal == n2 and int(n) > 0, log
    plain = re.findall(
        r"plain PyTorch bf16 forward, same tokens: (\d+)/(\d+) .* \|dp\| ([\d.]+)", log
    )
    assert len(plain) == steps, log
    # The gap arbor removes: the plain forward's probabilities are off somewhere.
    assert all(float(dp) > 0 for _, _, dp in plain), log
    changed = re.findall(r"push: (\d+)/(\d+) tensors changed", log)
    assert len(changed) == steps and all(int(c) > 0 for c, _ in changed), log
    versions = re.findall(r"pushed (step-\d+) over HTTP", log)
    assert versions == [f"step-{s}" for s in range(1, steps + 1)], log
    assert "OK: the importance ratio was exactly 1.0 on every token" in log


def test_one_trainer_process(cli: Cli, tiny: dict[str, Path], tmp_path: Path) -> None:
    rc, log = _run(cli, tiny["llama"], tmp_path, "--steps", "2")
    assert rc == 0, log
    assert "prompts via text completions; pushes over HTTP" in log
    _check_steps(log, 2)


def test_fsdp2_over_two_gloo_ranks(cli: Cli, tiny: dict[str, Path], tmp_path: Path) -> None:
    # Llama: tiny Qwen3's first rollouts all earn the same reward (no gradient, no change).
    rc, log = _run(cli, tiny["llama"], tmp_path, "--steps", "2", ranks=2)
    assert rc == 0, log
    assert "on FSDP2 over 2 ranks (cpu)" in log
    _check_steps(log, 2)


def test_a_server_on_other_weights_fails(cli: Cli, tiny: dict[str, Path], tmp_path: Path) -> None:
    """The server loads a copy of the model with one weight changed: the rollouts'
    log-probs are not the trainer's, and the script must say so and exit 1."""
    other = tmp_path / "other"
    shutil.copytree(tiny["llama"], other)
    cli.run(1, "make-model", "--preset", "tiny", "--seed", "8", "--out", str(other), "--force")
    wrapper = tmp_path / "arbor-other"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'a=("$@")\n'
        'for i in "${!a[@]}"; do [[ ${a[$i]} == --model ]] && a[$((i + 1))]='
        f"{other}; done\n"
        f'exec {cli.arbor} "${{a[@]}}"\n'
    )
    wrapper.chmod(0o755)
    rc, log = _run(cli, tiny["llama"], tmp_path / "w", "--steps", "1", "--arbor", str(wrapper))
    assert rc == 1, log
    assert "MISMATCH" in log
    exact = re.findall(r"(\d+)/(\d+) exactly 1\.0", log)
    assert len(exact) == 1 and exact[0][0] != exact[0][1], log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_prime_rl_rollout_client_unmodified(
    cli: Cli, tiny: dict[str, Path], tmp_path: Path
) -> None:
    """The rollouts asked for by prime-rl's own client (`renderers`, PyPI), unmodified:
    the trainer's log-probs are still the rollouts', bit for bit."""
    for module in ("renderers", "transformers", "openai"):
        pytest.importorskip(module, reason=f"pip install {module} (prime-rl's client)")
    model = tmp_path / "chat-model"
    shutil.copytree(tiny["llama"], model)
    # The tiny tokenizer's own special tokens, and a chat template to render with.
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "chat_template": template,
            }
        )
    )
    rc, log = _run(cli, model, tmp_path / "work", "--steps", "1", "--client", "renderers")
    assert rc == 0, log
    assert "rollouts by prime-rl's client (renderers -> /inference/v1/generate)" in log
    _check_steps(log, 1)
