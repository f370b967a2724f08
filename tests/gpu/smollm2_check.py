#!/usr/bin/env python3
"""The real SmolLM2-135M-Instruct GGUF on a GPU machine (run by tests/gpu/device_check.sh's
`smollm2` mode): a check and the issue's benchmark.

1. Greedy continuations of the golden prompts (tests/fixtures/models/smollm2/llama_cpp.json, 32
   new tokens, chat prompts through the chat template) on `cuda` equal `cpu`'s (exact arithmetic,
   itself checked against transformers by `make test`). Exits non-zero on a difference.
2. One stream (figures): decode tokens/s over 128 new tokens and prefill tokens/s at 512 and
   4,096 prompt tokens, kiln generate --backend cuda against llama.cpp's llama-bench (CUDA build,
   all layers on the GPU, flash attention), interleaved, median of --rounds; decode also as a
   fraction of the HBM roofline (weight bytes x tokens/s / --hbm-gbs); a launch profile of the
   decode steps (KILN_PROFILE) into OUT/profile_decode.txt.
3. LoRA fine-tuning (check and figures): `kiln finetune --backend cuda` on 4 x 256-token
   batches (tests/bench/finetune_bench.sh's data); its first two losses equal the cpu run's
   (relative 1e-3), and its tokens/s against PyTorch + PEFT on the same GPU
   (tests/bench/peft_train_peer.py --device cuda; transformers reads the GGUF through the `gguf`
   package, which may have to be carried to the GPU machine as a wheel).
   Also decode with the cuda backend's alternatives (the Linear op's work-group template,
   device sampling), and (--only ncu) Nsight Compute's time of every kernel of a few decode
   steps, summed by kernel.
4. 64 streams (figures): kilnd (backend: cuda) and llama-server under tests/bench/llm_loadgen.py
   at concurrency 1 and 64, 128-token prompts and 128 new tokens.

  python3 tests/gpu/smollm2_check.py --bin DIR --model GGUF --out DIR [--llama DIR]
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "models", "smollm2", "llama_cpp.json")
LOADGEN = os.path.join(HERE, "..", "bench", "llm_loadgen.py")
STATS = re.compile(r"prompt (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\) \| (\d+) tokens in "
                   r"([\d.]+) s \(([\d.]+) tok/s\)")
# Text that tokenizes to about one token per word; repeated to reach a prompt length.
FILLER = ("the potter set the bowls in the kiln and waited while the fire rose through the "
          "night ")


def log(*a):
    print(*a, flush=True)


def generate(args, backend, prompt, tokens, chat=False, extra=(), env=None):
    cmd = [os.path.join(args.bin, "kiln"), "generate", "--model", args.model, "--prompt", prompt,
           "--max-tokens", str(tokens), "--backend", backend, *extra]
    if chat:
        cmd.append("--chat")
    # surrogateescape: a model whose weights are a pattern (tests/gpu/pattern_gguf.py) writes
    # bytes that are not UTF-8; they compare exactly all the same.
    p = subprocess.run(cmd, capture_output=True, text=True, errors="surrogateescape",
                       timeout=600, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        raise RuntimeError(f"kiln generate --backend {backend} failed: {p.stderr[-2000:]}")
    return p.stdout, STATS.search(p.stderr)


def golden(args):
    cases = json.load(open(FIXTURE))["cases"]
    diffs = 0
    for case in cases:
        text = {}
        for backend in ("cpu", args.backend):
            text[backend], _ = generate(args, backend, case["text"], 32, case["chat"])
        ok = text["cpu"] == text[args.backend]
        diffs += not ok
        log(f"{'OK  ' if ok else 'DIFF'} {case['name'][:40]!r}: {args.backend} {text[args.backend][:50]!r}"
            + ("" if ok else f" cpu {text['cpu'][:50]!r}"))
    log(f"golden: {len(cases) - diffs}/{len(cases)} prompts identical ({args.backend} vs cpu)")
    return diffs


def prompt_of(n_words):
    words = (FILLER * (n_words // len(FILLER.split()) + 1)).split()
    return " ".join(words[:n_words])


def llama_env(args):
    return dict(os.environ, LD_LIBRARY_PATH=args.llama + ":" + os.environ.get("LD_LIBRARY_PATH", ""))


def llama_bench(args):
    cmd = [os.path.join(args.llama, "llama-bench"), "-m", args.model, "-ngl", "99", "-fa", "1",
           "-p", "512,4096", "-n", "128", "-r", "3", "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=llama_env(args))
    if p.returncode != 0:
        log("llama-bench failed:", p.stderr[-1500:])
        return {}
    out = {}
    for row in json.loads(p.stdout):
        key = "decode" if row["n_gen"] else f"prefill {row['n_prompt']}"
        out[key] = row["avg_ts"]
    return out


def one_stream(args):
    weight_bytes = os.path.getsize(args.model)
    prompts = {512: prompt_of(483), 4096: prompt_of(3868)}  # ~1.06 tokens a word
    generate(args, args.backend, prompts[512], 4)  # warm-up: kernels compiled and cached
    figures = {"kiln": {}, "llama.cpp": {}}
    for r in range(args.rounds):
        _, m = generate(args, args.backend, "The kiln was hot and", 128)
        figures["kiln"].setdefault("decode", []).append(float(m.group(6)))
        for n, prompt in prompts.items():
            _, m = generate(args, args.backend, prompt, 2)
            figures["kiln"].setdefault(f"prefill {n}", []).append(float(m.group(3)))
            figures["kiln"].setdefault(f"prompt tokens {n}", []).append(int(m.group(1)))
        if args.llama:
            for k, v in llama_bench(args).items():
                figures["llama.cpp"].setdefault(k, []).append(v)
        log(f"round {r + 1}: kiln {json.dumps({k: v[-1] for k, v in figures['kiln'].items()})} "
            f"llama.cpp {json.dumps({k: v[-1] for k, v in figures['llama.cpp'].items()})}")
    log(f"\none stream, median of {args.rounds} rounds (tokens/s):")
    for k in ("decode", "prefill 512", "prefill 4096"):
        kiln = statistics.median(figures["kiln"][k])
        line = f"  {k:13s} kiln {kiln:9.1f}"
        if figures["llama.cpp"].get(k):
            peer = statistics.median(figures["llama.cpp"][k])
            line += f"   llama.cpp {peer:9.1f}   ratio {kiln / peer:.2f}x"
        if k == "decode":
            line += (f"   kiln at {100 * weight_bytes * kiln / (args.hbm_gbs * 1e9):.1f}% of the "
                     f"HBM roofline ({weight_bytes / 1e6:.1f} MB per token, {args.hbm_gbs} GB/s)")
        log(line)
    log(f"  (kiln's prompts: {figures['kiln']['prompt tokens 512'][0]} and "
        f"{figures['kiln']['prompt tokens 4096'][0]} tokens)")
    # Where a decode step's time goes: every launch timed on its own (engine/profile.h).
    profile = os.path.join(args.out, "profile_decode.txt")
    subprocess.run([os.path.join(args.bin, "kiln"), "generate", "--model", args.model, "--prompt",
                    "The kiln was hot and", "--max-tokens", "32", "--backend", args.backend],
                   capture_output=True, timeout=600,
                   env=dict(os.environ, KILN_PROFILE="1", KILN_PROFILE_FILE=profile))
    log(f"  launch profile of 32 decode steps: {profile}")


def decode_variants(args):
    """Decode tokens/s of the cuda backend's alternatives, interleaved, median of --rounds: the
    Linear op's warp-per-row kernel (default) or the work-group template (KILN_GPU_LINEAR_SG=0),
    which reads block weights element by element (default) or a block per work-item
    (KILN_GPU_LINEAR_BLOCKS=1); sampling on the host (default) or in the step program
    (KILN_GPU_DEVICE_SAMPLING=1)."""
    variants = {"default": ((), {}), "work-group": ((), {"KILN_GPU_LINEAR_SG": "0"}),
                "work-group blk": ((), {"KILN_GPU_LINEAR_SG": "0", "KILN_GPU_LINEAR_BLOCKS": "1"}),
                "device sampling": ((), {"KILN_GPU_DEVICE_SAMPLING": "1"})}
    figures = {k: [] for k in variants}
    texts = {}
    for _ in range(args.rounds):
        for name, (extra, env) in variants.items():
            text, m = generate(args, args.backend, "The kiln was hot and", 128, extra=extra,
                               env=env)
            figures[name].append(float(m.group(6)))
            texts[name] = text
    for name, v in figures.items():
        log(f"  decode, {name:14s} {statistics.median(v):8.1f} tokens/s"
            + ("" if texts[name] == texts["default"] else "  (text differs from default)"))


def ncu_profile(args):
    """Where a decode step's time goes on the GPU (figures): Nsight Compute times every kernel
    of a short generation (CUDA graph nodes one by one), and the kernels are summed by name
    over the decode steps' share, largest first, into OUT/ncu_decode.txt."""
    ncu = shutil.which("ncu") or next(iter(sorted(
        __import__("glob").glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if ncu is None:
        log("ncu: not found")
        return 0
    steps = 8
    csv_path = os.path.join(args.out, "ncu_decode.csv")
    cmd = [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--metrics",
           "gpu__time_duration.sum", os.path.join(args.bin, "kiln"), "generate", "--model",
           args.model, "--prompt", "The kiln was hot and", "--max-tokens", str(steps + 1),
           "--backend", args.backend]
    with open(csv_path, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, timeout=240)
    if p.returncode != 0:
        log("ncu failed:", p.stderr[-1500:])
        return 0
    lines = summarize_ncu(csv_path, steps)
    with open(os.path.join(args.out, "ncu_decode.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines[:40]))
    return 0


def summarize_ncu(csv_path, steps):
    """ncu's CSV (one row per kernel and metric) summed by kernel name and geometry."""
    import csv
    rows = [r for r in csv.reader(open(csv_path, errors="replace")) if len(r) > 5]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Value" in r), None)
    if head is None:
        return ["ncu: no kernel rows"]
    h = rows[head]
    ki, vi, gi, bi = (h.index("Kernel Name"), h.index("Metric Value"), h.index("Grid Size"),
                      h.index("Block Size"))
    by_name = {}
    for r in rows[head + 1:]:
        try:
            ns = float(r[vi].replace(",", ""))
        except ValueError:
            continue
        key = (r[ki][:60], r[gi], r[bi])
        c, t = by_name.get(key, (0, 0.0))
        by_name[key] = (c + 1, t + ns)
    total = sum(t for _, t in by_name.values())
    lines = [f"{len(rows) - head - 1} kernels, {total / 1e3:.1f} us in all over the prompt step "
             f"and {steps} decode steps; per name and geometry, largest first:"]
    for (name, grid, block), (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {t / 1e3:9.1f} us {c:6d} launches {t / c / 1e3:8.2f} us each  "
                     f"{name} grid {grid} block {block}")
    return lines


STEP = re.compile(r"step (\d+)/\d+ .* loss ([\d.]+) .* ([\d.]+) s$", re.M)


def finetune(args, backend, data, steps):
    out = tempfile.mkdtemp()
    cmd = [os.path.join(args.bin, "kiln"), "finetune", "--model", args.model, "--train", data,
           "--out", out, "--steps", str(steps), "--batch-size", "4", "--seq-len", "256", "--lr",
           "1e-4", "--save-steps", "1000000", "--backend", backend]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"kiln finetune --backend {backend} failed: {p.stderr[-2000:]}")
    steps = [(float(m.group(2)), float(m.group(3))) for m in STEP.finditer(p.stderr)]
    peak = re.search(r"peak RSS .*", p.stdout + p.stderr)
    return steps, peak.group(0) if peak else ""


def train(args):
    root = tempfile.mkdtemp()
    data = os.path.join(root, "train.jsonl")
    with open(data, "w") as f:  # tests/bench/finetune_bench.sh's data
        for i in range(256):
            story = " ".join(f"Item {i}.{j} follows item {i}.{j - 1} in the long list."
                             for j in range(40))
            f.write(json.dumps({"prompt": f"Continue the list {i}:", "completion": " " + story})
                    + "\n")
    gpu, peak = finetune(args, args.backend, data, 8)
    cpu, _ = finetune(args, "cpu", data, 2)
    shutil.rmtree(root, ignore_errors=True)
    log("LoRA losses, " + args.backend + ": " + " ".join(f"{l:.4f}" for l, _ in gpu)
        + "; cpu: " + " ".join(f"{l:.4f}" for l, _ in cpu))
    bad = sum(abs(g[0] - c[0]) > 1e-3 * abs(c[0]) for g, c in zip(gpu, cpu)) + (len(cpu) < 2)
    step_s = statistics.median(t for _, t in gpu[1:])
    log(f"kiln LoRA on {args.backend}: {4 * 256 / step_s:.1f} tokens/s ({step_s * 1e3:.1f} ms a "
        f"step, median of steps 2-{len(gpu)}); {peak}")
    peer = subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "peft_train_peer.py"),
                           "--model", args.model, "--method", "lora", "--steps", "6",
                           "--device", "cuda" if args.backend == "cuda" else "cpu"],
                          capture_output=True, text=True, timeout=900)
    log(peer.stdout.strip() or f"PEFT peer failed: {peer.stderr[-1500:]}")
    m = re.search(r"tokens_per_s=([\d.]+)", peer.stdout)
    if m:
        log(f"kiln / PyTorch + PEFT: {4 * 256 / step_s / float(m.group(1)):.2f}x")
    return bad


def free_ports(n):
    """n distinct free ports, chosen while all are bound (one at a time the kernel may hand a
    just-released port out again)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_ready(url, proc, name, seconds=150):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become ready in {seconds} s")


def many_streams(args):
    root = tempfile.mkdtemp()
    port, grpc, metrics = free_ports(3)
    cfg = os.path.join(root, "kilnd.yaml")
    with open(cfg, "w") as f:
        f.write(f"server:\n  grpc:\n    address: 127.0.0.1:{grpc}\n  http:\n"
                f"    address: 127.0.0.1:{port}\n  metrics:\n    address: 127.0.0.1:{metrics}\n"
                f"  storage_dir: {root}/storage\nmodels:\n  - name: smollm2\n    kind: llm\n"
                f"    path: {args.model}\n    backend: {args.backend}\n    scheduler:\n"
                "      max_num_seqs: 64\n      max_num_batched_tokens: 2048\n"
                "      max_prefill_tokens_with_decodes: 512\n      kv_cache_bytes: auto\n"
                "      kv_cache_memory_fraction: 0.3\n")
    procs = []
    servers = []
    try:
        klog = open(os.path.join(args.out, "kilnd.log"), "w")
        kilnd = subprocess.Popen([os.path.join(args.bin, "kilnd"), "--config", cfg], stdout=klog,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(kilnd)
        wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", kilnd, "kilnd")
        servers += ["--server", f"kiln=http://127.0.0.1:{port}", "--model", "kiln=smollm2"]
        if args.llama:
            lport = free_ports(1)[0]
            llog = open(os.path.join(args.out, "llama-server.log"), "w")
            llama = subprocess.Popen(
                [os.path.join(args.llama, "llama-server"), "-m", args.model, "-ngl", "99", "-fa",
                 "on", "-np", "64", "-c", str(64 * 512), "--port", str(lport), "--host",
                 "127.0.0.1"], stdout=llog, stderr=subprocess.STDOUT, start_new_session=True,
                env=llama_env(args))
            procs.append(llama)
            wait_ready(f"http://127.0.0.1:{lport}/health", llama, "llama-server")
            servers += ["--server", f"llama.cpp=http://127.0.0.1:{lport}"]
        p = subprocess.run([sys.executable, LOADGEN, *servers, "--concurrency", "1,64",
                            "--prompt-tokens", "128", "--max-tokens", "128",
                            "--requests-per-worker", "2", "--json",
                            os.path.join(args.out, "loadgen.json")],
                           capture_output=True, text=True, timeout=900)
        log(p.stdout[-6000:], p.stderr[-2000:])
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            log("".join(line for line in r.read().decode().splitlines(keepends=True)
                        if line.startswith("kiln_device_memory")))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except Exception:
                pass
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="kiln and kilnd (the unpacked bundle's bin/)")
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama", default="", help="llama.cpp's CUDA build: llama-bench, "
                    "llama-server (and their libraries on the loader path)")
    ap.add_argument("--backend", default="cuda", help="checked against cpu (cpu: a dry run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hbm-gbs", type=float, default=0, help="the GPU's memory bandwidth "
                    "(default: from nvidia-smi's name; H100 SXM 3,350 GB/s, H200 4,800)")
    ap.add_argument("--only", default="golden,variants,one,train,many")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.hbm_gbs:
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout
        except OSError:
            name = ""
        args.hbm_gbs = 4800 if "H200" in name else 3350
    failures = 0
    for name, step in (("golden", golden), ("variants", decode_variants), ("one", one_stream),
                       ("ncu", ncu_profile), ("train", train), ("many", many_streams)):
        if name not in args.only.split(","):
            continue
        try:  # each step on its own: a failure is reported and the next one still runs
            failures += step(args) or 0
        except Exception as e:  # noqa: BLE001
            log(f"{name}: FAILED: {e!r}")
            failures += 1
    log(f"smollm2_check: {failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
