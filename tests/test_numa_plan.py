"""NUMA placement: topology from fake sysfs trees, the pure plan on 1, 2, 3 and 4 nodes (unequal memory, a node
without memory, replicate and auto with and without per-node copies), and the memory-policy syscalls on this machine
(read back with get_mempolicy, in a child process so the test process keeps its own policy). The copies themselves:
test_numa_replicas.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hybridinfer.backends import numa
from hybridinfer.errors import ParameterError

GiB = 1 << 30


def fake_sysfs(root, nodes: dict[int, tuple[str, int, int]], distance: dict[int, str] | None = None) -> str:
    """nodes: id -> (cpulist, MemTotal GiB, MemFree GiB), written as the kernel writes them; distance: id -> the
    node's distance line."""
    d = root / "node"
    d.mkdir()
    (d / "online").write_text(",".join(map(str, nodes)) + "\n")
    (d / "possible").write_text("0-63\n")
    for i, (cpus, total, free) in nodes.items():
        n = d / f"node{i}"
        n.mkdir()
        (n / "cpulist").write_text(cpus + "\n")
        kb = lambda g: int(g * GiB) // 1024  # noqa: E731
        (n / "meminfo").write_text(f"Node {i} MemTotal:       {kb(total)} kB\nNode {i} MemFree:        {kb(free)} kB\n"
                                   f"Node {i} MemUsed:        {kb(total - free)} kB\nNode {i} HugePages_Total:     0\n")
        if distance:
            (n / "distance").write_text(distance[i] + "\n")
    return str(d)


