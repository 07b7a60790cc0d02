"""Push a checkpoint to a running `arbor serve` over HTTP (/update_weights_from_tensor), the
no-NCCL path a trainer without GPUs of its own (or CI) uses. Standard library only: the
model directory's safetensors files are cut into safetensors images of at most --part-bytes
(tensors whole, in file order), posted with commit=false, then one empty commit. A tensor
larger than --part-bytes goes alone in a part of its own: the server's default
--max-weight-upload-bytes takes the model's largest tensor.

  python3 examples/rl_push_http.py --addr 127.0.0.1:8000 --model DIR [--weight-version V]
        [--part-bytes 536870912] [--api-key KEY] [--policy wait|retract|abort]

Prints the parts, the bytes, the seconds to upload and to apply, and arbor's answer.
"""
import argparse
import glob
import json
import os
import struct
import sys
import time
import urllib.error
import urllib.request


def tensors(model_dir):
    """(name, header entry, file, absolute byte offset, size) in file order."""
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        base = 8 + n
        for name, e in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
            a, b = e["data_offsets"]
            yield name, e, path, base + a, b - a


def image(items):
    """A safetensors image of the given (name, entry, path, offset, size) tensors."""
    header, off = {}, 0
    for name, e, _, _, size in items:
        header[name] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + size]}
        off += size
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    out = bytearray(struct.pack("<Q", len(h)) + h)
    for _, _, path, start, size in items:
        with open(path, "rb") as f:
            f.seek(start)
            out += f.read(size)
    return bytes(out)


def post(addr, path, body, key, timeout=3600):
    req = urllib.request.Request(f"http://{addr}{path}", data=body, method="POST")
    req.add_header("Content-Type", "application/octet-stream")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        # arbor's error bodies are OpenAI-style JSON.
        try:
            msg = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = e.reason
        return {"success": False, "status": e.code, "message": msg}
    except (ConnectionError, urllib.error.URLError) as e:
        # A server refusing a body by its Content-Length may close before reading it.
        return {"success": False, "message": f"{e} (a part of {len(body)} bytes: is it "
                "above the server's --max-weight-upload-bytes?)"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--weight-version", default=None)
    ap.add_argument("--part-bytes", type=int, default=512 << 20)
    ap.add_argument("--api-key", default=os.environ.get("ARBOR_API_KEY"))
    ap.add_argument("--policy", default="wait")
    a = ap.parse_args()
    parts, cur, cur_bytes = [], [], 0
    for t in tensors(a.model):
        if cur and cur_bytes + t[4] + (1 << 16) > a.part_bytes:
            parts.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += t[4]
    if cur:
        parts.append(cur)
    if not parts:
        sys.exit(f"no safetensors tensors under {a.model}")
    for p in parts:
        if len(p) == 1 and p[0][4] > a.part_bytes:
            print(f"{p[0][0]}: {p[0][4]} bytes, above --part-bytes: sent alone", file=sys.stderr)
    t0 = time.time()
    sent = 0
    for i, p in enumerate(parts):
        body = image(p)
        sent += len(body)
        r = post(a.addr, "/update_weights_from_tensor?commit=false", body, a.api_key)
        if not r.get("success"):
            sys.exit(f"part {i + 1}/{len(parts)} refused: {r}")
    t1 = time.time()
    q = f"/update_weights_from_tensor?commit=true&policy={a.policy}"
    if a.weight_version:
        q += f"&weight_version={a.weight_version}"
    r = post(a.addr, q, b"", a.api_key)
    t2 = time.time()
    print(f"pushed {sent / 1e9:.2f} GB in {len(parts)} parts: upload {t1 - t0:.2f} s, "
          f"commit {t2 - t1:.2f} s (arbor: {r.get('seconds', 0):.2f} s), total {t2 - t0:.2f} s")
    print(json.dumps(r))
    if not r.get("success"):
        sys.exit(1)


if __name__ == "__main__":
    main()
