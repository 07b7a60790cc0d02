"""roofline.py's formulas and classification: python3 -m pytest scripts/bench/test_roofline.py"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import roofline
from ncu_steps import cut_steps, read_ncu
from roofline import Cost, Model, Shape

HERE = Path(__file__).resolve().parent
# A real `bench decode --batch 8 --prompt-len 1024 --steps 2` run, invariant numerics, H100:
# steps 0-3 warm up on a 16-token request, step 4 is the prefill of 8 × 1024 tokens,
# step 5 a decode step at batch 8.
REAL = HERE / "testdata" / "ncu-invariant-b8.csv"
MD = Model()

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def write_csv(path: Path, launches: list[tuple[str, float]]) -> str:
    """Nsight Compute's details page (as `--csv --print-units base` writes it), times in ns."""
    lines = ["==PROF== Connected to process 1 (arbor)", HEAD]
    for i, (name, ns) in enumerate(launches):
        lines.append(f'"{i}","1","arbor","127.0.0.1","{name}","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0",'
                     f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,.0f}"')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def invariant_layer(attn: list[str], last: bool) -> list[str]:
    gemm = "arbor_gemm_wg_tma_128x128"
    return [gemm, "qkv_rope_kv4_kernel", *attn, gemm, "add_rms_norm_kernel", gemm, gemm,
            "add_assign_kernel" if last else "add_rms_norm_kernel"]


def test_gemm_cost_counts_weights_inputs_and_f32_output() -> None:
    c = roofline.gemm_cost(8192, 4096, 4096)
    assert c.flops == 2 * 8192 * 4096 * 4096 == 274_877_906_944
    # W 4096·4096 bf16 + X 8192·4096 bf16 + out 8192·4096 f32
    assert c.bytes == 33_554_432 + 67_108_864 + 134_217_728


def test_o_gemm_of_100_us_at_m_8192_from_a_csv(tmp_path: Path) -> None:
    names = ["embedding_kernel", "rms_norm_kernel",
             *invariant_layer(["pa_prefill96_hd128"], last=True),
             "select_rows_kernel", "rms_norm_kernel", "arbor_gemm_wg_cluster2_64x256", "row_stats_kernel"]
    times = [10_000.0] * len(names)
    o_at = names.index("pa_prefill96_hd128") + 1
    times[o_at] = 100_000.0  # 100 µs
    path = write_csv(tmp_path / "p.csv", list(zip(names, times, strict=True)))
    (step,) = cut_steps(read_ncu(path))
    items = roofline.classify(step, MD, Shape(tokens=8192, batch=8, context=1024, lm_rows=8))
    o = items[o_at]
    assert o.label == "o GEMM 4096×4096"
    assert o.cost == Cost(274_877_906_944, 234_881_024)
    row = next(r for r in roofline.group(items) if r.label.startswith("o GEMM"))
    flops_peak, bw_peak, _ = roofline.PEAKS["h100"]
    us, tf, bw, nearer, floor = roofline.cells(row, flops_peak, bw_peak)
    # 2.749e11 FLOP in 100 µs = 2749 TFLOP/s (278 % of 989); 234.9 MB in 100 µs = 2.35 TB/s
    assert (us, tf, bw, nearer) == ("100.0", "2749 (278 %)", "2.35 (70 %)", "compute")
    assert floor == f"{274_877_906_944 / 989e12 * 1e6:.1f}"  # 277.9: compute bound
    labels = [i.label for i in items]
    assert labels[:3] == ["embedding", "RMSNorm (layer 0 input)", "q/k/v GEMM 4096×6144"]
    assert labels[-4:] == ["select rows", "RMSNorm (final)", "LM head GEMM 4096×128256", "row stats"]
    lm = items[-2].cost
    assert lm is not None and lm.flops == 2 * 8 * 128256 * 4096  # the selected rows only
    gu = items[labels.index("gate/up GEMM 4096×28672 + SiLU·mul")].cost
    # The SiLU·mul epilogue writes [M, I] f32 + bf16, not [M, 2I] f32.
    assert gu == Cost(2 * 8192 * 28672 * 4096, 28672 * 4096 * 2 + 8192 * 4096 * 2 + 8192 * 14336 * 6)


