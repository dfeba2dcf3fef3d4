import sys; sys.path.insert(0, "/work/wt-vllmimg/tests")
import numpy as np, jax.numpy as jnp
from flax import nnx
from grpo_jax import hf
from grpo_jax.rollout.vllm.client import VLLMClient
from grpo_jax.rollout.vllm.sync import ServerWeights, resolve_transport
from vllm_server import API_KEY
model, _ = hf.load_model("/tmp/vimg/m", dtype=jnp.float32)
params = nnx.state(model, nnx.Param)
table = hf.params_from_state(model.cfg, params)
table = {k: (v * 0 if k == "final_norm" else v) for k, v in table.items() if not k.startswith("vision/")}
c = VLLMClient(open("/tmp/vimg/url").read(), api_key=API_KEY)
t = resolve_transport("auto", c); print("transport", t)
w = ServerWeights(c, t, model.cfg)
print("pushed in", w.push_full(table))
