"""Bad input gets a clear error naming the problem, and the daemon keeps serving everyone
else: after every bad request, a good one still succeeds."""
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc


@pytest.fixture
def stub(kilnd):
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(
        kilnd.grpc_url, options=[("grpc.max_send_message_length", 256 << 20)]))


def simple_request(**over):
    req = service_pb2.ModelInferRequest(model_name=over.get("model", "simple"))
    if "version" in over:
        req.model_version = over["version"]
    for name in over.get("names", ["INPUT0", "INPUT1"]):
        req.inputs.add(name=name, datatype=over.get("datatype", "INT32"),
                       shape=over.get("shape", [1, 16]))
        req.raw_input_contents.append(over.get("raw", np.arange(16, dtype=np.int32).tobytes()))
    return req


def assert_error(stub, req, code, *fragments):
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req)
    assert e.value.code() == code, e.value.details()
    for f in fragments:
        assert f in e.value.details(), e.value.details()
    # The daemon still serves a good request.
    good = stub.ModelInfer(simple_request())
    assert np.frombuffer(good.raw_output_contents[0], np.int32)[5] == 10


def test_wrong_datatype(stub):
    assert_error(stub, simple_request(datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT,
                 "input 'INPUT0' has datatype FP32 but model 'simple' expects INT32")


def test_shape_mismatch(stub):
    assert_error(stub, simple_request(shape=[1, 8], raw=bytes(32)),
                 grpc.StatusCode.INVALID_ARGUMENT, "has shape [1, 8]", "expects [-1, 16]")


def test_batch_over_max(stub):
    assert_error(stub, simple_request(shape=[9, 16], raw=bytes(9 * 64)),
                 grpc.StatusCode.INVALID_ARGUMENT, "batch size 9", "max_batch_size")


def test_missing_input(stub):
    assert_error(stub, simple_request(names=["INPUT0"]), grpc.StatusCode.INVALID_ARGUMENT,
                 "missing input 'INPUT1'")


def test_unknown_model(stub):
    assert_error(stub, simple_request(model="nope"), grpc.StatusCode.NOT_FOUND,
                 "Request for unknown model: 'nope' is not found")


def test_unknown_version(stub):
    assert_error(stub, simple_request(version="7"), grpc.StatusCode.NOT_FOUND,
                 "has no version '7'")


def test_raw_contents_wrong_byte_size(stub):
    assert_error(stub, simple_request(raw=bytes(63)), grpc.StatusCode.INVALID_ARGUMENT,
                 "has 63 bytes of contents but shape [1, 16] of INT32 needs 64")


def test_raw_and_typed_together(stub):
    req = simple_request()
    req.inputs[0].contents.int_contents.extend(range(16))
    assert_error(stub, req, grpc.StatusCode.INVALID_ARGUMENT, "also uses raw_input_contents")


def test_oversized_message(stub, kilnd):
    # Default server.grpc.max_message_bytes is 64 MiB.
    req = service_pb2.ModelInferRequest(model_name="identity_fp32")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[20 << 20])
    req.raw_input_contents.append(bytes(80 << 20))
    assert_error(stub, req, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.mark.parametrize("key,value,fragment", [
    ("timeout", -1, "'timeout' is -1"),
    ("timeout", 10**13, "the maximum is 3600000000"),
    ("priority", -3, "'priority' is -3"),
    ("priority", 99, "priority 99 is out of range"),
])
def test_absurd_timeout_or_priority(stub, key, value, fragment):
    req = service_pb2.ModelInferRequest(model_name="sleep_us")
    req.inputs.add(name="SLEEP_US", datatype="INT32", shape=[1, 1])
    req.raw_input_contents.append(np.array([1], np.int32).tobytes())
    req.parameters[key].int64_param = value
    assert_error(stub, req, grpc.StatusCode.INVALID_ARGUMENT, fragment)


def test_unknown_datatype_string(stub):
    assert_error(stub, simple_request(datatype="INT33"), grpc.StatusCode.INVALID_ARGUMENT,
                 "unknown datatype 'INT33'")


def test_garbage_on_the_wire_does_not_hurt(kilnd, stub):
    import socket
    with socket.create_connection(("127.0.0.1", kilnd.grpc_port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 16)
        s.settimeout(2)
        try:
            s.recv(1024)
        except OSError:
            pass
    good = stub.ModelInfer(simple_request())
    assert len(good.raw_output_contents) == 2


def test_tritonclient_reports_the_server_message(kilnd):
    from tritonclient.utils import InferenceServerException
    c = grpcclient.InferenceServerClient(kilnd.grpc_url)
    x = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    x.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException, match="missing input 'INPUT1'"):
        c.infer("simple", [x])
