"""The places a run leases, and how a rank tells that one of them was deleted mid-run."""

from __future__ import annotations

from splitstage.storage.lease import LEASE_NAME
from splitstage.tasks.stage2.outputs import RunPlaces


def paths(output: str, checkpoints: str) -> RunPlaces:
    return RunPlaces(run_dir="runs/x", output_url=output, checkpoint_url=checkpoints)


def test_a_checkpoint_url_outside_the_output_folder_is_leased_too(tmp_path):
    inside = paths(f"{tmp_path}/out/run", f"{tmp_path}/out/run/checkpoints")
    outside = paths(f"{tmp_path}/out/run", f"{tmp_path}/elsewhere/run")
    assert inside.leased() == ["output_url"]
    assert outside.leased() == ["output_url", "checkpoint_url"]
    # a sibling whose name starts with the output folder's is outside it
    assert paths(f"{tmp_path}/out/run", f"{tmp_path}/out/run-2").leased() == [
        "output_url",
        "checkpoint_url",
    ]


def test_a_place_is_deleted_when_its_lease_file_is_gone_even_if_the_folder_came_back(tmp_path):
    run = paths(str(tmp_path / "out"), f"file://{tmp_path}/ckpt")
    for place in ("out", "ckpt"):
        (tmp_path / place).mkdir()
        (tmp_path / place / LEASE_NAME).write_text("{}")
    assert run.deleted() is None
    (tmp_path / "ckpt" / LEASE_NAME).unlink()  # e.g. rm -rf, then a writer made the folder again
    assert run.deleted() == f"file://{tmp_path}/ckpt"


def test_another_nodes_released_lease_is_not_a_deleted_folder(tmp_path):
    """Node 0's launcher may release the lease when it stops; a node that does not hold it
    judges only by the folder."""
    (tmp_path / "out").mkdir()
    run = paths(str(tmp_path / "out"), str(tmp_path / "out/checkpoints"))
    assert run.deleted(lease_held_here=False) is None
    assert run.deleted() == str(tmp_path / "out")
    (tmp_path / "out").rmdir()
    assert run.deleted(lease_held_here=False) == str(tmp_path / "out")


def test_an_object_store_has_no_folder_to_lose():
    assert paths("s3://bucket/out/run", "s3://bucket/ckpt/run").deleted() is None