def test_read_topology(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-3,8-11", 64, 60), 1: ("4-7,12-15", 64, 30), 2: ("", 0, 0)})
    t = numa.read_topology(root)
    assert [n.id for n in t.nodes] == [0, 1, 2]
    assert t.nodes[0].cpus == (0, 1, 2, 3, 8, 9, 10, 11) and t.nodes[1].mem_free == 30 * GiB
    assert [n.id for n in t.mem_nodes] == [0, 1] and t.nodes[2].cpus == ()
    assert numa.parse_cpulist("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    assert t.nodes[0].distance == ()  # no distance files: unknown
    (tmp_path / "d").mkdir()
    d = numa.read_topology(fake_sysfs(tmp_path / "d", {0: ("0-1", 8, 6), 1: ("2-3", 8, 6)}, {0: "10 21", 1: "21 10"}))
    assert d.nodes[1].distance == (21, 10)
    one = numa.read_topology(str(tmp_path / "missing"))  # no sysfs: one node of this process's CPUs
    assert len(one.nodes) == 1 and one.nodes[0].cpus
    here = numa.read_topology()
    assert here.nodes and all(n.cpus or n.mem_total == 0 for n in here.nodes)


def _topo(*nodes) -> numa.Topology:
    return numa.Topology(tuple(numa.Node(i, tuple(range(4 * i, 4 * i + 4)) if cpus else (), int(tot * GiB),
                                         int(free * GiB)) for i, (cpus, tot, free) in enumerate(nodes)))


ONE = _topo((1, 16, 12))
TWO = _topo((1, 64, 60), (1, 64, 60))
UNEQUAL = _topo((1, 128, 100), (1, 32, 10))
FOUR = _topo((1, 64, 50), (1, 64, 50), (1, 64, 50), (1, 64, 50))
CPU_ONLY = _topo((1, 64, 60), (1, 0, 0), (1, 64, 60))  # node 1 has CPUs and no memory


@pytest.mark.parametrize("supported", [False, True])
@pytest.mark.parametrize("policy", ["off", "interleave", "bind:0", "replicate", "auto"])
def test_every_policy_plans_on_one_node(policy, supported):
    p = numa.plan(ONE, 5 * GiB, policy, replicate_supported=supported)
    assert p.mode in ("off", "interleave", "bind", "replicate")
    assert p.describe().startswith(f"numa: policy {policy}")
    if policy == "bind:0":
        assert p.mem_nodes == (0,) and p.cpus == (0, 1, 2, 3)
    if policy == "auto" or (policy == "replicate" and not supported):
        assert p.mode == "off" and "one node" in p.notes[0]
    if policy == "replicate" and supported:  # one node still gets its one bound copy, read by all its CPUs
        assert p.mode == "replicate" and p.replicas == (0,) and p.replica_cpus == ((0, 1, 2, 3),)
        assert "copy 0 on node 0: read by threads on CPUs 0-3" in p.describe()


def test_replicate_on_one_node_that_cannot_hold_a_copy():
    p = numa.plan(ONE, 20 * GiB, "replicate", replicate_supported=True)  # 12 GiB free
    assert p.mode == "off" and "exceeds node 0's free memory" in p.notes[0]


def test_plans_on_several_nodes():
    assert numa.plan(TWO, 20 * GiB, "interleave").mem_nodes == (0, 1)
    assert numa.plan(FOUR, 20 * GiB, "interleave").mem_nodes == (0, 1, 2, 3)
    auto = numa.plan(TWO, 20 * GiB, "auto")
    assert auto.mode == "interleave" and auto.mem_nodes == (0, 1)
    # replicate: a backend without per-node copies interleaves and says so; with support, a copy per node, each
    # read by its own node's CPUs
    r = numa.plan(FOUR, 20 * GiB, "replicate")
    assert r.mode == "interleave" and "CPU backend" in r.notes[0]
    r = numa.plan(FOUR, 20 * GiB, "replicate", replicate_supported=True)
    assert r.mode == "replicate" and r.replicas == (0, 1, 2, 3) and not r.notes
    assert r.replica_cpus == tuple(tuple(range(4 * i, 4 * i + 4)) for i in range(4))
    assert r.cpus is None and not r.mem_nodes  # no process-wide policy or pinning: per copy, per thread
    a = numa.plan(TWO, 20 * GiB, "auto", replicate_supported=True)
    assert a.mode == "replicate" and a.replicas == (0, 1) and a.replica_cpus == ((0, 1, 2, 3), (4, 5, 6, 7))
    # auto on four nodes: 60 GiB fits no node (50 GiB free each) but all together: interleave
    assert numa.plan(FOUR, 60 * GiB, "auto", replicate_supported=True).mode == "interleave"
    r = numa.plan(FOUR, 60 * GiB, "replicate", replicate_supported=True)
    assert r.mode == "interleave" and "fits the free memory of 0 node" in r.notes[0]
    # unequal memory: a 40 GiB model fits node 0 only -> no replicas; auto interleaves (fits both together)
    r = numa.plan(UNEQUAL, 40 * GiB, "replicate", replicate_supported=True)
    assert r.mode == "interleave" and "fits the free memory of 1 node" in r.notes[0]
    assert numa.plan(UNEQUAL, 40 * GiB, "auto", replicate_supported=True).mode == "interleave"
    b = numa.plan(UNEQUAL, 40 * GiB, "bind:1")
    assert b.mode == "bind" and b.cpus == (4, 5, 6, 7) and "may not fit" in b.notes[0]
    assert not numa.plan(UNEQUAL, 40 * GiB, "bind:0").notes
    # more than all free memory: auto leaves placement to the kernel
    assert numa.plan(UNEQUAL, 200 * GiB, "auto").mode == "off"


def test_replicas_on_some_nodes_serve_the_others_by_distance():
    # three nodes with memory, node 2 too small for a copy: its CPUs read the nearest copy (node 1 by distance)
    topo = numa.Topology((numa.Node(0, (0, 1), 64 * GiB, 60 * GiB, (10, 21, 31)),
                          numa.Node(1, (2, 3), 64 * GiB, 60 * GiB, (21, 10, 21)),
                          numa.Node(2, (4, 5), 64 * GiB, 5 * GiB, (31, 21, 10))))
    r = numa.plan(topo, 20 * GiB, "replicate", replicate_supported=True)
    assert r.replicas == (0, 1) and r.replica_cpus == ((0, 1), (2, 3, 4, 5))
    assert "node(s) 2 lack the memory for a copy" in r.notes[0]
    # auto wants a copy on every node: with node 2 too small it interleaves
    assert numa.plan(topo, 20 * GiB, "auto", replicate_supported=True).mode == "interleave"
    # without distances the first copy takes them; a CPU-only node's CPUs are read by a copy too
    r = numa.plan(CPU_ONLY, 10 * GiB, "replicate", replicate_supported=True)
    assert r.replicas == (0, 2) and r.replica_cpus == ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11))
    assert numa.plan(CPU_ONLY, 10 * GiB, "auto", replicate_supported=True).mode == "replicate"


