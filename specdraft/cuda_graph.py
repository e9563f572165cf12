"""CUDA-graph capture and replay keyed by batch descriptors.

One graph per BatchExecutionDescriptor. `capture` walks the descriptors largest first;
for each it asks the caller's factory for a fresh closure twice, once for an eager
warm-up and once for the capture, so that the buffers each pass runs on were prepared
for exactly that descriptor (docs/architecture.md, "The capture rule"). `dispatch` maps a real batch
to the smallest captured descriptor that fits it; `replay` runs that graph.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.kernels import as_int

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    NONE = 0  # eager
    FULL = 1  # the whole step in one graph


@dataclass(frozen=True, order=True)
class BatchExecutionDescriptor:
    """The key of one captured graph. num_reqs None means requests are not padded to a
    fixed count; uniform_token_count is the tokens per request when all requests carry
    the same count (1 for decode, K + 1 for a draft prefill or verification), None for
    mixed batches; max_query_len bounds any request's query length."""

    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None
    max_query_len: int
    cg_mode: CUDAGraphMode = CUDAGraphMode.FULL

    def fits(
        self, num_reqs: int, num_tokens: int, uniform_token_count: int | None, max_query_len: int
    ) -> bool:
        if num_tokens > self.num_tokens or max_query_len > self.max_query_len:
            return False
        if self.num_reqs is not None and num_reqs > self.num_reqs:
            return False
        if self.uniform_token_count is not None:
            return uniform_token_count == self.uniform_token_count
        return True


def _sizes(name: str, values: object) -> list[int]:
    """A list of sizes >= 1 (ints or numpy integers), each checked and named by index."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(
            f"{name} must be a sequence of ints, got {type(values).__name__} {values!r}"
        )
    out = []
    for i, v in enumerate(values):
        v = as_int(f"{name}[{i}]", v)
        if v < 1:
            raise ValueError(f"{name}[{i}] must be >= 1, got {v}")
        out.append(v)
    return out


def default_capture_sizes(max_num_tokens: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16 up to 512, capped at the limit."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    return [s for s in sizes if s <= max_num_tokens]


_CAPTURE_STREAMS: dict[int, Any] = {}


def capture_stream() -> Any:
    """The one side stream every graph of the process is captured on (per device).

    On the H200 (driver 580, torch 2.11) a graph's cost per kernel node rises from ~0.87
    to ~1.05 µs, for every graph of the process and for good, once captures have gone
    to a few distinct streams (three to six in our runs; eager launches alone, eight),
    while 42 graphs captured on one stream leave it at 0.87: SmolLM2's decode
    step, 351 against 389 µs (bench/NOTES.md, stop 45). A stream per manager put an
    engine with a few draft descriptors past it, so every manager captures here."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[device]


_SHARED_POOL: Any = None
# A pool whose graphs have all been freed cannot take new captures (the caching
# allocator asserts on it). Deciding from the managers alive when a capture starts was
# racy: an unreachable manager still holding graphs (a reference cycle the collector had
# not reached) made the old pool look alive, then died before the next capture. So the
# shared pool holds a one-kernel graph of its own for as long as the process runs.
_POOL_KEEPER: Any = None


def shared_graph_pool() -> Any:
    """One memory pool for every manager's graphs (docs/architecture.md, invariant 4)."""
    global _SHARED_POOL, _POOL_KEEPER
    if _SHARED_POOL is None:
        pool = torch.cuda.graph_pool_handle()
        keeper = torch.cuda.CUDAGraph()
        here, side = torch.cuda.current_stream(), capture_stream()
        side.wait_stream(here)
        with torch.cuda.stream(side):
            keeper.capture_begin(pool)
            try:
                torch.zeros(1, device="cuda").add_(1)
            finally:
                keeper.capture_end()
        here.wait_stream(side)
        _SHARED_POOL, _POOL_KEEPER = pool, keeper
    return _SHARED_POOL


