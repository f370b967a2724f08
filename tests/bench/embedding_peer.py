"""Sentence embeddings: Kiln's encoder (tests/bench/embedding_bench) against sentence-transformers
on PyTorch (CPU, the same thread count), interleaved round by round in one run, at batch 1 and
32, on the 200 fixture sentences (tokenization included on both sides). Prints texts/s per
side (median of the rounds) and the ratio.

  .venv-ref/bin/python tests/bench/embedding_peer.py --bench build/tests/bench/embedding_bench

Needs a venv with torch and sentence-transformers (the reference venv, see
scripts/fixtures/README.md) and the default embedding model (scripts/fetch-default-model.sh).
"""
import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=str(ROOT / "build/tests/bench/embedding_bench"))
    ap.add_argument("--model", default=str(ROOT / ".kiln/models/all-MiniLM-L6-v2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(args.threads)
    texts = [json.loads(line)["text"] for line in
             (ROOT / "tests/fixtures/embeddings/sentences.jsonl").read_text().splitlines()]
    st = SentenceTransformer(args.model, device="cpu")
    st.encode(texts, batch_size=32)  # warm-up

    kiln = subprocess.Popen([args.bench, "--serve", "--model", args.model,
                             "--threads", str(args.threads)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert kiln.stdout.readline().strip() == "ready", "embedding_bench did not start"

    def kiln_rate(batch):
        kiln.stdin.write(f"{batch} {args.seconds}\n")
        kiln.stdin.flush()
        return float(kiln.stdout.readline())

    def torch_rate(batch):
        start, done = time.perf_counter(), 0
        while True:
            with torch.inference_mode():
                st.encode(texts, batch_size=batch, show_progress_bar=False)
            done += len(texts)
            elapsed = time.perf_counter() - start
            if elapsed >= args.seconds:
                return done / elapsed

    print(f"all-MiniLM-L6-v2, {len(texts)} sentences, {args.threads} threads, "
          f"{args.rounds} interleaved rounds of {args.seconds:g} s")
    print(f"{'batch':>5} {'kiln texts/s':>13} {'torch texts/s':>14} {'ratio':>6}  (per round)")
    for batch in (int(b) for b in args.batches.split(",")):
        k, t = [], []
        for _ in range(args.rounds):
            k.append(kiln_rate(batch))
            t.append(torch_rate(batch))
        ratios = [a / b for a, b in zip(k, t)]
        print(f"{batch:>5} {statistics.median(k):>13.1f} {statistics.median(t):>14.1f} "
              f"{statistics.median(ratios):>6.2f}  ({', '.join(f'{r:.2f}' for r in ratios)})")
    kiln.stdin.close()
    kiln.wait()


if __name__ == "__main__":
    main()
