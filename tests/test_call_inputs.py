"""generate()'s per-call input checks (swiftkern/call_inputs.py), called directly: what each
accepts, how it normalizes, and what it refuses (Generator.generate's own tests call them too)."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from swiftkern.arg_checks import whole
from swiftkern.call_inputs import arrival_steps, check_positions, per_prompt, stop_string_check, stop_token_set
from swiftkern.errors import SwiftkernError
from swiftkern.model import SkipModel


class _Letters:
    """Token t reads as chr(97 + t % 26); eos_token_id as given."""

    def __init__(self, eos=None):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(t) % 26) for t in ids)


def test_per_prompt_spreads_one_value_and_checks_each():
    check = lambda s: whole("seed", s, 0)  # noqa: E731
    assert per_prompt("seeds", 7, 3, check) == [7, 7, 7]
    assert per_prompt("seeds", (1, 2), 2, check) == [1, 2]
    with pytest.raises(SwiftkernError, match="got 1 seeds for 2 prompts"):
        per_prompt("seeds", [1], 2, check)
    with pytest.raises(SwiftkernError, match="seed must be an integer"):
        per_prompt("seeds", [1, 2.5], 2, check)  # each value checked before the count


def test_arrival_steps():
    assert arrival_steps(None, 3) is None
    assert arrival_steps((0, 4, 0), 3) == [0, 4, 0]
    for bad in ([1, 2], [0, -1], [0, True], [0, 1.0], [0], 0, "0, 1"):
        with pytest.raises(SwiftkernError, match="arrive_at"):
            arrival_steps(bad, 2)


def test_stop_token_set_takes_the_given_ids_or_the_models_eos():
    model = SkipModel(tiny_model("llama"))
    model.hf_model.generation_config.eos_token_id = [3, 9]
    assert stop_token_set(model, None, None, None) == {3, 9}
    assert stop_token_set(model, None, None, [4]) == {3, 4, 9}
    assert stop_token_set(model, None, 5, [4]) == {4, 5}  # an explicit EOS replaces the model's
    assert stop_token_set(model, None, [], None) == frozenset()
    model.hf_model.generation_config.eos_token_id = None
    assert stop_token_set(model, _Letters(eos=11), None, None) == {11}  # then the tokenizer's
    assert stop_token_set(model, None, None, None) == frozenset()
    with pytest.raises(SwiftkernError, match=r"stop_token_ids entry must be in \[0, "):
        stop_token_set(model, None, None, [model.vocab_size])


def test_stop_string_check_reads_the_text():
    check = stop_string_check(_Letters(), "cd")  # one stop string, not the letters c and d
    assert check(0, [1, 2, 3]) and not check(0, [2, 1, 3]) and not check(0, [3])
    either = stop_string_check(_Letters(), ["zz", "b"])
    assert either(0, [0, 1]) and not either(0, [0, 2])
    assert stop_string_check(_Letters(), None) is None and stop_string_check(_Letters(), []) is None
    for bad in ("", [""], ["a", 3], 5):
        with pytest.raises(SwiftkernError, match="stop must be a non-empty string"):
            stop_string_check(_Letters(), bad)
    with pytest.raises(SwiftkernError, match="stop strings need a tokenizer"):
        stop_string_check(None, "a")


def test_check_positions():
    model = SkipModel(tiny_model("llama"))
    limit = model.config.max_position_embeddings
    check_positions(model, limit - 4, 4)
    with pytest.raises(SwiftkernError, match=f"exceeds the model's {limit} positions"):
        check_positions(model, limit - 4, 5)
