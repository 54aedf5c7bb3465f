"""CUDA-graph replay of the model's forward passes.

A decode step of a small model on a fast GPU is bound by the host, not the device: ~10 ops per
layer, each a Python call, a dispatch and a kernel launch (SmolLM2-135M on an H100: ~14 ms a
step, ~300 op calls at 0.02-0.28 ms each from Python, as the kernel benches measured them). A
CUDA graph records the launches of one forward once and replays them with one call; the
deterministic verifier's fixed-shape passes are replayed the same way (``Verifier.forward``:
kind "verify", and "prefill" for its prefill passes, whose shapes are bucketed to powers of
two inside graphs).
What a replay reads must then sit at the addresses captured: the tokens are copied into a
static buffer, the cache is the same storage (its lengths updated in place), and the body
(``SkipModel.forward_device``) reads no host-side cache state, so the only host values baked
into a graph are those in its key.

A graph's key: the batch and token count, the skip plan, the attention span (the longest row +
T rounded up to a power of two, at most the cache's capacity: the keys the attention kernels
are planned for; past a row's length they are masked), the positions whose logits are wanted,
whether the full LM head runs inside, the cache's storage, the backend and the invariant flag
(with the invariant set's RoPE table, which a capture reads).
A key seen once runs eagerly (with the same span, so eager and replayed calls of one key give
the same bits); the second time it is captured (a warm-up on a side stream, then the capture)
and from then on replayed. Calls that a graph cannot serve run as ``forward`` always does:
per-row layer sets (the search's candidates) and more than ``max_tokens`` tokens (prefill).
A pruned draft head stays outside the graph (its size grows with the context): the graph
returns the normed hidden state and the head's matmul runs eagerly.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from . import ops
from .errors import SwiftkernError
from .graph_capture import CudaGraph, EmulatedGraph  # noqa: F401 (EmulatedGraph: for GraphRunner's callers)
from .rope_table import rope_follows_the_batch

MAX_GRAPH_TOKENS = 256  # B x T at most in a graphed forward: decode, drafts and verify passes
MIN_SPAN = 64
MAX_GRAPHS = 64  # captured graphs kept, least recently used dropped first
CACHE_STEP = 256  # the runner's cache sizes are rounded up to a multiple of this


def unsteady_calls(model) -> int:
    """Forwards of ``model`` so far that did not replay a graph (first sights and captures,
    far slower than a replay), 0 outside ``cuda_graphs()``: a timing taken while this did not
    change is of replays alone, which is what a cost model that picks draft lengths needs."""
    runner = model.graphs
    return 0 if runner is None else runner.eager + runner.captures


def padded_width(model, cache, batch: int, tokens: int) -> int:
    """The positions a row's forward of ``tokens`` positions (a verify pass, a check of drafts)
    runs with: ``tokens``, or through a graph runner (inside ``model.cuda_graphs``) its
    ``GraphRunner.padded_tokens`` within the cache's room. The caller pads the rows and rolls
    back what the padding wrote."""
    runner = model.graphs
    if runner is None or tokens <= 1:
        return tokens
    return runner.padded_tokens(batch, tokens, cache.max_len - max(cache.host_lengths))


def attention_span(longest: int, capacity: int, minimum: int = MIN_SPAN) -> int:
    """Keys a graphed forward's attention is planned for: ``longest`` (the longest row + T)
    rounded up to ``minimum`` times a power of two, at most ``capacity`` (the same in units of
    key blocks for the verifier)."""
    span = minimum
    while span < longest:
        span *= 2
    return min(span, capacity)


@contextlib.contextmanager
def _host_lengths_hidden(cache):
    """The cache's host lengths are None inside: a read fails instead of being baked in."""
    saved = cache.host_lengths
    cache.host_lengths = None
    try:
        yield
    finally:
        cache.host_lengths = saved


class _Entry:
    """A key's state: seen once (graph None), or captured with its static inputs."""

    def __init__(self):
        self.graph = None
        self.inputs: tuple = ()  # the static tensors the graph reads


