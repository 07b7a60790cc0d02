"""Dequantizes raw GGML blocks with the `gguf` Python package (llama.cpp's numpy
implementation), for tests/gguf.rs to compare arbor's dequantizer against.

usage: dequant_ref.py TYPE IN.bin OUT.bin
TYPE is a GGML type name (Q4_1, Q6_K, BF16, ...); IN holds whole blocks; OUT receives the
values as little-endian float32.
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

name, inp, out = sys.argv[1:4]
qtype = GGMLQuantizationType[name]
raw = np.fromfile(inp, dtype=np.uint8)
if qtype == GGMLQuantizationType.F32:
    vals = raw.view(np.float32)
elif qtype == GGMLQuantizationType.F16:
    vals = raw.view(np.float16)
else:
    vals = dequantize(raw.reshape(1, -1), qtype)
np.asarray(vals, dtype="<f4").reshape(-1).tofile(out)
