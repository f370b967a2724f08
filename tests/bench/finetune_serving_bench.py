#!/usr/bin/env python3
"""Fine-tuning beside serving, against a running kilnd (OpenAI-compatible HTTP API):

  (a) serving with adapters: aggregate tokens/s of --streams streams spread over --adapters
      LoRA adapters (each made by a short fine-tuning job on the server) vs the same streams
      on the base model alone, interleaved (base, adapters, base, adapters, ...);
  (b) a job running beside serving: ITL p50/p99 at --itl-streams streams with and without a
      job training, and the job's training tokens/s (kiln_train_tokens_total over wall time)
      alone and while serving;
  (c) time from a job's `succeeded` (observed by polling every 10 ms) to the first token
      streamed by its fine_tuned_model.

  build/server/kilnd --set server.storage_dir=/tmp/kiln-bench &
  .venv/bin/python tests/bench/finetune_serving_bench.py --url http://127.0.0.1:8000 \\
      --metrics http://127.0.0.1:8002 --model smollm2

Everything is measured in one run on one machine; quote the ratios (the VM's speed drifts).
--json writes every figure.
"""
import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_loadgen  # noqa: E402  (same directory)

DATA = [
    {"messages": [{"role": "user", "content": f"What is the code word number {i}?"},
                  {"role": "assistant", "content": f"The code word {i} is KILN-{i * 7919}."}]}
    for i in range(16)
]


def http(method, url, body=None, content_type="application/json"):
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read() or b"{}")


def upload(url, lines):
    boundary = "kilnbench"
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"fine-tune\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"bench.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    body += content + f"\r\n--{boundary}--\r\n".encode()
    return http("POST", url + "/v1/files", body, f"multipart/form-data; boundary={boundary}")["id"]


def create_job(url, model, file_id, suffix, epochs, seq=64):
    hyper = {"n_epochs": epochs, "batch_size": 1, "max_seq_len": seq, "lora_r": 8,
             "learning_rate": 1e-3}
    return http("POST", url + "/v1/fine_tuning/jobs",
                {"model": model, "training_file": file_id, "suffix": suffix,
                 "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}}})


def job(url, job_id):
    return http("GET", f"{url}/v1/fine_tuning/jobs/{job_id}")


def wait_job(url, job_id, pred, poll=0.05, timeout=3600):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        j = job(url, job_id)
        if pred(j):
            return j
        if j["status"] in ("failed", "cancelled") and not pred(j):
            raise RuntimeError(f"job {job_id} {j['status']}: {j.get('error')}")
        time.sleep(poll)
    raise RuntimeError(f"job {job_id} did not get there in {timeout} s")


def train_tokens(metrics_url):
    text = urllib.request.urlopen(metrics_url + "/metrics", timeout=30).read().decode()
    m = re.search(r"^kiln_train_tokens_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def level(url, models, streams, per_worker, words, max_tokens, seed):
    """One load level (llm_loadgen's) whose streams cycle over `models`."""
    server = llm_loadgen.Server(",".join(models), url, ",".join(models))
    r = asyncio.run(llm_loadgen.run_level(server, streams, per_worker, words, max_tokens, 600,
                                          seed))
    if r["errors"]:
        print(f"  failed requests: {r['errors']}", file=sys.stderr)
    return r


def first_token_seconds(url, model):
    body = {"model": model, "messages": [{"role": "user", "content": "What is the code word number 3?"}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST")
    req.add_header("Content-Type", "application/json")
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                if (choice.get("delta") or {}).get("content"):  # not the role-only first chunk
                    return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics", default="http://127.0.0.1:8002")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--itl-streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--words", type=int, default=40, help="prompt words (~1.3 tokens each)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--job-seconds", type=float, default=20, help="job-only phase length")
    ap.add_argument("--json")
    a = ap.parse_args()
    url = a.url.rstrip("/")
    out = {}
    file_id = upload(url, DATA)

    # (c) and the adapters of (a): short jobs, one after the other.
    names, ttft = [], []
    for i in range(a.adapters):
        j = create_job(url, a.model, file_id, f"bench{i}-{int(time.time())}", epochs=1)
        done = wait_job(url, j["id"], lambda x: x["status"] == "succeeded", poll=0.01)
        seen = time.perf_counter()  # `succeeded` observed (within one 10 ms poll of the change)
        first_token_seconds(url, done["fine_tuned_model"])
        ttft.append(time.perf_counter() - seen)
        names.append(done["fine_tuned_model"])
    out["c_succeeded_to_first_token_s"] = ttft
    print(f"(c) succeeded -> first token: median {statistics.median(ttft) * 1e3:.0f} ms, "
          f"max {max(ttft) * 1e3:.0f} ms over {len(ttft)} jobs (target < 1 s)")

    # (a) interleaved rounds: base alone, then the same streams over the adapters.
    base, mixed = [], []
    for r in range(a.rounds):
        base.append(level(url, [a.model], a.streams, 1, a.words, a.max_tokens, r)["tokens_per_s"])
        mixed.append(level(url, names, a.streams, 1, a.words, a.max_tokens, r)["tokens_per_s"])
    ratio = statistics.median(m / b for m, b in zip(mixed, base))
    out["a"] = {"base_tokens_per_s": base, "adapters_tokens_per_s": mixed, "ratio": ratio}
    print(f"(a) {a.streams} streams: base {statistics.median(base):.1f} tok/s, over "
          f"{len(names)} adapters {statistics.median(mixed):.1f} tok/s: {ratio:.2f}x "
          f"(target >= 0.8x)")

    # (b) ITL without a job, job alone, ITL with the job.
    quiet = level(url, [a.model], a.itl_streams, 2, a.words, a.max_tokens, 100)
    j = create_job(url, a.model, file_id, f"bench-long-{int(time.time())}", epochs=50)
    wait_job(url, j["id"], lambda x: x.get("kiln", {}).get("step", 0) >= 1)
    t0, k0 = time.perf_counter(), train_tokens(a.metrics)
    time.sleep(a.job_seconds)
    alone = (train_tokens(a.metrics) - k0) / (time.perf_counter() - t0)
    t0, k0 = time.perf_counter(), train_tokens(a.metrics)
    busy = level(url, [a.model], a.itl_streams, 2, a.words, a.max_tokens, 100)
    beside = (train_tokens(a.metrics) - k0) / (time.perf_counter() - t0)
    http("POST", f"{url}/v1/fine_tuning/jobs/{j['id']}/cancel", {})
    out["b"] = {"without_job": quiet, "with_job": busy, "job_tokens_per_s_alone": alone,
                "job_tokens_per_s_beside_serving": beside}
    print(f"(b) {a.itl_streams} streams ITL p50/p99: without a job {quiet['itl_p50_ms']:.1f}/"
          f"{quiet['itl_p99_ms']:.1f} ms, with a job {busy['itl_p50_ms']:.1f}/"
          f"{busy['itl_p99_ms']:.1f} ms: p50 {busy['itl_p50_ms'] / quiet['itl_p50_ms']:.2f}x "
          f"(target <= 1.2x); serving {quiet['tokens_per_s']:.1f} -> {busy['tokens_per_s']:.1f} "
          f"tok/s")
    print(f"    job training tokens/s: alone {alone:.1f}, beside serving {beside:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
