"""State that lasts the whole process, across reloads of the module that keeps it."""

from __future__ import annotations

import sys
import types


def process_state(name: str, **fields) -> types.ModuleType:
    """The namespace kept in ``sys.modules[name]``, made with ``fields`` as its attributes the
    first time it is asked for. A registry module that is reloaded or imported a second time
    under another name finds what its first import recorded there (e.g. the ops it registered),
    so it neither registers twice nor forgets what is its own."""
    state = sys.modules.get(name)
    if state is None:
        state = types.ModuleType(name)
        for key, value in fields.items():
            setattr(state, key, value)
        sys.modules[name] = state
    return state
