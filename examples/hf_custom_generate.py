"""swiftkern behind HF ``model.generate``: the same call HF users make, decoded by swiftkern.

    python examples/hf_custom_generate.py [--model smollm2|<HF folder>|<.gguf>] [--max-new-tokens 64]
                                          [--device cpu|cuda]

Runs plain HF greedy ``generate``, then the same call with ``custom_generate`` in swiftkern's
``ar`` mode and ``self-spec`` mode with the prompt-lookup drafter (on a GPU also with CUDA
graphs, kept across calls by one ``GraphRunner``), streams one of them, and prints the time of
each and whether the tokens are equal.
"""

import argparse
import time

import torch
from transformers import TextStreamer

import swiftkern
from swiftkern.integrations.transformers import generate as swift_generate

PROMPT = ("Rewrite this sentence so it is shorter, keeping its meaning: 'The meeting that had been "
          "planned for Monday morning has been moved, because of a scheduling conflict, to Tuesday.'")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    skip_model, tok = swiftkern.load_model(args.model, device=args.device)
    model = skip_model.hf_model  # a plain HF LlamaForCausalLM
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    enc = tok([text], return_tensors="pt").to(args.device)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)

    runs = {"HF generate": {},
            "swiftkern ar": dict(custom_generate=swift_generate, swift_mode="ar"),
            "swiftkern self-spec (lookup)": dict(custom_generate=swift_generate, swift_mode="self-spec",
                                                 drafter="lookup", k_max=5)}
    if skip_model.device.type == "cuda":  # the runner keeps its cache and graphs across generate calls
        from swiftkern.cuda_graphs import GraphRunner

        graphs = dict(swift_kwargs={"cuda_graphs": GraphRunner(skip_model)})
        for call in ("call 1", "call 2"):  # call 2 replays what call 1 captured
            runs[f"self-spec (lookup) + CUDA graphs, {call}"] = dict(runs["swiftkern self-spec (lookup)"], **graphs)
    outputs = {}
    for name, extra in runs.items():
        t = time.perf_counter()
        with torch.no_grad():
            outputs[name] = model.generate(**enc, **common, **extra)
        n = outputs[name].shape[1] - enc["input_ids"].shape[1]
        print(f"{name:55s} {n} tokens in {time.perf_counter() - t:.2f} s, equal to HF: "
              f"{torch.equal(outputs[name], outputs['HF generate'])}")

    print("\nstreamed (swiftkern self-spec, tokens appear as they are verified):")
    model.generate(**enc, **common, streamer=TextStreamer(tok, skip_prompt=True), **runs["swiftkern self-spec (lookup)"])


if __name__ == "__main__":
    main()