def test_node_without_memory():
    p = numa.plan(CPU_ONLY, 10 * GiB, "interleave")
    assert p.mem_nodes == (0, 2)  # node 1 has no pages to give
    assert numa.plan(CPU_ONLY, 10 * GiB, "auto").mem_nodes == (0, 2)
    with pytest.raises(ParameterError, match="no memory"):
        numa.plan(CPU_ONLY, 10 * GiB, "bind:1")
    with pytest.raises(ValueError, match="no node 9"):
        numa.plan(CPU_ONLY, 10 * GiB, "bind:9")
    with pytest.raises(ValueError, match="unknown numa policy"):
        numa.plan(CPU_ONLY, 10 * GiB, "spread")
    two_mem_one_cpu = numa.Topology((numa.Node(0, (0, 1), 8 * GiB, 6 * GiB), numa.Node(1, (), 8 * GiB, 6 * GiB)))
    p = numa.plan(two_mem_one_cpu, GiB, "bind:1")
    assert p.cpus is None and "no CPUs" in p.notes[0]


_CHILD = textwrap.dedent("""
    import mmap, ctypes, json, os, sys
    from hybridinfer.backends import numa
    node = numa.read_topology().mem_nodes[0].id
    out = {}
    out["before"] = numa.get_mempolicy()[0]
    done = numa.apply(numa.plan(numa.read_topology(), 1 << 20, sys.argv[1], replicate_supported=True))
    out["done"] = done
    out["after"] = numa.get_mempolicy()
    out["affinity"] = sorted(os.sched_getaffinity(0))
    buf = mmap.mmap(-1, 1 << 16)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    numa.mbind(addr, 1 << 16, numa.MPOL_BIND, (node,))
    buf[0] = 1  # the page exists: its policy is the buffer's
    out["buffer"] = numa.get_mempolicy(addr)
    print(json.dumps(out))
""")


def _child(policy: str) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", _CHILD, policy], capture_output=True, text=True)
    if r.returncode and ("Operation not permitted" in r.stderr or "not supported" in r.stderr):
        pytest.skip(f"memory policies refused here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory policies")
def test_syscalls_on_this_machine():
    node = numa.read_topology().mem_nodes[0].id
    got = _child("interleave")
    assert got["before"] == numa.MPOL_DEFAULT
    assert got["after"] == [numa.MPOL_INTERLEAVE, [n.id for n in numa.read_topology().mem_nodes]]
    assert got["buffer"] == [numa.MPOL_BIND, [node]]  # mbind: the buffer's own policy, queried by address
    got = _child(f"bind:{node}")
    assert got["after"] == [numa.MPOL_BIND, [node]]
    assert set(got["affinity"]) <= set(numa.read_topology().node(node).cpus)
    for policy in ("off", "replicate", "auto"):  # one node: these run and leave the process's default policy
        got = _child(policy)
        assert got["after"][0] in (numa.MPOL_DEFAULT, numa.MPOL_INTERLEAVE) and got["done"]
    assert "made when the model loads" in _child("replicate")["done"][0]


def test_cli_numa_plan(capsys):
    from hybridinfer.cli import main

    assert main(["batch", "--numa", "auto", "--numa-plan"]) == 0
    out = capsys.readouterr().out
    assert "numa: policy auto" in out and "node 0" in out
    assert main(["batch", "--numa", "bind:99", "--numa-plan"]) == 2
    assert "no node 99" in capsys.readouterr().err
    assert main(["batch", "--numa", "nonsense", "--numa-plan"]) == 2
    assert main(["batch", "--numa", "replicate", "--numa-plan"]) == 0
    out = capsys.readouterr().out
    assert "policy replicate -> replicate" in out and "copy 0 on node" in out and "off ->" not in out


def test_topology_of_this_machine_matches_sysfs():
    if not os.path.isdir("/sys/devices/system/node"):
        pytest.skip("no sysfs NUMA tree")
    t = numa.read_topology()
    assert sum(len(n.cpus) for n in t.nodes) >= 1 and t.mem_nodes
