"""TLS on the gRPC, HTTP and metrics ports (server.tls): real clients (tritonclient over gRPC
and HTTP, grpcio, the openai SDK, requests, raw sockets) against kilnd with certificates made
here by the `openssl` CLI; plaintext to a TLS port fails cleanly; mTLS; bad files stop
start-up with a clear message; SIGHUP swaps the certificate for new connections without
dropping open ones."""
import hashlib
import http.client
import shutil
import signal
import socket
import ssl
import subprocess
import time

import grpc
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import (LLM_NAME, TENSOR_MODELS, Kilnd, default_model_path, serving,
                      wait_for)


# ---- certificates -------------------------------------------------------------------------

def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_key(d, name):
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", f"{name}.key", cwd=d)


def sign(d, name, cn, serial, ext, days="2"):
    """A certificate for `name`.key signed by the test CA, with `ext` (X.509 v3 lines)."""
    openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}", "-out", f"{name}.csr",
            cwd=d)
    (d / f"{name}.ext").write_text(ext)
    # `-days -1` makes a certificate whose notAfter is a day ago: expired.
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-set_serial", serial, "-days", days, "-extfile", f"{name}.ext", "-out",
            f"{name}.crt", cwd=d)


class Certs:
    def __init__(self, d):
        self.dir = d
        make_key(d, "ca")
        openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=Kiln test CA",
                "-days", "2", "-out", "ca.crt", cwd=d)
        server_ext = ("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                      "extendedKeyUsage=serverAuth\n")
        for name, serial in (("server", "0x1001"), ("server2", "0x2002"),
                             ("expired", "0x3003")):
            make_key(d, name)
            sign(d, name, "kilnd", serial, server_ext, days="-1" if name == "expired" else "2")
        make_key(d, "client")
        sign(d, "client", "kiln-test-client", "0x4004", "extendedKeyUsage=clientAuth\n")
        make_key(d, "other")  # matches no certificate
        self.ca = str(d / "ca.crt")
        self.client = (str(d / "client.crt"), str(d / "client.key"))

    def path(self, name):
        return str(self.dir / name)

    def fingerprint(self, name):
        der = ssl.PEM_cert_to_DER_cert((self.dir / f"{name}.crt").read_text())
        return hashlib.sha256(der).hexdigest()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("tls"))


def served_fingerprint(port, certs, client_cert=False):
    """SHA-256 of the certificate a new TLS connection to `port` is served."""
    ctx = ssl.create_default_context(cafile=certs.ca)
    if client_cert:
        ctx.load_cert_chain(*certs.client)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return hashlib.sha256(s.getpeercert(binary_form=True)).hexdigest()


# ---- kilnd over TLS -----------------------------------------------------------------------

class TlsKilnd(Kilnd):
    """kilnd whose HTTP port serves TLS: `base` is https and readiness is checked over it."""

    def __init__(self, *args, certs, client_cert=False, **kwargs):
        self.verify = certs.ca
        self.cert = certs.client if client_cert else None
        self.requests_kwargs = {"verify": self.verify, "cert": self.cert}
        super().__init__(*args, **kwargs)

    @property
    def base(self):
        return f"https://127.0.0.1:{self.http_port}"

    def get(self, path, **kwargs):
        return requests.get(f"{self.base}{path}", timeout=kwargs.pop("timeout", 5),
                            **self.requests_kwargs, **kwargs)


def tls_overrides(certs, cert="server", key="server", mtls=False, metrics=False):
    o = [f"server.tls.cert_file={certs.path(cert + '.crt')}",
         f"server.tls.key_file={certs.path(key + '.key')}"]
    if mtls:
        o.append(f"server.tls.client_ca_file={certs.ca}")
    if metrics:
        o.append("server.tls.metrics=true")
    return o


@pytest.fixture
def start_tls(start_kilnd, certs):
    def start(overrides, client_cert=False, wait=True):
        return start_kilnd(TENSOR_MODELS, overrides, wait=wait, cls=TlsKilnd, certs=certs,
                           client_cert=client_cert)
    return start


@pytest.fixture(scope="module")
def llm_tls(tmp_path_factory, certs):
    """One kilnd with TLS serving the default model and the tensor models."""
    config = tmp_path_factory.mktemp("llm_tls") / "kiln.yaml"
    config.write_text(f"""
server:
  shutdown_grace_seconds: 60
{TENSOR_MODELS}
  - name: {LLM_NAME}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
    scheduler: {{max_num_seqs: 4, max_queue_size: 16}}
""")
    with serving(TlsKilnd(config, tls_overrides(certs), certs=certs)) as k:
        yield k


def simple_inputs(module):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a + b


def health(channel):
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10).status


