"""bench/cpu_decode_profile.py: where a decode step's time goes, call by call, from the native step's own clock
(hi_replay_run), on a tiny model (the numbers are the benchmark's, not asserted; that they add up is)."""

from __future__ import annotations

import os
import re
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _profile():
    sys.path.insert(0, BENCH)
    try:
        import cpu_decode_profile
    finally:
        sys.path.remove(BENCH)
    return cpu_decode_profile


def test_profile_table_accounts_for_the_step(oracle_gguf, capsys):
    path = str(oracle_gguf("qwen35moe", "q8_0"))
    _profile().main(["-m", path, "-t", "2", "-n", "3"])
    out = capsys.readouterr().out
    m = re.search(r"\(([\d.]+) ms/step; ([\d.]+) with each call clocked", out)
    assert m and float(m.group(2)) > 0
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in out.splitlines()
            if r.startswith("| ") and not r.startswith("| call")]
    names = [r[0] for r in rows]
    assert names[-1] == "outside the native calls"
    for want in ("gdn_layer", "attn_step", "moe_route", "moe_combine", "rms_norm"):
        assert want in names
    assert any(n.startswith("moe_gate_up Q8_0") for n in names) and any(n.startswith("moe_down") for n in names)
    # the products read every weight a step reads but the embedding row, the norms and the conv kernels
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.tools.benchmarks.decode import bytes_per_token, model_args

    gm = GGUFModel(path)
    args = model_args(gm)  # as the bench reads them
    emb = gm.tensors["token_embd.weight"]
    small = sum(t.nbytes for n, t in gm.tensors.items()  # the norms, gates' biases, conv kernels
                if n != "token_embd.weight" and (len([d for d in t.ne if d > 1]) < 2 or "ssm_conv1d" in n))
    want = bytes_per_token(gm, args) - small - (0 if args.tied_output else emb.nbytes // emb.ne[1])
    got = float(re.search(r"weights per token ([\d.e-]+) GB", out).group(1)) * 1e9
    assert abs(got - want) <= 0.001 * want, (got, want)
    assert abs(sum(float(r[3].rstrip("%")) for r in rows) - 100) < 1  # the calls and the rest make the step
    assert abs(sum(float(r[2]) for r in rows) - float(m.group(2))) < 0.01 + 0.01 * float(m.group(2))
    assert any(r[4] and float(r[4]) > 0 for r in rows) and float(rows[0][2]) > 0  # sorted: the costliest first
    for r in rows[:-1]:
        assert int(r[1]) >= 1 and float(r[2]) >= 0
        if r[4] and float(r[4]) > 0:  # a weight product: its bytes and rate agree with its time, as printed
            gb, ms, rate = float(r[4]), float(r[2]), float(r[5])
            assert abs(gb / (ms * 1e-3) - rate) <= rate * (0.00005 / gb + 0.0005 / ms) + 0.05


def test_profile_pool_table(oracle_gguf, capsys):
    _profile().main(["-m", str(oracle_gguf("qwen35moe", "q8_0")), "-t", "2", "-n", "3", "--pool"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| small") or r.startswith("| big")]
    assert rows and all(float(r.split("|")[4]) > 0 for r in rows)  # wall us per task


def test_profile_of_verify_and_batched_steps(oracle_gguf, capsys):
    """--rows 3: verify steps of one sequence, rolled back (the GDN layers' calls again outside the replay); --batch
    2: batched decode steps (the many-row GDN and attention calls)."""
    path = str(oracle_gguf("qwen35moe", "q8_0"))
    for flag, calls in ((["--rows", "3"], ("gdn_layer", "attn_step")), (["--batch", "2"], ("gdn_rows", "attn_rows"))):
        _profile().main(["-m", path, "-t", "2", "-n", "3", *flag])
        out = capsys.readouterr().out
        m = re.search(r"(\d) row\(s\) of (\d) sequence\(s\) a step: .*\(([\d.]+) ms/step", out)
        want = ("3", "1") if flag[0] == "--rows" else ("1", "2")
        assert m and (m.group(1), m.group(2)) == want and float(m.group(3)) > 0
        names = [r.strip("|").split("|")[0].strip() for r in out.splitlines() if r.startswith("| ")]
        assert all(c in names for c in calls), names
