"""bench/bench_planner_phases.py measures what it says: replayed steps serve every call from the record,
the plans stay the same, and arguments are keyed by content."""
import sys

import numpy as np
import pytest

from batches import long_tail_docs, short_docs
from bench_scripts import load_bench
from blockattn.masks import MaskSpec
from blockattn.planner import clear_plan_cache
from blockattn.planner.cost_model import CostModel
from blockattn.planner.tiles import TileSet


def _bench():
    return load_bench("bench_planner_phases")


@pytest.fixture(scope="module")
def specs():
    # one batch the one-node dcp stops after its first start on, one where every start is balanced
    out = [MaskSpec.documents(short_docs(3, 32768)), MaskSpec.documents(long_tail_docs(5, 32768))]
    yield out
    clear_plan_cache()


def test_replayed_steps_serve_every_call_and_leave_the_plans_as_they_are(specs):
    bench = _bench()
    baseline = bench.measure(specs, (), repeats=1, reference=None)
    assert baseline["replayed_calls"] == 0 and len(baseline["plan_ms"]) == len(specs)
    for _name, steps in bench.REPLAY_SETS[1:]:
        entry = bench.measure(specs, steps, repeats=2, reference=baseline["fingerprints"])
        assert entry["fingerprints"] == baseline["fingerprints"]
        assert entry["replayed_calls"] > 0, steps  # the step ran in these plans and was served from the record
        assert entry["unreplayed_calls"] == 0, steps


def test_a_step_that_changes_its_result_is_caught(specs, monkeypatch):
    bench = _bench()
    baseline = bench.measure(specs, (), repeats=1, reference=None)
    import blockattn.planner.candidates as candidates

    original = candidates._balanced

    def reversed_ranks(*args, **kwargs):  # a "compiled" step that is wrong: every tile on another rank
        home, rank = original(*args, **kwargs)
        return home, (rank + 1) % args[1]

    monkeypatch.setattr(candidates, "_balanced", reversed_ranks)
    monkeypatch.setattr(sys.modules["blockattn.planner.first_pass"], "_balanced", reversed_ranks)
    with pytest.raises(AssertionError, match="changed the plans"):
        bench.measure(specs, ("balancing",), repeats=1, reference=baseline["fingerprints"])


def test_arguments_are_keyed_by_content():
    bench = _bench()
    key = bench.argument_key
    a = np.arange(10)
    assert key(a) == key(a.copy()) != key(a[::-1].copy())
    assert key(a) != key(a.astype(np.int32))  # (same values, another dtype)
    spec = MaskSpec.documents([100, 28])
    t1 = TileSet.from_block_mask(spec.block_mask(16))
    clear_plan_cache()
    t2 = TileSet.from_block_mask(MaskSpec.documents([100, 28]).block_mask(16))
    assert t1 is not t2 and key(t1) == key(t2)
    assert key(CostModel()) == key(CostModel()) != key(CostModel(balance_duplex=True))
    assert key({"b": 1, "a": (a, 2.0)}) == key({"a": (a.copy(), 2.0), "b": 1})
    with pytest.raises(TypeError, match="no replay key"):
        key(object())
