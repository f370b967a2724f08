"""Triton's client examples (triton-inference-server/client src/python/examples) against kilnd
serving Triton's QA models as built-ins (config/examples/triton_qa.yaml): the examples' calls,
reimplemented with tritonclient, and the outputs they check. Plus the decoupled transaction
policy: repeat_int32 over a gRPC stream (with and without the empty final response), refused on
unary gRPC and HTTP inference, and a closed stream stopping the model; and the infer (sync and
async), health/metadata and model-control examples on `simple`."""
import queue
import time
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient import utils
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

QA_CONFIG = Path(__file__).resolve().parents[2] / "config" / "examples" / "triton_qa.yaml"


@pytest.fixture
def qa(start_kilnd):
    return start_kilnd(QA_CONFIG.read_text())


def string_inputs(client_module, a, b):
    """simple_string's inputs as the string examples build them: decimal strings, [1, 16]."""
    inputs = []
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        data = np.array([str(x).encode("utf-8") for x in values.reshape(values.size)],
                        dtype=np.object_).reshape(values.shape)
        inputs.append(client_module.InferInput(name, list(data.shape), "BYTES"))
        inputs[-1].set_data_from_numpy(data)
    return inputs


# simple_grpc_string_infer_client.py / simple_http_string_infer_client.py
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_string_infer_client(qa, protocol):
    mod = grpcclient if protocol == "grpc" else httpclient
    client = mod.InferenceServerClient(qa.grpc_url if protocol == "grpc" else qa.http_url)
    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    in1 = np.ones(shape=(1, 16), dtype=np.int32)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    results = client.infer("simple_string", string_inputs(mod, in0, in1), outputs=outputs)
    out0, out1 = results.as_numpy("OUTPUT0"), results.as_numpy("OUTPUT1")
    assert out0.shape == (1, 16) and out0.dtype == np.object_
    for i in range(16):
        assert int(out0[0][i]) == in0[0][i] + in1[0][i]
        assert int(out1[0][i]) == in0[0][i] - in1[0][i]
    assert out0[0][3] == b"4" and out1[0][0] == b"-1"


# The identity half of the string examples: an embedded NUL, then 4-byte binary blobs.
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_string_identity(qa, protocol):
    mod = grpcclient if protocol == "grpc" else httpclient
    client = mod.InferenceServerClient(qa.grpc_url if protocol == "grpc" else qa.http_url)
    null_chars = np.array(["he\x00llo".encode("utf-8") for _ in range(16)],
                          dtype=np.object_).reshape([1, 16])
    blobs = np.array([b"\x00\x01\x02\x03" for _ in range(16)], dtype=np.bytes_).reshape([1, 16])
    for data in (null_chars, blobs):
        inputs = [mod.InferInput("INPUT0", list(data.shape), "BYTES")]
        inputs[0].set_data_from_numpy(data)
        results = client.infer("simple_identity", inputs,
                               outputs=[mod.InferRequestedOutput("OUTPUT0")])
        out = results.as_numpy("OUTPUT0")
        if data.dtype == np.object_:
            assert np.array_equal(data, out)
        else:
            assert np.array_equal(data, np.char.encode(out.astype(str)))


# grpc_explicit_byte_content_client.py: bytes_contents in, raw output contents back.
def test_explicit_byte_content_client(qa):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(qa.grpc_url))
    request = service_pb2.ModelInferRequest(model_name="simple_string", model_version="")
    for name, values in (("INPUT0", [str(i) for i in range(16)]), ("INPUT1", ["1"] * 16)):
        t = service_pb2.ModelInferRequest().InferInputTensor(name=name, datatype="BYTES",
                                                              shape=[1, 16])
        t.contents.bytes_contents.extend(v.encode("utf-8") for v in values)
        request.inputs.append(t)
    for name in ("OUTPUT0", "OUTPUT1"):
        request.outputs.append(service_pb2.ModelInferRequest().InferRequestedOutputTensor(
            name=name))
    response = stub.ModelInfer(request)
    results = [np.resize(utils.deserialize_bytes_tensor(raw), list(o.shape))
               for o, raw in zip(response.outputs, response.raw_output_contents)]
    assert len(results) == 2
    for i in range(16):
        assert int(results[0][0][i]) == i + 1
        assert int(results[1][0][i]) == i - 1


