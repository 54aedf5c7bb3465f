"""State swiftkern keeps on a caller's HF model that is not the model's: dropped by copies.

The HF backend keeps its Generators on the model (what they learn carries over between calls)
and ``SkipModel`` its packed weights (made once per model). Kept as plain attributes they made
the model fail ``copy.deepcopy`` and ``torch.save`` (a Generator holds a lock) or carried
megabytes of packed codes into a checkpoint. ``transient(model)`` is a dict on the model that a
deep copy or a pickle replaces with an empty one: a copy builds its own on first use.
"""

from __future__ import annotations

ATTRIBUTE = "_swiftkern_transient"


class TransientState(dict):
    """A dict that copies and pickles as an empty one."""

    def __deepcopy__(self, memo) -> "TransientState":
        return TransientState()

    def __copy__(self) -> "TransientState":
        return TransientState()

    def __reduce__(self):
        return (TransientState, ())


def transient(model) -> TransientState:
    """``model``'s swiftkern state (made on first use)."""
    state = model.__dict__.get(ATTRIBUTE)
    if state is None:
        state = TransientState()
        object.__setattr__(model, ATTRIBUTE, state)  # past nn.Module's __setattr__ (not a module or parameter)
    return state


def weights_key(model) -> tuple:
    """What a wrapper built on ``model`` depends on: each parameter's object, storage, dtype and
    shape. A load with ``assign=True``, ``param.data = ...``, ``model.to(dtype)`` or a resized
    vocabulary changes it; an in-place update (the same storage) does not, and a SkipModel,
    which shares the parameters, sees that one anyway (its packed copies: by their version, or
    for a write through ``.data`` by ``PackedSet.refresh`` at each ``generate`` call)."""
    return tuple((id(p), p.data_ptr(), p.dtype, tuple(p.shape)) for p in model.parameters())
