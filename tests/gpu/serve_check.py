#!/usr/bin/env python3
"""kilnd serving a model with `backend: cuda`, checked against exact arithmetic (run on a GPU
machine by tests/gpu/device_check.sh).

Makes the SmolLM2-shaped random model of tests/bench/gpu_decode_bench.py (f16 and f32 folders),
starts kilnd with both on `cuda`, and for a few prompts compares the greedy continuation served
over the OpenAI API with `kiln generate --backend ref` (plain f32 loops: the exact-arithmetic
reference) on the same folder. Prints one line per prompt and dtype and exits non-zero on any
difference or error.

  python3 tests/gpu/serve_check.py --kilnd BIN --kiln BIN
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import gpu_decode_bench  # noqa: E402

PROMPTS = ["The kiln was hot", "Glaze, clay and fire:"]
TOKENS = 24


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kilnd", required=True)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--backend", default="cuda", help="the served models' backend")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    dirs = gpu_decode_bench.make_models(root)
    cfg = os.path.join(root, "kilnd.yaml")
    with open(cfg, "w") as f:
        f.write("server:\n  grpc:\n    address: 127.0.0.1:18801\n  http:\n"
                "    address: 127.0.0.1:18800\n  metrics:\n    address: 127.0.0.1:18802\n"
                f"  storage_dir: {root}/storage\nmodels:\n")
        for name in ("f16", "f32"):
            f.write(f"  - name: smol-{name}\n    kind: llm\n    path: {dirs[name]}\n"
                    f"    backend: {args.backend}\n")
    log = open(os.path.join(root, "kilnd.log"), "w")
    proc = subprocess.Popen([args.kilnd, "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
    failures = 0
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:18800/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                print(open(log.name).read()[-3000:])
                raise SystemExit("kilnd did not become ready")
            time.sleep(0.5)
        for name in ("f16", "f32"):
            for prompt in PROMPTS:
                served = post("http://127.0.0.1:18800/v1/completions",
                              {"model": f"smol-{name}", "prompt": prompt, "max_tokens": TOKENS,
                               "temperature": 0})["choices"][0]["text"]
                ref = subprocess.run([args.kiln, "generate", "--model", dirs[name], "--prompt",
                                      prompt, "--max-tokens", str(TOKENS), "--backend", "ref"],
                                     capture_output=True, text=True, timeout=600).stdout
                ref = ref[:-1] if ref.endswith("\n") else ref  # kiln generate ends its line
                ok = served == ref
                failures += not ok
                print(f"{'OK  ' if ok else 'DIFF'} {name} {prompt!r}: served {served[:60]!r}"
                      + ("" if ok else f" ref {ref[:60]!r}"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"serve_check: {failures} difference(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
