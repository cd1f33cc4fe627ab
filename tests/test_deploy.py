"""The deploy files, checked with the tools users run, no cluster or container engine needed:
kustomize and schema validation, promtool, amtool, systemd-analyze, the compose files' mounts,
and the package the Dockerfile installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import requests
import yaml
from conftest import (
    ENV_BIN,
    ROOT,
    Alertmanager,
    Prometheus,
    free_port,
    require_binary,
    require_module,
    wait_until,
)

from exporter.heuristics.rules import render, render_prometheusrule

DEPLOY = ROOT / "deploy"
CORE_KINDS = {"Namespace", "ServiceAccount", "DaemonSet", "Service", "ConfigMap"}


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}


def test_kustomize_renders_every_kind_and_core_kinds_pass_schema_validation(manifests):
    kv = require_module("kubernetes_validate")
    assert set(manifests) == CORE_KINDS | {"ServiceMonitor", "PrometheusRule"}
    for kind in CORE_KINDS:
        kv.validate(manifests[kind], "1.30.0", strict=True)
    for name, d in manifests.items():
        if name != "Namespace":
            assert d["metadata"]["namespace"] == "gputrain", name


def test_the_daemonset_runs_on_gpu_nodes_unprivileged_without_taking_a_gpu(manifests):
    pod = manifests["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert "nvidia.com/gpu" not in str(c["resources"])  # reads GPUs, does not allocate one
    assert set(c["resources"]) == {"requests", "limits"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "--ingest.listen-address=$(HOST_IP):19401" in c["args"]
    token_arg = next(a for a in c["args"] if a.startswith("--ingest.token-file="))
    secret = next(v for v in pod["volumes"] if "secret" in v)
    mount = next(m for m in c["volumeMounts"] if m["name"] == secret["name"])
    assert token_arg.split("=", 1)[1].startswith(mount["mountPath"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # the Service and ServiceMonitor find these pods on the metrics port
    labels = manifests["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert manifests["Service"]["spec"]["selector"].items() <= labels.items()
    sm = manifests["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= manifests["Service"]["metadata"][
        "labels"].items()
    assert sm["endpoints"][0]["port"] == "metrics"
    relabels = sm["endpoints"][0]["relabelings"]
    assert {"targetLabel": "job", "replacement": "gputrain"} in relabels  # the rules' selector


def test_the_prometheusrule_carries_exactly_the_rule_groups_of_alerts(manifests, tmp_path):
    shipped = yaml.safe_load((ROOT / "alerts" / "gputrain.rules.yml").read_text())["groups"]
    assert manifests["PrometheusRule"]["spec"]["groups"] == shipped
    committed = (DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text()
    assert committed == render_prometheusrule(), (
        "stale: gputrain-exporter rules --format prometheusrule > "
        "deploy/kubernetes/prometheusrule.yaml")
    assert yaml.safe_load(render())["groups"] == shipped
    promtool = require_binary("promtool")
    extracted = tmp_path / "groups.yml"
    extracted.write_text(yaml.safe_dump({"groups": manifests["PrometheusRule"]["spec"][
        "groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboards_configmap_is_for_the_grafana_sidecar_and_current(manifests):
    from exporter.heuristics import dashboards as generate

    cm = manifests["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(cm["data"]) == {p.name for p in (ROOT / "grafana" / "dashboards").glob("*.json")}
    assert (DEPLOY / "kubernetes" / "dashboards-configmap.yaml").read_text() == \
        generate.configmap(), "stale: .venv/bin/python scripts/generate.py"


def test_the_example_training_pod_gets_the_node_address_the_token_and_tls():
    kv = require_module("kubernetes_validate")
    pod = yaml.safe_load((DEPLOY / "kubernetes" / "examples" / "training-pod.yaml").read_text())
    kv.validate(pod, "1.30.0", strict=True)
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["GPUTRAIN_URL"]["value"] == "https://$(HOST_IP):19401"
    assert env["GPUTRAIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "gputrain-ingest-token"
    ca_dir = container["volumeMounts"][0]["mountPath"]
    assert env["GPUTRAIN_CA_FILE"]["value"].startswith(ca_dir + "/")
    ds = yaml.safe_load((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    spec = ds["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert "gputrain-ingest-token" in secrets.values()
    exporter = spec["containers"][0]
    mounts = {m["mountPath"]: secrets.get(m["name"]) for m in exporter["volumeMounts"]}
    flags = dict(a.split("=", 1) for a in exporter["args"] if "=" in a)
    for flag in ("--ingest.tls-cert-file", "--ingest.tls-key-file", "--ingest.token-file"):
        assert mounts.get(flags[flag].rsplit("/", 1)[0]), flag  # in a mounted secret
    # the name the client verifies is the one the README's openssl command puts in the cert
    kustomization = (DEPLOY / "kubernetes" / "kustomization.yaml").read_text()
    assert f"subjectAltName=DNS:{env['GPUTRAIN_TLS_SERVER_NAME']['value']}" in kustomization


class ComposeLoader(yaml.SafeLoader):
    """YAML plus compose's merge tags: ``!reset`` drops the base value, ``!override``
    replaces it."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": True})
