"""API keys (server.auth) on every front end, with real clients: requests, tritonclient (HTTP
and gRPC), grpcio, the openai SDK.

Health and /metrics are open by default; everything else needs `Authorization: Bearer <key>`
(gRPC: `authorization` metadata) with the route's scope. No key or a wrong one: 401 /
UNAUTHENTICATED; a key without the scope: 403 / PERMISSION_DENIED; each in its API's error
shape. Every gRPC method the server serves is walked through reflection, so a new RPC without
the check fails here. Keys never show in logs or metrics; key files are re-read on SIGHUP.
"""
import hashlib
import signal

import grpc
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
from openai import OpenAI
from tritonclient.utils import InferenceServerException

from conftest import LLM_NAME, TENSOR_MODELS, start_llm_kilnd, wait_for

INFER = "sk-test-inference-7f3a9c41"
ADMIN = "sk-test-admin-2b8e41d0"      # from a key_file
FT = "sk-test-finetune-5d0c77e2"
NEAR = INFER[:-1] + "2"               # a near miss of INFER
KEYS = (INFER, ADMIN, FT, NEAR)


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def auth_yaml(key_file, open_classes=None):
    """server.auth with three keys: ci-bot (inference), ops (admin, from `key_file`), trainer
    (fine_tuning)."""
    open_line = f"\n    open: [{', '.join(open_classes)}]" if open_classes is not None else ""
    return f"""
server:
  auth:
    api_keys:
      - {{name: ci-bot, key_sha256: {sha(INFER)}, scopes: [inference]}}
      - {{name: ops, key_file: {key_file}, scopes: [admin]}}
      - {{name: trainer, key_sha256: {sha(FT)}, scopes: [fine_tuning]}}{open_line}
"""


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "ops.key"
    path.write_text(ADMIN + "\n")
    return path


@pytest.fixture
def kilnd(start_kilnd, key_file):
    return start_kilnd(auth_yaml(key_file) + TENSOR_MODELS)


def simple_inputs():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs


# ---- HTTP -----------------------------------------------------------------------------------

def test_health_and_metrics_are_open_by_default(kilnd):
    for path in ["/v2/health/live", "/v2/health/ready", "/v2/models/simple/ready"]:
        assert requests.get(kilnd.base + path, timeout=10).status_code == 200, path
    assert "kiln_server_ready 1" in kilnd.metrics()
    assert httpclient.InferenceServerClient(kilnd.http_url).is_server_ready()
    g = grpcclient.InferenceServerClient(kilnd.grpc_url)
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("simple")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(kilnd.grpc_url))
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("headers", [
    {},
    {"X-Api-Key": INFER},                        # the wrong header
    {"Authorization": INFER},                    # no scheme
    {"Authorization": f"Basic {INFER}"},         # another scheme
    {"Authorization": f"Bearer  {INFER}"},       # two spaces
    {"Authorization": f"Bearer {NEAR}"},         # a wrong key
    {"Authorization": f"Bearer {INFER}x"},       # a longer one
    {"Authorization": "Bearer"},
], ids=["none", "x-api-key", "no-scheme", "basic", "two-spaces", "near-miss", "longer", "empty"])
def test_http_without_a_valid_key_is_401(kilnd, headers):
    r = requests.get(f"{kilnd.base}/v2/models/simple", headers=headers, timeout=10)
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"
    message = r.json()["error"]  # KServe's shape
    assert isinstance(message, str) and ("Bearer <key>" in message or "not valid" in message)
    assert INFER not in r.text and NEAR not in r.text
    # The OpenAI routes answer in OpenAI's shape, as api.openai.com does.
    r = requests.get(f"{kilnd.base}/v1/models", headers=headers, timeout=10)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key", err
    assert set(err) == {"message", "type", "param", "code"}


