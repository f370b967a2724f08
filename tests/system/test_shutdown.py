"""Graceful shutdown: SIGTERM -> not ready at once -> in-flight work finishes within the grace
period -> exit 0; past the grace period the rest is cancelled with a clear status, exit 1."""
import signal
import time

import grpc
import numpy as np
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import wait_for

CONFIG = """
server:
  shutdown_grace_seconds: {grace}
models:
  - name: sleep
    kind: builtin
    builtin: sleep_us
    max_batch_size: 1
    instance_count: 2
    dynamic_batching: {{}}
"""


def sleep_request(us):
    req = service_pb2.ModelInferRequest(model_name="sleep")
    req.inputs.add(name="SLEEP_US", datatype="INT32", shape=[1, 1])
    req.raw_input_contents.append(np.array([us], np.int32).tobytes())
    return req


def admitted(k, n):
    wait_for(lambda: k.metric_value("kiln_inflight_requests") == n, f"{n} admitted requests")


def test_sigterm_finishes_in_flight_work_and_exits_0(start_kilnd):
    k = start_kilnd(CONFIG.format(grace=10))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(k.grpc_url))
    futures = [stub.ModelInfer.future(sleep_request(700000)) for _ in range(4)]
    admitted(k, 4)
    k.proc.send_signal(signal.SIGTERM)
    # Not ready once the signal is handled, still live.
    wait_for(lambda: requests.get(f"{k.base}/v2/health/ready", timeout=2).status_code == 503,
             "readiness to drop")
    # The bodies say the same as the statuses (the open inference protocol's JSON).
    r = requests.get(f"{k.base}/v2/health/ready", timeout=2)
    assert (r.status_code, r.json()) == (503, {"ready": False})
    r = requests.get(f"{k.base}/v2/models/sleep/ready", timeout=2)
    assert (r.status_code, r.json()) == (503, {"name": "sleep", "ready": False})
    r = requests.get(f"{k.base}/v2/health/live", timeout=2)
    assert (r.status_code, r.json()) == (200, {"live": True})
    # New work is refused while draining.
    try:
        stub.ModelInfer(sleep_request(1), timeout=5)
        raise AssertionError("a request was accepted during shutdown")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.details()
    for f in futures:
        r = f.result(timeout=10)
        assert np.frombuffer(r.raw_output_contents[0], np.int32)[0] == 700000
    assert k.proc.wait(timeout=10) == 0
    assert "shutdown complete" in k.output()


def test_work_past_the_grace_period_is_cancelled_and_exit_is_1(start_kilnd):
    k = start_kilnd(CONFIG.format(grace=0.5))
    k.expected_exit = 1
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(k.grpc_url))
    running = [stub.ModelInfer.future(sleep_request(5000000)) for _ in range(3)]
    admitted(k, 3)
    start = time.time()
    k.proc.send_signal(signal.SIGTERM)
    for f in running:
        try:
            f.result(timeout=10)
            raise AssertionError("a 5 s request finished inside a 0.5 s grace period")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert "shutting down" in e.details()
    assert k.proc.wait(timeout=10) == 1
    assert time.time() - start < 4
    assert "grace period" in k.output()


def test_sigint_also_shuts_down(start_kilnd):
    k = start_kilnd(CONFIG.format(grace=5))
    k.proc.send_signal(signal.SIGINT)
    assert k.proc.wait(timeout=10) == 0
