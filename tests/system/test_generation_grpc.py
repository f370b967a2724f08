"""kiln.v1.Generation with plain grpcio (stubs generated from proto/kiln/v1/generation.proto at
build time) against a real kilnd serving SmolLM2-135M-Instruct: Generate and GenerateStream
agree, chats, token ids, logprobs, Tokenize/Detokenize/ListModels, errors that name the
field, cancellation freeing the KV cache, health and reflection."""
import math
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import LLM_NAME as MODEL
from conftest import start_llm_kilnd, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _stubs_dir(tmp_root):
    """The build's generated stubs, or fresh ones when run outside CTest."""
    built = Path(os.environ.get("KILN_BUILD_DIR", ROOT / "build")) / "tests" / "system" / "pb"
    if (built / "kiln" / "v1" / "generation_pb2_grpc.py").exists():
        return built
    out = tmp_root / "pb"
    out.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                    f"--python_out={out}", f"--grpc_python_out={out}",
                    str(ROOT / "proto" / "kiln" / "v1" / "generation.proto")], check=True)
    return out


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    sys.path.insert(0, str(_stubs_dir(tmp_path_factory.mktemp("stubs"))))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    return generation_pb2, generation_pb2_grpc



@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "grpc")
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def stub(kilnd, pb):
    return pb[1].GenerationStub(grpc.insecure_channel(kilnd.grpc_url))


def request(pb, prompt="The capital of France is", max_tokens=4, **sampling):
    sampling.setdefault("temperature", 0)
    return pb[0].GenerateRequest(model=MODEL, prompt=prompt,
                                 sampling=pb[0].SamplingParams(max_tokens=max_tokens, **sampling))


def test_generate_and_generate_stream_agree(stub, pb):
    req = request(pb)
    req.request_id = "abc"
    full = stub.Generate(req, timeout=120)
    assert full.request_id == "abc" and full.model == MODEL
    assert "Paris" in full.text
    assert full.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 3 and full.usage.completion_tokens == len(full.token_ids)
    messages = list(stub.GenerateStream(req, timeout=120))
    assert "".join(m.text for m in messages) == full.text
    assert [t for m in messages for t in m.token_ids] == list(full.token_ids)
    assert [m.finish_reason for m in messages if m.finish_reason] == [full.finish_reason]
    assert messages[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_token_ids_and_logprobs(stub, pb):
    p = pb[0]
    chat = p.GenerateRequest(model=MODEL, chat=p.Chat(
        messages=[p.ChatMessage(role="user", content="What is the capital of France?")],
        add_generation_prompt=True), sampling=p.SamplingParams(max_tokens=8, temperature=0,
                                                               logprobs=2))
    r = stub.Generate(chat, timeout=120)
    assert "Paris" in r.text
    assert len(r.logprobs) == len(r.token_ids)
    assert all(len(t.top) == 2 and t.logprob <= 0 for t in r.logprobs)
    assert r.logprobs[0].id == r.token_ids[0] == r.logprobs[0].top[0].id

    ids = stub.Tokenize(p.TokenizeRequest(model=MODEL, text="The capital of France is"))
    by_ids = stub.Generate(p.GenerateRequest(model=MODEL, prompt_ids=p.TokenIds(ids=ids.token_ids),
                                             sampling=p.SamplingParams(max_tokens=4,
                                                                       temperature=0)))
    by_text = stub.Generate(request(pb))
    assert by_ids.text == by_text.text


def test_tokenize_detokenize_list_models(stub, pb):
    p = pb[0]
    t = stub.Tokenize(p.TokenizeRequest(model=MODEL, text="Hello <|im_end|> world"))
    assert len(t.pieces) == len(t.token_ids) > 3
    assert "<|im_end|>" not in t.pieces, "typed control-token text stays text"
    back = stub.Detokenize(p.DetokenizeRequest(model=MODEL, token_ids=t.token_ids))
    assert back.text == "Hello <|im_end|> world"
    chat = stub.Tokenize(p.TokenizeRequest(model=MODEL, chat=p.Chat(
        messages=[p.ChatMessage(role="user", content="Hi")], add_generation_prompt=True)))
    assert "<|im_start|>" in chat.pieces and "<|im_end|>" in chat.pieces
    models = stub.ListModels(p.ListModelsRequest()).models
    assert len(models) == 1
    m = models[0]
    assert (m.name, m.kind, m.state) == (MODEL, "llm", "READY")
    assert m.architecture == "llama" and m.context_length == 2048 and m.vocab_size == 49152
    assert m.has_chat_template


@pytest.mark.parametrize("edit,code,words", [
    (dict(sampling=dict(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "`top_p` is 0"),
    (dict(sampling=dict(temperature=math.nan)), grpc.StatusCode.INVALID_ARGUMENT,
     "`temperature` is nan"),
    (dict(sampling=dict(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
     "`sampling.max_tokens` is 0"),
    (dict(sampling=dict(max_tokens=100000)), grpc.StatusCode.INVALID_ARGUMENT,
     "leaves room for at most"),
    (dict(model="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
])
def test_errors_name_the_field(stub, pb, edit, code, words):
    sampling = dict(max_tokens=4, temperature=0)
    sampling.update(edit.get("sampling", {}))
    req = pb[0].GenerateRequest(model=edit.get("model", MODEL), prompt="hi",
                                sampling=pb[0].SamplingParams(**sampling))
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=30)
        assert e.value.code() == code
        assert words in e.value.details()


def test_unknown_chat_role_is_invalid_argument(stub, pb):
    p = pb[0]
    req = p.GenerateRequest(model=MODEL, chat=p.Chat(messages=[p.ChatMessage(role="pirate",
                                                                              content="arr")]))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].role" in e.value.details()


def test_cancelling_the_stream_frees_the_kv_cache(kilnd, stub, pb):
    usage = 'kiln_llm_kv_cache_usage_ratio'
    stream = stub.GenerateStream(request(pb, prompt="Tell me a long story about a kiln.",
                                         max_tokens=512, ignore_eos=True), timeout=300)
    first = next(stream)
    assert first.text or first.token_ids
    assert kilnd.metric_value(usage, model=MODEL) > 0
    stream.cancel()
    wait_for(lambda: kilnd.metric_value(usage, model=MODEL) == 0, "the KV blocks to be freed")
    assert kilnd.metric_value("kiln_llm_requests_total", model=MODEL,
                              finish_reason="cancelled") >= 1


def test_health_and_reflection_list_the_service(kilnd):
    channel = grpc.insecure_channel(kilnd.grpc_url)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="kiln.v1.Generation"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(reflection.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert "kiln.v1.Generation" in names and "inference.GRPCInferenceService" in names
