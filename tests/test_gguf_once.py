"""gguf_once.gguf_parsed_once: one GGUF reader per file and one tensor-name map per
architecture inside the block, the garbage collector paused, everything as before after it (an
error too); and SmolLM2 loaded with it is the model, config and tokenizer loaded without it."""

import contextlib
import gc

import gguf
import numpy as np
import pytest
import torch

import swiftkern
from swiftkern.gguf_once import gguf_parsed_once


def small_gguf(path, value: int) -> str:
    """A GGUF file of one key and one small tensor -> its path."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("t", np.arange(8, dtype=np.float32) * value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_one_reader_a_file_and_one_name_map_inside_only(tmp_path):
    a, b = small_gguf(tmp_path / "a.gguf", 2), small_gguf(tmp_path / "b.gguf", 3)
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    original_dequantize = gguf.dequantize
    with gguf_parsed_once():
        assert gguf.dequantize is not original_dequantize  # gguf_dequant's, for Q4_1 and Q8_0
        ra = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is ra
        rb = gguf.GGUFReader(b)
        assert rb is not ra
        assert list(rb.tensors[0].data) == [3.0 * i for i in range(8)]
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
    assert gguf.dequantize is original_dequantize
    assert gguf.GGUFReader(a) is not ra


def rich_gguf(path) -> str:
    """A GGUF file with every kind of metadata array the fast reader reads itself (strings,
    empty strings, integers, floats, bools, an empty array) and one it leaves to gguf (an array
    of arrays), plus scalars, a string and two tensors -> its path."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "hello", "Ünïcode", "a b"] * 40)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3, -4] * 25)
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint32("test.value", 7)
    writer.add_string("test.name", "small")
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.add_tensor("u", np.ones((3, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def assert_same_fields(mine, gguf_own):
    """Every field of the two readers alike: offset, name, data indices, types, and each part's
    dtype, shape and bytes; and the tensors' names, types and data."""
    assert list(mine.fields) == list(gguf_own.fields) and len(mine.fields) > 3
    for name, f in gguf_own.fields.items():
        g = mine.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), name
        assert len(g.parts) == len(f.parts), name
        for a, b in zip(g.parts, f.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in mine.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in gguf_own.tensors]
    for a, b in zip(mine.tensors, gguf_own.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_a_read_only_reader_holds_plain_arrays_with_the_same_fields(tmp_path):
    """Inside the block a read-only reader's file and every slice of it are plain ndarrays (no
    ``memmap`` Python hooks on each of SmolLM2's ~147k field reads), its arrays read in one loop
    each, with every field and tensor of a reader made outside it; a writable one keeps its
    memmap (``flush`` and all)."""
    a = rich_gguf(tmp_path / "a.gguf")
    outside = gguf.GGUFReader(a)
    assert isinstance(outside.data, np.memmap)
    with gguf_parsed_once():
        inside = gguf.GGUFReader(a)
        writable = gguf.GGUFReader(a, "r+")
    assert isinstance(inside, gguf.GGUFReader) and type(inside).__name__ == "GGUFReader"
    assert type(inside.data) is np.ndarray and not inside.data.flags.writeable
    for f in inside.fields.values():
        assert all(type(part) is np.ndarray for part in f.parts), f.name
    assert type(inside.tensors[0].data) is np.ndarray
    assert_same_fields(inside, outside)
    assert isinstance(writable.data, np.memmap)
    assert_same_fields(writable, outside)


@pytest.mark.slow
def test_smollm2s_file_reads_the_same_fields():
    from swiftkern.gguf_reader_fast import fast_reader_class

    path = swiftkern.loading.smollm2_path()
    assert_same_fields(fast_reader_class(gguf.GGUFReader)(path), gguf.GGUFReader(path))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_paused_inside_and_as_before_after_an_error(enabled, tmp_path):
    was = gc.isenabled()
    original_reader = gguf.GGUFReader
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError, match="inside"):
            with gguf_parsed_once():
                assert not gc.isenabled()
                raise RuntimeError("an error inside")
        assert gc.isenabled() == enabled
        assert gguf.GGUFReader is original_reader
    finally:
        gc.enable() if was else gc.disable()


def test_nested_and_overlapping_blocks_restore_only_at_the_last_exit(tmp_path):
    """A load inside a load, and two loads in threads whose blocks close in the order they
    opened: until the last block closes gguf keeps the memoized functions and the collector
    stays paused; after it both are as before the first. (A first version restored at each
    exit what that block had replaced: the thread case then left the first block's memoized
    reader behind for good.)"""
    import threading

    a = small_gguf(tmp_path / "a.gguf", 2)
    original_reader, collecting = gguf.GGUFReader, gc.isenabled()
    with gguf_parsed_once():
        outer = gguf.GGUFReader(a)
        with gguf_parsed_once():
            assert gguf.GGUFReader(a) is outer
        assert gguf.GGUFReader(a) is outer and not gc.isenabled()
    assert gguf.GGUFReader is original_reader and gc.isenabled() == collecting

    # not last in, first out: the thread's block opens first and closes while the main one is open
    first_in, close_first, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with gguf_parsed_once():
            first_in.set()
            close_first.wait(10)
        first_out.set()

    worker = threading.Thread(target=first)
    worker.start()
    assert first_in.wait(10)
    with gguf_parsed_once():
        mine = gguf.GGUFReader(a)
        close_first.set()
        assert first_out.wait(10)
        assert gguf.GGUFReader(a) is mine and not gc.isenabled()  # still this block's readers
    worker.join(10)
    assert gguf.GGUFReader is original_reader and gc.isenabled() == collecting


@pytest.mark.slow
def test_smollm2_loads_the_same_with_and_without_it(monkeypatch):
    fast_model, fast_tok = swiftkern.load_model("smollm2")
    monkeypatch.setattr(swiftkern.loading, "gguf_parsed_once", contextlib.nullcontext)
    slow_model, slow_tok = swiftkern.load_model("smollm2")
    fast, slow = fast_model.hf_model, slow_model.hf_model
    assert fast.config.to_dict() == slow.config.to_dict()
    fast_sd, slow_sd = fast.state_dict(), slow.state_dict()
    assert fast_sd.keys() == slow_sd.keys() and len(fast_sd) > 200
    for name, tensor in fast_sd.items():
        assert tensor.dtype == slow_sd[name].dtype and torch.equal(tensor, slow_sd[name]), name
    assert fast_tok.get_vocab() == slow_tok.get_vocab()
    text = "The committee approved the new budget after a long debate. Ünïcode, tabs\tand 12345."
    assert fast_tok(text)["input_ids"] == slow_tok(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert fast_tok.apply_chat_template(chat, tokenize=False) == slow_tok.apply_chat_template(chat, tokenize=False)
