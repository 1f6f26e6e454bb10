"""Cancelling a run ends its torchrun process tree, however the cancel arrives.

Training watches one `threading.Event` (`train(cancel=...)`): when it is set, the launcher stops
torchrun and every worker (they run in their own sessions, so killing torchrun's group is not
enough). The event is set by
- a watcher thread polling the flow run (and its parents) for a Cancelling/Cancelled state: a
  cancel from the UI or API while the flow runs in-process with no runner (`make demo`, tests);
- the `on_cancellation` / `on_crashed` hooks (`stop_training`);
- the train task ending early for any reason (see `tasks.prefect_tasks.train_task`).
Under a worker, a cancel is a SIGTERM that Prefect turns into an exception in the flow's main
thread; it unwinds through the launcher, which kills the tree on any exception.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext

POLL_SECONDS = 2.0
_STOPPING = {StateType.CANCELLING, StateType.CANCELLED, StateType.CRASHED}
_active: dict[UUID, set[threading.Event]] = {}
_lock = threading.Lock()


def _lineage(client: Any, flow_run: Any, depth: int = 8) -> list[UUID]:
    """This flow run's id and its parents' (a subflow stops when any ancestor is cancelled)."""
    ids = [flow_run.id]
    while flow_run.parent_task_run_id and len(ids) < depth:
        parent_task = client.read_task_run(flow_run.parent_task_run_id)
        flow_run = client.read_flow_run(parent_task.flow_run_id)
        ids.append(flow_run.id)
    return ids


def _watch(flow_run: Any, event: threading.Event, done: threading.Event, poll: float) -> None:
    """Poll the run and its parents until `done`; set `event` once one of them is stopping."""
    with get_client(sync_client=True) as client:
        try:
            ids = _lineage(client, flow_run)
        except Exception:  # no parents readable: watch this run alone
            ids = [flow_run.id]
        while not done.wait(poll):
            for run_id in ids:
                with contextlib.suppress(Exception):  # the API may blink; try again next tick
                    state = client.read_flow_run(run_id).state
                    if state is not None and state.type in _STOPPING:
                        event.set()
                        return


@contextlib.contextmanager
def cancel_event(poll_seconds: float = POLL_SECONDS) -> Iterator[threading.Event]:
    """An Event set when this flow run is cancelled; pass it to `train(cancel=...)`."""
    event = threading.Event()
    context = FlowRunContext.get()
    flow_run = context.flow_run if context else None
    if flow_run is None:  # called outside a flow run: nothing to watch
        yield event
        return
    done = threading.Event()
    with _lock:
        _active.setdefault(flow_run.id, set()).add(event)
    watcher = threading.Thread(
        target=contextvars.copy_context().run,
        args=(_watch, flow_run, event, done, poll_seconds),
        name=f"cancel-watch-{flow_run.id}",
        daemon=True,
    )
    watcher.start()
    try:
        yield event
    finally:
        done.set()
        with _lock:
            events = _active.get(flow_run.id, set())
            events.discard(event)
            if not events:
                _active.pop(flow_run.id, None)


def stop_training(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (on_cancellation, on_crashed): set the cancel events of this run's training."""
    with _lock:
        events = list(_active.get(flow_run.id, ()))
    for event in events:
        event.set()