# ---- clients over TLS ---------------------------------------------------------------------

def test_tritonclient_grpc_and_http_over_tls(llm_tls, certs):
    c = grpcclient.InferenceServerClient(llm_tls.grpc_url, ssl=True,
                                         root_certificates=certs.ca)
    inputs, want = simple_inputs(grpcclient)
    np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), want)
    h = httpclient.InferenceServerClient(llm_tls.http_url, ssl=True,
                                         ssl_options={"ca_certs": certs.ca})
    assert h.is_server_ready()
    inputs, want = simple_inputs(httpclient)
    np.testing.assert_array_equal(h.infer("simple", inputs).as_numpy("OUTPUT0"), want)
    h.close()
    # Without server.tls.metrics the metrics port stays plaintext.
    assert "kiln_server_ready 1" in llm_tls.metrics()


def test_grpcio_over_tls(llm_tls, certs):
    creds = grpc.ssl_channel_credentials(open(certs.ca, "rb").read())
    with grpc.secure_channel(llm_tls.grpc_url, creds) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    # A client that does not trust the server's CA is refused by its own TLS check.
    with grpc.secure_channel(llm_tls.grpc_url, grpc.ssl_channel_credentials()) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_openai_sdk_over_tls(llm_tls, certs):
    client = openai.OpenAI(base_url=f"{llm_tls.base}/v1", api_key="unused", max_retries=0,
                           timeout=120,
                           http_client=openai.DefaultHttpxClient(
                               verify=ssl.create_default_context(cafile=certs.ca)))
    r = client.chat.completions.create(model=LLM_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    # Streamed (SSE) over TLS as well.
    chunks = list(client.chat.completions.create(
        model=LLM_NAME, max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "Hi"}]))
    assert chunks and chunks[-1].choices[0].finish_reason is not None


def test_plaintext_to_tls_ports_fails_cleanly_and_kilnd_keeps_serving(llm_tls, certs):
    # requests over http:// to the TLS HTTP port: a connection error, not a hang.
    t0 = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{llm_tls.http_url}/v2/health/ready", timeout=10)
    assert time.monotonic() - t0 < 5
    # A raw plaintext request is closed promptly (EOF or reset), without an HTTP answer.
    with socket.create_connection(("127.0.0.1", llm_tls.http_port), timeout=5) as s:
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
        assert not data.startswith(b"HTTP/"), data
    # Plaintext gRPC to the TLS gRPC port.
    with grpc.insecure_channel(llm_tls.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Still serving over TLS on both ports.
    assert llm_tls.get("/v2/health/ready").status_code == 200
    with grpc.secure_channel(llm_tls.grpc_url,
                             grpc.ssl_channel_credentials(open(certs.ca, "rb").read())) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    assert "TLS handshake failed" not in llm_tls.output()  # debug level: not logged at info


# ---- mTLS ---------------------------------------------------------------------------------

def test_mtls_requires_a_client_certificate_on_every_port(start_tls, certs):
    k = start_tls(tls_overrides(certs, mtls=True, metrics=True), client_cert=True)
    base = f"https://127.0.0.1:{k.http_port}"
    with pytest.raises(requests.ConnectionError):  # an SSLError, or a reset after the handshake
        requests.get(f"{base}/v2/health/ready", verify=certs.ca, timeout=5)
    assert requests.get(f"{base}/v2/health/ready", verify=certs.ca, cert=certs.client,
                        timeout=5).status_code == 200
    # The metrics port too (server.tls.metrics): TLS with the client certificate, nothing else.
    metrics = f"127.0.0.1:{k.metrics_port}/metrics"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{metrics}", timeout=5)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"https://{metrics}", verify=certs.ca, timeout=5)
    r = requests.get(f"https://{metrics}", verify=certs.ca, cert=certs.client, timeout=5)
    assert "kiln_server_ready 1" in r.text

    ca = open(certs.ca, "rb").read()
    with grpc.secure_channel(k.grpc_url, grpc.ssl_channel_credentials(ca)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    key, chain = open(certs.client[1], "rb").read(), open(certs.client[0], "rb").read()
    with grpc.secure_channel(k.grpc_url, grpc.ssl_channel_credentials(ca, key, chain)) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    c = grpcclient.InferenceServerClient(k.grpc_url, ssl=True, root_certificates=certs.ca,
                                         private_key=certs.client[1],
                                         certificate_chain=certs.client[0])
    inputs, want = simple_inputs(grpcclient)
    np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), want)
    h = httpclient.InferenceServerClient(
        k.http_url, ssl=True,
        ssl_options={"ca_certs": certs.ca, "certfile": certs.client[0],
                     "keyfile": certs.client[1]})
    inputs, want = simple_inputs(httpclient)
    np.testing.assert_array_equal(h.infer("simple", inputs).as_numpy("OUTPUT0"), want)
    h.close()


