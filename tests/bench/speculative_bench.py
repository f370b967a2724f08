#!/usr/bin/env python3
"""Speculative decoding in serving: generation speed of chat completions with
`speculative: {method: ngram}` (prompt lookup; `--method draft`: the model's draft model)
against the same requests with `speculative: {method: none}`, interleaved in one run on one
server, one request at a time.

  .venv/bin/python tests/bench/speculative_bench.py --url http://127.0.0.1:8000 \\
      --model smollm2 --rounds 3 --num-tokens 4

Two tasks: "rewrite" asks the model to rewrite a piece of code with one change (the answer
copies most of its input, where drafts copied from the prompt are right) and "chat" asks
ordinary questions (little to copy: the cost of drafts that are mostly wrong). Requests are
greedy, so both runs of a prompt produce the same tokens (checked: a difference is reported
and fails the run). Requests stream: decode speed = the tokens after the first over the time
after the first token (what a client sees once the answer starts; the prefill is the same in
both), end-to-end = completion tokens over request time; ratios are summed tokens over
summed time, spec / plain. Within a round the order of
the two runs alternates, so drift in the VM's speed hits both alike. Acceptance comes from
the server's kiln_llm_spec_{draft,accepted}_tokens_total counters.
"""
import argparse
import json
import re
import sys
import time

try:
    import requests
except ImportError:  # pragma: no cover
    sys.exit("speculative_bench needs requests: use the project's .venv")

TOTAL_PRICE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price -= price * item["discount"]
        total += price
    return total * (1 + tax_rate)
'''
INVENTORY = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def report(self):
        for name, count in sorted(self.items.items()):
            print(name, count)
'''
PARSE_QUERY = '''function parseQuery(query) {
  const result = {};
  for (const part of query.split("&")) {
    const [key, value] = part.split("=");
    if (!key) continue;
    result[decodeURIComponent(key)] = decodeURIComponent(value || "");
  }
  return result;
}
'''
# (code, language, change). SmolLM2-135M copies the first three nearly verbatim; the last it
# rewrites freely (an answer that repeats little of its input: the case speculation helps
# least), kept so the figure is not only the easy case.
REWRITE = [
    (INVENTORY, "python", "rename the method `report` to `show`"),
    (INVENTORY, "python", "rename the class to `Stock`"),
    (PARSE_QUERY, "javascript", "rename the function to `parse`"),
    (TOTAL_PRICE, "python", "rename the variable `total` to `acc`"),
]
CHAT = [
    "Tell me about the history of pottery in three short paragraphs.",
    "What should I pack for a week-long hiking trip? Give a list.",
    "Explain how a refrigerator works to a ten-year-old.",
]


def prompts(task):
    if task == "chat":
        return CHAT
    return [f"Rewrite this code with one change: {change}. Reply with the whole code only."
            f"\n\n```{lang}\n{code}```" for code, lang, change in REWRITE]


def metric(url, name, model):
    text = requests.get(url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def run(url, model, prompt, spec, max_tokens, timeout):
    """Streams one greedy chat completion; returns (ttft_s, total_s, completion_tokens, text)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "speculative": spec, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, n = None, [], 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk["choices"][0]["delta"]["content"])
    return ttft or 0.0, time.perf_counter() - t0, n, "".join(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002",
                    help="where /metrics is served (kilnd's metrics port)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lookup-min", type=int, default=0, help="prompt_lookup_min (0: the model's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-tokens", type=int, default=4, help="drafted tokens per step (K)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft"),
                    help="draft: the server's model needs scheduler.speculative.draft_model")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    spec = {"method": a.method, "num_tokens": a.num_tokens}
    if a.lookup_min:
        spec["prompt_lookup_min"] = a.lookup_min
        spec["prompt_lookup_max"] = max(4, a.lookup_min)
    off = {"method": "none"}

    results, mismatches = {}, []
    for task in ("rewrite", "chat"):
        ps = prompts(task)
        for p in ps:  # warm-up: the prompts enter the prefix cache for both kinds alike
            run(a.url, a.model, p, off, 8, a.timeout)
        time_s = {"spec": 0.0, "plain": 0.0}
        decode_s = {"spec": 0.0, "plain": 0.0}
        tokens = {"spec": 0, "plain": 0}
        d0 = metric(a.metrics_url, "kiln_llm_spec_draft_tokens_total", a.model)
        c0 = metric(a.metrics_url, "kiln_llm_spec_accepted_tokens_total", a.model)
        for rnd in range(a.rounds):
            for i, p in enumerate(ps):
                order = ("spec", "plain") if (rnd + i) % 2 == 0 else ("plain", "spec")
                out = {}
                for kind in order:
                    ttft, dt, n, text = run(a.url, a.model, p, spec if kind == "spec" else off,
                                            a.max_tokens, a.timeout)
                    time_s[kind] += dt
                    decode_s[kind] += dt - ttft
                    tokens[kind] += n
                    out[kind] = text
                if out["spec"] != out["plain"]:
                    mismatches.append(f"{task} prompt {i} round {rnd}")
        drafted = metric(a.metrics_url, "kiln_llm_spec_draft_tokens_total", a.model) - d0
        accepted = metric(a.metrics_url, "kiln_llm_spec_accepted_tokens_total", a.model) - c0
        tps = {k: tokens[k] / time_s[k] for k in time_s}
        # Decode: the tokens after the first over the time after it (prefill excluded).
        rounds_prompts = a.rounds * len(ps)
        dps = {k: (tokens[k] - rounds_prompts) / decode_s[k] for k in time_s}
        results[task] = {"tokens_per_s": tps, "ratio": tps["spec"] / tps["plain"],
                         "decode_tokens_per_s": dps,
                         "decode_ratio": dps["spec"] / dps["plain"],
                         "tokens": tokens, "drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else float("nan"),
                         "tokens_per_step_gain": accepted / max(1, tokens["spec"])}

    print(f"server {a.url}, model {a.model}, {a.method} K={a.num_tokens}, {a.rounds} rounds, "
          f"one request at a time, greedy")
    print(f"{'task':8s} {'decode tok/s spec':>18s} {'plain':>7s} {'ratio':>6s}   "
          f"{'end-to-end tok/s spec':>22s} {'plain':>7s} {'ratio':>6s} {'tokens':>7s} "
          f"{'acceptance':>11s}")
    for task, r in results.items():
        print(f"{task:8s} {r['decode_tokens_per_s']['spec']:18.1f} "
              f"{r['decode_tokens_per_s']['plain']:7.1f} {r['decode_ratio']:6.3f}   "
              f"{r['tokens_per_s']['spec']:22.1f} {r['tokens_per_s']['plain']:7.1f} "
              f"{r['ratio']:6.3f} {r['tokens']['spec']:7d} {r['acceptance']:11.2f}")
    print(f"outputs that differ with and without drafts: {len(mismatches)}")
    for m in mismatches:
        print("  " + m)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "mismatches": mismatches}, f, indent=1)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
