"""Triton's system shared memory extension (issue 14, item 9) with tritonclient, as Triton's
examples simple_grpc_shm_client.py and simple_http_shm_client.py use it: regions made with
tritonclient.utils.shared_memory, registered, inputs and outputs of the built-in `simple` model
in them, status, unregister; then every error a client can provoke, each naming the region,
with the server still serving afterwards. CUDA shared memory: registering says it is not
supported; unregistering (the examples do it first) is a no-op."""
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.utils import InferenceServerException

INPUT0 = np.arange(16, dtype=np.int32)
INPUT1 = np.ones(16, dtype=np.int32)
NBYTES = INPUT0.nbytes  # 64


def unique_key(what):
    # /dev/shm is shared with every other test run on the machine.
    return f"/kiln_test_{what}_{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["grpc", "http"])
def client(request, kilnd):
    if request.param == "grpc":
        c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    else:
        c = httpclient.InferenceServerClient(kilnd.http_url)
    c.module = grpcclient if request.param == "grpc" else httpclient
    c.protocol = request.param
    yield c
    c.close()


@pytest.fixture
def regions():
    """Creates client-side regions; destroys (unlinks) them at the end."""
    made = []

    def make(name, size, key=None):
        handle = shm.create_shared_memory_region(name, key or unique_key(name), size)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def key_of(handle):
    return handle._shm_key


def code(e):
    """The error's code as the protocol names it: "StatusCode.INVALID_ARGUMENT" or "400"."""
    return str(e.value.status())


def output_meta(result, name, protocol):
    out = result.get_output(name)
    assert out is not None, f"{name} missing from the response"
    if protocol == "grpc":
        params = {k: v.WhichOneof("parameter_choice") and getattr(v, v.WhichOneof(
            "parameter_choice")) for k, v in out.parameters.items()}
        return out.datatype, list(out.shape), params, out
    return out["datatype"], out["shape"], out.get("parameters", {}), out


def simple_shm_request(c, in_name="input_data", out_name="output_data"):
    m = c.module
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(in_name, NBYTES)
    inputs[1].set_shared_memory(in_name, NBYTES, offset=NBYTES)
    if c.protocol == "http":
        outputs = [m.InferRequestedOutput("OUTPUT0", binary_data=True),
                   m.InferRequestedOutput("OUTPUT1", binary_data=True)]
    else:
        outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out_name, NBYTES)
    outputs[1].set_shared_memory(out_name, NBYTES, offset=NBYTES)
    return inputs, outputs


def assert_serves_inline(c):
    m = c.module
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(INPUT0.reshape(1, 16))
    inputs[1].set_data_from_numpy(INPUT1.reshape(1, 16))
    r = c.infer("simple", inputs)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), (INPUT0 + INPUT1).reshape(1, 16))


def test_the_simple_shm_client_example_flow(client, regions):
    c = client
    # To make sure no shared memory regions are registered with the server (as the examples).
    c.unregister_system_shared_memory()
    c.unregister_cuda_shared_memory()
    op = regions("output_data", NBYTES * 2)
    c.register_system_shared_memory("output_data", key_of(op), NBYTES * 2)
    ip = regions("input_data", NBYTES * 2)
    shm.set_shared_memory_region(ip, [INPUT0])
    shm.set_shared_memory_region(ip, [INPUT1], offset=NBYTES)
    c.register_system_shared_memory("input_data", key_of(ip), NBYTES * 2)

    inputs, outputs = simple_shm_request(c)
    result = c.infer("simple", inputs, outputs=outputs)
    dtype, shape, params, _ = output_meta(result, "OUTPUT0", c.protocol)
    assert (dtype, shape) == ("INT32", [1, 16])
    assert params["shared_memory_region"] == "output_data"
    assert params["shared_memory_byte_size"] == NBYTES
    out0 = shm.get_contents_as_numpy(op, utils.triton_to_np_dtype(dtype), shape)
    _, shape1, params1, _ = output_meta(result, "OUTPUT1", c.protocol)
    assert params1["shared_memory_offset"] == NBYTES
    out1 = shm.get_contents_as_numpy(op, np.int32, shape1, offset=NBYTES)
    np.testing.assert_array_equal(out0[0], INPUT0 + INPUT1)
    np.testing.assert_array_equal(out1[0], INPUT0 - INPUT1)
    if c.protocol == "http":
        assert "data" not in result.get_output("OUTPUT0")

    status = c.get_system_shared_memory_status()
    if c.protocol == "grpc":
        got = {name: (r.key, r.offset, r.byte_size) for name, r in status.regions.items()}
    else:
        got = {r["name"]: (r["key"], r["offset"], r["byte_size"]) for r in status}
    assert got == {"input_data": (key_of(ip), 0, NBYTES * 2),
                   "output_data": (key_of(op), 0, NBYTES * 2)}
    one = c.get_system_shared_memory_status("input_data")
    assert len(one.regions if c.protocol == "grpc" else one) == 1

    c.unregister_system_shared_memory("input_data")
    remaining = c.get_system_shared_memory_status()
    assert len(remaining.regions if c.protocol == "grpc" else remaining) == 1
    c.unregister_system_shared_memory()
    remaining = c.get_system_shared_memory_status()
    assert len(remaining.regions if c.protocol == "grpc" else remaining) == 0
    # Unregistered: the next request naming it is refused.
    with pytest.raises(InferenceServerException, match="'input_data' is not registered"):
        c.infer("simple", inputs, outputs=outputs)


