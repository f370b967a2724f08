"""Structured output against a real kilnd serving SmolLM2 (the default model), with the official
`openai` SDK, kiln.v1 over gRPC and KServe's generate route: response_format json_object and
json_schema (strict), Kiln's `grammar` (GBNF) and `regex`, streamed and not, sampled at a high
temperature so the model would wander without the mask. Every output is parsed and validated
(jsonschema); bad schemas and grammars are 400s in OpenAI's error shape naming the field.
"""
import json
import re
import sys

import grpc
import jsonschema
import openai
import pytest
import requests
from openai import OpenAI

from conftest import LLM_NAME as MODEL
from conftest import start_llm_kilnd
from test_generation_grpc import _stubs_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "pt"]},
                      "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "nickname": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "languages", "address", "height_m"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "structured")
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_always_validates(client, seed):
    r = chat(client, "Describe a person.", temperature=1.2, seed=seed, max_tokens=300,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_schema_streamed_equals_unstreamed(client):
    kw = dict(temperature=0.8, seed=11, max_tokens=300,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    whole = chat(client, "A French engineer, please.", **kw).choices[0].message.content
    parts = []
    for chunk in chat(client, "A French engineer, please.", stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_json_object(client):
    r = chat(client, "Give me a JSON object about a cat.", temperature=0.7, seed=5,
             max_tokens=200, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut at max_tokens: what came is still the start of an object
        assert c.message.content.lstrip().startswith("{")


def test_grammar_and_regex_on_completions(client):
    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{5,40} "."'
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=60,
                                  temperature=1.0, seed=2, extra_body={"grammar": gbnf})
    assert re.fullmatch(r"(yes|no), because [a-z ]{5,40}\.", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=30,
                                  temperature=1.0, seed=3,
                                  extra_body={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"


def test_kserve_generate_and_kiln_v1(kilnd, tmp_path):
    r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/generate", json={
        "text_input": "Pick a colour:", "parameters": {
            "max_tokens": 20, "temperature": 1.0, "regex": "(red|green|blue)!"}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"].endswith(("red!", "green!", "blue!"))
    sys.path.insert(0, str(_stubs_dir(tmp_path)))
    from kiln.v1 import generation_pb2, generation_pb2_grpc
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(kilnd.grpc_url))
    req = generation_pb2.GenerateRequest(model=MODEL, prompt="A person as JSON:")
    req.sampling.max_tokens = 300
    req.sampling.temperature = 0.9
    req.sampling.seed = 4
    req.sampling.json_schema = json.dumps(PERSON)
    resp = stub.Generate(req, timeout=300)
    jsonschema.validate(json.loads(resp.text), PERSON)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "hostname"}}}},
     "response_format", "format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}},
     "response_format", "nope"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"grammar": "root ::= [a-"}, "grammar", "unterminated character class"),
    ({"regex": "(?<=a)b"}, "regex", "`regex`"),
])
def test_bad_constraints_are_400_naming_the_field(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=5, extra_body=extra)
    err = e.value.body
    assert err["param"] == param, err
    assert message in err["message"], err


def test_openai_sdk_parse_with_a_pydantic_model(client):
    """The SDK's structured-output helper: a Pydantic model becomes a strict json_schema (with
    titles and $defs) and the reply parses back into the model."""
    from typing import List, Literal

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        action: Literal["mix", "shape", "fire", "glaze"]
        minutes: int = Field(ge=1, le=600)

    class Recipe(BaseModel):
        name: str = Field(max_length=40)
        steps: List[Step] = Field(min_length=1, max_length=4)

    r = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "How do I make a clay bowl?"}],
        response_format=Recipe, max_tokens=300, temperature=0.8, seed=9)
    recipe = r.choices[0].message.parsed
    assert isinstance(recipe, Recipe) and 1 <= len(recipe.steps) <= 4


def test_kserve_generate_response_format(kilnd):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/generate", json={
        "text_input": "Answer in JSON:", "parameters": {
            "max_tokens": 30,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": schema}}}})
    assert r.status_code == 200, r.text
    out = r.json()["text_output"]  # the prompt, then the output
    assert isinstance(json.loads(out[out.index("{"):])["ok"], bool), out
