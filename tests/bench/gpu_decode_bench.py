#!/usr/bin/env python3
"""Decode and prefill speed of the cuda backend against PyTorch (Hugging Face transformers,
eager) on the same GPU, in the same run, interleaved. Runs on a GPU machine (tests/gpu/).

The model is SmolLM2-135M's transformer (30 layers, hidden 576, 9 heads, 3 KV heads, MLP 1536,
tied embeddings) with random weights (seed 0) and the small BPE vocabulary of the tiny test
Llama (3,072 rows), made here with transformers and saved as a Hugging Face folder in f32, bf16
and f16: the real SmolLM2 file does not fit what a GPU session can carry.

  python3 tests/bench/gpu_decode_bench.py --kiln build/bin/kiln [--rounds 3] [--tokens 128]

Prints per dtype: decode tokens/s at one stream (kiln generate's figure; PyTorch's
model.generate, greedy, timed with CUDA synchronisation), prefill tokens/s for a 512-token
prompt, their ratios, and whether the greedy continuations agree (f32 only; reported, not
gated: near-tied logits of random weights may order differently).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import torch
import transformers

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa_f32")
PROMPT = "The kiln was hot and the potter waited for the glaze to set on the bowls " * 2


def make_models(root):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=3072, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    dirs = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)):
        d = os.path.join(root, name)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(os.path.join(FIXTURE, f), d)
        dirs[name] = d
    return dirs


STATS = re.compile(r"prompt (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\) \| (\d+) tokens in "
                   r"([\d.]+) s \(([\d.]+) tok/s\)")


def kiln(binary, model, prompt, tokens):
    p = subprocess.run([binary, "generate", "--model", model, "--prompt", prompt, "--max-tokens",
                        str(tokens), "--backend", "cuda"], capture_output=True, text=True,
                       timeout=600)
    m = STATS.search(p.stderr + p.stdout)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"kiln generate failed ({p.returncode}): {p.stderr[-2000:]}")
    return {"text": p.stdout, "prompt_tps": float(m.group(3)), "gen_tokens": int(m.group(4)),
            "decode_tps": float(m.group(6))}


def torch_run(model, tok, prompt, tokens):
    ids = tok(prompt, return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        prefill = ids.shape[1] / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        torch.cuda.synchronize()
        decode = tokens / (time.perf_counter() - t0)
    text = tok.decode(out[0, ids.shape[1]:])
    return {"text": text, "prompt_tps": prefill, "decode_tps": decode}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    dirs = make_models(root)
    long_prompt = " ".join([PROMPT] * 40)
    results = {}
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    for name, d in dirs.items():
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).cuda().eval()
        tok = transformers.AutoTokenizer.from_pretrained(d)
        n_long = len(tok(long_prompt).input_ids)
        long_prompt_512 = tok.decode(tok(long_prompt).input_ids[:512]) if n_long > 512 else long_prompt
        torch_run(model, tok, PROMPT, 8)  # warm-up (cuBLAS handles, kernels)
        kiln(args.kiln, d, PROMPT, 8)
        rows = {"kiln_decode": [], "torch_decode": [], "kiln_prefill": [], "torch_prefill": []}
        texts = {}
        for _ in range(args.rounds):
            k = kiln(args.kiln, d, PROMPT, args.tokens)
            t = torch_run(model, tok, PROMPT, args.tokens)
            kp = kiln(args.kiln, d, long_prompt_512, 1)
            tp = torch_run(model, tok, long_prompt_512, 1)
            rows["kiln_decode"].append(k["decode_tps"])
            rows["torch_decode"].append(t["decode_tps"])
            rows["kiln_prefill"].append(kp["prompt_tps"])
            rows["torch_prefill"].append(tp["prompt_tps"])
            texts = {"kiln": k["text"], "torch": t["text"], "kiln_tokens": k["gen_tokens"]}
        med = {k: statistics.median(v) for k, v in rows.items()}
        agree = texts["kiln"].strip() == texts["torch"].strip()
        results[name] = {"median": med, "rounds": rows, "greedy_text_equal": agree,
                         "kiln_generated_tokens": texts["kiln_tokens"]}
        print(f"{name}: decode 1 stream kiln {med['kiln_decode']:.1f} tok/s, torch "
              f"{med['torch_decode']:.1f} tok/s (x{med['kiln_decode'] / med['torch_decode']:.2f}); "
              f"prefill 512 kiln {med['kiln_prefill']:.0f} tok/s, torch "
              f"{med['torch_prefill']:.0f} tok/s (x{med['kiln_prefill'] / med['torch_prefill']:.2f});"
              f" greedy text equal: {agree}")
        if not agree and name == "f32":
            print("  kiln :", texts["kiln"][:200].replace("\n", " "))
            print("  torch:", texts["torch"][:200].replace("\n", " "))
        del model
        torch.cuda.empty_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
