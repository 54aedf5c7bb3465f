"""swiftkern's Triton kernels, installed as ``swiftkern.triton_kernels`` (one module per op).

Importing this package imports triton and registers each kernel as the custom op
``torch.ops.swiftkern_triton.<op>`` with the schema of ``swiftkern.ops.registry.SCHEMAS``, a CUDA
implementation and a fake (meta) one. Under ``TRITON_INTERPRET=1`` (set before triton is first
imported) the kernels also run on CPU tensors, so the same ops are registered for the CPU key:
that is how the tests check the kernels without a GPU. ``swiftkern.ops`` imports this package
lazily, only when a Triton kernel may be needed, and picks the backend per op and device.

Modules: launch (launch sizes and input checks), registry (the registration), and per op
fused_add_rms_norm (with rms_norm), silu_mul, rope_kv_append, verify_attention (with
verify_attention_invariant), greedy_accept, rejection_sample, kv_compact, skinny_linear (the
regular path's float32 matmul at few rows on CUDA), bi_exp_sum (the deterministic verifier's
softmax denominator, the reference's bits in one launch); bi_matmul (the
deterministic verifier's matmul, not in ``ops.registry.SCHEMAS``) registers its own op through
``registry.register`` when imported here.
"""

from __future__ import annotations

from . import bi_exp_sum as _exp_sum
from . import bi_matmul as _bi_matmul  # noqa: F401  (registers swiftkern_triton::bi_matmul)
from . import fused_add_rms_norm as _norm
from . import greedy_accept as _greedy
from . import kv_compact as _compact
from . import rejection_sample as _rejection
from . import rope_kv_append as _rope
from . import silu_mul as _silu
from . import skinny_linear as _skinny
from . import verify_attention as _attention
from .launch import interpreting
from .registry import register, registered
from swiftkern.ops.autograd import register_autograd  # noqa: E402

# op -> (implementation, fake); the schemas are swiftkern.ops.registry.SCHEMAS[op]
KERNELS = {
    "rms_norm": (_norm.rms_norm, _norm.rms_norm_fake),
    "fused_add_rms_norm": (_norm.fused_add_rms_norm, _norm.fused_add_rms_norm_fake),
    "silu_mul": (_silu.silu_mul, _silu.silu_mul_fake),
    "rope_kv_append": (_rope.rope_kv_append, _rope.rope_kv_append_fake),
    "verify_attention": (_attention.verify_attention, _attention.verify_attention_fake),
    "verify_attention_invariant": (_attention.verify_attention_invariant, _attention.verify_attention_fake),
    "greedy_accept": (_greedy.greedy_accept, _greedy.greedy_accept_fake),
    "rejection_sample": (_rejection.rejection_sample, _rejection.rejection_sample_fake),
    "kv_compact": (_compact.kv_compact, _compact.kv_compact_fake),
    "skinny_linear": (_skinny.skinny_linear, _skinny.skinny_linear_fake),
    "bi_exp_sum": (_exp_sum.bi_exp_sum, _exp_sum.bi_exp_sum_fake),
}


def _register_all() -> None:
    from swiftkern.ops.registry import SCHEMAS

    for name, (fn, fake) in KERNELS.items():
        register(name, SCHEMAS[name], fn, fake)


_register_all()
register_autograd("swiftkern_triton")  # rms_norm and silu_mul in a patched model that trains

__all__ = ["KERNELS", "interpreting", "register", "registered"]
