"""The benchmark workload generator: deterministic and shaped as the issue specifies."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from workloads import VOCAB, multi_turn, packed  # noqa: E402


@pytest.fixture(scope="module")
def workload():
    return multi_turn(seed=7)


def test_shape(workload):
    assert len(workload.system_prompts) == 20
    assert all(850 <= len(p) <= 1200 for p in workload.system_prompts)
    assert len(workload.conversations) == 200
    assert all(len(c.turns) == 10 and all(150 <= len(t) <= 300 for t in c.turns) for c in workload.conversations)
    assert len(workload.inserts) == 2000 and len(workload.lookups) == 10_000
    assert max(int(s.max()) for s in workload.inserts) < VOCAB
    kinds = {k: workload.lookup_kinds.count(k) for k in ("repeat", "extend", "new")}
    assert abs(kinds["repeat"] - 5000) < 300 and abs(kinds["extend"] - 2500) < 250 and abs(kinds["new"] - 2500) < 250


def test_turns_are_inserted_in_order(workload):
    progress = {}
    for (conv, turns), tokens in zip(workload.insert_order, workload.inserts):
        assert turns == progress.get(conv, 0) + 1
        progress[conv] = turns
        expected = workload.conversations[conv].sequence(workload.system_prompts, turns)
        assert np.array_equal(tokens, expected)
    assert set(progress.values()) == {10}


def test_lookups_relate_to_inserts(workload):
    inserted = {s.tobytes() for s in workload.inserts}
    prompts = [p.tobytes() for p in workload.system_prompts]
    for kind, tokens in zip(workload.lookup_kinds[:500], workload.lookups[:500]):
        if kind == "repeat":
            assert tokens.tobytes() in inserted
        elif kind == "extend":
            assert tokens[:-200].tobytes() in inserted
        else:
            assert any(tokens.tobytes().startswith(p) for p in prompts)


def test_deterministic_from_the_seed(workload):
    again = multi_turn(seed=7)
    assert packed(again.inserts) == packed(workload.inserts)
    assert packed(again.lookups) == packed(workload.lookups)
    other = multi_turn(seed=8)
    assert packed(other.inserts) != packed(workload.inserts)
