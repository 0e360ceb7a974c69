"""The monitoring kit in ``dashboards/``: the example Prometheus config and alert rules
pass promtool (syntax and the rule unit tests in alerts_test.yml), the Grafana
dashboard only asks for metrics the daemon exports, and every query of the dashboard and
of the alert rules answers from a real Prometheus scraping a real daemon under load.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from daemon_util import ClientEngine, DaemonProcess
from hicache.metrics import Metrics
from tiers_util import SPEC

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "grafana" / "hicache.json"
PROMETHEUS_DIR = REPO / "dashboards" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERTS_TEST = Path(__file__).with_name("alerts_test.yml")

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (Debian/Ubuntu: apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus server is not on PATH (Debian/Ubuntu: apt-get install prometheus)")

# The alerts alerts.yml must define; it may define more.
REQUIRED_ALERTS = {"HicacheDown", "HicacheHitRatioCollapse", "HicacheEvictionStorm",
                   "HicacheProtectedPagesNearCapacity", "HicacheSessionsExpiring", "HicacheDiskCorruptRecords",
                   "HicacheDiskTierFull", "HicacheLockHeldForAnHour", "HicacheTenantOverShare",
                   "HicacheRemoteTierDown", "HicacheKvEventsDropped"}
SEVERITIES = {"critical", "warning", "info"}

# Grafana's variables, as the integration test fills them in ("instance" comes from the
# scraped target). A variable not listed here fails the test: give it a value.
RATE_INTERVAL = "30s"  # spans the whole test; Grafana would pick at least 4 scrape intervals
VARIABLE_VALUES = {"__rate_interval": RATE_INTERVAL, "__range": "5m"}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


# Loopback only: an http_proxy in the environment must not see these requests.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def promtool(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([PROMTOOL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@needs_promtool
def test_alert_rules_pass_promtool_check():
    assert "SUCCESS" in promtool("check", "rules", ALERTS)


@needs_promtool
def test_example_config_passes_promtool_check(tmp_path):
    # check config also loads the rule files it names, relative to the config file.
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(PROMETHEUS_DIR / name, tmp_path / name)
    output = promtool("check", "config", tmp_path / "prometheus.yml")
    assert "1 rule files found" in output


@needs_promtool
def test_alert_rules_unit_tests():
    promtool("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel but rows, including those inside collapsed rows."""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard_panels(dashboard) for target in panel["targets"]]


def exported_metric_names() -> set[str]:
    """The series names the daemon exposes, read from hicache.metrics itself (with a
    disk tier and a spec registered, so that the storage gauges and the queues' bounds
    are there too)."""
    metrics = Metrics()
    metrics.identities(["default"])  # (the daemon names its identities at once)
    metrics.remote_up(True)  # (with a remote tier)
    storage = {"bytes": 0, "records": 0, "capacity_bytes": 1, "map_size_bytes": 1, "corrupt_records": 0}
    queues = {"host_staging": [0, 1], "disk_write": [0, 1]}  # (bounded: a spec registered, with a disk tier)
    metrics.add_state_collector(lambda: {"pages": {}, "sessions": 0, "storage": storage, "tenants": {"t": [0, 0]},
                                         "queues": queues, "events": {"events": 0, "batches": 0, "dropped": 0, "subscribers": {"daemon": 0}},
                                         "build": {"version": "0", "protocol_version": 1, "mode": "cpu"}})
    # *_created series are an exposition detail that Prometheus does not keep as such.
    return {sample.name for family in metrics.registry.collect() for sample in family.samples
            if not sample.name.endswith("_created")}


_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                    "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, grouping clauses, function calls and keywords are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)\s*(\()?", text):
        word, is_call = match.groups()
        if not is_call and word.lower() not in _PROMQL_KEYWORDS:
            names.add(word)
    return names


def test_metric_names_finds_selectors_only():
    expr = ('histogram_quantile(0.99, sum by (op, le) (rate(hicache_request_duration_seconds_bucket'
            '{instance=~"$instance", op!="rate"}[$__rate_interval]))) / on () group_left () up offset 1e3s')
    assert metric_names(expr) == {"hicache_request_duration_seconds_bucket", "up"}


