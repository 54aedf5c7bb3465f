"""csrc/argmax_key.h, the order-preserving key the CUDA greedy_accept combines a row's vocabulary
chunks with (atomicMax of argmax_key(value, index)), compiled here by the host compiler into a
small driver: each chunk's best (value, index) from torch.argmax, combined through the keys, must
give torch.argmax of the whole row, whatever the chunks, ties, NaNs, signed zeros and infinities.
"""

import shutil
import struct
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

CSRC = Path(__file__).resolve().parent.parent / "csrc"

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "argmax_key.h"
// stdin: lines "<float bits as hex> <index>", one per chunk's best -> stdout: the combined index;
// "order <bits>" lines print float_order instead.
int main() {
  char what[16];
  unsigned bits;
  long long index;
  unsigned long long best = 0;
  while (std::scanf("%15s", what) == 1) {
    if (std::strcmp(what, "order") == 0) {
      std::scanf("%x", &bits);
      float v; std::memcpy(&v, &bits, 4);
      std::printf("%u\n", swiftkern::float_order(v));
      continue;
    }
    std::sscanf(what, "%x", &bits);
    std::scanf("%lld", &index);
    float v; std::memcpy(&v, &bits, 4);
    const unsigned long long key = swiftkern::argmax_key(v, index);
    if (key == 0) { std::printf("zero key\n"); return 1; }
    if (key > best) best = key;
  }
  std::printf("%lld\n", static_cast<long long>(swiftkern::argmax_key_index(best)));
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    cxx = shutil.which(cxx) or shutil.which("c++") or shutil.which("g++")
    assert cxx, "no C++ compiler on PATH (the extension build needs one too)"
    d = tmp_path_factory.mktemp("argmax_key")
    (d / "driver.cpp").write_text(DRIVER)
    subprocess.run([cxx, "-std=c++17", "-O2", f"-I{CSRC}", str(d / "driver.cpp"), "-o", str(d / "driver")],
                   check=True)
    return d / "driver"


def _bits(v: float) -> str:
    return format(struct.unpack("<I", struct.pack("<f", v))[0], "x")


def combined_argmax(driver, row: torch.Tensor, chunk: int) -> int:
    """Each chunk's argmax by torch, combined through argmax_key by the compiled header."""
    lines = []
    for start in range(0, row.numel(), chunk):
        i = int(row[start:start + chunk].argmax())
        lines.append(f"{_bits(float(row[start + i]))} {start + i}")
    run = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return int(run.stdout)


NEG_NAN = struct.unpack("<f", struct.pack("<I", 0xFFC00000))[0]  # x86's default NaN (0 * inf), sign bit set
SPECIAL = [float("nan"), NEG_NAN, float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3e38, -3e38, 1e-45, -1e-45]


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-4, 4, width=32)), min_size=1, max_size=40),
       chunk=st.integers(1, 12))
def test_chunks_combined_through_keys_match_torch_argmax(driver, values, chunk):
    row = torch.tensor(values, dtype=torch.float32)
    assert combined_argmax(driver, row, chunk) == int(row.argmax())


@pytest.mark.parametrize("case, want", [
    ([-1.0, -0.0, -1.0, 0.0], 1),  # -0.0 == 0.0: the lower index, even in a later-looking order
    ([-1.0, 0.0, -1.0, -0.0], 1),
    ([1.0, float("nan"), 2.0, float("nan")], 1),  # the first NaN wins over everything
    ([float("inf"), NEG_NAN, float("nan")], 1),  # whatever its sign bit
    ([float("-inf")] * 5, 0),  # a row of -inf: index 0
    ([2.0, 5.0, 5.0, 5.0, 1.0], 1),  # ties: the lowest index, across chunk borders
    ([float("inf"), 3e38, float("inf")], 0),
])
def test_rules_at_chunk_borders(driver, case, want):
    row = torch.tensor(case, dtype=torch.float32)
    assert int(row.argmax()) == want  # the rule is torch's
    for chunk in range(1, len(case) + 1):
        assert combined_argmax(driver, row, chunk) == want


def test_float_order_is_monotone(driver):
    """Sorted distinct floats (with both infinities and subnormals) get increasing orders; -0.0
    gets +0.0's; NaN is above +inf; -inf's order is above 0, so no key is 0 ("nothing yet")."""
    values = sorted({float(v) for v in torch.randn(200).mul(1e3)} | {float("inf"), float("-inf"), 1e-45,
                                                                       -1e-45, 0.0, 3.4e38, -3.4e38})
    stdin = "".join(f"order {_bits(v)}\n" for v in values + [-0.0, NEG_NAN])
    out = subprocess.run([str(driver)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    orders = [int(x) for x in out[:len(values) + 2]]
    assert all(a < b for a, b in zip(orders, orders[1:len(values)]))
    assert orders[len(values)] == orders[values.index(0.0)]
    assert orders[len(values) + 1] > orders[len(values) - 1]
    assert orders[0] > 0
