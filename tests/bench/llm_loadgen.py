#!/usr/bin/env python3
"""LLM serving load generator: streams completions from OpenAI-compatible servers and reports
aggregate generated tokens/s, time to first token (TTFT) and inter-token latency (ITL) at
several concurrency levels, for each server, with ratios against the first one.

Kiln and llama.cpp's llama-server both speak the OpenAI API, so one run compares them under
the same load, one server at a time (never both at once: they would share the cores):

  .venv/bin/python tests/bench/llm_loadgen.py \\
      --server kiln=http://127.0.0.1:8000 --model kiln=smollm2 \\
      --server llama.cpp=http://127.0.0.1:8080 \\
      --concurrency 1,4,16,64 --prompt-tokens 128 --max-tokens 128

Each request is a streamed POST /v1/completions with a distinct prompt of about
--prompt-tokens tokens (calibrated once against the first server with max_tokens 1, so the
prefix cache of neither server helps), `max_tokens` new tokens and `ignore_eos` (every
request generates exactly that many), greedy. At concurrency c, c workers each send
--requests-per-worker requests back to back; a level starts with one warm-up request per
server that is not measured.

Figures: tokens/s = completion tokens of successful requests / wall time of the level;
TTFT = request sent -> first non-empty text chunk; ITL = gap between consecutive non-empty
chunks (one token each on both servers, except where a UTF-8 character spans tokens);
p50/p99 over all requests (TTFT) or all gaps (ITL). Completion tokens come from the final
`usage` (stream_options.include_usage), else from the chunk count. Failed requests (HTTP
errors, timeouts, streams without [DONE]) are counted and reported, never silently dropped.
--json writes every figure for the record.

Multi-LoRA: --model NAME=m1,m2,... spreads the workers over several model names (worker i
sends model i mod n), e.g. Kiln's LoRA adapters of one base model:
  --server kiln=http://127.0.0.1:8000 --model kiln=sql,chat,code,math --concurrency 16
"""
import argparse
import asyncio
import json
import random
import statistics
import sys
import time

try:
    import aiohttp
except ImportError:  # pragma: no cover
    sys.exit("llm_loadgen needs aiohttp: run it with the project's venv (.venv/bin/python)")

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river stone kiln clay "
         "glaze fire oven potter wheel vase bowl plate cup handle color blue green red white "
         "black heat cool slow fast early late morning evening night summer winter spring").split()


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def make_prompt(rng, words):
    return "Write a story about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


class Server:
    def __init__(self, name, url, model):
        self.name, self.url, self.model = name, url.rstrip("/"), model


