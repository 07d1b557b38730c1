"""Per-node weight copies (numa replicate): the native replica table (a chunk reads its thread's copy), the pure
span and thread assignment helpers, copies bound to their node (read back with get_mempolicy), and an engine whose
two pool threads read two copies on this machine's node 0 giving the same logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import numa
from hybridinfer.backends.cpu.replicas import assign_threads, node_buffer, replicate, weight_spans
from hybridinfer.backends.cpu.simd import SimdLib
from hybridinfer.backends.cpu.simd_replicas import MAX_REPLICAS, MAX_SPANS
from hybridinfer.engine.api import Engine
from hybridinfer.errors import ParameterError

NODE = numa.read_topology().mem_nodes[0].id if numa.read_topology().mem_nodes else 0
TWO_ON_ONE = numa.Plan("replicate", "replicate", replicas=(NODE, NODE), replica_cpus=((0,), (1,)))


def _f32_product(simd, w, x):
    xq = simd.quantize(x, 0)
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    simd.matmul(w.view(np.uint8).reshape(-1), 0, w.shape[0], w.shape[1], xq, out)
    return out


def test_a_chunk_reads_its_threads_copy():
    """One thread (the caller): copy 1 holds 2 W, so its product is exactly twice the original's."""
    s = SimdLib(n_threads=1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    base = _f32_product(s, w, x)
    wb = w.view(np.uint8).reshape(-1)
    s.set_replicas([(wb, [wb.copy(), (2 * w).view(np.uint8).reshape(-1).copy()])])
    assert s.thread_replica(0) == -1 and np.array_equal(_f32_product(s, w, x), base)  # not placed: the original
    s.place_thread(0, 1)
    assert s.thread_replica(0) == 1 and np.array_equal(_f32_product(s, w, x), 2 * base)
    hits = s.replica_hits(reset=True)
    assert hits.shape == (1, MAX_REPLICAS) and hits[0, 1] > 0 and hits[0, 0] == 0
    s.place_thread(0, 0)
    assert np.array_equal(_f32_product(s, w, x), base)
    assert s.replica_hits()[0, 0] > 0 and s.replica_hits()[0, 1] == 0
    # a matrix outside every span (a copy of w elsewhere) is read where it is
    other = w.copy()
    s.place_thread(0, 1)
    assert np.array_equal(_f32_product(s, other, x), base)
    s.set_replicas([])  # cleared: the original again
    assert np.array_equal(_f32_product(s, w, x), base)


def test_replica_arguments_are_checked():
    s = SimdLib(n_threads=2)
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="copy 0 holds 100 bytes"):
        s.set_replicas([(a, [np.zeros(100, np.uint8)])])
    with pytest.raises(TypeError, match="spans\\[0\\] weights must be a contiguous 1-D uint8"):
        s.set_replicas([(a.view(np.float32), [b])])
    with pytest.raises(ValueError, match="overlap"):
        s.set_replicas([(a[:2048], [b[:2048]]), (a[1024:3072], [b[:2048]])])
    with pytest.raises(ValueError, match="same count"):
        s.set_replicas([(a[:2048], [b[:2048]]), (a[2048:], [b[2048:], b[2048:]])])
    with pytest.raises(ValueError, match=f"at most {MAX_SPANS}"):
        s.set_replicas([(a[i : i + 1], [b[i : i + 1]]) for i in range(MAX_SPANS + 1)])
    with pytest.raises(ValueError, match="tid must be in \\[0, 2\\), got 2"):
        s.place_thread(2, 0)
    with pytest.raises(ValueError, match="replica must be in"):
        s.place_thread(1, MAX_REPLICAS)
    with pytest.raises(ValueError, match="tid 0 is the calling thread"):
        s.place_thread(0, 0, cpus=[0])
    with pytest.raises(ValueError, match="cpus must be CPU numbers"):
        s.place_thread(1, 0, cpus=[-1])
    with pytest.raises(OSError, match="refused to pin pool thread 1 to CPUs \\[4000\\]"):
        s.place_thread(1, 0, cpus=[4000])  # no such CPU
    s.place_thread(1, 1, cpus=[0])
    assert s.thread_replica(1) == 1


def test_weight_spans():
    MiB = 1 << 20
    # touching, overlapping and near extents of one mapping merge; another mapping stays apart
    got = weight_spans([("a", 0, 100), ("a", 100, 200), ("a", 150, 300), ("a", 300 + MiB, 400 + MiB), ("b", 5, 9)])
    assert got == [("a", 0, 400 + MiB), ("b", 5, 9)]
    # far apart (an untied embedding between): separate, until the table is full, then the nearest merge first
    far = [("a", i * 100 * MiB, i * 100 * MiB + 10) for i in range(4)]
    assert len(weight_spans(far)) == 4
    got = weight_spans(far[:2] + [("a", 150 * MiB, 150 * MiB + 10)], max_spans=2)
    assert got == [("a", 0, 10), ("a", 100 * MiB, 150 * MiB + 10)]
    with pytest.raises(ValueError, match="3 separate mappings"):
        weight_spans([("a", 0, 1), ("b", 0, 1), ("c", 0, 1)], max_spans=2)


