"""KServe v2 REST with tritonclient.http (binary tensor data by default) and raw JSON."""
import json

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def test_health_and_metadata(kilnd):
    assert requests.get(f"{kilnd.base}/v2/health/live").status_code == 200
    assert requests.get(f"{kilnd.base}/v2/health/ready").status_code == 200
    assert requests.get(f"{kilnd.base}/v2/models/simple/ready").status_code == 200
    assert requests.get(f"{kilnd.base}/v2/models/simple/versions/1/ready").status_code == 200
    md = requests.get(f"{kilnd.base}/v2").json()
    assert md["name"] == "kiln" and "binary_tensor_data" in md["extensions"]
    mm = requests.get(f"{kilnd.base}/v2/models/simple").json()
    assert mm["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    cfg = requests.get(f"{kilnd.base}/v2/models/simple/config").json()
    assert cfg["max_batch_size"] == 8 and cfg["input"][0]["dims"] == [16]


def test_health_answers_with_the_open_inference_protocols_json(kilnd):
    """KServe's SDK reads the answer from the body (InferenceRESTClient.is_server_live:
    response.json().get("live")); regression: the bodies were empty, so it failed on a 200."""
    expected = {"/v2/health/live": {"live": True},
                "/v2/health/ready": {"ready": True},
                "/v2/models/simple/ready": {"name": "simple", "ready": True},
                "/v2/models/simple/versions/1/ready": {"name": "simple", "ready": True}}
    for path, body in expected.items():
        r = requests.get(f"{kilnd.base}{path}")
        assert r.status_code == 200, path
        assert r.headers["Content-Type"] == "application/json", path
        assert r.json() == body, path
    # A known model that is not ready: 503, and the body says so.
    httpclient.InferenceServerClient(kilnd.http_url).unload_model("identity_fp32")
    r = requests.get(f"{kilnd.base}/v2/models/identity_fp32/ready")
    assert r.status_code == 503
    assert r.headers["Content-Type"] == "application/json"
    assert r.json() == {"name": "identity_fp32", "ready": False}
    # An unknown one stays a KServe error.
    r = requests.get(f"{kilnd.base}/v2/models/nope/ready")
    assert r.status_code == 404
    assert r.json()["error"] == "Request for unknown model: 'nope' is not found"  # Triton's


def test_unknown_routes_and_models(kilnd):
    r = requests.get(f"{kilnd.base}/v2/models/nope")
    assert r.status_code == 404
    assert r.json()["error"] == "Request for unknown model: 'nope' is not found"  # Triton's
    assert requests.get(f"{kilnd.base}/v3/whatever").status_code == 404
    # A method the route does not take: 405 with the methods it does (RFC 9110).
    r = requests.get(f"{kilnd.base}/v2/models/simple/infer")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"


def test_tritonclient_http_binary_infer(kilnd):
    c = httpclient.InferenceServerClient(kilnd.http_url)
    assert c.is_server_ready() and c.is_model_ready("simple")
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [2, 16], "INT32"),
              httpclient.InferInput("INPUT1", [2, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)                      # binary by default
    inputs[1].set_data_from_numpy(b, binary_data=False)   # JSON
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    r = c.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_plain_json_infer(kilnd):
    body = {"id": "j1", "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [[1] * 16]}]}
    r = requests.post(f"{kilnd.base}/v2/models/simple/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["id"] == "j1"
    assert out["OUTPUT0"]["data"] == [i + 1 for i in range(16)]
    assert out["OUTPUT1"]["shape"] == [1, 16]


@pytest.mark.parametrize("body,status,fragment", [
    ("{not json", 400, "not valid JSON"),
    ({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                  "data": list(range(15))}]}, 400, "has 15 elements"),
    ({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                  "data": [0.5] * 16}]}, 400, "datatype FP32"),
    ({"inputs": "nope"}, 400, "`inputs` must be an array"),
])
def test_bad_json_bodies(kilnd, body, status, fragment):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(f"{kilnd.base}/v2/models/simple/infer", data=data)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]


def test_oversized_body_gets_413(kilnd):
    r = requests.post(f"{kilnd.base}/v2/models/identity_fp32/infer", data=bytes(65 << 20))
    assert r.status_code == 413


def test_repository_index_and_stats(kilnd):
    idx = requests.post(f"{kilnd.base}/v2/repository/index").json()
    assert {m["name"] for m in idx} == {"simple", "identity_fp32", "sleep_us"}
    c = httpclient.InferenceServerClient(kilnd.http_url)
    x = httpclient.InferInput("INPUT0", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    c.infer("identity_fp32", [x])
    stats = c.get_inference_statistics("identity_fp32")["model_stats"][0]
    assert stats["inference_count"] == 1 and stats["execution_count"] == 1


def test_tritonclient_http_error_message(kilnd):
    c = httpclient.InferenceServerClient(kilnd.http_url)
    x = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    x.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException, match="missing input 'INPUT1'"):
        c.infer("simple", [x])
