"""A GGUF file's tokenizer as the file describes it: its special tokens, and whether a BOS token
starts every text.

transformers 4.57 makes SmolLM2's GGUF tokenizer with ``<|im_start|>`` as EOS, no padding token,
and a BOS before every text, where the file says EOS and padding ``<|im_end|>`` and no BOS
(``tokenizer.ggml.*``): its prompts were one token longer than the model's own (5.x follows the
file), and a padded batch was refused. ``follow_the_file`` sets what the file says.
"""

from __future__ import annotations

from .errors import SwiftkernError

SPECIAL_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
               "pad": "tokenizer.ggml.padding_token_id"}
FLAGS = {"add_bos_token": "tokenizer.ggml.add_bos_token", "add_eos_token": "tokenizer.ggml.add_eos_token"}


def gguf_tokenizer_fields(path: str) -> dict:
    """The file's special token ids (``bos``, ``eos``, ``pad``) and flags (``add_bos_token``,
    ``add_eos_token``) that it sets, by those names. Inside ``gguf_once.gguf_parsed_once`` this
    reads the parse the model's load made."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out = {}
    for name, key in {**SPECIAL_IDS, **FLAGS}.items():
        field = fields.get(key)
        if field is not None and field.data:
            value = field.parts[field.data[0]][0]
            out[name] = bool(value) if name in FLAGS else int(value)
    return out


def follow_the_file(tokenizer, fields: dict) -> None:
    """Set ``tokenizer``'s BOS, EOS and padding tokens and its add-BOS/EOS flags to ``fields``
    (``gguf_tokenizer_fields``) where they differ; raises SwiftkernError where this
    transformers' tokenizer still does not add (or leave out) a BOS as the file says."""
    for name in SPECIAL_IDS:
        wanted = fields.get(name)
        if wanted is not None and getattr(tokenizer, f"{name}_token_id") != wanted:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(wanted))
    for flag in FLAGS:
        if flag in fields and getattr(tokenizer, flag, None) not in (None, fields[flag]):
            setattr(tokenizer, flag, fields[flag])
    bos, add_bos = fields.get("bos"), fields.get("add_bos_token")
    if bos is not None and add_bos is not None:
        starts = tokenizer("a")["input_ids"][:1] == [bos]
        if starts != add_bos:
            import transformers

            raise SwiftkernError(f"transformers {transformers.__version__}'s tokenizer for this GGUF file "
                                 f"{'adds' if starts else 'does not add'} a BOS token where the file says "
                                 f"{'not to' if starts else 'to'}; upgrade transformers (5.x follows the file)")