# simple_grpc_infer_client.py's flow on simple_int8 (Triton's INT8 variant of `simple`).
def test_grpc_infer_client_int8(qa):
    client = grpcclient.InferenceServerClient(qa.grpc_url)
    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int8), axis=0)
    in1 = np.full(shape=(1, 16), fill_value=-1, dtype=np.int8)
    in0[0][15] = 127  # wraps, as int8 arithmetic does
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT8"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT8")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    results = client.infer("simple_int8", inputs,
                           outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                                    grpcclient.InferRequestedOutput("OUTPUT1")])
    out0, out1 = results.as_numpy("OUTPUT0"), results.as_numpy("OUTPUT1")
    assert out0.dtype == np.int8 and out0.shape == (1, 16)
    with np.errstate(over="ignore"):
        assert np.array_equal(out0, in0 + in1)
        assert np.array_equal(out1, in0 - in1)
    assert out1[0][15] == -128
    md = client.get_model_metadata("simple_int8")
    assert [i.datatype for i in md.inputs] == ["INT8", "INT8"]
    assert list(md.inputs[0].shape) == [-1, 16]


# simple_grpc_custom_args_client.py: custom channel arguments and headers, on `simple`.
def test_grpc_custom_args_client(qa):
    channel_args = [
        ("grpc.max_send_message_length", 1024 * 1024),
        ("grpc.max_receive_message_length", 1024 * 1024),
        ("grpc.keepalive_time_ms", 2**31 - 1),
        ("grpc.keepalive_timeout_ms", 20000),
        ("grpc.keepalive_permit_without_calls", False),
        ("grpc.http2.max_pings_without_data", 2),
        ("grpc.dns_enable_srv_queries", 1),
    ]
    client = grpcclient.InferenceServerClient(url=qa.grpc_url, channel_args=channel_args)
    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    in1 = np.ones(shape=(1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    results = client.infer(model_name="simple", inputs=inputs,
                           outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                                    grpcclient.InferRequestedOutput("OUTPUT1")],
                           headers={"test": "1"})
    assert np.array_equal(results.as_numpy("OUTPUT0"), in0 + in1)
    assert np.array_equal(results.as_numpy("OUTPUT1"), in0 - in1)


# The qa/ clients of custom_identity_int32 (memory growth, client timeout): INT32 identity,
# batched, over both protocols.
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_custom_identity_int32(qa, protocol):
    mod = grpcclient if protocol == "grpc" else httpclient
    client = mod.InferenceServerClient(qa.grpc_url if protocol == "grpc" else qa.http_url)
    for data in (np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0),
                 np.array([[10]], dtype=np.int32),
                 np.arange(12, dtype=np.int32).reshape(3, 4)):
        inputs = [mod.InferInput("INPUT0", list(data.shape), "INT32")]
        inputs[0].set_data_from_numpy(data)
        out = client.infer("custom_identity_int32", inputs).as_numpy("OUTPUT0")
        assert out.dtype == np.int32 and np.array_equal(out, data)
    assert client.get_model_config("custom_identity_int32") is not None


