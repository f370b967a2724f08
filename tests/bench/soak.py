#!/usr/bin/env python3
"""Soak: --minutes of mixed load against one kilnd serving the default model, reporting the
daemon's resident memory, open file descriptors, threads and KV-cache blocks in use at the
start and at the end (issue 13, item 7).

  .venv/bin/python tests/bench/soak.py --minutes 30          # starts build/server/kilnd
  .venv/bin/python tests/bench/soak.py --minutes 5 --json soak.json

The daemon (started here, on free loopback ports, its own storage directory) serves SmolLM2
(`smollm2`, fetched by scripts/fetch-default-model.sh) and the built-in `simple`, with
fine-tuning on. --workers threads each loop over a weighted mix of:

  HTTP  (OpenAI API) streamed chat to the end; non-streamed completions; a stream the client
        closes after two chunks (cancel); a request sent whole, or cut in the middle of its
        body, on a raw socket closed without reading the answer (disconnect); malformed JSON,
        absurd `max_tokens`, an unknown model (each must be a 4xx); KServe v2 REST inference on
        `simple`.
  gRPC  kiln.v1 GenerateStream to the end and cancelled after its first message; KServe
        ModelInfer on `simple`; now and then a fresh channel, used once and closed.

beside two background loops: model reloads through the KServe repository API (`simple`
unloaded and loaded again, and `smollm2` reloaded while READY, so the new instance takes new
requests while the old one drains), and tiny fine-tuning jobs (4 examples, 1 epoch, LoRA r 4)
one after the other, every --finetune-every seconds.

The start snapshot is taken after a warm-up (--warmup-seconds of the same mix, plus one
reload of each kind and one fine-tuning job to the end), so one-time allocations (kernel
compilation, thread pools growing to the load, the job store, training buffers) are not
counted as growth. The end snapshot is taken once the daemon is idle: no request in flight,
every KV block back in the pool (kiln_llm_kv_cache_usage_ratio 0), no job running, and
descriptors settled. Figures are read from /proc/<pid>/ (VmRSS, fd/, Threads) and /metrics.

Every request's outcome is counted; an outcome the mix does not expect (a 5xx, a dropped
stream, a gRPC error other than the ones a reload or a cancel explains) is reported as
unexpected. tests/system/test_soak.py runs this for 2 minutes and asserts the bounds.
"""
import argparse
import itertools
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "system"))
from conftest import Kilnd, default_model_path, ready, wait_for  # noqa: E402

LLM = "smollm2"
WORDS = "kiln clay glaze fire oven potter wheel vase bowl plate cup handle blue green".split()


def _stubs():
    """kiln.v1 generation stubs: the build's (tests/system/CMakeLists.txt), else fresh ones."""
    built = Path(os.environ.get("KILN_BUILD_DIR", ROOT / "build")) / "tests" / "system" / "pb"
    if not (built / "kiln" / "v1" / "generation_pb2_grpc.py").exists():
        import subprocess
        import tempfile
        built = Path(tempfile.mkdtemp(prefix="kiln-pb-"))
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                        f"--python_out={built}", f"--grpc_python_out={built}",
                        str(ROOT / "proto" / "kiln" / "v1" / "generation.proto")], check=True)
    sys.path.insert(0, str(built))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    return generation_pb2, generation_pb2_grpc


gen_pb2, gen_grpc = _stubs()


# ---- the daemon and what we measure ---------------------------------------------------------

def config_text():
    return f"""
server:
  shutdown_grace_seconds: 60
fine_tuning:
  enabled: true
  max_concurrent_jobs: 1
  checkpoint_every_steps: 2
  max_yield_seconds: 1
models:
  - name: {LLM}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
    scheduler: {{max_num_seqs: 16, max_queue_size: 256}}
  - name: simple
    kind: builtin
    builtin: simple
    max_batch_size: 8
    dynamic_batching: {{max_queue_delay_microseconds: 0}}
"""


def start_daemon(tmp_dir, mmap_threshold=None):
    """A ready kilnd (conftest.Kilnd) on free ports; the caller stops it. `mmap_threshold`:
    glibc's M_MMAP_THRESHOLD for the daemon (MALLOC_MMAP_THRESHOLD_), see --help."""
    path = Path(tmp_dir) / "kiln-soak.yaml"
    path.write_text(config_text())
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else None
    return ready(Kilnd(path, env=env))