def test_identity_mixes_inline_and_shared_memory_tensors_of_one_mib(client, regions):
    c, m = client, client.module
    n = (1 << 20) // 4
    x = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    ip = regions("big_in", x.nbytes)
    op = regions("big_out", x.nbytes + 100)
    shm.set_shared_memory_region(ip, [x])
    c.register_system_shared_memory("big_in", key_of(ip), x.nbytes)
    # Unaligned offset into the object: the server maps around it.
    c.register_system_shared_memory("big_out", key_of(op), x.nbytes, offset=100)
    try:
        # Input in shared memory, output inline.
        i = m.InferInput("INPUT0", [n], "FP32")
        i.set_shared_memory("big_in", x.nbytes)
        r = c.infer("identity_fp32", [i])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
        # Input inline, output in shared memory.
        i = m.InferInput("INPUT0", [n], "FP32")
        i.set_data_from_numpy(x)
        o = m.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory("big_out", x.nbytes)
        c.infer("identity_fp32", [i], outputs=[o])
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(op, np.float32, [n], offset=100), x)
    finally:
        c.unregister_system_shared_memory()


def test_register_errors_name_the_region(client, regions):
    c = client
    r = regions("small", 64)
    c.register_system_shared_memory("small", key_of(r), 64)
    try:
        with pytest.raises(InferenceServerException, match="'small' is already registered") as e:
            c.register_system_shared_memory("small", key_of(r), 64)
        assert code(e) in ("StatusCode.ALREADY_EXISTS", "400")
        missing = unique_key("missing")
        with pytest.raises(InferenceServerException, match=f"cannot open key '{missing}'") as e:
            c.register_system_shared_memory("missing", missing, 64)
        assert code(e) in ("StatusCode.INVALID_ARGUMENT", "400")
        with pytest.raises(InferenceServerException,
                           match="region 'too_big': offset 32 \\+ byte_size 64 is past the end"):
            c.register_system_shared_memory("too_big", key_of(r), 64, offset=32)
        with pytest.raises(InferenceServerException,
                           match="Unable to find system shared memory region: 'nope'") as e:
            c.get_system_shared_memory_status("nope")
        assert code(e) in ("StatusCode.NOT_FOUND", "404")
        c.unregister_system_shared_memory("never_registered")  # not an error, as in Triton
    finally:
        c.unregister_system_shared_memory()
    assert_serves_inline(c)


