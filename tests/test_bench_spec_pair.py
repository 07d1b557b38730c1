"""bench/spec_batch_pair.py: generate_batch with the file's MTP drafts on and off, on two engines run in turn, on a
tiny synthetic model with the MTP block (the rates are the benchmark's, not asserted; the table's shape is)."""

from __future__ import annotations

import os
import re
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_pair_table_has_both_engines_every_round(tmp_path, capsys):
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "m.gguf")
    shape = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, ssm_d_state=64,
                 ssm_n_group=2, ssm_dt_rank=4)
    synth_model(path, "qwen35", shape, "q8_0", seed=3, mtp=True)
    sys.path.insert(0, BENCH)
    try:
        import spec_batch_pair
    finally:
        sys.path.remove(BENCH)
    spec_batch_pair.main(["-m", path, "-t", "2", "--batch-sizes", "1,2", "-n", "6", "--rounds", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (drafts off|default) \| (\d+) \| ([\d., ]+) \| ([\d.]+) \|$", out, re.M)
    assert sorted((e, int(b)) for e, b, _, _ in rows) == [("default", 1), ("default", 2), ("drafts off", 1),
                                                          ("drafts off", 2)]
    for _, _, each, med in rows:
        runs = [float(x) for x in each.split(", ")]
        assert len(runs) == 2 and min(runs) <= float(med) <= max(runs) and min(runs) > 0
    assert re.search(r"^default: mtp drafted \d+, accepted \d+$", out, re.M)  # the file's own drafter, by default
