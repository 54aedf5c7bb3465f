"""The replay rule (``generator_options.replay_elided``) on every device and kernel set, against
the table the README and ``swiftkern generate --help`` give. The CUDA rows run on any machine:
the rule reads only the model's device and dtype and which invariant set runs there."""

from types import SimpleNamespace

import pytest
import torch

from swiftkern import generator_options


def _elided(monkeypatch, device: str, has_set: bool, mode: str, replay: str, drafter: str) -> bool:
    """replay_elided for a model on ``device`` where the batch-invariant set runs (``has_set``:
    the C++ set on the CPU, the Triton set on CUDA) or does not."""
    monkeypatch.setattr(generator_options, "invariant_kernels_available",
                        lambda d, dtype: has_set and d == "cpu")
    monkeypatch.setattr(generator_options, "invariant_backend",
                        lambda d, dtype: ("cpp" if d == "cpu" else "triton") if has_set else None)
    model = SimpleNamespace(device=torch.device(device), dtype=torch.float32)
    return generator_options.replay_elided(model, mode, replay, drafter)


# (device, invariant set there, replay, drafter) -> whether the replay is skipped
TABLE = [
    ("cpu", True, "auto", "auto", True),  # every CPU kernel batch- and length-invariant
    ("cpu", True, "auto", "self-spec", True),
    ("cpu", False, "auto", "auto", False),  # no C++ set: only the replay is deterministic
    ("cuda", True, "auto", "auto", True),  # every step on the Triton set costs less than the replay
    ("cuda", True, "auto", "self-spec", False),  # the self-spec drafter replays on CUDA
    ("cuda", False, "auto", "auto", False),
    ("cpu", True, "never", "auto", True),
    ("cuda", True, "never", "self-spec", True),  # never: no replay wherever a set runs
    ("cpu", True, "always", "auto", False),
    ("cuda", True, "always", "auto", False),
]


@pytest.mark.parametrize("device,has_set,replay,drafter,elided", TABLE)
def test_the_replay_is_skipped_where_the_table_says(monkeypatch, device, has_set, replay, drafter, elided):
    assert _elided(monkeypatch, device, has_set, "deterministic", replay, drafter) is elided


@pytest.mark.parametrize("mode", ["ar", "self-spec"])
def test_other_modes_have_no_replay_to_skip(monkeypatch, mode):
    assert _elided(monkeypatch, "cpu", True, mode, "auto", "auto") is False
