"""Loading straight onto the mesh, and export tensor by tensor: the same values and bytes as the
whole-copy loader and writer, with each device holding its block only."""

import filecmp
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from hf_oracle import tiny_hf_model

from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax.models import param_table

LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def old_load(model_dir, cfg) -> dict[str, np.ndarray]:
    """The loader this replaces: every file read whole into fp32 host arrays, HF layouts
    transposed and stacked over layers, then cast to the param dtype on the device."""
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update({k: v.astype(np.float32) for k, v in
                        safetensors.numpy.load_file(f).items()})
    out = {}
    for name, pattern in hf.hf_names(cfg).items():
        shape, leaf = param_table(cfg)[name][0], name.split("/")[-1]
        one = lambda w, shape: (w.T if leaf in LINEAR else w).reshape(shape)  # noqa: E731
        value = (np.stack([one(tensors[pattern.format(i=i)], shape[1:])
                           for i in range(cfg.num_layers)])
                 if name.startswith("layers/") else one(tensors[pattern], shape))
        out[name] = np.asarray(jnp.asarray(value, cfg.param_dtype))
    return out


def assert_same(model, expected):
    got = hf.params_numpy(model)
    assert got.keys() == expected.keys()
    for name in got:
        assert got[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


MESHES = {"one device": None, "fsdp=8": (1, 8, 1), "fsdp=2 tp=4": (1, 2, 4)}


@pytest.mark.parametrize("mesh_shape", MESHES.values(), ids=MESHES.keys())
@pytest.mark.parametrize("family,tie,file_dtype,param_dtype", [
    ("llama", False, "float32", "float32"), ("qwen2", True, "bfloat16", "float32"),
    ("qwen3", False, "float32", "bfloat16"), ("qwen2", False, "float16", "bfloat16")])
def test_sharded_load_equals_whole_load(tmp_path, mesh_shape, family, tie, file_dtype,
                                        param_dtype):
    """Every layout (transposed, merged head dims, biases, q/k norms, untied head) read block by
    block onto a mesh gives the old loader's values bit for bit, in the param dtype."""
    import torch
    tiny_hf_model(family, tie=tie).to(getattr(torch, file_dtype)).save_pretrained(
        tmp_path, max_shard_size="40KB")  # several files and an index
    mesh = mesh_shape and mesh_lib.make_mesh(mesh_lib.MeshConfig(*mesh_shape))
    model, _ = hf.load_model(str(tmp_path), mesh, dtype=jnp.float32, param_dtype=param_dtype)
    assert_same(model, old_load(tmp_path, model.cfg))
    params = nnx.state(model, nnx.Param)
    if mesh is not None:
        want = mesh_lib.param_shardings(params, mesh)
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            assert x.sharding == s


def test_load_refuses_a_weight_of_the_wrong_shape(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(hf.ModelLoadError, match="gate_proj.weight has shape"):
        hf.load_model(str(tmp_path))


@pytest.mark.parametrize("dtype,max_shard_bytes", [("float32", 2**31), ("bfloat16", 20_000)])
def test_export_writes_the_bytes_safetensors_writes(tmp_path, dtype, max_shard_bytes):
    """save_hf streams one tensor at a time from a sharded model; its files are byte for byte
    what safetensors' save_file makes of the whole state dict, split the same way."""
    tiny_hf_model("qwen2", tie=False).save_pretrained(tmp_path / "src")
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 2, 4))
    model, _ = hf.load_model(str(tmp_path / "src"), mesh, dtype=jnp.float32)
    hf.save_hf(model, tmp_path / "out", dtype=dtype, max_shard_bytes=max_shard_bytes)
    whole = hf.hf_state_dict(model.cfg, hf.params_numpy(model), dtype=dtype)
    index = tmp_path / "out" / "model.safetensors.index.json"
    files = ({f: [k for k, v in json.loads(index.read_text())["weight_map"].items() if v == f]
              for f in set(json.loads(index.read_text())["weight_map"].values())}
             if index.exists() else {"model.safetensors": list(whole)})
    assert (len(files) > 1) == (max_shard_bytes < 2**31)
    for name, keys in files.items():
        safetensors.numpy.save_file({k: whole[k] for k in keys}, tmp_path / name,
                                    metadata={"format": "pt"})
        assert filecmp.cmp(tmp_path / name, tmp_path / "out" / name, shallow=False), name


RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from flax import nnx
    from grpo_jax import hf, mesh as mesh_lib

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=8))
    jax.block_until_ready(jax.device_put(jnp.ones(8), mesh_lib.logical_sharding(mesh, "batch")))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    before = status()
    model, _ = hf.load_model(sys.argv[1], mesh, dtype=jnp.float32)
    params = jax.block_until_ready(nnx.state(model, nnx.Param))
    after = status()
    print(json.dumps({"peak_growth": after["VmHWM"] - before["VmRSS"],
                      "model_bytes": sum(x.nbytes for x in jax.tree.leaves(params))}))
""")


@pytest.mark.slow
def test_smollm2_loads_sharded_in_about_one_copy_of_memory(smol_dir):
    """SmolLM2-135M (fp32 params: 513 MiB) onto fsdp=8 CPU devices: each device holds 1/8 of
    every matrix (the norms, 0.07 MiB, are replicated), the values are the old loader's, and
    the process's peak RSS grows by less than 1.5 copies while loading.

    Measure: VmHWM (peak resident set) after resetting it to VmRSS just before the load,
    minus VmRSS then. It counts everything: the CPU devices' buffers (anonymous memory: the
    model itself), host blocks in flight, and the safetensors file's pages that a memory map
    made resident (the loader closes the map after each tensor, so at most one tensor's pages
    are resident). Measured on the 2-core CPU machine: the old loader (read all, fp32 copies,
    stack, then put on the mesh) peaked at +1160 MiB (2.26 copies); this one at +659-677 MiB
    (1.28-1.32 copies; the excess over one copy is freed host blocks glibc keeps, gone after
    malloc_trim)."""
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=8))
    model, _ = hf.load_model(str(smol_dir), mesh, dtype=jnp.float32)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    total = sum(x.nbytes for x in leaves)
    per_device = {d: 0 for d in mesh.devices.flat}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
    assert replicated < 1e-3 * total
    for nbytes in per_device.values():
        assert abs(nbytes - total / 8) <= replicated
    assert_same(model, old_load(smol_dir, model.cfg))
    del model, leaves

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([str(Path(hf.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(smol_dir)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth {got['peak_growth'] / 2**20:.0f} MiB for a "
          f"{got['model_bytes'] / 2**20:.0f} MiB model")
    assert got["model_bytes"] == total
    assert got["peak_growth"] < 1.5 * total


def test_restore_reads_only_the_asked_leaves_onto_their_shardings(tmp_path):
    """What export's load_checkpoint does: params onto an FSDP mesh, the optimizer state left
    on disk (a placeholder)."""
    from orbax import checkpoint as ocp

    from grpo_jax.checkpoint import Checkpointer
    state = {"params": {"w": jnp.arange(64.0).reshape(8, 8)}, "opt": {"mu": jnp.ones((8, 8))}}
    with Checkpointer(tmp_path, save_total_limit=None, async_save=False) as ckpt:
        ckpt.save(1, state, {})
    sharding = mesh_lib.logical_sharding(mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 8, 1)),
                                         "embed", None)
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding)},
              "opt": {"mu": ocp.PLACEHOLDER}}
    with Checkpointer(tmp_path, save_total_limit=None) as ckpt:
        got, _ = ckpt.restore(1, target)
    assert got["opt"]["mu"] is ocp.PLACEHOLDER
    assert got["params"]["w"].sharding == sharding
    np.testing.assert_array_equal(got["params"]["w"], state["params"]["w"])
