"""Triton's HTTP client examples against kilnd (issue 14, bug 7): tritonclient.http
(geventhttpclient) reusing one client across errors, tritonclient.http.aio (aiohttp) in the flow of
simple_http_aio_infer_client.py, and the raw keep-alive framing around unknown routes.

What broke: the examples check that an unknown model's error starts with Triton's wording,
"Request for unknown model"; kilnd said "unknown model 'x'", so simple_http_infer_client.py and
simple_http_aio_infer_client.py failed ("improper error message for wrong model name")."""
import asyncio
import socket

import aiohttp
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

INPUT0 = np.arange(16, dtype=np.int32).reshape(1, 16)
INPUT1 = np.full((1, 16), -1, dtype=np.int32)


def simple_request(module, outputs=True):
    """The examples' request: INPUT0 as JSON, INPUT1 binary; OUTPUT0 binary, OUTPUT1 JSON."""
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(INPUT0, binary_data=False)
    inputs[1].set_data_from_numpy(INPUT1, binary_data=True)
    if not outputs:
        return inputs, None
    return inputs, [module.InferRequestedOutput("OUTPUT0", binary_data=True),
                    module.InferRequestedOutput("OUTPUT1", binary_data=False)]


def assert_simple(result):
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), INPUT0 + INPUT1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), INPUT0 - INPUT1)


def test_sync_client_is_reused_after_an_unknown_model_and_an_unknown_route(kilnd):
    # concurrency=1: one pooled keep-alive connection carries every request below.
    c = httpclient.InferenceServerClient(kilnd.http_url, concurrency=1)
    try:
        inputs, outputs = simple_request(httpclient)
        assert_simple(c.infer("simple", inputs, outputs=outputs))
        with pytest.raises(InferenceServerException) as e:
            c.infer("wrong_model_name", inputs, outputs=outputs)
        assert e.value.status() == "404"
        assert e.value.message().startswith("Request for unknown model"), e.value.message()
        assert "'wrong_model_name'" in e.value.message()
        # Errors answered to a POST with a JSON body: a shared-memory key that does not exist,
        # CUDA shared memory (not supported).
        with pytest.raises(InferenceServerException, match="cannot open key"):
            c.register_system_shared_memory("input0_data", "/kiln_no_such_key_simple", 64)
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
            c.register_cuda_shared_memory("input0_data", "AA==", 0, 64)
        c.unregister_system_shared_memory()
        # The same InferInput / InferRequestedOutput objects, reused.
        assert_simple(c.infer("simple", inputs, outputs=outputs))
        assert c.is_server_live() and c.is_model_ready("simple")
        with pytest.raises(InferenceServerException) as e:
            c.get_model_metadata("wrong_model_name")
        assert e.value.message().startswith("Request for unknown model"), e.value.message()
        assert c.get_model_metadata("simple")["name"] == "simple"
    finally:
        c.close()


def test_aio_client_runs_the_simple_http_aio_infer_client_flow(kilnd):
    async def flow():
        async with aioclient.InferenceServerClient(kilnd.http_url) as c:
            assert await c.is_server_live()
            assert await c.is_server_ready()
            assert await c.is_model_ready("simple")
            md = await c.get_model_metadata("simple")
            assert [i["name"] for i in md["inputs"]] == ["INPUT0", "INPUT1"]
            query = {"test_1": 1, "test_2": 2}
            inputs, outputs = simple_request(aioclient)
            assert_simple(await c.infer("simple", inputs, outputs=outputs, query_params=query))
            stats = await c.get_inference_statistics(model_name="simple")
            assert len(stats["model_stats"]) == 1
            no_out, _ = simple_request(aioclient, outputs=False)
            assert_simple(await c.infer("simple", no_out, query_params=query))
            with pytest.raises(InferenceServerException) as e:
                await c.infer("wrong_model_name", inputs, outputs=outputs, query_params=query)
            assert e.value.message().startswith("Request for unknown model"), e.value.message()
            with pytest.raises(InferenceServerException) as e:
                await c.get_model_metadata("wrong_model_name")
            assert e.value.message().startswith("Request for unknown model"), e.value.message()
            both = await asyncio.gather(
                c.infer("simple", inputs, outputs=outputs, query_params=query),
                c.infer("simple", no_out, query_params=query))
            for result in both:
                assert_simple(result)
            assert await c.is_server_live()

    asyncio.run(flow())


def read_response(f, head=False):
    """One response from the buffered socket file `f`: (status, headers, body), framed by
    Content-Length (none after HEAD) exactly as a strict client (llhttp) does; the next byte
    must start the next response."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        assert name.lower() not in headers, f"duplicate header {name}"
        headers[name.lower()] = value.strip()
    assert "content-length" in headers, headers
    body = b"" if head else f.read(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def test_raw_keep_alive_survives_unknown_routes_with_bodies(kilnd):
    body = b'{"inputs": []}'
    chunked = b"5\r\nhello\r\n0\r\n\r\n"
    pipeline = (
        b"POST /v2/nope HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body) +
        b"GET /v2/health/live HTTP/1.1\r\nHost: k\r\n\r\n" +
        b"POST /v2/nosuchextension/unregister HTTP/1.1\r\nHost: k\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunked +
        b"HEAD /v2/nope HTTP/1.1\r\nHost: k\r\n\r\n" +
        b"DELETE /v2/health/live HTTP/1.1\r\nHost: k\r\nContent-Length: 3\r\n\r\nabc" +
        b"POST /v2/models/wrong_model_name/infer HTTP/1.1\r\nHost: k\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body) +
        b"GET /v2/health/live HTTP/1.1\r\nHost: k\r\n\r\n")
    with socket.create_connection(("127.0.0.1", kilnd.http_port), timeout=10) as s:
        s.sendall(pipeline)
        f = s.makefile("rb")
        answers = [read_response(f, head=i == 3) for i in range(7)]
        # Still open and in sync: one more request on the same connection.
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: k\r\n\r\n")
        answers.append(read_response(f))
    statuses = [a[0] for a in answers]
    assert statuses == [404, 200, 404, 404, 405, 404, 200, 200]
    assert all("connection" not in h for _, h, _ in answers), "kept alive throughout"
    assert answers[1][2] == b'{"live":true}' and answers[6][2] == b'{"live":true}'
    assert answers[3][2] == b"" and int(answers[3][1]["content-length"]) > 0  # HEAD
    assert answers[4][1]["allow"] == "GET, HEAD"
    assert b"Request for unknown model: 'wrong_model_name'" in answers[5][2]


def test_aiohttp_reuses_its_connection_after_an_unknown_route(kilnd):
    async def flow():
        created, reused = [], []
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(lambda *_: created.append(1) or asyncio.sleep(0))
        trace.on_connection_reuseconn.append(lambda *_: reused.append(1) or asyncio.sleep(0))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                         trace_configs=[trace]) as session:
            url = f"http://{kilnd.http_url}"
            async with session.post(f"{url}/v2/nope", data=b"x" * 1000) as r:
                assert r.status == 404 and "no route" in (await r.json())["error"]
            async with session.head(f"{url}/v2/nope") as r:
                assert r.status == 404 and await r.read() == b""
            async with session.get(f"{url}/v2/health/live") as r:
                assert r.status == 200 and await r.json() == {"live": True}
        assert (len(created), len(reused)) == (1, 2), "one keep-alive connection for all three"

    asyncio.run(flow())
