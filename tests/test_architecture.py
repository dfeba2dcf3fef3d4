"""The package's structure, held against the code: imports in layers without circles, the
rollout parts by where they run, and the contracts written down (docs/architecture.md): no
attribute probes on a rollout or a model, no private names reached across modules, libraries'
private modules (`_src`) reached from one documented shim alone. And the tests' own: no test
module imports another."""

import ast
import re
from pathlib import Path

import grpo_jax

ROOT = Path(grpo_jax.__file__).parent


def _modules():
    """(dotted name, parsed tree) of every module of the package."""
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        yield name.removesuffix(".__init__"), ast.parse(path.read_text())


def _package_imports() -> dict[str, set[str]]:
    """grpo_jax's modules -> the grpo_jax modules each imports (anywhere in it, functions too);
    `from pkg import name` counts as importing pkg.name when that is a module, else pkg."""
    trees = dict(_modules())
    graph = {}
    for name, tree in trees.items():
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in trees}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in trees:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if sub in trees else node.module)
        graph[name] = out - {name}
    return graph


def test_the_package_imports_in_layers_without_circles():
    """No module imports one that (through others) imports it back; a package's __init__
    counts as the modules it names."""
    graph = _package_imports()
    inits = {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    # Through a package's __init__ to what it hands on, not a dependency of its own.
    edges = {m: {t for d in deps for t in (graph[d] if d in inits else {d})} - {m}
             for m, deps in graph.items() if m not in inits}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, circles


# docs/architecture.md's layers, bottom first: a module imports from its own layer or those
# below it.
LAYERS = (("errors", "config", "run_facts", "shapes", "metrics", "logger", "calculator",
           "images", "image_blocks", "squares", "internals"),
          ("mesh", "distributed", "storage", "checksums", "run_dir"), ("models",),
          ("grpo", "hf", "peft_io"),
          ("math_rewards", "reward_model", "rewards", "scoring"), ("rollout",),
          ("policy", "round", "run_state", "dynamic_sampling", "data", "evaluation"),
          ("checkpoint", "run_log", "train", "export", "bench", "aot", "serve", "cli"))


def test_rollout_parts_import_by_where_they_run():
    """rollout/server runs inside vLLM (no jax): it imports only itself; the native sampler and
    the vLLM client import neither each other nor the rollouts composed above them."""
    graph = _package_imports()
    part = lambda m: m.split(".")[2] if m.count(".") >= 3 else None  # noqa: E731
    for m, deps in graph.items():
        if m.startswith("grpo_jax.rollout.server"):
            assert all(d.startswith("grpo_jax.rollout.server") for d in deps), (m, deps)
        if part(m) in ("native", "vllm"):
            other = {"native": "vllm", "vllm": "native"}[part(m)]
            bad = [d for d in deps if d.startswith("grpo_jax.rollout.") and part(d) != part(m)
                   and (part(d) == other or d.count(".") == 2
                        and d.split(".")[2] in ("engines", "tools", "custom"))]
            assert not bad, (m, bad)
    assert {part(m) for m in graph if m.startswith("grpo_jax.rollout.")} >= {
        "native", "vllm", "server"}


def test_imports_go_up_the_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    of = lambda module: layer[module.split(".")[1]]  # noqa: E731
    graph = _package_imports()
    assert {m.split(".")[1] for m in graph if m != "grpo_jax"} == set(layer)
    up = [(m, d) for m, deps in graph.items() if m != "grpo_jax"
          for d in deps if d != "grpo_jax" and of(d) > of(m)]
    assert not up, up


# The objects whose contracts are written down (rollout.base.Rollout, models.Decoder): code reads
# their declared attributes, never probes for one. `model.layers`, the layer table whose
# attribute names are the param table's, is data, not a contract.
CONTRACT_OBJECTS = {"model", "rollout", "inner", "policy"}


def _probed(call: ast.Call) -> str | None:
    """The object a getattr-with-default / hasattr call probes, by its last name; else None."""
    if not (isinstance(call.func, ast.Name) and call.func.id in ("getattr", "hasattr")):
        return None
    if call.func.id == "getattr" and len(call.args) < 3:
        return None  # getattr(obj, name) without a default reads a name it knows is there
    obj = call.args[0]
    return (obj.id if isinstance(obj, ast.Name) else
            obj.attr if isinstance(obj, ast.Attribute) and isinstance(obj.value, ast.Name)
            and obj.value.id == "self" else None)


def test_no_attribute_probes_on_a_rollout_or_a_model():
    probes = [(name, node.lineno, ast.unparse(node)) for name, tree in _modules()
              for node in ast.walk(tree) if isinstance(node, ast.Call)
              and _probed(node) in CONTRACT_OBJECTS]
    assert not probes, probes


def test_no_private_names_across_modules():
    """A module's `_name`s are its own: no other module of the package imports or reads one."""
    trees = dict(_modules())
    reached = []
    for name, tree in trees.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in trees:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        reached.append((name, f"{node.module}.{a.name}"))
                    if f"{node.module}.{a.name}" in trees:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names
                                if a.asname and a.name in trees})
        reached += [(name, f"{aliases[node.value.id]}.{node.attr}") for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")]
    assert not reached, reached


SHIM = "grpo_jax.internals"  # its docstring says why each private module is reached


def test_libraries_private_modules_only_in_the_shim():
    reached = [(name, node.lineno, ast.unparse(node)) for name, tree in _modules()
               for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               and any("_src" in part.split(".") for part in
                       ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""]))]
    assert reached and {name for name, *_ in reached} == {SHIM}, reached


