"""Set-up done once per process: the launcher's preflight builds each meta model once and opens
the cache once; `train` runs that set-up once, in its short-lived child (`prepare`), and the
launcher none of it (tests/integration/test_launcher_lean.py); a rank trains only the split the
launcher checked."""

from __future__ import annotations

import pytest

from splitstage.splitter import UserError
from splitstage.tasks import job_plan
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2 import outputs
from splitstage.tasks.stage2 import prepare as set_up
from splitstage.tasks.stage2.outputs import run_paths
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.trainer import check_same_split
from tests.helpers.tiny_job import make_workspace, tiny_config


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("setup-once"), samples=16, seed=0)


def test_preflight_builds_each_meta_model_once_and_opens_the_cache_once(workspace, monkeypatch):
    config = tiny_config(workspace, "once", 0)
    plan = make_plan(config)
    builds: list[tuple[str, bool]] = []
    build = plan.family.build_model

    def counted_build(name, device, meta=False):
        builds.append((name, meta))
        return build(name, device, meta=meta)

    monkeypatch.setattr(plan.family, "build_model", counted_build)
    opened = []
    open_cache = job_plan.open_cache
    monkeypatch.setattr(
        job_plan, "open_cache", lambda *a, **k: opened.append(1) or open_cache(*a, **k)
    )
    resolved = []
    options = outputs.output_storage_options
    monkeypatch.setattr(
        outputs, "output_storage_options", lambda *a: resolved.append(a[1]) or options(*a)
    )
    paths = run_paths(config, "once", workspace / "runs")
    checks = preflight(plan, paths)
    assert checks.sample_count == 16
    # the output and checkpoint options, resolved once each (run_paths), then passed down
    assert resolved == [paths["output_url"], paths["checkpoint_url"]]
    assert builds == [("dit", True)]  # the weights check and the LoRA-target check share it
    assert len(opened) == 1  # the cache check and the batch plan read one store


def test_the_set_up_child_plans_once_and_checks_once(workspace, monkeypatch, tmp_path):
    """What the child runs (`prepare`): one plan, one meta build, one cache, one resolve each."""
    plans, builds, opened, resolved = [], [], [], []
    make = set_up.make_plan

    def counted_plan(config):
        plan = make(config)
        plans.append(plan)
        build = plan.family.build_model

        def counted_build(name, device, meta=False):
            builds.append((name, meta))
            return build(name, device, meta=meta)

        monkeypatch.setattr(plan.family, "build_model", counted_build)
        return plan

    monkeypatch.setattr(set_up, "make_plan", counted_plan)
    open_cache = job_plan.open_cache
    monkeypatch.setattr(
        job_plan, "open_cache", lambda *a, **k: opened.append(1) or open_cache(*a, **k)
    )
    options = outputs.output_storage_options
    monkeypatch.setattr(
        outputs, "output_storage_options", lambda *a: resolved.append(a[1]) or options(*a)
    )
    plan = set_up.make_plan(tiny_config(workspace, "child", 0))
    prepared = set_up.prepare(plan, "child", tmp_path, tmp_path)
    paths = prepared["paths"]
    assert len(plans) == 1 and builds == [("dit", True)] and len(opened) == 1
    assert resolved == [paths["output_url"], paths["checkpoint_url"]]


def test_a_rank_refuses_a_split_other_than_the_launchers(workspace):
    plan = make_plan(tiny_config(workspace, "split", 0))
    launcher = plan.split.to_dict()
    check_same_split(plan, launcher)  # the same split: trains
    check_same_split(plan, None)  # a spec from before the launcher recorded it
    other = {**launcher, "v1": [*launcher["v1"], "extra_unit"]}
    with pytest.raises(UserError, match=r"this rank split pipeline .* differently.*\(v1 differ"):
        check_same_split(plan, other)
