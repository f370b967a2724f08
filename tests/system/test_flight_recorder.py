"""The flight recorder and the watchdog (docs/operations.md): GET /debug/flight_recorder after
chat completions shows steps with their composition and the requests' state changes; SIGUSR1
writes a dump under storage_dir/flight/; a SIGUSR1 storm leaves kilnd serving and the
directory bounded; the watchdog names a batch of `sleep_us` that sleeps past
watchdog_seconds, with its request, and counts it; `enabled: false` turns the route off.
"""
import json
import os
import signal
from pathlib import Path

import requests
from openai import OpenAI

from conftest import LLM_NAME, TENSOR_MODELS, start_llm_kilnd, wait_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def flight_files(k):
    d = Path(k.storage) / "flight"
    return sorted(p for p in d.glob("flight-*.json")) if d.is_dir() else []


def sleep_infer(k, us, request_id):
    body = {"id": request_id,
            "inputs": [{"name": "SLEEP_US", "datatype": "INT32", "shape": [1, 1], "data": [us]}]}
    return requests.post(f"{k.base}/v2/models/sleep_us/infer", json=body, timeout=60)


def test_llm_steps_and_request_states_at_the_route(tmp_path_factory):
    k = start_llm_kilnd(tmp_path_factory, "flight")
    try:
        client = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
        ids = []
        for _ in range(2):
            r = client.chat.completions.create(model=LLM_NAME, messages=QUESTION, max_tokens=4,
                                               temperature=0)
            ids.append(r.id)
        # A response reaches the client when its last token is emitted, which can be before
        # that step's step_end (and the request's "finished") is recorded: wait for the ring to
        # show no step in progress rather than reading it once.
        def settled():
            resp = requests.get(f"{k.base}/debug/flight_recorder", timeout=10)
            assert resp.status_code == 200, resp.text
            doc = resp.json()
            ring = doc["models"][0]
            kinds = [e["kind"] for e in ring["events"]]
            done = (ring["in_progress"] == [] and
                    kinds.count("step_begin") == kinds.count("step_end"))
            return doc if done else None
        doc = wait_for(settled, "the last step's step_end in the flight recorder")
        assert doc["reason"] == "http" and doc["entries"] == 4096
        [ring] = doc["models"]
        assert ring["model"] == LLM_NAME and ring["kind"] == "llm"
        events = ring["events"]
        times = [e["unix_ns"] for e in events]
        assert times == sorted(times), "events oldest first"
        begins = [e for e in events if e["kind"] == "step_begin"]
        ends = [e for e in events if e["kind"] == "step_end"]
        assert begins and len(begins) == len(ends)
        # The first step of a request prefills its prompt; later ones decode one token each.
        assert any(e["prefill_tokens"] > 10 and e["decode_tokens"] == 0 for e in begins)
        assert any(e["decode_tokens"] == 1 and e["seqs"] == 1 for e in begins)
        assert all(e["kv_blocks_total"] > 0 for e in begins)
        end = ends[-1]
        assert end["ok"] and end["mode"] in ("captured", "direct")
        assert end["launches"] is None or end["launches"] > 0
        assert end["run_ms"] > 0 and end["total_ms"] >= end["run_ms"]
        for rid in ids:
            states = [e["state"] for e in events if e["kind"] == "request" and e["request"] == rid]
            assert states == ["queued", "admitted", "finished"], (rid, states)
        assert ring["in_progress"] == []
        # One model by name; an unknown one is a clear 404.
        one = requests.get(f"{k.base}/debug/flight_recorder?model={LLM_NAME}", timeout=10).json()
        assert [m["model"] for m in one["models"]] == [LLM_NAME]
        missing = requests.get(f"{k.base}/debug/flight_recorder?model=nope", timeout=10)
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
    finally:
        assert k.stop() == 0, k.output()