def repeat_inputs(values, delays, wait):
    inputs = [grpcclient.InferInput("IN", [len(values)], "INT32"),
              grpcclient.InferInput("DELAY", [len(delays)], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.array(values, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.array(delays, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([wait], dtype=np.uint32))
    return inputs


def collect(q, n, timeout=30):
    items = []
    for _ in range(n):
        items.append(q.get(timeout=timeout))
    return items


# simple_grpc_custom_repeat.py: one request, repeat_count responses of OUT, in order.
def test_grpc_custom_repeat(qa):
    repeat_count, data_offset = 10, 100
    values = list(range(data_offset, data_offset + repeat_count))
    q = queue.Queue()
    with grpcclient.InferenceServerClient(url=qa.grpc_url) as client:
        client.start_stream(callback=lambda result, error: q.put(error or result))
        start = time.monotonic()
        client.async_stream_infer(model_name="repeat_int32",
                                  inputs=repeat_inputs(values, [20] * repeat_count, 20),
                                  outputs=[grpcclient.InferRequestedOutput("OUT")],
                                  request_id="r1")
        results = collect(q, repeat_count)
        elapsed = time.monotonic() - start
        client.stop_stream()
    assert elapsed >= 0.2 - 0.01  # each response waited its DELAY
    for i, r in enumerate(results):
        assert not isinstance(r, InferenceServerException), r
        out = r.as_numpy("OUT")
        assert len(out) == 1 and out[0] == data_offset + i
        assert r.as_numpy("IDX") is None  # not requested
        response = r.get_response()
        assert response.id == "r1"
        assert response.parameters["triton_final_response"].bool_param is False
    assert q.empty()


# The decoupled examples with enable_empty_final_response: every response flagged, the last one
# empty and final; a request with nothing to repeat gets only that final response.
def test_decoupled_empty_final_response(qa):
    q = queue.Queue()
    with grpcclient.InferenceServerClient(url=qa.grpc_url) as client:
        client.start_stream(callback=lambda result, error: q.put(error or result))
        client.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([4, 5, 6],
                                                                                  [0, 0, 0], 0),
                                  request_id="with-final", enable_empty_final_response=True)
        results = collect(q, 4)
        client.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([], [], 0),
                                  request_id="empty", enable_empty_final_response=True)
        empty = collect(q, 1)
        client.stop_stream()
    for r in results + empty:
        assert not isinstance(r, InferenceServerException), r
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False, False, False, True]
    assert [int(r.as_numpy("OUT")[0]) for r in results[:3]] == [4, 5, 6]
    assert [int(r.as_numpy("IDX")[0]) for r in results[:3]] == [0, 1, 2]
    last = results[3].get_response()
    assert last.id == "with-final" and len(last.outputs) == 0
    only = empty[0].get_response()
    assert only.id == "empty" and len(only.outputs) == 0
    assert only.parameters["triton_final_response"].bool_param is True


def test_decoupled_policy_in_model_config(qa):
    grpc_cfg = grpcclient.InferenceServerClient(qa.grpc_url).get_model_config("repeat_int32")
    assert grpc_cfg.config.model_transaction_policy.decoupled is True
    assert grpc_cfg.config.max_batch_size == 0
    http_cfg = httpclient.InferenceServerClient(qa.http_url).get_model_config("repeat_int32")
    assert http_cfg["model_transaction_policy"]["decoupled"] is True
    plain = grpcclient.InferenceServerClient(qa.grpc_url).get_model_config("simple_string")
    assert plain.config.model_transaction_policy.decoupled is False


def test_decoupled_model_refused_on_unary_infer(qa):
    client = grpcclient.InferenceServerClient(qa.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer("repeat_int32", repeat_inputs([1], [0], 0))
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(e.value)
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    r = requests.post(f"{qa.base}/v2/models/repeat_int32/infer", timeout=10, json={
        "inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]},
                   {"name": "DELAY", "shape": [1], "datatype": "UINT32", "data": [0]},
                   {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]}]})
    assert r.status_code == 400
    assert "HTTP end point doesn't support models with decoupled" in r.json()["error"]
    # The server still serves the model over a stream afterwards.
    q = queue.Queue()
    with grpcclient.InferenceServerClient(url=qa.grpc_url) as c:
        c.start_stream(callback=lambda result, error: q.put(error or result))
        c.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([9], [0], 0))
        assert int(collect(q, 1)[0].as_numpy("OUT")[0]) == 9
        c.stop_stream()


