"""NUMA placement: the topology read from sysfs, a pure plan of where the weights and threads go, and the Linux
memory-policy syscalls that carry it out.

Policies: `off` (the kernel's default: first touch); `interleave` (the weight copy's pages spread round-robin over
the nodes with memory, so decode reads every socket's memory at once); `bind:N` (memory and threads on node N);
`replicate` (one weight copy per node, each bound to its node's memory, and each pool thread pinned to a node's CPUs
reading that node's copy: every weight read is local; the CPU backend makes the copies,
hybridinfer.backends.cpu.replicas;
nodes with CPUs but no copy send their threads to the nearest copy); `auto` (one node: nothing to do; several:
replicate where supported and the model fits every node's free memory, else interleave, off when the model does not
fit the free memory of all nodes together).

interleave and bind set the policy on the calling thread with set_mempolicy before the model is loaded: threads made
after it (the pool's, the scheduler's) inherit it, and the weight copy's pages are placed by it as they are first
written. replicate sets no process policy: each copy is bound with mbind before it is written."""

from __future__ import annotations

import ctypes
import os
import platform
import re
from dataclasses import dataclass, field

from ..errors import ParameterError

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
MPOL_F_ADDR = 2  # get_mempolicy: the policy of the page at addr
MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind", MPOL_INTERLEAVE: "interleave"}
_SYSCALLS = {  # (mbind, set_mempolicy, get_mempolicy)
    "x86_64": (237, 238, 239), "aarch64": (235, 237, 236), "arm64": (235, 237, 236),
    "ppc64le": (259, 261, 260), "ppc64": (259, 261, 260), "riscv64": (235, 237, 236),
}
_MASK_BITS = 1024  # node mask size passed to the kernel (more than MAX_NUMNODES of any kernel build)
POLICIES = ("off", "interleave", "bind:N", "replicate", "auto")
FIT_MARGIN = 1.1  # the weights' bytes times this must be free on a node for a copy there (other allocations)


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple[int, ...]
    mem_total: int  # bytes; 0 for a node without memory (CPUs only)
    mem_free: int
    distance: tuple[int, ...] = ()  # to each node of the topology, in its order (sysfs: 10 local); () unknown


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]

    @property
    def mem_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.mem_total > 0)

    def node(self, i: int) -> Node | None:
        return next((n for n in self.nodes if n.id == i), None)


def parse_cpulist(s: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    out: list[int] = []
    for part in s.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return tuple(out)


def _meminfo(path: str) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"Node\s+\d+\s+(\w+):\s+(\d+)(?:\s+kB)?", line)
            if m:
                out[m.group(1)] = int(m.group(2)) * 1024
    return out


def read_topology(root: str = "/sys/devices/system/node") -> Topology:
    """The NUMA nodes under `root` (sysfs; a fake tree in tests): their CPUs and memory. Without it (not Linux, no
    sysfs) one node holding every CPU this process may use and no memory figures."""
    if not os.path.isdir(root):
        cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        return Topology((Node(0, cpus, 0, 0),))
    nodes = []
    for name in sorted(os.listdir(root), key=lambda n: int(n[4:]) if n[4:].isdigit() else -1):
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        d = os.path.join(root, name)
        try:
            with open(os.path.join(d, "cpulist")) as f:
                cpus = parse_cpulist(f.read())
        except OSError:
            cpus = ()
        try:
            mi = _meminfo(os.path.join(d, "meminfo"))
        except OSError:
            mi = {}
        try:
            with open(os.path.join(d, "distance")) as f:
                dist = tuple(int(x) for x in f.read().split())
        except (OSError, ValueError):
            dist = ()
        nodes.append(Node(int(name[4:]), cpus, mi.get("MemTotal", 0), mi.get("MemFree", 0), dist))
    if any(len(n.distance) != len(nodes) for n in nodes):  # a partial table says nothing reliable
        nodes = [Node(n.id, n.cpus, n.mem_total, n.mem_free) for n in nodes]
    return Topology(tuple(nodes))


