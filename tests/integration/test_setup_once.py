"""Set-up done once per process: the checks build each meta model once and open the cache once;
a rank's set-up plans once and checks once, and the trainer takes that plan (never plans again);
a rank trains only the split rank 0 checked."""

from __future__ import annotations

import pytest

from splitstage.splitter import UserError
from splitstage.tasks import job_plan
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2 import outputs, rank_setup
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.outputs import run_places
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.rank_setup import check_same_split
from splitstage.tasks.stage2.trainer import Trainer
from tests.helpers.tiny_job import make_workspace, one_rank_setup, tiny_config


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("setup-once"), samples=16, seed=0)


def counting(monkeypatch) -> dict[str, list]:
    """Count plans, model builds (name, meta), opened caches and resolved output options."""
    seen: dict[str, list] = {"plans": [], "builds": [], "opened": [], "resolved": []}
    make = rank_setup.make_plan

    def counted_plan(config):
        plan = make(config)
        seen["plans"].append(plan)
        build = plan.family.build_model

        def counted_build(name, device, meta=False):
            seen["builds"].append((name, meta))
            return build(name, device, meta=meta)

        monkeypatch.setattr(plan.family, "build_model", counted_build)
        return plan

    monkeypatch.setattr(rank_setup, "make_plan", counted_plan)
    open_cache = job_plan.open_cache
    monkeypatch.setattr(
        job_plan, "open_cache", lambda *a, **k: seen["opened"].append(1) or open_cache(*a, **k)
    )
    options = outputs.output_storage_options
    monkeypatch.setattr(
        outputs,
        "output_storage_options",
        lambda *a: seen["resolved"].append(a[1]) or options(*a),
    )
    return seen


def test_preflight_builds_each_meta_model_once_and_opens_the_cache_once(workspace, monkeypatch):
    config = tiny_config(workspace, "once", 0)
    plan = make_plan(config)
    seen = counting(monkeypatch)
    monkeypatch.setattr(plan.family, "build_model", _counted(plan, seen))
    places = run_places(config, "once", workspace / "runs")
    checks = preflight(plan, places)
    assert checks.sample_count == 16
    # the output and checkpoint options, resolved once each (run_places), then passed down
    assert seen["resolved"] == [places.output_url, places.checkpoint_url]
    assert seen["builds"] == [("dit", True)]  # the weights check and the LoRA-target check
    assert len(seen["opened"]) == 1  # the cache check and the batch plan read one store


def _counted(plan, seen):
    build = plan.family.build_model

    def counted_build(name, device, meta=False):
        seen["builds"].append((name, meta))
        return build(name, device, meta=meta)

    return counted_build


def test_a_rank_plans_once_checks_once_and_trains_with_that_plan(workspace, monkeypatch):
    """What a rank runs before training (`set_up_rank`), then the trainer on what it made."""
    seen = counting(monkeypatch)
    config = tiny_config(workspace, "rank", 0)
    try:
        setup = one_rank_setup(config, workspace / "runs")
        assert len(seen["plans"]) == 1 and seen["builds"] == [("dit", True)]
        assert len(seen["opened"]) == 1
        assert seen["resolved"] == [setup.spec.places.output_url, setup.spec.places.checkpoint_url]
        trainer = Trainer(setup)
        assert trainer.plan is setup.plan and len(seen["plans"]) == 1  # never planned again
        assert seen["builds"] == [("dit", True)] * 2  # the checks' stand-in, the trained model
        assert len(seen["opened"]) == 1  # the trainer reads the store the checks opened
    finally:
        close_distributed()


def test_a_rank_refuses_a_split_other_than_rank_0s(workspace):
    plan = make_plan(tiny_config(workspace, "split", 0))
    main_split = plan.split.to_dict()
    check_same_split(plan, main_split)  # the same split: trains
    other = {**main_split, "v1": [*main_split["v1"], "extra_unit"]}
    with pytest.raises(UserError, match=r"this rank split pipeline .* differently.*\(v1 differ"):
        check_same_split(plan, other)
