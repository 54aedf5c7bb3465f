"""Triton's interpreter (TRITON_INTERPRET=1, the CPU runs of the Triton kernels) without one of its
costs: at every call of a ``@triton.jit`` helper inside a kernel it patches ``triton.language``
again (``_patch_lang``: ``inspect.getmembers`` over tl, tl.core, tl.tensor, tl.math), although the
kernel's launch patched those modules already and keeps them patched until it ends. Measured on
the CPU machine (test_verifier_model_shapes' fused verifier, cProfile): 44 of 170 s in those
repeats, ~30 000 helper calls for ~500 launches.

``skip_nested_lang_patches`` makes such a repeat a no-op where every language module the helper
sees is patched (its ``load`` no longer Triton's builtin): the helper runs with the very
functions the launch installed. The launch's own patch, and its restore, are left as they are.
Where this Triton has no ``_patch_lang`` it changes nothing."""

from __future__ import annotations

import inspect


def skip_nested_lang_patches() -> bool:
    """Installs the skip; -> whether this Triton's interpreter has the hook it wraps."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if getattr(patch_lang, "skips_nested", False):
        return True  # installed already
    if patch_lang is None or scope_type is None:
        return False

    def patched(lang) -> bool:
        return not tl.core.is_builtin(getattr(lang, "load", None))

    def patch_unless_patched(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(patched(lang) for lang in langs):
            return scope_type()  # nothing to restore: the launch's scope restores the modules
        return patch_unless_patched.inner(fn)

    patch_unless_patched.skips_nested, patch_unless_patched.inner = True, patch_lang
    interpreter._patch_lang = patch_unless_patched
    return True
