"""A Qwen3-0.6B-shaped model with random weights, saved for ``python -m bench --model DIR``.

    python bench/random_qwen3.py DIR

No Qwen3 checkpoint is among the test data and nothing downloads, so this times Qwen3's layout
(28 layers, hidden 1024, 16 query / 8 key-value heads of 128, per-head q/k norms, vocabulary
151936, tied embeddings): speed does not depend on the weights' values. The LM head is scaled up
so that greedy picks are not near-ties (HF and swiftkern then agree on every token, which the
routine checks). SmolLM2's tokenizer and chat template are saved with it (its ids all fall inside
Qwen3's vocabulary). Writes ~2.3 GB (float32)."""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write the model and tokenizer to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import swiftkern
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(args.out)
    swiftkern.load_model("smollm2")[1].save_pretrained(args.out)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
