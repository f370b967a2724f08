#!/usr/bin/env python3
"""Tracing's overhead on LLM decode: the same streamed load against three kilnd daemons
serving the same model, one at a time, in interleaved rounds (the order rotates each round):

  off     observability.tracing.enabled=false
  on      tracing on, nobody recording: ids and the traceparent header only
  export  tracing on and every span exported over OTLP/HTTP JSON to a null collector in this
          process (the costliest steady state: every span built, queued, serialised, POSTed)

  .venv/bin/python tests/bench/tracing_bench.py build/server/kilnd \\
      --streams 8 --max-tokens 64 --rounds 3

Figures: generated tokens/s per level (llm_loadgen.run_level: distinct prompts, ignore_eos,
greedy), the median over rounds per mode, and the ratios on/off and export/off.
"""
import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_loadgen  # noqa: E402  (same directory)

ROOT = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NullCollector(BaseHTTPRequestHandler):
    spans_bytes = 0

    def do_POST(self):
        NullCollector.spans_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def start(kilnd, model_path, overrides, threads):
    http = free_port()
    cfg = Path(tempfile.mkdtemp(prefix="kiln-trace-bench-")) / "kiln.yaml"
    cfg.write_text(f"""
models:
  - name: smollm2
    kind: llm
    path: {model_path}
    context_length: 2048
    scheduler: {{max_num_seqs: 32, max_queue_size: 256}}
""")
    cmd = [kilnd, "--config", str(cfg), "--set", f"server.http.address=127.0.0.1:{http}",
           "--set", f"server.grpc.address=127.0.0.1:{free_port()}",
           "--set", f"server.metrics.address=127.0.0.1:{free_port()}",
           "--set", f"server.storage_dir={cfg.parent}"]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=open(cfg.parent / "log", "w"), stderr=subprocess.STDOUT,
                            env=env)
    url = f"http://127.0.0.1:{http}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kilnd exited: {(cfg.parent / 'log').read_text()}")
        try:
            if urllib.request.urlopen(url + "/v2/health/ready", timeout=1).status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit("kilnd not ready in 600 s")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kilnd")
    ap.add_argument("--model-path", help="GGUF of the model (default: the repository's default "
                    "model, fetched by scripts/fetch-default-model.sh)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--words", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for kilnd")
    a = ap.parse_args()
    model = a.model_path or (ROOT / subprocess.run(
        [str(ROOT / "scripts" / "fetch-default-model.sh")], cwd=ROOT, check=True,
        capture_output=True, text=True).stdout.strip().splitlines()[-1]).resolve()

    collector = ThreadingHTTPServer(("127.0.0.1", 0), NullCollector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    modes = {
        "off": ["observability.tracing.enabled=false"],
        "on": ["observability.tracing.enabled=true"],
        "export": ["observability.tracing.enabled=true", f"observability.otlp.endpoint={endpoint}"],
    }
    daemons = {m: start(a.kilnd, model, o, a.threads) for m, o in modes.items()}
    rates = {m: [] for m in modes}
    try:
        names = list(modes)
        for rnd in range(a.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for m in order:
                server = llm_loadgen.Server(m, daemons[m][1], "smollm2")
                r = asyncio.run(llm_loadgen.run_level(server, a.streams, a.requests_per_stream,
                                                      a.words, a.max_tokens, 600, 1000 + rnd))
                if r["errors"]:
                    print(f"  {m}: failed requests {r['errors']}", file=sys.stderr)
                rate = r["tokens"] / r["wall_s"]
                rates[m].append(rate)
                print(f"round {rnd + 1} {m:7s} {rate:8.1f} tok/s  ({r['tokens']} tokens, "
                      f"{r['wall_s']:.2f} s)", flush=True)
    finally:
        for proc, _ in daemons.values():
            proc.terminate()
            proc.wait(timeout=120)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"\nmedian tok/s over {a.rounds} rounds, {a.streams} streams x "
          f"{a.requests_per_stream} requests x {a.max_tokens} tokens:")
    for m in modes:
        print(f"  {m:7s} {med[m]:8.1f}   " + " ".join(f"{x:.1f}" for x in rates[m]))
    print(f"ratio on/off     {med['on'] / med['off']:.3f}")
    print(f"ratio export/off {med['export'] / med['off']:.3f}")
    print(f"exported {NullCollector.spans_bytes / 1e6:.2f} MB of OTLP JSON")


if __name__ == "__main__":
    main()
