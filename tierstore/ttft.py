"""Time to first token of one request, from the model, the GPUs and the fabric: pure functions, small dataclasses.

Why a model of its own: the engine emulator's simple TTFT (recomputed tokens / `prefill_tokens_per_s` + hit bytes
over each tier's bandwidth) has no context-length dependence of prefill, no link shared by the requests in flight,
no overlap of loading with compute and no prefill-to-decode transfer, so it cannot say when long contexts make the
network, not the GPUs, decide TTFT. The equations (README, 'TTFT model'):

    compute  = 2 x A x R / (F_gemm x n x e)  +  f_pair x (P^2 - H^2) / 2 / (F_bf16 x n x e)
    load     = max over links k of  sum over tiers t on k of  bytes_t x c / min(B_k x N_k x g_k, b_t)
    hidden   = (1 - o) x (compute + load) + o x (max(compute, load) + min(compute, load) / layers)
    transfer = P x kv_bytes_per_token x c / (B_ew x N_ew x g_ew)        (pd_disaggregated only)
    TTFT     = overhead + hidden + transfer

P prompt tokens, H of them hit (loaded), R = P - H recomputed; A active parameters; f_pair the attention FLOPs of
one query-key pair over all layers; F peak dense FLOPs of one GPU, n GPUs, e the efficiency (MFU); c requests in
flight sharing a link; B a NIC's bandwidth, N NICs, g goodput; b a tier medium's own read bandwidth; o the share
of loading that overlaps compute. Calibration on published measurements: kvscope.tierstore.calibration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

# Peak dense Tensor Core throughput per GPU, TFLOPS (vendor figures "with sparsity" halved), and GPU memory.
# Sources: NVIDIA H100 datasheet (SXM: BF16 1,979*, FP8 3,958* TFLOPS, * with sparsity; 80 GB), NVIDIA H200 datasheet
# (SXM: the same Tensor Core figures; 141 GB), NVIDIA HGX B200 in the Blackwell datasheet (8 GPUs: FP8 72* PFLOPS,
# BF16 36* PFLOPS; 180 GB each), NVIDIA L40S datasheet (BF16 362.05 / 733*, FP8 733 / 1,466*; 48 GB), NVIDIA A100
# datasheet (BF16 312 / 624*; no FP8; 80 GB). The H20 has no public NVIDIA datasheet: its figures (BF16 148, FP8
# 296 dense; 96 GB) are the ones server vendors publish for it.


@dataclass(frozen=True, slots=True)
class GpuClass:
    """One GPU model's public peak dense throughput: what prefill compute is divided by (times GPUs, efficiency).
    `fp8_tflops` None: the GPU has no FP8 Tensor Cores (its matmuls run at BF16)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    memory_gb: float
    source: str

    def gemm_flops(self, dtype: str) -> float:
        """Peak FLOP/s of the weight matmuls in `dtype` (fp8 falls back to bf16 on a GPU without FP8)."""
        tflops = self.fp8_tflops if dtype == "fp8" and self.fp8_tflops else self.bf16_tflops
        return tflops * 1e12


GPU_CLASSES: dict[str, GpuClass] = {
    "a100": GpuClass("A100 SXM", 312.0, None, 80, "NVIDIA A100 datasheet: BF16 312 TFLOPS dense"),
    "h20": GpuClass("H20", 148.0, 296.0, 96, "server vendors' H20 specifications: BF16 148, FP8 296 TFLOPS dense"),
    "l40s": GpuClass("L40S", 362.05, 733.0, 48, "NVIDIA L40S datasheet: BF16 362.05, FP8 733 TFLOPS dense"),
    "h100": GpuClass("H100 SXM", 989.5, 1979.0, 80, "NVIDIA H100 datasheet: BF16 1,979*, FP8 3,958* (sparse)"),
    "h200": GpuClass("H200 SXM", 989.5, 1979.0, 141, "NVIDIA H200 datasheet: BF16 1,979*, FP8 3,958* (sparse)"),
    "b200": GpuClass("B200", 2250.0, 4500.0, 180, "NVIDIA HGX B200 (8 GPUs): BF16 36*, FP8 72* PFLOPS (sparse)"),
}


@dataclass(frozen=True, slots=True)
class ModelCompute:
    """What a model's prefill costs in FLOPs: 2 x active parameters per token for the weight matmuls (an MoE
    computes only its active experts), and attention's quadratic term, `pair_flops` per query-key pair summed over
    layers: 2 x heads x (qk_head_dim + v_head_dim) per layer (QK^T and AV, a multiply-add being 2 FLOPs). MLA's
    prefill runs as multi-head attention over the decompressed keys (qk_nope + qk_rope dims), so its pair cost is
    that of its query heads, not of its compressed cache."""

    active_params: float
    layers: int
    pair_flops: float

    @classmethod
    def of(cls, active_params: float, layers: int, heads: int, qk_head_dim: int, v_head_dim: int) -> ModelCompute:
        return cls(active_params, layers, 2.0 * heads * (qk_head_dim + v_head_dim) * layers)

    def gemm_flops(self, new_tokens: int) -> float:
        return 2.0 * self.active_params * new_tokens

    def attention_flops(self, prompt_tokens: int, hit_tokens: int) -> float:
        """The new tokens (after the hit) each attend to every token before them (causal): (P^2 - H^2) / 2 pairs."""
        return self.pair_flops * (prompt_tokens**2 - hit_tokens**2) / 2.0


