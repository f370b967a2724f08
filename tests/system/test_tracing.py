"""Per-request traces against a real kilnd: W3C traceparent in and out (HTTP headers, gRPC
metadata), GET /debug/trace capturing a Chrome trace of steps and requests, and OTLP/HTTP
JSON export to a tiny collector written here. The LLM cases serve the default model."""
import json
import os
import re
import secrets
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import requests

from conftest import LLM_NAME as MODEL
from conftest import TENSOR_MODELS, Kilnd, default_model_path, start_llm_kilnd, wait_for
from test_generation_grpc import _stubs_dir

LLM_SPANS = {"admission", "queue", "prefill", "decode", "detokenize", "response"}
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_parent():
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


class Collector:
    """An OTLP/HTTP JSON receiver on a free port: keeps every POSTed body."""

    def __init__(self):
        self.bodies, self.content_types, self.lock = [], [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    outer.content_types.append(self.headers["Content-Type"])
                    outer.bodies.append((self.path, json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self, trace_id):
        with self.lock:
            bodies = list(self.bodies)
        return [s for _, b in bodies for rs in b["resourceSpans"] for ss in rs["scopeSpans"]
                for s in ss["spans"] if s["traceId"] == trace_id]


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.shutdown()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, collector):
    k = start_llm_kilnd(tmp_path_factory, "tracing", overrides=[
        f"observability.otlp.endpoint=http://127.0.0.1:{collector.port}/v1/traces",
        "observability.otlp.service_name=kilnd-under-test"])
    yield k
    assert k.stop() == 0, k.output()


def chat(k, headers=None, stream=False, max_tokens=4):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": True}
    r = requests.post(f"{k.base}/v1/chat/completions", json=body, headers=headers or {},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_chat_returns_the_callers_trace_with_a_new_span(llm):
    trace_id, span_id, parent = new_parent()
    for stream in (False, True):
        r = chat(llm, {"traceparent": parent, "tracestate": "vendor=x"}, stream=stream)
        m = TRACEPARENT.match(r.headers["traceparent"])
        assert m, r.headers["traceparent"]
        assert m.group(1) == trace_id and m.group(2) != span_id and m.group(3) == "01"
        assert r.headers["tracestate"] == "vendor=x"


@pytest.mark.parametrize("bad", [
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # zero trace id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # uppercase
    "not a traceparent",
])
def test_an_invalid_traceparent_starts_a_new_trace(llm, bad):
    r = chat(llm, {"traceparent": bad, "tracestate": "vendor=x"})
    m = TRACEPARENT.match(r.headers["traceparent"])
    assert m and m.group(1) != "0" * 32 and m.group(1) not in bad.lower()
    assert "tracestate" not in r.headers  # it belonged to the dropped parent


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    sys.path.insert(0, str(_stubs_dir(tmp_path_factory.mktemp("stubs"))))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    return generation_pb2, generation_pb2_grpc


def test_grpc_traceparent_in_initial_metadata(llm, pb):
    stub = pb[1].GenerationStub(grpc.insecure_channel(llm.grpc_url))
    req = pb[0].GenerateRequest(model=MODEL, prompt="The capital of France is",
                                sampling=pb[0].SamplingParams(max_tokens=3, temperature=0))
    trace_id, span_id, parent = new_parent()
    _, call = stub.Generate.with_call(req, metadata=[("traceparent", parent)], timeout=120)
    md = dict(call.initial_metadata())
    m = TRACEPARENT.match(md["traceparent"])
    assert m and m.group(1) == trace_id and m.group(2) != span_id
    stream = stub.GenerateStream(req, metadata=[("traceparent", parent)], timeout=120)
    assert list(stream)[-1].finish_reason
    m = TRACEPARENT.match(dict(stream.initial_metadata())["traceparent"])
    assert m and m.group(1) == trace_id and m.group(2) != span_id
    # Without a traceparent: a new trace, still returned.
    _, call = stub.Generate.with_call(req, timeout=120)
    assert TRACEPARENT.match(dict(call.initial_metadata())["traceparent"])


def check_chain(spans, client_span, root_name):
    """`spans`: (name, span id, parent id) of one trace. The root is the server span under the
    client's span; every other span is its child."""
    roots = [s for s in spans if s[0] == root_name]
    assert len(roots) == 1, spans
    root = roots[0]
    assert root[2] == client_span
    for name, sid, parent in spans:
        if sid != root[1]:
            assert parent == root[1], (name, spans)
    return root


def test_debug_trace_captures_steps_and_request_spans(llm):
    box = {}

    def capture():
        box["r"] = requests.get(f"{llm.base}/debug/trace?seconds=2", timeout=30)

    t = threading.Thread(target=capture)
    t.start()
    sent = []  # (trace id, client span id), sent while the capture runs
    with ThreadPoolExecutor(2) as pool:
        while t.is_alive():
            parents = [new_parent() for _ in range(2)]
            list(pool.map(lambda p: chat(llm, {"traceparent": p[2]}, max_tokens=6), parents))
            sent += [(p[0], p[1]) for p in parents]
    t.join()
    r = box["r"]
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    steps = [e for e in complete if e["cat"] == "step"]
    assert steps, "no step events"
    lanes = {e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == steps[0]["pid"]}
    assert f"model {MODEL}" in lanes
    assert all(e["args"]["tokens"] >= 1 and e["args"]["sequences"] >= 1 for e in steps)
    # Some request ran wholly inside the window: its spans are all there and chain to its root.
    by_trace = {}
    for e in complete:
        if e["cat"] == "request":
            a = e["args"]
            by_trace.setdefault(a["trace_id"], []).append((e["name"], a["span_id"],
                                                           a["parent_id"]))
    whole = [(tid, sid) for tid, sid in sent
             if LLM_SPANS | {"POST /v1/chat/completions"} <= {s[0] for s in by_trace.get(tid, [])}]
    assert whole, f"no request complete in the capture: {sorted(by_trace)} vs {sent}"
    tid, client_span = whole[0]
    check_chain(by_trace[tid], client_span, "POST /v1/chat/completions")


def test_debug_trace_arguments_and_one_capture_at_a_time(llm):
    for bad in ("0", "61", "abc", ""):
        r = requests.get(f"{llm.base}/debug/trace?seconds={bad}", timeout=10)
        assert r.status_code == 400 and "seconds" in r.json()["error"], (bad, r.text)
    with ThreadPoolExecutor(2) as pool:
        codes = sorted(pool.map(
            lambda _: requests.get(f"{llm.base}/debug/trace?seconds=1", timeout=30).status_code,
            range(2)))
    assert codes == [200, 409]


def test_otlp_export_reaches_the_collector(llm, collector):
    trace_id, span_id, parent = new_parent()
    chat(llm, {"traceparent": parent})
    root = "POST /v1/chat/completions"

    def arrived():
        return LLM_SPANS | {root} <= {s["name"] for s in collector.spans(trace_id)}

    wait_for(arrived, "the request's spans at the collector", timeout=30)
    spans = collector.spans(trace_id)
    check_chain([(s["name"], s["spanId"], s.get("parentSpanId", "")) for s in spans], span_id,
                root)
    with collector.lock:
        path, body = collector.bodies[-1]
        content_type = collector.content_types[-1]
    assert path == "/v1/traces" and content_type == "application/json"
    rs = body["resourceSpans"][0]
    assert {"key": "service.name", "value": {"stringValue": "kilnd-under-test"}} in \
        rs["resource"]["attributes"]
    assert rs["scopeSpans"][0]["scope"]["name"] == "kiln"
    for s in spans:  # OTLP JSON: hex ids, nanoseconds as decimal strings, enum numbers
        assert re.fullmatch(r"[0-9a-f]{32}", s["traceId"])
        assert re.fullmatch(r"[0-9a-f]{16}", s["spanId"])
        assert isinstance(s["startTimeUnixNano"], str) and isinstance(s["endTimeUnixNano"], str)
        assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) > 1.6e18
        assert s["kind"] == (2 if s["name"] == root else 1)
        assert s["status"]["code"] in (1, 2)
        for a in s["attributes"]:
            assert set(a["value"]) <= {"stringValue", "intValue"}
    top = next(s for s in spans if s["name"] == root)
    attrs = {a["key"]: a["value"] for a in top["attributes"]}
    assert attrs["kiln.model"] == {"stringValue": MODEL}
    assert int(attrs["kiln.completion_tokens"]["intValue"]) >= 1
    prefill = [s for s in spans if s["name"] == "prefill"]
    assert sum(int(a["value"]["intValue"]) for s in prefill for a in s["attributes"]
               if a["key"] == "kiln.tokens") >= 1
    assert llm.metric_value("kiln_trace_spans_exported_total") >= len(spans)


def test_tensor_model_spans_and_tracing_off(start_kilnd):
    body = {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
    trace_id, span_id, parent = new_parent()
    k = start_kilnd(TENSOR_MODELS)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "r", requests.get(f"{k.base}/debug/trace?seconds=1", timeout=30)))
    t.start()
    while t.is_alive():
        r = requests.post(f"{k.base}/v2/models/simple/infer", json=body,
                          headers={"traceparent": parent}, timeout=30)
        assert r.status_code == 200, r.text
        assert TRACEPARENT.match(r.headers["traceparent"]).group(1) == trace_id
    t.join()
    spans = [(e["name"], e["args"]["span_id"], e["args"]["parent_id"])
             for e in box["r"].json()["traceEvents"]
             if e["ph"] == "X" and e.get("args", {}).get("trace_id") == trace_id]
    assert {"admission", "queue", "execute", "response",
            "POST /v2/models/{model}/infer"} <= {s[0] for s in spans}
    roots = {s[1] for s in spans if s[0] == "POST /v2/models/{model}/infer"}
    assert all(s[2] == span_id for s in spans if s[1] in roots)
    # Every child hangs off a captured root, except possibly the children of the one request
    # in flight when the capture window closed: they ended inside it, their root after it.
    orphans = {s[2] for s in spans if s[1] not in roots and s[2] not in roots}
    assert len(orphans) <= 1, orphans
    assert sum(1 for s in spans if s[2] in roots) >= 4

    off = start_kilnd(TENSOR_MODELS, overrides=["observability.tracing.enabled=false"])
    r = requests.post(f"{off.base}/v2/models/simple/infer", json=body,
                      headers={"traceparent": parent}, timeout=30)
    assert r.status_code == 200 and "traceparent" not in r.headers
    r = requests.get(f"{off.base}/debug/trace?seconds=1", timeout=10)
    assert r.status_code == 409 and "tracing is off" in r.json()["error"]
