"""Prompts into token ids (swiftkern.prompt_ids): a real HF tokenizer's chat template, and the
vocabulary's edges, against what the tokenizer itself gives and the closed range [0, V)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model
from swiftkern import Generator, SwiftkernError
from swiftkern.prompt_ids import encode_prompts

VOCAB = {"[UNK]": 0, "</s>": 1, "user": 2, "hi": 3, "there": 4, "assistant": 5}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer built here (nothing downloaded): one id a word, a chat template."""
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="</s>")
    tok.chat_template = TEMPLATE
    return tok


def test_a_chat_prompt_is_the_templates_token_ids():
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True): the ids
    are its input_ids, the same as tokenizing the rendered template."""
    tok = word_tokenizer()
    messages = [{"role": "user", "content": "hi there"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tok(rendered)["input_ids"]
    assert want == [2, 3, 4, 5]
    assert encode_prompts("hi there", tok, len(VOCAB), chat=True) == [want]
    assert encode_prompts(["hi there", "there"], tok, len(VOCAB), chat=False) == [[3, 4], [4]]


@pytest.mark.parametrize("ids, refused", [([0, 300], False), ([300], False), ([301], True), ([-1], True),
                                          ([5, 301, 7], True)])
def test_token_ids_must_lie_in_the_vocabulary(ids, refused):
    """tiny_model's vocabulary is 301 ids: 0..300 are taken, 301 and -1 refused before any forward."""
    gen = Generator(tiny_model("llama"))
    assert gen.model.vocab_size == 301
    if not refused:
        assert len(gen.generate([ids], max_new_tokens=1).tokens[0]) == 1
        return
    with pytest.raises(SwiftkernError, match=r"outside \[0, 301\)"):
        gen.generate([ids], max_new_tokens=1)


def test_a_tuple_of_ids_is_one_prompt_as_a_list_is():
    """A tuple was taken for a list of prompts, each id a prompt ("prompt 0 must be text or a
    list of token ids, got int")."""
    assert encode_prompts((5, 6, 7), None, 300) == encode_prompts([5, 6, 7], None, 300) == [[5, 6, 7]]
    assert encode_prompts(((5, 6), [7]), None, 300) == [[5, 6], [7]]


def test_prompts_as_arrays_are_their_ids_and_other_arrays_are_refused():
    """A NumPy batch ([B, T], as a tokenizer's return_tensors="np") and a list of 1-D tensors or
    arrays (prompts of different lengths) were refused ("prompt 0 must be text or a list of
    token ids, got Tensor"); they are the ids they hold, as a [B, T] tensor was."""
    import numpy
    import torch

    want = [[5, 6, 7], [8, 9, 10]]
    for batch in (torch.tensor(want), numpy.array(want), numpy.array(want, dtype=numpy.uint16), list(torch.tensor(want)),
                  [numpy.array(want[0]), want[1]]):
        got = encode_prompts(batch, None, 300)
        assert got == want and all(type(t) is int for p in got for t in p)
    assert encode_prompts([torch.tensor([5, 6, 7]), numpy.array([8])], None, 300) == [[5, 6, 7], [8]]
    gen = Generator(tiny_model("llama"))
    ragged = [torch.tensor([5, 6, 7]), numpy.array([8])]
    assert gen.generate(ragged, max_new_tokens=3).tokens == gen.generate([[5, 6, 7], [8]], max_new_tokens=3).tokens
    for bad, said in ((numpy.array([[1.0, 2.0]]), "a prompt tensor must hold integer token ids"),
                      (numpy.array(["a"]), "a prompt tensor must hold integer token ids"),
                      ([torch.tensor([[1, 2]])], r"prompt 0 must hold integer token ids, \[T\]"),
                      ([numpy.array([True])], "prompt 0 must hold integer token ids"),
                      ([torch.tensor([4]), torch.tensor([1.5])], "prompt 1 must hold integer token ids"),
                      (numpy.array([[1, 400]]), r"prompt 0 has token ids \[400\] outside \[0, 300\)")):
        with pytest.raises(SwiftkernError, match=said):
            encode_prompts(bad, None, 300)
