"""ncu_source_top.py's parsing and sums: python3 -m pytest scripts/bench/test_ncu_source_top.py"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ncu_source_top import opcode, read_rows, summarize

HERE = Path(__file__).resolve().parent

# The shape of `ncu --page source --csv --print-source sass`: a kernel line, then the
# table (columns abridged).
CSV = """\
"Kernel Name","arbor_gemm_wg_tma_128x128"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x10","@!P0  BRA 0x90","300","280"
"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x1","1,200","1,100"
"0x30","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","400","10"
"0x40","WARPGROUP.DEPBAR.LE gsb0, 0x1","100","90"
"0x50","FADD R1, R2, R3","0","0"
"""


def test_opcode_drops_the_predicate() -> None:
    assert opcode("@!P0  BRA 0x90") == "BRA"
    assert (
        opcode("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24")
        == "HGMMA.64x128x16.F32.BF16"
    )
    assert opcode("EXIT ;") == "EXIT"
    assert opcode("") == "?"


def test_summary_ranks_instructions_and_sums_opcodes() -> None:
    out = summarize(read_rows(CSV), top=3)
    lines = out.splitlines()
    assert lines[0] == "2000 stall samples over 5 instructions"
    # 1,200 of 2,000 (thousands separators parsed), largest first, at most `top`.
    assert lines[2].split()[:3] == ["60.0", "%", "0x20"]
    assert lines[3].split()[:3] == ["20.0", "%", "0x30"]
    assert len([line for line in lines if line.startswith("  ") and "0x" in line]) == 3
    by_op = lines[lines.index("by opcode:") + 1 :]
    # The two DEPBAR sites sum to 1,300 of 2,000.
    assert by_op[0].split() == ["65.0", "%", "WARPGROUP.DEPBAR.LE"]
    assert by_op[1].split() == ["20.0", "%", "HGMMA.64x128x16.F32.BF16"]


def test_input_without_a_source_table_is_refused() -> None:
    with pytest.raises(SystemExit, match="no source table"):
        read_rows('"Kernel Name","x"\n"a","b"\n')
    with pytest.raises(SystemExit, match="Warp Stall Sampling"):
        summarize(read_rows('"# Address","Source"\n"0x10","NOP"\n'), top=3)


def test_the_script_reads_standard_input() -> None:
    got = subprocess.run(
        [sys.executable, str(HERE / "ncu_source_top.py"), "--top", "2"],
        input=CSV,
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.startswith("2000 stall samples")
