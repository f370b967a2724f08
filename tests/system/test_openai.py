"""The OpenAI-compatible API with the official `openai` SDK, unchanged, against a real kilnd
serving SmolLM2-135M-Instruct: models, chat and text completions, streaming and not, usage,
logprobs, stop strings, seeds, and the SDK's error classes.

Generation on 2 CPU cores is slow, so every request asks for a few tokens; one kilnd serves the
whole module.
"""
import re
import shutil
import subprocess
from pathlib import Path

import openai
import pytest
import requests
from openai import OpenAI

from conftest import LLM_NAME as MODEL
from conftest import start_llm_kilnd

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]



@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "openai")
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_llm(client):
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "kiln"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


# Issue 14: agent frameworks send the assistant's tool-call turn with "content": null; it was
# refused with the chat template's error and the model file's path on the server.
def test_assistant_turn_with_null_content_after_a_tool_call(client, kilnd):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
                {"role": "user", "content": "So, shorts?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    # Missing content reads the same as null: the same prompt.
    messages[1] = {"role": "assistant", "tool_calls": [call]}
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
    assert again.usage.prompt_tokens == r.usage.prompt_tokens
    assert again.choices[0].message.content == r.choices[0].message.content
    # Other roles still need content, and no error shows where the server keeps its models.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": None}])
    assert e.value.body["param"] == "messages[0].content"
    assert ".gguf" not in e.value.body["message"] and "/" not in e.value.body["message"]


def test_chat_stream_is_identical_to_the_non_streamed_answer(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, seed=11)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == full.usage.completion_tokens
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens


def test_sampled_text_repeats_with_the_same_seed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.9, seed=42)
    a = client.completions.create(**kwargs).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert a == b


def test_text_completion_streamed_and_not(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is",
                                            max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_defaults_to_sixteen_tokens_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    echoed = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0,
                                       max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("One, two, three,")


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert t.top_logprobs[0].token == t.token, "greedy takes the most likely token"
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or "\ufffd" in t.token
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_several_choices_each_reproducible_by_seed(client):
    # n > 1 (issue 17): choice i is what one request with seed + i gives.
    args = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=5)
    r = client.chat.completions.create(n=3, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    completion = 0
    for i, c in enumerate(r.choices):
        one = client.chat.completions.create(**{**args, "seed": 5 + i})
        assert c.message.content == one.choices[0].message.content
        completion += one.usage.completion_tokens
    assert r.usage.completion_tokens == completion
    assert r.usage.prompt_tokens == one.usage.prompt_tokens


def test_logit_bias_steers_greedy_decoding(client):
    # issue 17: +100 on one token makes greedy decoding repeat it (through the step program's
    # sample op on the real model); the logprobs stay those of the model's own distribution.
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                logprobs=1)
    plain = client.completions.create(**args)
    forced = client.completions.create(logit_bias={"4523": 100}, **args)
    assert forced.choices[0].text != plain.choices[0].text
    assert len(set(forced.choices[0].logprobs.tokens)) == 1, forced.choices[0].logprobs.tokens
    assert forced.choices[0].logprobs.top_logprobs[0] == plain.choices[0].logprobs.top_logprobs[0]


def test_stop_string_ends_the_text(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12,
                                  temperature=0, stop=[" 8"])
    assert r.choices[0].finish_reason == "stop"
    assert " 8" not in r.choices[0].text and r.choices[0].text.strip().startswith("6")