def test_dashboard_is_provisionable():
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["multi"] and instance["includeAll"]
    assert instance["query"] == "label_values(hicache_build_info, instance)"
    # No data source is pinned: every uid in the file is the variable (or Grafana's own
    # annotation source).
    uids = set(re.findall(r'"uid": "([^"]*)"', DASHBOARD.read_text()))
    assert uids <= {"${datasource}", "-- Grafana --", dashboard["uid"]}, uids
    for panel in dashboard_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def unfiltered_selectors(expr: str, matcher: str = 'instance=~"$instance"') -> list[str]:
    """The metric names in ``expr`` selected without ``matcher``. String literals are
    matched and skipped, so a label value equal to a name does not count."""
    unfiltered = []
    for name in metric_names(expr):
        pattern = rf'"(?:[^"\\]|\\.)*"|(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^}}]*\}})?'
        for match in re.finditer(pattern, expr):
            if not match.group(0).startswith('"') and matcher not in (match.group(1) or ""):
                unfiltered.append(name)
    return unfiltered


def test_unfiltered_selectors():
    assert unfiltered_selectors('sum(up{instance=~"$instance", op="hicache_sessions"}) / hicache_sessions') \
        == ["hicache_sessions"]
    assert unfiltered_selectors('rate(hicache_pages{instance="x"}[1m])') == ["hicache_pages"]
    assert unfiltered_selectors('hicache_pages{tier="disk", instance=~"$instance"}') == []


def test_every_panel_has_targets_filtered_by_instance():
    dashboard = load_dashboard()
    panels = dashboard_panels(dashboard)
    assert len(panels) >= 20
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        assert panel["targets"], f"{panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert not unfiltered_selectors(target["expr"]), f"{panel['title']!r}: {target['expr']}"


def test_metrics_every_exporter_has_are_filtered_by_job():
    """``up`` and ``process_*`` come from every target, not only hicache's: a node's
    other exporters often share its ``instance`` label (see
    test_a_daemon_down_reads_as_down_beside_another_exporter_of_its_node)."""
    for title, expr in dashboard_exprs(load_dashboard()):
        shared = [name for name in unfiltered_selectors(expr, 'job="hicache"') if not name.startswith("hicache_")]
        assert not shared, f"{title!r}: {expr}"


def test_dashboard_uses_only_exported_metrics():
    known = exported_metric_names() | {"up"}
    used = set()
    for title, expr in dashboard_exprs(load_dashboard()):
        names = metric_names(expr)
        assert names, f"{title!r}: no metric in {expr}"
        assert names <= known, f"{title!r}: {sorted(names - known)} are not exported by hicache/metrics.py"
        used |= names
    # Every counter and gauge of hicache's own is on the dashboard somewhere (of the
    # standard process_* metrics, those worth a panel).
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in known if name.startswith("hicache_")}
    shown = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert families - shown == set()


def substitute(expr: str, values: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            pytest.fail(f"no test value for the dashboard variable ${name} in {expr}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """A ``prometheus`` process in ``directory`` scraping one hicache daemon every second
    (job "hicache", as alerts.yml expects) and evaluating a copy of alerts.yml.
    ``instance``: the target's instance label (default: its address); ``other_jobs``:
    more jobs, ``{job name: (target, instance label)}``; ``port``: the one it listens
    on (default: a free one)."""

    def __init__(self, directory: Path, target: str, *, instance: str | None = None,
                 other_jobs: dict[str, tuple[str, str]] | None = None, port: int | None = None) -> None:
        directory.mkdir()
        shutil.copy(ALERTS, directory / "alerts.yml")
        config = directory / "prometheus.yml"
        jobs = {"hicache": (target, instance), **(other_jobs or {})}
        scrape_configs = "".join(
            f'  - job_name: {job}\n    static_configs:\n      - targets: ["{address}"]\n'
            + (f'        labels: {{instance: "{label}"}}\n' if label else "")
            for job, (address, label) in jobs.items())
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "rule_files:\n  - alerts.yml\n"
            f"scrape_configs:\n{scrape_configs}")
        self.url = f"http://127.0.0.1:{port or free_port()}"
        self.log = directory / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.url}{path}"
        try:
            with _LOCAL.open(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:  # 400 / 422 carry the error as JSON
            return json.load(error)

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr, time=f"{time.time():.3f}")

    def results(self, expr: str) -> list:
        answer = self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def ready(self) -> bool:
        try:
            with _LOCAL.open(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_for(self, what: str, condition, timeout_s: float = 20.0):
        """Poll ``condition`` until it returns something true; fail at the deadline or if
        Prometheus exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = condition()
            if result:
                return result
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.log.read_text()}")
            time.sleep(0.1)  # poll period, not an ordering

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def run_workload(endpoint: str) -> None:
    """Prefixes shared by several sequences, repeats, and pools small enough to evict
    device -> host -> disk; a second engine then loads the same sequences back from host
    and disk. Both engines say bye."""
    ps = SPEC.page_size
    prefix = list(range(1, 2 * ps + 1))
    sequences = [prefix + [1000 * i + j for j in range(2 * ps)] for i in range(1, 7)]
    engines = []
    try:
        first = ClientEngine(endpoint, num_pages=8)
        engines.append(first)
        second = ClientEngine(endpoint, num_pages=8)
        engines.append(second)
        # flush after each request: its backups land, so its pages are evictable by the
        # next alloc rather than still being copied.
        for engine, batch in ((first, sequences + sequences[-2:]), (second, sequences)):
            for tokens in batch:
                engine.prefill(tokens)
                engine.client.flush()
    finally:
        for engine in engines:
            engine.close()


def samples_in_last_minute(prometheus: PrometheusServer, selector: str, minimum: float = 0.0) -> int:
    """How many scrapes in the last minute saw ``selector`` at ``minimum`` or above."""
    result = prometheus.results(f"{selector}[1m]")
    return sum(1 for series in result for _, value in series["values"] if float(value) >= minimum)


@needs_prometheus
def test_every_dashboard_and_alert_query_answers_from_a_live_daemon(tmp_path):
    (tmp_path / "daemon").mkdir()
    metrics_port = free_port()
    instance = f"127.0.0.1:{metrics_port}"
    # With KV events, and a remote tier whose master is not there (its panels have data:
    # lookups unavailable, the tier down).
    daemon = DaemonProcess(tmp_path / "daemon", metrics={"enabled": True, "address": "127.0.0.1",
                                                         "port": metrics_port},
                           events={"enabled": True},
                           remote={"enabled": True, "master": f"127.0.0.1:{free_port()}", "retry_s": 0.1})
    prometheus = None
    try:
        daemon.start()
        prometheus = PrometheusServer(tmp_path / "prometheus", instance)
        sel = f'job="hicache", instance="{instance}"'
        prometheus.wait_for("prometheus to be ready", prometheus.ready)
        # Two scrapes before the workload: the rates below then span it.
        prometheus.wait_for("two scrapes of the idle daemon",
                            lambda: samples_in_last_minute(prometheus, f"up{{{sel}}}", 1) >= 2)
        run_workload(daemon.endpoint)
        prometheus.wait_for("two scrapes after the workload", lambda: samples_in_last_minute(
            prometheus, f'hicache_sessions_ended_total{{{sel}, reason="bye"}}', 2) >= 2)

        dashboard = load_dashboard()
        instance_values = prometheus.get("/api/v1/label/instance/values", **{"match[]": "hicache_build_info"})
        assert instance in instance_values["data"], "label_values(hicache_build_info, instance) misses the daemon"
        # Grafana puts a regex-escaped value inside the quotes of instance=~"$instance".
        values = {**VARIABLE_VALUES, "instance": re.escape(instance).replace("\\", "\\\\")}
        empty = []
        for title, expr in dashboard_exprs(dashboard):
            if not prometheus.results(substitute(expr, values)):
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

        # The workload shows: some of it was served from the cache, from every tier
        # (the hit-ratio overview stat, and the tokens-saved panel by tier).
        hit_ratio = next(expr for title, expr in dashboard_exprs(dashboard) if title == "Hit ratio")
        [ratio] = prometheus.results(substitute(hit_ratio, values))
        assert 0 < float(ratio["value"][1]) <= 1
        saved = prometheus.results(f"sum by (tier) (rate(hicache_matched_tokens_total{{{sel}}}[{RATE_INTERVAL}]))")
        assert {s["metric"]["tier"] for s in saved if float(s["value"][1]) > 0} == {"device", "host", "disk"}

        # Every rule loaded, evaluated without error, and answers as a plain query.
        def evaluated_rules():
            groups = prometheus.get("/api/v1/rules")["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            return rules if rules and all(rule["health"] != "unknown" for rule in rules) else None

        rules = prometheus.wait_for("every rule to be evaluated", evaluated_rules)
        known = exported_metric_names() | {"up"}
        assert {rule["name"] for rule in rules if rule["type"] == "alerting"} >= REQUIRED_ALERTS
        for rule in rules:
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
            assert metric_names(rule["query"]) <= known, f"{rule['name']} uses unknown metrics: {rule['query']}"
            prometheus.results(rule["query"])
            if rule["type"] == "alerting":
                assert rule["labels"].get("severity") in SEVERITIES, rule["name"]
                for annotation in ("summary", "description", "runbook"):
                    assert rule["annotations"].get(annotation, "").strip(), f"{rule['name']}: no {annotation}"
        # A healthy daemon raises nothing. The exceptions are on purpose: the workload
        # pushes some 20 pages through an 8-page host pool within seconds, which is an
        # eviction storm by the rule's own measure (over 1% of the tier per second); the
        # remote tier's master is not there. Those alerts may be pending - pending only,
        # their "for" is 5 and 10 minutes.
        alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
        assert {alert["labels"]["alertname"] for alert in alerts} <= {"HicacheEvictionStorm",
                                                                       "HicacheRemoteTierDown"}, alerts
        assert all(alert["state"] == "pending" for alert in alerts), alerts
    finally:
        if prometheus is not None:
            prometheus.stop()
        code = daemon.stop()
    assert code == 0, daemon.log.read_text()


@needs_prometheus
def test_a_daemon_down_reads_as_down_beside_another_exporter_of_its_node(tmp_path):
    """Prometheus setups often give a node's targets one ``instance`` label (relabelled
    to the node, so that node_exporter's and hicache's series join). With the daemon
    down and another exporter of its node up (here: Prometheus itself), the panels that
    read ``up`` and the ``process_*`` metrics (which every exporter has) show the daemon
    down and nothing of its process — not the other exporter's."""
    node = "gpu-node-01"
    port = free_port()
    prometheus = PrometheusServer(tmp_path / "prometheus", f"127.0.0.1:{free_port()}", instance=node,
                                  other_jobs={"node": (f"127.0.0.1:{port}", node)}, port=port)
    try:
        prometheus.wait_for("prometheus to be ready", prometheus.ready)
        prometheus.wait_for("a scrape of both jobs", lambda: len(prometheus.results(f'up{{instance="{node}"}}')) == 2)
        values = {**VARIABLE_VALUES, "instance": node}
        answers = {}
        for panel in dashboard_panels(load_dashboard()):
            for target in panel["targets"]:
                if not any(name.startswith("hicache_") for name in metric_names(target["expr"])):
                    results = prometheus.results(substitute(target["expr"], values))
                    answers[panel["title"], target["legendFormat"]] = [float(r["value"][1]) for r in results]
        assert answers.pop(("Daemons up", "up")) == [0.0]
        assert answers.pop(("Daemons up", "scraped")) == [1.0]
        assert answers and all(got == [] for got in answers.values()), answers  # the process panels
    finally:
        prometheus.stop()
