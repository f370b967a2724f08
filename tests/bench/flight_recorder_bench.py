#!/usr/bin/env python3
"""The cost of the flight recorder (and of tracing, once kilnd has it) on LLM decode: two
kilnd serving the same model, one with observability.flight_recorder and .tracing on (the
defaults), one with both off; interleaved rounds of the same streamed load (llm_loadgen's
run_level) against each in turn, never both at once. Prints each round's generated tokens/s
and CPU ms per token (kilnd's process_cpu_seconds_total), the ratio of the totals (the
recorder's cost; the target is < 1 %), and the median of the rounds' ratios.

  .venv/bin/python tests/bench/flight_recorder_bench.py build/server/kilnd \\
      --rounds 6 --concurrency 8 --max-tokens 64

The model is the default one (scripts/fetch-default-model.sh) unless --model-path is given.
The VM's speed drifts: quote the ratios over interleaved rounds, not one round; on a shared
machine CPU per token is steadier than tokens/s.
"""
import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_loadgen  # noqa: E402  (same directory)

ROOT = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(metrics_url):
    """kilnd's process_cpu_seconds_total: CPU time is less disturbed than wall time by other
    work on a shared machine."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
    return float("nan")


def start(kilnd, model_path, settings, log):
    http, metrics = free_port(), free_port()
    storage = tempfile.mkdtemp(prefix="kiln-flight-bench-")
    config = Path(storage) / "kiln.yaml"
    config.write_text(f"""
models:
  - name: smollm2
    kind: llm
    path: {model_path}
    context_length: 2048
    scheduler: {{max_num_seqs: 64}}
""")
    cmd = [kilnd, "--config", str(config), "--set", f"server.http.address=127.0.0.1:{http}",
           "--set", f"server.grpc.address=127.0.0.1:{free_port()}",
           "--set", f"server.metrics.address=127.0.0.1:{metrics}",
           "--set", f"server.storage_dir={storage}"]
    for s in settings:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kilnd exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url, f"http://127.0.0.1:{metrics}/metrics", storage
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("kilnd not ready after 600 s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kilnd")
    ap.add_argument("--model-path", help="default: the fetched default model")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per configuration")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests-per-worker", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    model_path = args.model_path
    if not model_path:
        out = subprocess.run([str(ROOT / "scripts" / "fetch-default-model.sh")], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        model_path = str((ROOT / out.strip().splitlines()[-1]).resolve())

    configs = {
        "on": ["observability.flight_recorder.enabled=true", "observability.tracing.enabled=true"],
        "off": ["observability.flight_recorder.enabled=false",
                "observability.tracing.enabled=false"],
    }
    procs, servers, metrics, storages = [], {}, {}, []
    log = tempfile.NamedTemporaryFile(prefix="kilnd-flight-bench-", suffix=".log", delete=False)
    try:
        for name, settings in configs.items():
            proc, url, metrics[name], storage = start(args.kilnd, model_path, settings, log)
            procs.append(proc)
            storages.append(storage)
            servers[name] = llm_loadgen.Server(name, url, "smollm2")
        totals = {name: [0, 0.0, 0.0] for name in configs}  # tokens, seconds, CPU seconds
        ratios = []  # per round: on / off tokens/s
        print(f"concurrency {args.concurrency}, {args.requests_per_worker} requests/worker, "
              f"{args.max_tokens} tokens each; tokens/s per round:")
        for rnd in range(args.rounds):
            # Alternate which goes first, so drift over a round does not favour one.
            order = list(configs) if rnd % 2 == 0 else list(reversed(configs))
            line, tps = [], {}
            for name in order:
                cpu0 = cpu_seconds(metrics[name])
                r = asyncio.run(llm_loadgen.run_level(
                    servers[name], args.concurrency, args.requests_per_worker, args.prompt_words,
                    args.max_tokens, args.timeout, seed=1000 + rnd))
                if r["ok"] != r["requests"]:
                    sys.exit(f"{name}: {r['requests'] - r['ok']} failed requests: {r['errors']}")
                cpu = cpu_seconds(metrics[name]) - cpu0
                totals[name][0] += r["tokens"]
                totals[name][1] += r["wall_s"]
                totals[name][2] += cpu
                tps[name] = r["tokens_per_s"]
                line.append(f"{name} {r['tokens_per_s']:8.1f} tok/s {1e3 * cpu / r['tokens']:6.2f} "
                            "CPU-ms/tok")
            ratios.append(tps["on"] / tps["off"])
            print(f"  round {rnd + 1}: " + "   ".join(line), flush=True)
        on = totals["on"][0] / totals["on"][1]
        off = totals["off"][0] / totals["off"][1]
        ratios.sort()
        median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
        cpu_on = totals["on"][2] / totals["on"][0]
        cpu_off = totals["off"][2] / totals["off"][0]
        print(f"total: recorder on {on:.1f} tokens/s, off {off:.1f} tokens/s; "
              f"on/off = {on / off:.4f} (cost {100 * (1 - on / off):+.2f} %); median of the "
              f"rounds' on/off {median:.4f}")
        print(f"CPU per token: on {1e3 * cpu_on:.3f} ms, off {1e3 * cpu_off:.3f} ms "
              f"(cost {100 * (cpu_on / cpu_off - 1):+.2f} %)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
        for d in storages:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