def test_http_with_the_key(kilnd):
    r = requests.get(f"{kilnd.base}/v2/models/simple", headers=bearer(INFER), timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "simple"
    # The scheme is case-insensitive (RFC 6750).
    r = requests.get(f"{kilnd.base}/v2", headers={"Authorization": f"bearer {INFER}"}, timeout=10)
    assert r.status_code == 200
    c = httpclient.InferenceServerClient(kilnd.http_url)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    out = c.infer("simple", inputs, headers=bearer(INFER))
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), np.full((1, 16), 2))
    with pytest.raises(InferenceServerException) as e:
        c.infer("simple", inputs)
    assert e.value.status() == "401" and "Bearer <key>" in e.value.message()


def test_http_trailing_whitespace_belongs_to_the_header_not_the_key(kilnd):
    # HTTP/1.1 drops whitespace around a field value (RFC 9110 §5.5) before the server sees it:
    # `Bearer KEY ` carries KEY. (gRPC metadata is kept byte for byte: there a trailing space
    # is another key, see test_grpc_without_a_valid_key_is_unauthenticated.)
    r = requests.get(f"{kilnd.base}/v2", headers={"Authorization": f"Bearer {INFER} "},
                     timeout=10)
    assert r.status_code == 200, r.text
    r = requests.get(f"{kilnd.base}/v2", headers={"Authorization": f"Bearer {INFER} x"},
                     timeout=10)
    assert r.status_code == 401, r.text


