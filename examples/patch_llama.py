"""Liger-style patching: plain HF inference with swiftkern's RMSNorm and SwiGLU ops.

    python examples/patch_llama.py [--model smollm2|<HF folder>|<.gguf>]

Patches one loaded model's modules (instance level), compares its logits with the unpatched
model's, generates with it, and undoes the patch. ``swiftkern.apply_swiftkern_to_llama()``
with no model patches the classes instead (every Llama model, loaded before or after).
"""

import argparse

import torch

import swiftkern
from swiftkern import ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    skip_model, tok = swiftkern.load_model(args.model)
    model = skip_model.hf_model
    enc = tok(["The three states of matter are"], return_tensors="pt")
    with torch.no_grad():
        before = model(**enc).logits
        patch = swiftkern.apply_swiftkern_to_llama(model=model, rms_norm=True, swiglu=True)
        print("patched:", ", ".join(patch.targets), "| ops backends:",
              {k: v for k, v in ops.backend_info().get("ops", {}).items() if k in ("rms_norm", "silu_mul")})
        after = model(**enc).logits
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        patch.undo()
    print(f"max |logit difference| patched vs HF: {(after - before).abs().max().item():.3g} "
          f"(logits up to {before.abs().max().item():.3g})")
    print("patched generate:", tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