def test_timing_metrics_are_named_in_one_module():
    """Every timing/* metric name is made by metrics.timing: no other module spells one."""
    spelled = [(name, node.lineno) for name, tree in _modules() if name != "grpo_jax.metrics"
               for node in ast.walk(tree) if isinstance(node, ast.Constant)
               and isinstance(node.value, str) and node.value.startswith("timing/")]
    assert not spelled, spelled


TESTS = Path(__file__).parent
_SCRIPT_IMPORT = re.compile(r"^\s*(?:from|import)\s+(test_\w+)", re.MULTILINE)


def test_test_modules_import_no_test_module():
    """What tests share lives in conftest.py (fixtures) and in helper modules without the
    `test_` prefix (tiny_run, hf_oracle, vllm_server, ...): a test module that imports another
    takes on its imports, skips and module-level work, fixtures come in as unused names, and
    what its neighbours rely on is hidden among its tests, free to change with them. Checked in
    every file of tests/, and in the scripts the tests hand to subprocesses (strings that
    import)."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = _SCRIPT_IMPORT.findall(node.value)
            else:
                continue
            found += [f"tests/{path.name}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[0].startswith("test_")]
    assert not found, (
        "test modules must not import test modules; move what is shared into tests/conftest.py "
        "(fixtures) or a helper module without the test_ prefix:\n  " + "\n  ".join(found))


FACTS = "grpo_jax.run_facts"
# The KL coefficient's own math, and the config's checks of its value (the config sits below
# run_facts: it validates beta, e.g. TRL's error for sync_ref_model with beta 0).
BETA_READERS = ("grpo_jax.grpo.loss", "grpo_jax.config")
# Where a test of a value decides something: a reference rule is `beta` in one of these.
_TESTS = {ast.If: "test", ast.IfExp: "test", ast.While: "test", ast.Assert: "test"}


def _decided(node) -> list:
    """The expressions `node` tests: an if/while/assert's or conditional expression's test,
    a boolean operation's operands, a `not`'s operand, a comparison's sides."""
    if type(node) in _TESTS:
        return [getattr(node, _TESTS[type(node)])]
    if isinstance(node, ast.BoolOp):
        return node.values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [node.operand]
    if isinstance(node, ast.Compare):
        return [node.left, *node.comparators]
    return []


def _calls(tree, name: str) -> list:
    """Calls of `name` (a plain name or an attribute's), with the callee's text."""
    return [(node.lineno, ast.unparse(node.func)) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and name in (
                getattr(node.func, "id", None), getattr(node.func, "attr", None))]


def test_run_facts_are_decided_in_one_module():
    """The reference rule (is there a reference model: a test of beta), the prompt group (rows
    per shared prompt) and the run's total steps are run_facts' alone: train, aot and bench call
    it, none re-derives one (docs/architecture.md)."""
    trees = dict(_modules())
    rule, groups, steps = [], [], []
    for name, tree in trees.items():
        if name == FACTS:
            continue
        if not name.startswith(BETA_READERS):
            rule += [(name, e.lineno, ast.unparse(e)) for node in ast.walk(tree)
                     for expr in _decided(node) for e in ast.walk(expr)
                     if isinstance(e, ast.Attribute) and e.attr == "beta"]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "total_steps":
                steps.append((name, node.lineno, "def total_steps"))
            if isinstance(node, ast.FunctionDef) and node.name == "prompt_group" and not any(
                    f == "run_facts.prompt_group" for _, f in _calls(node, "prompt_group")):
                groups.append((name, node.lineno, "def prompt_group without run_facts'"))
        groups += [(name, line, f) for line, f in _calls(tree, "gcd")]
        steps += [(name, line, f) for line, f in _calls(tree, "total_steps")
                  if f != "run_facts.total_steps"]
        # Programs are built for run_facts.total_steps' steps, never a number written in.
        steps += [(name, node.lineno, ast.unparse(node)) for fn in ("Policy", "build_programs")
                  for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and fn in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
                  and any(isinstance(a, ast.Constant) and isinstance(a.value, int)
                          for a in node.args)]
    assert not rule, rule
    assert not groups, groups
    assert not steps, steps
    facts = trees[FACTS]
    defined = {n.name for n in facts.body if isinstance(n, ast.FunctionDef)}
    assert {"has_reference", "prompt_group", "total_steps"} <= defined
