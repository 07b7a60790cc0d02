"""Client of scripts/gpu/routed-experts-check.sh: SGLang `/generate` requests with
`return_routed_experts`, their answers written as JSON, and a comparison of those files.

    routed-experts-check.py ask PORT MODEL_DIR OUT.json    # one server's answers
    routed-experts-check.py compare A.json B.json ...

`meta_info.routed_experts` is decoded as slime decodes it (`slime/utils/misc.py`
`decode_int32_meta_array`: base64 of little-endian int32) and shaped
[prompt + output - 1, layers, top_k] as `slime/utils/types.py` reshapes it.
"""

import base64
import json
import struct
import sys
import urllib.request
from typing import Any

PROMPTS: list[list[int]] = [
    [(i * 7919 + j * 104729 + 13) % 250 + 1 for j in range(4 + (i * 37) % 90)]
    for i in range(6)
]
MAX_NEW = 24


def post(port: int, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def body(ids: Any, routed: bool) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {
            "temperature": 0.8,
            "top_p": 0.95,
            "max_new_tokens": MAX_NEW,
            "sampling_seed": 11,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "return_routed_experts": routed,
    }


def decode(item: dict[str, Any], layers: int, top_k: int) -> list[list[list[int]]]:
    raw = base64.b64decode(item["meta_info"]["routed_experts"].encode("ascii"))
    ids = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    rows = (
        item["meta_info"]["prompt_tokens"] + item["meta_info"]["completion_tokens"] - 1
    )
    if len(ids) != rows * layers * top_k:
        raise SystemExit(f"{len(ids)} ids for {rows} rows of {layers} x {top_k}")
    per = layers * top_k
    return [
        [ids[r * per + l * top_k : r * per + (l + 1) * top_k] for l in range(layers)]
        for r in range(rows)
    ]


def bits(item: dict[str, Any]) -> list[list[Any]]:
    # The log-prob's float repr round-trips its f32 bits.
    return [[e[1], e[0]] for e in item["meta_info"]["output_token_logprobs"]]


def ask(port: int, model: str, out: str) -> None:
    with open(f"{model}/config.json") as f:
        cfg = json.load(f)
    layers, top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    answers: dict[str, Any] = {"alone": [], "batch": []}
    for p in PROMPTS:
        routed = post(port, body(p, True))
        plain = post(port, body(p, False))
        if bits(routed) != bits(plain):
            raise SystemExit(
                f"asking for routed experts changed the tokens of a prompt of {len(p)}"
            )
        answers["alone"].append(
            {"bits": bits(routed), "routes": decode(routed, layers, top_k)}
        )
    # The same prompts in one batch: item i keys its draw as choice i, so item 0 is the
    # first prompt alone; every item's prompt rows are those of its prompt alone.
    for it in sorted(post(port, body(PROMPTS, True)), key=lambda x: x["index"]):
        answers["batch"].append({"bits": bits(it), "routes": decode(it, layers, top_k)})
    with open(out, "w") as f:
        json.dump(answers, f)
    rows = sum(len(a["routes"]) for a in answers["alone"])
    print(
        f"{out}: {len(PROMPTS)} prompts alone and in a batch, {rows} routed rows of {layers} x {top_k}"
    )


def compare(files: list[str]) -> None:
    runs = []
    for name in files:
        with open(name) as f:
            runs.append(json.load(f))
    base = runs[0]
    failed = False
    for name, run in zip(files[1:], runs[1:]):
        for kind in ("alone", "batch"):
            for i, (a, b) in enumerate(zip(base[kind], run[kind])):
                if a["routes"] != b["routes"]:
                    pairs = enumerate(zip(a["routes"], b["routes"]))
                    r = next(
                        (r for r, (x, y) in pairs if x != y),
                        min(len(a["routes"]), len(b["routes"])),
                    )
                    print(
                        f"FAIL  {name} {kind} {i}: routes differ from {files[0]} at row {r}"
                    )
                    failed = True
                if a["bits"] != b["bits"]:
                    print(f"FAIL  {name} {kind} {i}: tokens differ from {files[0]}")
                    failed = True
    # Within each run: the batch's prompt rows are those of the prompts alone, and item 0
    # (keyed as the first prompt alone) is that answer whole.
    for name, run in zip(files, runs):
        for i, (alone, item) in enumerate(zip(run["alone"], run["batch"])):
            n = len(PROMPTS[i])
            if alone["routes"][:n] != item["routes"][:n]:
                print(f"FAIL  {name}: prompt {i}'s rows differ alone and in a batch")
                failed = True
        if run["alone"][0] != run["batch"][0]:
            print(f"FAIL  {name}: the batch's item 0 differs from its prompt alone")
            failed = True
    if failed:
        raise SystemExit(1)
    print(f"PASS  routed experts and tokens identical across {', '.join(files)}")


if __name__ == "__main__":
    if sys.argv[1] == "ask":
        ask(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "compare":
        compare(sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}: ask or compare")
