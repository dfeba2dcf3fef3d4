"""Disaggregated rounds across two processes (`rollout.sampler_process`): the sampler's advances
(partial.py) run in a process of its own, on devices of its own, behind the same start/collect
contract as the one-process split (disaggregated.py SplitRollouts), so a round, a checkpoint and
a resume see no difference: the trainer's process holds the run state, the sampler's process
only decodes.

Why a child process over a socket pair, and not JAX's multi-controller runtime: a
multi-controller run has every process dispatch the same programs in the same order, while the
sampler and the trainer run different programs at different times (the point of the split). A
child with its own runtime is what verl's rollouter, slime's and prime-rl's inference workers
are; here it is started by the trainer and ends with it. A multi-process trainer starts one per
process, each on its own host's devices (sampler_hosts.py).

Per round, one message each way: the trainer's weights (host numpy: device_get, pickled, put on
the sampler's mesh; the only way every backend allows between two runtimes) with the new groups,
and back the finished groups with a host copy of the rows left in flight. That copy (the KV
caches too) is RunState.rows_in_flight, whole in the trainer's process, so a checkpoint needs
nothing from the sampler; the sampler keeps its device copy and decodes on from it when the next
start hands back the very state it returned (any other, e.g. a resume's, is sent and placed).

A sampler that dies ends the run: collect (or start) raises SamplerProcessError naming how it
ended, the run stops with its last checkpoint (GRPORound.settle can't collect the advance, so no
final checkpoint of a half-known state is written). The sampler ends when the trainer does: it
reads EOF from the socket, and Linux's parent-death signal kills it if the trainer is killed.
It runs in a session of its own, so a terminal's Ctrl-C reaches the trainer only, which stops
it after the round.

CPU hosts only for now: there a process's devices are its own host platform's (XLA's
--xla_force_host_platform_device_count). On accelerators each process would have to be started
seeing only its own chips (the trainer too, before its runtime starts), which this does not do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import NamedTuple, Protocol, Sequence

import jax
import numpy as np

from grpo_jax.errors import SamplerProcessError
from grpo_jax.rollout.native.disaggregated import Collected, Queued, done_data_rows
from grpo_jax.rollout.native.partial import InFlight, TurnEnds

# How long the sampler's process may take to start (import, build the sampler, compile its empty
# rows) and to end after the trainer asks it to.
START_TIMEOUT_S, CLOSE_TIMEOUT_S = 600.0, 30.0


class TurnsSpec(Protocol):
    """A picklable description of the rows' tool loop that the sampler's process builds
    (rollout/tools.py TurnsSpec; the native sampler imports no tool loop)."""

    def build(self) -> TurnEnds:
        """The tool loop's host side, as the trainer's process built its own."""


class SamplerSpec(NamedTuple):
    """What the sampler's process builds its rollout from: JaxRollout's settings (its
    `settings`, without the mesh), the sampler mesh's axis sizes, the prompt width of the
    rows in flight (the run's longest prompt) and, with tools, the tool loop its rows run (the
    tools are called in the sampler's process, as the one-process split calls them in the
    sampler's thread)."""
    settings: dict
    mesh_sizes: dict
    prompt_width: int
    turns: TurnsSpec | None = None


class SamplerProcess:
    """SplitRollouts' contract, the advance in a child process on `devices` host devices."""

    def __init__(self, spec: SamplerSpec, devices: int, max_staleness: int):
        self.max_staleness = max_staleness
        ours, theirs = socket.socketpair()
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": _host_devices(os.environ.get("XLA_FLAGS", ""), devices)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env=env, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._running: Future | None = None
        self._held: InFlight | None = None  # the rows in flight the sampler holds on its devices
        self._finished: float | None = None  # when its last advance ended (time.monotonic)
        self._send_lock = threading.Lock()
        try:
            self.conn.send(spec)
            self._recv(START_TIMEOUT_S, "starting")
        except BaseException:
            self.close()
            raise

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, params, in_flight: InFlight, records: Sequence[dict],
              data_rows: Sequence[int], version: int, key) -> float:
        """As SplitRollouts.start: `params` (the trainer's, version `version`) copied to the
        host now (so the trainer's next update may donate them) and sent, with the groups, from
        a thread; returns the sampler's idle seconds since its last advance ended."""
        if self._running is not None:
            raise RuntimeError("an advance is already running: collect() it first")
        host = jax.device_get(params)
        flight = None if in_flight is self._held and self._held is not None else _to_host(in_flight)
        message = (host, flight, list(records), [int(i) for i in data_rows], int(version),
                   np.asarray(jax.random.key_data(key)))
        now = time.monotonic()
        idle = 0.0 if self._finished is None else max(now - self._finished, 0.0)
        future: Future = Future()
        self._running = future
        threading.Thread(target=self._exchange, args=(message, future), daemon=True,
                         name="grpo-jax-sampler-process").start()
        return idle

    def collect(self) -> Collected:
        """The running advance's result (waiting for it); a dead sampler raises here."""
        if self._running is None:
            raise RuntimeError("no advance is running")
        t0 = time.perf_counter()
        in_flight, rollout, done, data_rows, dropped, began, ended = self._running.result()
        self._running = None  # a failed one stays running (Split.collect)
        waited = time.perf_counter() - t0
        self._held, self._finished = in_flight, ended
        return Collected(in_flight, Queued(rollout, tuple(done), data_rows, dropped,
                                           ended - began, waited))

    def close(self) -> None:
        """End the sampler's process (asked, then killed after CLOSE_TIMEOUT_S)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError), self._send_lock:  # it may die as it is asked
                self.conn.send(None)
            try:
                self.proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.conn.close()

    def _exchange(self, message, future: Future) -> None:
        try:
            try:
                with self._send_lock:
                    self.conn.send(message)
            except OSError:  # it died before or while reading
                raise self._died("decoding") from None
            flight, rollout, done, data_rows, dropped, began, ended = self._recv(None, "decoding")
            future.set_result((_from_host(flight), rollout, done, data_rows, dropped, began,
                               ended))
        except BaseException as e:  # raised by collect, in the trainer's thread
            future.set_exception(e)

    def _recv(self, timeout: float | None, doing: str):
        """The sampler's next answer; its failure, or its death, as SamplerProcessError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self.conn.poll(1.0):
                if self.proc.poll() is not None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self.proc.kill()
                    raise SamplerProcessError(
                        f"the sampler process (pid {self.proc.pid}) did not answer within "
                        f"{timeout:.0f} s while {doing}: killed; the run stops with its last "
                        "checkpoint, --resume continues it")
            answer = self.conn.recv()
        except (EOFError, OSError):
            answer = None
        if answer is None:
            raise self._died(doing)
        if answer[0] == "error":
            raise SamplerProcessError(f"the sampler process failed while {doing}: {answer[1]}")
        return answer[1]


    def _died(self, doing: str) -> SamplerProcessError:
        return SamplerProcessError(
            f"the sampler process (pid {self.proc.pid}) {_ended(self.proc)} while {doing}: the "
            "run stops with its last checkpoint (see any error the sampler printed above); "
            "--resume continues the run")


