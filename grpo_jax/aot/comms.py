"""Communication of a compiled program: its collectives, their bytes, the mesh axes they cross,
and their time at the target's interconnect bandwidths.

Read from the optimized HLO text (`compiled.as_text()`): every all-gather, reduce-scatter,
all-reduce, all-to-all and collective-permute (and their async -start forms), with its operands'
bytes and its replica groups (explicit `{{0,1},...}`, iota `[2,4]<=[8]T(1,0)` or mesh-axes
`mesh['axis_0'=2,...] {'axis_1'}`). A collective in a while loop's body counts once per trip,
as `hlo.cost` counts FLOPs and bytes (`hlo.multipliers`).

Bytes are per device. `size` is the array a collective moves, whole over its group (an
all-gather's result, the operand of the others); ring algorithms send `traffic` of it per device:
(n-1)/n of it for all-gather, reduce-scatter and all-to-all, twice that for all-reduce, all of it
for collective-permute.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from grpo_jax.aot.hlo import array_bytes, multipliers, parse_module

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def traffic_factor(kind: str, n: int) -> float:
    """Bytes each device sends, as a fraction of the collective's `size`, in ring algorithms."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    size: int  # bytes per device of the array moved, whole over the group
    group: int  # devices per group (collective-permute: 2, a pair)
    axes: tuple[str, ...]  # mesh axes the groups span
    count: float  # runs per execution of the program (loop trips multiplied in)
    slices: int = 1  # TPU slices a group spans (> 1: it crosses the data-center network)
    torus_dims: int = 1  # physical torus dimensions a group spans (TPU ICI)

    @property
    def traffic(self) -> float:
        """Bytes each device sends per run."""
        return self.size * traffic_factor(self.kind, self.group)


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _mesh_groups(text: str) -> np.ndarray:
    """Groups of the mesh-axes form: `mesh['a'=2,'b'=4](, device_ids=(...))? {'b', 'a':(1)2}`."""
    head, _, axes_text = text.rpartition("{")
    names = re.findall(r"'?([\w]+)'?\s*=\s*(\d+)", head.split("]")[0])
    sizes = [int(s) for _, s in names]
    index = {n: i for i, (n, _) in enumerate(names)}
    ids_text = re.search(r"device_ids=\((.*)\)", head)
    if ids_text is None:
        devices = np.arange(math.prod(sizes))
    else:
        # An iota ("[2,4]T(1,0)": arange reshaped, transposed, flattened; "<=" gives the
        # reshape when the shape differs) or the ids listed.
        m = re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*",
                         ids_text.group(1))
        devices = (_iota(_ints(m.group(2) or m.group(1)),
                         _ints(m.group(3)) if m.group(3) else None).ravel()
                   if m else np.array(_ints(ids_text.group(1))))
    refs = []  # (axis index, pre-size or None, size)
    for ref in re.findall(r"'?([\w]+)'?(?::\((\d+)\)(\d+))?", axes_text.split("}")[0]):
        if ref[0]:
            refs.append((index[ref[0]], int(ref[1]) if ref[1] else None,
                         int(ref[2]) if ref[2] else sizes[index[ref[0]]]))
    # Split each mesh axis into its referenced sub-axes (major to minor), then put the grouped
    # dimensions last, in the order the replica group names them.
    dims, grouped = [], {}
    for i, size in enumerate(sizes):
        subs = sorted((r for r in refs if r[0] == i), key=lambda r: r[1] or 1)
        prefix = 1
        for axis, pre, sub in subs:
            pre = pre or 1
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[(axis, pre)] = len(dims)
            dims.append(sub)
            prefix *= sub
        if prefix != size:
            dims.append(size // prefix)
    order = [grouped[(a, p or 1)] for a, p, _ in refs]
    rest = [d for d in range(len(dims)) if d not in order]
    group = math.prod(dims[d] for d in order)
    return devices.reshape(dims).transpose(rest + order).reshape(-1, group)


def replica_groups(attrs: str, num_devices: int) -> np.ndarray:
    """[groups, group size] device ids of a collective's replica_groups (all devices in one
    group when they are empty)."""
    m = re.search(r"replica_groups=(mesh\[.*?\]\s*(?:,\s*device_ids=\(.*?\))?\s*\{[^}]*\}"
                  r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
    if m is None or m.group(1) == "{}":
        return np.arange(num_devices)[None]
    text = m.group(1)
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("["):
        shape, reshape, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                            text).groups()
        return _iota(_ints(reshape), _ints(perm) if perm else None).reshape(_ints(shape))
    return np.array([_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])])


