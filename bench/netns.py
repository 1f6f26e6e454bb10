"""Run a benchmark's child in a network namespace of its own whose loopback is shaped by `tc`
(a rate limit, a delay): the network, not this machine's 2 shared cores, sets the pace, as with a
real endpoint. Needs root, `ip` and `tc`; otherwise says why in one string."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


def run_shaped(qdisc: list[str], child: list[str]) -> dict | str:
    """Run `python child...` in a new network namespace whose loopback has the root qdisc
    `qdisc` (e.g. ["tbf", "rate", "800mbit", ...] or ["netem", "delay", "25ms"]); return the JSON
    the child prints on its last line, or a reason string when that cannot be done."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return "needs root with ip and tc"
    name = f"splitstage-bench-{os.getpid()}"
    setup = [
        ["ip", "netns", "add", name],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc],
    ]
    try:
        for command in setup:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                return f"{' '.join(command[-6:])}: {done.stderr.strip() or done.returncode}"
        command = ["ip", "netns", "exec", name, sys.executable, *child]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"the measurement failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
