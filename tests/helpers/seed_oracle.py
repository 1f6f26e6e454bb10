"""A literal transcription of the seed's pseudocode (shared/seeds/000_*.txt): the test oracle.

`PipelineUnit` / `as_diffsynth` add DiffSynth-Studio's own unit class, so the oracle can run on
the fields exactly as declared (a bare string included) instead of on splitstage's `fetch_*`.
"""


def split_pipeline_units(units, model_names):
    related = {
        id
        for id, unit in enumerate(units)
        if unit.onload_model_names is not None
        and any(m in unit.onload_model_names for m in model_names)
    }
    edges = build_edges(units)
    chains = build_chains(units)
    while True:
        before = len(related)
        related = forward_reachable(edges, related)
        related = updating_units(units, chains, related)
        if len(related) == before:
            break
    related_units = [units[i] for i in sorted(related)]
    unrelated_units = [units[i] for i in range(len(units)) if i not in related]
    return related_units, unrelated_units


def build_edges(units):
    last_producer = {}
    edges = []
    for id, unit in enumerate(units):
        for param in unit.fetch_input_params():
            if param in last_producer:
                edges.append((last_producer[param], id))
        for param in unit.fetch_output_params():
            last_producer[param] = id
    return edges


def build_chains(units):
    params = sorted(
        set(sum([unit.fetch_input_params() + unit.fetch_output_params() for unit in units], []))
    )
    chains = {param: [] for param in params}
    for id, unit in enumerate(units):
        for param in unit.fetch_output_params():
            chains[param].append(id)
    return chains


def forward_reachable(edges, related):
    while True:
        neighbors = {
            target for source, target in edges if source in related and target not in related
        }
        if not neighbors:
            break
        related |= neighbors
    return related


def updating_units(units, chains, related):
    first_consumer = {}
    for unit_id in sorted(related):
        for param in units[unit_id].fetch_input_params():
            if param not in first_consumer:
                first_consumer[param] = unit_id
    for param, first in first_consumer.items():
        chain = chains[param]
        if first in chain and chain.index(first) != len(chain) - 1:
            for later in chain[chain.index(first) + 1 :]:
                related.add(later)
    return related


class PipelineUnit:
    """DiffSynth-Studio's PipelineUnit (diffsynth/diffusion/base_pipeline.py): its split fields and
    `fetch_*_params`, transcribed, so the oracle reads a bare-string field exactly as Python does
    there (iterating it yields characters; `in` on it is a substring test)."""

    def __init__(
        self,
        input_params=None,
        output_params=None,
        input_params_posi=None,
        input_params_nega=None,
        onload_model_names=None,
        name=None,
    ):
        self.input_params = input_params
        self.output_params = output_params
        self.input_params_posi = input_params_posi
        self.input_params_nega = input_params_nega
        self.onload_model_names = onload_model_names
        self.name = name

    def fetch_input_params(self):
        params = []
        if self.input_params is not None:
            for param in self.input_params:
                params.append(param)
        if self.input_params_posi is not None:
            for _, param in self.input_params_posi.items():
                params.append(param)
        if self.input_params_nega is not None:
            for _, param in self.input_params_nega.items():
                params.append(param)
        params = sorted(list(set(params)))
        return params

    def fetch_output_params(self):
        params = []
        if self.output_params is not None:
            for param in self.output_params:
                params.append(param)
        return params


def as_diffsynth(unit):
    """A DiffSynth PipelineUnit with `unit`'s declared fields, untouched (strings stay strings)."""
    return PipelineUnit(
        input_params=unit.input_params,
        output_params=unit.output_params,
        input_params_posi=dict(unit.input_params_posi),
        input_params_nega=dict(unit.input_params_nega),
        onload_model_names=unit.onload_model_names,
        name=unit.name,
    )
