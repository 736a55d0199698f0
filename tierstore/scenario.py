"""Scenario files (YAML): the workload, the KV geometry, the engine and the arms of an A/B test.

Validated with pydantic so that a bad file fails with the field's dotted path and the reason, before anything
runs. Sizes accept B, KB, MB, GB, TB and KiB, MiB, GiB, TiB (see kvscope.units).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from kvscope.tierstore.backends import BACKENDS
from kvscope.tierstore.policies import POLICIES
from kvscope.tierstore.store import Placement
from kvscope.tierstore.ttft import GPU_CLASSES, Gpus, Link, ModelCompute
from kvscope.units import MAX_INTEGER, digits, parse_bandwidth, parse_duration, parse_size
from kvscope.validation import describe, read_yaml

# Sizes, bandwidths and durations are written as strings with units or as plain numbers: their JSON Schema (the
# OpenAPI document's) says both, and the unit rules are in docs/design.md, 'Units'.
_SIZE_INPUT = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "description": "bytes"},
        {"type": "string", "description": "a size with its unit (kB, MB, GB, TB, KiB, MiB, GiB, TiB, ...)",
         "examples": ["50GiB", "46.09TB"]},
    ]
}  # fmt: skip
_BANDWIDTH_INPUT = {
    "anyOf": [
        {"type": "number", "minimum": 1, "description": "bytes per second"},
        {"type": "string", "description": "a rate in bits or bytes per second", "examples": ["400Gb/s", "50GB/s"]},
    ]
}
_DURATION_INPUT = {
    "anyOf": [
        {"type": "number", "minimum": 0, "description": "seconds"},
        {"type": "string", "description": "a duration with its unit (ms, s, m, h, d)", "examples": ["50ms", "2s"]},
    ]
}
Bytes = Annotated[int, BeforeValidator(parse_size), WithJsonSchema(_SIZE_INPUT, mode="validation")]
BytesPerSecond = Annotated[float, BeforeValidator(parse_bandwidth), WithJsonSchema(_BANDWIDTH_INPUT, mode="validation")]


def _seconds(value: object) -> object:
    """A duration (e.g. 50ms, 2s) or a number of seconds; 0 is allowed (no pause)."""
    return 0.0 if value in (0, "0") else parse_duration(value)  # type: ignore[arg-type]


Seconds = Annotated[float, BeforeValidator(_seconds), WithJsonSchema(_DURATION_INPUT, mode="validation")]
# Arm and scenario names become file names (an arm's file-backed tiers), run names and metric labels: letters,
# digits, "_" and "-" only (no path separator, no dot, no quote or newline), as short as a label should be.
ARM_NAME, SCENARIO_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}"), re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,126}")


def _named(pattern: re.Pattern[str], what: str):
    def check(name: str) -> str:
        if not pattern.fullmatch(name):
            raise ValueError(f"{what} {name!r}: use letters, digits, _ and - only ({pattern.pattern})")
        return name

    return AfterValidator(check)


ArmName = Annotated[str, _named(ARM_NAME, "arm name")]
ScenarioName = Annotated[str, _named(SCENARIO_NAME, "scenario name")]
StoreKind = Literal["embedded", "mooncake"]
LinkName = Literal["east_west", "north_south"]
VLLM_MIN_LEASE_S = 1.0  # covers vLLM's gap between the connector's lookup and its load (see _vllm_engine_fits)
MOONCAKE_MIN_SEGMENT = 16 * 1024**2  # the store client refuses a smaller global segment ("at least 16777216")
DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
}


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file, the field and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _bounded_integers(cls, data: object) -> object:
        """No count or size beyond a 64-bit integer: a 4,300-digit number is a typo or an attack, and arithmetic
        on it (the service's work bound) would never end."""
        if isinstance(data, dict):
            for key, value in data.items():
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER:
                    raise ValueError(
                        f"{key}: an integer of {digits(value)} digits is more than kvscope takes (2^63 - 1)"
                    )
        return data


class MultiRoundWorkload(_Strict):
    """Multi-round chat: every round each session sends its whole conversation so far plus new user tokens."""

    kind: Literal["multi_round"]
    sessions: int = Field(gt=0)
    rounds: int = Field(gt=0)
    first_prompt_tokens: int = Field(gt=0, description="each session's first prompt, shared prefix included")
    user_tokens: int = Field(0, ge=0, description="new user tokens in each later round")
    output_tokens: int = Field(0, ge=0, description="tokens generated each round; they join the next prompt")
    output_cached: bool = Field(False, description="generated tokens' KV is stored when the request ends")
    shared_prefix_tokens: int = Field(0, ge=0, description="a prefix common to all sessions (system prompt)")
    order: Literal["round_robin", "shuffled"] = "round_robin"
    seed: int = Field(0, description="random seed for order: shuffled")
    keys: Literal["int", "vllm"] = Field(
        "int",
        description="block keys: int, a cheap integer chain; vllm, vLLM's own (SHA-256 of a block's token ids "
        "chained to its parent's key, PYTHONHASHSEED=0) over synthetic token ids, the keys a real connector stores",
    )

    @model_validator(mode="after")
    def _shared_prefix_fits(self) -> MultiRoundWorkload:
        if self.shared_prefix_tokens > self.first_prompt_tokens:
            raise ValueError("shared_prefix_tokens must not exceed first_prompt_tokens")
        return self


class TraceWorkload(_Strict):
    """Replay of a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)."""

    kind: Literal["trace"]
    path: Path
    block_tokens: int = Field(512, gt=0, description="tokens per hash_id block in the trace")
    round_seconds: float = Field(300.0, gt=0, description="width of the time window reported as one round")
    limit: int | None = Field(None, gt=0, description="replay only the first N requests")


class ModelShape(_Strict):
    """KV bytes per token from a model: 2 x layers x kv_heads x head_dim x dtype (MHA/GQA), or
    layers x (kv_lora_rank + qk_rope_head_dim) x dtype for MLA models such as DeepSeek-V3."""

    layers: int = Field(gt=0)
    dtype: str = "bf16"
    kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    kv_lora_rank: int | None = Field(None, gt=0)
    qk_rope_head_dim: int | None = Field(None, ge=0)
    # What prefill costs (the TTFT model with engine.gpu, kvscope.tierstore.ttft.ModelCompute)
    active_params: float | None = Field(
        None,
        gt=0,
        le=1e15,
        description="parameters a token goes through (an MoE's active ones), e.g. 37e9 for DeepSeek-R1",
    )
    attention_heads: int | None = Field(None, gt=0, description="query heads (attention's quadratic FLOPs)")
    qk_head_dim: int | None = Field(
        None, gt=0, description="query/key dims per head (default head_dim; MLA: qk_nope_head_dim + qk_rope_head_dim)"
    )
    v_head_dim: int | None = Field(None, gt=0, description="value dims per head (default head_dim)")

    @model_validator(mode="after")
    def _one_attention_kind(self) -> ModelShape:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        gqa = self.kv_heads is not None and self.head_dim is not None
        mla = self.kv_lora_rank is not None
        if gqa == mla:
            raise ValueError("give either kv_heads and head_dim (MHA/GQA) or kv_lora_rank (MLA)")
        return self

    def compute(self) -> ModelCompute | None:
        """The prefill FLOPs model, when the shape says enough of it (active_params and attention_heads; for MLA
        qk_head_dim and v_head_dim too); None otherwise."""
        qk, v = self.qk_head_dim or self.head_dim, self.v_head_dim or self.head_dim
        if self.active_params is None or self.attention_heads is None or qk is None or v is None:
            return None
        return ModelCompute.of(self.active_params, self.layers, self.attention_heads, qk, v)

    @property
    def bytes_per_token(self) -> int:
        width = DTYPE_BYTES[self.dtype]
        if self.kv_lora_rank is not None:
            return self.layers * (self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * width
        assert self.kv_heads is not None and self.head_dim is not None
        return 2 * self.layers * self.kv_heads * self.head_dim * width


class KvGeometry(_Strict):
    block_tokens: int | None = Field(None, gt=0, description="tokens per KV block (default 256)")
    bytes_per_token: Bytes | None = Field(None, gt=0)
    model: ModelShape | None = None

    @model_validator(mode="after")
    def _one_size_source(self) -> KvGeometry:
        if (self.bytes_per_token is None) == (self.model is None):
            raise ValueError("give exactly one of bytes_per_token or model")
        return self

    @property
    def token_bytes(self) -> int:
        return self.bytes_per_token if self.bytes_per_token is not None else self.model.bytes_per_token  # type: ignore[union-attr]


class TierSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    capacity: Bytes = Field(gt=0)
    policy: str = Field("lru", json_schema_extra={"enum": list(POLICIES)})
    backend: str = Field("accounting", json_schema_extra={"enum": list(BACKENDS)})
    path: Path | None = Field(None, description="file backend: the file that holds the tier's bytes")
    o_direct: bool = False
    read_bandwidth: BytesPerSecond | None = Field(None, description="bandwidth from engine to tier, e.g. 400Gb/s")
    link: LinkName | None = Field(
        None,
        description="with a fabric: the network its loads cross (default: east_west for the first tier, the DRAM "
        "tier; north_south for the tiers below it, storage)",
    )

    @model_validator(mode="after")
    def _known_names(self) -> TierSpec:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        return self


class MooncakeSettings(_Strict):
    """How kvscope runs a real Mooncake store for an arm: the master's flags and the client's environment that
    decide what is evictable when, and how the requests are paced against the lease."""

    lease_ttl: Seconds = Field(
        0.05, ge=0, description="-default_kv_lease_ttl: exist and get lease an object this long (unevictable)"
    )
    request_interval: Seconds = Field(
        0.1,
        ge=0,
        description="a request starts at least this long after the previous one started; longer than lease_ttl, "
        "so every earlier request's leases have expired when a put evicts (reproducible runs)",
    )
    eviction_high_watermark: float = Field(0.9, gt=0, le=1, description="-eviction_high_watermark_ratio")
    eviction_ratio: float = Field(0.05, gt=0, le=1, description="-eviction_ratio: share of objects evicted at once")
    put_retry_budget: Seconds = Field(
        2.0, ge=0, description="how long a put refused with -200 (no available handle) is retried"
    )
    local_buffer: Bytes = Field(16 * 1024**2, gt=0, description="the client's own transfer buffer")
    offload_buffer: Bytes = Field(
        64 * 1024**2,
        gt=0,
        description="MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES: the staging buffer of SSD reads (Mooncake's own "
        "default, 1.25 GiB, is resident memory the client holds)",
    )
    offload_heartbeat_s: int = Field(1, ge=1, description="MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS")
    offload_bucket: Bytes = Field(
        4 * 1024**2, gt=0, description="MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES: objects written to disk together"
    )
    start_timeout: Seconds = Field(60.0, gt=0, description="how long the master and client may take to be ready")


class ArmSpec(_Strict):
    store: StoreKind = Field(
        "embedded",
        description="embedded: kvscope's simulated store; mooncake: a real Mooncake master and store client "
        "that kvscope starts for the arm (tiers: dram = the global segment, then optionally ssd = SSD offload)",
    )
    placement: Placement = "replicate"
    promote_on_hit: bool = False
    tiers: list[TierSpec] = Field(min_length=1, description="the store's tiers, top first")
    attached: list[TierSpec] = Field(
        default_factory=list,
        description="tiers present in the arm's cluster that its store does not use (e.g. an idle NVMe-oF pool): "
        "exported with their counters so a verifier can prove nothing landed there",
    )
    mooncake: MooncakeSettings | None = Field(None, description="store: mooncake only (defaults when omitted)")
    mirror: bool = Field(
        False,
        description="store: mooncake or none: also run the arm's model on the embedded store, as arm <name>_sim",
    )

    @model_validator(mode="after")
    def _unique_tiers(self) -> ArmSpec:
        names = [tier.name for tier in self.tiers + self.attached]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique within an arm, got {names}")
        if self.store == "mooncake":
            _check_mooncake_arm(self)
        elif self.mirror and self.store == "embedded":
            raise ValueError("mirror applies to store: mooncake or none")
        elif self.store == "none" and (self.attached or self.mooncake is not None):
            raise ValueError("an arm of store: none (a vLLM engine alone) has no attached tiers or mooncake settings")
        elif any(tier.policy == "mooncake" for tier in self.tiers[1:] + self.attached):
            raise ValueError("policy mooncake models a Mooncake segment: the first tier only")
        elif self.mooncake is not None and self.tiers[0].policy != "mooncake":
            raise ValueError("mooncake settings apply to store: mooncake, or to a first tier of policy: mooncake")
        return self

    @property
    def mooncake_settings(self) -> MooncakeSettings:
        return self.mooncake or MooncakeSettings()

    def simulated(self, client_retries: bool = True) -> ArmSpec:
        """The embedded store's model of this arm: the same tiers, placement and attached tiers, its segment under
        Mooncake's policy with the arm's settings. `client_retries`: whether the client that puts retries a refused
        put (kvscope's own does; vLLM's connector does not)."""
        if not self.tiers:  # the engine alone: its model is the engine emulator's GPU tier, on no store
            return self.model_copy(update={"store": "embedded", "mirror": False})
        settings = self.mooncake_settings
        if not client_retries:
            settings = settings.model_copy(update={"put_retry_budget": 0.0})
        segment = self.tiers[0].model_copy(update={"policy": "mooncake"})
        return self.model_copy(
            update={"store": "embedded", "mooncake": settings, "mirror": False, "tiers": [segment, *self.tiers[1:]]}
        )


def _check_mooncake_arm(arm: ArmSpec) -> None:
    """A Mooncake arm's tiers are Mooncake's media, in order; what kvscope cannot set on them is refused."""
    names = [tier.name for tier in arm.tiers]
    if names not in (["dram"], ["dram", "ssd"]):
        raise ValueError(
            f"a mooncake arm's tiers are dram (the global segment), then optionally ssd (its SSD offload); got {names}"
        )
    if arm.tiers[0].capacity < MOONCAKE_MIN_SEGMENT:
        raise ValueError(
            f"a mooncake dram segment is at least {MOONCAKE_MIN_SEGMENT:,} B (16 MiB): Mooncake refuses less"
        )
    attached = [tier.name for tier in arm.attached]
    if attached and (attached != ["ssd"] or len(arm.tiers) != 1):
        raise ValueError("a mooncake arm can attach only an ssd tier, and only when its tiers are [dram]")
    for tier in arm.tiers + arm.attached:
        if tier.backend != "accounting" or tier.path is not None or tier.o_direct or tier.read_bandwidth is not None:
            raise ValueError(
                f"tier {tier.name!r}: backend, path, o_direct and read_bandwidth do not apply to Mooncake's media "
                "(its gets are timed for real)"
            )
    if arm.promote_on_hit:
        raise ValueError("promote_on_hit is not supported with store: mooncake")


class EngineAloneArm(ArmSpec):
    """`store: none`: the engine alone, no store behind it (a vLLM engine's own prefix cache: vLLM alone)."""

    store: Literal["none"] = Field(description="none: the engine alone (vLLM alone), no tiers")  # type: ignore[assignment]
    tiers: list[TierSpec] = Field(default_factory=list, max_length=0)


def _arm_kind(arm: object) -> str:
    store = arm.get("store") if isinstance(arm, dict) else getattr(arm, "store", None)
    return "union-engine-alone" if store == "none" else "union-store"


# The tags name the union's branch, not a field: error messages leave "union-..." out of the path
AnyArm = Annotated[
    Annotated[ArmSpec, Tag("union-store")] | Annotated[EngineAloneArm, Tag("union-engine-alone")],
    Discriminator(_arm_kind),
]


class GpuCacheSpec(_Strict):
    capacity: Bytes = Field(gt=0)
    policy: str = "tail_first"


class VllmSettings(_Strict):
    """A real vLLM engine per arm (kvscope.tierstore.vllm): a tiny model of the scenario's `kv.model` shape, its
    prefix cache `gpu_blocks` blocks of `kv.block_tokens` (vLLM keeps one back)."""

    gpu_blocks: int = Field(gt=1, description="--num-gpu-blocks-override: the GPU tier, in blocks")
    heads: int = Field(4, gt=0, description="attention heads; the model's hidden size is heads x kv.model.head_dim")
    vocab: int = Field(4000, ge=100, description="words of the tiny model's vocabulary")
    max_model_len: int | None = Field(
        None, gt=0, description="default: the longest prompt and output of the workload, at most 4096"
    )
    start_timeout: Seconds = Field(300.0, gt=0, description="how long the server may take to be ready")
    request_timeout: Seconds = Field(
        60.0,
        gt=0,
        le=600,
        description="how long one chat request may take (a load that fails again and again, which vLLM's connector "
        "recomputes and retries without end, fails the arm here with the server's account of it)",
    )


def _overlap(value: object) -> object:
    """on/off (true/false) or the share of the loading that overlaps compute."""
    return float(value) if isinstance(value, bool) else value


class FabricSpec(_Strict):
    """The networks a request's KV crosses (kvscope.tierstore.ttft.Link): east-west between GPU servers and the
    DRAM tier (and, PD-disaggregated, from prefill to decode nodes); north-south from GPU servers to the storage
    tier. Each is a NIC's bandwidth times the NICs of a node (one request is striped over all of them) times the
    goodput transfers reach, shared by the requests in flight (engine.concurrency)."""

    east_west: BytesPerSecond = Field(description="a NIC's east-west bandwidth, e.g. 400Gb/s")
    north_south: BytesPerSecond | None = Field(None, description="a NIC's north-south bandwidth, e.g. 200Gb/s")
    nics: int = Field(1, ge=1, description="east-west NICs of a GPU node")
    north_south_nics: int = Field(1, ge=1, description="north-south NICs of a GPU node")
    # at least 0.001, as efficiency below: a time stays finite (the service answers it as JSON)
    east_west_goodput: float = Field(1.0, ge=0.001, le=1, description="share of the east-west line rate transfers get")
    north_south_goodput: float = Field(1.0, ge=0.001, le=1, description="share of the north-south line rate they get")

    def links(self, concurrency: int) -> dict[str, Link]:
        links = {"east_west": Link(self.east_west, self.nics, self.east_west_goodput, concurrency)}
        if self.north_south is not None:
            links["north_south"] = Link(self.north_south, self.north_south_nics, self.north_south_goodput, concurrency)
        return links


class GpuSpec(_Strict):
    """The GPUs a request's prefill runs on: a class of kvscope.tierstore.ttft.GPU_CLASSES (its public peak dense
    FLOPs), how many, and the share of their peak prefill reaches (MFU)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, serialize_by_alias=True)

    kind: str = Field(alias="class", json_schema_extra={"enum": list(GPU_CLASSES)})
    count: int = Field(8, ge=1, description="GPUs of one request's prefill (e.g. one 8-GPU node)")
    efficiency: float = Field(0.4, ge=0.001, le=1, description="model FLOPs utilization of prefill")
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="of the weight matmuls; attention runs in BF16")

    @model_validator(mode="after")
    def _known_class(self) -> GpuSpec:
        if self.kind not in GPU_CLASSES:
            raise ValueError(f"class {self.kind!r} is not one of {', '.join(GPU_CLASSES)}")
        return self

    def gpus(self) -> Gpus:
        return Gpus(GPU_CLASSES[self.kind], self.count, self.efficiency, self.dtype)


class EngineSpec(_Strict):
    kind: Literal["emulator", "vllm"] = Field(
        "emulator", description="emulator: kvscope's model of an engine; vllm: a real vLLM server per arm"
    )
    prefill_tokens_per_s: float = Field(
        10_000.0, ge=1, description="recompute throughput for the TTFT model (at least 1 token/s: a time stays finite)"
    )
    gpu_cache: GpuCacheSpec | None = Field(None, description="a GPU-local prefix cache in front of the tiers")
    vllm: VllmSettings | None = Field(None, description="kind: vllm only")
    # The TTFT model (kvscope.tierstore.ttft), on with gpu or a fabric; without them, the simple one above
    gpu: GpuSpec | None = Field(None, description="prefill compute from the model's FLOPs on these GPUs")
    topology: Literal["colocated", "pd_disaggregated"] = Field(
        "colocated",
        description="pd_disaggregated: prefill nodes send the prompt's KV to decode nodes over east-west before "
        "the first token",
    )
    overlap_loading: Annotated[float, BeforeValidator(_overlap)] = Field(
        0.0, ge=0, le=1, description="share of the loading that runs layer by layer under compute (true: 1)"
    )
    concurrency: int = Field(1, ge=1, description="requests in flight sharing a link")
    overhead: Seconds = Field(0.0, ge=0, description="fixed time of every request (scheduling, lookups, ...)")

    @model_validator(mode="after")
    def _vllm_settings(self) -> EngineSpec:
        if self.kind == "vllm" and self.vllm is None:
            raise ValueError("kind: vllm needs vllm: {gpu_blocks: ...}")
        if self.kind != "vllm" and self.vllm is not None:
            raise ValueError("vllm settings apply to kind: vllm only")
        if self.kind == "vllm" and self.gpu_cache is not None:
            raise ValueError("with kind: vllm the GPU tier is vLLM's own prefix cache (vllm.gpu_blocks), not gpu_cache")
        if self.kind == "vllm" and self.gpu is not None:
            raise ValueError("engine.gpu models an emulated engine's TTFT; a real vLLM engine's is measured")
        return self

    @property
    def ttft_knobs(self) -> list[str]:
        """The TTFT model's keys set away from their defaults (they need engine.gpu or a fabric)."""
        defaults = {"topology": "colocated", "overlap_loading": 0.0, "concurrency": 1, "overhead": 0.0}
        return [key for key, default in defaults.items() if getattr(self, key) != default]


class PredictionSpec(_Strict):
    collapse_tolerance: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="a round has collapsed when its hit ratio is below (1 - this) x its ideal",
    )


class Scenario(_Strict):
    name: ScenarioName = "scenario"
    description: str = ""
    workload: Annotated[MultiRoundWorkload | TraceWorkload, Field(discriminator="kind")]
    kv: KvGeometry
    engine: EngineSpec = EngineSpec()
    fabric: FabricSpec | None = Field(None, description="the networks of the TTFT model (kvscope.tierstore.ttft)")
    prediction: PredictionSpec = PredictionSpec()
    arms: dict[ArmName, AnyArm] = Field(min_length=1)

    @model_validator(mode="after")
    def _ttft_model_fits(self) -> Scenario:
        engine = self.engine
        if engine.gpu is None and self.fabric is None:
            if engine.ttft_knobs:
                raise ValueError(f"engine.{engine.ttft_knobs[0]} is part of the TTFT model: give engine.gpu or fabric")
            return self
        if engine.kind == "vllm":
            raise ValueError("the TTFT model (engine.gpu, fabric) is an emulated engine's; a real vLLM's is measured")
        if engine.gpu is not None and (self.kv.model is None or self.kv.model.compute() is None):
            raise ValueError("engine.gpu needs kv.model with active_params and attention_heads (and, for MLA, "
                             "qk_head_dim and v_head_dim): the FLOPs of prefill")  # fmt: skip
        if self.fabric is None:
            raise ValueError("the TTFT model needs a fabric: {east_west: ...} (the links loads and transfers cross)")
        for name, arm in self.arms.items():
            if arm.store == "mooncake":
                raise ValueError(f"arm {name!r}: a real Mooncake store's loads are timed, not modelled (fabric)")
            for index, tier in enumerate(arm.tiers):
                if self.tier_link(arm, index) == "north_south" and self.fabric.north_south is None:
                    raise ValueError(f"arm {name!r}, tier {tier.name!r} loads over north_south: give "
                                     "fabric.north_south")  # fmt: skip
        return self

    @staticmethod
    def tier_link(arm: ArmSpec, index: int) -> str:
        """The network the loads of the arm's tier `index` cross: its `link`, else east_west for the first tier (the
        DRAM tier), north_south for those below it (storage)."""
        return arm.tiers[index].link or ("east_west" if index == 0 else "north_south")

    @model_validator(mode="after")
    def _block_size_agrees(self) -> Scenario:
        if isinstance(self.workload, TraceWorkload) and self.kv.block_tokens not in (
            None,
            self.workload.block_tokens,
        ):
            raise ValueError(
                f"kv.block_tokens ({self.kv.block_tokens}) differs from the trace's block_tokens "
                f"({self.workload.block_tokens}): trace hash_ids fix the block size"
            )
        return self

    @model_validator(mode="after")
    def _mooncake_arms_fit(self) -> Scenario:
        for name, arm in self.arms.items():
            if arm.store == "none" and self.engine.kind != "vllm":
                raise ValueError(f"arm {name!r} has store: none: only a vLLM engine serves an arm alone")
            if arm.mirror and f"{name}_sim" in self.arms:
                raise ValueError(f"arm {name!r} is mirrored as {name}_sim, which names another arm")
            if arm.store == "mooncake" and self.block_bytes > arm.tiers[0].capacity:
                raise ValueError(
                    f"arm {name!r}: a block ({self.block_bytes:,} B) is larger than the dram segment "
                    f"({arm.tiers[0].capacity:,} B): Mooncake could never store it (-200 forever)"
                )
        return self

    @model_validator(mode="after")
    def _vllm_engine_fits(self) -> Scenario:
        if self.engine.kind != "vllm":
            return self
        model = self.kv.model
        if not isinstance(self.workload, MultiRoundWorkload):
            raise ValueError("engine.kind vllm serves multi-round chat workloads (a trace has no text)")
        if self.block_tokens % 32:
            raise ValueError(f"engine.kind vllm: kv.block_tokens must be a multiple of 32 (vLLM's CPU attention), "
                             f"not {self.block_tokens}")  # fmt: skip
        if model is None or model.kv_heads is None or model.dtype not in ("bf16", "bfloat16", "fp16", "float16",
                                                                          "fp32", "float32"):  # fmt: skip
            raise ValueError("engine.kind vllm: give kv.model {layers, kv_heads, head_dim, dtype: bf16|fp16|fp32}, "
                             "the shape of the model kvscope makes")  # fmt: skip
        for name, arm in self.arms.items():
            if arm.store == "none":  # vLLM alone: its prefix cache, no connector
                continue
            if arm.store != "mooncake":
                raise ValueError(f"engine.kind vllm: arm {name!r} must be store: mooncake (its tiers are reached "
                                 "through vLLM's Mooncake connector), or store: none (vLLM alone)")  # fmt: skip
            if arm.mooncake_settings.lease_ttl < VLLM_MIN_LEASE_S:
                raise ValueError(
                    f"engine.kind vllm: arm {name!r}: mooncake.lease_ttl must be at least {VLLM_MIN_LEASE_S:g} s: "
                    "vLLM's scheduler looks blocks up (which leases them) a step before its worker loads them, and "
                    "a lease that ran out fails the load with -707 and the request with it"
                )
        if self.vllm_max_model_len > (self.engine.vllm.gpu_blocks - 1) * self.block_tokens:  # type: ignore[union-attr]
            raise ValueError(
                f"engine.vllm.gpu_blocks: {self.engine.vllm.gpu_blocks} blocks cannot hold one request of "  # type: ignore[union-attr]
                f"{self.vllm_max_model_len} tokens (vLLM keeps one block back)"
            )
        return self

    @property
    def vllm_max_model_len(self) -> int:
        """The real engine's --max-model-len: as set, else the workload's longest prompt and output."""
        settings, workload = self.engine.vllm, self.workload
        if settings is not None and settings.max_model_len:
            return settings.max_model_len
        assert isinstance(workload, MultiRoundWorkload)
        longest = workload.first_prompt_tokens + workload.rounds * (workload.output_tokens + workload.user_tokens)
        return min(4096, -(-longest // self.block_tokens) * self.block_tokens)

    def served_apart(self, name: str) -> bool:
        """Whether a runnable arm is served by real processes (a Mooncake store, a vLLM engine): such arms run at
        the same time, each in a thread of its own; the embedded store's arms run one after the other."""
        return self.runnable_arms[name].store != "embedded"

    @property
    def runnable_arms(self) -> dict[str, ArmSpec]:
        """The arms to run, in order: each arm, followed by `<name>_sim` where it asks for a mirror."""
        arms: dict[str, ArmSpec] = {}
        for name, arm in self.arms.items():
            arms[name] = arm
            if arm.mirror:
                arms[f"{name}_sim"] = arm.simulated(client_retries=self.engine.kind != "vllm")
        return arms

    @property
    def block_tokens(self) -> int:
        if isinstance(self.workload, TraceWorkload):
            return self.workload.block_tokens
        return self.kv.block_tokens or 256

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv.token_bytes


def parse_scenario(data: object, source: str = "scenario", base_dir: Path | None = None) -> Scenario:
    """Validate a scenario mapping; relative trace paths resolve against `base_dir` (the file's folder)."""
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as error:
        raise ScenarioError("\n".join(describe(error, source, "scenario"))) from None
    if isinstance(scenario.workload, TraceWorkload) and base_dir and not scenario.workload.path.is_absolute():
        workload = scenario.workload.model_copy(update={"path": base_dir / scenario.workload.path})
        scenario = scenario.model_copy(update={"workload": workload})
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    path = Path(path)
    return parse_scenario(read_yaml(path, "scenario", ScenarioError), str(path), path.parent)