def test_assign_threads():
    assert assign_threads(4, [1, 1]) == [0, 1, 0, 1]
    assert assign_threads(2, [2, 2]) == [0, 1]  # threads 0 and 1 on different copies
    got = assign_threads(12, [8, 4])
    assert got.count(0) == 8 and got.count(1) == 4 and got[:2] == [0, 1]
    assert assign_threads(3, [5]) == [0, 0, 0]
    with pytest.raises(ValueError, match="positive shares"):
        assign_threads(2, [0, 1])


def test_node_buffer_is_bound_to_its_node():
    buf, how = node_buffer((4 << 20) + 123, NODE)
    buf[:] = 1  # first touch, after the policy
    if how.startswith("not bound"):
        pytest.skip(f"mbind refused here: {how}")
    assert how == f"bound to node {NODE}" and buf.nbytes == (4 << 20) + 123 and buf.ctypes.data % (2 << 20) == 0
    for off in (0, buf.nbytes - 1):
        assert numa.get_mempolicy(buf.ctypes.data + off) == (numa.MPOL_BIND, (NODE,))


def _run(eng, ids):
    st = eng.new_state()
    pre = eng.backend.forward(ids[:8], st).copy()
    dec = np.stack([eng.backend.forward([t], st, all_logits=False)[0].copy() for t in ids[8:]])
    return pre, dec


IDS = [1, 504, 3458, 314, 2106, 282, 4215, 30, 216, 1, 22, 33]


def test_two_copies_on_one_node_give_the_same_logits(smollm_path):
    """Threads 0 and 1 read two different copies (both on this machine's node): the same bits as no copies, and
    each thread's chunks came from its own copy only."""
    plain = _run(Engine.load(smollm_path, backend="cpu", n_ctx=64, n_threads=2, weights="mmap"), IDS)
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=64, n_threads=2, numa=TWO_ON_ONE)
    cpu = eng.backend
    reps = cpu.replicas
    assert cpu.weights == "mmap"  # auto with copies: the file mapping, the copies are where decode reads
    assert reps.thread_replica == [0, 1] and len(reps.spans) == 1 and reps.nbytes >= sum(m.raw.nbytes for m in cpu.mats)
    cpu.simd.replica_hits(reset=True)
    got = _run(eng, IDS)
    assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1])
    hits = cpu.simd.replica_hits()
    assert hits[0, 0] > 0 and hits[1, 1] > 0  # the caller read copy 0, the worker copy 1 ...
    assert hits[0, 1:].sum() == 0 and hits[1, 0] == 0 and hits[1, 2:].sum() == 0  # ... and nothing else
    assert reps.hits(cpu.simd) == [int(hits[0, 0]), int(hits[1, 1])]
    text = "\n".join(reps.describe())
    assert "2 weight copy(ies)" in text and "read by pool thread(s) 1 (workers pinned to CPUs 1)" in text
    for k in range(2):
        if not reps.placed[k].startswith("not bound"):
            assert reps.policy_of(k) == f"bind node(s) {NODE}"
            assert numa.get_mempolicy(reps.copies[k][0].ctypes.data) == (numa.MPOL_BIND, (NODE,))


@pytest.mark.parametrize("weights", ["mmap", "copy"])
def test_moe_products_read_the_copies(oracle_gguf, weights):
    """A MoE model (expert products, the grouped prefill path, the head), weights mapped or copied: same logits."""
    path = str(oracle_gguf("qwen35moe", "q4_k_m"))
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 200, 12)]
    plain = _run(Engine.load(path, backend="cpu", n_ctx=64, n_threads=2, weights=weights), ids)
    eng = Engine.load(path, backend="cpu", n_ctx=64, n_threads=2, weights=weights, numa=TWO_ON_ONE)
    assert eng.backend.weights == weights and eng.backend.replicas is not None
    eng.backend.simd.replica_hits(reset=True)
    got = _run(eng, ids)
    assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1])
    assert sum(eng.backend.replicas.hits(eng.backend.simd)) > 0


def test_engine_numa_option_is_checked(smollm_path):
    with pytest.raises(ParameterError, match="numa must be a hybridinfer.backends.numa.Plan"):
        Engine.load(smollm_path, backend="cpu", n_ctx=64, numa="replicate")
    with pytest.raises(ParameterError, match="reference backend has no per-node weight copies"):
        Engine.load(smollm_path, backend="reference", n_ctx=64, numa=TWO_ON_ONE)
    with pytest.raises(ValueError, match="nodes must be 1 to 16"):
        replicate(SimdLib(n_threads=1), [np.zeros(64, np.uint8)], [])


def test_cli_run_replicate_reports_what_it_did(smollm_path, capsys):
    from hybridinfer.cli import main

    assert main(["run", "-m", smollm_path, "--backend", "cpu", "-t", "2", "--numa", "replicate", "--raw",
                 "-p", "The capital of France is", "-n", "2"]) == 0
    err = capsys.readouterr().err
    assert "numa: 1 weight copy(ies)" in err and f"copy 0 on node {NODE}:" in err
    assert "read by pool thread(s) 0,1" in err


def test_cli_info_shows_topology_and_plans(smollm_path, capsys):
    from hybridinfer.cli import main

    assert main(["info", smollm_path]) == 0
    out = capsys.readouterr().out
    assert f"node {NODE}: CPUs " in out and "GiB free" in out
    for policy in ("off", "interleave", f"bind:{NODE}", "replicate", "auto"):
        assert f"numa: policy {policy} ->" in out
    assert main(["info", "-m", smollm_path, "other.gguf"]) == 2
