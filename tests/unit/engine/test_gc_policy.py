"""The serving process's garbage-collector settings (tail latency of the step loop)."""
import gc

import pytest

from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.gc_policy import STEP_GEN0_THRESHOLD, tune_gc_for_serving
from affinity_serve.engine.llm_engine import LLMEngine


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_tune_freezes_the_heap_and_raises_the_young_threshold(restore_gc):
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    tune_gc_for_serving()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (STEP_GEN0_THRESHOLD, 10, 10)
    gc.set_threshold(0, 10, 10)          # automatic collection off: stays off
    tune_gc_for_serving()
    assert gc.get_threshold()[0] == 0


def test_a_replica_tunes_the_collector_but_a_bare_engine_does_not(checkpoints, restore_gc):
    """Process-wide settings belong to the serving process (a replica), not to every engine built (the
    offline LLM, tests)."""
    from affinity_serve.app.replica import LLMReplica
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    cfg = dict(model=checkpoints["llama"], cache={"num_blocks": 16, "block_size": 4})
    LLMEngine.from_config(EngineConfig(**cfg))
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] == 700
    rep = LLMReplica(EngineConfig(**cfg))
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == STEP_GEN0_THRESHOLD
    # the engine was frozen with the rest of start-up: get_objects() lists only the collected generations
    assert not any(o is rep.engine.engine for o in gc.get_objects())
