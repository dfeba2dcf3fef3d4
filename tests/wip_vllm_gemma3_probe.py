import sys; sys.path.insert(0, "/work/wt-vllmimg/tests"); sys.path.insert(0, "/tmp/vimg")
from PIL import Image
from grpo_jax.rollout.vllm.client import VLLMClient
from grpo_jax.rollout.vllm.rollout import unexpanded_ids
from grpo_jax import images
from vllm_server import API_KEY
proc = images.load_processor("/tmp/vimg/m")
c = VLLMClient(open("/tmp/vimg/url").read(), api_key=API_KEY)
ims = [Image.new("RGB", (28, 28), (255, 0, 0)), Image.new("RGB", (28, 28), (0, 0, 255))]
msgs = [[{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": "How many squares?"}]}] for im in ims]
b = images.process(proc, msgs)
ids = [b.prompt_ids(i) for i in range(2)]
short = [unexpanded_ids(proc, x) for x in ids]
print(len(ids[0]), len(short[0]))
groups, exp = c.generate_images(short, [[im] for im in ims], n=1, temperature=0.0, max_tokens=6)
print("expansion equal:", [e == i for e, i in zip(exp, ids)])
for g in groups: print([(x.token_ids, [round(v, 3) for v in x.logprobs]) for x in g])
