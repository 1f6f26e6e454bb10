"""The shorter GIL switch interval: the shortest asked for holds, the old one always comes back."""

from __future__ import annotations

import sys
import threading

import pytest

import splitstage.tasks.cache.store as store_module
from splitstage.process.switch_interval import shorter_switch_interval
from splitstage.tasks.cache.store import CacheStore
from tests.helpers.cache_samples import make_samples


@pytest.fixture(autouse=True)
def known_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_nested_and_out_of_order_exits_keep_the_shortest_then_restore():
    outer, inner = shorter_switch_interval(0.001), shorter_switch_interval(0.0002)
    outer.__enter__()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    inner.__enter__()
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    outer.__exit__(None, None, None)  # the first to enter leaves first (another thread's)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    inner.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_never_longer_than_before_and_restored_after_an_error():
    sys.setswitchinterval(0.0001)
    with pytest.raises(RuntimeError), shorter_switch_interval(0.001):
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_threads_entering_and_leaving_together_restore_it():
    start = threading.Barrier(8)

    def user(seconds: float) -> None:
        start.wait()
        for _ in range(200):
            with shorter_switch_interval(seconds):
                assert sys.getswitchinterval() <= seconds + 1e-9

    threads = [threading.Thread(target=user, args=(1e-4 * (i + 1),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_write_shards_lowers_it_while_writing_only(tmp_path, monkeypatch):
    seen = []
    real = store_module.write_chains

    def chains(fs, todo):
        seen.append(sys.getswitchinterval())
        return real(fs, todo)

    monkeypatch.setattr(store_module, "write_chains", chains)
    CacheStore(str(tmp_path), "ck").write_shards([make_samples([1, 2])])
    assert seen == [pytest.approx(1e-4)] and sys.getswitchinterval() == pytest.approx(0.005)
