"""KServe's own Python SDK (kserve, tests/requirements.txt) against kilnd: the REST and gRPC
inference clients' health checks and a v2 inference on `simple`, JSON and binary."""
import asyncio

import numpy as np
import pytest

kserve = pytest.importorskip("kserve", reason="kserve is in tests/requirements.txt")


def simple_request(binary, request_id):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [kserve.InferInput("INPUT0", [1, 16], "INT32"),
              kserve.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return a, b, kserve.InferRequest(model_name="simple", infer_inputs=inputs,
                                     request_id=request_id)


def check_simple(response, a, b, request_id):
    assert response.id == request_id
    assert response.model_name == "simple"
    outputs = {o.name: o.as_numpy() for o in response.outputs}
    assert np.array_equal(outputs["OUTPUT0"].reshape(1, 16), a + b)
    assert np.array_equal(outputs["OUTPUT1"].reshape(1, 16), a - b)


def test_rest_client(kilnd):
    async def run():
        client = kserve.InferenceRESTClient(config=kserve.RESTConfig(protocol="v2"))
        try:
            assert await client.is_server_live(kilnd.base)
            assert await client.is_server_ready(kilnd.base)
            assert await client.is_model_ready(kilnd.base, "simple")
            for binary in (False, True):
                a, b, req = simple_request(binary, f"rest-{binary}")
                check_simple(await client.infer(kilnd.base, req, model_name="simple"), a, b,
                             f"rest-{binary}")
        finally:
            await client.close()

    asyncio.run(run())


def test_grpc_client(kilnd):
    async def run():
        client = kserve.InferenceGRPCClient(url=kilnd.grpc_url)
        try:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert await client.is_model_ready("simple")
            a, b, req = simple_request(True, "grpc-1")
            check_simple(await client.infer(req), a, b, "grpc-1")
        finally:
            await client.close()

    asyncio.run(run())


def test_rest_client_unknown_model_is_an_error(kilnd):
    async def run():
        client = kserve.InferenceRESTClient(config=kserve.RESTConfig(protocol="v2"))
        try:
            _, _, req = simple_request(False, "x")
            with pytest.raises(Exception) as e:
                await client.infer(kilnd.base, req, model_name="no_such_model")
            assert "404" in str(e.value), str(e.value)
        finally:
            await client.close()

    asyncio.run(run())
