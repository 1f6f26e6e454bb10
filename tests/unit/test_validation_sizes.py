"""`validation.sizes`: 'WIDTHxHEIGHT' strings parsed to (height, width); bad ones are one line
naming the field and the value, through the config loader and the real CLI (exit 2)."""

from __future__ import annotations

import pytest

from splitstage.cli import main
from splitstage.config.job import ConfigError, config_from_dict


def sizes_of(sizes):
    return config_from_dict({"validation": {"prompts": ["a cat"], "sizes": sizes}}).validation


def test_sizes_parse_as_width_by_height_in_the_order_given():
    settings = sizes_of(["768x512", " 512X768 "])
    assert settings.sizes == ["768x512", "512x768"]  # normalized
    assert settings.sample_sizes() == [(512, 768), (768, 512)]  # (height, width)
    one_string = sizes_of("1024x1024, 1280x768")  # SimpleTuner's validation_resolution form
    assert one_string.sample_sizes() == [(1024, 1024), (768, 1280)]
    assert sizes_of([]).sample_sizes() == [] == config_from_dict({}).validation.sizes


@pytest.mark.parametrize(
    ("sizes", "needles"),
    [
        (["768"], ["'768' is not WIDTHxHEIGHT", "'768x512'"]),
        (["768x"], ["'768x' is not WIDTHxHEIGHT"]),
        (["768*512"], ["'768*512' is not WIDTHxHEIGHT"]),
        (["-64x64"], ["'-64x64' is not WIDTHxHEIGHT"]),
        (["64.5x64"], ["'64.5x64' is not WIDTHxHEIGHT"]),
        (["0x512"], ["'0x512'", "1..4096 pixels"]),
        (["512x0"], ["'512x0'", "1..4096 pixels"]),
        (["8192x512"], ["'8192x512'", "1..4096 pixels"]),
        (["64x32", "64X32"], ["'64X32' is listed twice", "remove one"]),
        ([""], ["'' is not WIDTHxHEIGHT"]),
        (7, ["valid list"]),
    ],
)
def test_bad_sizes_are_one_line_naming_the_field(sizes, needles):
    with pytest.raises(ConfigError) as error:
        sizes_of(sizes)
    line = str(error.value)
    assert "\n" not in line and "validation.sizes" in line, line
    for needle in needles:
        assert needle in line, line


def test_the_cli_refuses_a_bad_size_with_exit_2(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('[validation]\nprompts = ["a cat"]\nsizes = ["768x512", "wide"]\n')
    assert main(["validate", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith("splitstage: error: "), err
    assert "validation.sizes: 'wide' is not WIDTHxHEIGHT" in err[0]
