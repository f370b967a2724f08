"""deploy/kubernetes/: every manifest passes an offline schema check (kubernetes-validate's
bundled Kubernetes schemas, strict, for the oldest and newest Kubernetes we target; KServe's
ServingRuntime against tests/system/schemas/servingruntime.schema.json), and the files agree
with each other and with kilnd: the grace period covers preStop plus kilnd's drain, probes and
Service target the ports kilnd's config listens on, the Secret holds exactly the files the
config names, the HPA scales on a gauge kilnd serves, kilnd accepts the configurations."""
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml

from conftest import KILND, TENSOR_MODELS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
RUNTIME_SCHEMA = Path(__file__).parent / "schemas" / "servingruntime.schema.json"
# The oldest Kubernetes the manifests target (every field they use is GA there) and the newest
# whose schemas kubernetes-validate bundles.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def documents():
    """[(file name, document)] of every manifest."""
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind):
    found = [d for _, d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes, found {len(found)}"
    return found[0]


def kiln_config():
    """The kiln.yaml that the ConfigMap holds, parsed."""
    return yaml.safe_load(config_map()["data"]["kiln.yaml"])


def config_map():
    maps = [d for _, d in documents() if d["kind"] == "ConfigMap" and "kiln.yaml" in d["data"]]
    assert len(maps) == 1, "expected one ConfigMap holding kiln.yaml"
    return maps[0]


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def pod_spec():
    return one("Deployment")["spec"]["template"]["spec"]


def container():
    containers = pod_spec()["containers"]
    assert len(containers) == 1
    return containers[0]


def probes(c):
    return {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}


# ---- the validator itself -----------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_the_validator_has_its_schemas_and_refuses_a_bad_manifest(version):
    # No silent pass: the bundled schemas must load, and a manifest with a wrong type and an
    # unknown field must be refused, or every check below means nothing.
    good = copy.deepcopy(one("Deployment"))
    try:
        kubernetes_validate.validate(good, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"kubernetes-validate has no schema for apps/v1 Deployment at {version}: "
                    f"{e} (is the package from tests/requirements.txt installed whole?)")
    bad = copy.deepcopy(good)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    bad = copy.deepcopy(good)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


# ---- schemas --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,doc", documents(), ids=lambda x: x if isinstance(x, str) else "")
def test_manifest_passes_the_schema(name, doc, version):
    if doc["apiVersion"].startswith("serving.kserve.io/"):
        schema = json.loads(RUNTIME_SCHEMA.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(doc)
        # Its containers are core/v1 Containers: check them as a Pod's.
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime"},
               "spec": {"containers": doc["spec"]["containers"]}}
        kubernetes_validate.validate(pod, version, strict=True)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{name}: no schema for {doc['apiVersion']} {doc['kind']} at {version}: {e}")


def test_the_servingruntime_schema_refuses_what_kserve_would():
    schema = json.loads(RUNTIME_SCHEMA.read_text())
    runtime = one("ServingRuntime")
    jsonschema.validate(runtime, schema)
    for edit in (lambda r: r["spec"].update(protocolVersions=["v3"]),
                 lambda r: r["spec"].update(supportedModelFormat=[{"name": "gguf"}]),
                 lambda r: r["spec"]["supportedModelFormats"][0].pop("name"),
                 lambda r: r["spec"].update(containers=[])):
        bad = copy.deepcopy(runtime)
        edit(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# ---- the files agree with each other and with kilnd ----------------------------------------

def test_grace_period_covers_prestop_and_kilnd_drain():
    spec, server = pod_spec(), kiln_config()["server"]
    pre_stop = container()["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        pause = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep", f"preStop is expected to pause: {command}"
        pause = float(command[1])
    grace = server["shutdown_grace_seconds"]
    # The kubelet counts preStop inside terminationGracePeriodSeconds, then SIGKILLs.
    assert spec["terminationGracePeriodSeconds"] > pause + grace, (
        f"terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} does not cover "
        f"preStop ({pause} s) + server.shutdown_grace_seconds ({grace} s)")


def test_ports_probes_and_service_match_kilnd_config():
    server = kiln_config()["server"]
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": port_of(server["http"]["address"]),
                     "grpc": port_of(server["grpc"]["address"]),
                     "metrics": port_of(server["metrics"]["address"])}
    tls = bool(server.get("tls", {}).get("cert_file"))
    assert probes(c).keys() == {"startupProbe", "readinessProbe", "livenessProbe"}
    for kind, probe in probes(c).items():
        if "grpc" in probe:
            assert probe["grpc"]["port"] == ports["grpc"], kind
            assert not tls, f"{kind}: the kubelet's gRPC probe is plaintext, kilnd serves TLS"
        else:
            get = probe["httpGet"]
            port = ports.get(get["port"], get["port"])
            assert port == ports["http"], f"{kind} probes port {get['port']}"
            assert get["path"] in ("/v2/health/ready", "/v2/health/live"), kind
            assert (get.get("scheme", "HTTP") == "HTTPS") == tls, f"{kind}: scheme vs TLS"
    assert "health" in server.get("auth", {}).get("open", ["health"]), \
        "the probes carry no API key: health must be open"
    annotations = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service = one("Service")
    assert service["spec"]["selector"].items() <= \
        one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in ports, f"Service port {p['name']} targets {p['targetPort']}"


def test_mounts_match_the_image_and_the_config():
    spec, c = pod_spec(), container()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    # The image's ENTRYPOINT reads --config PATH; the ConfigMap must be mounted there.
    entry = re.search(r'^ENTRYPOINT\s+(\[.*\])', (ROOT / "deploy" / "Dockerfile").read_text(),
                      re.M)
    argv = json.loads(entry.group(1))
    config_path = Path(argv[argv.index("--config") + 1])
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == \
        config_map()["metadata"]["name"]
    assert config_path.name in config_map()["data"]
    server, models = kiln_config()["server"], kiln_config()["models"]
    for m in models:
        if m["kind"] == "llm":
            assert any(m["path"].startswith(d + "/") for d in mounts), \
                f"model {m['name']}: {m['path']} is on no mounted volume"
    assert server["storage_dir"] in mounts, "storage_dir is not a mounted volume"


def secret_paths(server):
    paths = [k["key_file"] for k in server.get("auth", {}).get("api_keys", [])
             if "key_file" in k]
    paths += [v for k, v in server.get("tls", {}).items()
              if k.endswith("_file") and v]
    return paths


def test_secret_holds_exactly_the_files_the_config_names():
    secret, server = one("Secret"), kiln_config()["server"]
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mount = next(m["mountPath"] for m in container()["volumeMounts"]
                 if volumes[m["name"]].get("secret", {}).get("secretName") ==
                 secret["metadata"]["name"])
    paths = secret_paths(server)
    assert paths, "the config names no key or certificate file"
    for p in paths:
        assert str(Path(p).parent) == mount, f"{p} is not in the Secret's mount {mount}"
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    assert {Path(p).name for p in paths} == keys, \
        f"config names {sorted(Path(p).name for p in paths)}, the Secret holds {sorted(keys)}"
    # The files must be readable by the image's non-root user: group-readable with fsGroup.
    mode = volumes[next(n for n, v in volumes.items() if "secret" in v)]["secret"]["defaultMode"]
    assert mode & 0o040 and pod_spec()["securityContext"]["fsGroup"]


def run_check_config(config_path, *args):
    r = subprocess.run([KILND, "--check-config", "--config", str(config_path), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"kilnd --check-config refused it:\n{r.stdout}{r.stderr}"


def test_kilnd_accepts_the_configmap(tmp_path):
    default = subprocess.run([KILND, "--print-default-config"], capture_output=True,
                             text=True, check=True).stdout
    if not re.search(r"^\s+auth:", default, re.M) or not re.search(r"^\s+tls:", default, re.M):
        pytest.skip("this kilnd has no server.auth / server.tls yet (the auth and TLS work "
                    "adds them); the ConfigMap uses both")
    # The Secret's files where the config names them, as real files (a certificate made now).
    text = config_map()["data"]["kiln.yaml"]
    mount = str(Path(secret_paths(yaml.safe_load(text)["server"])[0]).parent)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name, value in one("Secret")["stringData"].items():
        (secrets / name).write_text(value)
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make a test certificate"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=kiln",
                    "-keyout", str(secrets / "tls.key"), "-out", str(secrets / "tls.crt")],
                   check=True, capture_output=True)
    config = tmp_path / "kiln.yaml"
    config.write_text(text.replace(mount + "/", f"{secrets}/"))
    run_check_config(config)


def test_kilnd_accepts_the_servingruntime_arguments():
    args = [a.replace("{{.Name}}", "my-model")
            for a in one("ServingRuntime")["spec"]["containers"][0]["args"]]
    run_check_config(ROOT / "deploy" / "kiln.yaml", *args)


def test_servingruntime_ports_match_its_arguments():
    c = one("ServingRuntime")["spec"]["containers"][0]
    sets = dict(a.split("=", 1) for a in c["args"] if "=" in a)
    assert c["ports"][0]["containerPort"] == port_of(sets["server.http.address"])
    for kind, probe in probes(c).items():
        assert probe["grpc"]["port"] == port_of(sets["server.grpc.address"]), kind
    spec = one("ServingRuntime")["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    assert int(spec["annotations"]["prometheus.kserve.io/port"]) == 8002  # kilnd's default


def served_families(kilnd):
    """{family: type} from a real daemon's /metrics."""
    text = requests.get(f"http://127.0.0.1:{kilnd.metrics_port}/metrics", timeout=10).text
    return {line.split()[2]: line.split()[3] for line in text.splitlines()
            if line.startswith("# TYPE ")}


def test_hpa_scales_on_a_gauge_kilnd_serves(start_kilnd):
    hpa, deployment = one("HorizontalPodAutoscaler"), one("Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2, "one replica cannot drain without an outage"
    (metric,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    name = metric["pods"]["metric"]["name"]
    # The LLM families exist (without children) even when no LLM is loaded.
    families = served_families(start_kilnd(TENSOR_MODELS))
    assert families.get(name) == "gauge", f"{name} is not a gauge kilnd serves"
    selector = metric["pods"]["metric"].get("selector", {}).get("matchLabels", {})
    if "model" in selector:
        assert selector["model"] in {m["name"] for m in kiln_config()["models"]}
    # prometheus-adapter must serve that name.
    adapter = [d for _, d in documents()
               if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})]
    assert adapter, "no prometheus-adapter rule for the HPA's metric"
    rules = yaml.safe_load(adapter[0]["data"]["config.yaml"])["rules"]
    assert any(r["seriesQuery"].startswith(name + "{") and r["name"]["as"] == name
               for r in rules), f"no prometheus-adapter rule serves {name}"
