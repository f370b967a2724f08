"""Dynamic batching, priorities, queue timeouts, full queues and cancellation, observed
through real clients, statistics and metrics."""
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import wait_for

CONFIG = """
models:
  - name: batched
    kind: builtin
    builtin: simple
    max_batch_size: 8
    dynamic_batching: {max_queue_delay_microseconds: 20000, preferred_batch_size: [8]}
  - name: prio
    kind: builtin
    builtin: sleep_us
    max_batch_size: 1
    dynamic_batching:
      priority_levels: 2
      default_priority_level: 2
  - name: strict
    kind: builtin
    builtin: sleep_us
    max_batch_size: 1
    dynamic_batching:
      default_queue_policy:
        max_queue_size: 2
        default_timeout_microseconds: 100000
        allow_timeout_override: true
  - name: delayed
    kind: builtin
    builtin: sleep_us
    max_batch_size: 1
    dynamic_batching:
      default_queue_policy: {timeout_action: DELAY, default_timeout_microseconds: 1000}
"""


def sleep_request(model, us, **params):
    req = service_pb2.ModelInferRequest(model_name=model)
    req.inputs.add(name="SLEEP_US", datatype="INT32", shape=[1, 1])
    req.raw_input_contents.append(np.array([us], np.int32).tobytes())
    for k, v in params.items():
        req.parameters[k].int64_param = v
    return req


@pytest.fixture
def server(start_kilnd):
    return start_kilnd(CONFIG)


@pytest.fixture
def stub(server):
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))


def test_concurrent_requests_are_batched(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    done = queue.Queue()
    for k in range(32):
        a = np.full((1, 16), k, np.int32)
        ins = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
               grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        ins[0].set_data_from_numpy(a)
        ins[1].set_data_from_numpy(a)
        c.async_infer("batched", ins, callback=lambda result, error, k=k: done.put((k, result, error)))
    for _ in range(32):
        k, r, e = done.get(timeout=30)
        assert e is None
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2 * k))
    s = c.get_inference_statistics("batched").model_stats[0]
    assert s.inference_count == 32
    assert s.execution_count < s.inference_count, (s.execution_count, s.inference_count)
    sizes = {b.batch_size for b in s.batch_stats}
    assert max(sizes) > 1 and max(sizes) <= 8
    assert server.metric_value("kiln_inference_executions_total", model="batched") == \
        s.execution_count


def running(server, model):
    """Waits until `model` has a request in a running execution (the instance is busy)."""
    wait_for(lambda: server.metric_value("kiln_inference_executing_requests", model=model) == 1,
             f"a running execution of {model}")


def test_higher_priority_runs_first(server, stub):
    # Occupy the single instance, then queue low- then high-priority requests. Each step waits
    # for the server's own gauges (never for a sleep); the blocker's length only has to
    # outlast the queueing of four requests. `order` is the order in which the clients get
    # their answers: each queued request runs 200 ms, so that a client thread descheduled on a
    # busy machine cannot swap two of them (with 1 ms each the blocker's answer was once
    # recorded after low0's, in a CI run of the whole suite on 2 cores).
    order, lock = [], threading.Lock()
    queued_us = 200000

    def call(name, req):
        stub.ModelInfer(req)
        with lock:
            order.append(name)

    def gauge(name):
        return server.metric_value(name, model="prio")

    blocker = threading.Thread(target=call, args=("blocker", sleep_request("prio", 3000000)))
    blocker.start()
    running(server, "prio")
    threads = [threading.Thread(target=call, args=(f"low{i}", sleep_request("prio", queued_us,
                                                                            priority=2)))
               for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: gauge("kiln_inference_pending_requests") == 3, "three queued requests")
    high = threading.Thread(target=call,
                            args=("high", sleep_request("prio", queued_us, priority=1)))
    high.start()
    wait_for(lambda: gauge("kiln_inference_pending_requests") == 4, "the high-priority request")
    assert gauge("kiln_inference_executing_requests") == 1, "the blocker ended too early"
    for t in [blocker, high, *threads]:
        t.join(timeout=30)
    assert order[0] == "blocker"
    assert order[1] == "high", order


def test_queue_timeout_rejects(server, stub):
    blocker = stub.ModelInfer.future(sleep_request("strict", 2000000))
    running(server, "strict")
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(sleep_request("strict", 1, timeout=20000))  # 20 ms override
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timed out" in e.value.details() and "REJECT" in e.value.details()
    blocker.result(timeout=10)


def test_full_queue_refuses_at_once(server, stub):
    blocker = stub.ModelInfer.future(sleep_request("strict", 2000000))
    running(server, "strict")
    queued = [stub.ModelInfer.future(sleep_request("strict", 1, timeout=20000000))
              for _ in range(2)]
    wait_for(lambda: server.metric_value("kiln_inference_pending_requests", model="strict") == 2,
             "two queued requests")
    start = time.time()
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(sleep_request("strict", 1))
    assert time.time() - start < 0.2, "a full queue must answer at once"
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size 2" in e.value.details()
    blocker.result(timeout=10)
    for f in queued:
        f.result(timeout=10)


def test_delay_policy_still_serves_timed_out_requests(server, stub):
    blocker = stub.ModelInfer.future(sleep_request("delayed", 1000000))
    running(server, "delayed")
    r = stub.ModelInfer(sleep_request("delayed", 1), timeout=10)
    assert np.frombuffer(r.raw_output_contents[0], np.int32)[0] == 1
    blocker.result(timeout=10)


def test_cancelled_rpc_leaves_the_queue(server, stub):
    blocker = stub.ModelInfer.future(sleep_request("prio", 3000000))
    running(server, "prio")
    # A client deadline cancels the queued request on the server.
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(sleep_request("prio", 1), timeout=0.1)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: server.metric_value("kiln_inference_failures_total", model="prio",
                                         reason="cancelled") == 1, "the cancellation")
    assert server.metric_value("kiln_inference_pending_requests", model="prio") == 0, \
        "the cancelled request is still queued"
    assert server.metric_value("kiln_inference_executing_requests", model="prio") == 1, \
        "the blocker ended before the cancelled request left the queue"
    blocker.result(timeout=10)
    # The cancelled request never ran: only the blocker executed.
    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert c.get_inference_statistics("prio").model_stats[0].execution_count == 1
