"""The operator's kit in deploy/: every series the Grafana dashboard and the Prometheus alert
rules query is one a running reactor exposes (scraped from a real `reactor run`), the rules
pass `promtool` (their syntax, and their own unit tests in rules.test.yml), the systemd units
pass `systemd-analyze verify` and ask for what the notify protocol gives, and the Kubernetes
manifests probe the port the reactor serves and give workers the job timeout to finish."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rq.queue import Queue

from reactor.cli.main import cli
from reactor.dispatcher.metrics import DEFAULT_HOST
from reactor.settings import DEFAULT_HEARTBEAT_SECONDS
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.metrics import scrape
from tests.support.notify_socket import NotifySocket
from tests.support.paths import ROOT
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows, states
from tests.support.servers import free_port
from tests.support.waiting import wait_for

DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "photo-reactor.json"
#: Series Prometheus makes itself for every scrape target (not in any /metrics).
PROMETHEUS_OWN = {"up"}

# -- the PromQL the kit queries ---------------------------------------------------------------

#: Words of PromQL that are not metric names when they stand outside braces and brackets.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_TOKEN = re.compile(
    r"\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:ms|[smhdwy])?|[A-Za-z_:][A-Za-z0-9_:]*\s*\(?|.", re.I
)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: label matchers (`{...}`), ranges (`[...]`),
    strings, durations (`offset 1h`) and Grafana's `$variables` are dropped, then every identifier that is not a
    keyword, is not called as a function (`rate(`) and does not name grouping labels
    (`by (type, state)`) is a metric name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for token in _TOKEN.findall(text):
        word = token.strip()
        if not re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", word):
            continue  # a number, an operator, a function call "rate("
        if word.lower() not in _KEYWORDS:
            names.add(word)
    return names


def test_the_parser_finds_metric_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(reactor_claim_seconds_bucket{job=~"$job"}'
        '[$__rate_interval]))) > 0.5 and on (instance) up{job="x"} == 1 unless max by (type)'
        "(deriv(reactor_backlog[15m] offset 1h)) > 1e3 or time() - last_turn"
    )
    assert promql_metric_names(expr) == {
        "reactor_claim_seconds_bucket",
        "up",
        "reactor_backlog",
        "last_turn",
    }


def rule_expressions() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_expressions() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = {
        f"{panel['title']} {target['refId']}": target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    }
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition", "")
        if query.startswith("label_values("):
            # Grafana's label_values(METRIC, LABEL): the first argument is a series selector.
            found[f"${variable['name']}"] = query.removeprefix("label_values(").split(",")[0]
    return found


def queried_names() -> dict[str, set[str]]:
    queries = {**rule_expressions(), **dashboard_expressions()}
    names = {where: promql_metric_names(expr) for where, expr in queries.items()}
    assert all(names.values()), [where for where, found in names.items() if not found]
    return names


def test_the_kit_covers_what_an_operator_watches() -> None:
    assert set(rule_expressions()) >= {
        "PhotoReactorDown",
        "PhotoReactorLoopStalled",
        "PhotoReactorListenerDisconnected",
        "PhotoReactorEnqueueFailing",
        "PhotoReactorRescueSpike",
        "PhotoReactorBacklogGrowing",
        "PhotoReactorOldestDueTooOld",
        "PhotoReactorXminHorizonHeld",
        "PhotoReactorDeadTuplesHigh",
        "PhotoReactorAutovacuumOff",
        "PhotoReactorArchiveBehind",
        "PhotoReactorNotifyQueueFilling",
    }
    titles = {where.rsplit(" ", 1)[0] for where in dashboard_expressions()}
    assert titles >= {"Dispatch rate by type", "Backlog by type", "Oldest due row by type"}
    assert titles >= {"xmin horizon age", "Dead tuples and autovacuum"}
    assert titles >= {
        "Rescues and failed rows",
        "Failures",
        "Listener and loop",
        "Doorbell and wake-ups",
    }
    assert titles >= {"Claim latency", "Enqueue latency"}


# -- against a running reactor ----------------------------------------------------------------


def exposed_names(text: str) -> set[str]:
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def test_every_series_the_dashboard_and_the_rules_query_is_exposed(
    env: Env, spawn: Callable[..., Process]
) -> None:
    conn = env.connect()
    # Finished rows for retention to delete, and rows to dispatch: every labelled series
    # appears with its first sample (a rescue's reasons with the first sweep).
    insert_rows(conn, 3, prefix="old", state="done", updated_at="2000-01-01T00:00:00Z")
    insert_rows(conn, 5)
    port = free_port()
    start_reactor(
        spawn,
        "--metrics-port",
        str(port),
        "--sweep-interval",
        "1",
        "--prune-done-after",
        "1d",
    )
    wait_for(lambda: states(conn) == {"active": 5}, what="dispatch and retention")

    queried = queried_names()

    def missing() -> dict[str, list[str]]:
        exposed = exposed_names(scrape(port))
        return {
            where: sorted(found - exposed - PROMETHEUS_OWN)
            for where, found in queried.items()
            if found - exposed - PROMETHEUS_OWN
        }

    # The backlog's series come with the first sweep's refresh (every second here).
    try:
        wait_for(lambda: not missing(), timeout=20, what="every queried series")
    except AssertionError:
        raise AssertionError(f"queried but not exposed: {missing()}") from None
    assert states(conn) == {"active": 5}  # the old done rows were pruned
    assert len(set().union(*queried_names().values())) >= 22


# -- promtool ---------------------------------------------------------------------------------


@pytest.fixture
def promtool() -> Iterator[str]:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    yield found


@pytest.mark.parametrize(
    "args",
    [
        ("check", "rules", "rules.yml"),
        ("test", "rules", "rules.test.yml"),
        ("check", "config", "prometheus.yml"),
    ],
    ids=["check-rules", "test-rules", "check-config"],
)
def test_promtool_accepts_the_rules(promtool: str, args: tuple[str, ...]) -> None:
    out = subprocess.run(
        [promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_the_monitoring_profile_mounts_the_kit_and_scrapes_the_reactor() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    profiled = {n for n, s in compose.items() if "monitoring" in s.get("profiles", [])}
    assert profiled == {"prometheus", "grafana"}
    for name in profiled:
        assert compose[name]["profiles"] == ["monitoring"]
        for volume in compose[name]["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), f"{name} mounts {source}, not in the repository"
    reactor_args = compose["reactor"]["command"]
    port = flag_value(reactor_args, "--metrics-port")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "photo-reactor"  # the job the rules select
    assert job["static_configs"][0]["targets"] == [f"reactor:{port}"]
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "photo-reactor.yml").read_text()
    )
    mounted = [v for v in compose["grafana"]["volumes"] if v.startswith("./deploy/grafana/photo")]
    assert mounted[0].split(":")[1].startswith(provisioned["providers"][0]["options"]["path"])
    assert all('job="photo-reactor"' in expr for expr in rule_expressions().values())


# -- systemd ----------------------------------------------------------------------------------

UNITS = ("reactor.service", "reactor-worker@.service")


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string((DEPLOY / "systemd" / name).read_text())
    return parser


def job_timeout_default() -> int:
    assert option_default("run", "job_timeout") is None  # None: RQ's own default
    return Queue.DEFAULT_TIMEOUT


@pytest.mark.parametrize("name", UNITS)
def test_the_units_speak_notify_and_are_hardened(name: str) -> None:
    service = unit(name)["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure"
    # The worker refuses a watchdog shorter than two heartbeats (`reactor worker`).
    assert float(service["WatchdogSec"]) >= 2 * DEFAULT_HEARTBEAT_SECONDS
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
    }.items():
        assert service[key] == value
    # The notify socket is a Unix socket: the address families must leave it.
    assert "AF_UNIX" in service["RestrictAddressFamilies"].split()


def test_the_worker_unit_lets_the_running_job_finish() -> None:
    service = unit("reactor-worker@.service")["Service"]
    assert service["KillMode"] == "mixed"  # SIGTERM to the worker, not to its work horse
    assert job_timeout_default() < int(service["TimeoutStopSec"]) <= job_timeout_default() + 60
    assert service["ExecStart"].split()[1] == "worker"
    assert unit("reactor.service")["Service"]["ExecStart"].split()[1] == "run"


def test_the_worker_unit_starts_again_after_its_worker_was_killed(
    env: Env, spawn: Callable[..., Process], tmp_path: Path
) -> None:
    """systemd restarts a killed worker 5 s later with the same command line: it must start,
    where a fixed `--name` met the dead worker's RQ key (minutes of TTL while idle) and exited."""
    command = unit("reactor-worker@.service")["Service"]["ExecStart"].split()[1:]
    args = [a.replace("%H", socket.gethostname()).replace("%i", "1") for a in command]
    environment = {"REACTOR_ROUTES": "photo.process=tests.handlers.ok"}

    def start() -> tuple[Process, NotifySocket]:
        listener = NotifySocket(str(tmp_path / f"notify-{len(started)}"))
        env.cleanups.append(listener.close)
        extra = {**environment, "NOTIFY_SOCKET": listener.sock.getsockname()}
        started.append(spawn("-m", "reactor", *args, name="worker", extra_env=extra))
        return started[-1], listener

    started: list[Process] = []
    first, listener = start()
    listener.wait("READY=1\nSTATUS=running")
    first.kill()  # idle, as after a watchdog abort or the OOM killer
    second, listener = start()

    def ready() -> bool:
        assert second.proc.poll() is None, f"the restarted worker exited:\n{second.output()}"
        return bool(listener.times("READY=1\nSTATUS=running"))

    wait_for(ready, timeout=30, what="the restarted worker ready")

    # A worker given a name of its own meets that dead key: one line says why and what to do.
    named = [*args, "--name", "photo-worker-1"]
    first = spawn("-m", "reactor", *named, name="named", extra_env=environment)
    registered = env.redis()
    wait_for(lambda: registered.exists("rq:worker:photo-worker-1"), what="the worker registered")
    first.kill()
    again = run_cli(env, *named, extra_env=environment, timeout=60)
    assert again.returncode == 2, again.stderr
    assert (
        again.stderr.count("\n") == 1
        and "'photo-worker-1' is registered in Redis already (a live" in again.stderr
    )


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verifies_the_units(name: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # As installed, with the command pointing at this environment's `reactor`.
    reactor = Path(sys.executable).with_name("reactor")
    text = (DEPLOY / "systemd" / name).read_text()
    text = text.replace("/opt/photo-reactor/venv/bin/reactor", str(reactor))
    installed = tmp_path / name.replace("@.", "@1.")
    installed.write_text(text)
    out = subprocess.run(
        [analyze, "verify", str(installed)], capture_output=True, text=True, timeout=60
    )
    # Unknown keys are only warned about: any output is a failure.
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


# -- Kubernetes -------------------------------------------------------------------------------


def manifests(name: str) -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())
    return {doc["kind"]: doc for doc in docs if doc}