class CudaGraphBackend:
    """The CUDA calls the manager makes, behind one seam so that CPU tests can stand in
    for them."""

    # A CUDA capture records the work and runs none of it; a stand-in may run it.
    executes_on_capture = False

    def pool(self) -> Any:
        if not torch.cuda.is_available():
            # torch's own message here is "Tried to instantiate dummy base class
            # _graph_pool_handle", which tells a user nothing.
            raise RuntimeError(
                "CUDA graph capture needs an NVIDIA GPU and a CUDA build of torch; none is "
                "available here. On a CPU run eagerly: build the manager with "
                "cg_mode=CUDAGraphMode.NONE (dispatch then returns None and the caller runs "
                "the step eagerly)."
            )
        return shared_graph_pool()

    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
        """Record fn on a side stream that first waits for the current one. Unlike
        torch.cuda.graph, no device synchronize and no emptying of the allocator's
        cache first: a graph captured while requests run (the speculative engine's step
        graphs) then costs no pipeline drain, and later steps no fresh cudaMalloc."""
        graph = torch.cuda.CUDAGraph()
        side = capture_stream()  # shared by every manager (its docstring says why)
        here = torch.cuda.current_stream()
        side.wait_stream(here)
        with torch.cuda.stream(side):
            if pool is None:
                graph.capture_begin()
            else:
                graph.capture_begin(pool)
            try:
                outputs = fn()
            finally:
                graph.capture_end()
        here.wait_stream(side)
        return graph, outputs

    def replay(self, graph: Any) -> Any:
        """None: a graph's outputs stay at the addresses capture returned (a stand-in
        that runs the work anew returns its fresh outputs instead)."""
        graph.replay()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info()[0]


ForwardFn = Callable[[CUDAGraphMode], Any]
ForwardFactory = Callable[[BatchExecutionDescriptor, bool], ForwardFn]


