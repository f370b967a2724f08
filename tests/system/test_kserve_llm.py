"""KServe on an LLM with tritonclient (gRPC and HTTP), as Triton's vLLM backend is used:
text_input/text_output BYTES tensors, sampling_parameters JSON, exclude_input_in_output,
decoupled streaming on ModelStreamInfer with triton_final_response, metadata and config, and
Triton's generate extension over REST."""
import json
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LLM_NAME as MODEL
from conftest import start_llm_kilnd

PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 4, "temperature": 0}



@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "kserve")
    yield k
    assert k.stop() == 0, k.output()


def inputs(client_module, text, sampling=None, stream=None, exclude=None):
    out = []
    t = client_module.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    out.append(t)
    if sampling is not None:
        s = client_module.InferInput("sampling_parameters", [1], "BYTES")
        s.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        out.append(s)
    for name, value in (("stream", stream), ("exclude_input_in_output", exclude)):
        if value is not None:
            b = client_module.InferInput(name, [1], "BOOL")
            b.set_data_from_numpy(np.array([value]))
            out.append(b)
    return out


def text_of(result):
    return result.as_numpy("text_output")[0].decode()


def stream_all(client, model_inputs, **kwargs):
    """All responses of one request on ModelStreamInfer, until triton_final_response."""
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(MODEL, model_inputs, request_id="s1", **kwargs)
        out = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                return out, error
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out, None
    finally:
        client.stop_stream()


def test_metadata_and_config_show_the_llm_signature(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    md = c.get_model_metadata(MODEL, as_json=True)
    assert [i["name"] for i in md["inputs"]] == ["text_input", "stream", "sampling_parameters",
                                                  "exclude_input_in_output"]
    assert [o["name"] for o in md["outputs"]] == ["text_output"]
    assert md["inputs"][0]["datatype"] == "BYTES"
    cfg = c.get_model_config(MODEL, as_json=True)["config"]
    assert cfg["model_transaction_policy"]["decoupled"] is True
    assert c.is_model_ready(MODEL)


def test_grpc_infer_returns_prompt_and_completion(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    full = text_of(c.infer(MODEL, inputs(grpcclient, PROMPT, GREEDY)))
    assert full.startswith(PROMPT) and "Paris" in full[len(PROMPT):]
    only = text_of(c.infer(MODEL, inputs(grpcclient, PROMPT, GREEDY, exclude=True)))
    assert PROMPT + only == full
    # Request parameters carry the sampling keys when there is no sampling_parameters input.
    by_params = text_of(c.infer(MODEL, inputs(grpcclient, PROMPT, exclude=True),
                                parameters={"max_tokens": 4, "temperature": 0}))
    assert by_params == only


def test_grpc_stream_matches_the_single_response(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    only = text_of(c.infer(MODEL, inputs(grpcclient, PROMPT, GREEDY, exclude=True)))
    responses, error = stream_all(c, inputs(grpcclient, PROMPT, GREEDY, stream=True))
    assert error is None, error
    assert len(responses) >= 2
    flags = [r.get_response().parameters["triton_final_response"].bool_param for r in responses]
    assert flags == [False] * (len(responses) - 1) + [True]
    assert "".join(text_of(r) for r in responses) == only

    responses, error = stream_all(c, inputs(grpcclient, PROMPT, GREEDY, stream=True),
                                  enable_empty_final_response=True)
    assert error is None, error
    assert responses[-1].as_numpy("text_output") is None, "an empty final response"
    assert "".join(text_of(r) for r in responses[:-1]) == only


def test_grpc_errors(kilnd):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    with pytest.raises(InferenceServerException, match="ModelStreamInfer"):
        c.infer(MODEL, inputs(grpcclient, PROMPT, GREEDY, stream=True))
    with pytest.raises(InferenceServerException, match="top_p"):
        c.infer(MODEL, inputs(grpcclient, PROMPT, {"top_p": 0}))
    with pytest.raises(InferenceServerException, match="sampling_parameters"):
        bad = inputs(grpcclient, PROMPT)
        s = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        s.set_data_from_numpy(np.array([b"{not json"], dtype=np.object_))
        c.infer(MODEL, bad + [s])
    _, error = stream_all(c, inputs(grpcclient, PROMPT, {"max_tokens": 0}, stream=True))
    assert error is not None and "max_tokens" in str(error)


def test_http_infer(kilnd):
    c = httpclient.InferenceServerClient(kilnd.http_url)
    full = text_of(c.infer(MODEL, inputs(httpclient, PROMPT, GREEDY)))
    assert full.startswith(PROMPT) and "Paris" in full
    assert c.get_model_config(MODEL)["model_transaction_policy"]["decoupled"] is True


def test_generate_extension(kilnd):
    r = requests.post(f"{kilnd.base}/v2/models/{MODEL}/generate",
                      json={"text_input": PROMPT, "parameters": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == MODEL and body["text_output"].startswith(PROMPT)
    s = requests.post(f"{kilnd.base}/v2/models/{MODEL}/generate_stream",
                      json={"text_input": PROMPT, "parameters": GREEDY}, timeout=120,
                      stream=True)
    assert s.status_code == 200 and s.headers["Content-Type"] == "text/event-stream"
    events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith(b"data:")]
    assert len(events) >= 2
    assert PROMPT + "".join(e["text_output"] for e in events) == body["text_output"]
