"""Tool calling with the official `openai` SDK against a real kilnd: SmolLM2 (the default model,
whose template knows nothing of tools: Kiln writes them into the system prompt in Hermes' words)
and a random-weight Qwen2 (tests/fixtures/models/qwen2_bias_f32) given Qwen 2.5's chat template,
which renders the tools itself. A required or named tool_choice always yields a call whose
arguments validate against the function's schema, streamed or not; a conversation carrying the
call and the tool's result goes on; bad tools are 400s naming the field.
"""
import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import OpenAI

from conftest import LLM_NAME, Kilnd, default_model_path, ready

ROOT = Path(__file__).resolve().parents[2]

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                      "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD, "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    # The Qwen2 fixture with Qwen 2.5's template and room for the tools in its context.
    qwen = tmp_path_factory.mktemp("qwen") / "qwen2"
    shutil.copytree(ROOT / "tests/fixtures/models/qwen2_bias_f32", qwen)
    cfg = json.loads((qwen / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (ROOT / "tests/fixtures/chat/templates/qwen2_5.jinja").read_text()
    cfg["model_max_length"] = 4096
    (qwen / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = json.loads((qwen / "config.json").read_text())
    model["max_position_embeddings"] = 4096
    (qwen / "config.json").write_text(json.dumps(model))
    config = tmp_path_factory.mktemp("tools") / "kiln.yaml"
    config.write_text(f"""
models:
  - name: {LLM_NAME}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
  - name: qwen2
    kind: llm
    path: {qwen}
    context_length: 4096
""")
    k = ready(Kilnd(config, ()))
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, model, messages, **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **kw)


def assert_valid_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("model", [LLM_NAME, "qwen2"])
@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_choice_always_calls_it(client, model, seed):
    # One call (parallel_tool_calls off): a random-weight model would otherwise chain calls
    # until max_tokens on some seeds.
    r = ask(client, model, [{"role": "user", "content": "What's the weather in Lisbon?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0, seed=seed, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None
    assert len(c.message.tool_calls) == 1
    for call in c.message.tool_calls:
        assert_valid_call(call, "get_weather")


@pytest.mark.parametrize("model", [LLM_NAME, "qwen2"])
def test_required_streams_tool_call_deltas(client, model):
    calls = {}
    finish = None
    for chunk in ask(client, model, [{"role": "user", "content": "What is 17 plus 25?"}],
                     tool_choice="required", temperature=0.7, seed=3, stream=True,
                     parallel_tool_calls=False):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_conversation_with_a_tool_result_goes_on(client):
    first = ask(client, LLM_NAME, [{"role": "user", "content": "Add 2 and 3."}],
                tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert_valid_call(call, "add")
    args = json.loads(call.function.arguments)
    messages = [{"role": "user", "content": "Add 2 and 3."},
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    r = ask(client, LLM_NAME, messages, tool_choice="none", temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)


def test_auto_returns_content_or_valid_calls(client):
    r = ask(client, LLM_NAME, [{"role": "user", "content": "Hello! How are you today?"}],
            temperature=0)
    m = r.choices[0].message
    for call in m.tool_calls or []:
        assert call.function.name in SCHEMAS
    if not m.tool_calls:
        assert r.choices[0].finish_reason in ("stop", "length") and m.content


@pytest.mark.parametrize("extra,param,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "function.name"),
])
def test_bad_tools_are_400_naming_the_field(client, extra, param, message):
    kw = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=LLM_NAME, max_tokens=5,
                                       messages=[{"role": "user", "content": "hi"}], **kw)
    assert e.value.body["param"] == param
    assert message in e.value.body["message"]
