"""Shared fixtures for system tests: start a real kilnd on free loopback ports.

Tests get `kilnd` (the default embedded config) or build their own with `start_kilnd`.
Every daemon is stopped with SIGTERM at teardown and must exit cleanly (code 0) unless the
test said otherwise; its log is printed when a test fails.
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

KILND = os.environ.get("KILND") or str(
    Path(__file__).resolve().parents[2] / "build" / "server" / "kilnd")


# The kernel cache of every test daemon: kilnd's own default is <storage_dir>/cache, and each
# test daemon has a storage directory of its own, so without this every start would compile its
# kernels afresh. One shared directory, as the kernel cache is made to be (content-keyed,
# safe between processes); test_cli_config.py checks the storage default by unsetting it.
KERNEL_CACHE = os.environ.get("KILN_CACHE_DIR") or str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln")


def wait_for(predicate, what="the condition", timeout=30):
    """Polls observable server state (metrics, health, statistics) until `predicate()` holds,
    so tests order themselves by what the server shows, never by sleeping. Fails naming
    `what` after `timeout` seconds; otherwise returns the predicate's (truthy) value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port():
    return free_ports(1)[0]


def free_ports(n):
    """n distinct free ports: the sockets stay bound until all are chosen (one at a time, the
    kernel may hand out a just-closed port again, and two servers of one daemon collide)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Kilnd:
    # Extra arguments of the readiness check's requests.get (TLS: `verify`, `cert`).
    requests_kwargs = {}

    def __init__(self, config_path=None, overrides=(), args=(), env=None):
        self.grpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.log = tempfile.NamedTemporaryFile(prefix="kilnd-", suffix=".log", delete=False)
        cmd = [KILND]
        if config_path:
            cmd += ["--config", str(config_path)]
        # Each daemon its own storage (the fine-tuning store), unless the test chose one (in
        # its config or overrides, e.g. to restart on it): never the repository's .kiln,
        # which `make run` uses.
        storage = []
        chosen = any(o.startswith("server.storage_dir=") for o in overrides) or (
            config_path and "storage_dir:" in Path(config_path).read_text())
        if not chosen:
            self.storage = tempfile.mkdtemp(prefix="kilnd-storage-")
            storage = [f"server.storage_dir={self.storage}"]
        for o in [f"server.grpc.address=127.0.0.1:{self.grpc_port}",
                  f"server.http.address=127.0.0.1:{self.http_port}",
                  f"server.metrics.address=127.0.0.1:{self.metrics_port}", *storage, *overrides]:
            cmd += ["--set", o]
        cmd += list(args)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "KILN_CACHE_DIR": KERNEL_CACHE,
                                          **(env or {})})
        self.expected_exit = 0

    @property
    def grpc_url(self):
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self):
        return f"127.0.0.1:{self.http_port}"

    @property
    def base(self):
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kilnd exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if requests.get(f"{self.base}/v2/health/ready", timeout=1,
                                **self.requests_kwargs).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"kilnd not ready after {timeout}s:\n{self.output()}")

    def output(self):
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def metrics(self):
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def metric_value(self, name, **labels):
        """The value of one sample from /metrics (0.0 if absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == name and not want or key == f"{name}{{{want}}}":
                return float(value)
        return 0.0

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        if getattr(self, "storage", None):
            shutil.rmtree(self.storage, ignore_errors=True)
        return self.proc.returncode


# The default model (SmolLM2-135M-Instruct), fetched by the repository's script if absent.
LLM_NAME = "smollm2"


def default_model_path():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([str(root / "scripts" / "fetch-default-model.sh")], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    return str((root / out.strip().splitlines()[-1]).resolve())


def ready(k, timeout=300):
    """`k` (a started Kilnd) once it is ready; if it never is, it is stopped and the error
    raised. The caller stops it."""
    try:
        k.wait_ready(timeout=timeout)
    except Exception:
        k.stop()
        raise
    return k


@contextlib.contextmanager
def serving(k, timeout=300):
    """For a module-scoped fixture: yields `k` (a started Kilnd) once ready, and stops it at
    the end; it must exit 0 (its log is printed otherwise)."""
    try:
        k.wait_ready(timeout=timeout)
        yield k
    finally:
        code = k.stop()
        if code != 0:
            print(f"---- kilnd log ({' '.join(k.cmd)}) ----\n{k.output()}")
        assert code == 0, f"kilnd exited with {code}"


def start_llm_kilnd(tmp_path_factory, name, server="",
                    scheduler="max_num_seqs: 8, max_queue_size: 64", model="", overrides=()):
    """A ready kilnd serving the default model as LLM_NAME (context 2048); `server` is extra
    YAML under `server:`, `model` extra keys of the model entry, `overrides` --set arguments.
    The caller stops it."""
    config = tmp_path_factory.mktemp(name) / "kiln.yaml"
    config.write_text(f"""
server:
  shutdown_grace_seconds: 60
{server}
models:
  - name: {LLM_NAME}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
    scheduler: {{{scheduler}}}
{model}
""")
    return ready(Kilnd(config, overrides))


@pytest.fixture
def start_kilnd(request, tmp_path):
    started = []

    def start(config_text=None, overrides=(), args=(), wait=True, env=None, cls=None, **kwargs):
        """`cls` (a Kilnd subclass) and `kwargs` (its own arguments) for special daemons."""
        path = None
        if config_text is not None:
            path = tmp_path / f"kiln-{len(started)}.yaml"
            path.write_text(config_text)
        k = (cls or Kilnd)(path, overrides, args, env, **kwargs)
        started.append(k)
        if wait:
            k.wait_ready()
        return k

    yield start
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else True
    for k in started:
        code = k.stop()
        if failed or code != k.expected_exit:
            print(f"---- kilnd log ({' '.join(k.cmd)}) ----\n{k.output()}")
        assert code == k.expected_exit, f"kilnd exited with {code}, expected {k.expected_exit}"


# The built-in tensor models, as the default configuration declares them; system tests of the
# tensor path use this rather than the default file so that they do not depend on which LLM
# the default configuration serves.
TENSOR_MODELS = """
models:
  - name: simple
    kind: builtin
    builtin: simple
    max_batch_size: 8
    dynamic_batching: {max_queue_delay_microseconds: 0}
  - name: identity_fp32
    kind: builtin
    builtin: identity_fp32
    max_batch_size: 0
  - name: sleep_us
    kind: builtin
    builtin: sleep_us
    max_batch_size: 16
    dynamic_batching:
      max_queue_delay_microseconds: 1000
      priority_levels: 2
      default_priority_level: 2
      default_queue_policy: {allow_timeout_override: true, max_queue_size: 1024}
"""


@pytest.fixture
def kilnd(start_kilnd):
    """kilnd serving the built-in tensor models (simple, identity_fp32, sleep_us)."""
    return start_kilnd(TENSOR_MODELS)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
