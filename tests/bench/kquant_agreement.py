#!/usr/bin/env python3
"""How much Kiln's loading of Q5_0/Q5_1 and K-quant weights as Q8_0 costs, measured as greedy
agreement on the SmolLM2 golden prompts (tests/fixtures/models/smollm2/llama_cpp.json).

For each type: the default model's weights (losslessly expanded to F32) are quantized with
llama.cpp's `llama-quantize` (built outside the repository; its path is an argument), then

  exact     llama.cpp (llama-cpp-python) on that file's weights dequantized exactly to F32,
            f32 KV cache: the arithmetic the quantized weights define
  kiln      `kiln generate` on the quantized file (Q5_0 converts exactly to Q8_0; Q5_1 and
            K-quants are requantized to Q8_0), default exact f32 activations
  native    llama.cpp running the quantized file itself (its own quantized activations)

and the greedy continuations (32 tokens) of kiln and native are compared with exact's.

  .venv-ref/bin/python tests/bench/kquant_agreement.py --llama-quantize PATH/llama-quantize \\
      [--kiln build/bin/kiln] [--types Q4_K_M Q5_K_M Q6_K Q5_0]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts", "fixtures"))
from make_smollm2_reference import expand_to_f32  # noqa: E402

MAX_NEW = 32


def llama_greedy(path, cases, eog, **settings):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=512, n_threads=2, logits_all=True, verbose=False, **settings)
    texts, step0 = [], []
    for c in cases:
        llm.reset()
        llm.eval(c["prompt_ids"])
        step0.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        out = []
        for _ in range(MAX_NEW):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(t)
            if t in eog:
                break
            llm.eval([t])
        texts.append(llm.detokenize(out).decode("utf-8", "replace"))
    del llm
    return texts, step0


def kiln_greedy(kiln, path, case):
    args = [kiln, "generate", "--model", path, "--max-tokens", str(MAX_NEW), "--threads", "2"]
    if case["chat"]:
        args += ["--chat", "--prompt", case["messages"][0]["content"]]
    else:
        args += ["--prompt", case["text"]]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return out[:-1] if out.endswith("\n") else out  # kiln generate ends with a newline


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--kiln", default=os.path.join(ROOT, "build", "bin", "kiln"))
    ap.add_argument("--model", default=os.path.join(ROOT, ".kiln", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0"])
    args = ap.parse_args()
    fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "models", "smollm2", "llama_cpp.json")))
    cases, eog = fx["cases"], set(fx["eog_ids"])
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        expand_to_f32(args.model, f32)
        for typ in args.types:
            quant, exact_path = os.path.join(tmp, typ + ".gguf"), os.path.join(tmp, typ + ".f32.gguf")
            subprocess.run([args.llama_quantize, "--allow-requantize", f32, quant, typ], check=True,
                           capture_output=True)
            expand_to_f32(quant, exact_path)
            exact, e0 = llama_greedy(exact_path, cases, eog, type_k=0, type_v=0)
            native, n0 = llama_greedy(quant, cases, eog)
            kiln = [kiln_greedy(args.kiln, quant, c) for c in cases]
            same = lambda a: sum(x == y for x, y in zip(a, exact))  # noqa: E731
            gap = max(float(np.abs(a - b).max()) for a, b in zip(n0, e0))
            print(f"{typ:7} identical to exact: kiln {same(kiln)}/{len(cases)}, llama.cpp native "
                  f"{same(native)}/{len(cases)} (native step-0 max |dlogit| vs exact {gap:.2f})", flush=True)


if __name__ == "__main__":
    main()