def test_infer_errors_name_the_region_and_the_server_keeps_serving(client, regions):
    c, m = client, client.module
    ip = regions("in", NBYTES * 2)
    shm.set_shared_memory_region(ip, [INPUT0, INPUT1])
    op = regions("out", NBYTES * 2)
    c.register_system_shared_memory("in", key_of(ip), NBYTES * 2)
    c.register_system_shared_memory("out", key_of(op), NBYTES * 2)
    bad_request = "StatusCode.INVALID_ARGUMENT", "400"

    def expect(match, inputs, outputs=None):
        with pytest.raises(InferenceServerException, match=match) as e:
            c.infer("simple", inputs, outputs=outputs)
        assert code(e) in bad_request, e.value

    try:
        inputs, outputs = simple_shm_request(c, "in", "out")
        # An unknown region.
        inputs[0].set_shared_memory("unknown", NBYTES)
        expect("input 'INPUT0': shared memory region 'unknown' is not registered", inputs)
        # A byte size that does not match the tensor.
        inputs[0].set_shared_memory("in", NBYTES - 4)
        expect("input 'INPUT0': shared_memory_byte_size is 60 \\(shared memory region 'in'\\)",
               inputs)
        # offset + byte_size past the region.
        inputs[0].set_shared_memory("in", NBYTES, offset=NBYTES + 4)
        expect("past the end of shared memory region 'in', which has 128 bytes", inputs)
        # (set_shared_memory with offset 0 keeps an earlier offset: start over.)
        inputs, outputs = simple_shm_request(c, "in", "out")
        # Two outputs into overlapping bytes.
        outputs[1].set_shared_memory("out", NBYTES, offset=NBYTES // 2)
        expect("output 'OUTPUT0' \\(shared memory region 'out'.*overlap", inputs, outputs)
        # An output region too small for the result: found once the model has answered.
        outputs[1].set_shared_memory("out", NBYTES // 2, offset=NBYTES)
        expect("output 'OUTPUT1' has 64 bytes but shared_memory_byte_size is 32 "
               "\\(shared memory region 'out'\\)", inputs, outputs)
        # The same request, right, still works.
        inputs, outputs = simple_shm_request(c, "in", "out")
        c.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(op, np.int32, [16], offset=NBYTES), INPUT0 - INPUT1)
    finally:
        c.unregister_system_shared_memory()
    assert_serves_inline(c)


def test_cuda_shared_memory_says_it_is_not_supported(client):
    c = client
    c.unregister_cuda_shared_memory()  # nothing to unregister: fine
    status = c.get_cuda_shared_memory_status()
    assert len(status.regions if c.protocol == "grpc" else status) == 0
    with pytest.raises(InferenceServerException,
                       match="CUDA shared memory is not supported: no CUDA device") as e:
        # gRPC takes the serialized cudaIpcMemHandle_t, HTTP its base64.
        c.register_cuda_shared_memory("gpu", b"\0" * 64 if c.protocol == "grpc" else "AA==", 0, 64)
    assert code(e) in ("StatusCode.FAILED_PRECONDITION", "400")
    assert_serves_inline(c)


def test_server_metadata_lists_the_extension(kilnd):
    md = requests.get(f"{kilnd.base}/v2", timeout=10).json()
    assert "system_shared_memory" in md["extensions"]
    assert "cuda_shared_memory" not in md["extensions"]


def test_http_register_body_is_checked(kilnd):
    url = f"{kilnd.base}/v2/systemsharedmemory/region/r/register"
    for body, what in [({"offset": 0, "byte_size": 8}, "needs `key`"),
                       ({"key": "/k", "byte_size": -1}, "`byte_size` must be a non-negative"),
                       ({"key": 7, "byte_size": 8}, "`key` must be a string")]:
        r = requests.post(url, json=body, timeout=10)
        assert r.status_code == 400 and what in r.json()["error"], (body, r.text)
    r = requests.post(url, data=b"{", timeout=10)
    assert r.status_code == 400


def test_logging_extension(client):
    """`logging` is listed in the server metadata, so both protocols serve it (HTTP's
    /v2/logging used to answer 404)."""
    c = client
    md = c.get_server_metadata()
    assert "logging" in (md.extensions if c.protocol == "grpc" else md["extensions"])

    def settings(s):
        if c.protocol == "http":
            return s
        return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in s.settings.items()}

    now = settings(c.get_log_settings())
    assert now["log_info"] is True and now["log_verbose_level"] == 0, now
    assert now["log_file"] == "" and now["log_format"] == "text"
    changed = settings(c.update_log_settings({"log_verbose_level": 1}))
    assert changed["log_verbose_level"] == 1
    # Echoing what was read back is accepted (log_format and log_file unchanged).
    restored = settings(c.update_log_settings({**now}))
    assert restored == now
    with pytest.raises(InferenceServerException, match="unknown log setting 'log_colour'"):
        c.update_log_settings({"log_colour": True})
    with pytest.raises(InferenceServerException, match="'log_format' cannot be changed"):
        c.update_log_settings({"log_format": "ISO8601"})
