"""A corpus of malformed requests against every JSON route of a real kilnd (SmolLM2 as an LLM
and the built-in `simple` tensor model): not JSON, truncated, the wrong top-level type, deep
nesting, fields of the wrong type, numbers beyond a double, bad UTF-8, NUL bytes, an empty
body, oversized headers. Each must be a 4xx in the route's own error shape — OpenAI's
{"error": {"message", "type", "param", "code"}} under /v1, KServe's {"error": "..."} under
/v2 — never a 5xx or a dropped connection, and the daemon must serve on afterwards."""
import json
import socket

import pytest
import requests

from conftest import LLM_NAME as MODEL
from conftest import Kilnd, default_model_path, ready

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/fine_tuning/jobs",
          "/v1/load_lora_adapter", f"/v2/models/{MODEL}/generate",
          f"/v2/models/{MODEL}/generate_stream", f"/v2/models/{MODEL}/infer",
          "/v2/models/simple/infer", "/v2/repository/index", "/v2/repository/models/simple/load"]

DEEP = 100_000  # far beyond any parser's recursion budget


def corpus():
    """(id, body bytes) pairs; each is malformed for every route above."""
    yield "not_json", b"hello, world"
    yield "truncated", b'{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"'
    yield "top_level_array", b'[{"model": "smollm2"}]'
    yield "top_level_string", b'"smollm2"'
    yield "top_level_number", b"42"
    yield "null", b"null"
    yield "deep_arrays", b"[" * DEEP + b"]" * DEEP
    yield "deep_objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP
    yield "deep_inside_a_field", (b'{"model": "smollm2", "prompt": "Hi", "messages": '
                                  + b"[" * DEEP + b"]" * DEEP + b"}")
    yield "wrong_types", (b'{"model": 7, "messages": "Hi", "prompt": 5, "inputs": "x", '
                          b'"text_input": 3, "max_tokens": "ten", "outputs": 1, "ready": "yes", '
                          b'"parameters": [], "training_file": 1, "lora_name": 2}')
    yield "huge_number", b'{"model": "smollm2", "prompt": "Hi", "temperature": 1e400}'
    yield "huge_integer", (b'{"model": "smollm2", "prompt": "Hi", "max_tokens": '
                           + b"9" * 400 + b"}")
    yield "bad_utf8", b'{"model": "smollm2", "prompt": "caf\xe9", "text_input": "\xff\xfe"}'
    yield "lone_surrogate", b'{"model": "smollm2", "prompt": "\\ud800", "text_input": "\\udfff"}'
    yield "nul_in_key", b'{"mo\x00del": "smollm2"}'
    yield "duplicate_and_trailing", b'{"model": "a", "model": "b"} trailing'


CASES = [(r, name, body) for r in ROUTES for name, body in corpus()]
# An empty body is a request of its own where every field is optional (Triton's index and
# load); everywhere else it lacks what the route needs.
CASES += [(r, "empty", b"") for r in ROUTES if not r.startswith("/v2/repository/")]


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    config = folder / "kiln.yaml"
    config.write_text(f"""
server:
  storage_dir: {folder / "storage"}
  http: {{max_body_bytes: 4194304}}
models:
  - name: {MODEL}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
  - name: simple
    kind: builtin
    builtin: simple
    max_batch_size: 8
fine_tuning: {{enabled: true}}
""")
    k = ready(Kilnd(config))
    yield k
    assert k.stop() == 0, k.output()


def check_shape(route, r):
    assert 400 <= r.status_code < 500, (route, r.status_code, r.text[:300])
    body = r.json()  # always JSON
    if route.startswith("/v1/"):
        err = body["error"]
        assert isinstance(err, dict), body
        assert isinstance(err["message"], str) and err["message"], body
        assert isinstance(err["type"], str) and err["type"], body
        assert "param" in err and "code" in err, body
    else:
        assert isinstance(body["error"], str) and body["error"], body


@pytest.mark.parametrize("route,name,body", CASES,
                         ids=[f"{r.strip('/').replace('/', '_')}-{n}" for r, n, _ in CASES])
def test_malformed_body_is_a_4xx_in_the_routes_shape(kilnd, route, name, body):
    r = requests.post(f"{kilnd.base}{route}", data=body,
                      headers={"Content-Type": "application/json"}, timeout=60)
    check_shape(route, r)


def test_oversized_headers_are_refused_and_the_server_serves_on(kilnd):
    host, port = kilnd.base.removeprefix("http://").split(":")
    for size in (64 * 1024, 1024 * 1024):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            req = (f"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * size}\r\n\r\n")
            try:
                s.sendall(req.encode())
                reply = s.recv(4096).decode(errors="replace")
            except (ConnectionResetError, BrokenPipeError):
                reply = ""  # closed while we were still sending: refused too
        if reply:
            status = int(reply.split(" ", 2)[1])
            assert status in (400, 413, 431), reply[:200]
    # Many headers rather than one big one.
    headers = {f"X-H{i}": "v" * 100 for i in range(2000)}
    try:
        r = requests.get(f"{kilnd.base}/v2/health/ready", headers=headers, timeout=30)
        assert r.status_code in (400, 413, 431), r.status_code
    except requests.ConnectionError:
        pass  # closed before answering: refused without a crash; checked below
    r = requests.get(f"{kilnd.base}/v2/health/ready", timeout=30)
    assert r.status_code == 200


def test_the_daemon_serves_on_after_the_corpus(kilnd):
    r = requests.post(f"{kilnd.base}/v1/completions",
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = requests.post(f"{kilnd.base}/v2/models/simple/infer", timeout=30, data=json.dumps({
        "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                   {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [2] * 16}]}))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3] * 16


def test_deep_json_in_a_grpc_parameter_does_not_crash(kilnd):
    """A KServe LLM request's string parameters may hold JSON (a `stop` list): 100,000 levels
    of nesting there is taken as a plain string, never walked recursively."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(kilnd.grpc_url))
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text = b"Hi"
    req.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    req.parameters["stop"].string_param = "[" * DEEP + "]" * DEEP
    req.parameters["max_tokens"].int64_param = 2
    try:
        stub.ModelInfer(req, timeout=60)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    r = requests.get(f"{kilnd.base}/v2/health/ready", timeout=30)
    assert r.status_code == 200