def _ended(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(CLOSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _host_devices(flags: str, n: int) -> str:
    """XLA_FLAGS with the host platform's device count set to `n`."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _to_host(at: InFlight) -> InFlight:
    """`at` picklable: its device rows as numpy, its key as key data."""
    return at._replace(rows=jax.device_get(at.rows),
                       key=None if at.key is None else np.asarray(jax.random.key_data(at.key)))


def _from_host(at: InFlight) -> InFlight:
    return at._replace(key=None if at.key is None else jax.random.wrap_key_data(at.key))


# ---------------------------------------------------------------- the sampler's process

def serve(conn: Connection) -> None:
    """The sampler's loop: build the rollout from the spec, then one advance per message until
    the trainer sends None or goes away."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.rollout.native.rollout import JaxRollout

    spec: SamplerSpec = conn.recv()
    try:
        mesh = mesh_lib.make_mesh(mesh_lib.config_for(spec.mesh_sizes), jax.devices())
        partial = JaxRollout(**spec.settings, mesh=mesh).partial
        if spec.turns is not None:
            partial = partial.with_turns(spec.turns.build())
        template = partial.empty(spec.prompt_width)
    except Exception:
        conn.send(("error", _last_line()))
        raise
    conn.send(("ready", None))
    held: InFlight | None = None
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if message is None:
            return
        params, flight, records, data_rows, version, key = message
        try:
            params = jax.device_put(params, mesh_lib.param_shardings(params, mesh))
            at = held if flight is None else _placed(flight, template)
            began = time.monotonic()
            done = partial.advance(params, at, records, data_rows, version,
                                   jax.random.wrap_key_data(key))
            jax.block_until_ready(done.in_flight.rows)
            ended = time.monotonic()
            held = done.in_flight
            rows = done_data_rows(at, records, data_rows, done.records)
            answer = ("done", (_to_host(held), done.rollout, list(done.records), rows,
                               done.dropped, began, ended))
        except Exception:
            traceback.print_exc()
            answer = ("error", _last_line())
        conn.send(answer)


def _placed(at: InFlight, template: InFlight) -> InFlight:
    """Host rows in flight on the sampler's devices, laid out as its empty ones."""
    rows = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding), at.rows, template.rows)
    return _from_host(at._replace(rows=rows))


def _last_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the trainer's dies (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the EOF alone ends it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() == 1:  # the trainer died before the call above took effect
        os._exit(1)


if __name__ == "__main__":
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops the run, and then us
    serve(Connection(int(sys.argv[1])))
