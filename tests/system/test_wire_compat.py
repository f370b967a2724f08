"""Wire compatibility: every message and field Kiln's KServe protos define matches the
descriptors compiled into the stock tritonclient (same names, numbers, types, labels)."""
import os
from pathlib import Path

from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

DESC = Path(os.environ.get("KILN_BUILD_DIR", Path(__file__).resolve().parents[2] / "build")) \
    / "proto" / "kiln_protos.desc"


def ours():
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(DESC.read_bytes())
    return {f.name: f for f in fds.file}


def theirs(module):
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def compare_messages(mine, ref, path=""):
    ref_by_name = {m.name: m for m in ref}
    checked = 0
    for m in mine:
        assert m.name in ref_by_name, f"{path}{m.name} does not exist in Triton's protocol"
        r = ref_by_name[m.name]
        rf = {f.name: f for f in r.field}
        for f in m.field:
            assert f.name in rf, f"{path}{m.name}.{f.name} is not a Triton field"
            g = rf[f.name]
            assert (f.number, f.type, f.label) == (g.number, g.type, g.label), \
                f"{path}{m.name}.{f.name}: ours {(f.number, f.type, f.label)}, Triton's " \
                f"{(g.number, g.type, g.label)}"
            if f.type_name:
                assert f.type_name.split(".")[-1] == g.type_name.split(".")[-1], \
                    f"{path}{m.name}.{f.name} type {f.type_name} vs {g.type_name}"
            checked += 1
        re = {e.name: e for e in r.enum_type}
        for e in m.enum_type:
            assert {v.name: v.number for v in e.value}.items() <= \
                {v.name: v.number for v in re[e.name].value}.items()
        checked += compare_messages(m.nested_type, r.nested_type, f"{path}{m.name}.")
    return checked


def test_service_matches_triton():
    mine = ours()["proto/kserve/grpc_service.proto"]
    ref = theirs(service_pb2)
    assert mine.package == ref.package == "inference"
    ms = {m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
          for m in mine.service[0].method}
    rs = {m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
          for m in ref.service[0].method}
    assert mine.service[0].name == ref.service[0].name == "GRPCInferenceService"
    assert ms == rs
    assert compare_messages(mine.message_type, ref.message_type) > 100


def test_model_config_subset_matches_triton():
    mine = ours()["proto/kserve/model_config.proto"]
    ref = theirs(model_config_pb2)
    assert compare_messages(mine.message_type, ref.message_type) > 40
    ours_enum = {v.name: v.number for v in mine.enum_type[0].value}
    ref_enum = {v.name: v.number for v in ref.enum_type[0].value}
    assert ours_enum.items() <= ref_enum.items()


def test_health_matches_grpcio():
    """grpc/health/v1/health.proto, compiled into kilnd so that reflection can describe gRPC's
    health service, is the protocol every health client speaks (grpcio-health-checking's)."""
    from grpc_health.v1 import health_pb2
    mine = ours()["grpc/health/v1/health.proto"]
    ref = theirs(health_pb2)
    assert mine.package == ref.package == "grpc.health.v1"
    assert compare_messages(mine.message_type, ref.message_type) == 2
    assert {m.name for m in mine.message_type} == {m.name for m in ref.message_type}
    assert [(m.name, m.input_type, m.output_type, m.server_streaming)
            for m in mine.service[0].method] == [
        (m.name, m.input_type, m.output_type, m.server_streaming) for m in ref.service[0].method]