@dataclass(frozen=True, slots=True)
class Gpus:
    """The GPUs a request's prefill runs on (its tensor/expert-parallel group, e.g. one 8-GPU node) and the share of
    their peak it reaches (MFU): no kernel runs at the datasheet's peak, so `efficiency` is stated, not measured."""

    gpu: GpuClass
    count: int
    efficiency: float
    dtype: str = "fp8"  # of the weight matmuls; attention runs in BF16 (FlashAttention / FlashMLA prefill kernels)

    def compute_seconds(self, model: ModelCompute, prompt_tokens: int, hit_tokens: int) -> float:
        """Prefill of the tokens after the hit: the weight matmuls at the matmul dtype's peak, attention at BF16's."""
        scale = self.count * self.efficiency
        gemm = model.gemm_flops(prompt_tokens - hit_tokens) / (self.gpu.gemm_flops(self.dtype) * scale)
        attention = model.attention_flops(prompt_tokens, hit_tokens) / (self.gpu.bf16_tflops * 1e12 * scale)
        return gemm + attention


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a node's NICs of one network (east-west to the DRAM tier and other GPU nodes; north-south
    to the storage tier): `nics` NICs of `bandwidth` bytes/s each, of which `goodput` is what transfers get (a
    transfer engine such as Mooncake's stripes one request over all NICs). `concurrency` requests in flight share
    it evenly (RDMA congestion control approximates a fair share), so each gets bandwidth x nics x goodput / c."""

    bandwidth: float
    nics: int = 1
    goodput: float = 1.0
    concurrency: int = 1

    @property
    def total(self) -> float:
        return self.bandwidth * self.nics * self.goodput

    @property
    def share(self) -> float:
        """Bytes per second one request gets."""
        return self.total / self.concurrency


def load_seconds(reads: Mapping[str, list[tuple[int, float | None]]], links: Mapping[str, Link]) -> float:
    """Time to load a request's hits: per link, each tier's bytes over the request's share of the slower of the
    link and the tier's medium (a medium too is shared by the requests in flight); the tiers on one link one
    after the other, links (different NICs) at the same time. `reads`: link name -> [(bytes, medium bandwidth or
    None)]."""
    seconds = 0.0
    for name, parts in reads.items():
        link = links[name]
        on_link = 0.0
        for nbytes, medium in parts:
            if nbytes:
                rate = link.total if medium is None else min(link.total, medium)
                on_link += nbytes * link.concurrency / rate
        seconds = max(seconds, on_link)
    return seconds


def overlapped(compute: float, load: float, overlap: float, layers: int) -> float:
    """Compute and loading together when a share `overlap` of the loading runs layer by layer under compute (a
    connector that loads layer i + 1 while layer i computes): fully overlapped, the longer of the two plus one
    layer of the shorter (the pipeline's fill); not at all, their sum; in between, the linear blend."""
    pipelined = max(compute, load) + min(compute, load) / layers
    return (1.0 - overlap) * (compute + load) + overlap * pipelined


def pd_transfer_seconds(prompt_tokens: int, kv_bytes_per_token: int, link: Link) -> float:
    """PD disaggregation: the prefill node sends the whole prompt's KV (hit and computed) to the decode node over
    the east-west link before the first token, after the prefill (the decode node reads it once prefill is done,
    as vLLM's P/D connectors do); sends go out of the prefill node's NICs, loads come in, so they do not contend."""
    return prompt_tokens * kv_bytes_per_token / link.share


class TtftParts(NamedTuple):
    """One request's TTFT in parts that add up: the fixed overhead, prefill compute, the loading that compute did
    not hide, and the PD transfer. A tuple: every request served makes one, and a frozen dataclass costs twice the
    time to build."""

    overhead: float
    compute: float
    load: float
    pd_transfer: float

    @property
    def total(self) -> float:
        return self.overhead + self.compute + self.load + self.pd_transfer


@dataclass(frozen=True, slots=True)
class TtftModel:
    """Everything TTFT depends on beyond the request itself: the model's FLOPs and KV size, the GPUs, the links
    by name (`east_west`, `north_south`), the overlap, the topology and a fixed per-request overhead (scheduling,
    the connector's lookups, the request's way in and out: what no bandwidth or FLOP count explains). Without
    `gpus` (or `model`) prefill runs at `prefill_tokens_per_s`, whatever the context (the simple model's compute);
    `layers` is the pipeline depth of an overlapped load."""

    kv_bytes_per_token: int
    links: Mapping[str, Link]
    model: ModelCompute | None = None
    gpus: Gpus | None = None
    prefill_tokens_per_s: float = 10_000.0
    layers: int = 1
    overlap: float = 0.0
    pd_disaggregated: bool = False
    overhead: float = 0.0

    def compute_seconds(self, prompt_tokens: int, hit_tokens: int) -> float:
        if self.gpus is not None and self.model is not None:
            return self.gpus.compute_seconds(self.model, prompt_tokens, hit_tokens)
        return (prompt_tokens - hit_tokens) / self.prefill_tokens_per_s

    def parts(
        self, prompt_tokens: int, hit_tokens: int, reads: Mapping[str, list[tuple[int, float | None]]]
    ) -> TtftParts:
        """A request of `prompt_tokens`, `hit_tokens` of them loaded as `reads` (see `load_seconds`)."""
        compute = self.compute_seconds(prompt_tokens, hit_tokens)
        load = load_seconds(reads, self.links)
        together = overlapped(compute, load, self.overlap, self.layers)
        transfer = (
            pd_transfer_seconds(prompt_tokens, self.kv_bytes_per_token, self.links["east_west"])
            if self.pd_disaggregated
            else 0.0
        )
        return TtftParts(self.overhead, compute, max(0.0, together - compute), transfer)

    def of_hit(self, prompt_tokens: int, hit_tokens: int, link: str = "east_west") -> TtftParts:
        """A request whose hits all come over one link from a tier as fast as the link."""
        return self.parts(prompt_tokens, hit_tokens, {link: [(hit_tokens * self.kv_bytes_per_token, None)]})
