"""A request leaving the batch and another joining it: the KV cache's rows in place vs copied.

    python -m bench --routine cache_rows [--device cuda] [--dtype bfloat16] [--reps 10] [--smoke]

One timed call: the request in row 0 finishes (its row leaves) and a new one arrives (a row
joins), so the batch is back at B rows for the next call. Every row holds S/2 valid positions.
Providers:

    in-place   swiftkern's KVCache: the last row moves into the freed one (its valid positions
               only), and the arrival takes that freed row back (``Requests.drop_finished``,
               ``KVCache.select_rows``, ``KVCache.add_rows``)
    copy       the plain way, and what swiftkern did before: the kept rows gathered into a new
               cache (``index_select``), then an empty row concatenated (``torch.cat``); each
               copies the whole cache and holds two at the peak

Shapes: SmolLM2's cache (30 layers, 3 KV heads, head dim 64; float32 on the CPU, bfloat16 on
a GPU) at 8 rows of 512 positions, and an 8B-class model's (32 layers, 8 KV heads, head dim
128, bfloat16: 4.3 GB) at 16 rows of 2048 positions; --dtype sets both. Column ratio_vs_copy: copy's median / this provider's, same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from swiftkern.kv_cache import KVCache  # noqa: E402
from swiftkern.requests import fill_freed_rows  # noqa: E402

ROUTINE = "cache_rows"
PRINT_KEYS = ("provider", "dtype", "shape", "median_ms", "p20_ms", "p80_ms", "ratio_vs_copy")
# (name, layers, rows, kv heads, positions, head dim, dtype: None = the model's on this device)
SHAPES = [("smollm2", 30, 8, 3, 512, 64, None), ("8b-class", 32, 16, 8, 2048, 128, torch.bfloat16)]
SMOKE_SHAPES = [("tiny", 2, 4, 2, 16, 8, None)]


def filled_cache(L: int, B: int, H: int, S: int, D: int, dtype, device: str) -> KVCache:
    """A cache of B rows, each holding S/2 written positions."""
    cache = KVCache(L, B, H, S, D, dtype, device)
    cache.k[:, :, :, :S // 2] = 1.0
    cache.v[:, :, :, :S // 2] = 1.0
    cache.set_lengths([S // 2] * B)
    return cache


def leave_and_join_in_place(cache: KVCache):
    def fn():
        cache.select_rows(fill_freed_rows(list(range(1, cache.batch))))
        row = cache.add_rows(1)[0]
        cache.set_row_length(row, cache.max_len // 2)
    return fn


def leave_and_join_by_copy(state: dict):
    """The former KVCache.select_rows / add_rows on plain tensors k, v: [L, B, H, S, D]
    (``state``: {"k", "v"})."""
    def fn():
        k, v = state["k"], state["v"]
        keep = torch.arange(1, k.shape[1], device=k.device)
        k, v = k.index_select(1, keep), v.index_select(1, keep)
        empty = k.new_zeros((k.shape[0], 1) + tuple(k.shape[2:]))
        state["k"], state["v"] = torch.cat([k, empty], dim=1), torch.cat([v, empty], dim=1)
    return fn


def run(args) -> list[dict]:
    model_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    reps = args.reps or (2 if args.smoke else 10)
    rows = []
    for name, L, B, H, S, D, shape_dtype in SMOKE_SHAPES if args.smoke else SHAPES:
        dtype = getattr(torch, args.dtype) if args.dtype else shape_dtype or model_dtype
        fns = {}
        if not args.providers or "in-place" in args.providers:
            fns["in-place"] = leave_and_join_in_place(filled_cache(L, B, H, S, D, dtype, args.device))
        if not args.providers or "copy" in args.providers:
            k, v = (torch.zeros((L, B, H, S, D), dtype=dtype, device=args.device) for _ in range(2))
            k[:, :, :, :S // 2], v[:, :, :, :S // 2] = 1.0, 1.0
            fns["copy"] = leave_and_join_by_copy({"k": k, "v": v})
            del k, v
        times = common.time_fn(fns, args.device, warmup=1, reps=reps)
        for provider, timing in times.items():
            ratio = times["copy"]["median_ms"] / timing["median_ms"] if "copy" in times else ""
            rows.append(common.row(ROUTINE, provider, args.device, dtype, f"{name} L={L} B={B} H={H} S={S} D={D}",
                                   timing, batch=B, reps=reps,
                                   ratio_vs_copy=round(ratio, 2) if ratio != "" else ""))
        del fns
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows
