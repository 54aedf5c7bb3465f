"""The GGUF tokenizer follows the file: SmolLM2's says EOS and padding <|im_end|> (2), BOS
<|im_start|> (1) and no BOS before a text. transformers 4.57 made it with EOS <|im_start|>, no
padding token and a BOS before every text (prompts one token longer than the model's own, a
padded batch refused); 5.x follows the file. Here a tokenizer broken as 4.57 made it is mended."""

from __future__ import annotations

import copy

import pytest

from swiftkern.errors import SwiftkernError
from swiftkern.gguf_once import gguf_parsed_once
from swiftkern.gguf_tokenizer import follow_the_file, gguf_tokenizer_fields
from swiftkern.loading import smollm2_path

CHAT = [{"role": "user", "content": "Name a prime."}]


@pytest.fixture(scope="module")
def fields():
    with gguf_parsed_once():
        return gguf_tokenizer_fields(smollm2_path())


def test_the_files_fields(fields):
    assert fields == {"bos": 1, "eos": 2, "pad": 2, "add_bos_token": False}


def encodings(tokenizer):
    return (tokenizer("The capital of France is")["input_ids"], tokenizer.eos_token_id, tokenizer.pad_token_id,
            tokenizer.bos_token_id, tokenizer(["a", "b c d"], padding=True)["input_ids"],
            list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]))


def test_load_model_gives_the_files_tokenizer(smollm2):
    _, tokenizer = smollm2
    ids, eos, pad, bos, _, chat = encodings(tokenizer)
    assert (ids[0], eos, pad, bos) == (504, 2, 2, 1)  # "The", no BOS before it
    assert chat[:2] == [1, 9690] and chat.count(1) == 3  # <|im_start|>system: one per turn, none added


def test_a_tokenizer_made_as_transformers_4_made_it_is_mended(smollm2, fields):
    _, loaded = smollm2
    broken = copy.deepcopy(loaded)
    broken.eos_token, broken.pad_token, broken.add_bos_token = "<|im_start|>", None, True
    assert (broken("a")["input_ids"][0], broken.eos_token_id, broken.pad_token_id) == (1, 1, None)
    follow_the_file(broken, fields)
    assert encodings(broken) == encodings(loaded)


def test_a_bos_the_tokenizer_cannot_leave_out_is_refused(smollm2, fields):
    _, loaded = smollm2

    class AlwaysBos:  # a tokenizer whose BOS no flag switches off
        bos_token_id, eos_token_id, pad_token_id, add_bos_token = 1, 2, 2, False

        def __call__(self, text):
            return {"input_ids": [1] + loaded(text)["input_ids"]}

    with pytest.raises(SwiftkernError, match=r"adds a BOS token where the file says not to; upgrade transformers"):
        follow_the_file(AlwaysBos(), fields)
