"""Speculative decoding against a real kilnd serving SmolLM2 (the default model) with
scheduler.speculative {method: ngram}: greedy and seeded outputs are identical to decoding
without drafts (`speculative: {"method": "none"}` on the same server), streamed or not, alone
or batched, on the OpenAI API, KServe's generate route and kiln.v1, and drafts are accepted on
a task that copies its input (the acceptance counters in /metrics). And with a draft model
(scheduler.speculative.draft_model), the output is the same."""
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests
from openai import OpenAI

from conftest import LLM_NAME as MODEL
from conftest import default_model_path, start_llm_kilnd
from test_generation_grpc import _stubs_dir

CODE = '''def word_counts(path, min_length=3):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                if len(word) >= min_length:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
'''
REWRITE = f"Rewrite this Python function, renaming the variable `counts` to `tally`. Reply with " \
          f"the code only.\n\n```python\n{CODE}```"
OFF = {"speculative": {"method": "none"}}


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(
        tmp_path_factory, "speculative",
        scheduler="max_num_seqs: 8, max_queue_size: 64, "
                  "speculative: {method: ngram, num_tokens: 6}")
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def counters(kilnd):
    return (kilnd.metric_value("kiln_llm_spec_draft_tokens_total", model=MODEL),
            kilnd.metric_value("kiln_llm_spec_accepted_tokens_total", model=MODEL))


def test_greedy_rewrite_is_identical_and_accepts_drafts(kilnd, client):
    drafted0, accepted0 = counters(kilnd)
    spec = chat(client, REWRITE, temperature=0, max_tokens=160)
    drafted1, accepted1 = counters(kilnd)
    plain = chat(client, REWRITE, temperature=0, max_tokens=160, extra_body=OFF)
    assert counters(kilnd) == (drafted1, accepted1), "speculative none still drafted"
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    # The answer copies the function: most drafts are right.
    assert drafted1 > drafted0
    assert (accepted1 - accepted0) / (drafted1 - drafted0) > 0.4, (drafted1, accepted1)


@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_sampling_is_identical(client, seed):
    kw = dict(temperature=0.9, top_p=0.95, seed=seed, max_tokens=120, logprobs=True,
              top_logprobs=2)
    spec = chat(client, REWRITE, **kw)
    plain = chat(client, REWRITE, **kw, extra_body=OFF)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    got = [(t.token, round(t.logprob, 3)) for t in spec.choices[0].logprobs.content]
    want = [(t.token, round(t.logprob, 3)) for t in plain.choices[0].logprobs.content]
    assert got == want


def test_streamed_and_batched_outputs_are_identical(client):
    prompts = [REWRITE, "Repeat exactly: the quick brown fox jumps over the lazy dog. "
               "the quick brown fox jumps over the lazy dog.", "Name three colours."]

    def stream(p, extra):
        chunks = chat(client, p, temperature=0, max_tokens=100, stream=True, extra_body=extra)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:  # batched with each other
        spec = list(pool.map(lambda p: stream(p, None), prompts))
    plain = [stream(p, OFF) for p in prompts]
    assert spec == plain


def test_a_draft_model_leaves_the_output_unchanged(tmp_path_factory):
    """scheduler.speculative.draft_model, here the model itself (so every greedy draft is
    right): kilnd loads it beside the model, and drafts from it verify to the same tokens."""
    k = start_llm_kilnd(
        tmp_path_factory, "speculative-draft",
        scheduler="max_num_seqs: 8, max_queue_size: 64, speculative: {method: draft, "
                  f"draft_model: '{default_model_path()}', num_tokens: 4, adaptive: false}}")
    try:
        c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=300)
        for content in ("What is the capital of France? Answer in one sentence.", REWRITE):
            spec = chat(c, content, temperature=0, max_tokens=48)
            plain = chat(c, content, temperature=0, max_tokens=48, extra_body=OFF)
            assert spec.choices[0].message.content == plain.choices[0].message.content
        drafted, accepted = counters(k)
        assert drafted > 0
        # Every draft is right except those past the end of an answer: the step that samples
        # its end token rejects the (at most num_tokens) drafts after it, once per request.
        assert accepted >= drafted - 2 * 4, (accepted, drafted)
    finally:
        assert k.stop() == 0, k.output()


def test_bad_speculative_settings_are_400s(client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", extra_body={"speculative": {"method": "draft", "model": "tiny"}})
    assert e.value.body["param"] == "speculative.method"
    assert "no draft model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", extra_body={"speculative": {"method": "ngram", "num_tokens": 0.5}})
    assert e.value.body["param"] == "speculative.num_tokens"


def test_kserve_generate_and_kiln_v1_take_speculative(kilnd, client, tmp_path):
    want = chat(client, REWRITE, temperature=0, max_tokens=60, extra_body=OFF)
    prompt = "Repeat exactly: one two three four five, one two three four five, one two"
    outs = []
    for spec in ({"method": "ngram", "num_tokens": 4}, {"method": "none"}):
        r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/generate", json={
            "text_input": prompt, "parameters": {"max_tokens": 40, "temperature": 0,
                                                 "speculative": spec}}, timeout=300)
        assert r.status_code == 200, r.text
        outs.append(r.json()["text_output"])
    assert outs[0] == outs[1]
    sys.path.insert(0, str(_stubs_dir(tmp_path)))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(kilnd.grpc_url))
    texts = []
    for method in ("ngram", "none"):
        req = generation_pb2.GenerateRequest(model=MODEL)
        req.chat.messages.add(role="user", content=REWRITE)
        req.chat.add_generation_prompt = True
        req.sampling.max_tokens = 60
        req.sampling.temperature = 0
        req.sampling.speculative.method = method
        texts.append(stub.Generate(req, timeout=300).text)
    assert texts[0] == texts[1] == want.choices[0].message.content
    req = generation_pb2.GenerateRequest(model=MODEL, prompt="hi")
    req.sampling.speculative.method = "ngram"
    req.sampling.speculative.num_tokens = 99
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative.num_tokens" in e.value.details()