def test_sigusr1_writes_a_dump(start_kilnd):
    k = start_kilnd(TENSOR_MODELS)
    assert sleep_infer(k, 1000, "before-dump").status_code == 200
    k.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: flight_files(k), "a dump under storage_dir/flight/")
    doc = json.loads(flight_files(k)[0].read_text())
    assert doc["reason"] == "sigusr1"
    rings = {m["model"]: m for m in doc["models"]}
    assert set(rings) == {"simple", "identity_fp32", "sleep_us"}
    events = rings["sleep_us"]["events"]
    assert [e["kind"] for e in events] == ["request", "request", "batch_begin", "batch_end",
                                           "request"]
    assert [e.get("state") for e in events if e["kind"] == "request"] == [
        "queued", "running", "finished"]
    assert all(e.get("request", "before-dump") == "before-dump" for e in events)
    assert events[3]["requests"] == 1 and events[3]["ok"]
    # No temporary file is left behind.
    assert not [p for p in (Path(k.storage) / "flight").iterdir() if p.name.startswith(".tmp")]


def test_sigusr1_storm_keeps_serving_and_the_directory_bounded(start_kilnd):
    k = start_kilnd(TENSOR_MODELS)
    for _ in range(200):
        os.kill(k.proc.pid, signal.SIGUSR1)
    assert sleep_infer(k, 1000, "during-storm").status_code == 200
    wait_for(lambda: k.metric_value("kiln_flight_dumps_total") >= 1, "the storm's dumps")
    # More signals than the limit, spaced so that each gets its own dump.
    for i in range(25):
        before = k.metric_value("kiln_flight_dumps_total")
        os.kill(k.proc.pid, signal.SIGUSR1)
        wait_for(lambda: k.metric_value("kiln_flight_dumps_total") > before, f"dump {i}")
    assert len(flight_files(k)) == 20  # FlightService::kKeepFiles
    assert sleep_infer(k, 1000, "after-storm").status_code == 200
    assert requests.get(f"{k.base}/v2/health/ready", timeout=5).status_code == 200


def test_watchdog_names_the_stuck_batch_and_its_request(start_kilnd):
    k = start_kilnd(TENSOR_MODELS, overrides=["observability.watchdog_seconds=0.5"])
    import threading
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("r", sleep_infer(k, 4_000_000, "stuck-request")))
    t.start()
    try:
        wait_for(lambda: k.metric_value("kiln_watchdog_fires_total", model="sleep_us") == 1,
                 "the watchdog to fire", timeout=10)
        # Other models keep serving meanwhile.
        body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16],
                            "data": list(range(16))},
                           {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16],
                            "data": [1] * 16}]}
        assert requests.post(f"{k.base}/v2/models/simple/infer", json=body,
                             timeout=10).status_code == 200
        wait_for(lambda: any("watchdog" in p.name for p in flight_files(k)), "the watchdog dump")
        [dump] = [p for p in flight_files(k) if "watchdog" in p.name]
        doc = json.loads(dump.read_text())
        assert doc["reason"] == "watchdog"
        [stuck] = doc["stuck"]
        assert stuck["model"] == "sleep_us" and stuck["kind"] == "batch"
        assert stuck["requests"] == ["stuck-request"] and stuck["seconds"] >= 0.5
        ring = {m["model"]: m for m in doc["models"]}["sleep_us"]
        [work] = ring["in_progress"]
        assert work["id"] == stuck["id"] and work["requests"] == ["stuck-request"]
        assert "stuck-request" in k.output() and "watchdog" in k.output()
    finally:
        t.join()
    assert result["r"].status_code == 200
    # Once per stuck batch, not every tick.
    assert k.metric_value("kiln_watchdog_fires_total", model="sleep_us") == 1


def test_disabled_recorder_turns_the_route_off(start_kilnd):
    k = start_kilnd(TENSOR_MODELS, overrides=["observability.flight_recorder.enabled=false"])
    assert sleep_infer(k, 1000, "unrecorded").status_code == 200
    resp = requests.get(f"{k.base}/debug/flight_recorder", timeout=5)
    assert resp.status_code == 404
    assert "observability.flight_recorder.enabled" in resp.json()["error"]
    # SIGUSR1 writes nothing either.
    k.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: "flight recorder dump (sigusr1) not written" in k.output(), "the warning")
    assert flight_files(k) == []
