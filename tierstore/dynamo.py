"""A real NVIDIA Dynamo stack kvscope starts and owns: a frontend with its KV router in front of mocker workers
(Dynamo's simulated engine: a real KV block manager, real KV events and metrics, no GPU), from a virtualenv of its
own (`make dynamo-env`), everything on 127.0.0.1.

No etcd and no NATS: discovery is a directory of files (`DYN_DISCOVERY_BACKEND=file`, emptied before each start:
an entry a killed worker left behind would be routed to), requests go over TCP and events over ZeroMQ. In its
direct mode every ZeroMQ publisher binds all interfaces (`tcp://0.0.0.0:0`, whatever `DYN_EVENT_PLANE_HOST` says:
that only sets the address it advertises), so the stack runs Dynamo's broker mode: publishers connect to the XSUB
socket and subscribers to the XPUB socket of `EventRelay`, a ZeroMQ forwarder kvscope binds on 127.0.0.1 (the wheel
ships no broker of its own). The model is the tiny word-level one of the vLLM engine (kvscope.tierstore.vllm_side.
tiny_model: a config, a tokenizer trained on the spot, a chat template; no weights), so every word is one token and
prompt lengths are exact. Stop with SIGTERM: a worker killed outright leaves its discovery entry behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from kvscope.processes import HOST, OwnedProcess, ProcessError, free_port, wait_until
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.vllm import words
from kvscope.tierstore.workloads import MultiRoundWorkload, Request

_SIDE = Path(__file__).resolve().parent / "vllm_side"


def dynamo_python() -> Path:
    """The Dynamo virtualenv's interpreter: $KVSCOPE_DYNAMO_PYTHON, else `.venv-dynamo` of this source checkout."""
    configured = os.environ.get("KVSCOPE_DYNAMO_PYTHON")
    return Path(configured) if configured else Path(__file__).resolve().parents[1] / ".venv-dynamo" / "bin" / "python"


