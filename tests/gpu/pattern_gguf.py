#!/usr/bin/env python3
"""A copy of a GGUF that compresses to a few MB, for carrying a real model's shapes to a lent GPU
machine (a call carries 64 MiB with the repository; see docs/gpu.md): the header, metadata and
tokenizer stay, and each tensor's data is its first --rows rows repeated (the token embedding's
first --embd-rows), so every block keeps its scale fields where the format has them. Kernel
speed does not depend on the values; the text it generates is not the model's, but the cpu
backend's continuation of it is the reference for any other backend.

  .venv/bin/python tests/gpu/pattern_gguf.py IN.gguf OUT.gguf [--rows 16] [--embd-rows 1024]
  xz -T0 -6 OUT.gguf
"""
import argparse
import shutil

import gguf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--embd-rows", type=int, default=1024)
    args = ap.parse_args()
    shutil.copyfile(args.src, args.dst)
    reader = gguf.GGUFReader(args.src)
    with open(args.dst, "r+b") as f:
        for t in reader.tensors:
            nrows = max(1, int(t.n_elements // int(t.shape[0])))  # shape[0]: elements per row
            row_bytes = int(t.n_bytes) // nrows
            keep = args.embd_rows if t.name == "token_embd.weight" else args.rows
            period = row_bytes * keep
            if period >= t.n_bytes:
                continue
            f.seek(t.data_offset)
            head = f.read(period)
            reps, rest = divmod(int(t.n_bytes), period)
            f.seek(t.data_offset)
            f.write(head * reps + head[:rest])


if __name__ == "__main__":
    main()