# ---- bad files ----------------------------------------------------------------------------

@pytest.mark.parametrize("cert,key,message", [
    ("expired", "expired", "server.tls.cert_file: {dir}/expired.crt expired on "),
    ("server", "other", "server.tls.key_file: {dir}/other.key does not match the certificate "
                        "in server.tls.cert_file ({dir}/server.crt)"),
    ("missing", "server", "server.tls.cert_file: cannot read {dir}/missing.crt: "
                          "No such file or directory"),
])
def test_bad_tls_files_stop_start_up_with_a_clear_error(start_tls, certs, cert, key, message):
    k = start_tls(tls_overrides(certs, cert=cert, key=key), wait=False)
    k.expected_exit = 1
    assert k.proc.wait(timeout=30) == 1
    assert message.format(dir=certs.dir) in k.output()
    assert "start-up failed" in k.output()


def test_client_ca_that_is_not_a_certificate_is_a_start_up_error(start_tls, certs):
    k = start_tls(tls_overrides(certs) + [f"server.tls.client_ca_file={certs.path('ca.key')}"],
                  wait=False)
    k.expected_exit = 1
    assert k.proc.wait(timeout=30) == 1
    assert f"server.tls.client_ca_file: {certs.path('ca.key')} holds no PEM certificate" in \
        k.output()


# ---- reload on SIGHUP ---------------------------------------------------------------------

def test_sighup_reloads_the_certificate_without_dropping_open_connections(start_tls, certs,
                                                                          tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(certs.path("server.crt"), live / "tls.crt")
    shutil.copy(certs.path("server.key"), live / "tls.key")
    k = start_tls([f"server.tls.cert_file={live / 'tls.crt'}",
                   f"server.tls.key_file={live / 'tls.key'}"])
    old, new = certs.fingerprint("server"), certs.fingerprint("server2")
    assert served_fingerprint(k.http_port, certs) == old
    assert served_fingerprint(k.grpc_port, certs) == old

    # Open connections: a keep-alive HTTPS connection, and a gRPC channel with a call in flight.
    conn = http.client.HTTPSConnection("127.0.0.1", k.http_port, timeout=5,
                                       context=ssl.create_default_context(cafile=certs.ca))

    def ready_on_conn():
        conn.request("GET", "/v2/health/ready")
        r = conn.getresponse()
        r.read()
        return r.status

    assert ready_on_conn() == 200
    sock = conn.sock
    channel = grpc.secure_channel(k.grpc_url,
                                  grpc.ssl_channel_credentials(open(certs.ca, "rb").read()))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    req = service_pb2.ModelInferRequest(model_name="sleep_us")
    req.inputs.add(name="SLEEP_US", datatype="INT32", shape=[1, 1])
    req.raw_input_contents.append(np.array([1_500_000], np.int32).tobytes())
    in_flight = stub.ModelInfer.future(req, timeout=30)
    wait_for(lambda: k.metric_value("kiln_inflight_requests") == 1, "the call to be admitted")

    shutil.copy(certs.path("server2.crt"), live / "tls.crt")
    shutil.copy(certs.path("server2.key"), live / "tls.key")
    k.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "TLS certificates reloaded" in k.output(), "the reload to be logged")
    # New connections get the new certificate (gRPC within its watcher's 1 s interval).
    wait_for(lambda: served_fingerprint(k.http_port, certs) == new, "HTTP to serve the new cert")
    wait_for(lambda: served_fingerprint(k.grpc_port, certs) == new, "gRPC to serve the new cert",
             timeout=10)
    # The open ones were not dropped: the call in flight completes, the channel goes on, and
    # the keep-alive session answers on the same socket, still with the old certificate.
    r = in_flight.result(timeout=30)
    assert np.frombuffer(r.raw_output_contents[0], np.int32)[0] == 1_500_000
    assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
    assert ready_on_conn() == 200
    assert conn.sock is sock  # the same connection, not a new one
    assert hashlib.sha256(sock.getpeercert(binary_form=True)).hexdigest() == old
    conn.close()
    channel.close()

    # A failed reload (a key that does not match) keeps the certificate in use and says why.
    shutil.copy(certs.path("other.key"), live / "tls.key")
    k.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed" in k.output(), "the failed reload to be logged")
    assert (f"server.tls.key_file: {live / 'tls.key'} does not match the certificate"
            in k.output())
    assert served_fingerprint(k.http_port, certs) == new
    assert served_fingerprint(k.grpc_port, certs) == new
    assert k.get("/v2/health/ready").status_code == 200
