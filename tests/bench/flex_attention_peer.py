#!/usr/bin/env python3
"""Issue 16's peer comparison: Kiln's prefill attention with FlexAttention-style modifiers
(tests/bench/flex_attention_bench) against PyTorch's `flex_attention` on the CPU, same shapes
(1 x 8 heads x T tokens x head dim 64, f32), same thread count, interleaved case by case and
round by round so that both see the same machine.

  .venv-ref/bin/python tests/bench/flex_attention_peer.py build [--tokens 4096] [--rounds 3]
      [--threads 2] [--cases causal,window256,...]

PyTorch runs `torch.compile(flex_attention)` (Inductor's CPU flex-attention template) with a
block mask from `create_block_mask`, made once per case outside the timed region (FlexAttention
reuses it while the shape and the mask stay the same); the compile is not timed either. Kiln's
figure is the bench's per-run time of the engine's attention op. Each case prints both times and
Kiln / PyTorch (< 1: Kiln faster); the summary gives the median per case over the rounds.

Outputs are not compared here (the op harness and the golden tests hold Kiln's numerics); this
script only times.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HEADS, HEAD_DIM, DOC_LEN, WINDOW, CAP = 8, 64, 256, 256, 50.0


def causal(b, h, q, kv):
    return q >= kv


def window(b, h, q, kv):
    return (q >= kv) & (q - kv < WINDOW)


def softcap(score, b, h, q, kv):
    return CAP * torch.tanh(score / CAP)


ALIBI_SLOPES = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, dtype=torch.float32) / HEADS)


def alibi(score, b, h, q, kv):
    return score + ALIBI_SLOPES[h] * (kv - q)


def peer_case(name, tokens):
    """(mask_mod or None, score_mod or None) of a case, as flex_attention takes them. Kiln's
    compiled_* cases are the same masks spelled as custom expressions: PyTorch runs the mask."""
    name = name.removeprefix("compiled_")
    if name == "alibi_causal":
        return causal, alibi
    if name == "causal":
        return causal, None
    if name == "unmasked":
        return None, None
    if name == "window256":
        return window, None
    if name == "documents16x256":
        docs = torch.arange(tokens) // DOC_LEN

        def documents(b, h, q, kv):
            return (q >= kv) & (docs[q] == docs[kv])
        return documents, None
    if name == "softcap50_causal":
        return causal, softcap
    raise SystemExit(f"unknown case {name}")


def time_peer(name, tokens, min_seconds=2.0):
    mask_mod, score_mod = peer_case(name, tokens)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g) for _ in range(3))
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device="cpu")
    fn = torch.compile(flex_attention)
    fn(q, k, v, score_mod=score_mod, block_mask=block_mask)  # compile, not timed
    runs, total = 0, 0.0
    while total < min_seconds or runs < 3:
        t0 = time.perf_counter()
        fn(q, k, v, score_mod=score_mod, block_mask=block_mask)
        total += time.perf_counter() - t0
        runs += 1
    return total / runs


def time_kiln(build, name, tokens, threads):
    exe = os.path.join(build, "tests", "bench", "flex_attention_bench")
    env = dict(os.environ, KILN_CPU_THREADS=str(threads))
    out = subprocess.run([exe, f"--tokens={tokens}", f"--benchmark_filter=^{name}/",
                          "--benchmark_format=json"], env=env, check=True, capture_output=True,
                         text=True).stdout
    runs = json.loads(out)["benchmarks"]
    if not runs or "ms" not in runs[0]:
        raise SystemExit(f"flex_attention_bench gave no figure for {name}: {out[-500:]}")
    return runs[0]["ms"] / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="causal,unmasked,window256,documents16x256,softcap50_causal,"
                    "compiled_causal,compiled_window256,compiled_documents16x256,alibi_causal")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = args.cases.split(",")
    ratios = {c: [] for c in cases}
    times = {c: ([], []) for c in cases}
    print(f"torch {torch.__version__}, {args.threads} threads, T={args.tokens}, "
          f"{HEADS} heads x {HEAD_DIM}", flush=True)
    for r in range(args.rounds):
        for c in cases:
            # Alternate which goes first, so neither always follows the other.
            if r % 2 == 0:
                kiln, peer = time_kiln(args.build, c, args.tokens, args.threads), time_peer(c, args.tokens)
            else:
                peer = time_peer(c, args.tokens)
                kiln = time_kiln(args.build, c, args.tokens, args.threads)
            ratios[c].append(kiln / peer)
            times[c][0].append(kiln)
            times[c][1].append(peer)
            print(f"round {r + 1} {c:24} kiln {kiln * 1e3:9.2f} ms  torch flex {peer * 1e3:9.2f} ms"
                  f"  kiln/torch {kiln / peer:6.3f}", flush=True)
    print("\ncase                      kiln ms (median)  torch ms (median)  kiln/torch (median of rounds)")
    for c in cases:
        print(f"{c:24} {statistics.median(times[c][0]) * 1e3:14.2f} "
              f"{statistics.median(times[c][1]) * 1e3:18.2f} {statistics.median(ratios[c]):16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