def test_prefill_attention_is_causal_and_reads_each_sequence_once_per_kv_head() -> None:
    c = roofline.prefill_attention_cost(MD, Shape(tokens=8192, batch=8, context=1024, lm_rows=8))
    assert c.flops == 4 * 8 * 32 * 1024 * 1024 * 128 / 2 == 68_719_476_736
    kv = 8 * 1024 * 8 * 128 * 2 * 2
    q = 8192 * 32 * 128 * 4
    out = 8192 * 32 * 128 * (4 + 2)
    assert c.bytes == kv + q + out
    # A chunk of 2 tokens after 2 cached ones: 2·2 full rows of scores plus the 2²/2 triangle.
    c = roofline.prefill_attention_cost(MD, Shape(tokens=2, batch=1, context=4, lm_rows=1))
    assert c.flops == 4 * 32 * 128 * (2 * 2 + 2)
    assert c.bytes == 4 * 8 * 128 * 4 + 2 * 32 * 128 * 10


def test_decode_attention_splits_and_combine() -> None:
    sh = Shape(tokens=8, batch=8, context=1025, lm_rows=8)
    assert roofline.splits(512) == 1 and roofline.splits(513) == 2 and roofline.splits(1025) == 3
    c = roofline.decode_attention_cost(MD, sh)
    assert c.flops == 4 * 8 * 32 * 1025 * 128 == 134_348_800
    parts = 8 * 32 * 3 * (128 + 2) * 4
    assert c.bytes == 8 * 1025 * 8 * 128 * 4 + 8 * 32 * 128 * 4 + parts
    assert roofline.combine_cost(MD, sh) == Cost(0, parts + 8 * 32 * 128 * 6)
    one = Shape(tokens=8, batch=8, context=512, lm_rows=8)
    assert roofline.combine_cost(MD, one) == Cost(0, 0)
    assert roofline.decode_attention_cost(MD, one).bytes == 8 * 512 * 8 * 128 * 4 + 8 * 32 * 128 * 10


def test_norms_and_elementwise_bytes() -> None:
    assert roofline.norm_cost(MD, 8, add=True).bytes == 8 * 4096 * 18 + 4096 * 4
    assert roofline.norm_cost(MD, 8, add=False).bytes == 8 * 4096 * 10 + 4096 * 4
    # q/k/v f32 + cos/sin in, rotated q f32 and bf16 k, v out
    assert roofline.rope_cost(MD, 8).bytes == 8 * 6144 * 4 + 8 * 128 * 4 + 8 * 4096 * 4 + 8 * 1024 * 2 * 2


