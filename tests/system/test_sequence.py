"""Sequence batching (stateful models) with the stock Triton clients: the calls of Triton's
example clients simple_grpc_sequence_sync_infer_client.py,
simple_grpc_sequence_stream_infer_client.py and simple_http_sequence_sync_infer_client.py
against the built-in simple_sequence, with their expected outputs, and the errors a client
sees (no sequence id, a sequence never started, one released as idle)."""
import json
import queue
import uuid
from functools import partial

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import wait_for

CONTROLS = """
      control_input:
        - name: START
          control: [{kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}]
        - name: READY
          control: [{kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1]}]
"""

CONFIG = f"""
models:
  - name: simple_sequence
    kind: builtin
    builtin: simple_sequence
    max_batch_size: 8
    sequence_batching:
      max_sequence_idle_microseconds: 5000000
{CONTROLS}
  - name: seq_oldest_idle
    kind: builtin
    builtin: simple_sequence
    max_batch_size: 8
    sequence_batching:
      max_sequence_idle_microseconds: 300000
      oldest: {{max_candidate_sequences: 4, max_queue_delay_microseconds: 100}}
{CONTROLS}
"""

VALUES = [11, 7, 5, 3, 2, 0, 1]


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    from conftest import Kilnd
    path = tmp_path_factory.mktemp("seq") / "kiln.yaml"
    path.write_text(CONFIG)
    k = Kilnd(path)
    k.wait_ready()
    yield k
    assert k.stop() == k.expected_exit, k.output()


def check_example_results(int0, int1, str0):
    """The examples' checks for the non-dyna simple_sequence."""
    assert len(int0) == len(int1) == len(str0) == len(VALUES) + 1
    for i in range(len(int0)):
        assert int0[i][0][0] == (1 if i == 0 else VALUES[i - 1]), (i, int0)
        assert int1[i][0][0] == (101 if i == 0 else -VALUES[i - 1]), (i, int1)
        assert str0[i][0][0] == (21 if i == 0 else -VALUES[i - 1]), (i, str0)


def sync_send(client, mod, results, values, sequence_id, model="simple_sequence"):
    for count, value in enumerate(values, start=1):
        data = np.full(shape=[1, 1], fill_value=value, dtype=np.int32)
        inp = mod.InferInput("INPUT", data.shape, "INT32")
        inp.set_data_from_numpy(data)
        result = client.infer(model_name=model, inputs=[inp],
                              outputs=[mod.InferRequestedOutput("OUTPUT")],
                              sequence_id=sequence_id, sequence_start=(count == 1),
                              sequence_end=(count == len(values)))
        results.append(result.as_numpy("OUTPUT"))


@pytest.mark.parametrize("mod", [grpcclient, httpclient], ids=["grpc", "http"])
def test_sync_example_clients(kilnd, mod):
    client = mod.InferenceServerClient(kilnd.grpc_url if mod is grpcclient else kilnd.http_url)
    int0, int1, str0 = [], [], []
    sync_send(client, mod, int0, [0] + VALUES, 1000)
    sync_send(client, mod, int1, [100] + [-v for v in VALUES], 1001)
    sync_send(client, mod, str0, [20] + [-v for v in VALUES], str(uuid.uuid4()))
    check_example_results(int0, int1, str0)
    wait_for(lambda: kilnd.metric_value("kiln_inference_sequences_active",
                                        model="simple_sequence") == 0, "sequences ended")


def test_stream_example_client(kilnd):
    """The streaming example: three sequences sent back to back on one stream, all in flight
    together, answers matched by request id."""
    completed = queue.Queue()

    def callback(user_data, result, error):
        user_data.put(error if error else result)

    string_id = str(uuid.uuid4())
    with grpcclient.InferenceServerClient(kilnd.grpc_url) as client:
        client.start_stream(callback=partial(callback, completed))
        for sequence_id, values in ((1000, [0] + VALUES), (1001, [100] + [-v for v in VALUES]),
                                    (string_id, [20] + [-v for v in VALUES])):
            for count, value in enumerate(values, start=1):
                data = np.full(shape=[1, 1], fill_value=value, dtype=np.int32)
                inp = grpcclient.InferInput("INPUT", data.shape, "INT32")
                inp.set_data_from_numpy(data)
                client.async_stream_infer(
                    model_name="simple_sequence", inputs=[inp],
                    outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                    request_id=f"{sequence_id}_{count}", sequence_id=sequence_id,
                    sequence_start=(count == 1), sequence_end=(count == len(values)))
        results = {1000: [], 1001: [], string_id: []}
        for _ in range(3 * (len(VALUES) + 1)):
            item = completed.get(timeout=30)
            assert not isinstance(item, InferenceServerException), item
            this_id = item.get_response().id.rsplit("_", 1)[0]
            key = this_id if this_id == string_id else int(this_id)
            results[key].append(item.as_numpy("OUTPUT"))
    # One sequence's requests run in order, so its answers come back in order.
    check_example_results(results[1000], results[1001], results[string_id])


def one(client, mod, model, value, **kwargs):
    data = np.full(shape=[1, 1], fill_value=value, dtype=np.int32)
    inp = mod.InferInput("INPUT", data.shape, "INT32")
    inp.set_data_from_numpy(data)
    return client.infer(model_name=model, inputs=[inp], **kwargs).as_numpy("OUTPUT")[0][0]


