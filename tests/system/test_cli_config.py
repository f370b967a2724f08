"""kilnd's command line and configuration errors, as an operator meets them."""
import os
import socket
import subprocess

from conftest import KERNEL_CACHE, KILND, free_port


def run(*args, timeout=30):
    return subprocess.run([KILND, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KILN_CACHE_DIR": KERNEL_CACHE})


def test_print_default_config_is_valid_and_documented(tmp_path):
    r = run("--print-default-config")
    assert r.returncode == 0
    assert "models:" in r.stdout and "#" in r.stdout
    p = tmp_path / "default.yaml"
    p.write_text(r.stdout)
    check = run("--check-config", "--config", str(p))
    assert check.returncode == 0, check.stderr
    assert "valid" in check.stdout


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("server:\n  grpc:\n    address: [unclosed\n")
    r = run("--check-config", "--config", str(p))
    assert r.returncode == 1
    assert f"{p}:" in r.stderr and "invalid YAML" in r.stderr, r.stderr


def test_unknown_key_suggests_the_near_miss(tmp_path):
    p = tmp_path / "typo.yaml"
    p.write_text("models:\n  - name: s\n    kind: builtin\n    builtin: simple\n"
                 "    max_batch: 4\n")
    r = run("--check-config", "--config", str(p))
    assert r.returncode == 1
    assert f"{p}:5:5:" in r.stderr, r.stderr
    assert "max_batch_size" in r.stderr, r.stderr


def test_starting_with_an_invalid_config_exits_1(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("server:\n  grpc:\n    address: nonsense\n")
    r = run("--config", str(p))
    assert r.returncode == 1
    assert "server.grpc.address" in r.stderr


def test_port_already_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        r = run("--set", f"server.grpc.address=127.0.0.1:{busy}",
                "--set", f"server.http.address=127.0.0.1:{free_port()}",
                "--set", f"server.metrics.address=127.0.0.1:{free_port()}")
    assert r.returncode != 0
    assert f"127.0.0.1:{busy}" in r.stderr and "in use" in r.stderr, r.stderr


def test_http_port_in_use_too():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        r = run("--set", f"server.grpc.address=127.0.0.1:{free_port()}",
                "--set", f"server.http.address=127.0.0.1:{busy}",
                "--set", f"server.metrics.address=127.0.0.1:{free_port()}")
    assert r.returncode != 0
    assert f"{busy}" in r.stderr and "in use" in r.stderr, r.stderr


def test_bad_command_line_exits_2():
    assert run("--no-such-flag").returncode == 2
    assert run("--log-format", "xml").returncode == 2


def test_json_logs(start_kilnd):
    import json
    k = start_kilnd("models: []\n", args=["--log-format", "json"])
    lines = [l for l in k.output().splitlines() if l.strip()]
    assert lines, "no log output"
    for line in lines:
        rec = json.loads(line)
        assert {"ts", "level", "msg"} <= rec.keys()


def test_kernel_cache_is_in_the_storage_dir_unless_kiln_cache_dir_says(start_kilnd, tmp_path):
    """Kernels compiled at run time are kept on the storage volume (config/README.md)."""
    store = tmp_path / "store"
    k = start_kilnd("models: []\n", overrides=[f"server.storage_dir={store}"],
                    env={"KILN_CACHE_DIR": ""})
    assert f"kernel cache: {store}/cache" in k.output()
    elsewhere = tmp_path / "elsewhere"
    k = start_kilnd("models: []\n", overrides=[f"server.storage_dir={store}"],
                    env={"KILN_CACHE_DIR": str(elsewhere)})
    assert f"kernel cache: {elsewhere}" in k.output()


def test_shipped_configs_are_valid():
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    files = [root / "deploy" / "kiln.yaml", *sorted((root / "config" / "examples").glob("*.yaml"))]
    assert len(files) >= 3
    for f in files:
        r = run("--check-config", "--config", str(f))
        assert r.returncode == 0, f"{f}: {r.stderr}"
