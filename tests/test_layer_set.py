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


@pytest.mark.parametrize("bad,good", [("attn:8", "attn:7"), ("mlp:8", "mlp:7"), ("attn:1|mlp:6-8", "attn:1|mlp:6-7"),
                                      ('{"num_layers": 8, "skip_mlp": [8]}', '{"num_layers": 8, "skip_mlp": [7]}')])
def test_index_equal_to_num_layers_is_refused(bad, good):
    """Indices live in [0, L): L itself (one past the last layer) is refused, L - 1 is not."""
    with pytest.raises(SwiftkernError, match="outside"):
        LayerSet.parse(bad, 8)
    assert 7 in LayerSet.parse(good, 8).skip_attn + LayerSet.parse(good, 8).skip_mlp


def test_parse_against_explicit_masks():
    """Each kind lands in its own mask: the [2L] bitmask written out by hand."""
    ls = LayerSet.parse("mlp:0,2-3|attn:4", 5)
    assert ls.to_bits() == [0, 0, 0, 0, 1] + [1, 0, 1, 1, 0]
    assert LayerSet.parse('{"num_layers": 5, "skip_attn": [4], "skip_mlp": [3, 0, 2]}', 5) == ls
    assert LayerSet.from_bits([0, 1, 0, 0] + [0, 0, 1, 0]) == LayerSet(4, (1,), (2,))


@pytest.mark.parametrize("spec", ["attn:5-3|mlp:1", "attn:1|attn:3", "attn:1-|mlp:2"])
def test_reversed_range_or_repeated_field_is_refused(spec):
    """A typo must not silently become another layer set (expected: an error, like "attn:x")."""
    with pytest.raises(SwiftkernError):
        LayerSet.parse(spec, 8)


@pytest.mark.parametrize("L,ratio", [(6, 0.3), (12, 0.45), (30, 0.2)])
def test_random_keeps_both_ends_of_both_kinds_over_seeds(L, ratio):
    """Over many seeds: never layer 0 or L-1 (attention or MLP), always round(ratio * 2L) skipped,
    and every inner sub-layer chosen by some seed (the pool is all of them)."""
    seen = set()
    for seed in range(200):
        ls = LayerSet.random(L, ratio, seed=seed)
        assert ls.num_skipped == round(ratio * 2 * L)
        picked = {("attn", i) for i in ls.skip_attn} | {("mlp", i) for i in ls.skip_mlp}
        assert not {i for _, i in picked} & {0, L - 1}, ls
        seen |= picked
    assert seen == {(kind, i) for kind in ("attn", "mlp") for i in range(1, L - 1)}


@pytest.mark.parametrize("make, msg", [
    (lambda: LayerSet(4, (1.5,), ()), "skip_attn entry must be an integer, got 1.5"),  # was truncated to layer 1
    (lambda: LayerSet(4, "12", ()), "skip_attn must be a sequence of layer indices"),  # was layers 1 and 2
    (lambda: LayerSet(4, (True,), ()), "skip_attn entry must be an integer, got True"),
    (lambda: LayerSet(4, None, ()), "skip_attn must be a sequence"),
    (lambda: LayerSet(2.5), "num_layers must be an integer"),
    (lambda: LayerSet("4"), "num_layers must be an integer"),
    (lambda: LayerSet.parse(None, 4), "layer set must be a string"),
    (lambda: LayerSet.parse("attn:1", "4"), "num_layers must be an integer"),
    (lambda: LayerSet.parse('{"skip_attn": "x"}', 4), "skip_attn must be a sequence"),
    (lambda: LayerSet.parse('{"skip_attn": [1.5]}', 4), "skip_attn entry must be an integer"),
], ids=["float-index", "string-indices", "bool-index", "none-indices", "float-L", "string-L", "parse-none",
        "parse-string-L", "json-string-indices", "json-float-index"])
def test_arguments_of_the_wrong_kind_are_refused_not_truncated(make, msg):
    with pytest.raises(SwiftkernError, match=msg):
        make()


def test_a_huge_range_is_refused_before_it_is_expanded():
    """"attn:1-3000000" built a list of three million indices and a 26 MB message first."""
    import time

    t = time.perf_counter()
    with pytest.raises(SwiftkernError, match=r"entry '1-3000000' is outside the 4 layers") as refused:
        LayerSet.parse("attn:1-3000000", 4)
    assert time.perf_counter() - t < 0.5 and len(str(refused.value)) < 200


@pytest.mark.parametrize("spec", ["attn:1_0", "attn:+1", "mlp:2-+3", "attn:\u0663", "attn:1-3_0"])
def test_an_index_is_ascii_digits(spec):
    """int() took "1_0" as layer 10, "+1" as 1 and an Arabic-Indic three as 3: a typo became
    another layer set."""
    with pytest.raises(SwiftkernError, match="not an index or a range"):
        LayerSet.parse(spec, 40)
    assert LayerSet.parse("attn: 1 - 3 ,5|mlp:0", 8) == LayerSet(8, (1, 2, 3, 5), (0,))  # spaces are fine


def test_random_keeps_the_ends_of_a_model_of_two_layers_or_fewer():
    """With no inner layer there is nothing to skip: random(2, 0.6) skipped the last layer's
    sub-layers and random(1, 0.75) every sub-layer (refused as such)."""
    assert LayerSet.random(2, 0.6).num_skipped == 0 and LayerSet.random(1, 0.75).num_skipped == 0
    three = LayerSet.random(3, 0.9)
    assert three.skip_attn == (1,) and three.skip_mlp == (1,)  # the one inner layer, whatever the ratio
    assert LayerSet.random(2, 0.6, protect_ends=False).num_skipped == 2


@pytest.mark.parametrize("make,msg", [
    (lambda: LayerSet(0), "num_layers must be >= 1, got 0"),
    (lambda: LayerSet.from_bits([0, 1, 0]), "a bitmask has 2L entries, got 3"),
    (lambda: LayerSet.parse('{"skip_atn": [1]}', 8), r"unknown JSON keys \['skip_atn'\]"),  # not an empty set
    (lambda: LayerSet.parse('{"num_layers": "8"}', 8), "JSON num_layers must be an integer, got '8'"),
    (lambda: LayerSet.random(8, 1.0), r"skip ratio must be in \[0, 1\), got 1.0"),
    (lambda: LayerSet.random(8, -0.1), r"skip ratio must be in \[0, 1\), got -0.1"),
])
def test_other_bad_layer_sets_are_refused_with_what_is_wrong(make, msg):
    with pytest.raises(SwiftkernError, match=msg):
        make()
    assert LayerSet.random(8, 0.0).is_empty  # the closed end: nothing skipped
