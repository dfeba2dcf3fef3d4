"""Suite-wide setup: 8 host CPU devices (sharding tests), fp32 matmuls, offline hub."""

import os
import shutil
import tempfile

# LLVM's expensive passes off: the compile-heavy modules run 5-12% faster (docs/testing.md; the
# whole run within noise). Without fast-math those passes may not reorder floating-point sums,
# so results are the same (unlike XLA's -O0, which changes them: the tight checks all pass).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_llvm_disable_expensive_passes=true")
# JAX's persistent compilation cache, one per run (made by the first process; pytest-xdist's
# workers and every subprocess a test starts inherit it): a program compiled by any of them is
# never compiled again in this run, and a fresh run compiles everything once.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="grpo-jax-test-jit-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# One directory per run for what the run's processes share besides compiled JAX programs: vLLM's
# compile cache (each tiny-Llama server after the first loads its torch.compile artifacts instead
# of ~20-30 s of compiling) and the tiny Llama those servers serve (vLLM's cache key holds the
# model's path, so every module's servers serve the one copy).
_OWN_RUN_DIR = "GRPO_JAX_TEST_RUN_DIR" not in os.environ
if _OWN_RUN_DIR:
    os.environ["GRPO_JAX_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="grpo-jax-test-run-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    if _OWN_RUN_DIR:
        shutil.rmtree(os.environ["GRPO_JAX_TEST_RUN_DIR"], ignore_errors=True)


# ------------------------------------------------------------------ parallel workers
# tests/run.sh runs two pytest-xdist workers. A module goes to one worker whole (its module
# fixtures are made once), modules that share a session fixture go to the same one, and the
# longest groups start first so that no worker is left with a long module at the end (the order
# is from `--durations` of a full run). A module left out runs after these, in file order: one
# of a minute or more left out ends up alone at the end (test_vlm_train, second to last, did).
SHARED_GROUPS = {  # modules that use the same session-scoped vLLM server
    "test_vllm": "vllm_tiny", "test_vllm_async": "vllm_tiny", "test_vllm_sampling_bias": "vllm_tiny",
    "test_vllm_restart": "vllm_tiny",
    "test_tools": "vllm_smol", "test_vllm_weight_sync": "vllm_smol",
}
LONGEST_FIRST = ("vllm_smol", "vllm_tiny", "test_aot", "test_lora", "test_train",
                 "test_vlm_train", "test_tool_continuation", "test_multihost",
                 "test_partial_tools", "test_partial", "test_moe", "test_shared_prefix",
                 "test_faults", "test_vlm_qwen3", "test_vllm_images", "test_async_jax",
                 "test_sampler",
                 "test_refill", "test_split",
                 "test_context_parallel", "test_tool_templates", "test_vllm_lora",
                 "test_run_dir", "test_schedule", "test_integrity", "test_bench",
                 "test_families", "test_train_step")


def _group(nodeid: str) -> str:
    module = nodeid.split("::")[0].rpartition("/")[2].removesuffix(".py")
    return SHARED_GROUPS.get(module, module)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    # A test that kills its group's shared server runs after the group's other tests.
    items.sort(key=lambda it: (rank.get(_group(it.nodeid), len(rank)), _group(it.nodeid),
                               it.get_closest_marker("kills_shared_server") is not None,
                               order[id(it)]))


_SHARED_SERVERS: list = []  # the shared servers of the group now running (groups run whole)


def pytest_runtest_teardown(item, nextitem):
    """A group's shared servers stop when its last test is done (not at the session's end: a
    SmolLM2 server holds ~4 GB while the worker runs other modules)."""
    if nextitem is None or _group(nextitem.nodeid) != _group(item.nodeid):
        while _SHARED_SERVERS:
            _SHARED_SERVERS.pop().stop()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `-n N` (xdist's default `--dist load`): one work unit per group of modules, in the
    order above. (xdist's own `loadgroup` marks do not reach its scheduler under pytest 9.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _group(nodeid)

    config.option.loadscopereorder = False
    return ModuleGroups(config, log)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """A module's compiled programs and arrays are freed after it: a worker runs many modules
    (two workers at ~10 GB each ran this machine out of memory). The persistent cache makes any
    program a later module needs again cheap to get back."""
    yield
    import ctypes
    import gc
    jax.clear_caches()
    gc.collect()
    try:  # and hand the freed heap back: glibc keeps it otherwise, and RSS only grows
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# SmolLM2-135M-Instruct, loaded once for the session. Tests only read these objects: they must
# not change the models' weights or configs, nor the tokenizer.

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with a character-level tokenizer, and 64 prompts for it
    (`tiny_run.config` trains on them); one per module, as each module's runs write beside it."""
    import json

    from hf_oracle import char_tokenizer, tiny_hf_model
    out = tmp_path_factory.mktemp("tiny")
    tok = char_tokenizer()
    model = tiny_hf_model("llama", tie=True, vocab=len(tok), seed=0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    prompts = out / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Post number {i}: write something short.\nTL;DR:"})
                    + "\n")
    return out


@pytest.fixture(scope="session")
def smol_dir():
    """The converted Hugging Face directory of SmolLM2-135M-Instruct."""
    from grpo_jax import hf
    return hf.resolve_model_dir(hf.SMOL_ALIAS)


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def smol_ref(smol_dir):
    """transformers' SmolLM2 (PyTorch CPU, fp32, eval mode): the oracle."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype="float32").eval()


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    """SmolLM2 as the grpo_jax decoder, fp32."""
    import jax.numpy as jnp

    from grpo_jax import hf
    model, _ = hf.load_model(str(smol_dir), dtype=jnp.float32)
    return model


SMOL_FEW_LAYERS = 4


@pytest.fixture(scope="session")
def smol_few_layers(smol_dir):
    """SmolLM2's first SMOL_FEW_LAYERS layers (its real weights and shapes: 9 query and 3 KV
    heads, 576 wide, 49152 tokens; then its final norm and tied head) as the grpo_jax decoder,
    fp32: for tests that compare two code paths (sharded vs one device, shared prefix vs plain)
    at a real model's shapes, where 30 layers would only add run time (the layers run under one
    lax.scan: compiling them costs the same for any count)."""
    import jax.numpy as jnp

    from grpo_jax import hf
    model, _ = hf.load_model(str(smol_dir), dtype=jnp.float32, num_layers=SMOL_FEW_LAYERS)
    return model


# ------------------------------------------------------------------ vLLM server, shared
# test_vllm, test_vllm_async, test_vllm_sampling_bias and test_vllm_restart share one server of a
# tiny Llama (each module starts by pushing the model's initial weights back: `server` below);
# test_tools and test_vllm_weight_sync one of SmolLM2. test_vllm_restart's tests (marked
# kills_shared_server, run after the group's other tests) hang a transfer to the tiny one, restart
# it mid-run, then kill it mid-run; test_vllm_lora's server is its own (LoRA enabled, no API key;
# its last test kills it).

@pytest.fixture(scope="session")
def tiny_llama_dir():
    """vllm_server's tiny random Llama (a word-level tokenizer vLLM can load), one copy per run."""
    from vllm_server import run_tiny_llama
    return run_tiny_llama()


@pytest.fixture(scope="session")
def tiny_vllm_server(tiny_llama_dir, tmp_path_factory):
    """A vLLM CPU server for tiny_llama_dir, guarded by vllm_server.API_KEY; a 1 MiB cap on the
    guarded JSON routes' bodies (test_weight_routes_check_bodies_and_dtypes; the weights travel
    in raw buckets, which have their own check)."""
    from vllm_server import start_vllm
    srv = start_vllm(tiny_llama_dir, tmp_path_factory.mktemp("vllm_server"), 256,
                     GRPO_JAX_MAX_BODY_BYTES=str(1 << 20))
    _SHARED_SERVERS.append(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smol_vllm_server(smol_dir, tmp_path_factory):
    """A vLLM CPU server for SmolLM2 (guarded by vllm_server.API_KEY) and the directories it could
    write to: its TMPDIR, its cache and the model's (test_vllm_weight_sync checks they stay
    unchanged). Without inductor (vllm_server.NO_INDUCTOR): its cache is its own."""
    from vllm_server import NO_INDUCTOR, start_vllm
    tmp = tmp_path_factory.mktemp("smol_server")
    (tmp / "tmp").mkdir()
    srv = start_vllm(smol_dir, tmp, 1024, TMPDIR=str(tmp / "tmp"),
                     VLLM_CACHE_ROOT=str(tmp / "cache"),  # its own: checked to stay unchanged
                     **NO_INDUCTOR)
    _SHARED_SERVERS.append(srv)
    yield srv, [tmp / "tmp", tmp / "cache", smol_dir]
    srv.stop()


# The tiny-Llama modules' fixtures over the shared server: each module that asks for them gets
# its own (module scope), so each starts from the model's initial weights. test_vllm_lora
# (a server of its own, with vLLM's LoRA and no API key) and test_vllm_restart define their own
# `model_dir`, `server` and `client`, which take precedence in those modules.

@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def trainer(model_dir):
    """The tiny Llama as the grpo_jax decoder, fp32: the oracle of the server's log-probs."""
    import jax.numpy as jnp

    from grpo_jax.hf import load_model
    model, _ = load_model(str(model_dir), dtype=jnp.float32, remat=False)
    return model


@pytest.fixture(scope="module")
def server(tiny_vllm_server, model_dir):
    """The session's server (tiny_vllm_server), serving the model's initial weights: an
    earlier module's runs trained it."""
    from vllm_server import push_initial_weights
    push_initial_weights(tiny_vllm_server.base_url, model_dir)
    return tiny_vllm_server


@pytest.fixture(scope="module")
def client(server):
    from grpo_jax.rollout.vllm.client import VLLMClient
    from vllm_server import API_KEY
    with VLLMClient(server.base_url, api_key=API_KEY, max_retries=2, backoff_s=0.2) as c:
        yield c


# ------------------------------------------------------------------ compiled programs

@pytest.fixture
def compiled():
    """The names of the programs XLA compiles during the test, from jax.monitoring's compile
    event (as test_train.py's test_later_rounds_compile_nothing counts them)."""
    names = []

    def on_event(event, duration, fun_name="?", **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    yield names
    jax.monitoring.unregister_event_duration_listener(on_event)
