"""A pytest plugin that writes, per test, the seconds JAX spent tracing, lowering and compiling in
the test's own process (JAX's monitoring events; subprocesses and servers are not counted), the
compile time the persistent cache saved, and the functions that took longest to compile:

    PYTHONPATH=tools:$PYTHONPATH python -m pytest -p pytest_compile_log ...

One JSON line per test in $COMPILE_LOG_DIR/<xdist worker>.jsonl (default ./compile_log).
Not part of the suite: a measuring tool for docs/testing.md.
"""

import collections
import json
import os
import time

import pytest
from jax import monitoring

_seconds: dict[str, float] = collections.defaultdict(float)
_by_function: dict[str, float] = collections.defaultdict(float)
_compiles: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **kw) -> None:
    name = event.rsplit("/", 1)[-1]
    _seconds[name] += duration
    if name == "backend_compile_duration":
        function = kw.get("fun_name", "?")
        _by_function[function] += duration
        _compiles[function] += 1


monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    for totals in (_seconds, _by_function, _compiles):
        totals.clear()
    start = time.time()
    yield
    top = sorted(((round(s, 2), f, _compiles[f]) for f, s in _by_function.items()), reverse=True)
    record = {"test": item.nodeid, "wall": round(time.time() - start, 2),
              **{k: round(v, 2) for k, v in _seconds.items()}, "top": top[:8]}
    out = os.environ.get("COMPILE_LOG_DIR", "compile_log")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"),
              "a") as f:
        f.write(json.dumps(record) + "\n")
