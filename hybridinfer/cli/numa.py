"""`--numa`: the NUMA placement of the engine commands (run, chat, logits, serve, batch) and the topology that `info`
and `batch --numa-plan` show (hybridinfer.backends.numa has the plan and the syscalls)."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ParameterError


def numa_policy(s: str) -> str:
    """An argparse type: off | interleave | bind:N | replicate | auto."""
    if s in ("off", "interleave", "replicate", "auto") or (s.startswith("bind:") and s[5:].isdigit()):
        return s
    raise argparse.ArgumentTypeError(f"must be off, interleave, bind:N, replicate or auto, got {s!r}")


def add_numa_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numa", default="off", type=numa_policy,
                   help="off | interleave | bind:N | replicate | auto: where the weights and threads go (replicate: a "
                        "weight copy per node, each read by threads pinned to that node; default off)")


def _model_bytes(model: str | None) -> int:
    if model is None:
        from ..format.default_model import default_model_path

        model = default_model_path()
    try:
        return os.path.getsize(model)
    except OSError:
        return 0  # the engine's load names the missing file


def numa_plan(a):
    """The plan of --numa for this machine's topology and the model's bytes (replicate needs a CPU-decode backend)."""
    from ..backends import numa

    try:
        return numa.plan(numa.read_topology(), _model_bytes(a.model), a.numa,
                         replicate_supported=a.backend != "reference")
    except ValueError as e:
        raise ParameterError(f"--numa: {e}") from None


def apply_numa(a, say) -> object | None:
    """Carry out the process-wide part of --numa before the model loads (what its weight copy and pool threads
    inherit), saying what was done through `say`; returns the plan for Engine.load(numa=...) (its replicate part
    is the backend's), or None where there is nothing for it to do."""
    from ..backends import numa

    if a.numa == "off":
        return None
    p = numa_plan(a)
    try:
        for line in numa.apply(p):
            say(line)
    except numa.NumaError as e:  # a container without the permission: say so and go on with the default
        print(f"hybridinfer: note: --numa {a.numa}: {e}; the kernel's default placement is used", file=sys.stderr)
        return None
    return p if p.mode == "replicate" else None


def print_topology(model_bytes: int, policies=None, out=print) -> None:
    """This machine's nodes (CPUs, memory) and the placement each policy would give `model_bytes` of weights."""
    from ..backends import numa

    topo = numa.read_topology()
    out(f"numa:          {len(topo.nodes)} node(s)")
    for n in topo.nodes:
        mem = (f"memory {n.mem_total / 2**30:.1f} GiB ({n.mem_free / 2**30:.1f} GiB free)" if n.mem_total
               else "no memory")
        out(f"  node {n.id}: CPUs {numa.cpu_ranges(n.cpus) or 'none'}, {mem}")
    if policies is None:
        policies = ["off", "interleave"] + [f"bind:{n.id}" for n in topo.mem_nodes] + ["replicate", "auto"]
    for pol in policies:
        try:
            desc = numa.plan(topo, model_bytes, pol, replicate_supported=True).describe()
        except ValueError as e:
            desc = f"numa: policy {pol}: {e}"
        for line in desc.splitlines():
            out(f"  {line}")
