"""The RDMA source's optional pyverbs port attributes (MTU, GID and P_Key table sizes, message size). pyverbs is
never a hard dependency: when it cannot be imported, context_class() is None (exporters/rdma.py says when it is
used at all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("kvscope.exporters.rdma")

# ibv_mtu: IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5.
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def context_class() -> Callable[..., Any] | None:
    """pyverbs' Context class, or None when pyverbs (or the libibverbs under it) cannot be imported."""
    try:
        from pyverbs.device import Context  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a build whose shared libraries are missing
        return None
    return Context


def add_attributes(
    ports: Iterable[tuple[str, str, dict[str, str]]],
    add: Callable[[str, dict[str, str], int], None],
    context_class: Callable[..., Any],
) -> None:
    """Each (device, port, labels)'s port attributes, as add(name, labels, value) gauges; a device or port pyverbs
    cannot open or query is left out (logged at debug level)."""
    by_device: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for device, port, labels in ports:
        by_device.setdefault(device, []).append((port, labels))
    for device, port_labels in by_device.items():
        try:
            context = context_class(name=device)
        except Exception as error:  # no such device for libibverbs, no permission, ...
            log.debug("pyverbs cannot open %s: %s", device, error)
            continue
        try:
            for port, labels in port_labels:
                if not port.isdigit():
                    continue
                try:
                    attr = context.query_port(int(port))
                except Exception as error:
                    log.debug("pyverbs cannot query %s/%s: %s", device, port, error)
                    continue
                for name, value in _verbs_gauges(attr):
                    add(name, labels, value)
        finally:
            close = getattr(context, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as error:
                    log.debug("pyverbs close of %s failed: %s", device, error)


def _verbs_gauges(attr: Any) -> Iterable[tuple[str, int]]:
    for name, field_name in (("rdma_port_active_mtu_bytes", "active_mtu"), ("rdma_port_max_mtu_bytes", "max_mtu")):
        mtu = _MTU_BYTES.get(_int_attr(attr, field_name) or 0)
        if mtu is not None:
            yield name, mtu
    for name, field_name in (
        ("rdma_port_gid_table_size", "gid_tbl_len"),
        ("rdma_port_pkey_table_size", "pkey_tbl_len"),
        ("rdma_port_max_message_bytes", "max_msg_sz"),
    ):
        value = _int_attr(attr, field_name)
        if value is not None:
            yield name, value


def _int_attr(attr: Any, name: str) -> int | None:
    try:
        value = getattr(attr, name)
    except Exception:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
