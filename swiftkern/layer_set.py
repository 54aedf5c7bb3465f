"""Which sub-layers a draft skips: a bitmask over the 2L sub-layers (attention_i, mlp_i)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from .arg_checks import whole
from .errors import SwiftkernError

_DIGITS = re.compile(r"[0-9]+")  # an index as written in a layer set: ASCII digits alone
JSON_KEYS = ("num_layers", "skip_attn", "skip_mlp")  # the JSON form's keys, all of which to_json writes


def _format_indices(indices: tuple[int, ...]) -> str:
    """(1, 2, 3, 7) -> '1-3,7'"""
    parts, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(parts)


def _parse_indices(text: str, num_layers: int, what: str) -> tuple[int, ...]:
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = (p.strip() for p in part.partition("-"))
        if not all(_DIGITS.fullmatch(p) for p in ((lo, hi) if dash else (lo,))):  # int() took "1_0" as 10, "+1"
            raise SwiftkernError(f"layer set: {what} entry {part!r} is not an index or a range like 3-7")
        start, stop = int(lo), int(hi if dash else lo)
        if stop < start:
            raise SwiftkernError(f"layer set: {what} range {part!r} runs backwards; write it as {stop}-{start}")
        if start < 0 or stop >= num_layers:  # before expanding it: "1-3000000" built a list of millions
            raise SwiftkernError(f"layer set: {what} entry {part!r} is outside the {num_layers} layers "
                                 f"(indices 0..{num_layers - 1})")
        out.update(range(start, stop + 1))
    return tuple(sorted(out))


@dataclass(frozen=True)
class LayerSet:
    """The sub-layers a draft skips in an L-layer decoder.

    A skipped sub-layer leaves the residual stream unchanged; a skipped attention layer
    also writes no KV. ``skip_attn`` and ``skip_mlp`` hold sorted layer indices in [0, L).

    Compact string form: ``"attn:1,3,5-9|mlp:2,4"`` (``"none"`` skips nothing). JSON form:
    ``{"num_layers": L, "skip_attn": [...], "skip_mlp": [...]}``. A set that skips every
    sub-layer is refused: the draft would not be a model any more.
    """

    num_layers: int
    skip_attn: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()

    def __post_init__(self):
        L = whole("layer set: num_layers", self.num_layers)
        if L < 1:
            raise SwiftkernError(f"layer set: num_layers must be >= 1, got {L}")
        for name in ("skip_attn", "skip_mlp"):
            given = getattr(self, name)
            if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
                raise SwiftkernError(f"layer set: {name} must be a sequence of layer indices, got {given!r} "
                                     "(LayerSet.parse reads the string form)")
            idx = tuple(sorted(set(whole(f"layer set: {name} entry", i) for i in given)))
            bad = [i for i in idx if not 0 <= i < L]
            if bad:
                raise SwiftkernError(
                    f"layer set: {name} has indices {bad} outside [0, {L}) for a {L}-layer model"
                )
            object.__setattr__(self, name, idx)
        if len(self.skip_attn) == L and len(self.skip_mlp) == L:
            raise SwiftkernError(
                "layer set skips every sub-layer; keep at least one attention or MLP layer"
            )

    # --- views -------------------------------------------------------------------------
    @property
    def num_skipped(self) -> int:
        return len(self.skip_attn) + len(self.skip_mlp)

    @property
    def skip_ratio(self) -> float:
        """Fraction of the 2L sub-layers skipped."""
        return self.num_skipped / (2 * self.num_layers)

    @property
    def is_empty(self) -> bool:
        return self.num_skipped == 0

    def attn_mask(self) -> list[bool]:
        """[L] True where attention_i is skipped."""
        s = set(self.skip_attn)
        return [i in s for i in range(self.num_layers)]

    def mlp_mask(self) -> list[bool]:
        """[L] True where mlp_i is skipped."""
        s = set(self.skip_mlp)
        return [i in s for i in range(self.num_layers)]

    def to_bits(self) -> list[int]:
        """[2L] bitmask, attention bits first then MLP bits (1 = skipped)."""
        return [int(b) for b in self.attn_mask() + self.mlp_mask()]

    @classmethod
    def from_bits(cls, bits) -> "LayerSet":
        bits = [int(b) for b in bits]
        if len(bits) % 2:
            raise SwiftkernError(f"layer set: a bitmask has 2L entries, got {len(bits)}")
        L = len(bits) // 2
        return cls(L, tuple(i for i in range(L) if bits[i]), tuple(i for i in range(L) if bits[L + i]))

    # --- (de)serialisation -------------------------------------------------------------
    def __str__(self) -> str:
        if self.is_empty:
            return "none"
        return f"attn:{_format_indices(self.skip_attn)}|mlp:{_format_indices(self.skip_mlp)}"

    def to_json(self) -> str:
        return json.dumps(
            {"num_layers": self.num_layers, "skip_attn": list(self.skip_attn), "skip_mlp": list(self.skip_mlp)}
        )

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> "LayerSet":
        """Parse the compact string, ``"none"``, or the JSON form (checked against num_layers)."""
        if not isinstance(spec, str):
            raise SwiftkernError(f"layer set must be a string ('attn:1,3-5|mlp:2', 'none' or JSON), got {spec!r}")
        num_layers = whole("layer set: num_layers", num_layers)
        spec = spec.strip()
        if spec in ("", "none"):
            return cls(num_layers)
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
            except json.JSONDecodeError as e:
                raise SwiftkernError(f"layer set: malformed JSON ({e.msg})") from None
            unknown = sorted(set(obj) - set(JSON_KEYS))  # a misspelt key must not become an empty list
            if unknown:
                raise SwiftkernError(f"layer set: unknown JSON keys {unknown}; it takes {list(JSON_KEYS)}")
            if whole("layer set: JSON num_layers", obj.get("num_layers", num_layers)) != num_layers:
                raise SwiftkernError(
                    f"layer set is for a {obj['num_layers']}-layer model, this model has {num_layers}"
                )
            return cls(num_layers, obj.get("skip_attn", ()), obj.get("skip_mlp", ()))
        fields = {}
        for part in spec.split("|"):
            key, sep, value = part.partition(":")
            key = key.strip()
            if not sep or key not in ("attn", "mlp"):
                raise SwiftkernError(
                    f"layer set {spec!r}: expected 'attn:1,3-5|mlp:2', 'none' or JSON"
                )
            if key in fields:
                raise SwiftkernError(f"layer set {spec!r}: '{key}' given twice; list all its layers once, "
                                     "e.g. 'attn:1,3'")
            fields[key] = _parse_indices(value, num_layers, key)
        return cls(num_layers, fields.get("attn", ()), fields.get("mlp", ()))

    # --- constructors used by drafting and search ----------------------------------------
    @classmethod
    def random(cls, num_layers: int, ratio: float, seed: int = 0, protect_ends: bool = True) -> "LayerSet":
        """A random set skipping round(ratio * 2L) sub-layers (fewer where the pool is smaller);
        first and last layer kept (protect_ends: with 2 layers or fewer, nothing is skipped)."""
        if not 0.0 <= ratio < 1.0:
            raise SwiftkernError(f"skip ratio must be in [0, 1), got {ratio}")
        layers = range(1, num_layers - 1) if protect_ends else range(num_layers)
        pool = [(kind, i) for kind in ("attn", "mlp") for i in layers]
        k = min(len(pool), round(ratio * 2 * num_layers))
        chosen = random.Random(seed).sample(pool, k)
        return cls(
            num_layers,
            tuple(i for kind, i in chosen if kind == "attn"),
            tuple(i for kind, i in chosen if kind == "mlp"),
        )