def option_default(command: str, option: str) -> Any:
    """The default the CLI itself declares (not a copy of it)."""

    params = {p.name: p for p in cli.commands[command].params}
    return params[option].default


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_the_reactor_is_probed_on_healthz_at_its_metrics_port() -> None:

    docs = manifests("reactor.yaml")
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "run"
    # Off by default: the manifest must turn it on, and bind beyond loopback for the kubelet.
    assert option_default("run", "metrics_port") is None
    assert option_default("run", "metrics_host") == DEFAULT_HOST
    port = int(flag_value(args, "--metrics-port") or 0)
    assert port and flag_value(args, "--metrics-host") == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/healthz"
        assert ports.get(http["port"], http["port"]) == port
    annotations = docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    selector = docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert selector == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def test_workers_have_the_job_timeout_to_finish() -> None:
    reactor_args = manifests("reactor.yaml")["Deployment"]["spec"]["template"]["spec"]
    given = flag_value(reactor_args["containers"][0]["args"], "--job-timeout")
    job_timeout = int(given) if given else job_timeout_default()
    docs = manifests("worker.yaml")
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"][0] == "worker"
    grace = pod["terminationGracePeriodSeconds"]
    # A warm shutdown lets the running job finish: its timeout, and a little for the outcome.
    assert job_timeout < grace <= job_timeout + 60
    selector = docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert selector == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def test_every_deploy_file_is_described() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.name != "README.md"):
        assert str(path.relative_to(DEPLOY)) in readme, f"deploy/README.md does not name {path}"
