"""/metrics: Prometheus text format validated by promtool, with the documented families."""
import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient


def infer_simple(kilnd, n=3):
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    a = np.zeros((1, 16), np.int32)
    for _ in range(n):
        ins = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
               grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        ins[0].set_data_from_numpy(a)
        ins[1].set_data_from_numpy(a)
        c.infer("simple", ins)
    bad = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(Exception):
        c.infer("simple", [bad])


def test_promtool_accepts_the_exposition(kilnd):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (Debian package `prometheus`, installed by "
                    "scripts/install-deps.sh)")
    infer_simple(kilnd)
    text = kilnd.metrics()
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert r.stdout.decode().strip() == "" and r.stderr.decode().strip() == "", \
        r.stdout.decode() + r.stderr.decode()


def test_documented_families_are_present_and_count(kilnd):
    infer_simple(kilnd, n=3)
    text = kilnd.metrics()
    for family in ["kiln_inference_requests_total", "kiln_inference_failures_total",
                   "kiln_inference_count_total", "kiln_inference_executions_total",
                   "kiln_inference_pending_requests", "kiln_inference_queue_duration_seconds",
                   "kiln_inference_compute_duration_seconds",
                   "kiln_inference_request_duration_seconds", "kiln_inference_batch_size",
                   "kiln_build_info", "kiln_server_ready", "kiln_inflight_requests",
                   "kiln_model_ready", "process_cpu_seconds_total",
                   "process_resident_memory_bytes"]:
        assert f"# TYPE {family} " in text, family
    assert kilnd.metric_value("kiln_inference_requests_total", model="simple",
                              outcome="success") == 3
    assert kilnd.metric_value("kiln_inference_failures_total", model="simple",
                              reason="invalid_argument") == 1
    assert kilnd.metric_value("kiln_inference_count_total", model="simple") == 3
    assert kilnd.metric_value("kiln_server_ready") == 1
    assert kilnd.metric_value("process_resident_memory_bytes") > 1e6
