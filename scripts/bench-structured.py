#!/usr/bin/env python3
"""Cost of constrained decoding, side by side in one run: batches of 8 concurrent requests,
each generating exactly TOKENS tokens, free (ignore_eos) then constrained (a regex and a JSON
schema whose shortest match is longer than TOKENS, so no request ends early), alternating
ROUNDS times on one server. Reports per batch the wall time per decode step and the engine's
per-step time outside the forward pass (`tessera_step_overhead_seconds`, where the masks are
computed and applied), from /metrics. Standard library only.

Usage: scripts/bench-structured.py BASE_URL [TOKENS] [ROUNDS]   (BASE_URL without /v1)
"""

import json
import re
import sys
import threading
import time
import urllib.request

BATCH = 8
PROMPT = "Write a long story about a lighthouse keeper."

CASES = {
    "free": {"ignore_eos": True},
    "regex": {"structured_outputs": {"regex": "[A-Za-z ,.']{2000,4000}"}},
    "json": {
        "structured_outputs": {
            "json": {
                "type": "object",
                "properties": {"chapters": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}},
                "required": ["chapters"],
                "additionalProperties": False,
            }
        }
    },
}


def post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def step_metrics(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics") as r:
        text = r.read().decode()
    out = {}
    for name in ("overhead", "forward"):
        for kind in ("sum", "count"):
            m = re.search(rf"^tessera_step_{name}_seconds_{kind}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            out[f"{name}_{kind}"] = float(m.group(1))
    return out


def batch(base: str, extra: dict, tokens: int) -> tuple[float, dict]:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 1, "seed": 0, **extra}
    results = [None] * BATCH
    before = step_metrics(base)

    def one(i: int) -> None:
        results[i] = post(base, "/v1/completions", {**body, "seed": i})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BATCH)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = step_metrics(base)
    for r in results:
        assert r["usage"]["completion_tokens"] == tokens, r
    delta = {k: after[k] - before[k] for k in after}
    return wall, delta


def main(base: str, tokens: int, rounds: int) -> None:
    batch(base, CASES["free"], 8)  # warm-up
    rows = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, extra in CASES.items():
            rows[name].append(batch(base, extra, tokens))
    print(f"batch {BATCH}, {tokens} tokens per request, {rounds} rounds (medians)")
    print("| requests | wall ms per step | forward ms per step | other ms per step | vs free |")
    print("| --- | --- | --- | --- | --- |")
    free_wall = None
    for name, runs in rows.items():
        med = lambda xs: sorted(xs)[len(xs) // 2]
        wall = med([w / tokens for w, _ in runs]) * 1e3
        fwd = med([d["forward_sum"] / d["forward_count"] for _, d in runs]) * 1e3
        other = med([d["overhead_sum"] / d["overhead_count"] for _, d in runs]) * 1e3
        free_wall = free_wall or wall
        print(f"| {name} | {wall:.2f} | {fwd:.2f} | {other:.3f} | {100 * (wall / free_wall - 1):+.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
