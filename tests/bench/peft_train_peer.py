#!/usr/bin/env python3
"""The PyTorch + PEFT peer of tests/bench/finetune_bench.sh: trains SmolLM2 (the GGUF,
dequantized to float32 by transformers) on the same kind of batches as `kiln finetune` and
prints one line of figures.

  PY peft_train_peer.py --model .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --method lora|full --steps 6 --batch-size 4 --seq-len 256 --threads 2 [--device cuda]

Batches are ROWS x SEQ tokens drawn from a fixed seed, every position a target (packing with
no padding, the case that costs the most). The optimizer is torch.optim.AdamW (lr 1e-4, fp32).
The first step is a warm-up and is not timed; on a GPU (--device cuda, tests/gpu/) each step
ends with a synchronisation. Output:
  peer method=lora tokens_per_s=... step_s=... peak_rss_mib=... params=... [peak_gpu_mib=...]
"""
import argparse
import os
import resource
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", choices=["lora", "full"], default="lora")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    folder, name = os.path.split(os.path.abspath(a.model))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa")
    if a.method == "lora":
        import peft
        cfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0,
                              target_modules="all-linear", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, cfg)
    model.to(a.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    times = []
    for step in range(a.steps + 1):
        ids = torch.randint(0, vocab, (a.batch_size, a.seq_len), generator=g).to(a.device)
        start = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.device != "cpu":
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
    # Tokens pushed through forward and backward per step, as `kiln finetune` counts them
    # (finetune_bench.sh: batch x seq_len).
    tokens = a.batch_size * a.seq_len
    step_s = sorted(times)[len(times) // 2]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peer method={a.method} tokens_per_s={tokens / step_s:.1f} step_s={step_s:.3f} "
          f"peak_rss_mib={rss:.0f} params={sum(p.numel() for p in params)}"
          + (f" peak_gpu_mib={torch.cuda.max_memory_allocated() / 2**20:.0f}"
             if a.device != "cpu" else ""))


if __name__ == "__main__":
    main()