def test_closed_stream_stops_the_model_and_the_server_keeps_serving(qa):
    q = queue.Queue()
    client = grpcclient.InferenceServerClient(url=qa.grpc_url)
    client.start_stream(callback=lambda result, error: q.put(error or result))
    # 100 responses 100 ms apart: 10 s if nothing stops it.
    client.async_stream_infer(model_name="repeat_int32",
                              inputs=repeat_inputs(list(range(100)), [100] * 100, 0))
    first = collect(q, 1)[0]
    assert int(first.as_numpy("OUT")[0]) == 0
    client.stop_stream(cancel_requests=True)
    client.close()
    # The single instance is free again well before the 10 s the request would have taken.
    start = time.monotonic()
    q2 = queue.Queue()
    with grpcclient.InferenceServerClient(url=qa.grpc_url) as c:
        c.start_stream(callback=lambda result, error: q2.put(error or result))
        c.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([42], [0], 0))
        r = collect(q2, 1)[0]
        c.stop_stream()
    assert not isinstance(r, InferenceServerException), r
    assert int(r.as_numpy("OUT")[0]) == 42
    assert time.monotonic() - start < 5


def test_bad_input_is_a_clear_400_naming_the_input(qa):
    base = f"{qa.base}/v2/models"
    cases = [
        ("simple_string", [{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES",
                            "data": ["1"] * 15 + ["x7"]},
                           {"name": "INPUT1", "shape": [1, 16], "datatype": "BYTES",
                            "data": ["1"] * 16}], "input 'INPUT0' element 15 is `x7`"),
        ("simple_string", [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                            "data": [1] * 16},
                           {"name": "INPUT1", "shape": [1, 16], "datatype": "BYTES",
                            "data": ["1"] * 16}], "input 'INPUT0' has datatype INT32"),
        ("simple_int8", [{"name": "INPUT0", "shape": [1, 8], "datatype": "INT8", "data": [1] * 8},
                         {"name": "INPUT1", "shape": [1, 8], "datatype": "INT8", "data": [1] * 8}],
         "input 'INPUT0' has shape [1, 8]"),
    ]
    for model, inputs, message in cases:
        r = requests.post(f"{base}/{model}/infer", json={"inputs": inputs}, timeout=10)
        assert r.status_code == 400, (model, r.text)
        assert message in r.json()["error"], r.json()
    # Over a stream, a bad repeat_int32 request is an error response naming the input; the
    # stream goes on.
    q = queue.Queue()
    with grpcclient.InferenceServerClient(url=qa.grpc_url) as c:
        c.start_stream(callback=lambda result, error: q.put(error or result))
        c.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([1], [20000], 0))
        c.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([1, 2], [0], 0))
        c.async_stream_infer(model_name="repeat_int32", inputs=repeat_inputs([3], [0], 0))
        got = collect(q, 3)
        c.stop_stream()
    assert isinstance(got[0], InferenceServerException)
    assert "input 'DELAY' element 0 is 20000 ms" in str(got[0])
    assert "input 'DELAY' has 1 elements but input 'IN' has 2" in str(got[1])
    assert int(got[2].as_numpy("OUT")[0]) == 3


def simple_inputs(mod):
    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    in1 = np.ones(shape=(1, 16), dtype=np.int32)
    inputs = [mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1, **({"binary_data": False} if mod is httpclient else {}))
    # (the HTTP examples send INPUT1 as JSON and INPUT0 binary)
    return inputs, in0, in1


def put_result(q, result, error):
    q.put((result, error))