@functools.cache
def dynamo_missing() -> str | None:
    """Why a real Dynamo stack cannot run here, or None."""
    python = dynamo_python()
    if not python.exists():
        return f"no Dynamo interpreter at {python} (make dynamo-env, or set KVSCOPE_DYNAMO_PYTHON)"
    probe = subprocess.run(
        [str(python), "-c", "import dynamo.frontend, dynamo.mocker, tokenizers, transformers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return f"Dynamo does not import in {python}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def dynamo_version() -> str:
    """The installed ai-dynamo distribution's version."""
    found = subprocess.run(
        [str(dynamo_python()), "-c", "import importlib.metadata as m; print(m.version('ai-dynamo'))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return found.stdout.strip()


_system_ports: set[int] = set()  # every port system_port handed out in this process


def system_port(host: str = HOST) -> int:
    """A free TCP port of `host` below 32768 for a worker's system server: Dynamo 1.6 reads DYN_SYSTEM_PORT as a
    signed 16-bit number and refuses the kernel's ephemeral ports (32768 and up), which `free_port` hands out."""
    chooser = random.Random()
    for _ in range(1000):
        port = chooser.randrange(20000, 32768)
        if port in _system_ports:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        _system_ports.add(port)
        return port
    raise ProcessError(f"no free port of {host} between 20000 and 32767 in 1000 tries")


def build_tiny_model(directory: Path, vocab: int = 4000, max_model_len: int = 4096) -> Path:
    """The tiny model's directory, written with the Dynamo virtualenv's tokenizers and transformers."""
    shape = {"vocab": vocab, "hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "max_model_len": max_model_len,
             "dtype": "bfloat16"}  # fmt: skip
    made = subprocess.run(
        [str(dynamo_python()), str(_SIDE / "tiny_model.py"), str(directory), json.dumps(shape)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if made.returncode != 0:
        raise ProcessError(f"making the tiny model failed: {made.stderr.strip()[-2000:]}")
    return directory


class EventRelay:
    """Dynamo's ZeroMQ event plane in broker mode: publishers connect to `xsub`, subscribers to `xpub`, both bound
    on 127.0.0.1; a forwarder thread passes every message (and the subscriptions the other way) until `stop`."""

    def __init__(self) -> None:
        self.xsub, self.xpub = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
        self._context = zmq.Context()
        self._control = f"inproc://relay-control-{id(self)}"
        self._stopper = self._context.socket(zmq.PAIR)
        self._stopper.bind(self._control)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._forward, args=(ready,), name="dynamo event relay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise ProcessError("the Dynamo event relay did not bind its sockets")

    @property
    def broker_url(self) -> str:
        """The value of DYN_ZMQ_BROKER_URL that points Dynamo's processes here."""
        return f"xsub={self.xsub} , xpub={self.xpub}"

    def _forward(self, ready: threading.Event) -> None:
        inbound, outbound = self._context.socket(zmq.XSUB), self._context.socket(zmq.XPUB)
        control = self._context.socket(zmq.PAIR)
        try:
            inbound.bind(self.xsub)
            outbound.bind(self.xpub)
            control.connect(self._control)
            ready.set()
            zmq.proxy_steerable(inbound, outbound, None, control)  # returns on TERMINATE
        finally:
            for socket in (inbound, outbound, control):
                socket.close(linger=0)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stopper.send(b"TERMINATE")
            self._thread.join(10)
        self._stopper.close(linger=0)
        self._context.term()


@dataclass(frozen=True, slots=True)
class MockerSettings:
    """One mocker worker's engine: its KV cache (blocks of `block_tokens`), how many requests it runs at once,
    and how much faster than the simulated hardware it runs (`speedup`; 0 would drop every delay)."""

    gpu_blocks: int = 256
    block_tokens: int = 16
    max_num_seqs: int = 256
    speedup: float = 1000.0
    engine_type: str = "vllm"


class DynamoStack:
    """`dynamo.frontend --router-mode kv` and one `dynamo.mocker` process per worker, each worker's /metrics on a
    system port of its own, the frontend's on its HTTP port; started in `workdir` (its discovery directory, logs
    and the tiny model)."""

    def __init__(self, workdir: Path, workers: int = 2, mocker: MockerSettings = MockerSettings(),
                 model_name: str = "tiny") -> None:  # fmt: skip
        self.workdir, self.model_name, self.mocker = workdir, model_name, mocker
        self.model_dir = workdir / "model"
        if not (self.model_dir / "tokenizer.json").exists():
            build_tiny_model(self.model_dir)
        self.discovery = workdir / "discovery"
        shutil.rmtree(self.discovery, ignore_errors=True)
        self.discovery.mkdir(parents=True)
        self.relay = EventRelay()
        self.http_port = free_port()
        self.url = f"http://{HOST}:{self.http_port}"
        self.worker_ports = [system_port() for _ in range(workers)]
        self.processes: list[OwnedProcess] = []
        try:
            self.frontend = self._start(
                "frontend",
                ["dynamo.frontend", "--router-mode", "kv", "--http-host", HOST, "--http-port", str(self.http_port)],
                {},
            )
            self.workers = [
                self._start(f"mocker-{index}", ["dynamo.mocker", "--model-path", str(self.model_dir),
                                                "--model-name", model_name, "--speedup-ratio", str(mocker.speedup),
                                                "--block-size", str(mocker.block_tokens),
                                                "--num-gpu-blocks-override", str(mocker.gpu_blocks),
                                                "--max-num-seqs", str(mocker.max_num_seqs),
                                                "--engine-type", mocker.engine_type],
                            {"DYN_SYSTEM_PORT": str(port)})
                for index, port in enumerate(self.worker_ports)
            ]  # fmt: skip
        except BaseException:
            self.stop()
            raise

    @property
    def worker_metrics_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}/metrics" for port in self.worker_ports]

    def _start(self, name: str, module_args: list[str], extra_env: dict[str, str]) -> OwnedProcess:
        environment = {
            **os.environ,
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(self.discovery),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_ZMQ_BROKER_URL": self.relay.broker_url,
            "DYN_EVENT_PLANE_HOST": HOST,
            "DYN_TCP_RPC_HOST": HOST,
            "DYN_TCP_RESPONSE_STREAM_HOST": HOST,
            "DYN_SYSTEM_HOST": HOST,
            "DYN_HTTP_HOST": HOST,
            "HF_HUB_OFFLINE": "1",
            "HOME": str(self.workdir),  # the frontend keeps copies of the model cards under ~/.cache/dynamo
            "DYN_LOG": "info",
            **extra_env,
        }
        environment.pop("VIRTUAL_ENV", None)
        process = OwnedProcess(
            f"dynamo {name}",
            [str(dynamo_python()), "-m", *module_args],
            self.workdir / f"{name}.log",
            env=environment,
            cwd=self.workdir,
        )
        self.processes.append(process)
        return process

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every worker serves /metrics and the frontend lists the model with every worker behind it."""

        def serves(url: str) -> bool:
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        for url in self.worker_metrics_urls:
            wait_until(lambda url=url: serves(url), f"a Dynamo worker's {url}", timeout_s, self.processes)

        def model_listed() -> bool:
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2).json().get("data", [])
            except (httpx.HTTPError, ValueError):
                return False
            return any(model.get("id") == self.model_name for model in models)

        wait_until(model_listed, f"the Dynamo frontend at {self.url} to list {self.model_name}", timeout_s,
                   self.processes)  # fmt: skip
        wait_until(lambda: len(self.registered_workers()) == len(self.workers),
                   f"the Dynamo frontend to see {len(self.workers)} workers", timeout_s, self.processes)  # fmt: skip

    def registered_workers(self) -> set[str]:
        """The worker ids (decimal) the frontend's KV router has registered, from its own /metrics."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=2).text
        except httpx.HTTPError:
            return set()
        return {
            line.split('router_worker_id="', 1)[1].split('"', 1)[0]
            for line in text.splitlines()
            if line.startswith("dynamo_component_router_worker_registered{")
            and 'router_worker_id="' in line
            and not line.rstrip().endswith(" 0")
        }

    def chat(self, client: httpx.Client, messages: list[dict], output_tokens: int) -> dict:
        """One chat completion of exactly `output_tokens` tokens (EOS ignored); the response."""
        body = {"model": self.model_name, "messages": messages, "max_tokens": output_tokens,
                "min_tokens": output_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
        try:
            response = client.post(f"{self.url}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            raise ProcessError(f"Dynamo frontend: chat request failed: {error!r}\n{self.frontend.tail()}") from None
        if response.status_code != 200:
            raise ProcessError(
                f"Dynamo frontend: chat answered {response.status_code}: {response.text[:500]}\n{self.frontend.tail()}"
            )
        return response.json()

    def stop(self) -> None:
        """SIGTERM to the workers, then the frontend (each its own process group), then the relay."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessError, OSError):
                process.stop(timeout_s=15)
        self.relay.stop()


# Where each session's and each round's new words start in the tiny model's vocabulary: sessions never share a
# block past the shared prefix, so every cache hit is a session's own history (or the shared system prompt).
SESSION_STRIDE, ROUND_STRIDE = 397, 1733


@dataclass
class Served:
    """What the frontend answered, summed over the responses: their usage."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    per_round: list[dict[str, int]] = field(default_factory=list)


class Conversations:
    """kvscope's multi-round chat workload (kvscope.tierstore.workloads.MultiRoundWorkload) as OpenAI chat requests
    to a Dynamo frontend: each session sends its whole conversation so far (the shared prefix as a system message,
    its turns, the engine's answers) plus new user words, so prefixes repeat round after round. Every response's
    prompt tokens are checked against the workload's, and its usage summed (`served`)."""

    def __init__(self, stack: DynamoStack, workload: spec.MultiRoundWorkload, vocab: int = 4000) -> None:
        self.stack, self.spec, self.vocab = stack, workload, vocab
        self.workload = MultiRoundWorkload(workload, stack.mocker.block_tokens)
        self.history: dict[int, list[dict[str, str]]] = {}
        self.served = Served()
        self._lock = threading.Lock()

    def run(self, client: httpx.Client, parallel: int = 1,
            after_round: Callable[[int], None] | None = None) -> Served:  # fmt: skip
        """Every round in turn, its requests `parallel` at a time; `after_round(number)` once each round is done."""
        for requests in self.workload.rounds():
            before = (self.served.prompt_tokens, self.served.cached_tokens)
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                for outcome in pool.map(lambda request: self._turn(client, request), requests):
                    del outcome
            self.served.per_round.append({"round": requests[0].round if requests else 0,
                                          "prompt_tokens": self.served.prompt_tokens - before[0],
                                          "cached_tokens": self.served.cached_tokens - before[1]})  # fmt: skip
            if after_round is not None and requests:
                after_round(requests[0].round)
        return self.served

    def _turn(self, client: httpx.Client, request: Request) -> None:
        w, vocab = self.spec, self.vocab
        messages = self.history.setdefault(request.session, [])
        start = (request.session * SESSION_STRIDE + request.round * ROUND_STRIDE) % vocab
        if not messages:
            if w.shared_prefix_tokens:
                messages.append({"role": "system", "content": words(0, w.shared_prefix_tokens, vocab)})
            messages.append(
                {"role": "user", "content": words(start, w.first_prompt_tokens - w.shared_prefix_tokens, vocab)}
            )
        elif w.user_tokens:
            messages.append({"role": "user", "content": words(start, w.user_tokens, vocab)})
        answer = self.stack.chat(client, messages, max(w.output_tokens, 1))
        usage, content = answer["usage"], answer["choices"][0]["message"]["content"] or ""
        if usage["prompt_tokens"] != request.prompt_tokens or len(content.split()) != max(w.output_tokens, 1):
            raise ProcessError(
                f"session {request.session} round {request.round}: {usage['prompt_tokens']} prompt tokens (the "
                f"workload says {request.prompt_tokens}), {len(content.split())} words back"
            )
        if w.output_tokens:
            messages.append({"role": "assistant", "content": content})
        with self._lock:
            self.served.requests += 1
            self.served.prompt_tokens += usage["prompt_tokens"]
            self.served.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.served.completion_tokens += usage["completion_tokens"]


if __name__ == "__main__":  # `python -m kvscope.tierstore.dynamo`: whether a real Dynamo stack can run here
    print(dynamo_missing() or f"Dynamo ready in {dynamo_python()}")
    sys.exit(0 if dynamo_missing() is None else 1)