class CudaGraphManager:
    """Owns the descriptor set, captures one graph per descriptor and dispatches real
    batches to them. Outputs of a replay are whatever the captured callable returned:
    views of persistent buffers, valid until the next step."""

    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_num_tokens: int,
        cg_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        capture_sizes: Sequence[int] | None = None,
        uniform_token_counts: Iterable[int] = (1,),
        mixed: bool = True,
        dp_size: int = 1,
        backend: CudaGraphBackend | None = None,
    ):
        max_num_reqs = as_int("max_num_reqs", max_num_reqs)
        max_num_tokens = as_int("max_num_tokens", max_num_tokens)
        dp_size = as_int("dp_size", dp_size)
        if not isinstance(cg_mode, CUDAGraphMode):
            raise TypeError(f"cg_mode must be a CUDAGraphMode, got {cg_mode!r}")
        if capture_sizes is not None:
            capture_sizes = _sizes("capture_sizes", capture_sizes)
        uniform_token_counts = _sizes("uniform_token_counts", uniform_token_counts)
        if max_num_reqs < 1 or max_num_tokens < max_num_reqs:
            raise ValueError(
                f"need 1 <= max_num_reqs ({max_num_reqs}) <= max_num_tokens ({max_num_tokens})"
            )
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.max_num_reqs, self.max_num_tokens = max_num_reqs, max_num_tokens
        self.cg_mode, self.dp_size = cg_mode, dp_size
        self.backend = backend or CudaGraphBackend()
        sizes = default_capture_sizes(max_num_tokens) if capture_sizes is None else capture_sizes
        self.descriptors = self._build_descriptors(sizes, uniform_token_counts, mixed)
        self._graphs: dict[BatchExecutionDescriptor, Any] = {}
        self._outputs: dict[BatchExecutionDescriptor, Any] = {}
        # captured descriptors in dispatch preference order, and their num_tokens
        self._ranked: list[BatchExecutionDescriptor] = []
        self._ranked_tokens: list[int] = []
        self._pool: Any = None
        self._fallback_logged = False

    # ---- descriptors ------------------------------------------------------------------

    def _build_descriptors(
        self, sizes: Iterable[int], uniform_counts: Iterable[int], mixed: bool
    ) -> list[BatchExecutionDescriptor]:
        if self.cg_mode is CUDAGraphMode.NONE:
            return []
        out = set()
        sizes = sorted({s for s in sizes if 1 <= s <= self.max_num_tokens})
        for u in sorted(set(uniform_counts)):
            for s in sizes:
                if s % u == 0 and s // u <= self.max_num_reqs:
                    out.add(BatchExecutionDescriptor(s, s // u, u, u, self.cg_mode))
        if mixed:
            for s in sizes:
                out.add(
                    BatchExecutionDescriptor(s, min(s, self.max_num_reqs), None, s, self.cg_mode)
                )
        # largest first: later, smaller graphs reuse the pool memory of larger ones
        return sorted(
            out,
            key=lambda d: (
                -d.num_tokens,
                d.uniform_token_count is None,
                d.uniform_token_count or 0,
            ),
        )

    def num_tokens_across_dp(self, desc: BatchExecutionDescriptor) -> torch.Tensor | None:
        """The descriptor's num_tokens for every data-parallel rank (CPU int32), or None
        when dp_size is 1. The collective that agrees on it comes with data parallelism."""
        if self.dp_size == 1:
            return None
        return torch.full((self.dp_size,), desc.num_tokens, dtype=torch.int32)

    # ---- capture ----------------------------------------------------------------------

    def capture(
        self,
        create_forward_fn: ForwardFactory,
        progress_bar_desc: str = "Capturing CUDA graphs",
        descriptors: Sequence[BatchExecutionDescriptor] | None = None,
    ) -> None:
        """Warm up and capture every descriptor (or the given ones), largest first. The
        factory is called twice per descriptor: for the warm-up (run eagerly) and for the
        capture, each time preparing that descriptor's inputs afresh."""
        if not callable(create_forward_fn):
            raise TypeError(
                f"create_forward_fn must be callable, got {type(create_forward_fn).__name__}"
            )
        todo = self.descriptors if descriptors is None else list(descriptors)
        for i, d in enumerate(todo):
            if not isinstance(d, BatchExecutionDescriptor):
                raise TypeError(
                    f"descriptors[{i}] must be a BatchExecutionDescriptor, got {type(d).__name__}"
                )
        if not todo:
            # Nothing to capture (cg_mode NONE, or an empty list): no CUDA call at all, so
            # this works on a machine without a GPU.
            self.capture_seconds, self.pool_bytes = 0.0, None
            return
        if self._pool is None:
            self._pool = self.backend.pool()
        free_before = self.backend.free_memory()
        start = time.perf_counter()
        for desc in _progress(todo, progress_bar_desc):
            warm = create_forward_fn(desc, True)
            warm(CUDAGraphMode.NONE)
            run = create_forward_fn(desc, False)
            graph, outputs = self.backend.capture(
                lambda run=run, mode=desc.cg_mode: run(mode), self._pool
            )
            self._graphs[desc] = graph
            self._outputs[desc] = outputs
        self._ranked = sorted(self._graphs, key=_rank)
        self._ranked_tokens = [d.num_tokens for d in self._ranked]
        self.backend.synchronize()
        free_after = self.backend.free_memory()
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d graphs in %.2f s (%.3f s each); free memory %s -> %s",
            len(todo),
            elapsed,
            elapsed / len(todo),
            _gib(free_before),
            _gib(free_after),
        )
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = (
            free_before - free_after if free_before is not None and free_after is not None else None
        )

    @property
    def captured(self) -> list[BatchExecutionDescriptor]:
        return list(self._graphs)

    # ---- dispatch and replay ----------------------------------------------------------

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        *,
        uniform_token_count: int | None = None,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor | None:
        """The smallest captured descriptor that fits the batch, or None (run eagerly).
        Uniform descriptors win ties: their tighter max_query_len gives smaller tiles."""
        # Per step: plain ints skip the conversion.
        if type(num_reqs) is not int:
            num_reqs = as_int("num_reqs", num_reqs)
        if type(num_tokens) is not int:
            num_tokens = as_int("num_tokens", num_tokens)
        if uniform_token_count is not None and type(uniform_token_count) is not int:
            uniform_token_count = as_int("uniform_token_count", uniform_token_count)
        if max_query_len is not None and type(max_query_len) is not int:
            max_query_len = as_int("max_query_len", max_query_len)
        if not 1 <= num_reqs <= self.max_num_reqs:
            raise ValueError(
                f"num_reqs {num_reqs} must be in [1, max_num_reqs {self.max_num_reqs}]"
            )
        if not num_reqs <= num_tokens <= self.max_num_tokens:
            raise ValueError(
                f"num_tokens {num_tokens} must be in [num_reqs {num_reqs}, max_num_tokens "
                f"{self.max_num_tokens}]"
            )
        if uniform_token_count is not None and uniform_token_count * num_reqs != num_tokens:
            raise ValueError(
                f"uniform_token_count {uniform_token_count} x num_reqs {num_reqs} != "
                f"num_tokens {num_tokens}"
            )
        if max_query_len is not None and max_query_len * num_reqs < num_tokens:
            raise ValueError(
                f"max_query_len {max_query_len} is too small: {num_reqs} requests of at most "
                f"{max_query_len} tokens cannot hold num_tokens {num_tokens}"
            )
        mq = max_query_len or uniform_token_count or num_tokens - num_reqs + 1
        # Ranked by num_tokens first: start at the first graph with enough tokens; the
        # first one that fits is the best (usually within a few).
        best = None
        for i in range(bisect.bisect_left(self._ranked_tokens, num_tokens), len(self._ranked)):
            d = self._ranked[i]
            if d.fits(num_reqs, num_tokens, uniform_token_count, mq):
                best = d
                break
        # Said once, and only where graphs were captured (a batch outside them): with
        # graphs off (cg_mode NONE, a CPU run) every step runs eagerly by design.
        if best is None and self._graphs and not self._fallback_logged:
            self._fallback_logged = True
            logger.warning(
                "no captured graph fits %d requests / %d tokens (largest captured: %s); "
                "running eagerly (logged once)",
                num_reqs,
                num_tokens,
                max((d.num_tokens for d in self._graphs), default=None),
            )
        return best

    def replay(self, desc: BatchExecutionDescriptor) -> Any:
        """Replay the graph of `desc`; returns the outputs its capture returned."""
        graph = self._graphs.get(desc)
        if graph is None:
            raise RuntimeError(f"no graph captured for {desc}; call capture() first")
        self.backend.replay(graph)
        return self._outputs[desc]

    def teardown(self) -> None:
        """Drop every graph and this manager's hold on the pool."""
        if self._graphs:  # nothing captured (cg_mode NONE, a CPU run): no CUDA call
            self.backend.synchronize()
        self._graphs.clear()
        self._outputs.clear()
        self._ranked, self._ranked_tokens = [], []
        self._pool = None


def _rank(d: BatchExecutionDescriptor) -> tuple:
    return (d.num_tokens, d.uniform_token_count is None, d.num_reqs or 0)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _progress(items: list, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a convenience, not a requirement
        return items
    return tqdm(items, desc=desc, disable=not items or not logger.isEnabledFor(logging.INFO))


class SpeculatorCudaGraphManager(CudaGraphManager):
    """Capture manager for the draft prefill and draft decode steps.

    For every warm-up and every capture pass of a descriptor it writes fresh dummy
    inputs, attention metadata and slot mappings for exactly that descriptor through
    `metadata_builder.prepare_inputs_to_capture` (which fills the input buffers and the
    step block table), then hands them to
    `forward_fn(num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp,
    cg_mode)`. The metadata builder stands for the seed's input buffers, block tables,
    attention groups and KV-cache config together."""

    def capture(  # type: ignore[override]
        self,
        forward_fn: Callable[..., Any],
        metadata_builder: Any,
        progress_bar_desc: str = "Capturing draft graphs",
        descriptors: Sequence[BatchExecutionDescriptor] | None = None,
    ) -> None:
        if not callable(forward_fn):
            raise TypeError(f"forward_fn must be callable, got {type(forward_fn).__name__}")
        if not callable(getattr(metadata_builder, "prepare_inputs_to_capture", None)):
            raise TypeError(
                "metadata_builder must be a MetadataBuilder (with prepare_inputs_to_capture), "
                f"got {type(metadata_builder).__name__}"
            )

        def create_forward_fn(desc: BatchExecutionDescriptor, warmup: bool) -> ForwardFn:
            num_reqs = desc.num_reqs or min(desc.num_tokens, self.max_num_reqs)
            max_query_len = desc.max_query_len or desc.uniform_token_count or desc.num_tokens
            meta = metadata_builder.prepare_inputs_to_capture(
                num_reqs, desc.num_tokens, max_query_len
            )
            dp = self.num_tokens_across_dp(desc)
            return lambda cg_mode: forward_fn(
                num_reqs, desc.num_tokens, meta, meta.slot_mapping, dp, cg_mode
            )

        super().capture(create_forward_fn, progress_bar_desc, descriptors)