def test_unknown_paths_are_404_before_the_key_is_asked(kilnd):
    r = requests.get(f"{kilnd.base}/v3/whatever", timeout=10)
    assert r.status_code == 404 and r.json() == {"error": "no route for GET /v3/whatever"}
    r = requests.get(f"{kilnd.base}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route for GET /v1/nothing"
    # A known path with a wrong method is the path's class: asked for a key first.
    assert requests.put(f"{kilnd.base}/v1/files", timeout=10).status_code == 401
    r = requests.put(f"{kilnd.base}/v1/files", headers=bearer(FT), timeout=10)
    assert r.status_code == 405


@pytest.mark.parametrize("method,path,shape", [
    ("POST", "/v2/repository/models/simple/load", "kserve"),
    ("POST", "/v2/repository/models/simple/unload", "kserve"),
    ("POST", "/v1/load_lora_adapter", "openai"),
    ("POST", "/v1/unload_lora_adapter", "openai"),
    ("GET", "/debug/flight_recorder", "kserve"),
    ("GET", "/debug/trace", "kserve"),
])
def test_admin_routes_need_the_admin_scope(kilnd, method, path, shape):
    for key in (INFER, FT):
        r = requests.request(method, kilnd.base + path, headers=bearer(key), json={}, timeout=10)
        assert r.status_code == 403, (key, r.text)
        name = "ci-bot" if key == INFER else "trainer"
        message = f"key `{name}` lacks the `admin` scope this route needs"
        if shape == "openai":
            assert r.json()["error"]["message"] == message
            assert r.json()["error"]["type"] == "invalid_request_error"
        else:
            assert r.json() == {"error": message}
    r = requests.request(method, kilnd.base + path, json={}, timeout=10)
    assert r.status_code == 401


def test_load_and_unload_with_the_admin_key(kilnd):
    c = httpclient.InferenceServerClient(kilnd.http_url)
    with pytest.raises(InferenceServerException) as e:
        c.unload_model("simple", headers=bearer(INFER))
    assert e.value.status() == "403"
    c.unload_model("simple", headers=bearer(ADMIN))
    assert not c.is_model_ready("simple")  # health: open
    g = grpcclient.InferenceServerClient(kilnd.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.load_model("simple", headers={"authorization": f"Bearer {INFER}"})
    assert e.value.status() == "StatusCode.PERMISSION_DENIED"
    g.load_model("simple", headers={"authorization": f"Bearer {ADMIN}"})
    assert g.is_model_ready("simple")


def test_fine_tuning_routes_need_the_fine_tuning_scope(kilnd):
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", headers=bearer(INFER), timeout=10)
    assert r.status_code == 403 and "lacks the `fine_tuning` scope" in r.text
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", headers=bearer(FT), timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "list"
    # The openai SDK sends its api_key as `Authorization: Bearer`.
    client = OpenAI(base_url=f"{kilnd.base}/v1", api_key=FT, max_retries=0, timeout=30)
    assert client.files.list().data == []
    with pytest.raises(openai.PermissionDeniedError):
        OpenAI(base_url=f"{kilnd.base}/v1", api_key=INFER, max_retries=0).files.list()
    with pytest.raises(openai.AuthenticationError) as e:
        OpenAI(base_url=f"{kilnd.base}/v1", api_key=NEAR, max_retries=0).files.list()
    assert e.value.code == "invalid_api_key"
    # The inference key lists models; the fine-tuning key does not.
    assert OpenAI(base_url=f"{kilnd.base}/v1", api_key=INFER,
                  max_retries=0).models.list().data == []
    with pytest.raises(openai.PermissionDeniedError):
        client.models.list()


def test_open_classes_are_configurable(start_kilnd, key_file):
    # metrics closed: any valid key reads it; inference opened: no key needed for it.
    k = start_kilnd(auth_yaml(key_file, ["health", "inference"]) + TENSOR_MODELS)
    url = f"http://127.0.0.1:{k.metrics_port}/metrics"
    r = requests.get(url, timeout=10)
    assert r.status_code == 401 and r.json()["error"].startswith("this route needs an API key")
    assert requests.get(url, headers=bearer(FT), timeout=10).status_code == 200
    assert requests.get(f"{k.base}/v2/models/simple", timeout=10).status_code == 200
    g = grpcclient.InferenceServerClient(k.grpc_url)
    assert g.infer("simple", simple_inputs()).as_numpy("OUTPUT0") is not None
    r = requests.post(f"{k.base}/v2/repository/models/simple/unload", timeout=10)
    assert r.status_code == 401


# ---- gRPC -----------------------------------------------------------------------------------

@pytest.mark.parametrize("metadata", [
    (),
    (("x-api-key", INFER),),
    (("authorization", INFER),),
    (("authorization", f"Bearer {INFER} "),),   # a trailing space: another key
    (("authorization", f" Bearer {INFER}"),),
    (("authorization", f"Bearer {NEAR}"),),
], ids=["none", "x-api-key", "no-scheme", "trailing-space", "leading-space", "near-miss"])
def test_grpc_without_a_valid_key_is_unauthenticated(kilnd, metadata):
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(kilnd.grpc_url))
    with pytest.raises(grpc.RpcError) as e:
        stub.ServerMetadata(service_pb2.ServerMetadataRequest(), metadata=metadata, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert INFER not in e.value.details() and NEAR not in e.value.details()
    good = stub.ServerMetadata(service_pb2.ServerMetadataRequest(),
                               metadata=(("authorization", f"Bearer {INFER}"),), timeout=10)
    assert good.name == "kiln"


def test_tritonclient_grpc_with_and_without_the_key(kilnd):
    g = grpcclient.InferenceServerClient(kilnd.grpc_url)
    out = g.infer("simple", simple_inputs(), headers={"authorization": f"Bearer {INFER}"})
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), 2 * np.arange(16).reshape(1, 16))
    with pytest.raises(InferenceServerException) as e:
        g.infer("simple", simple_inputs())
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "Bearer <key>" in e.value.message()


# Every method of the services Kiln registers, and the class it needs (server/grpc_server.cc,
# server/llm/generation_service.cc, server/finetune/finetune_grpc.cc).
GRPC_HEALTH = {"ServerLive", "ServerReady", "ModelReady"}
GRPC_ADMIN = {"RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryRegister",
              "SystemSharedMemoryUnregister", "CudaSharedMemoryRegister",
              "CudaSharedMemoryUnregister"}


def grpc_class(service, method):
    if service == "kiln.v1.FineTuning":
        return "fine_tuning"
    if method in GRPC_HEALTH:
        return "health"
    return "admin" if method in GRPC_ADMIN else "inference"


def served_methods(channel):
    """(service, method descriptor) for every method the server lists by reflection, less
    gRPC's own services (health, reflection: open by design)."""
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = DescriptorPool(db)
    out = []
    for name in db.get_services():
        if name.startswith("grpc."):
            continue
        for m in pool.FindServiceByName(name).methods:
            out.append((name, m))
    return out


