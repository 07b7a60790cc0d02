#!/usr/bin/env python3
"""A request alone == the same request under load, against a running `arbor serve`.

Sends the probe request once with nothing else running, then starts --clients threads that
send --load-requests requests of random lengths, and sends the probe --probes more times
while that load runs (each one only once enough load requests are in flight). Every
probe's choice (tokens, text, log-probs with top-N, logits digests, the prompt's
teacher-forced log-probs and digests, finish reason) must equal the lone one's exactly.

Prints one line per probe and a verdict; exits 1 if any probe differs, any request fails,
or a probe was not sent under load. Standard library only; loopback only.

Usage: serve-alone-vs-load.py --addr 127.0.0.1:PORT --vocab N [--clients 16]
       [--load-requests 96] [--probes 4] [--wait SECONDS] [--out DIR]
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request

COMPARED = [
    "token_ids",
    "text",
    "logprobs",
    "logits_digest",
    "prompt_logprobs",
    "prompt_logits_digest",
    "finish_reason",
]


def post(addr, body, timeout=300):
    req = urllib.request.Request(
        f"http://{addr}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from e


def choice(resp):
    c = resp["choices"][0]
    return {k: c.get(k) for k in COMPARED}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--load-requests", type=int, default=96)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--out", default=None, help="directory for the probe responses")
    ap.add_argument("--wait", type=float, default=0, help="seconds to wait for /health")
    a = ap.parse_args()
    host = a.addr.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        sys.exit(f"--addr {a.addr}: only loopback servers are loaded")
    deadline = time.time() + a.wait
    while True:
        try:
            with urllib.request.urlopen(f"http://{a.addr}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            sys.exit(f"FAIL: the server at {a.addr} did not answer /health within {a.wait:.0f} s")
        time.sleep(0.5)
    rng = random.Random(20261122)
    vocab = max(a.vocab, 3)
    probe = {
        "prompt": [rng.randrange(1, vocab) for _ in range(37)],
        "max_tokens": 24,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 11,
        "logprobs": 3,
        "prompt_logprobs": True,
    }
    t0 = time.time()
    alone = choice(post(a.addr, probe))
    print(f"probe alone: {len(alone['token_ids'] or [])} tokens in {time.time() - t0:.2f} s")

    load = []
    for i in range(a.load_requests):
        load.append(
            {
                "prompt": [rng.randrange(1, vocab) for _ in range(rng.randint(4, 64))],
                "max_tokens": rng.randint(4, 32),
                "temperature": 0.8,
                "seed": i,
                "logprobs": 1,
            }
        )
    lock = threading.Lock()
    state = {"next": 0, "in_flight": 0, "done": 0, "failed": [], "stop": False}

    # The load runs until every probe is answered (at least --load-requests requests, more
    # when the server is fast), so that every probe meets load.
    def client():
        while True:
            with lock:
                if state["stop"] or (state["next"] >= len(load) and results_done[0]):
                    return
                body = load[state["next"] % len(load)]
                state["next"] += 1
                state["in_flight"] += 1
            try:
                post(a.addr, body)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    state["failed"].append(str(e))
            finally:
                with lock:
                    state["in_flight"] -= 1
                    state["done"] += 1

    results_done = [False]
    threads = [threading.Thread(target=client, daemon=True) for _ in range(a.clients)]
    for t in threads:
        t.start()
    want_in_flight = max(1, a.clients // 2)
    results = []
    for i in range(a.probes):
        deadline = time.time() + 60
        while True:
            with lock:
                flying = state["in_flight"]
            if flying >= want_in_flight or time.time() > deadline:
                break
            time.sleep(0.005)
        t1 = time.time()
        got = choice(post(a.addr, probe))
        with lock:
            after = state["in_flight"]
        same = got == alone
        results.append((flying, after, same))
        diff = "" if same else " DIFFERS in " + ", ".join(k for k in COMPARED if got[k] != alone[k])
        print(
            f"probe {i + 1}/{a.probes} under load: sent with {flying} load requests in flight "
            f"({after} at its end), {time.time() - t1:.2f} s: "
            f"{'identical to the lone request' if same else 'DIFFERENT'}{diff}"
        )
        if a.out:
            with open(f"{a.out}/probe-{i + 1}.json", "w") as f:
                json.dump(got, f)
        time.sleep(0.05 * (i + 1))
    with lock:
        results_done[0] = True
    for t in threads:
        t.join(timeout=600)
    if a.out:
        with open(f"{a.out}/probe-alone.json", "w") as f:
            json.dump(alone, f)
    bad = []
    if state["failed"]:
        bad.append(f"{len(state['failed'])} load requests failed, first: {state['failed'][0]}")
    if any(not same for _, _, same in results):
        bad.append("a probe under load differs from the lone probe")
    if any(flying == 0 for flying, _, _ in results):
        bad.append("a probe was sent with no load in flight")
    same = sum(1 for r in results if r[2])
    print(
        f"serve alone vs under load: {same}/{len(results)} probes identical to the lone request; "
        f"{state['done']} load requests, {len(state['failed'])} failed"
    )
    if bad:
        print("FAIL: " + "; ".join(bad))
        sys.exit(1)
    print("PASS: a request alone == the same request under load")


if __name__ == "__main__":
    main()
