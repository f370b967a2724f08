"""Bad input and faults on the LLM path, each a test, against a real kilnd serving
SmolLM2-135M-Instruct: every item of the bad-input list is refused with 400 /
INVALID_ARGUMENT naming the field; 1,000 concurrent streams against a small queue (the excess
refused at once with 429 / RESOURCE_EXHAUSTED, the rest complete correctly); a client that
disconnects mid-stream gives its KV blocks back (kiln_llm_kv_cache_usage_ratio); SIGTERM with
streams in flight lets them finish within the grace period and exits 0."""
import asyncio
import http.client
import json
import re
import signal
import socket
import threading
import time

import aiohttp
import grpc
import pytest
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import LLM_NAME as MODEL
from conftest import start_llm_kilnd, wait_for

USAGE = "kiln_llm_kv_cache_usage_ratio"


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "faults", server="""  http: {max_body_bytes: 1048576}
  grpc: {max_message_bytes: 1048576}""")
    yield k
    assert k.stop() == 0, k.output()


def post(k, path, body, **kwargs):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{k.base}{path}", data=data,
                         headers={"Content-Type": "application/json"}, timeout=120, **kwargs)


USER = [{"role": "user", "content": "Hi"}]

# ---- bad input: each a test ------------------------------------------------------------------

BAD = [
    # (id, path, body, param, message)
    ("max_tokens_zero", "/v1/chat/completions",
     {"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens",
     "`max_tokens` is 0; it must be at least 1"),
    ("max_tokens_negative", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -5},
     "max_tokens", "`max_tokens` is -5"),
    ("max_tokens_huge", "/v1/completions",
     {"model": MODEL, "prompt": "a", "max_tokens": 10**9}, "max_tokens",
     "leaves room for at most 2047 in the context of model 'smollm2' (2048 tokens)"),
    ("max_tokens_beyond_int64", "/v1/completions",
     {"model": MODEL, "prompt": "a", "max_tokens": 2**70}, "max_tokens", "too large"),
    ("max_completion_tokens_zero", "/v1/chat/completions",
     {"model": MODEL, "messages": USER, "max_completion_tokens": 0}, "max_completion_tokens",
     "at least 1"),
    ("temperature_negative", "/v1/chat/completions",
     {"model": MODEL, "messages": USER, "temperature": -0.1}, "temperature",
     "`temperature` is -0.1"),
    ("temperature_nan_string", "/v1/chat/completions",
     {"model": MODEL, "messages": USER, "temperature": "NaN"}, "temperature",
     "must be a number"),
    ("top_p_zero", "/v1/chat/completions", {"model": MODEL, "messages": USER, "top_p": 0},
     "top_p", "(0, 1]"),
    ("top_p_negative", "/v1/completions", {"model": MODEL, "prompt": "a", "top_p": -0.5},
     "top_p", "(0, 1]"),
    ("top_p_above_one", "/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 1.01},
     "top_p", "(0, 1]"),
    ("empty_messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, "messages",
     "`messages` is empty"),
    ("unknown_role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "narrator", "content": "x"}]}, "messages[0].role",
     "allowed roles: system, user, assistant, tool, developer"),
    ("content_of_wrong_type", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": 42}]}, "messages[0].content",
     "must be a string or a list of text parts"),
    ("n_zero", "/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 0}, "n",
     "it must be in [1, 128]"),
    ("n_above_128", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 129}, "n",
     "it must be in [1, 128]"),
]


@pytest.mark.parametrize("path,body,param,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_400_naming_the_field(kilnd, path, body, param, message):
    r = post(kilnd, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert message in err["message"], err["message"]
    assert "''" not in err["message"], "issue 14: doubled quotes such as model 'smollm2''s"


def test_prompt_longer_than_the_context_names_both_numbers(kilnd):
    r = post(kilnd, "/v1/completions", {"model": MODEL, "prompt": "word " * 2500})
    assert r.status_code == 400
    err = r.json()["error"]
    m = re.search(r"the prompt is (\d+) tokens but model 'smollm2' has a context of 2048 tokens",
                  err["message"])
    assert m and int(m.group(1)) > 2048, err
    assert err["param"] == "prompt"


def test_temperature_nan_in_json_is_refused(kilnd):
    r = post(kilnd, "/v1/chat/completions",
             '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], '
             '"temperature": NaN}')
    assert r.status_code == 400
    assert "the request body is not valid JSON" in r.json()["error"]["message"]


# Issue 14: a number beyond a double's range answered a bare 500 on every JSON route.
JSON_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter",
               "/v1/fine_tuning/jobs", f"/v2/models/{MODEL}/generate",
               f"/v2/models/{MODEL}/generate_stream", f"/v2/models/{MODEL}/infer",
               "/v2/repository/index"]


@pytest.mark.parametrize("number", ["1e400", "2e308"])
@pytest.mark.parametrize("path", JSON_ROUTES)
def test_number_beyond_double_range_is_400_naming_the_field(kilnd, path, number):
    r = post(kilnd, path, '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], '
                          f'"prompt": "Hi", "temperature": {number}}}')
    assert r.status_code == 400, r.text
    want = f"`temperature`: number out of range: {number}"
    if path.startswith("/v1/"):
        err = r.json()["error"]
        assert err["message"].startswith(want), err
        assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    else:
        assert r.json()["error"].startswith(want), r.text
    # The daemon serves on.
    r = post(kilnd, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_invalid_utf8_in_the_body_is_refused(kilnd):
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "caf\xe9"}]}'
    r = post(kilnd, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert "UTF-8" in r.json()["error"]["message"]
    escaped = '{"model": "smollm2", "prompt": "\\ud800 lone surrogate"}'
    assert post(kilnd, "/v1/completions", escaped).status_code == 400


def test_invalid_utf8_in_a_kserve_text_input_is_refused(kilnd):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(kilnd.grpc_url))
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text = b"bad \xc3\x28 bytes"
    req.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text_input" in e.value.details() and "UTF-8" in e.value.details()