def call(channel, service, method, metadata, request=None):
    """Calls one method with an empty (or the given) request; returns the status code."""
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{service}/{method.name}"
    args = dict(request_serializer=req_cls.SerializeToString,
                response_deserializer=resp_cls.FromString)
    req = request if request is not None else req_cls()
    try:
        if method.client_streaming:
            list(channel.stream_stream(path, **args)(iter([req]), metadata=metadata, timeout=10))
        elif method.server_streaming:
            list(channel.unary_stream(path, **args)(req, metadata=metadata, timeout=10))
        else:
            channel.unary_unary(path, **args)(req, metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_grpc_method_checks_its_key(kilnd):
    channel = grpc.insecure_channel(kilnd.grpc_url)
    methods = served_methods(channel)
    services = {s for s, _ in methods}
    assert services == {"inference.GRPCInferenceService", "kiln.v1.Generation",
                        "kiln.v1.FineTuning"}, services
    assert len(methods) >= 20 + 5 + 14
    infer_md = (("authorization", f"Bearer {INFER}"),)
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    for service, m in methods:
        cls = grpc_class(service, m.name)
        what = f"{service}/{m.name} ({cls})"
        no_key = call(channel, service, m, ())
        if cls == "health":
            assert no_key != grpc.StatusCode.UNAUTHENTICATED, what
            continue
        assert no_key == grpc.StatusCode.UNAUTHENTICATED, what
        with_infer = call(channel, service, m, infer_md)
        if cls == "inference":
            assert with_infer not in (grpc.StatusCode.UNAUTHENTICATED,
                                      grpc.StatusCode.PERMISSION_DENIED), (what, with_infer)
            # A key without the scope is refused too (it is not just any key).
            assert call(channel, service, m, admin_md) == grpc.StatusCode.PERMISSION_DENIED, what
        else:
            assert with_infer == grpc.StatusCode.PERMISSION_DENIED, (what, with_infer)

    # Changing settings is admin; reading them is inference.
    by_name = {m.name: m for s, m in methods if s == "inference.GRPCInferenceService"}
    log = message_factory.GetMessageClass(by_name["LogSettings"].input_type)()
    log.settings["log_verbose_level"].uint32_param = 2
    assert call(channel, "inference.GRPCInferenceService", by_name["LogSettings"], infer_md,
                log) == grpc.StatusCode.PERMISSION_DENIED
    trace = message_factory.GetMessageClass(by_name["TraceSetting"].input_type)()
    trace.settings["trace_level"].value.append("TIMESTAMPS")
    assert call(channel, "inference.GRPCInferenceService", by_name["TraceSetting"], infer_md,
                trace) == grpc.StatusCode.PERMISSION_DENIED


# ---- keys in files, logs and metrics ---------------------------------------------------------

def test_key_file_is_reread_on_sighup(kilnd, key_file):
    rotated = "sk-test-admin-rotated-99ab"
    key_file.write_text(rotated + "\n")
    kilnd.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: requests.get(f"{kilnd.base}/debug/trace", headers=bearer(rotated),
                                  timeout=10).status_code != 401, "the rotated key to work")
    r = requests.get(f"{kilnd.base}/debug/trace", headers=bearer(ADMIN), timeout=10)
    assert r.status_code == 401
    # A broken file: the reload fails, says so, and the keys in force stay.
    key_file.write_text("")
    kilnd.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed; still using the previous secrets" in kilnd.output(),
             "the failed reload's log line")
    assert f"key_file `{key_file}` is empty" in kilnd.output()
    r = requests.post(f"{kilnd.base}/v2/repository/models/nope/unload", headers=bearer(rotated),
                      timeout=10)
    assert r.status_code != 401 and r.status_code != 403
    assert rotated not in kilnd.output()


def test_auth_on_without_keys_refuses_to_start(start_kilnd):
    k = start_kilnd("server:\n  auth:\n    enabled: true\n", wait=False)
    k.expected_exit = 1
    assert k.proc.wait(timeout=30) == 1
    assert "kiln-0.yaml:3:14: `server.auth.enabled`: auth is on but" in k.output()


