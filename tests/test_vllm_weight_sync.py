"""`vllm_weight_sync: http` against a real vLLM CPU server serving SmolLM2-135M-Instruct.

The weights travel in the bodies of vLLM's own weight-sync routes (our engine grpo_http), so the
server needs no filesystem shared with the trainer. The server runs with its own temporary
directory (TMPDIR, VLLM_CACHE_ROOT); the test proves that no sync writes a file anywhere it
reads (those directories, its model directory, /dev/shm), and that the same check does see the
file of the `shm` transport. After each of two updates the server must score exactly as the
trainer's new weights do. Start-up ~120 s, RSS 3-4 GB.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.hf import params_numpy
from vllm_server import API_KEY, needs_vllm, trainer_logp


@pytest.fixture(scope="module")
def smol_server(smol_vllm_server):
    """The session's SmolLM2 server (tests/conftest.py; test_tools uses it too) and its dirs."""
    return smol_vllm_server


def files(dirs) -> dict:
    """(size, mtime) of every file under `dirs`, and the names in /dev/shm (vLLM's own shared
    memory segments there change content, not names; POSIX semaphores, sem.*, 32 bytes, have no
    room for weights)."""
    out = {}
    for root in dirs:
        for path, _, names in os.walk(root):
            for name in names:
                st = os.stat(os.path.join(path, name))
                out[os.path.join(path, name)] = (st.st_size, st.st_mtime_ns)
    out.update({f"/dev/shm/{n}": None for n in os.listdir("/dev/shm")
                if not n.startswith("sem.")})
    return out


def written(before: dict, dirs, server_pgid: int) -> set[str]:
    """What is new or changed since `before`. /dev/shm is the machine's: the other test worker's
    processes (its own vLLM server's ring buffers, psm_*) add names there too, so a name that a
    process outside this one and the server's group holds is left out. A name nobody holds
    counts: a file transport's leftover is just that."""
    changed = {k for k, v in files(dirs).items() if k not in before or before[k] != v}
    return changed - held_elsewhere(server_pgid)


def held_elsewhere(server_pgid: int) -> set[str]:
    """/dev/shm paths that a process outside this one and the server's group maps or holds."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) == os.getpid() or os.getpgid(int(pid)) == server_pgid:
                continue
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split(None, 5)[-1].strip() for line in f
                            if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile, or not ours to read
    return {h.removesuffix(" (deleted)") for h in held if h.startswith("/dev/shm/")}


@jax.jit  # one program for every seed (each shape's draw was one of its own to compile)
def _moved(params, seed):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + 0.01 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, new)


def perturbed(model, seed: int):
    """The model after a stand-in update: every tensor moved by 1% of its spread."""
    graphdef, params = nnx.split(model, nnx.Param)
    return nnx.merge(graphdef, _moved(params, seed))


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)


@needs_vllm
def test_http_sync_smollm2_writes_no_file(smol_server, smol_model, smol_tok):
    from grpo_jax.rollout.vllm.client import VLLMClient
    from grpo_jax.rollout.vllm.sync import ServerWeights
    srv, server_dirs = smol_server
    pgid = os.getpgid(srv.process.pid)
    prompts = [chat(smol_tok, "What is 2+3?"), chat(smol_tok, "Name a colour.")]
    completions = [smol_tok.encode("2 + 3 = 5. The answer is five.<|im_end|>"),
                   smol_tok.encode("Blue, like the sky on a clear day.")]
    with VLLMClient(srv.base_url, api_key=API_KEY) as client:
        weights = ServerWeights(client, "http", smol_model.cfg)
        old = smol_model
        for step in (1, 2):
            new = perturbed(smol_model, step)
            table = params_numpy(new)
            before = files(server_dirs)  # (requests may add vLLM's own compile cache files)
            seconds = weights.push_full(table)
            assert not written(before, server_dirs, pgid)  # no file written where the server reads
            m = weights.metrics
            print(f"http sync {step}: {seconds:.2f} s, {m['weight_sync/bytes'] / 2**20:.0f} MiB "
                  f"in {m['weight_sync/buckets']:.0f} buckets, "
                  f"{m['weight_sync/bytes_per_s'] / 2**20:.0f} MiB/s")
            assert weights.current() and m["weight_sync/buckets"] > 1
            served = client.logprobs_for(prompts, completions)
            for p, c, s in zip(prompts, completions, served):
                np.testing.assert_allclose(s, trainer_logp(new, p, c), atol=1e-4, rtol=0)
                assert np.abs(s - trainer_logp(old, p, c)).max() > 1e-2
            # The sampler's log-probs of what the server generates now match too.
            for c in client.generate(prompts[:1], n=2, max_tokens=8, seed=step)[0]:
                np.testing.assert_allclose(c.logprobs, trainer_logp(new, prompts[0],
                                                                    c.token_ids),
                                           atol=1e-4, rtol=0)
            old = new

        # The check sees a file transport: the shm path leaves its file in /dev/shm.
        shm = ServerWeights(client, "shm", smol_model.cfg)
        table, before = params_numpy(smol_model), files(server_dirs)
        start = time.perf_counter()
        shm.push_full(table)
        print(f"shm sync: {time.perf_counter() - start:.2f} s")
        assert any(k.startswith("/dev/shm/grpo_jax-weights-")
                   for k in written(before, server_dirs, pgid))