def parse_metrics(text):
    """{(name, frozenset(labels)): value} of every sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p)
        out[(name, pairs)] = float(value)
    return out


def kv_blocks(samples):
    """(blocks in use, blocks in the pool) over every LLM: usage ratio x pool size per model."""
    used = total = 0
    for (name, labels), value in samples.items():
        if name == "kiln_llm_kv_cache_blocks":
            ratio = samples.get(("kiln_llm_kv_cache_usage_ratio", labels), 0.0)
            used += round(ratio * value)
            total += int(value)
    return used, total


def metric(samples, name):
    return sum(v for (n, _), v in samples.items() if n == name)


def snapshot(k):
    """RSS, descriptors and threads from /proc/<pid>; KV blocks and in-flight from /metrics."""
    pid = k.proc.pid
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    samples = parse_metrics(k.metrics())
    used, total = kv_blocks(samples)
    adapters = list(Path(k.storage).rglob("adapter_model.safetensors")) \
        if getattr(k, "storage", None) else []
    return {
        "t": time.time(),
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "inflight": metric(samples, "kiln_inflight_requests"),
        # Every finished job and each checkpoint it keeps is a served LoRA adapter, held in
        # memory by design: growth they account for is not a leak.
        "adapters": len(adapters),
        "adapters_mib": sum(p.stat().st_size for p in adapters) / 2**20,
        "jobs_running": samples.get(("kiln_finetune_jobs", frozenset({("status", '"running"')})),
                                    0.0),
    }


def idle(k):
    s = snapshot(k)
    return s["inflight"] == 0 and s["kv_blocks_used"] == 0 and s["jobs_running"] == 0


# ---- the mix ----------------------------------------------------------------------------------

class Client:
    """One worker's connections: an HTTP session and a gRPC channel (kept across requests, as
    real clients do; the raw-socket and fresh-channel actions churn connections)."""

    def __init__(self, k):
        self.k = k
        self.http = requests.Session()
        self.channel = grpc.insecure_channel(k.grpc_url)
        self.gen = gen_grpc.GenerationStub(self.channel)
        self.kserve = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def close(self):
        self.http.close()
        self.channel.close()


def prompt(rng):
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def post(c, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return c.http.post(c.k.base + path, data=data, timeout=300,
                       headers={"Content-Type": "application/json"}, **kw)


def sse_events(resp):
    for line in resp.iter_lines():
        if line.startswith(b"data:"):
            yield line[5:].strip()


def http_stream(c, rng):
    body = {"model": LLM, "messages": [{"role": "user", "content": prompt(rng)}],
            "max_tokens": rng.randint(4, 32), "stream": True,
            "temperature": rng.choice([0, 0.8])}
    with post(c, "/v1/chat/completions", body, stream=True) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        events = list(sse_events(r))
    return "ok" if events and events[-1] == b"[DONE]" else "stream without [DONE]"


def http_complete(c, rng):
    r = post(c, "/v1/completions", {"model": LLM, "prompt": prompt(rng),
                                    "max_tokens": rng.randint(1, 16)})
    return "ok" if r.status_code == 200 and r.json()["choices"] else f"http {r.status_code}"


def http_cancel(c, rng):
    body = {"model": LLM, "prompt": prompt(rng), "max_tokens": 512, "ignore_eos": True,
            "stream": True}
    with post(c, "/v1/completions", body, stream=True) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        events = sse_events(r)
        next(events), next(events)
    # Leaving the block closes the connection mid-stream (the rest is unread): the server
    # must notice and free the sequence's blocks (checked at the end through the KV usage).
    return "ok"


def http_disconnect(c, rng):
    body = json.dumps({"model": LLM, "prompt": prompt(rng), "max_tokens": 64,
                       "stream": rng.random() < 0.5}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", c.k.http_port), timeout=30) as s:
        if rng.random() < 0.5:
            s.sendall(head + body)        # the whole request, then gone before the answer
            if rng.random() < 0.5:
                try:
                    s.settimeout(5)
                    s.recv(64)            # ... or after its first bytes (if they come soon)
                except TimeoutError:
                    pass
        else:
            s.sendall(head + body[:len(body) // 2])  # cut in the middle of the body
    return "ok"


BAD = [
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "cont'),
    ("/v1/completions", {"model": LLM, "prompt": "a", "max_tokens": 10**9}),
    ("/v1/completions", {"model": LLM, "prompt": "a", "max_tokens": 2**70}),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user",
                                                                      "content": "hi"}]}),
    ("/v2/models/simple/infer", b"[1, 2"),
]


def http_bad(c, rng):
    path, body = rng.choice(BAD)
    r = post(c, path, body)
    return "ok" if 400 <= r.status_code < 500 else f"http {r.status_code} for bad input"


def simple_inputs():
    a = list(range(16))
    return a, [1] * 16


def http_simple(c, rng):
    a, b = simple_inputs()
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b}]}
    r = post(c, "/v2/models/simple/infer", body)
    if r.status_code == 200:
        return "ok"
    # `simple` is unloaded now and then by the reload loop.
    return "simple unloaded" if r.status_code in (400, 404, 503) else f"http {r.status_code}"


def grpc_stream(c, rng, cancel=False):
    req = gen_pb2.GenerateRequest(model=LLM, prompt=prompt(rng), sampling=gen_pb2.SamplingParams(
        max_tokens=512 if cancel else rng.randint(4, 32), ignore_eos=cancel))
    stream = c.gen.GenerateStream(req, timeout=300)
    try:
        for _ in stream:
            if cancel:
                stream.cancel()
                return "ok"
    except grpc.RpcError as e:
        if cancel and e.code() == grpc.StatusCode.CANCELLED:
            return "ok"
        return f"grpc {e.code().name}"
    return "ok"


def grpc_simple(c, rng, fresh=False):
    a, b = simple_inputs()
    req = service_pb2.ModelInferRequest(model_name="simple")
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend(data)
    channel = grpc.insecure_channel(c.k.grpc_url) if fresh else None
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel) if fresh else c.kserve
    try:
        stub.ModelInfer(req, timeout=60)
        return "ok"
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
            return "simple unloaded"
        return f"grpc {e.code().name}"
    finally:
        if channel:
            channel.close()


MIX = [  # (name, weight, action)
    ("http_stream", 6, http_stream),
    ("http_complete", 4, http_complete),
    ("http_cancel", 3, http_cancel),
    ("http_disconnect", 3, http_disconnect),
    ("http_bad", 3, http_bad),
    ("http_simple", 3, http_simple),
    ("grpc_stream", 4, grpc_stream),
    ("grpc_cancel", 3, lambda c, rng: grpc_stream(c, rng, cancel=True)),
    ("grpc_simple", 3, grpc_simple),
    ("grpc_fresh_channel", 1, lambda c, rng: grpc_simple(c, rng, fresh=True)),
]
EXPECTED = {"ok", "simple unloaded"}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = Counter()

    def add(self, action, outcome):
        with self.lock:
            self.counts[(action, outcome)] += 1

    def unexpected(self):
        return {f"{a}: {o}": n for (a, o), n in self.counts.items() if o not in EXPECTED}

    def by_action(self):
        out = Counter()
        for (a, _), n in self.counts.items():
            out[a] += n
        return dict(out)


def run_action(name, action, c, rng, tally):
    try:
        outcome = action(c, rng)
    except (requests.RequestException, OSError, StopIteration) as e:
        outcome = f"{type(e).__name__}"
    tally.add(name, outcome)


def worker(k, index, workers, seed, stop, tally):
    """Worker `index` of `workers` first runs its share of the mix once each (so that every
    action runs however slow the machine), then weighted random picks until `stop`."""
    rng = random.Random(seed)
    names, weights = zip(*[(n, w) for n, w, _ in MIX])
    actions = {n: a for n, _, a in MIX}
    c = Client(k)
    try:
        for name in names[index::workers]:
            run_action(name, actions[name], c, rng, tally)
        while not stop.is_set():
            name = rng.choices(names, weights)[0]
            run_action(name, actions[name], c, rng, tally)
    finally:
        c.close()


def reload_simple(k):
    for verb in ("unload", "load"):
        r = requests.post(f"{k.base}/v2/repository/models/simple/{verb}", timeout=120)
        if r.status_code != 200:
            return f"simple {verb}: http {r.status_code} {r.text[:200]}"
    return "ok"


def reload_llm(k):
    r = requests.post(f"{k.base}/v2/repository/models/{LLM}/load", timeout=300)
    return "ok" if r.status_code == 200 else f"{LLM} load: http {r.status_code} {r.text[:200]}"


def reloader(k, stop, tally, simple_every, llm_every):
    next_simple, next_llm = time.time() + simple_every, time.time() + llm_every
    while not stop.wait(0.5):
        if time.time() >= next_simple:
            tally.add("reload_simple", reload_simple(k))
            next_simple = time.time() + simple_every
        if time.time() >= next_llm:
            tally.add("reload_llm", reload_llm(k))
            next_llm = time.time() + llm_every


# ---- fine-tuning ------------------------------------------------------------------------------

FT_DATA = "".join(json.dumps({"messages": [
    {"role": "user", "content": f"What is the soak word {i}?"},
    {"role": "assistant", "content": f"The soak word {i} is CLAY-{i * 7919}."}]}) + "\n"
    for i in range(4)).encode()
_JOB_SEQ = itertools.count(1)
FT_HYPER = {"n_epochs": 1, "batch_size": 1, "max_seq_len": 64, "lora_r": 4,
            "learning_rate": 1e-3}


def finetune_job(k, stop=None, timeout=600):
    """Uploads the tiny dataset, trains it to the end; returns the outcome."""
    r = requests.post(f"{k.base}/v1/files", data={"purpose": "fine-tune"},
                      files={"file": ("soak.jsonl", FT_DATA, "application/jsonl")}, timeout=60)
    if r.status_code != 200:
        return f"upload: http {r.status_code} {r.text[:200]}"
    body = {"model": LLM, "training_file": r.json()["id"], "suffix": f"soak{next(_JOB_SEQ)}",
            "method": {"type": "supervised", "supervised": {"hyperparameters": FT_HYPER}}}
    r = requests.post(f"{k.base}/v1/fine_tuning/jobs", json=body, timeout=60)
    if r.status_code != 200:
        return f"create: http {r.status_code} {r.text[:200]}"
    job_id = r.json()["id"]
    deadline = time.time() + timeout
    cancelled = False
    while time.time() < deadline:
        status = requests.get(f"{k.base}/v1/fine_tuning/jobs/{job_id}", timeout=60).json()
        if status["status"] == "succeeded" or (cancelled and status["status"] == "cancelled"):
            return "ok"
        if status["status"] in ("failed", "cancelled"):
            return f"job {status['status']}: {status.get('error')}"
        if stop is not None and stop.is_set() and not cancelled:
            # The soak is over: cancel rather than hold its end for the rest of the job.
            r = requests.post(f"{k.base}/v1/fine_tuning/jobs/{job_id}/cancel", timeout=60)
            cancelled = r.status_code == 200
        time.sleep(0.2)
    return f"job {job_id} not finished after {timeout} s"


def finetuner(k, stop, tally, every):
    while not stop.is_set():
        tally.add("finetune_job", finetune_job(k, stop))
        if stop.wait(every):
            return


# ---- the run ----------------------------------------------------------------------------------

def run_mix(k, seconds, workers, seed, tally, simple_every, llm_every, finetune_every,
            samples=None, sample_every=10.0):
    """`workers` mixed-load threads plus the reload and fine-tuning loops for `seconds`;
    appends a snapshot to `samples` every `sample_every` seconds."""
    stop = threading.Event()
    threads = [threading.Thread(target=worker,
                                args=(k, i, workers, seed * 1000 + i, stop, tally))
               for i in range(workers)]
    threads.append(threading.Thread(target=reloader,
                                    args=(k, stop, tally, simple_every, llm_every)))
    if finetune_every is not None:
        threads.append(threading.Thread(target=finetuner, args=(k, stop, tally, finetune_every)))
    for t in threads:
        t.start()
    end = time.time() + seconds
    try:
        while not stop.wait(min(sample_every, max(0.0, end - time.time()))):
            if samples is not None:
                samples.append(snapshot(k))
            if time.time() >= end:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()


def settle(k, start, timeout=120):
    """Waits until the daemon is idle (nothing in flight, every KV block free, no job
    running) and its descriptors are back to the start's (or `timeout` passed); returns the
    end snapshot and the seconds that took."""
    t0 = time.time()
    wait_for(lambda: idle(k), "the daemon to be idle (in-flight 0, KV blocks 0, no job)",
             timeout=timeout)
    try:
        wait_for(lambda: snapshot(k)["fds"] <= start["fds"], "descriptors back to the start",
                 timeout=max(5.0, timeout - (time.time() - t0)))
    except AssertionError:
        pass  # reported through the figures; the test holds the bound
    return snapshot(k), time.time() - t0


def soak(k, minutes, workers=6, seed=1, warmup_seconds=20, simple_every=10.0, llm_every=30.0,
         finetune_every=60.0, log=print):
    """Warm-up, the start snapshot, `minutes` of the mix, idle, the end snapshot. Returns the
    report (see main); `finetune_every` None: no fine-tuning."""
    warm = Tally()
    log(f"warm-up: one reload of each kind{', one fine-tuning job' if finetune_every else ''}, "
        f"{warmup_seconds:.0f} s of the mix")
    warm.add("reload_simple", reload_simple(k))
    warm.add("reload_llm", reload_llm(k))
    if finetune_every is not None:
        warm.add("finetune_job", finetune_job(k))
    run_mix(k, warmup_seconds, workers, seed + 7, warm, simple_every, llm_every, None)
    start, _ = settle(k, {"fds": 1 << 30})
    log(f"start: {fmt(start)}")

    tally, samples = Tally(), [start]
    run_mix(k, minutes * 60, workers, seed, tally, simple_every, llm_every, finetune_every,
            samples, sample_every=min(30.0, minutes * 60 / 8))
    for s in samples[1:]:
        log(f"  +{s['t'] - start['t']:6.0f} s  {fmt(s)}")
    end, settle_s = settle(k, start)
    log(f"end:   {fmt(end)}  (idle after {settle_s:.1f} s)")
    delta = {key: end[key] - start[key] for key in ("rss_mib", "fds", "threads",
                                                    "kv_blocks_used", "adapters",
                                                    "adapters_mib")}
    # RSS growth the new served adapters do not account for.
    delta["rss_unexplained_mib"] = delta["rss_mib"] - delta["adapters_mib"]
    log("delta: " + ", ".join(f"{key} {v:+.1f}" if isinstance(v, float) else f"{key} {v:+d}"
                              for key, v in delta.items()))
    log(f"requests: {sum(tally.by_action().values())} "
        f"({', '.join(f'{a} {n}' for a, n in sorted(tally.by_action().items()))})")
    if tally.unexpected() or warm.unexpected():
        log(f"unexpected outcomes: {tally.unexpected()} (warm-up: {warm.unexpected()})")
    return {"minutes": minutes, "workers": workers, "start": start, "end": end,
            "delta": delta, "peak_rss_mib": max(s["rss_mib"] for s in samples),
            "samples": samples, "settle_s": settle_s, "requests": tally.by_action(),
            "unexpected": tally.unexpected(), "warmup_unexpected": warm.unexpected()}


def fmt(s):
    return (f"RSS {s['rss_mib']:7.1f} MiB  fds {s['fds']:4d}  threads {s['threads']:3d}  "
            f"KV blocks {s['kv_blocks_used']}/{s['kv_blocks_total']}  "
            f"adapters {s['adapters']} ({s['adapters_mib']:.1f} MiB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=6, help="mixed-load threads")
    ap.add_argument("--warmup-seconds", type=float, default=20.0)
    ap.add_argument("--simple-every", type=float, default=10.0,
                    help="seconds between unload+load of `simple`")
    ap.add_argument("--llm-every", type=float, default=30.0,
                    help="seconds between reloads of smollm2")
    ap.add_argument("--finetune-every", type=float, default=60.0,
                    help="seconds between fine-tuning jobs; negative: none")
    ap.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                    help="run kilnd with glibc's MALLOC_MMAP_THRESHOLD_=BYTES. Unset, glibc "
                         "raises its threshold after the first large free (up to 32 MiB), so "
                         "a reloaded model's buffers land in the heap and RSS climbs with "
                         "each reload before it levels off; 65536 keeps it flat")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    import tempfile
    k = start_daemon(tempfile.mkdtemp(prefix="kiln-soak-"), args.malloc_mmap_threshold)
    try:
        report = soak(k, args.minutes, args.workers, args.seed, args.warmup_seconds,
                      args.simple_every, args.llm_every,
                      None if args.finetune_every < 0 else args.finetune_every)
    finally:
        code = k.stop()
    print(f"kilnd exited with {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if code == 0 and not report["unexpected"] else 1


if __name__ == "__main__":
    sys.exit(main())