# simple_{grpc,http}_infer_client.py and simple_{grpc,http}_async_infer_client.py: `simple`
# synchronously, then asynchronously (gRPC: a callback; HTTP: an InferAsyncRequest).
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_and_async_infer_clients(qa, protocol):
    mod = grpcclient if protocol == "grpc" else httpclient
    client = (grpcclient.InferenceServerClient(qa.grpc_url) if protocol == "grpc"
              else httpclient.InferenceServerClient(qa.http_url, concurrency=4))
    inputs, in0, in1 = simple_inputs(mod)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    r = client.infer("simple", inputs, outputs=outputs, request_id="1")
    assert np.array_equal(r.as_numpy("OUTPUT0"), in0 + in1)
    assert np.array_equal(r.as_numpy("OUTPUT1"), in0 - in1)
    if protocol == "grpc":
        done = queue.Queue()
        for i in range(4):
            client.async_infer("simple", inputs, partial(put_result, done), request_id=str(i),
                               outputs=outputs)
        results = [done.get(timeout=30) for _ in range(4)]
        assert all(err is None for _, err in results), results
        assert sorted(res.get_response().id for res, _ in results) == ["0", "1", "2", "3"]
        got = [res for res, _ in results]
    else:
        got = [a.get_result() for a in
               [client.async_infer("simple", inputs, request_id=str(i), outputs=outputs)
                for i in range(4)]]
    for res in got:
        assert np.array_equal(res.as_numpy("OUTPUT0"), in0 + in1)
        assert np.array_equal(res.as_numpy("OUTPUT1"), in0 - in1)


# simple_{grpc,http}_health_metadata.py: liveness, readiness, server and model metadata, model
# config. One difference: the examples check that the server calls itself "triton"; kilnd
# answers "kiln" (docs/api.md).
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_health_metadata_client(qa, protocol):
    client = (grpcclient.InferenceServerClient(qa.grpc_url) if protocol == "grpc"
              else httpclient.InferenceServerClient(qa.http_url))
    assert client.is_server_live(headers={"test": "1", "dummy": "2"}) and client.is_server_ready()
    assert client.is_model_ready("simple")
    server = client.get_server_metadata()
    model = client.get_model_metadata("simple")
    if protocol == "grpc":
        assert server.name == "kiln" and "system_shared_memory" in server.extensions
        assert model.name == "simple" and [i.name for i in model.inputs] == ["INPUT0", "INPUT1"]
        assert model.inputs[0].datatype == "INT32" and list(model.inputs[0].shape) == [-1, 16]
    else:
        assert server["name"] == "kiln" and "system_shared_memory" in server["extensions"]
        assert model["name"] == "simple" and [i["name"] for i in model["inputs"]] == [
            "INPUT0", "INPUT1"]
        assert model["inputs"][0]["datatype"] == "INT32"
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in e.value.message()
    config = client.get_model_config("simple")
    assert (config.config.name if protocol == "grpc" else config["name"]) == "simple"


# simple_{grpc,http}_model_control.py: unload, not ready, load, ready again, and an unknown
# model's load fails naming it.
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_model_control_client(qa, protocol):
    client = (grpcclient.InferenceServerClient(qa.grpc_url) if protocol == "grpc"
              else httpclient.InferenceServerClient(qa.http_url))
    assert client.is_model_ready("simple")
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    client.load_model("simple")
    assert client.is_model_ready("simple")
    inputs, in0, in1 = simple_inputs(grpcclient if protocol == "grpc" else httpclient)
    assert np.array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), in0 + in1)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("wrong_model_name")
    assert "wrong_model_name" in str(e.value)


# simple_grpc_aio_infer_client.py and simple_grpc_aio_sequence_stream_infer_client.py's
# client: tritonclient.grpc.aio, health, metadata and inference on `simple`.
def test_grpc_aio_infer_client(qa):
    import asyncio

    import tritonclient.grpc.aio as aioclient

    async def run():
        client = aioclient.InferenceServerClient(qa.grpc_url)
        assert await client.is_server_live() and await client.is_model_ready("simple")
        assert (await client.get_model_metadata("simple")).name == "simple"
        inputs, in0, in1 = simple_inputs(aioclient)
        results = await asyncio.gather(*[client.infer("simple", inputs, request_id=str(i))
                                         for i in range(8)])
        for r in results:
            assert np.array_equal(r.as_numpy("OUTPUT0"), in0 + in1)
            assert np.array_equal(r.as_numpy("OUTPUT1"), in0 - in1)
        await client.close()

    asyncio.run(run())