def _pairs(attrs: str) -> np.ndarray:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    return np.array([_ints(p) for p in re.findall(r"\{([\d,\s]+)", m.group(1) + "}")]) if m \
        else np.zeros((0, 2), int)


def collectives(text: str, mesh, unknown_trips: float = 1.0) -> tuple[list[Collective], int]:
    """The collectives of a compiled program (`compiled.as_text()`) laid out over `mesh` (the
    jax Mesh it was compiled for: device id i of the HLO is mesh.devices.flat[i]). Returns them
    and the number of loops whose trip count was taken as `unknown_trips`."""
    from grpo_jax import mesh as mesh_lib

    comps, entry = parse_module(text)
    mult, unknown = multipliers(comps, entry, unknown_trips)
    flat = mesh.devices.flat
    grid = mesh.devices.shape
    names = tuple(mesh.axis_names)
    out, seen = [], set()
    for comp, instrs in comps.items():
        types = {i.name: i.type for i in instrs}
        count = mult.get(comp, 0.0)
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS or not count:
                continue
            # TPU's async collectives repeat the op in the fusions that start, continue and
            # finish it: the same channel, shape, groups and source, counted once.
            channel = re.search(r"channel_id=(\d+)", ins.attrs)
            if channel:
                source = re.search(r'op_name="([^"]*)"', ins.attrs)
                key = (channel.group(1), kind, re.sub(r"\{[^{}]*\}", "", ins.type),
                       re.search(r"(replica_groups|source_target_pairs)=(\S+)", ins.attrs),
                       source and source.group(1), count)
                key = key[:3] + (key[3] and key[3].group(2),) + key[4:]
                if key in seen:
                    continue
                seen.add(key)
            if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # TPU's fused all-reduce + slice: a reduce-scatter
            operands = [array_bytes(types.get(o, "")) for o in ins.operands]
            if kind == "collective-permute":
                groups = _pairs(ins.attrs)
                size = operands[0] if operands else array_bytes(ins.type)
            else:
                groups = replica_groups(ins.attrs, len(flat))
                size = sum(operands) * (groups.shape[1] if kind == "all-gather" else 1)
            if groups.size == 0:
                continue
            coords = np.stack(np.unravel_index(groups, grid), axis=-1)  # [g, n, axes]
            spans = (coords != coords[:, :1]).any(axis=1).any(axis=0)
            devs = [[flat[i] for i in g] for g in groups]
            slices = max(mesh_lib.slice_count(g) for g in devs)
            phys = [np.array([getattr(d, "coords", (0,)) for d in g]) for g in devs]
            torus = max(int((p != p[:1]).any(axis=0).sum()) for p in phys)
            out.append(Collective(kind, size, groups.shape[1],
                                  tuple(a for a, s in zip(names, spans) if s), count, slices,
                                  max(torus, 1)))
    return out, unknown


def seconds(c: Collective, chip) -> float:
    """One run of `c` on `chip` (hardware.Chip): its traffic over the links it can use. On a
    TPU torus a bidirectional ring per spanned dimension receives over two links (one each
    way), so a group spanning k dimensions gets k x (per-chip ICI / ports); over NVLink a GPU
    receives at half its bidirectional bandwidth. A group across slices goes hierarchically:
    the ICI part within each slice, then 1/(members per slice) of it over DCN."""
    per_slice = max(c.group // c.slices, 1)
    ici = (chip.ici_bandwidth * c.torus_dims / chip.ici_ports if chip.ici_ports
           else chip.ici_bandwidth / 2)
    t = c.size * traffic_factor(c.kind, per_slice) / ici
    if c.slices > 1:
        share = c.size / per_slice if c.kind != "all-gather" else c.size / c.group
        t += share * (c.slices - 1 if c.kind == "all-gather"
                      else traffic_factor(c.kind, c.slices)) / chip.dcn_bandwidth
    return t


def summary(colls: list[Collective], chip) -> dict:
    """Per-device bytes and seconds of one program execution, in all and by (kind, axes)."""
    by: dict[str, dict] = {}
    for c in colls:
        key = f"{c.kind} over {'+'.join(c.axes) or 'nothing'}" + (" (DCN)" if c.slices > 1 else "")
        e = by.setdefault(key, {"count": 0.0, "gb": 0.0, "seconds": 0.0})
        e["count"] += c.count
        e["gb"] += c.traffic * c.count / 1e9
        e["seconds"] += seconds(c, chip) * c.count
    return {"gb": sum(e["gb"] for e in by.values()),
            "seconds": sum(e["seconds"] for e in by.values()), "by": by}