def test_vllm_extensions_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0.7, top_p=0.9,
        presence_penalty=0.1, frequency_penalty=0.1, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "min_tokens": 3})
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=129), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
])
def test_bad_requests_raise_bad_request_error_naming_the_field(client, kwargs, param):
    args = dict(model=MODEL, messages=QUESTION, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"


# Issue 14: OpenAI's shapes in detail.
def test_unknown_route_is_not_found_with_a_code(client, kilnd):
    with pytest.raises(openai.NotFoundError) as e:
        client.images.generate(model=MODEL, prompt="kiln")
    assert e.value.code == "not_found" and e.value.type == "invalid_request_error"
    # /v1/embeddings is routed (test_embeddings.py); an LLM is not an embedding model.
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="kiln")
    assert e.value.param == "model"
    r = requests.get(f"{kilnd.base}/v1/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_chat_message_carries_refusal_null(kilnd):
    r = requests.post(f"{kilnd.base}/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None, message


def test_null_prompt_says_what_prompt_must_be(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=None, max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert e.value.body["message"] == (
        "`prompt` is null; it must be a string or a list of token ids"), e.value.body


def test_llm_and_compiler_metrics_are_exposed_as_documented(kilnd, client):
    """Every kiln_llm_* and kiln_compile_* family of docs/metrics.md is served, counts what this
    module did, and the exposition passes promtool."""
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = kilnd.metrics()
    documented = re.findall(r"^\| `(kiln_(?:llm|compile)_[a-z_]+)` \|",
                            (ROOT / "docs" / "metrics.md").read_text(), re.M)
    assert len(documented) >= 20, documented
    for family in documented:
        assert f"# TYPE {family} " in text, family
    assert kilnd.metric_value("kiln_llm_generation_tokens_total", model=MODEL) >= 3
    assert kilnd.metric_value("kiln_llm_steps_total", model=MODEL, mode="replay") >= 1
    assert kilnd.metric_value("kiln_llm_kv_cache_blocks", model=MODEL) > 0
    assert kilnd.metric_value("kiln_compile_kernels_total", outcome="reused") > 0
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed by scripts/install-deps.sh"
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
        r.stdout.decode() + r.stderr.decode()


def test_llama_cpp_numerics_load_and_answer_repeatably(tmp_path_factory):
    """`activations: q8` and `kv_cache_dtype: f16` (llama.cpp's arithmetic) load and serve;
    greedy answers repeat. (They differ from the exact default's: on this question the q8 path
    answers like llama.cpp's Q4_1 — "L'Étoile, ..." — where exact arithmetic says "Paris".)
    The second request reuses the first one's prompt blocks from the prefix cache and computes
    only the rest of its prompt: its answer must still be the same. (It was not, on a Zen 3,
    before the attention kernels gave a row the same bits however the prompt was cut — the q8
    path turns a one-ulp difference into other roundings of its 8-bit activations.)"""
    k = start_llm_kilnd(tmp_path_factory, "q8",
                        model="    activations: q8\n    kv_cache_dtype: f16")
    try:
        c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
        answers = [c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                             temperature=0) for _ in range(2)]
        assert answers[0].choices[0].message.content
        assert answers[0].usage.completion_tokens == 12
        assert k.metric_value("kiln_llm_prefix_cache_hit_tokens_total", model=MODEL) > 0
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    finally:
        assert k.stop() == 0, k.output()


def test_llama_cpp_numerics_answer_a_second_turn_as_a_cold_prefill(tmp_path_factory):
    """A second turn's prompt holds the first turn's answer, whose KV blocks decode wrote and
    the prefix cache published. On the q8 path, answering from those blocks must give what a
    server without prefix caching gives, prefilling the whole conversation, to the bit: a row
    has the same bits whether decode, a prefill chunk or a cache hit produced its keys."""
    turns = {}
    for caching in ("true", "false"):
        k = start_llm_kilnd(
            tmp_path_factory, f"q8turns{caching}",
            scheduler=f"max_num_seqs: 8, max_queue_size: 64, enable_prefix_caching: {caching}",
            model="    activations: q8\n    kv_cache_dtype: f16")
        try:
            c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
            first = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert first.usage.completion_tokens == 40
            reply = first.choices[0].message.content
            hits = k.metric_value("kiln_llm_prefix_cache_hit_tokens_total", model=MODEL)
            second = c.chat.completions.create(
                model=MODEL, max_tokens=16, temperature=0, logprobs=True,
                messages=QUESTION + [{"role": "assistant", "content": reply},
                                     {"role": "user", "content": "Tell me more about it."}])
            reused = k.metric_value("kiln_llm_prefix_cache_hit_tokens_total", model=MODEL) - hits
            if caching == "true":
                # Blocks past the first prompt's full ones hold rows decode wrote.
                assert reused >= (first.usage.prompt_tokens // 16 + 1) * 16, (reused, first.usage)
            else:
                assert reused == 0
            # The log-probabilities too, bit for bit (JSON carries them exactly): the same
            # greedy tokens could hide logits that moved.
            turns[caching] = (reply, second.choices[0].message.content,
                              [t.logprob for t in second.choices[0].logprobs.content])
            assert turns[caching][1]
        finally:
            assert k.stop() == 0, k.output()
    assert turns["true"] == turns["false"]
