#!/usr/bin/env python3
"""The cost of TLS (and of API-key auth, where kilnd enforces it) on the `simple` tensor model
over gRPC: latency p50/p99 at concurrency 1 and 16, per configuration:

  plaintext   no TLS, no auth
  tls         server.tls with a P-256 certificate (made here with the openssl CLI)
  tls+auth    TLS and one API key in server.auth (skipped, with a note, when this kilnd does
              not refuse a call without a key)

Each configuration is its own kilnd, started side by side; rounds are interleaved (the order
rotates every round) so that drift of the machine's speed spreads over all of them. Every
request is a fresh ModelInfer on long-lived channels (handshakes are not measured: one per
channel); latency is client-side, from a grpc.aio client in this process.

  .venv/bin/python tests/bench/auth_tls_bench.py --kilnd build/server/kilnd

Quote the ratios; absolute figures include the Python client's own overhead.
--json writes every figure.
"""
import argparse
import asyncio
import hashlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

# The `simple` model (with the other built-in tensor models) as the system tests declare it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "system"))
from conftest import TENSOR_MODELS, free_port  # noqa: E402

CONFIG = """
server:
  grpc: {{address: "127.0.0.1:{grpc}"}}
  http: {{address: "127.0.0.1:{http}"}}
  metrics: {{address: "127.0.0.1:{metrics}"}}
  storage_dir: "{storage}"
{extra}
"""


def make_certs(d):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=bench CA", "-keyout", "ca.key",
        "-out", "ca.crt")
    run("req", *ec, "-subj", "/CN=kilnd", "-keyout", "tls.key", "-out", "tls.csr")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
        "1", "-days", "2", "-extfile", "san.ext", "-out", "tls.crt")
    return {"ca": os.path.join(d, "ca.crt"), "cert": os.path.join(d, "tls.crt"),
            "key": os.path.join(d, "tls.key")}


class Daemon:
    def __init__(self, name, kilnd, workdir, tls=None, api_key=None):
        self.name, self.tls, self.api_key = name, tls, api_key
        self.grpc_port = free_port()
        extra = []
        if tls:
            extra.append(f'  tls: {{cert_file: "{tls["cert"]}", key_file: "{tls["key"]}"}}')
        if api_key:
            digest = hashlib.sha256(api_key.encode()).hexdigest()
            extra.append(f"  auth: {{api_keys: [{{name: b, key_sha256: {digest}, "
                         f"scopes: [inference]}}]}}")
        storage = os.path.join(workdir, f"storage-{name.replace('+', '-')}")
        config = os.path.join(workdir, f"{name.replace('+', '-')}.yaml")
        with open(config, "w") as f:
            f.write(CONFIG.format(grpc=self.grpc_port, http=free_port(), metrics=free_port(),
                                  storage=storage, extra="\n".join(extra)) + TENSOR_MODELS)
        self.log = open(os.path.join(workdir, f"{name.replace('+', '-')}.log"), "w")
        self.proc = subprocess.Popen([kilnd, "--config", config], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def channel(self):
        target = f"127.0.0.1:{self.grpc_port}"
        if not self.tls:
            return grpc.aio.insecure_channel(target)
        with open(self.tls["ca"], "rb") as f:
            return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(f.read()))

    def metadata(self):
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def simple_request():
    req = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        req.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return req


async def wait_ready(d, timeout=60):
    deadline = time.time() + timeout
    async with d.channel() as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        while time.time() < deadline:
            if d.proc.poll() is not None:
                raise RuntimeError(f"{d.name}: kilnd exited with {d.proc.returncode}")
            try:
                r = await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=1,
                                           metadata=d.metadata())
                if r.ready:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{d.name}: not ready after {timeout} s")


async def auth_enforced(d):
    """Whether `d` refuses a ModelInfer without a key."""
    async with d.channel() as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        try:
            await stub.ModelInfer(simple_request(), timeout=10)
            return False
        except grpc.aio.AioRpcError as e:
            return e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED)


async def run_level(d, concurrency, requests):
    """`requests` ModelInfer calls, `concurrency` at a time, each worker on its own channel
    (as separate clients would be). Returns the latencies in microseconds."""
    req, md = simple_request(), d.metadata()
    channels = [d.channel() for _ in range(concurrency)]
    latencies = []
    left = [requests]

    async def worker(ch):
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        await stub.ModelInfer(req, timeout=30, metadata=md)  # connect (and handshake) first
        await barrier.wait()
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            await stub.ModelInfer(req, timeout=30, metadata=md)
            latencies.append((time.perf_counter() - t0) * 1e6)

    barrier = asyncio.Barrier(concurrency)
    try:
        await asyncio.gather(*(worker(ch) for ch in channels))
    finally:
        for ch in channels:
            await ch.close()
    return latencies


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kilnd", required=True, help="path to the kilnd binary")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=2000, help="per round and level")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    work = tempfile.mkdtemp(prefix="kiln-auth-tls-bench-")
    certs = make_certs(work)
    key = secrets.token_urlsafe(24)
    daemons = [Daemon("plaintext", args.kilnd, work),
               Daemon("tls", args.kilnd, work, tls=certs),
               Daemon("tls+auth", args.kilnd, work, tls=certs, api_key=key)]
    notes = []
    try:
        for d in daemons:
            await wait_ready(d)
        if not await auth_enforced(daemons[2]):
            notes.append("tls+auth skipped: this kilnd serves calls without a key "
                         "(server.auth not enforced)")
            daemons.pop().stop()
        # Warm-up: one short round each.
        for d in daemons:
            for c in levels:
                await run_level(d, c, min(200, args.requests))
        results = {d.name: {c: [] for c in levels} for d in daemons}
        for r in range(args.rounds):
            order = daemons[r % len(daemons):] + daemons[:r % len(daemons)]
            for c in levels:
                for d in order:
                    results[d.name][c] += await run_level(d, c, args.requests)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.stop()

    summary = {}
    print(f"\n`simple` over gRPC, {args.rounds} interleaved rounds x {args.requests} requests "
          f"per level")
    print(f"{'configuration':<14}{'conc':>5}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, by_level in results.items():
        for c, xs in by_level.items():
            s = {"p50": percentile(xs, 50), "p99": percentile(xs, 99),
                 "mean": statistics.fmean(xs), "n": len(xs)}
            summary.setdefault(name, {})[c] = s
            print(f"{name:<14}{c:>5}{s['p50']:>10.0f}{s['p99']:>10.0f}{s['mean']:>10.0f}")
    base = summary["plaintext"]
    print("\nratios to plaintext:")
    for name in summary:
        if name == "plaintext":
            continue
        for c in levels:
            print(f"  {name:<12} conc {c:>2}: p50 x{summary[name][c]['p50'] / base[c]['p50']:.3f}"
                  f"  p99 x{summary[name][c]['p99'] / base[c]['p99']:.3f}")
    for n in notes:
        print(f"note: {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "notes": notes, "rounds": args.rounds,
                       "requests": args.requests}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