@pytest.mark.parametrize("mod", [grpcclient, httpclient], ids=["grpc", "http"])
def test_errors(kilnd, mod):
    client = mod.InferenceServerClient(kilnd.grpc_url if mod is grpcclient else kilnd.http_url)
    with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
        one(client, mod, "simple_sequence", 1)
    with pytest.raises(InferenceServerException,
                       match="sequence 77 to model 'simple_sequence' must specify the START"):
        one(client, mod, "simple_sequence", 1, sequence_id=77)
    with pytest.raises(InferenceServerException, match='sequence "nope" to model'):
        one(client, mod, "simple_sequence", 1, sequence_id="nope", sequence_end=True)
    # The control inputs are the batcher's: a client may not send them.
    data = np.zeros((1, 1), np.int32)
    start = mod.InferInput("START", [1, 1], "INT32")
    start.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException, match="has no input 'START'"):
        client.infer("simple_sequence", [start], sequence_id=5, sequence_start=True)


def test_idle_sequence_is_released(kilnd):
    client = grpcclient.InferenceServerClient(kilnd.grpc_url)
    model = "seq_oldest_idle"
    assert one(client, grpcclient, model, 4, sequence_id=9, sequence_start=True) == 5
    assert one(client, grpcclient, model, 6, sequence_id=9) == 6
    assert kilnd.metric_value("kiln_inference_sequences_active", model=model) == 1
    # 0.3 s without a request releases it; the gauge shows when.
    wait_for(lambda: kilnd.metric_value("kiln_inference_sequences_active", model=model) == 0,
             "the idle sequence released", timeout=10)
    with pytest.raises(InferenceServerException, match="max_sequence_idle_microseconds"):
        one(client, grpcclient, model, 1, sequence_id=9)
    # A new START brings it back.
    assert one(client, grpcclient, model, 2, sequence_id=9, sequence_start=True,
               sequence_end=True) == 3


def test_model_config_shows_sequence_batching(kilnd):
    g = grpcclient.InferenceServerClient(kilnd.grpc_url)
    cfg = g.get_model_config("simple_sequence").config
    assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"
    sb = cfg.sequence_batching
    assert sb.max_sequence_idle_microseconds == 5000000
    assert sb.WhichOneof("strategy_choice") == "direct"
    assert [(c.name, c.control[0].kind, list(c.control[0].int32_false_true))
            for c in sb.control_input] == [("START", 0, [0, 1]), ("READY", 1, [0, 1])]
    assert [i.name for i in cfg.input] == ["INPUT"]
    assert [(t.name, list(t.shape)) for t in g.get_model_metadata("simple_sequence").inputs] == [
        ("INPUT", [-1, 1])]
    h = requests.get(f"http://{kilnd.http_url}/v2/models/seq_oldest_idle/config").json()
    assert h["sequence_batching"]["oldest"]["max_candidate_sequences"] == 4
    # The JSON leaves out default values, CONTROL_SEQUENCE_START (enum 0) among them.
    assert [(c["name"], c["control"][0].get("kind", "CONTROL_SEQUENCE_START"),
             c["control"][0]["int32_false_true"])
            for c in h["sequence_batching"]["control_input"]] == [
        ("START", "CONTROL_SEQUENCE_START", [0, 1]), ("READY", "CONTROL_SEQUENCE_READY", [0, 1])]


def test_load_model_with_triton_style_config(kilnd):
    """load_model(config=...) with the JSON Triton's model-config endpoint returns (int64 as
    strings), and the errors that name the field."""
    g = grpcclient.InferenceServerClient(kilnd.grpc_url)
    config = {"kind": "builtin", "builtin": "simple_sequence", "max_batch_size": 4,
              "sequence_batching": {
                  "max_sequence_idle_microseconds": "1000000",
                  "oldest": {"max_candidate_sequences": 2, "preferred_batch_size": [2]},
                  "control_input": [
                      {"name": "START", "control": [
                          {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
                      {"name": "READY", "control": [
                          {"kind": "CONTROL_SEQUENCE_READY", "int32_false_true": [0, 1]}]}]}}
    g.load_model("seq_loaded", config=json.dumps(config))
    assert g.get_model_config("seq_loaded").config.sequence_batching.oldest \
        .preferred_batch_size == [2]
    assert one(g, grpcclient, "seq_loaded", 41, sequence_id=3, sequence_start=True,
               sequence_end=True) == 42
    bad = json.loads(json.dumps(config))
    bad["sequence_batching"]["control_input"][1]["control"][0]["kind"] = "CONTROL_SEQUENCE_GO"
    with pytest.raises(InferenceServerException,
                       match=r"sequence_batching.control_input\[1\].control\[0\].kind"):
        g.load_model("seq_bad", config=json.dumps(bad))
    bad = json.loads(json.dumps(config))
    bad["sequence_batching"]["control_input"][0]["control"][0]["fp32_false_true"] = [0, 1]
    with pytest.raises(InferenceServerException, match="needs exactly one of int32_false_true"):
        g.load_model("seq_bad", config=json.dumps(bad))
    bad = json.loads(json.dumps(config))
    bad["sequence_batching"]["control_input"][1]["name"] = "GO"
    with pytest.raises(InferenceServerException, match="has no input 'GO'"):
        g.load_model("seq_bad", config=json.dumps(bad))
