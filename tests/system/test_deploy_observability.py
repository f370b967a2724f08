"""deploy/grafana/kiln.json and deploy/prometheus/alerts.yaml: every query names a metric
family kilnd serves (read off a real daemon's /metrics), the dashboard is well-formed, and
promtool accepts the rules and passes their unit tests (alerts_test.yaml)."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
import yaml

from conftest import TENSOR_MODELS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kiln.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
METRIC = re.compile(r"\bkiln_[a-z0-9_]+")


def served_families(kilnd):
    text = requests.get(f"http://127.0.0.1:{kilnd.metrics_port}/metrics", timeout=10).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def family(name):
    """The family a sample name belongs to (histograms: _bucket, _sum, _count)."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def dashboard_queries():
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def alert_queries():
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_query_names_a_served_metric(start_kilnd):
    # The LLM families exist (without children) even when no LLM is loaded; the training ones
    # once fine-tuning is enabled (the default).
    served = served_families(start_kilnd(TENSOR_MODELS))
    queries = dashboard_queries() + alert_queries()
    assert len(queries) >= 20
    for q in queries:
        names = METRIC.findall(q)
        assert names, f"a query without a kiln metric: {q}"
        for n in names:
            assert family(n) in served, f"{n} (in `{q}`) is not served by kilnd"


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("tokens", "first token", "inter-token", "queue", "kv cache", "preemptions",
                  "errors", "training"):
        assert topic in titles, f"no panel about {topic}"
    for p in dash["panels"]:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}


def test_promtool_checks_and_unit_tests_the_alerts():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (Debian package `prometheus`, installed by "
                    "scripts/install-deps.sh)")
    subprocess.run([promtool, "check", "rules", str(ALERTS)], check=True, capture_output=True)
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=ALERTS.parent,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
