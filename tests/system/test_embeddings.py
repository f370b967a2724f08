"""POST /v1/embeddings with the official `openai` SDK and the KServe tensor path, against a real
kilnd serving all-MiniLM-L6-v2 (the default embedding model): vectors equal to
sentence-transformers' (tests/fixtures/embeddings, scripts/fixtures/make_embedding_fixtures.py),
float and base64, `dimensions`, order across the batches one request is split into, concurrent
requests sharing steps, and every bad input answered 400 naming the field.
"""
import base64
import json
import struct
import threading
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
from openai import OpenAI

from conftest import Kilnd, default_model_path, ready

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/embeddings"
MODEL = "all-MiniLM-L6-v2"


def embedding_model_path():
    # The script fetches both default models; the embedding folder sits beside the GGUF.
    return str((Path(default_model_path()).parent / "all-MiniLM-L6-v2").resolve())


def reference():
    texts = [json.loads(line)["text"] for line in
             (FIXTURES / "sentences.jsonl").read_text(encoding="utf-8").splitlines()]
    raw = (FIXTURES / "minilm_embeddings.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    begin, end = header["embeddings"]["data_offsets"]
    vectors = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype="<f4").reshape(
        header["embeddings"]["shape"])
    return texts, vectors


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    config = tmp_path_factory.mktemp("embeddings") / "kiln.yaml"
    config.write_text(f"""
models:
  - name: {MODEL}
    kind: embedding
    path: {embedding_model_path()}
    max_batch_size: 32
    dynamic_batching: {{max_queue_delay_microseconds: 2000}}
  - name: simple
    kind: builtin
    builtin: simple
    max_batch_size: 8
""")
    k = ready(Kilnd(config, ()))
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=120)


def cosine(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_models_lists_the_embedding_model(client, kilnd):
    assert MODEL in [m.id for m in client.models.list()]
    m = requests.get(f"{kilnd.base}/v1/models/{MODEL}").json()
    assert m["id"] == MODEL and m["object"] == "model" and m["dimensions"] == 384


def test_vectors_match_sentence_transformers(client):
    texts, want = reference()
    # The fixture holds one text over 256 tokens: sentence-transformers cuts it, Kiln when asked.
    r = client.embeddings.create(model=MODEL, input=texts[:64], extra_body={"truncate": True})
    assert r.object == "list" and r.model == MODEL and len(r.data) == 64
    for i, d in enumerate(r.data):
        assert d.index == i and d.object == "embedding" and len(d.embedding) == 384
        assert cosine(d.embedding, want[i]) >= 0.9999, texts[i]
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens > 64 * 3


def test_one_string_and_base64(client):
    texts, want = reference()
    floats = client.embeddings.create(model=MODEL, input=texts[0]).data[0].embedding
    assert cosine(floats, want[0]) >= 0.9999
    # base64 is the float32 little-endian bytes (the SDK asks for it by default and decodes it;
    # asked explicitly, it hands the string over).
    raw = requests.post(f"{client.base_url}embeddings",
                        json={"model": MODEL, "input": [texts[0]], "encoding_format": "base64"})
    assert raw.status_code == 200, raw.text
    b64 = raw.json()["data"][0]["embedding"]
    assert isinstance(b64, str)
    decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, rtol=0, atol=1e-7)
    sdk = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="base64")
    assert sdk.data[0].embedding == b64


def test_dimensions_keep_the_first_values_renormalised(client):
    full = client.embeddings.create(model=MODEL, input="a short text").data[0].embedding
    cut = client.embeddings.create(model=MODEL, input="a short text",
                                   dimensions=128).data[0].embedding
    assert len(cut) == 128
    head = np.asarray(full[:128])
    np.testing.assert_allclose(cut, head / np.linalg.norm(head), atol=1e-6)


def test_many_texts_keep_their_order_across_batches(client):
    texts, want = reference()
    r = client.embeddings.create(model=MODEL, input=texts[:150],  # five batches of <= 32
                                 extra_body={"truncate": True})
    assert [d.index for d in r.data] == list(range(150))
    worst = min(cosine(d.embedding, want[i]) for i, d in enumerate(r.data))
    assert worst >= 0.9999


def test_concurrent_requests_all_answer(client):
    texts, want = reference()
    errors, results = [], {}

    def worker(i):
        try:
            r = client.embeddings.create(model=MODEL, input=[texts[i], texts[i + 20]],
                                         extra_body={"truncate": True})
            results[i] = [d.embedding for d in r.data]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, (a, b) in results.items():
        assert cosine(a, want[i]) >= 0.9999 and cosine(b, want[i + 20]) >= 0.9999


def test_long_text_is_refused_unless_truncation_is_asked(client):
    long_text = "word " * 400
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=["fine", long_text])
    body = e.value.body
    assert body["param"] == "input" and "input[1]" in body["message"]
    assert "truncate" in body["message"]
    r = client.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate": True})
    assert len(r.data[0].embedding) == 384 and r.usage.prompt_tokens == 256


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": ""}, "input"),
    ({"model": MODEL, "input": []}, "input"),
    ({"model": MODEL, "input": ["ok", ""]}, "input"),
    ({"model": MODEL, "input": [1, 2, 3]}, "input"),
    ({"model": MODEL, "input": [[1, 2]]}, "input"),
    ({"model": MODEL, "input": {"text": "x"}}, "input"),
    ({"model": MODEL, "input": ["x"] * 2049}, "input"),
    ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": MODEL, "input": "x", "dimensions": 385}, "dimensions"),
    ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "simple", "input": "x"}, "model"),
])
def test_bad_requests_name_the_field(kilnd, body, param):
    r = requests.post(f"{kilnd.base}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_unknown_model_is_not_found(kilnd):
    r = requests.post(f"{kilnd.base}/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert requests.get(f"{kilnd.base}/v1/embeddings").status_code == 405


def test_kserve_tensor_path(kilnd):
    texts, want = reference()
    meta = requests.get(f"{kilnd.base}/v2/models/{MODEL}").json()
    assert meta["platform"] == "kiln_embedding"
    assert [o["name"] for o in meta["outputs"]] == ["embedding", "token_count", "truncated"]
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2, 1],
                        "data": [texts[3], texts[4]]}]}
    r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["embedding"]["shape"] == [2, 384]
    vectors = np.asarray(out["embedding"]["data"]).reshape(2, 384)
    assert cosine(vectors[0], want[3]) >= 0.9999 and cosine(vectors[1], want[4]) >= 0.9999
    assert out["truncated"]["data"] == [False, False]
    empty = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                         "data": [""]}]}
    r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/infer", json=empty)
    assert r.status_code == 400 and "empty" in r.text


def test_the_callers_trace_comes_back_with_a_new_span(kilnd):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    for body, status in [({"model": MODEL, "input": ["one", "two"]}, 200),
                         ({"model": MODEL, "input": ""}, 400)]:
        r = requests.post(f"{kilnd.base}/v1/embeddings", json=body,
                          headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert r.status_code == status, r.text
        _, got_trace, got_span, _ = r.headers["traceparent"].split("-")
        assert got_trace == trace_id and got_span != parent
