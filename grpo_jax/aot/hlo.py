"""The optimized HLO text of a compiled program (`compiled.as_text()`), read: its computations,
how many times each runs (while loops by trip count), and its FLOPs and HBM bytes counted the
way XLA's cost analysis counts them, but with every loop trip counted.

XLA's cost analysis (`compiled.cost_analysis()`) counts a while loop's body once, whatever its
trip count: a program that scans 48 layers and 8 micro-batches is undercounted 384-fold. Here
each computation's count is the sum over its call sites of the caller's count, times the trip
count for a loop body. The trip count is XLA's `known_trip_count` where the backend records it
(CPU, GPU) or, as the TPU compiler leaves a scan, read from the loop's condition (`i < N`,
counter starting at a constant). A loop whose length depends on its data (the sampler's decode
loop stops once every row is done) counts `unknown_trips` times, given by the caller.

Costs follow HloCostAnalysis: a dot is 2 FLOPs per multiply-add, an elementwise op or a
reduction one per element (transcendentals not counted as FLOPs), a fusion the sum of its
fused ops; bytes are each top-level op's operands read plus its result written, a fusion's
operands counted by what it reads of them (a slice of an operand it only slices or gathers
from, nothing of a buffer it updates in place) and its in-place result by the region written;
a gather reads the rows it takes, an async slice or copy (`slice-start`, `copy-start`, whose
tuple type repeats its operands) what it moves. Only HBM counts: arrays the TPU compiler put in
on-chip memory (layout `S(1)`) are read and written for free.

TPU Pallas kernels (`tpu_custom_call`), which XLA's cost analysis counts as no work, count by
their own cost estimate where they carry one (megablox's grouped matmuls), and splash
attention's, which carry none, by their shapes and the share of blocks their mask lets them
visit (`kernel_cost`): at 32k tokens attention is over a third of a forward's FLOPs. GPU
Pallas kernels lowered by Triton (`__gpu$xla.gpu.triton`: the decode-attention kernel) count
their operands and result as bytes, and the decode kernel its FLOPs by its shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,<=]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation|"
                     r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


_LAID_OUT = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,<=]*)\](?:\{([^}]*)\})?")


def array_bytes(type_text: str, hbm_only: bool = False) -> int:
    """Bytes of every array in an HLO type (a tuple's elements summed; f8 types: 1 byte), as
    laid out: a TPU layout's tile (`{1,0:T(8,128)}`) pads its most-minor dimensions to whole
    tiles, as the chip stores them. `hbm_only`: leave out arrays the compiler placed in
    another memory space (`S(1)`: the TPU's on-chip VMEM, `S(2)`: scalars), whose reads and
    writes are no HBM traffic."""
    total = 0
    for dtype, dims, layout in _LAID_OUT.findall(type_text):
        if hbm_only and re.search(r"S\([1-9]\d*\)", layout or ""):
            continue
        bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else 0)
        shape = [int(d.split("=")[-1]) for d in dims.split(",") if d]
        tile = re.search(r"T\(([\d,]+)\)", layout or "")
        if tile:
            order = [int(x) for x in layout.split(":")[0].split(",") if x]  # minor to major
            major_to_minor = [shape[i] for i in reversed(order)] if order else [1]
            t = [int(x) for x in tile.group(1).split(",")]
            head, tail = major_to_minor[:-len(t)], major_to_minor[-len(t):]
            t = t[-len(tail):]
            shape = head + [-(-d // k) * k for d, k in zip(tail, t)]
        total += math.prod(shape) * bits // 8
    return total


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    args: str  # the operand list as written (a constant's value)
    root: bool


def _split_call(rest: str) -> tuple[str, str]:
    """`a, b), attr=...` -> ('a, b', 'attr=...'): the operand list up to its closing paren."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations of an HLO module's text -> their instructions, and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.rstrip() == "}":  # not "}}, ..." within a multi-line backend_config (Pallas)
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            name, type_text, opcode, rest = m.groups()
            args, attrs = _split_call(rest)
            comps[current].append(_Instr(name, type_text, opcode,
                                         tuple(re.findall(r"%([\w.\-]+)", args)), attrs, args,
                                         line.lstrip().startswith("ROOT")))
        elif comps[current]:  # a backend config over several lines (a Pallas cost estimate)
            last = comps[current][-1]
            comps[current][-1] = dataclasses.replace(last, attrs=f"{last.attrs}\n{line}")
    return comps, entry


