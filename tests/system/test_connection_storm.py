"""10,000 TCP connections opened and dropped (issue 13, fault tests): connect and close, a
request cut off in its headers or its body (HTTP and metrics ports), garbage or half an HTTP/2
preface on the gRPC port, some closed with a reset (SO_LINGER 0), 64 at a time. Afterwards
kilnd still answers HTTP and gRPC health and an inference on both ports, its descriptors come
back to the baseline and its threads stayed bounded throughout (sampled from
/proc/<pid>/status while the storm runs).

Then the same with kilnd's descriptor limit lowered to 128 (RLIMIT_NOFILE, as a container or
a unit with a low `LimitNOFILE` would have): connections held open until accept fails with
EMFILE, then closed; each port must serve again."""
import os
import random
import resource
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import requests
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import wait_for

CONNECTIONS = 10_000
PARALLEL = 64
# Descriptors kilnd may hold beyond its baseline once the storm is over: none are expected,
# a couple allowed for a timer or an accept racing the count.
FD_SLACK = 2
# Threads the storm may add at its peak: gRPC's sync server grows its pollers under load
# (bounded by its resource quota); a thread per connection would blow through this at once.
THREAD_SLACK = 16


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


SIMPLE = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                      "data": list(range(16))},
                     {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32",
                      "data": [1] * 16}]}


def still_serving(k):
    """HTTP and gRPC health, and `simple` inferred over both ports."""
    assert requests.get(f"{k.base}/v2/health/ready", timeout=10).status_code == 200
    r = requests.post(f"{k.base}/v2/models/simple/infer", json=SIMPLE, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [i + 1 for i in range(16)]
    with grpc.insecure_channel(k.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        req = service_pb2.ModelInferRequest(model_name="simple")
        for name, data in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
            t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            t.contents.int_contents.extend(data)
        out = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=10)
        assert struct.unpack("<16i", out.raw_output_contents[0]) == \
            tuple(i + 1 for i in range(16))


def drop_one(k, i):
    """One connection, opened and dropped in one of several ways; returns its kind."""
    rng = random.Random(i)
    kind = rng.choice(["http_close", "http_partial_headers", "http_partial_body",
                       "grpc_close", "grpc_garbage", "grpc_partial_preface",
                       "metrics_partial_headers"])
    port = {"http": k.http_port, "grpc": k.grpc_port,
            "metrics": k.metrics_port}[kind.split("_")[0]]
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        if kind == "http_partial_headers":
            s.sendall(b"GET /v2/health/re")
        elif kind == "metrics_partial_headers":
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: ki")
        elif kind == "http_partial_body":
            s.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: kiln\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                      b'{"inputs": [')
        elif kind == "grpc_garbage":
            s.sendall(rng.randbytes(rng.randint(1, 512)))
        elif kind == "grpc_partial_preface":
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n")
        if rng.random() < 0.3:  # abortive close: RST instead of FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        s.close()
    return kind


def test_ten_thousand_dropped_connections(kilnd):
    pid = kilnd.proc.pid
    still_serving(kilnd)  # warm: every path used once before the baseline
    fds0, threads0 = fd_count(pid), thread_count(pid)

    peak = {"fds": fds0, "threads": threads0}
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            try:
                peak["fds"] = max(peak["fds"], fd_count(pid))
                peak["threads"] = max(peak["threads"], thread_count(pid))
            except FileNotFoundError:
                return  # the daemon died: the checks below say so

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            kinds = list(pool.map(lambda i: drop_one(kilnd, i), range(CONNECTIONS)))
    finally:
        done.set()
        sampler.join()
    assert len(kinds) == CONNECTIONS and len(set(kinds)) == 7
    assert kilnd.proc.poll() is None, f"kilnd died:\n{kilnd.output()}"

    still_serving(kilnd)
    # Cut-off requests wait for their missing bytes until the peer's FIN or RST arrives, which
    # it has: every descriptor must be closed again, without waiting for an idle timeout.
    wait_for(lambda: fd_count(pid) <= fds0 + FD_SLACK,
             f"kilnd's descriptors back to {fds0} (+{FD_SLACK}); now {fd_count(pid)}",
             timeout=30)
    assert peak["threads"] <= threads0 + THREAD_SLACK, \
        f"threads went from {threads0} to {peak['threads']} during the storm"
    wait_for(lambda: thread_count(pid) <= threads0 + 2,
             f"kilnd's threads back to {threads0}; now {thread_count(pid)}", timeout=30)
    print(f"baseline: {fds0} fds, {threads0} threads; peak during the storm: {peak['fds']} fds, "
          f"{peak['threads']} threads; after: {fd_count(pid)} fds, {thread_count(pid)} threads")


FD_LIMIT = 128


def exhaust_descriptors(k, port):
    """Holds connections to `port` until kilnd's accept fails for want of descriptors, then
    drops them all."""
    resource.prlimit(k.proc.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    held = []
    try:
        for _ in range(2 * FD_LIMIT):  # connect succeeds from the backlog, accepted or not
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        wait_for(lambda: "Too many open files" in k.output(), "kilnd to run out of descriptors")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: fd_count(k.proc.pid) < FD_LIMIT // 2, "the held connections to close")


def test_http_serves_again_after_running_out_of_descriptors(kilnd):
    exhaust_descriptors(kilnd, kilnd.http_port)
    wait_for(lambda: requests.get(f"{kilnd.base}/v2/health/ready", timeout=5).status_code == 200,
             "HTTP to answer again")
    still_serving(kilnd)


@pytest.mark.xfail(strict=True, raises=grpc.RpcError, reason=(
    "gRPC 1.51 (Debian 12's libgrpc++) stops listening for good after one failed accept4 "
    "(tcp_server_posix.cc: 'Failed accept4: Too many open files'): the gRPC port accepts no "
    "connection again while HTTP recovers. Strict: this fails once it is fixed, so the marker "
    "goes."))
def test_grpc_serves_again_after_running_out_of_descriptors(kilnd):
    exhaust_descriptors(kilnd, kilnd.grpc_port)
    still_serving(kilnd)