ComposeLoader.add_constructor(
    "!override", lambda loader, node: loader.construct_mapping(node)
    if isinstance(node, yaml.MappingNode) else loader.construct_sequence(node))


def compose(name: str) -> dict:
    return yaml.load((DEPLOY / "compose" / name).read_text(), Loader=ComposeLoader)


def bind_mounts(doc: dict) -> list[tuple[str, str]]:
    out = []
    for service in doc["services"].values():
        for v in service.get("volumes", []):
            source, target = v.split(":")[:2]
            if source.startswith((".", "/")):
                out.append((source, target))
    return out


def test_compose_files_parse_and_every_mounted_file_exists():
    base, demo = compose("compose.yaml"), compose("compose.demo.yaml")
    assert {"exporter", "prometheus", "alertmanager", "grafana"} <= set(base["services"])
    exporter = base["services"]["exporter"]
    assert exporter["pid"] == "host"
    assert exporter["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    assert (DEPLOY / "compose" / exporter["build"]["context"] / "deploy/docker/Dockerfile"
            ).is_file()
    assert exporter["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "--gpu.backend=demo" in demo["services"]["exporter"]["command"]
    assert demo["services"]["exporter"]["deploy"] == {"!reset": True}  # no GPU reservation
    mounts = bind_mounts(base) + bind_mounts(demo)
    assert mounts
    for source, _ in mounts:
        assert (DEPLOY / "compose" / source).exists(), f"compose mounts missing {source}"


def test_compose_files_need_compose_v2_and_the_docs_say_so():
    """The files use what only Compose v2 reads (a top-level name, the !reset tag); the page
    that shows the commands says so, and where a Compose v2 is installed it accepts them."""
    import shutil
    import subprocess

    base_text = (DEPLOY / "compose" / "compose.yaml").read_text()
    demo_text = (DEPLOY / "compose" / "compose.demo.yaml").read_text()
    assert compose("compose.yaml")["name"] == "gputrain" and "!reset" in demo_text
    assert "\nversion:" not in "\n" + base_text  # Compose v1's key, obsolete in v2
    page = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert "need Docker Compose v2" in page and "`docker-compose` 1.29" in page
    docker = shutil.which("docker")
    version = subprocess.run([docker, "compose", "version", "--short"], capture_output=True,
                             text=True) if docker else None
    if version is not None and version.returncode == 0:
        files = ["-f", str(DEPLOY / "compose" / "compose.yaml"),
                 "-f", str(DEPLOY / "compose" / "compose.demo.yaml")]
        run = subprocess.run([docker, "compose", *files, "config", "-q"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr


def prometheus_as_compose_mounts_it(etc: Path) -> Path:
    """The files compose mounts under /etc/prometheus, laid out under ``etc``."""
    for source, target in bind_mounts(compose("compose.yaml")):
        if target.startswith("/etc/prometheus/"):
            dest = etc / target.removeprefix("/etc/prometheus/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(DEPLOY / "compose" / source, dest)
    return etc


def test_prometheus_config_as_compose_mounts_it_passes_promtool(tmp_path):
    """Lay the files out where compose mounts them, then check the config."""
    promtool = require_binary("promtool")
    prometheus_as_compose_mounts_it(tmp_path)
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout
    cfg = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"].startswith("gputrain"))
    assert re.fullmatch("gputrain.*", job["job_name"])  # what the rules select
    assert cfg["alerting"]["alertmanagers"]


def test_alertmanager_config_passes_amtool_and_routes_every_severity(tmp_path):
    amtool = require_binary("amtool")
    path = DEPLOY / "alertmanager" / "alertmanager.yml"
    out = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for severity, receiver in (("critical", "oncall"), ("warning", "team"), ("info", "digest")):
        out = subprocess.run([amtool, "config", "routes", "test", f"--config.file={path}",
                              "alertname=GpuTrainInputBound", f"severity={severity}"],
                             capture_output=True, text=True)
        assert out.stdout.strip() == receiver, out.stdout + out.stderr
    # an alert naming a rank also goes to the daemon, which profiles it (README, "From what
    # to why"); people still get it
    out = subprocess.run([amtool, "config", "routes", "test", f"--config.file={path}",
                          "alertname=GpuTrainInputBound", "severity=warning", "run=llm",
                          "rank=3"], capture_output=True, text=True)
    assert out.stdout.strip() == "gputrain-profile,team", out.stdout + out.stderr


def test_systemd_unit_verifies_and_is_hardened(tmp_path):
    analyze = require_binary("systemd-analyze")
    unit = (DEPLOY / "systemd" / "gputrain-exporter.service").read_text()
    for setting in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                    "Restart=on-failure", "DevicePolicy=closed",
                    "DeviceAllow=char-nvidia-frontend rw",
                    "--config.file=/etc/gputrain-exporter/config.yml"):
        assert setting in unit, setting
    # verify checks that ExecStart exists: point it at the installed command
    installed = ENV_BIN / "gputrain-exporter"
    assert installed.is_file(), f"pip install . provides the gputrain-exporter command in {ENV_BIN}"
    local = tmp_path / "gputrain-exporter.service"
    local.write_text(unit.replace("/usr/local/bin/gputrain-exporter", str(installed)))
    out = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gputrain-exporter.service" not in out.stderr, out.stderr


def test_the_vmalert_unit_verifies_and_loads_the_global_rules_only(tmp_path):
    """deploy/scale-out/vmalert.service (the integration test runs its flags for real)."""
    analyze = require_binary("systemd-analyze")
    require_binary("vmalert", package="victoria-metrics")
    unit = (DEPLOY / "scale-out" / "vmalert.service").read_text()
    assert "-rule=/etc/gputrain-exporter/gputrain.global.rules.yml" in unit
    assert "DynamicUser=yes" in unit and "NoNewPrivileges=yes" in unit
    local = tmp_path / "vmalert.service"
    local.write_text(unit)
    out = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "vmalert.service" not in out.stderr, out.stderr


def test_the_scale_out_prometheus_configs_pass_promtool(tmp_path):
    """The shard and the federating global server, with their rule files beside them."""
    promtool = require_binary("promtool")
    from exporter.heuristics.rules import render

    for name, level in (("prometheus-shard.yml", "node"),
                        ("prometheus-global-federate.yml", "global")):
        d = tmp_path / name
        (d / "rules").mkdir(parents=True)
        (d / "rules" / f"gputrain.{level}.rules.yml").write_text(render(level=level))
        (d / name).write_text((DEPLOY / "scale-out" / name).read_text())
        out = subprocess.run([promtool, "check", "config", str(d / name)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_slurm_task_prolog_names_the_run_after_the_job():
    prolog = DEPLOY / "slurm" / "gputrain-task-prolog.sh"
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "81234", "SLURM_PROCID": "5"}
    lines = subprocess.run(["sh", str(prolog)], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    exported = dict(line.removeprefix("export ").split("=", 1) for line in lines)
    assert exported == {"GPUTRAIN_RUN": "81234"}
    # what the client then reports, under torchrun (whose run id defaults to "none")
    probe = ("from exporter.client.monitor import default_run, default_rank;"
             "print(default_run(), default_rank())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True,
                         env={**env, **exported, "TORCHELASTIC_RUN_ID": "none",
                              "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["81234", "5"]
    arrays = subprocess.run(["sh", str(prolog)], capture_output=True, text=True, check=True,
                            env={**env, "SLURM_ARRAY_JOB_ID": "900", "SLURM_ARRAY_TASK_ID": "3"})
    assert arrays.stdout.strip() == "export GPUTRAIN_RUN=900_3"


def test_dockerfile_is_non_root_exposes_the_port_and_sets_the_nvidia_runtime_env():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^EXPOSE 19400$", text, re.M)
    assert "NVIDIA_VISIBLE_DEVICES=all" in text and "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    for source in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is missing"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored


def test_the_package_the_image_installs_runs_the_daemon(tmp_path):
    """What the Dockerfile does (build a wheel of the repo, install it), then run it."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("gputrain_exporter-*.whl")
    env_dir = tmp_path / "venv"
    # a bare venv whose dependencies are the environment under test's (a .pth file adds its
    # site directories after the venv's own): never the base interpreter's alone, which may be
    # Debian's python without them
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (purelib / "environment-under-test.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    port, ingest = free_port(), free_port()
    proc = subprocess.Popen([str(env_dir / "bin" / "gputrain-exporter"), "--gpu.backend=demo",
                             "--demo.gpus=1", f"--web.listen-address=127.0.0.1:{port}",
                             f"--ingest.listen-address=127.0.0.1:{ingest}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        text = wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/metrics",
                                               timeout=2).text, timeout=20,
                          what="the installed exporter")
        wait_until(lambda: "gputrain_gpu_busy_seconds_total" in requests.get(
            f"http://127.0.0.1:{port}/metrics", timeout=2).text, timeout=20,
            what="a GPU sample")
        assert "gputrain_host_cpu_seconds_total" in text
        probe = subprocess.run([str(python), "-c", "import exporter, exporter.client, "
                                "exporter.reading.collectors; print(exporter.__file__)"],
                               cwd=tmp_path, capture_output=True, text=True, check=True)
        assert str(env_dir) in probe.stdout  # the installed copy, not the checkout
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_example_configs_start_real_prometheus_and_alertmanager(tmp_path):
    """Prometheus with the compose layout loads every rule group (one server does all levels);
    Alertmanager starts with the example routes."""
    etc = prometheus_as_compose_mounts_it(tmp_path / "etc")
    servers = [Prometheus(tmp_path, [], config_file=etc / "prometheus.yml"),
               Alertmanager(tmp_path, DEPLOY / "alertmanager" / "alertmanager.yml")]
    try:
        for server in servers:
            server.start()
        groups = requests.get(servers[0].url + "/api/v1/rules", timeout=2).json()["data"][
            "groups"]
        assert {g["name"] for g in groups} == {"gputrain.liveness", "gputrain.recording",
                                               "gputrain.alerts", "gputrain.global.alerts"}
        status = requests.get(servers[1].url + "/api/v2/status", timeout=2).json()
        assert "severity" in status["config"]["original"]
        # tiers of one signal nest: while the warning fires, its info is held back
        labels = {"alertname": "GpuTrainInputBound", "instance": "n1:19400", "run": "r",
                  "rank": "0"}
        other = {**labels, "rank": "1", "severity": "info"}
        r = requests.post(servers[1].url + "/api/v2/alerts", timeout=5, json=[
            {"labels": {**labels, "severity": "info"}}, {"labels": {**labels,
                                                                    "severity": "warning"}},
            {"labels": other}])
        assert r.status_code == 200, r.text

        want = {("0", "warning"): "active", ("0", "info"): "suppressed",
                ("1", "info"): "active"}
        got: dict[tuple[str, str], str] = {}

        def states() -> bool:
            # the inhibitor learns of the warning after the POST is answered: wait for it
            alerts = requests.get(servers[1].url + "/api/v2/alerts", timeout=2).json()
            got.clear()
            got.update({(a["labels"]["rank"], a["labels"]["severity"]): a["status"]["state"]
                        for a in alerts})
            return got == want

        try:
            wait_until(states, what="the info alert of rank 0 inhibited by its warning")
        finally:
            assert got == want
    finally:
        for server in servers:
            server.stop()


def test_the_pod_owners_overlay_reads_the_kubelet_socket_read_only():
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes-pod-owners")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (ds,) = [d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "--collector.kubernetes" in c["args"]
    socket = next(a for a in c["args"] if a.startswith("--kubernetes.pod-resources-socket="))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "pod-resources")
    assert mount["readOnly"] is True
    assert socket.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    assert c["securityContext"]["allowPrivilegeEscalation"] is False  # root, not privileged
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "--ingest.token-file=/etc/gputrain/token/token" in c["args"]  # the base's, kept


def test_every_deployment_keeps_the_ranks_on_a_writable_lasting_volume(manifests):
    """--ingest.state-file (a restart forgets no failed or vanished run) in a place each
    deployment keeps across the daemon's restart and lets it write."""
    flag = "--ingest.state-file=/var/lib/gputrain-exporter/ingest.json"
    unit = (DEPLOY / "systemd" / "gputrain-exporter.service").read_text()
    assert flag in unit and "StateDirectory=gputrain-exporter" in unit  # writable there
    (c,) = manifests["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert flag in c["args"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/gputrain-exporter")
    assert not mount.get("readOnly")
    volume = next(v for v in manifests["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert "emptyDir" in volume or "hostPath" in volume  # outlives the container
    exporter = compose("compose.yaml")["services"]["exporter"]
    assert flag in exporter["command"]
    assert "exporter-state:/var/lib/gputrain-exporter" in exporter["volumes"]
    assert "exporter-state" in compose("compose.yaml")["volumes"]
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "install -d -o 65532 -g 65532 /var/lib/gputrain-exporter" in dockerfile
    assert re.findall(r"^USER (\S+)", dockerfile, re.M)[-1] == "65532:65532"