def _called(ins: _Instr, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def _constant(comp: dict[str, _Instr], name: str) -> int | None:
    """The integer value of instruction `name` when it is a scalar constant (or a copy of one)."""
    ins = comp.get(name)
    while ins is not None and ins.opcode == "copy" and ins.operands:
        ins = comp.get(ins.operands[0])
    if ins is None or ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.args.strip()):
        return None
    return int(ins.args)


def trip_count(ins: _Instr, comps: dict[str, list[_Instr]],
               where: dict[str, _Instr]) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` where the backend records it (CPU,
    GPU), else read from the loop as the TPU compiler leaves it: a condition `i < N` (or <=) on a
    tuple element whose initial value is a constant (a scan's counter, stepping by 1). None for
    any other loop (the sampler's decode loop also stops when every row is done)."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get(_called(ins, "condition") or "", [])
    local = {i.name: i for i in cond}
    root = next((i for i in cond if i.root), None)
    if root is not None and root.opcode == "fusion":  # compare(param 0, param 1) fused
        inner = comps.get(_called(root, "calls") or "", [])
        cmp = next((i for i in inner if i.root and i.opcode == "compare"), None)
        params = {i.name: int(i.args) for i in inner if i.opcode == "parameter"}
        if cmp is None or len(cmp.operands) != 2 or not set(cmp.operands) <= set(params):
            return None
        operands = [root.operands[params[o]] for o in cmp.operands]
        direction = re.search(r"direction=(\w+)", cmp.attrs)
    elif root is not None and root.opcode == "compare" and len(root.operands) == 2:
        operands, direction = list(root.operands), re.search(r"direction=(\w+)", root.attrs)
    else:
        return None
    counter, bound = (local.get(o) for o in operands)
    if counter is None or counter.opcode != "get-tuple-element" or direction is None:
        return None
    limit = _constant(local, bound.name) if bound is not None else None
    index = re.search(r"index=(\d+)", counter.attrs)
    if limit is None or index is None or direction.group(1) not in ("LT", "LE"):
        return None
    init_tuple = where.get(ins.operands[0]) if ins.operands else None
    start = 0
    if init_tuple is not None and init_tuple.opcode == "tuple":
        start = _constant(where, init_tuple.operands[int(index.group(1))])
        if start is None:
            return None
    return max(limit - start + (direction.group(1) == "LE"), 0)


def multipliers(comps: dict[str, list[_Instr]], entry: str,
                unknown_trips: float = 1.0) -> tuple[dict[str, float], int]:
    """How many times each computation runs per execution of the entry: the sum over its call
    sites of the caller's count, times the trip count for a while body. Returns also the number
    of while loops whose trip count XLA did not know (counted `unknown_trips` times)."""
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
    unknown = 0
    for comp, instrs in comps.items():
        where = {i.name: i for i in instrs}
        for ins in instrs:
            if ins.opcode.endswith(("-done", "-update")):
                continue  # the -start of an async pair holds the work
            trips = None
            if ins.opcode == "while":
                trips = trip_count(ins, comps, where)
                if trips is None:
                    unknown += 1
                    trips = unknown_trips
            for key, value in _CALLED.findall(ins.attrs):
                factor = {"body": trips, "condition": (trips or 0) + 1}.get(key) or 1
                for callee in re.findall(r"[\w.\-]+", value):
                    calls[comp].append((callee, factor))
    mult: dict[str, float] = defaultdict(float)
    mult[entry] = 1.0
    # Computations are printed callees first (post-order): callers come before callees in
    # reverse, so each count is final before it is passed on.
    for comp in reversed(list(comps)):
        for callee, factor in calls.get(comp, ()):
            mult[callee] += mult[comp] * factor
    return dict(mult), unknown




_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "while", "conditional", "call", "opt-barrier",
         "add-dependency", "domain", "custom-call"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                   "logistic", "rsqrt", "sqrt", "cbrt", "power", "sine", "cosine", "tan",
                   "atan2", "erf"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                "compare", "select", "and", "or", "not", "xor", "clamp", "convert", "floor",
                "ceil", "round-nearest-even", "round-nearest-afz", "sign", "remainder",
                "is-finite", "shift-left", "shift-right-logical", "shift-right-arithmetic",
                "popcnt", "count-leading-zeros", "real", "imag", "stochastic-convert"}


def elements(type_text: str) -> int:
    return sum(math.prod(int(d.split("=")[-1]) for d in dims.split(",") if d) if dims else 1
               for _, dims in _ARRAY.findall(type_text))


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d.split("=")[-1]) for d in m.group(2).split(",") if d] if m and m.group(2) else []


def _window(attrs: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([\dx_]+)", attrs)
    if not m:
        return [default] * n
    return [int(v.split("_")[0]) for v in m.group(1).split("x")]


def _conv_flops(ins: _Instr, types: dict[str, str]) -> float:
    """A convolution (the TPU compiler writes matmuls as convolutions) as HloCostAnalysis counts
    it: 2 x input features per group x output features x batch x, per spatial dimension, the
    (output, kernel) positions that land on the input (padding and dilation left out)."""
    import numpy as np

    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels or len(ins.operands) < 2:
        return 0.0
    lhs, rhs, out = (_dims(types.get(o, "")) for o in ins.operands[:2]), None, _dims(ins.type)
    lhs, rhs = lhs
    ll, rl, ol = labels.groups()
    spatial = [c for c in ll if c.isdigit()]
    n = len(spatial)
    size = _window(ins.attrs, "size", n, 1)
    stride = _window(ins.attrs, "stride", n, 1)
    pad = re.search(r"\bpad=([\d_x-]+)", ins.attrs)
    low = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * n
    lhs_dil = _window(ins.attrs, "lhs_dilate", n, 1)
    rhs_dil = _window(ins.attrs, "rhs_dilate", n, 1)
    valid = 1
    for d in spatial:  # the window lists its dimensions by spatial number, not label order
        i = int(d)
        o = np.arange(out[ol.index(d)])[:, None]
        k = np.arange(size[i])[None, :]
        at = o * stride[i] - low[i] + k * rhs_dil[i]
        inside = (at % lhs_dil[i] == 0) & (at >= 0) & (at // lhs_dil[i] < lhs[ll.index(d)])
        valid *= int(inside.sum())
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", ins.attrs)
    fma = (lhs[ll.index("f")] // (int(groups.group(1)) if groups else 1) * rhs[rl.index("o")]
           * lhs[ll.index("b")] // (int(batch_groups.group(1)) if batch_groups else 1) * valid)
    return 2.0 * fma


def _gemm_flops(ins: _Instr, types: dict[str, str]) -> float:
    """A GPU library matmul (cuBLAS / cuBLASLt custom call): 2 x result elements x the
    contracted size, the contracting dimensions in its backend_config."""
    m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
    lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
    if not m or not lhs:
        return 0.0
    k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))
    return 2.0 * elements(_ARRAY.search(ins.type).group(0)) * k


# TPU Pallas kernels, and GPU ones lowered by Triton (models/decode_attention.py's).
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"')
# The decode-attention kernel (not its splits' combine): 4 FLOPs per query head, key and head
# dim (QK^T and PV), q [..., G, Dh] and k [..., S, Dh]; it reads every slot at most (masked
# ones it skips: the count is an upper bound, as for XLA's attention).
_DECODE = re.compile(r"/decode_attention/pallas_call")
# Splash attention's kernels (jax's splash_attention_kernel.get_kernel_name) and the FLOPs
# each does per (query, key, head dim) of the blocks it visits: the forward QK^T and PV; dq
# QK^T, dO V^T and dS K; dk/dv QK^T, dO V^T, P^T dO and dS^T Q (attention.splash sets
# separate dq and dk/dv kernels: splash's fused one would add dS K).
_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_FLOPS = {"fwd": 4, "dq": 6, "dkv": 8}
# The share of the [queries, keys] blocks a splash kernel visits, as attention.splash tags
# its name scope (the block mask is worked out on the host, so the compiled program can't
# say); 1 without a tag.
_VISITED = re.compile(r"splash_visits_([\d.]+)")


def kernel_cost(ins: _Instr, types: dict[str, str]) -> tuple[float, float] | None:
    """(FLOPs, HBM bytes) of a Pallas kernel (a `tpu_custom_call`, or a GPU Triton one, which
    XLA's cost analysis counts as nothing): its own cost estimate where it gives one
    (megablox's gmm); splash attention's from its shapes, q [..., Tq, Dh] and k [..., S, Dh],
    and the share of blocks it visits; the decode-attention kernel's from its shapes; None for
    any other instruction. Bytes without an estimate: what the kernel reads and writes once."""
    if ins.opcode != "custom-call" or not _KERNEL.search(ins.attrs):
        return None
    config = ins.attrs.replace('\\"', '"')
    moved = float(sum(_hbm(types.get(o, "")) for o in ins.operands) + _hbm(ins.type))
    est = re.search(r'"cost_estimate"\s*:\s*(\{[^{}]*\})', config)
    if est:
        e = json.loads(est.group(1))
        return float(e.get("flops", 0)), float(e.get("bytes_accessed", moved))
    kind = _SPLASH.search(config)
    # q and k: the first two floating-point operands (the block masks before them are ints).
    arrays = [_dims(t) for t in (types.get(o, "") for o in ins.operands)
              if re.match(r"\(?(bf16|f16|f32|f8)", t)]
    if (not kind and not _DECODE.search(config)) or len(arrays) < 2 \
            or min(len(a) for a in arrays[:2]) < 2:
        return 0.0, moved
    q, k = arrays[:2]
    if not kind:
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1], moved
    visited = _VISITED.search(config)
    share = float(visited.group(1)) if visited else 1.0
    return _SPLASH_FLOPS[kind.group(1)] * math.prod(q[:-1]) * k[-2] * q[-1] * share, moved


def _flops(ins: _Instr, types: dict[str, str], comps) -> float:
    if ins.opcode == "convolution":
        return _conv_flops(ins, types)
    kernel = kernel_cost(ins, types)
    if kernel is not None:
        return kernel[0]
    if ins.opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)',
                                                 ins.attrs):
        return _gemm_flops(ins, types)
    if ins.opcode == "dot":
        lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
        return 2.0 * elements(ins.type) * k
    if ins.opcode in _ELEMENTWISE:
        return float(elements(ins.type))
    if ins.opcode in ("reduce", "reduce-window"):
        return float(elements(types.get(ins.operands[0], ""))) if ins.operands else 0.0
    if ins.opcode == "fusion":
        inner = comps.get(_called(ins, "calls") or "", [])
        local = {i.name: i.type for i in inner}
        return sum(_flops(i, local, comps) for i in inner)
    return 0.0


def _fusion_bytes(ins: _Instr, types: dict[str, str], comps) -> float:
    """What a fusion reads of its operands and writes of its result."""
    inner = comps.get(_called(ins, "calls") or "", [])
    users = defaultdict(list)
    for i in inner:
        for o in i.operands:
            users[o].append(i)
    params = {int(i.args): i for i in inner if i.opcode == "parameter" and i.args.isdigit()}
    total = 0.0
    for n, name in enumerate(ins.operands):
        p = params.get(n)
        use = users.get(p.name, []) if p else []
        if use and all(u.opcode in ("dynamic-slice", "slice", "gather")
                       and u.operands[0] == p.name for u in use):
            total += sum(_hbm(u.type) for u in use)
        elif use and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p.name
                         for u in use):
            continue  # updated in place: not read
        else:
            total += _hbm(types.get(name, ""))
    root = next((i for i in inner if i.root), None)
    roots = ([{i.name: i for i in inner}.get(o) for o in root.operands]
             if root is not None and root.opcode == "tuple" else [root])
    local = {i.name: i.type for i in inner}
    for r in roots:
        if r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
            total += _hbm(local.get(r.operands[1], ""))
        elif r is not None:
            total += _hbm(r.type)
    return total


def _bytes(ins: _Instr, types: dict[str, str], comps) -> float:
    kernel = kernel_cost(ins, types)
    if kernel is not None:
        return kernel[1]
    if ins.opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)',
                                                 ins.attrs):
        return sum(_hbm(types.get(o, "")) for o in ins.operands) + _hbm(ins.type)
    if ins.opcode in _FREE or ins.opcode.endswith(("-done", "-update")):
        return 0.0
    if ins.opcode == "fusion":
        return _fusion_bytes(ins, types, comps)
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return 2.0 * _hbm(types.get(ins.operands[1], ""))
    if ins.opcode in ("dynamic-slice", "slice"):
        return 2.0 * _hbm(ins.type)
    if ins.opcode == "gather":  # the rows it takes, and its indices
        return 2.0 * _hbm(ins.type) + sum(_hbm(types.get(o, ""))
                                                 for o in ins.operands[1:])
    if ins.opcode.endswith("-start") and ins.type.startswith("("):
        # An async op's type is (its operands again, its result, context): the operands are
        # aliased, not written. A slice reads what it takes; a copy reads and writes it.
        parts = _tuple_parts(ins.type)
        result = parts[1] if len(parts) > 1 else ""
        if ins.opcode == "slice-start":  # the slice read from its operand, written where it goes
            read = array_bytes(result) if _hbm(parts[0]) else 0
            return float(read + _hbm(result))
        if ins.opcode == "copy-start":  # (destination, source): the HBM side of the move
            return float(_hbm(parts[0]) + _hbm(result))
        return sum(_hbm(types.get(o, "")) for o in ins.operands) + _hbm(result)
    return sum(_hbm(types.get(o, "")) for o in ins.operands) + _hbm(ins.type)


def _hbm(type_text: str) -> int:
    return array_bytes(type_text, hbm_only=True)


def _tuple_parts(type_text: str) -> list[str]:
    """The top-level elements of a tuple type, `(a, (b, c), d)` -> [a, (b, c), d]."""
    parts, depth, cur = [], 0, []
    for ch in type_text.strip()[1:-1]:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    return parts + ["".join(cur).strip()]


@dataclasses.dataclass(frozen=True)
class Counted:
    flops: float
    bytes: float
    unknown_loops: int


def cost(text: str, unknown_trips: float = 1.0) -> Counted:
    """FLOPs and HBM bytes of one execution of a compiled program, every loop trip counted."""
    comps, entry = parse_module(text)
    mult, unknown = multipliers(comps, entry, unknown_trips)
    fused = {callee for instrs in comps.values() for i in instrs if i.opcode == "fusion"
             for callee in [_called(i, "calls")] if callee}
    flops = nbytes = 0.0
    for comp, instrs in comps.items():
        count = mult.get(comp, 0.0)
        if not count or comp in fused:
            continue
        types = {i.name: i.type for i in instrs}
        for ins in instrs:
            flops += count * _flops(ins, types, comps)
            nbytes += count * _bytes(ins, types, comps)
    return Counted(flops, nbytes, unknown)
