"""Render one node's targets.yaml for the kvscope exporter DaemonSet, from a template and the node's labels.

It runs as the DaemonSet's init container, in the kvscope image (Python, PyYAML and kvscope itself), and writes
the file the exporter container then reads. The Downward API cannot expose a Node's labels to a pod, so it reads
its own Node object from the API server (`get nodes` only, granted by exporter/rbac.yaml) with a token projected
into this container alone.

What the labels say:
- `nic-role.kvscope.io/<device or netdev>=<role>`, e.g. `nic-role.kvscope.io/mlx5_0=dram`: merged into the
  `roles` of every rdma target of the template (a label wins over the template for the same key). Label names
  cannot hold "/", so a "<device>/<port>" key stays in the template.
- any label named by a template target's `node_label` (e.g. `kvscope.io/spdk=true`): the target is kept only on
  nodes where that label is "true" (an SPDK target exists on the storage nodes only). `node_label` is removed
  before the file is written: kvscope never sees it.
Besides: every rdma target gets `host: <node name>` unless the template sets one (the series' host label is the
Kubernetes node name, not whatever the host calls itself), and `exporter.listen_host` becomes LISTEN_HOST when set
(the node's IP under hostNetwork: the endpoint is not opened on the RDMA fabric's interfaces).

The result is validated with kvscope's own loader before it is written: a bad label value fails the init
container with the field named (kubectl describe pod / kubectl logs -c render-targets), never the exporter later.

Usage: render_targets.py --template TEMPLATE --out OUT   (NODE_NAME, and LISTEN_HOST optionally, in the environment)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import ssl
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROLE_PREFIX = "nic-role.kvscope.io/"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def render(template: dict, node_name: str, node_labels: dict[str, str], listen_host: str | None = None) -> dict:
    """The node's exporter configuration: the template with the node's NIC roles, host and optional targets."""
    config = copy.deepcopy(template)
    roles = {key.removeprefix(ROLE_PREFIX): value for key, value in node_labels.items() if key.startswith(ROLE_PREFIX)}
    targets = []
    for target in config.get("targets") or []:
        label = target.pop("node_label", None)
        if label is not None and node_labels.get(label) != "true":
            continue
        if target.get("source") == "rdma":
            target["roles"] = {**(target.get("roles") or {}), **roles}
            target.setdefault("host", node_name)
        targets.append(target)
    config["targets"] = targets
    if listen_host:
        config["exporter"] = {**(config.get("exporter") or {}), "listen_host": listen_host}
    return config


def node_labels(node_name: str) -> dict[str, str]:
    """The labels of Node `node_name`, read from the API server with the pod's projected service-account token."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    url = f"https://{netloc}/api/v1/nodes/{urllib.parse.quote(node_name)}"
    token = (SERVICE_ACCOUNT / "token").read_text().strip()
    context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=10, context=context) as answer:
        node = json.load(answer)
    return node.get("metadata", {}).get("labels") or {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from kvscope.exporters.config import ConfigError, parse_config

    node_name = os.environ["NODE_NAME"]
    template = yaml.safe_load(args.template.read_text())
    config = render(template, node_name, node_labels(node_name), os.environ.get("LISTEN_HOST"))
    try:
        parse_config(config, f"targets rendered for node {node_name}")
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 1
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"{args.out}: {len(config['targets'])} targets for node {node_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
