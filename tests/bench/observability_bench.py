#!/usr/bin/env python3
"""The cost of observability (the flight recorder and tracing) on LLM decode: the same
streamed load (llm_loadgen.run_level: distinct prompts, ignore_eos, greedy) against several
kilnd serving the same model side by side, one at a time, in interleaved rounds (the order
rotates each round, so drift over a round favours none):

  off        observability.flight_recorder.enabled=false, observability.tracing.enabled=false
  flight     the flight recorder only
  tracing    tracing only (nobody recording: ids and the traceparent header)
  both       both on (the defaults)
  both+otlp  both on, and every span exported over OTLP/HTTP JSON to a null collector in this
             process (the costliest steady state: every span built, queued, serialised,
             POSTed); only with --otlp

  .venv/bin/python tests/bench/observability_bench.py build/server/kilnd \\
      --rounds 6 --concurrency 8 --max-tokens 64 --otlp

Prints each round's generated tokens/s and CPU ms per token (kilnd's
process_cpu_seconds_total) per configuration; then per configuration the total tokens/s,
the median of the rounds' tokens/s and the CPU per token, each with its ratio to `off`.
The model is the default one (scripts/fetch-default-model.sh) unless --model-path is given.
The VM's speed drifts: quote ratios over interleaved rounds, not one round; on a shared
machine CPU per token is steadier than tokens/s.
"""
import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_loadgen  # noqa: E402  (same directory)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "system"))
import conftest  # noqa: E402
from conftest import LLM_NAME, Kilnd, default_model_path, ready  # noqa: E402

FLIGHT_OFF = "observability.flight_recorder.enabled=false"
TRACING_OFF = "observability.tracing.enabled=false"
CONFIGS = {
    "off": [FLIGHT_OFF, TRACING_OFF],
    "flight": [TRACING_OFF],
    "tracing": [FLIGHT_OFF],
    "both": [],
    "both+otlp": None,  # both, plus observability.otlp.endpoint (set in main)
}


class NullCollector(BaseHTTPRequestHandler):
    spans_bytes = 0

    def do_POST(self):
        NullCollector.spans_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def start(model_path, overrides, threads, tmp):
    config = Path(tempfile.mkdtemp(prefix="kiln-obs-bench-", dir=tmp)) / "kiln.yaml"
    config.write_text(f"""
models:
  - name: {LLM_NAME}
    kind: llm
    path: {model_path}
    context_length: 2048
    scheduler: {{max_num_seqs: 64, max_queue_size: 256}}
""")
    return ready(Kilnd(config, overrides,
                       env={"OMP_NUM_THREADS": str(threads)} if threads else None), 600)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kilnd")
    ap.add_argument("--model-path", help="GGUF of the model (default: the repository's default "
                    "model, fetched by scripts/fetch-default-model.sh)")
    ap.add_argument("--configs", default="off,flight,tracing,both",
                    help="comma-separated, from " + ", ".join(CONFIGS) + " (off is always run)")
    ap.add_argument("--otlp", action="store_true", help="add both+otlp")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per configuration")
    ap.add_argument("--concurrency", "--streams", type=int, default=8)
    ap.add_argument("--requests-per-worker", "--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-words", "--words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for kilnd")
    a = ap.parse_args()
    names = ["off"] + [c for c in a.configs.split(",") if c and c != "off"]
    if a.otlp and "both+otlp" not in names:
        names.append("both+otlp")
    for c in names:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}")
    conftest.KILND = a.kilnd
    model = a.model_path or default_model_path()

    collector = None
    overrides = dict(CONFIGS)
    if "both+otlp" in names:
        collector = ThreadingHTTPServer(("127.0.0.1", 0), NullCollector)
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        overrides["both+otlp"] = [
            f"observability.otlp.endpoint=http://127.0.0.1:{collector.server_address[1]}"
            "/v1/traces"]
    tmp = tempfile.mkdtemp(prefix="kiln-obs-bench-")
    daemons = {}
    rates = {c: [] for c in names}  # tokens/s per round
    totals = {c: [0, 0.0, 0.0] for c in names}  # tokens, seconds, CPU seconds
    try:
        for c in names:
            daemons[c] = start(model, overrides[c], a.threads, tmp)
        print(f"concurrency {a.concurrency}, {a.requests_per_worker} requests/worker, "
              f"{a.max_tokens} tokens each; per round tok/s and CPU-ms/tok:")
        for rnd in range(a.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            line = []
            for c in order:
                k = daemons[c]
                cpu0 = k.metric_value("process_cpu_seconds_total")
                r = asyncio.run(llm_loadgen.run_level(
                    llm_loadgen.Server(c, k.base, LLM_NAME), a.concurrency,
                    a.requests_per_worker, a.prompt_words, a.max_tokens, a.timeout,
                    seed=1000 + rnd))
                if r["ok"] != r["requests"]:
                    sys.exit(f"{c}: {r['requests'] - r['ok']} failed requests: {r['errors']}")
                cpu = k.metric_value("process_cpu_seconds_total") - cpu0
                rate = r["tokens"] / r["wall_s"]
                rates[c].append(rate)
                t = totals[c]
                t[0], t[1], t[2] = t[0] + r["tokens"], t[1] + r["wall_s"], t[2] + cpu
                line.append(f"{c} {rate:.1f} {1e3 * cpu / r['tokens']:.2f}")
            print(f"  round {rnd + 1}: " + "   ".join(line), flush=True)
    finally:
        for k in daemons.values():
            k.stop(timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)

    def summary(c):
        tokens, wall, cpu = totals[c]
        return tokens / wall, statistics.median(rates[c]), 1e3 * cpu / tokens

    base = summary("off")
    print(f"\nover {a.rounds} rounds: total tok/s, median of rounds' tok/s, CPU-ms/tok "
          "(ratio to off):")
    for c in names:
        tps, med, cpu = summary(c)
        print(f"  {c:10s} {tps:8.1f} ({tps / base[0]:.3f})  {med:8.1f} ({med / base[1]:.3f})  "
              f"{cpu:7.3f} ({cpu / base[2]:.3f})   rounds: "
              + " ".join(f"{x:.1f}" for x in rates[c]))
    if collector:
        print(f"exported {NullCollector.spans_bytes / 1e6:.2f} MB of OTLP JSON")
        collector.shutdown()


if __name__ == "__main__":
    main()
