"""PEFT adapters made by Python PEFT, served by a real kilnd through vLLM's runtime routes
(POST /v1/load_lora_adapter, /v1/unload_lora_adapter) and addressed by name as the `model`:
their greedy tokens, batched together with the base model, are PyTorch + PEFT's
(tests/fixtures/peft/llama_gqa_f32_{a,b}/kiln_reference.json, made by
scripts/fixtures/make_multi_lora_fixtures.py). Plus the refusals: a folder without
adapter_config.json, a rank over the model's max_lora_rank, an adapter of another model's
shapes, a name already taken, unloading an unknown adapter.
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests

from conftest import Kilnd

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "tests" / "fixtures" / "models" / "llama_gqa_f32"
PEFT = ROOT / "tests" / "fixtures" / "peft"
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def pb():
    from test_generation_grpc import _stubs_dir  # the build's generated stubs
    import tempfile
    sys.path.insert(0, str(_stubs_dir(Path(tempfile.mkdtemp()))))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    return generation_pb2, generation_pb2_grpc


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("lora") / "kiln.yaml"
    cfg.write_text(f"""
models:
  - name: tiny
    kind: llm
    path: {BASE}
    max_loaded_adapters: 2
    max_lora_rank: {MAX_LORA_RANK}
    scheduler: {{max_num_seqs: 8, max_num_batched_tokens: 64}}
""")
    k = Kilnd(cfg).wait_ready()
    yield k
    assert k.stop() == 0, k.output()


def load(k, name, path, **extra):
    return requests.post(f"{k.base}/v1/load_lora_adapter",
                         json={"lora_name": name, "lora_path": str(path), **extra}, timeout=60)


def reference(adapter):
    return json.loads((PEFT / adapter / "kiln_reference.json").read_text())


def generate(stub, pb, model, ids, n):
    r = stub.Generate(pb[0].GenerateRequest(
        model=model, prompt_ids=pb[0].TokenIds(ids=ids),
        sampling=pb[0].SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    return list(r.token_ids)


def test_peft_adapters_batched_give_pytorch_tokens(kilnd, pb):
    for name in ("a", "b"):
        r = load(kilnd, f"peft-{name}", PEFT / f"llama_gqa_f32_{name}")
        assert r.status_code == 200, r.text
        assert f"peft-{name}" in r.text
    models = {m["id"]: m for m in requests.get(f"{kilnd.base}/v1/models", timeout=10).json()["data"]}
    assert models["peft-a"]["parent"] == "tiny"
    assert models["peft-b"]["root"] == str(PEFT / "llama_gqa_f32_b")

    stub = pb[1].GenerationStub(grpc.insecure_channel(kilnd.grpc_url))
    calls = []
    for name in ("a", "b"):
        ref = reference(f"llama_gqa_f32_{name}")
        for p in ref["prompts"]:
            calls.append((f"peft-{name}", p["ids"], p["greedy"]))
    # Base-model requests in the same steps: whatever they give, alone, they give batched.
    base_prompt = calls[0][1]
    alone = generate(stub, pb, "tiny", base_prompt, 16)
    calls.append(("tiny", base_prompt, alone))
    with ThreadPoolExecutor(len(calls)) as pool:
        got = list(pool.map(lambda c: generate(stub, pb, c[0], c[1], len(c[2])), calls))
    for (model, _, want), tokens in zip(calls, got):
        assert tokens == want, model

    # KServe: the repository index lists the adapters; /ready, /metadata and the generate
    # extension take an adapter's name and run the adapter (the same text as OpenAI's route).
    index = requests.post(f"{kilnd.base}/v2/repository/index", json={"ready": True},
                          timeout=10).json()
    assert {"name": "peft-b", "version": "1", "state": "READY"} in index, index
    assert requests.get(f"{kilnd.base}/v2/models/peft-b/ready", timeout=10).status_code == 200
    assert requests.get(f"{kilnd.base}/v2/models/peft-b", timeout=10).json()["name"] == "peft-b"
    prompt = "The quick brown fox"
    texts = {}
    for model in ("peft-b", "tiny"):
        g = requests.post(f"{kilnd.base}/v2/models/{model}/generate", timeout=60, json={
            "text_input": prompt, "exclude_input_in_output": True,
            "parameters": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})
        assert g.status_code == 200, g.text
        assert g.json()["model_name"] == model
        c = requests.post(f"{kilnd.base}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert c.status_code == 200, c.text
        assert g.json()["text_output"] == c.json()["choices"][0]["text"], model
        texts[model] = g.json()["text_output"]
    assert texts["peft-b"] != texts["tiny"], "the adapter changes the greedy text"

    # Unloaded: the name is gone; the base still serves.
    r = requests.post(f"{kilnd.base}/v1/unload_lora_adapter", json={"lora_name": "peft-a"},
                      timeout=10)
    assert r.status_code == 200, r.text
    r = requests.post(f"{kilnd.base}/v1/completions",
                      json={"model": "peft-a", "prompt": "hi", "max_tokens": 1}, timeout=10)
    assert r.status_code == 404, r.text
    assert generate(stub, pb, "tiny", base_prompt, 16) == alone


def test_bad_adapters_are_refused_clearly(kilnd, tmp_path):
    empty = tmp_path / "no-config"
    empty.mkdir()
    r = load(kilnd, "x", empty)
    assert r.status_code in (400, 404), r.text
    assert "adapter_config.json" in r.json()["error"]["message"]

    # Rank over max_lora_rank: the fixture's rank-4 adapter with its config saying more.
    big = tmp_path / "big-rank"
    big.mkdir()
    src = PEFT / "llama_gqa_f32_a"
    conf = json.loads((src / "adapter_config.json").read_text())
    conf["r"] = MAX_LORA_RANK * 2
    (big / "adapter_config.json").write_text(json.dumps(conf))
    (big / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    r = load(kilnd, "big", big)
    assert r.status_code == 400, r.text
    assert "rank" in r.json()["error"]["message"]

    # An adapter made for another model (other shapes).
    r = load(kilnd, "other", PEFT / "tiny_llama_adapter")
    assert r.status_code == 400, r.text

    r = load(kilnd, "tiny", PEFT / "llama_gqa_f32_b")
    assert r.status_code in (400, 409), r.text  # the base model's own name is taken
    r = requests.post(f"{kilnd.base}/v1/load_lora_adapter", json={"lora_path": "/x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    r = requests.post(f"{kilnd.base}/v1/unload_lora_adapter", json={"lora_name": "nope"},
                      timeout=10)
    assert r.status_code == 404, r.text
