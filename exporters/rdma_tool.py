"""The RDMA source's optional `rdma -j statistic show` (iproute2): the netlink view of the hw counters plus the
optional counters sysfs never shows. Runs the tool and hands its stdout to the parser (exporters/rdma_text.py);
exporters/rdma.py says which counters it adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil

from kvscope.exporters.rdma_text import statistic_json

log = logging.getLogger("kvscope.exporters.rdma")


async def statistic_show(tool: str, timeout_s: float, target: str) -> list[tuple[str, str, dict[str, int]]] | None:
    """(device, port, counters) per port from `<tool> -j statistic show`; None when the tool is not found, cannot
    be run, exits non-zero (no NETLINK_RDMA, an old kernel), prints what is not that JSON or gives no answer
    within `timeout_s` (it is then killed and reaped). `target` names the target in the debug log."""
    binary = shutil.which(tool)
    if binary is None:
        return None
    try:
        process = await asyncio.create_subprocess_exec(
            binary,
            "-j",
            "statistic",
            "show",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as error:
        log.debug("%s: cannot run %s: %s", target, binary, error)
        return None
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except BaseException as error:  # timeout, or the scrape itself cancelled: do not leave the tool running
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        if isinstance(error, TimeoutError):
            log.debug("%s: %s gave no answer within %g s", target, binary, timeout_s)
            return None
        raise
    if process.returncode != 0:
        log.debug("%s: %s exited %s: %s", target, binary, process.returncode, err.decode(errors="replace")[:200])
        return None
    return statistic_json(out.decode(errors="replace"))