def test_body_and_message_size_limits_come_from_the_config(kilnd):
    big = {"model": MODEL, "prompt": "x" * (2 << 20)}
    assert post(kilnd, "/v1/completions", big).status_code == 413
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(kilnd.grpc_url))
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.raw_input_contents.append((2 << 20).to_bytes(4, "little") + b"x" * (2 << 20))
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- client disconnect -------------------------------------------------------------------------

def test_client_disconnect_mid_stream_returns_the_kv_blocks(kilnd):
    before = kilnd.metric_value("kiln_llm_requests_total", model=MODEL, finish_reason="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", kilnd.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 1000, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = b""
    while seen.count(b"data:") < 4:  # the role chunk and three tokens
        seen += resp.read1(4096)
    assert kilnd.metric_value(USAGE, model=MODEL) > 0, "the stream holds KV blocks"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_for(lambda: kilnd.metric_value(USAGE, model=MODEL) == 0), \
        "the KV blocks did not return to the pool"
    assert kilnd.metric_value("kiln_llm_requests_total", model=MODEL,
                              finish_reason="cancelled") == before + 1
    assert wait_for(lambda: kilnd.metric_value("kiln_inflight_requests") == 0)


# ---- 1,000 concurrent streams against a small queue --------------------------------------------

@pytest.fixture(scope="module")
def small_queue(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "flood", scheduler="max_num_seqs: 4, max_queue_size: 8")
    yield k
    assert k.stop() == 0, k.output()


FLOOD_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
              "temperature": 0, "ignore_eos": True, "stream": True}


async def one_stream(session, url):
    start = time.perf_counter()
    async with session.post(url, json=FLOOD_BODY) as r:
        if r.status != 200:
            return r.status, time.perf_counter() - start, await r.json()
        events = [line[6:] for line in (await r.text()).split("\n\n") if line.startswith("data: ")]
        return 200, time.perf_counter() - start, events


async def flood(url, n):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one_stream(session, url) for _ in range(n)))


def test_1000_concurrent_streams_against_a_small_queue(small_queue):
    k = small_queue
    reference = post(k, "/v1/completions", {**FLOOD_BODY, "stream": False}).json()
    want = reference["choices"][0]["text"]
    results = asyncio.run(flood(f"{k.base}/v1/completions", 1000))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 1000, {r[0] for r in results}
    assert len(ok) >= 8, "the queue and the running batch were used"
    assert len(refused) >= 900, "most of the excess was refused"
    for _, _, body in refused:
        assert body["error"]["type"] == "rate_limit_error"
        assert "queue" in body["error"]["message"]
    # Refused quickly: well before the admitted requests finished.
    slowest_refusal = max(seconds for _, seconds, _ in refused)
    assert slowest_refusal < 10, slowest_refusal
    for _, _, events in ok:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_for(lambda: k.metric_value(USAGE, model=MODEL) == 0)
    assert wait_for(lambda: k.metric_value("kiln_inflight_requests") == 0)


def test_grpc_streams_past_the_queue_are_resource_exhausted(small_queue):
    k = small_queue
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(k.grpc_url))

    def request():
        req = service_pb2.ModelInferRequest(model_name=MODEL)
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        text = b"The capital of France is"
        req.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
        req.parameters["max_tokens"].int64_param = 2
        return req

    futures = [stub.ModelInfer.future(request(), timeout=300) for _ in range(200)]
    codes = {}
    for f in futures:
        try:
            f.result()
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    assert codes.get("OK", 0) >= 8 and codes.get("RESOURCE_EXHAUSTED", 0) >= 100, codes


# ---- SIGTERM with streams in flight ------------------------------------------------------------

def test_sigterm_lets_streams_in_flight_finish_and_exits_0(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "sigterm")
    results, started = [], threading.Barrier(5)

    def stream(i):
        with requests.post(f"{k.base}/v1/completions", stream=True, timeout=300,
                           json={"model": MODEL, "prompt": f"Count with me: {i},",
                                 "max_tokens": 12, "ignore_eos": True, "temperature": 0,
                                 "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            first = next(lines)
            started.wait(timeout=120)
            rest = [first] + list(lines)
            results.append([line[6:] for line in rest if line.startswith(b"data: ")])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # every stream has begun
    k.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: requests.get(f"{k.base}/v2/health/ready", timeout=2).status_code
                    == 503, timeout=5)
    refused = post(k, "/v1/completions", {"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    for events in results:
        assert events[-1] == b"[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 12, "the stream finished, not cut off"
    assert k.proc.wait(timeout=60) == 0, k.output()
    assert "shutdown complete" in k.output()