class GraphRunner:
    """Replays ``SkipModel.forward`` (and the deterministic verifier's passes) through CUDA
    graphs (see the module docstring).

    ``GraphRunner(model, graph_type=None, max_tokens=MAX_GRAPH_TOKENS, max_graphs=MAX_GRAPHS)``:
    ``graph_type`` None is ``CudaGraph`` (the model must be on a CUDA device); tests pass
    ``EmulatedGraph`` to run the same bookkeeping on the CPU. Use it as
    ``with model.cuda_graphs(runner): ...``; ``stats()`` counts captures, replays and eager calls.
    """

    def __getstate__(self):
        raise SwiftkernError("a GraphRunner's captured graphs live on its GPU and cannot be copied or pickled: "
                             "make the Generator with cuda_graphs=False to copy it, or make one with "
                             "cuda_graphs=True in each process")

    def __init__(self, model, graph_type=None, max_tokens: int = MAX_GRAPH_TOKENS, max_graphs: int = MAX_GRAPHS):
        if graph_type is None:
            if model.device.type != "cuda":
                raise SwiftkernError(f"CUDA graphs need the model on a CUDA device (it is on {model.device}): "
                                     "use --device cuda, or leave cuda_graphs off")
            graph_type = CudaGraph
        if rope_follows_the_batch(model.rotary):  # HF's rotary compares the longest position on the host
            raise SwiftkernError(f"rope_type {model.rotary.rope_type!r} rescales its frequencies by the longest "
                                 "position of each forward, read on the host: no CUDA graphs (leave cuda_graphs off)")
        self.model = model
        self.graph_type = graph_type
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.entries: OrderedDict = OrderedDict()
        self.cache = None  # the KVCache new_cache handed out last
        self.cache_leased = False  # a generate call holds self.cache (lease)
        self.captures = self.replays = self.eager = 0
        self.first_sights = 0  # keys met for the first time (run eagerly; the next sight captures)
        self.replays_by_kind: dict = {}  # "forward" | "verify" -> replays
        self.weights_at: tuple | None = None  # the weights' addresses the graphs were captured on
        self.weight_moves = 0  # times the graphs were dropped for weights that moved
        cuda = graph_type is CudaGraph
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(model.device) if cuda else None

    def new_cache(self, batch: int, needed: int, used: int | None = None):
        """A KVCache for ``batch`` rows of at least ``needed`` positions (``used`` of them kept, as
        in ``SkipModel.new_cache``): the one handed out last when it has the rows and positions
        and no call holds it (graphs are keyed on the cache's storage, so a reused cache reuses
        them across calls and Generators), else a new one of ``needed`` rounded up to CACHE_STEP
        positions. A reused cache holds stale keys and values past every row's length: finite
        model values, masked, overwritten. A cache larger than a call needs costs it memory, not
        time (attention spans follow the rows' lengths), so it is kept for any call it fits, as
        for fewer rows: replacing it by a smaller one, as this did when it was over twice the
        positions needed, made calls of alternating prompt lengths re-capture their graphs on
        every call (the emulation counted 4 captures a round of five batch-1 prompts)."""
        used = needed if used is None else used
        cache = self.cache
        if (cache is not None and not self.cache_leased and batch <= cache.capacity
                and needed <= cache.max_len):
            self.model.check_positions(used)
            cache.reset(batch)
            return cache
        cache = self.model.new_cache(batch, -(-needed // CACHE_STEP) * CACHE_STEP, used)
        if not self.cache_leased:  # a call holds the kept one: this cache is the inner call's alone
            self.cache = cache
        return cache

    @contextlib.contextmanager
    def lease(self, batch: int, needed: int, used: int | None = None):
        """``new_cache`` for one generate call, held until the context ends: a call made inside it
        (a streamer's own generate on this model) gets a cache of its own instead of the one in
        use. -> the KVCache."""
        cache = self.new_cache(batch, needed, used)  # self.cache unless an outer call holds that
        outer, self.cache_leased = self.cache_leased, True
        try:
            yield cache
        finally:
            self.cache_leased = outer

    def follow_weights(self, addresses: tuple) -> None:
        """Drop every graph when the weights' storage moved since they were captured
        (``addresses``: ``modules_read.Snapshot.addresses``, at each ``cuda_graphs`` context): a
        write through ``param.data = ...`` keeps the parameter, which eager forwards follow, and
        frees the storage a graph reads at its captured address (on a GPU: the old or reused
        memory, silently; the emulation failed on it). In-place writes keep the addresses."""
        if addresses != self.weights_at:
            if self.weights_at is not None and self.entries:
                self.entries.clear()
                self.weight_moves += 1
            self.weights_at = addresses

    def stats(self) -> dict:
        return {"graphs": len(self.entries), "captures": self.captures, "replays": self.replays,
                "eager": self.eager, "replays_by_kind": dict(self.replays_by_kind)}

    def padded_tokens(self, batch: int, tokens: int, room: int) -> int:
        """The positions a row's verify pass (or check of drafts) of ``tokens`` positions is padded
        to under this runner: the next power of two, at most ``room`` (the cache's free positions)
        and what a graph takes (``max_tokens // batch``), never fewer than ``tokens``. A graph's
        key holds the width, and the drafter policy's widths follow its timings, so unpadded
        passes kept meeting new keys, each an eager forward and then a capture (prompt lookup on
        SmolLM2, emulated, ``python -m bench --routine graph_keys``: 18 new keys in rounds 1-4
        unpadded, 1 padded)."""
        bucket = 1 << (tokens - 1).bit_length()
        return max(tokens, min(bucket, room, self.max_tokens // batch))

    def forward(self, tokens, cache, skip_attn, skip_mlp, logits_positions, head) -> torch.Tensor | None:
        """``SkipModel.forward`` after its checks: -> logits [B, T or P, V or V'] (the cache
        advanced), or None for a call no graph serves (counted as eager; the caller runs it)."""
        model = self.model
        B, T = tokens.shape
        if B * T > self.max_tokens or not all(s is True or s is False for s in skip_attn + skip_mlp):
            self.eager += 1
            return None
        span = attention_span(max(cache.host_lengths) + T, cache.max_len)
        with_head = head is None
        key = ("forward", B, T, tuple(skip_attn), tuple(skip_mlp), span,
               None if logits_positions is None else tuple(logits_positions.shape), with_head,
               cache.k.data_ptr(), cache.v.data_ptr(), cache.lengths.data_ptr(), tuple(cache.k.shape),
               cache.k.stride(), model.invariant, model.rope_table_address() if model.invariant else None,
               tokens.device)

        def body(tok, pos=None):
            hidden = model.forward_device(tok, cache, skip_attn, skip_mlp, span, None, pos)
            return model.head_logits(hidden) if with_head else hidden

        inputs = (tokens,) if logits_positions is None else (tokens, logits_positions)
        with _host_lengths_hidden(cache):
            out = self.run(key, body, inputs, restore=(cache.lengths,))
        cache.advance_host(T)
        return out if with_head else model.head_logits(out, head)

    def run(self, key: tuple, fn, inputs: tuple, restore: tuple = ()) -> torch.Tensor:
        """fn(*inputs) -> a tensor, where ``key`` (its first item names the kind of call) holds
        every host value and address fn depends on besides the tensors ``inputs`` (copied into
        static buffers before a replay). The ops backend in use (it picks the kernels fn
        launches) is added to every key here.
        ``restore``: tensors fn updates in place that a capture's warm-up run must put back.
        The first call for a key runs fn eagerly, the second captures it, later ones replay."""
        key = key + (ops.backends.current_backend(),)
        entry = self.entries.get(key)
        if entry is None:  # first sight: eager, the same arithmetic as the graph will do
            self.first_sights += 1
            self.entries[key] = _Entry()
            while len(self.entries) > self.max_graphs:
                self.entries.popitem(last=False)
            self.eager += 1
            return fn(*inputs)
        self.entries.move_to_end(key)
        if entry.graph is None:
            self._capture(entry, key, fn, inputs, restore)
        for static, x in zip(entry.inputs, inputs):
            static.copy_(x)
        out = entry.graph.replay(lambda: fn(*entry.inputs)).clone()
        self.replays += 1
        self.replays_by_kind[key[0]] = self.replays_by_kind.get(key[0], 0) + 1
        return out

    def _capture(self, entry: _Entry, key: tuple, fn, inputs: tuple, restore: tuple) -> None:
        """A warm-up run on the capture stream (what it updates in ``restore`` put back after),
        then the capture."""
        entry.inputs = tuple(x.clone() for x in inputs)
        graph = self.graph_type(self.pool, self.stream, keyed=_integers(key))

        def static_fn():
            return fn(*entry.inputs)

        saved = [t.clone() for t in restore]
        if self.stream is not None:
            current = torch.cuda.current_stream(self.model.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                static_fn()
            current.wait_stream(self.stream)
        else:  # the emulation warms up too, so that the tests see what it leaves behind
            static_fn()
        for t, s in zip(restore, saved):
            t.copy_(s)
        graph.capture(static_fn)
        entry.graph = graph
        self.captures += 1


def _integers(key) -> frozenset:
    """The integers in a graph's key, nested tuples included (its addresses among them)."""
    if isinstance(key, tuple):
        return frozenset().union(*(_integers(x) for x in key))
    return frozenset((key,)) if isinstance(key, int) and not isinstance(key, bool) else frozenset()