def test_fast_decode_step_and_what_is_not_classified(tmp_path: Path) -> None:
    split = "nvjet_sm90_tss_64x8_64x16_2x1_v_bz_splitK_TNT"
    red = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(int, int)"
    layer = ["nvjet_sm90_tss_64x8_64x16_4x1_v_bz_TNT", "qkv_rope_kv4_kernel", "pa_decode1_hd128", "pa_combine",
             split, red, "add_rms_norm_kernel", "nvjet_sm90_tss_128x8_64x12_2x1_v_bz_TNT",
             "silu_mul_pairs_kernel", split, red]
    names = ["embedding_kernel", "rms_norm_kernel", *layer, "add_rms_norm_kernel", *layer,
             "mystery_kernel", "add_assign_kernel", "rms_norm_kernel", "nvjet_sm90_tss_384x8_64x4_2x1_v_bz_TNT",
             "row_stats_kernel"]
    path = write_csv(tmp_path / "f.csv", [(n, 5_000.0) for n in names])
    (step,) = cut_steps(read_ncu(path))
    assert roofline.step_mode(step) == "decode"
    items = roofline.classify(step, MD, Shape(tokens=8, batch=8, context=1025, lm_rows=8))
    labels = [i.label for i in items]
    assert labels[2:13] == [
        "q/k/v GEMM 4096×6144", "RoPE + KV write", "attention decode", "attention combine",
        "o GEMM 4096×4096", "o split-K reduce", "add + RMSNorm (post-attention)",
        "gate/up GEMM 4096×28672", "SiLU·mul", "down GEMM 14336×4096", "down split-K reduce"]
    assert labels[13] == "add + RMSNorm (next layer's input)"
    gu = items[9].cost
    # Without the epilogue the GEMM writes [M, 2I] f32; SiLU·mul reads it and writes [M, I] f32 + bf16.
    assert gu == roofline.gemm_cost(8, 28672, 4096) and gu.bytes == 28672 * 4096 * 2 + 8 * 4096 * 2 + 8 * 28672 * 4
    assert items[10].cost == Cost(0, 8 * 28672 * 4 + 8 * 14336 * 6)
    # Reduces and the unknown kernel keep their time but get no count.
    loose = [i for i in items if i.cost is None]
    assert [i.label for i in loose] == ["o split-K reduce", "down split-K reduce"] * 2 + ["mystery_kernel"]
    text = roofline.report(items, "h100", markdown=True)
    assert "| o split-K reduce `void cublasLt::splitKreduce_kernel<32, 16, int, float, ...` | 2 | 5.0 | — | — | — | — |" in text
    assert "| `mystery_kernel` | 1 | 5.0 | — | — | — | — |" in text
    assert f"{len(names)} launches;" in text and "5 launches (25 µs) with time only" in text
    # The sum of floors counts the classified launches only.
    flops_peak, bw_peak, _ = roofline.PEAKS["h100"]
    floors = sum(roofline.floor_s(i.cost, flops_peak, bw_peak) for i in items if i.cost is not None) * 1e6
    assert f"floors {floors:.0f} µs" in text


def test_a_gemm_out_of_place_is_not_given_a_shape(tmp_path: Path) -> None:
    names = ["embedding_kernel", "arbor_gemm_wg_tma_128x128", "row_stats_kernel", "rms_norm_kernel",
             "add_assign_kernel", "row_stats_kernel"]
    path = write_csv(tmp_path / "g.csv", [(n, 1_000.0) for n in names])
    items = roofline.classify(cut_steps(read_ncu(path))[0], MD, Shape(1, 1, 1, 1))
    assert items[1].label.startswith("GEMM?") and items[1].cost is None


def test_real_invariant_run_is_classified_whole() -> None:
    steps = cut_steps(read_ncu(str(REAL)))
    assert [len(s) for s in steps] == [262, 261, 261, 261, 262, 293]
    assert roofline.pick_step(steps, None) == 4 and roofline.pick_step(steps, "last") == 5
    for i, sh in ((4, Shape(8192, 8, 1024, 8)), (5, Shape(8, 8, 1025, 8))):
        items = roofline.classify(steps[i], MD, sh)
        assert all(c.cost is not None for c in items), [c.name for c in items if c.cost is None]
        rows = {r.label: r.calls for r in roofline.group(items)}
        for gemm in ("q/k/v GEMM 4096×6144", "o GEMM 4096×4096", "gate/up GEMM 4096×28672 + SiLU·mul",
                     "down GEMM 14336×4096"):
            assert rows[gemm] == 32
        assert rows["LM head GEMM 4096×128256"] == 1
        assert rows["attention prefill" if i == 4 else "attention decode"] == 32


def test_cli_needs_the_decode_context(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--context"):
        roofline.main([str(REAL), "--step", "last", "--tokens", "8"])
    roofline.main([str(REAL), "--tokens", "8192", "--batch", "8", "--markdown"])
    out = capsys.readouterr().out
    assert out.startswith("step 4 (of steps 0–5) in ") and "prefill of 8 × 1024 tokens" in out
    assert "| q/k/v GEMM 4096×6144 `arbor_gemm_wg_tma_128x128` | 32 | 634.1 | 650 (66 %) | 0.50 (15 %) |" in out


def test_profile_report_still_reads_the_csv() -> None:
    r = subprocess.run([sys.executable, str(HERE / "profile-report.py"), "arbor-steps", str(REAL)],
                       capture_output=True, text=True, check=True)
    assert "arbor step 4: 228554 µs of kernels in 262 launches" in r.stdout