@dataclass
class Plan:
    """Where the weights and threads go. mode: what is done ("off", "interleave", "bind", "replicate"); mem_nodes:
    the nodes its memory policy names; cpus: the CPUs the process's threads are pinned to (None: not pinned);
    replicas: the memory node of each per-node weight copy (replicate); replica_cpus: for each copy, the CPUs of the
    pool threads that read it; notes: why, in words."""

    policy: str
    mode: str
    mem_nodes: tuple[int, ...] = ()
    cpus: tuple[int, ...] | None = None
    replicas: tuple[int, ...] = ()
    replica_cpus: tuple[tuple[int, ...], ...] = ()
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = f"numa: policy {self.policy} -> {self.mode}"
        if self.mem_nodes:
            head += f" on node(s) {','.join(map(str, self.mem_nodes))}"
        if self.cpus is not None:
            head += f", threads on {len(self.cpus)} CPU(s)"
        if self.replicas:
            head += f", weight copies on node(s) {','.join(map(str, self.replicas))}"
        lines = [head] + [f"  copy {k} on node {n}: read by threads on CPUs {cpu_ranges(c) or 'any'}"
                          for k, (n, c) in enumerate(zip(self.replicas, self.replica_cpus, strict=False))]
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _replica_cpus(topo: Topology, replicas: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each copy's readers: its node's CPUs, and those of every node without a copy whose nearest copy (by the
    sysfs distance; the first copy where distances are unknown) it is."""
    order = {n.id: i for i, n in enumerate(topo.nodes)}
    out: dict[int, list[int]] = {r: [] for r in replicas}
    for n in topo.nodes:
        if n.id in out:
            out[n.id].extend(n.cpus)
            continue
        near = replicas[0]
        if n.distance:
            near = min(replicas, key=lambda r: (n.distance[order[r]], r))
        out[near].extend(n.cpus)
    return tuple(tuple(sorted(out[r])) for r in replicas)


def _replicate(topo: Topology, policy: str, replicas: tuple[int, ...], notes: list[str]) -> Plan:
    return Plan(policy, "replicate", replicas=replicas, replica_cpus=_replica_cpus(topo, replicas), notes=notes)


def plan(topo: Topology, model_bytes: int, policy: str, replicate_supported: bool = False) -> Plan:
    """The placement of a model of `model_bytes` on `topo` for `policy` (one of POLICIES, bind as "bind:2"). Pure:
    it reads nothing and changes nothing. replicate_supported: the backend can make per-node weight copies (the CPU
    backend can); without it replicate interleaves. A request that cannot be met (bind to a node that is not there
    or has no memory, an unknown policy) raises ParameterError naming it; one that can only be met in part is
    planned and says so in the notes."""
    mem = topo.mem_nodes
    if policy == "off":
        return Plan(policy, "off", notes=["the kernel's default placement (first touch)"])
    if policy.startswith("bind:"):
        spec = policy[5:]
        if not spec.isdigit():
            raise ParameterError(f"numa policy bind:N needs a node number, got {policy!r}")
        node = topo.node(int(spec))
        if node is None:
            raise ParameterError(f"numa policy {policy}: there is no node {spec} (nodes: "
                                 f"{','.join(str(n.id) for n in topo.nodes)})")
        if node.mem_total <= 0:
            raise ParameterError(f"numa policy {policy}: node {spec} has no memory of its own")
        p = Plan(policy, "bind", (node.id,), node.cpus or None)
        if node.mem_free and model_bytes * FIT_MARGIN > node.mem_free:
            p.notes.append(f"the model ({_gib(model_bytes)}) may not fit node {node.id}'s free memory "
                           f"({_gib(node.mem_free)}): allocations past it fail")
        if not node.cpus:
            p.notes.append(f"node {node.id} has no CPUs: threads are not pinned")
        return p
    if policy not in ("interleave", "replicate", "auto"):
        raise ParameterError(f"unknown numa policy {policy!r} (known: {', '.join(POLICIES)})")
    fits_each = tuple(n.id for n in mem if n.mem_free >= model_bytes * FIT_MARGIN)
    if len(mem) <= 1:
        only = mem[0].id if mem else 0
        if policy == "replicate" and replicate_supported:
            if mem and not fits_each:
                return Plan(policy, "off", notes=[f"the model ({_gib(model_bytes)}) exceeds node {only}'s free "
                                                  f"memory ({_gib(mem[0].mem_free)}): no copy made"])
            return _replicate(topo, policy, (only,), ["one node with memory: one weight copy bound to it, read by "
                                                      "every pool thread pinned to its CPUs"])
        what = {"interleave": "interleaving over one node is its default placement",
                "replicate": "one node holds the one weight copy", "auto": "nothing to place"}[policy]
        mode = "interleave" if policy == "interleave" else "off"
        return Plan(policy, mode, (only,) if mode != "off" else (), notes=[f"one node with memory: {what}"])
    ids = tuple(n.id for n in mem)
    if policy == "auto":
        if model_bytes * FIT_MARGIN > sum(n.mem_free for n in mem):
            return Plan(policy, "off", notes=[f"the model ({_gib(model_bytes)}) exceeds the free memory of all "
                                              f"nodes together: placement left to the kernel"])
        if replicate_supported and len(fits_each) == len(mem):
            return _replicate(topo, policy, ids, ["the model fits every node: a copy per node, each node's threads "
                                                  "read their own"])
        return Plan(policy, "interleave", ids, notes=["pages spread over all nodes: decode reads every node's "
                                                      "memory at once"])
    if policy == "interleave":
        return Plan(policy, "interleave", ids)
    # replicate
    if not replicate_supported:
        return Plan(policy, "interleave", ids,
                    notes=["per-node weight copies need the CPU backend (this backend has none): interleaving "
                           "instead"])
    if len(fits_each) < 2:
        return Plan(policy, "interleave", ids, notes=[f"the model ({_gib(model_bytes)}) fits the free memory of "
                                                      f"{len(fits_each)} node(s): interleaving instead"])
    notes = [] if len(fits_each) == len(mem) else [
        f"node(s) {','.join(str(i) for i in ids if i not in fits_each)} lack the memory for a copy: their threads "
        "read the nearest copy"]
    return _replicate(topo, policy, fits_each, notes)


# syscalls ---------------------------------------------------------------------------------------------------------
class NumaError(OSError):
    pass


def _numbers() -> tuple[int, int, int]:
    nums = _SYSCALLS.get(platform.machine())
    if nums is None or not hasattr(os, "sched_getaffinity"):
        raise NumaError(f"memory policies are not supported on {platform.system()} {platform.machine()}")
    return nums


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _mask(nodes) -> ctypes.Array:
    m = (ctypes.c_ulong * (_MASK_BITS // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        m[n // bits] |= 1 << (n % bits)
    return m


def _nodes(mask) -> tuple[int, ...]:
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    return tuple(i * bits + b for i, w in enumerate(mask) for b in range(bits) if w >> b & 1)


def _check(r: int, what: str) -> None:
    if r != 0:
        e = ctypes.get_errno()
        raise NumaError(e, f"{what}: {os.strerror(e)}")


def set_mempolicy(mode: int, nodes=()) -> None:
    """The calling thread's memory policy (threads it makes later inherit it)."""
    _, num, _ = _numbers()
    # the kernel reads maxnode - 1 bits (an off-by-one libnuma also passes)
    _check(_libc().syscall(ctypes.c_long(num), ctypes.c_int(mode), _mask(nodes) if nodes else None,
                           ctypes.c_ulong(_MASK_BITS + 1 if nodes else 0)), f"set_mempolicy({MODE_NAMES[mode]})")


def get_mempolicy(addr: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(mode, nodes) of the calling thread's policy, or of the page at `addr`."""
    _, _, num = _numbers()
    mode, mask = ctypes.c_int(-1), _mask(())
    _check(_libc().syscall(ctypes.c_long(num), ctypes.byref(mode), mask, ctypes.c_ulong(_MASK_BITS),
                           ctypes.c_void_p(addr or 0), ctypes.c_ulong(MPOL_F_ADDR if addr else 0)), "get_mempolicy")
    return mode.value, _nodes(mask)


def mbind(addr: int, length: int, mode: int, nodes=()) -> None:
    """The memory policy of the pages [addr, addr + length) (page-aligned): how a single buffer, such as one node's
    weight copy, is placed whatever the thread's policy."""
    num, _, _ = _numbers()
    _check(_libc().syscall(ctypes.c_long(num), ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(mode),
                           _mask(nodes) if nodes else None, ctypes.c_ulong(_MASK_BITS + 1 if nodes else 0),
                           ctypes.c_uint(0)), f"mbind({MODE_NAMES[mode]})")


def apply(p: Plan) -> list[str]:
    """Carry out a plan's process-wide part on the calling thread (call it before the model loads and before other
    threads start); what was done, in words. A replicate plan has none: the CPU backend makes and binds the copies
    and pins its pool's threads when the plan is passed to it (`Engine.load(..., numa=plan)`). A policy the kernel
    refuses (a container without the permission) raises NumaError."""
    done = []
    if p.mode == "interleave":
        set_mempolicy(MPOL_INTERLEAVE, p.mem_nodes)
        done.append(f"memory interleaved over node(s) {','.join(map(str, p.mem_nodes))}")
    elif p.mode == "bind":
        set_mempolicy(MPOL_BIND, p.mem_nodes)
        done.append(f"memory bound to node(s) {','.join(map(str, p.mem_nodes))}")
    elif p.mode == "replicate":
        done.append(f"weight copies for node(s) {','.join(map(str, p.replicas))} are made when the model loads")
    if p.cpus:
        os.sched_setaffinity(0, p.cpus)
        done.append(f"threads pinned to CPUs {cpu_ranges(p.cpus)}")
    if not done:
        done.append("placement left to the kernel")
    return done


def cpu_ranges(cpus) -> str:
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
