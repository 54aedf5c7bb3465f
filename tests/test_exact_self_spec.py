"""Self-spec equals ar bit for bit on the CPU, not only to rounding: its draft and verify passes
run the kernels a decode step runs (``Generator.invariant_decode``), so a verify pass gives each
token the bits decoding it alone would.

Checked on a tiny model built so that rounding picks its tokens: two rows of the LM head
dominate it and differ by a relative 1e-7, so one bit of difference in a token's hidden state
can flip the choice between them. The negative control shows that this model does tell: with
the regular kernels in the verify passes (the attention's 16-lane path sums in another order
than its one-query path), self-spec's tokens leave ar's."""

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, ops
from swiftkern.layer_kernels import invariant_kernels_available

pytestmark = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                                reason="needs the C++ CPU kernels (the batch-invariant set)")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200], [40, 41], [90, 91, 92, 93]]
NEW = 32
TIED = (7, 8)  # the two near-tied tokens


def rounding_decides(dtype=torch.float32):
    """A tiny LLaMA with SmolLM2's GQA group (3 query heads per kv head: a verify pass of 3 or
    more tokens takes the lane path of the regular attention, a decode step its one-query path)
    whose greedy choice between tokens 7 and 8 is up to rounding whenever they lead."""
    hf = tiny_model("llama", num_hidden_layers=4, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    with torch.no_grad():
        w = hf.lm_head.weight  # [V, H]
        g = torch.Generator().manual_seed(1)
        lead = torch.randn(w.shape[1], generator=g) * 4.0  # [H], far above the other rows (std 0.16)
        w[TIED[0]] = lead
        w[TIED[1]] = lead * (1 + 1e-7 * torch.randn(w.shape[1], generator=g))
    return SkipModel.from_hf(hf.to(dtype))


def outputs(model, mode, **kw):
    gen = Generator(model, mode=mode, **kw)
    return gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens


SPEC = dict(drafter="layer-skip", layer_set="attn:1|mlp:2", k_max=4, eps=0.0)  # verify passes of 5 tokens


def test_the_tied_tokens_lead_often():
    """The model is what the test needs: the near-tied pair leads at a good share of the steps."""
    out = outputs(rounding_decides(), "ar")
    tied = sum(t in TIED for row in out for t in row)
    assert tied >= NEW * len(PROMPTS) // 4, tied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_spec_equals_ar_where_rounding_picks_the_tokens(dtype):
    model = rounding_decides(dtype)
    ar = outputs(model, "ar")
    assert outputs(model, "self-spec", **SPEC) == ar
    for p in PROMPTS[:3]:  # alone (its prefill is not the padded batch's: torch's matmul, batch-variant)
        alone = [Generator(model, mode=mode, **kw).generate([p], max_new_tokens=NEW, eos_token_id=[]).tokens[0]
                 for mode, kw in (("ar", {}), ("self-spec", SPEC))]
        assert alone[0] == alone[1]
    assert Generator(model, mode="ar").generate(PROMPTS[:1], max_new_tokens=4).stats["decode_kernels"] \
        == "batch-invariant"


@pytest.mark.skipif(ops.registry.extension is None or "avx512" not in ops.registry.extension.skinny_linear_isas(),
                    reason="without AVX-512 the regular attention has one path only (no 16-lane path), so its "
                           "verify passes already sum as a decode step does: nothing to tell apart")
def test_negative_control_regular_verify_passes_leave_ar(monkeypatch):
    model = rounding_decides()
    ar = outputs(model, "ar")
    monkeypatch.setattr(Generator, "invariant_decode", lambda self: False)
    regular_ar = outputs(model, "ar")
    regular_spec = outputs(model, "self-spec", **SPEC)
    assert regular_ar == ar  # decode steps: one query per kv head's 3 heads, the one-query path either way
    assert sum(a != b for a, b in zip(regular_spec, ar)) >= 1


def test_prompts_take_the_regular_kernels_and_decoding_the_invariant_ones(monkeypatch):
    """Where each pass runs: the first prompts and a request joining later through the regular
    set (torch's float32 matmul takes long prompts faster), every decode, draft and verify
    pass through the invariant set; mode deterministic without replay all through the invariant
    set, with replay its fast path through the regular one (its verifier prefills the prompts)."""
    model = rounding_decides()
    seen = []

    def spying(forward):
        def spy(self, *args, **kwargs):
            tokens = args[1] if forward is one_call else args[0]
            seen.append((tokens.shape[1], self.invariant))
            return forward(self, *args, **kwargs)
        return spy
    one_call = SkipModel._forward_in_one_call  # (kern, tokens, ...): the CPU's one C++ call, else forward_device
    for name in ("forward_device", "_forward_in_one_call"):
        monkeypatch.setattr(SkipModel, name, spying(getattr(SkipModel, name)))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28]]  # longer than a verify pass
    for mode, kw, prompt_set, decode_set in [("ar", {}, False, True), ("self-spec", SPEC, False, True),
                                             ("deterministic", {}, True, True),
                                             ("deterministic", dict(replay="always"), None, False)]:
        seen.clear()
        Generator(model, mode=mode, **kw).generate(prompts, max_new_tokens=12, arrive_at=[0, 3], eos_token_id=[])
        if prompt_set is not None:
            assert {inv for T, inv in seen if T >= 7} == {prompt_set}, (mode, kw, seen)  # the prompts' passes
        decode_passes = {inv for T, inv in seen if T == 1}
        assert decode_passes == {decode_set}, (mode, kw, seen)
