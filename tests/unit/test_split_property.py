"""Property test: the fast split equals a literal transcription of the seed on random graphs."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from splitstage.splitter import Pipeline, Unit, plan_split, split_units
from tests.helpers import seed_oracle

PARAMS = [f"p{i}" for i in range(7)]
MODELS = ["m0", "m1", "m2", "m3"]
PER_STEP_MODEL = "__per_step__"

names = st.lists(st.sampled_from(PARAMS), max_size=4)
arg_maps = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(PARAMS), max_size=2)


@st.composite
def pipelines(draw):
    count = draw(st.integers(min_value=0, max_value=18))
    units = []
    for index in range(count):
        units.append(
            Unit(
                name=f"u{index}",
                input_params=tuple(draw(names)),
                input_params_posi=draw(arg_maps),
                input_params_nega=draw(arg_maps),
                output_params=tuple(draw(names)),
                onload_model_names=tuple(draw(st.lists(st.sampled_from(MODELS), max_size=2))),
                per_step=draw(st.booleans().map(lambda b: b and draw(st.integers(0, 5)) == 0)),
            )
        )
    return Pipeline("random", tuple(units), in_iteration_models=tuple(MODELS))


def oracle_split(units, trainable):
    """Run the seed; per-step units get a marker model that is trainable (they seed V1)."""
    marked = [
        replace(u, onload_model_names=u.onload_model_names + (PER_STEP_MODEL,)) if u.per_step else u
        for u in units
    ]
    v1, v2 = seed_oracle.split_pipeline_units(marked, list(trainable) + [PER_STEP_MODEL])
    return [u.name for u in v1], [u.name for u in v2]


@settings(max_examples=400, deadline=None)
@given(pipelines(), st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
def test_split_equals_seed_oracle(pipe, trainable):
    plan = plan_split(pipe, trainable)
    assert (list(plan.v1), list(plan.v2)) == oracle_split(list(pipe.units), trainable)


@settings(max_examples=200, deadline=None)
@given(pipelines(), st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
def test_v1_is_forward_closed_and_every_reason_holds(pipe, trainable):
    result = split_units(pipe.units, trainable)
    v1 = set(result.v1)
    by_name = {u.name: i for i, u in enumerate(pipe.units)}
    for source in v1:
        for target, _ in result.graph.successors[source]:
            assert target in v1  # (C1)
    for index, reason in result.reasons.items():
        unit = pipe.units[index]
        if reason.kind == "model":
            assert reason.model in trainable and reason.model in unit.onload_model_names
        elif reason.kind == "per_step":
            assert unit.per_step
        elif reason.kind == "reads":
            source = by_name[reason.source]
            assert source in v1 and (index, reason.param) in result.graph.successors[source]
        else:
            source = by_name[reason.source]
            assert source in v1 and reason.param in unit.output_params
            assert reason.param in result.graph.inputs[source]