async def complete(session, server, prompt, max_tokens, stream, timeout, worker=0):
    """One request. Returns dict(ok, error, ttft, gaps, tokens, prompt_tokens, chunks)."""
    models = server.model.split(",")
    body = {"model": models[worker % len(models)], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = {"ok": False, "error": None, "ttft": None, "gaps": [], "tokens": 0,
           "prompt_tokens": None, "chunks": 0}
    start = time.perf_counter()
    try:
        async with session.post(server.url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            if not stream:
                data = await resp.json()
                usage = data.get("usage") or {}
                out.update(ok=True, tokens=usage.get("completion_tokens", 0),
                           prompt_tokens=usage.get("prompt_tokens"))
                return out
            last = None
            done = False
            buf = b""
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            continue
                        msg = json.loads(payload)
                        if "error" in msg:
                            out["error"] = f"stream error: {msg['error']}"
                            return out
                        if msg.get("usage"):
                            out["tokens"] = msg["usage"].get("completion_tokens", out["tokens"])
                            out["prompt_tokens"] = msg["usage"].get("prompt_tokens")
                        for choice in msg.get("choices") or []:
                            if choice.get("text"):
                                now = time.perf_counter()
                                if last is None:
                                    out["ttft"] = now - start
                                else:
                                    out["gaps"].append(now - last)
                                last = now
                                out["chunks"] += 1
            if not done:
                out["error"] = "the stream ended without [DONE]"
                return out
            if not out["tokens"]:
                out["tokens"] = out["chunks"]
            out["ok"] = out["ttft"] is not None
            if not out["ok"]:
                out["error"] = "no text was streamed"
            return out
    except asyncio.TimeoutError:
        out["error"] = f"timed out after {timeout:.0f} s"
    except aiohttp.ClientError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def calibrate(session, server, target, timeout):
    """Words per prompt so that the prompt is about `target` tokens on `server`."""
    rng = random.Random(0)
    words = max(8, target * 3 // 4)
    best = words
    for _ in range(8):
        r = await complete(session, server, make_prompt(rng, words), 1, False, timeout)
        if not r["ok"] or not r["prompt_tokens"]:
            raise RuntimeError(f"calibration request to {server.name} failed: {r['error']}")
        got = r["prompt_tokens"]
        best = words
        if abs(got - target) <= 2:
            break
        words = max(1, round(words * target / got))
    return best


async def run_level(server, concurrency, per_worker, words, max_tokens, timeout, seed):
    # A new connection per request, for every server alike: llama-server closes a connection
    # after a streamed response, and a reused one then fails ("Server disconnected").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        rng = random.Random(seed)
        warm = await complete(session, server, make_prompt(rng, words), 8, True, timeout)
        if not warm["ok"]:
            print(f"  warm-up request to {server.name} failed: {warm['error']}", file=sys.stderr)
        prompts = [[make_prompt(rng, words) for _ in range(per_worker)]
                   for _ in range(concurrency)]

        async def worker(i, mine):
            return [await complete(session, server, p, max_tokens, True, timeout, i)
                    for p in mine]

        start = time.perf_counter()
        results = await asyncio.gather(*(worker(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    errors = {}
    for r in flat:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {
        "server": server.name, "concurrency": concurrency, "requests": len(flat),
        "ok": len(ok), "errors": errors, "wall_s": wall,
        "tokens": sum(r["tokens"] for r in ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
        "prompt_tokens_mean": statistics.mean([r["prompt_tokens"] for r in ok
                                               if r["prompt_tokens"]] or [float("nan")]),
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
    }


def print_table(rows, servers):
    base = servers[0].name
    header = (f"{'conc':>4}  {'server':<12} {'ok/req':>8} {'tok/s':>8} {'ratio':>8}  "
              f"{'TTFT p50':>9} {'p99':>9}  {'ITL p50':>8} {'p99':>8}  {'prompt':>6}")
    print(header)
    print("-" * len(header))
    for conc in sorted({r["concurrency"] for r in rows}):
        level = [r for r in rows if r["concurrency"] == conc]
        ref = next((r for r in level if r["server"] == base), None)
        for r in level:
            ratio = (r["tokens_per_s"] / ref["tokens_per_s"]
                     if ref and ref["tokens_per_s"] > 0 else float("nan"))
            print(f"{conc:>4}  {r['server']:<12} {r['ok']:>3}/{r['requests']:<4} "
                  f"{r['tokens_per_s']:>8.1f} {ratio:>8.2f}  "
                  f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms  "
                  f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms  "
                  f"{r['prompt_tokens_mean']:>6.0f}")
            for err, n in r["errors"].items():
                print(f"{'':>6}{n} x {err}")
    if len(servers) > 1:
        print(f"\nratios: {base} / other (tokens/s higher is better for {base}; "
              "TTFT and ITL lower is better)")
        for conc in sorted({r["concurrency"] for r in rows}):
            level = {r["server"]: r for r in rows if r["concurrency"] == conc}
            if base not in level:
                continue
            for s in servers[1:]:
                if s.name not in level:
                    continue
                a, b = level[base], level[s.name]

                def ratio(x, y):
                    return x / y if y and y == y and y > 0 else float("nan")
                print(f"  c={conc:<3} vs {s.name:<12} tok/s x{ratio(a['tokens_per_s'], b['tokens_per_s']):.2f}"
                      f"   TTFT p50 x{ratio(a['ttft_p50_ms'], b['ttft_p50_ms']):.2f}"
                      f"   ITL p50 x{ratio(a['itl_p50_ms'], b['itl_p50_ms']):.2f}")


def parse_pairs(values, what):
    out = {}
    for v in values:
        if "=" not in v:
            sys.exit(f"--{what} takes NAME=VALUE, got {v!r}")
        k, _, val = v.partition("=")
        out[k] = val
    return out


async def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True,
                    help="NAME=URL of an OpenAI-compatible server; the first is the reference")
    ap.add_argument("--model", action="append", default=[],
                    help="NAME=MODEL to send to server NAME (default: the first model it lists)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-worker", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args()

    urls = parse_pairs(args.server, "server")
    models = parse_pairs(args.model, "model")
    servers = []
    async with aiohttp.ClientSession() as session:
        for name, url in urls.items():
            model = models.get(name)
            if model is None:
                try:
                    async with session.get(url.rstrip("/") + "/v1/models",
                                           timeout=aiohttp.ClientTimeout(total=10)) as r:
                        data = await r.json()
                        model = data["data"][0]["id"]
                except Exception as e:  # noqa: BLE001 - report any failure to reach it
                    sys.exit(f"{name}: cannot list models at {url}/v1/models ({e}); "
                             "is the server up? pass --model NAME=MODEL")
            servers.append(Server(name, url, model))
        words = await calibrate(session, servers[0], args.prompt_tokens, args.timeout)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    print(f"prompts of ~{args.prompt_tokens} tokens ({words} words), {args.max_tokens} new "
          f"tokens each, {args.requests_per_worker} request(s) per stream; servers: "
          + ", ".join(f"{s.name} ({s.url}, model {s.model})" for s in servers), flush=True)
    rows = []
    for c in levels:
        for i, s in enumerate(servers):
            r = await run_level(s, c, args.requests_per_worker, words, args.max_tokens,
                                args.timeout, seed=1000 * c + i)
            rows.append(r)
            print(f"  c={c:<3} {s.name:<12} {r['tokens_per_s']:8.1f} tok/s  "
                  f"{r['ok']}/{r['requests']} ok  ({r['wall_s']:.1f} s)", flush=True)
    print()
    print_table(rows, servers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "prompt_words": words, "results": rows}, f, indent=2)
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