def test_missing_key_file_fails_start_up(start_kilnd, tmp_path):
    missing = tmp_path / "nowhere.key"
    k = start_kilnd(auth_yaml(missing) + TENSOR_MODELS, wait=False)
    k.expected_exit = 1
    assert k.proc.wait(timeout=60) == 1
    out = k.output()
    assert f"kiln-0.yaml:6:9: server.auth.api_keys `ops`: cannot read key_file `{missing}`" in out
    assert "No such file or directory" in out


def test_per_key_counters_and_no_key_in_logs_or_metrics(start_kilnd, key_file):
    k = start_kilnd(auth_yaml(key_file) + TENSOR_MODELS, args=["--log-level", "trace"])

    def count(key, protocol, result):
        return k.metric_value("kiln_auth_requests_total", key=key, protocol=protocol,
                              result=result)

    assert count("ci-bot", "http", "ok") == 0
    g = grpcclient.InferenceServerClient(k.grpc_url)
    for key in KEYS:
        requests.get(f"{k.base}/v2/models/simple", headers=bearer(key), timeout=10)
        requests.get(f"{k.base}/v2/models/simple", headers={"X-Api-Key": key}, timeout=10)
        requests.post(f"{k.base}/v2/repository/models/nope/load", headers=bearer(key), timeout=10)
        try:
            g.infer("simple", simple_inputs(), headers={"authorization": f"Bearer {key}"})
        except InferenceServerException:
            pass
        try:
            g.unload_model("nope", headers={"authorization": f"Bearer {key}"})
        except InferenceServerException:
            pass
    assert count("ci-bot", "http", "ok") == 1
    assert count("ci-bot", "grpc", "ok") == 1
    assert count("ci-bot", "http", "permission_denied") == 1   # the load
    assert count("ci-bot", "grpc", "permission_denied") == 1   # the unload
    assert count("ops", "http", "ok") == 1                     # the load
    assert count("ops", "http", "permission_denied") == 1      # the metadata
    assert count("trainer", "grpc", "permission_denied") == 2
    # Unknown key (NEAR, 2 routes) and no key (X-Api-Key, 4 times) count under key "".
    assert count("", "http", "unauthenticated") == 2 + 4
    assert count("", "grpc", "unauthenticated") == 2
    log, metrics = k.output(), k.metrics()
    assert "auth: http GET /v2/models/simple from 127.0.0.1:" in log
    assert "refused (inference class): the API key is not valid" in log
    for secret in KEYS:
        for text, where in ((log, "log"), (metrics, "metrics")):
            assert secret not in text, f"a key is in the {where}"
            assert sha(secret) not in text, f"a key's sha256 is in the {where}"


# ---- the OpenAI API with the LLM -------------------------------------------------------------

def test_openai_sdk_chat_with_a_key(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "ops.key"
    key_file.write_text(ADMIN + "\n")
    server = "\n".join(auth_yaml(key_file).strip().splitlines()[1:])  # under `server:`
    k = start_llm_kilnd(tmp_path_factory, "auth_llm", server=server)
    try:
        base = f"{k.base}/v1"
        client = OpenAI(base_url=base, api_key=INFER, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [LLM_NAME]
        chat = client.chat.completions.create(
            model=LLM_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.choices[0].message.content is not None
        stream = client.chat.completions.create(
            model=LLM_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            stream=True)
        assert len(list(stream)) >= 1
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=base, api_key=NEAR, max_retries=0).chat.completions.create(
                model=LLM_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        with pytest.raises(openai.PermissionDeniedError):
            OpenAI(base_url=base, api_key=FT, max_retries=0).completions.create(
                model=LLM_NAME, prompt="Hi", max_tokens=2)
        # vLLM's adapter route is admin's: the inference key may not load one.
        r = requests.post(f"{base}/load_lora_adapter", headers=bearer(INFER),
                          json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=10)
        assert r.status_code == 403
        r = requests.post(f"{base}/load_lora_adapter", headers=bearer(ADMIN),
                          json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=10)
        assert r.status_code not in (401, 403), r.text
    finally:
        assert k.stop() == 0, k.output()
