"""KServe v2 over gRPC with the stock Triton client, grpcio health checks and reflection."""
import errno
import os
import queue
import threading

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import wait_for


def simple_inputs(a, b, binary=True):
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "INT32"),
              grpcclient.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_live_ready_and_metadata(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("simple")
    md = c.get_server_metadata()
    assert md.name == "kiln"
    assert "model_repository" in md.extensions and "statistics" in md.extensions
    mm = c.get_model_metadata("simple")
    assert mm.platform == "kiln_builtin"
    assert [(t.name, t.datatype, list(t.shape)) for t in mm.inputs] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    cfg = c.get_model_config("simple").config
    assert cfg.max_batch_size == 8
    assert [i.name for i in cfg.input] == ["INPUT0", "INPUT1"]
    idx = c.get_model_repository_index()
    assert {m.name: m.state for m in idx.models} == {
        "simple": "READY", "identity_fp32": "READY", "sleep_us": "READY"}


def test_infer_simple_raw(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    r = c.infer("simple", simple_inputs(a, b),
                outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                         grpcclient.InferRequestedOutput("OUTPUT1")], request_id="r1")
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    assert r.get_response().id == "r1"


def test_infer_simple_typed_contents(kilnd):
    """typed `contents` instead of raw_input_contents, through the raw protobuf stub."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(kilnd.grpc_url))
    req = service_pb2.ModelInferRequest(model_name="simple")
    for name, values in (("INPUT0", range(16)), ("INPUT1", [2] * 16)):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend(values)
    resp = stub.ModelInfer(req)
    out = {o.name: np.frombuffer(raw, dtype=np.int32)
           for o, raw in zip(resp.outputs, resp.raw_output_contents)}
    np.testing.assert_array_equal(out["OUTPUT0"], np.arange(16) + 2)
    np.testing.assert_array_equal(out["OUTPUT1"], np.arange(16) - 2)


def test_identity_any_shape_and_large(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    for shape in [(3,), (2, 3, 4), (1, 1, 1, 1, 5), (1 << 20,)]:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        i = grpcclient.InferInput("INPUT0", list(shape), "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("identity_fp32", [i]).as_numpy("OUTPUT0"), x)


def test_64_concurrent_async_requests_all_correct(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    results = queue.Queue()
    for k in range(64):
        a = np.full((1, 16), k, dtype=np.int32)
        b = np.arange(16, dtype=np.int32).reshape(1, 16)
        c.async_infer("simple", simple_inputs(a, b),
                      callback=lambda result, error, k=k: results.put((k, result, error)))
    seen = set()
    for _ in range(64):
        k, r, e = results.get(timeout=30)
        assert e is None, e
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), k + np.arange(16).reshape(1, 16))
        seen.add(k)
    assert seen == set(range(64))


def test_stream_infer(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    got = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for k in range(10):
            a = np.full((1, 16), k, dtype=np.int32)
            c.async_stream_infer("simple", simple_inputs(a, a), request_id=str(k))
        # A bad request on the stream gets an error message; the stream stays open.
        bad = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        bad.set_data_from_numpy(np.zeros((1, 16), np.int32))
        c.async_stream_infer("simple", [bad], request_id="bad")
        a = np.full((1, 16), 99, dtype=np.int32)
        c.async_stream_infer("simple", simple_inputs(a, a), request_id="after")
        ids, errors = set(), []
        for _ in range(12):
            r, e = got.get(timeout=30)
            if e is not None:
                errors.append(str(e))
                continue
            k = r.get_response().id
            ids.add(k)
            expect = 99 if k == "after" else int(k)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2 * expect))
        assert ids == {str(k) for k in range(10)} | {"after"}
        assert len(errors) == 1 and "missing input 'INPUT1'" in errors[0]
    finally:
        c.stop_stream()


def test_grpc_health_server_and_per_model(kilnd):
    ch = grpc.insecure_channel(kilnd.grpc_url)
    health = health_pb2_grpc.HealthStub(ch)
    for service in ["", "inference.GRPCInferenceService", "simple", "sleep_us"]:
        r = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="no_such_model"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_follows_model_unload_and_load(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(kilnd.grpc_url))
    c.unload_model("identity_fp32")
    assert not c.is_model_ready("identity_fp32")
    r = health.Check(health_pb2.HealthCheckRequest(service="identity_fp32"))
    assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    states = {m.name: (m.state, m.reason) for m in c.get_model_repository_index().models}
    assert states["identity_fp32"] == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferenceServerException, match="not ready"):
        x = grpcclient.InferInput("INPUT0", [2], "FP32")
        x.set_data_from_numpy(np.zeros(2, np.float32))
        c.infer("identity_fp32", [x])
    c.load_model("identity_fp32")
    assert c.is_model_ready("identity_fp32")
    r = health.Check(health_pb2.HealthCheckRequest(service="identity_fp32"))
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_load_with_inline_config_adds_a_model(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    c.load_model("simple_b4", config='{"kind": "builtin", "builtin": "simple", '
                                     '"max_batch_size": 4}')
    assert c.get_model_config("simple_b4").config.max_batch_size == 4
    with pytest.raises(InferenceServerException, match="unknown key"):
        c.load_model("broken", config='{"kind": "builtin", "max_batch": 4}')


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_a_model_on_a_gpu_backend_this_machine_lacks_fails_its_load_with_the_reason(kilnd,
                                                                                    backend):
    """The gpu backends are plugins (lib/kiln/backends beside kilnd) that decline without a
    driver or a device: a model asking for one fails its load saying why, and the server keeps
    serving the rest. Where the GPU exists the model loads."""
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa_f32")
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    config = ('{"kind": "llm", "path": "%s", "backend": "%s"}' % (os.path.abspath(model), backend))
    try:
        c.load_model(f"on_{backend}", config=config)
    except InferenceServerException as e:
        # Declined (the plugin's reason, e.g. cudaErrorInsufficientDriver / hipErrorNoDevice),
        # or not built into this tree (no toolkit): never a crash or a hang.
        assert (f"backend '{backend}' is not available: backend plugin " in str(e) and
                "has nothing to offer here: " in str(e)) or f"no backend '{backend}'" in str(e), e
        assert not c.is_model_ready(f"on_{backend}")
    else:
        assert c.is_model_ready(f"on_{backend}")
    a = np.ones((1, 16), np.int32)
    np.testing.assert_array_equal(c.infer("simple", simple_inputs(a, a)).as_numpy("OUTPUT0"), 2 * a)


def test_load_with_a_partial_config_changes_only_its_keys(kilnd):
    """tritonclient's load_model(name, config=...) with some keys: they change the model's entry
    and the rest is kept (regression: refused with "`kind`: missing")."""
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    c.load_model("simple", config='{"max_batch_size": 16}')
    cfg = c.get_model_config("simple").config
    assert cfg.max_batch_size == 16
    assert cfg.HasField("dynamic_batching")  # kept from the configuration file
    a = np.ones((16, 16), np.int32)  # a batch the old limit (8) refused
    np.testing.assert_array_equal(c.infer("simple", simple_inputs(a, a)).as_numpy("OUTPUT0"), 2 * a)
    # Over HTTP, a nested section merges key by key.
    h = httpclient.InferenceServerClient(kilnd.http_url)
    h.load_model("sleep_us", config='{"dynamic_batching": {"max_queue_delay_microseconds": 0}}')
    cfg = c.get_model_config("sleep_us").config
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert cfg.dynamic_batching.priority_levels == 2 and cfg.max_batch_size == 16
    # The merged entry is validated as a whole; the model keeps serving its last good config.
    with pytest.raises(InferenceServerException,
                       match=r"preferred_batch_size\[0\]`: expected a batch size in \[1, 2\]"):
        c.load_model("simple", config='{"max_batch_size": 2, '
                                      '"dynamic_batching": {"preferred_batch_size": [4]}}')
    assert c.get_model_config("simple").config.max_batch_size == 16


def test_models_are_served_during_startup_and_load_waits_for_the_startup_load(start_kilnd,
                                                                              tmp_path):
    """Triton's contract: a model is ready as soon as it is loaded, and a load returns once the
    model is READY or failed (regression: during start-up ModelReady said false after a
    successful load, and a load of the model start-up was loading failed with "try again").
    Start-up is held on `slow`, whose weights are a FIFO that nothing writes yet."""
    fifo = tmp_path / "slow.gguf"
    os.mkfifo(fifo)
    k = start_kilnd(f"""
models:
  - {{name: simple, kind: builtin, builtin: simple, max_batch_size: 8}}
  - {{name: slow, kind: llm, path: {fifo}}}
""", wait=False)
    k.expected_exit = 1  # `slow` fails to load, so start-up fails
    base = k.base

    def state(name):
        try:
            index = requests.post(f"{base}/v2/repository/index", timeout=2).json()
        except requests.RequestException:
            return None
        return {m["name"]: m["state"] for m in index}.get(name)

    wait_for(lambda: state("slow") == "LOADING", "start-up to be loading `slow`")
    c = grpcclient.InferenceServerClient(k.grpc_url)
    r = requests.get(f"{base}/v2/health/ready", timeout=2)
    assert (r.status_code, r.json()) == (503, {"ready": False})
    assert not c.is_server_ready()
    # `simple` was loaded first: it is ready and serves while start-up goes on.
    assert c.is_model_ready("simple")
    r = requests.get(f"{base}/v2/models/simple/ready", timeout=2)
    assert (r.status_code, r.json()) == (200, {"name": "simple", "ready": True})
    a = np.ones((1, 16), np.int32)
    np.testing.assert_array_equal(c.infer("simple", simple_inputs(a, a)).as_numpy("OUTPUT0"), 2 * a)
    # A load (here over HTTP) returns with the model ready.
    assert requests.post(f"{base}/v2/repository/models/simple/load", timeout=30).status_code == 200
    assert c.is_model_ready("simple")

    # A load of `slow` joins start-up's load of it and waits for its outcome.
    outcome = {}

    def load_slow():
        try:
            grpcclient.InferenceServerClient(k.grpc_url).load_model("slow")
            outcome["error"] = None
        except InferenceServerException as e:
            outcome["error"] = e

    loader = threading.Thread(target=load_slow)
    loader.start()
    wait_for(lambda: "model 'slow': a load request joins the load under way" in k.output(),
             "the load of `slow` to join start-up's")
    assert loader.is_alive(), "the load returned while `slow` was still loading"
    assert state("slow") == "LOADING"

    # Let start-up's load go on: an empty FIFO is no GGUF file, so it fails.
    def open_writer():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO until kilnd reads
            return True
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            return False

    wait_for(open_writer, "kilnd to open the FIFO")
    loader.join(timeout=30)
    assert not loader.is_alive()
    assert outcome["error"] is not None, "the load of `slow` succeeded"
    assert "is neither a GGUF file" in outcome["error"].message(), outcome["error"]
    assert k.proc.wait(timeout=60) == 1
    assert "start-up failed" in k.output()


def test_server_reflection_lists_services(kilnd):
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(kilnd.grpc_url))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_reflection_describes_every_service_it_lists_health_included(kilnd):
    """What grpcurl does: resolve each listed service's file through reflection, then call
    grpc.health.v1.Health/Check with messages built only from those descriptors (regression:
    the health service was listed, but reflection could not return its file)."""
    ch = grpc.insecure_channel(kilnd.grpc_url)
    db = ProtoReflectionDescriptorDatabase(ch)
    pool = descriptor_pool.DescriptorPool(db)
    services = db.get_services()
    assert {"inference.GRPCInferenceService", "kiln.v1.Generation",
            "grpc.health.v1.Health"} <= set(services)
    for name in services:
        assert pool.FindServiceByName(name).methods, name
    check = pool.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]
    assert check.containing_service.file.name == "grpc/health/v1/health.proto"
    request_type = message_factory.GetMessageClass(check.input_type)
    response_type = message_factory.GetMessageClass(check.output_type)
    call = ch.unary_unary("/grpc.health.v1.Health/Check",
                          request_serializer=request_type.SerializeToString,
                          response_deserializer=response_type.FromString)
    status_enum = check.output_type.fields_by_name["status"].enum_type
    for service in ["", "simple"]:
        r = call(request_type(service=service))
        assert status_enum.values_by_number[r.status].name == "SERVING", service
    with pytest.raises(grpc.RpcError) as e:
        call(request_type(service="no_such_model"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_statistics_count_inferences(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    a = np.zeros((2, 16), np.int32)
    for _ in range(3):
        c.infer("simple", simple_inputs(a, a))
    s = c.get_inference_statistics("simple").model_stats[0]
    assert s.name == "simple" and s.version == "1"
    assert s.inference_count == 6
    assert s.inference_stats.success.count == 3
    assert s.execution_count == 3
    assert s.last_inference > 0
