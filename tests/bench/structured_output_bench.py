#!/usr/bin/env python3
"""Structured output's cost in serving: inter-token latency (ITL) of chat completions constrained
by a nested JSON Schema against the same requests unconstrained, interleaved in one run on one
server, one request at a time (the ratio is the grammar's per-token cost, not batching's).

  .venv/bin/python tests/bench/structured_output_bench.py --url http://127.0.0.1:8000 \\
      --model smollm2 --requests 10 --max-tokens 128

Each round sends the constrained request (response_format json_schema, strict) and then the
same prompt unconstrained with ignore_eos and max_tokens set to the number of tokens the
constrained one produced, so both generate the same number of tokens after the same prompt.
ITL = gap between consecutive streamed chunks (one token each); the first round of each kind
is a warm-up. Every constrained output is parsed and validated against the schema (jsonschema)
and a failure is reported. The first request with a schema never seen before is timed on its
own (TTFT cold: the schema's compile and first masks) against the same schema again (warm)
and no schema, with the prompt already in the prefix cache.
"""
import argparse
import json
import statistics
import sys
import time
import uuid

try:
    import jsonschema
    import requests
except ImportError:  # pragma: no cover
    sys.exit("structured_output_bench needs requests and jsonschema: use the project's .venv")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 60},
                           "city": {"type": "string", "maxLength": 40},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                               "status": {"enum": ["open", "shipped", "delivered"]},
                               "total": {"type": "number", "minimum": 0}},
                "required": ["id", "status", "total"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "vip": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "orders", "vip"],
    "additionalProperties": False,
}

PROMPTS = [
    "Invent a customer of a pottery shop and describe them as JSON.",
    "Give me a JSON record for a customer who bought two vases.",
    "Describe a regular customer of a kiln supplier in JSON.",
    "Make up a customer from Lisbon with one open order, as JSON.",
]


def stream(url, body, timeout):
    """Streams one chat completion; returns (ttft_s, [gaps_s], text, n_chunks)."""
    body = dict(body, stream=True)
    t0 = time.perf_counter()
    last, ttft, gaps, text, n = None, None, [], [], 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            delta = chunk["choices"][0].get("delta", {}).get("content") or ""
            if not delta:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            text.append(delta)
            n += 1
    return ttft, gaps, "".join(text), n


def summary(gaps):
    if not gaps:
        return float("nan"), float("nan"), float("nan")
    g = sorted(gaps)
    return (statistics.mean(g) * 1e3, g[len(g) // 2] * 1e3, g[min(len(g) - 1, int(0.99 * len(g)))] * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=10, help="rounds (each: one of each kind)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()

    def body(prompt, schema=None, max_tokens=a.max_tokens, ignore_eos=False):
        b = {"model": a.model, "messages": [{"role": "user", "content": prompt}],
             "max_tokens": max_tokens, "temperature": 0.7, "seed": 7}
        if schema is not None:
            b["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "customer", "schema": schema, "strict": True}}
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    # Cold vs warm: a schema this server has never seen (a fresh description), then again, then
    # none; the prompt is in the prefix cache for all three (the first request puts it there).
    fresh = dict(SCHEMA, description=f"run {uuid.uuid4()}")
    stream(a.url, body(PROMPTS[0], None, max_tokens=2), a.timeout)
    cold_ttft, _, _, _ = stream(a.url, body(PROMPTS[0], fresh, max_tokens=8), a.timeout)
    warm_ttft, _, _, _ = stream(a.url, body(PROMPTS[0], fresh, max_tokens=8), a.timeout)
    plain_ttft, _, _, _ = stream(a.url, body(PROMPTS[0], None, max_tokens=8), a.timeout)

    gaps_c, gaps_u, invalid, lengths = [], [], [], []
    for i in range(a.requests + 1):
        prompt = PROMPTS[i % len(PROMPTS)]
        _, gc, text, n = stream(a.url, body(prompt, SCHEMA), a.timeout)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            if n < a.max_tokens:  # a cut-off output (max_tokens) cannot be whole
                invalid.append(f"round {i}: {e.__class__.__name__}: {str(e)[:120]} in {text[:200]!r}")
        _, gu, _, _ = stream(a.url, body(prompt, None, max_tokens=max(n, 2), ignore_eos=True), a.timeout)
        if i == 0:
            continue  # warm-up
        gaps_c += gc
        gaps_u += gu
        lengths.append(n)

    mc, pc, qc = summary(gaps_c)
    mu, pu, qu = summary(gaps_u)
    print(f"server {a.url}, model {a.model}, {a.requests} rounds, one request at a time")
    print(f"tokens per constrained output: mean {statistics.mean(lengths):.0f} "
          f"(min {min(lengths)}, max {max(lengths)})")
    print(f"{'':14s} {'ITL mean ms':>12s} {'p50 ms':>8s} {'p99 ms':>8s}")
    print(f"{'json_schema':14s} {mc:12.2f} {pc:8.2f} {qc:8.2f}")
    print(f"{'unconstrained':14s} {mu:12.2f} {pu:8.2f} {qu:8.2f}")
    print(f"ratio (schema / unconstrained): mean {mc / mu:.3f}, p50 {pc / pu:.3f}, p99 {qc / qu:.3f}")
    print(f"TTFT with a new schema {cold_ttft * 1e3:.1f} ms, same schema again "
          f"{warm_ttft * 1e3:.1f} ms, no schema {plain_ttft * 1e3:.1f} ms")
    print(f"outputs that fail to parse or validate: {len(invalid)}")
    for line in invalid:
        print("  " + line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"itl_ms": {"schema": [mc, pc, qc], "plain": [mu, pu, qu]},
                       "ttft_ms": {"cold": cold_ttft * 1e3, "warm": warm_ttft * 1e3,
                                   "plain": plain_ttft * 1e3},
                       "invalid": invalid, "lengths": lengths}, f, indent=1)
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
