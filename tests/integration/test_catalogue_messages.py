"""Issue 26, messages that sent the user the wrong way: each names the real cause and its fix."""

from __future__ import annotations

import pytest

from splitstage.config.job import load_config
from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, cli, config_text

assets = catalogue.assets  # the shared module-scoped fixture


@pytest.mark.parametrize(
    "written, read",
    [
        ('"tensorboard"', ["tensorboard"]),  # accelerate's spelling
        ('"tensorboard, wandb"', ["tensorboard", "wandb"]),
        ('["wandb"]', ["wandb"]),
        ('"auto"', "auto"),
        ('"none"', "none"),
    ],
)
def test_report_to_takes_accelerates_spelling(written, read, assets, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=f"[tracking]\nreport_to = {written}\n"))
    assert load_config(str(path)).tracking.report_to == read


@pytest.mark.parametrize(
    "written, needles",
    [
        ('["comet"]', ["tracking.report_to", "unknown tracker 'comet'", "tensorboard, wandb"]),
        ('"all"', ["tracking.report_to", "'all' is accelerate's", "'auto'"]),
        ("3", ["tracking.report_to", "not a tracker name"]),
    ],
)
def test_report_to_refusals_are_one_line(written, needles, assets, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=f"[tracking]\nreport_to = {written}\n"))
    code, err = cli(["validate", str(path)], capsys)
    check_one_line(code, err, *needles)
    assert "literal[" not in err
