import pytest
from hypothesis import given, strategies as st

from swiftkern import LayerSet, SwiftkernError


@given(st.integers(1, 40).flatmap(
    lambda L: st.tuples(st.just(L), st.sets(st.integers(0, L - 1)), st.sets(st.integers(0, L - 1)))))
def test_round_trips(args):
    L, attn, mlp = args
    if len(attn) == L and len(mlp) == L:
        with pytest.raises(SwiftkernError):
            LayerSet(L, tuple(attn), tuple(mlp))
        return
    ls = LayerSet(L, tuple(attn), tuple(mlp))
    assert LayerSet.parse(str(ls), L) == ls
    assert LayerSet.parse(ls.to_json(), L) == ls
    assert LayerSet.from_bits(ls.to_bits()) == ls
    assert ls.num_skipped == len(attn) + len(mlp)
    assert [i for i, s in enumerate(ls.attn_mask()) if s] == sorted(attn)


def test_compact_string_form():
    ls = LayerSet.parse("attn:1,3-5|mlp:2", 8)
    assert ls.skip_attn == (1, 3, 4, 5) and ls.skip_mlp == (2,)
    assert str(ls) == "attn:1,3-5|mlp:2"
    assert LayerSet.parse("none", 8).is_empty
    assert ls.skip_ratio == pytest.approx(5 / 16)


@pytest.mark.parametrize("spec,msg", [
    ("attn:9", "outside"), ("foo:1", "expected"), ("attn:x", "not an index"),
    ('{"num_layers": 3}', "3-layer"), ("{bad", "malformed"),
])
def test_bad_specs_are_refused(spec, msg):
    with pytest.raises(SwiftkernError, match=msg):
        LayerSet.parse(spec, 8)


def test_random_keeps_ends_and_ratio():
    ls = LayerSet.random(30, 0.45, seed=3)
    assert ls.num_skipped == round(0.45 * 60)
    assert 0 not in ls.skip_attn + ls.skip_mlp and 29 not in ls.skip_attn + ls.skip_mlp
    assert LayerSet.random(30, 0.45, seed=3) == ls
