"""The MTP block after a single-pass (GPU) prefill: the pass hands every prompt row's final-norm output down to the
CPU's kept rows (GPUModel.hidden_to), and the drafter runs the block's rows of the prompt on the CPU, so drafting
starts with the prompt's rows as after a CPU prefill. The CPU side runs here with a stand-in device that computes as
the CPU does (the same bits); the gpu-marked test holds the card's hand-off to the CPU prefill within tolerance."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_mtp_snapshots import SHAPE, mtp_model, record_drafts

from hybridinfer.engine import spec as sp
from hybridinfer.engine.api import Engine
from hybridinfer.engine.spec_mtp import MTPDrafter

ISA = os.environ.get("HYBRIDINFER_ISA")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return mtp_model(tmp_path_factory.mktemp("mtpgpu"), seed=5)


class _Device:
    """A single-pass prefill device made of a CPU backend that keeps no rows itself (GPUPrefillCPUDecode's `gpu`):
    like the card, it hands each pass's final-norm rows to hidden_to when that is set."""

    hidden_to = None

    def __init__(self, cpu):
        self.cpu, self.handed = cpu, []

    def forward(self, tokens, state, all_logits=True, snapshot_at=(), on_snapshot=None):
        p0, keep = state.pos, self.cpu.keep_hidden
        self.cpu.keep_hidden = False
        try:
            rows = self.cpu.hidden(tokens, state.copy())  # what the card's pass computes before its head
            out = self.cpu.forward(tokens, state, all_logits=all_logits)
        finally:
            self.cpu.keep_hidden = keep
        if self.hidden_to is not None:
            self.hidden_to(state, p0, rows)
            self.handed.append((p0, len(rows)))
        return out


def _run(eng, prompt):
    g, log, seen = record_drafts(eng, prompt, 10)
    return g.tokens, log, g.timings["draft_n_accepted"], seen[0]


@pytest.mark.isa
@pytest.mark.parametrize("hand_off", [True, False])
def test_drafts_after_a_single_pass_prefill_equal_a_cpu_prefills(path, hand_off):
    """Through GPUPrefillCPUDecode over the stand-in device: the block's rows of the prompt are there at the first
    step (from position 0, the same bits as after a CPU prefill) and every step drafts as after a CPU prefill. Without
    the hand-off the rows start at the first decode step (what the hand-off is for)."""
    from hybridinfer.backends import GPUPrefillCPUDecode

    prompt = [int(x) for x in np.random.default_rng(2).integers(3, 512, 21)]
    with Engine.load(path, backend="cpu", n_ctx=96, isa=ISA, n_threads=2) as cpu:
        cpu.spec = sp.Speculator(cpu.spec.drafter, 3, adaptive=False)
        want = _run(cpu, prompt)
    with Engine.load(path, backend="cpu", n_ctx=96, isa=ISA, n_threads=2) as eng:
        dev = _Device(eng.backend)
        eng.backend = GPUPrefillCPUDecode(dev, eng.backend)
        eng.spec = sp.Speculator(MTPDrafter(eng.backend), 3, adaptive=False)
        if not hand_off:
            dev.hidden_to = None
        got = _run(eng, prompt)
    assert got[0] == want[0]  # tokens: drafts change none
    assert want[3][:2] == (0, len(prompt))
    if hand_off:
        assert dev.handed == [(0, len(prompt))]
        assert got[1] == want[1] and got[2] == want[2]
        assert got[3][:2] == want[3][:2] and np.array_equal(got[3][2], want[3][2])
    else:
        assert dev.handed == [] and got[3][0] != 0  # no rows of the prompt (none yet, or from a later position)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_gpu_prefill_gives_the_block_the_prompts_rows(tmp_path, arch):
    """backend="gpu": after a GPU prefill the block's K rows of the prompt and its first draft's logits equal those
    after a CPU prefill, within the GPU prefill's tolerance (test_gpu_prefill), the first draft the same token where
    the CPU's top two are apart by more than the tolerance."""
    from gpu_profile import PROFILE

    from hybridinfer.tools.synth import synth_model

    shape = dict(SHAPE) if arch == "qwen35" else dict(SHAPE, n_ff=None, n_expert=4, n_expert_used=2, n_ff_exp=256,
                                                        n_ff_shexp=256)
    shape = {k: v for k, v in shape.items() if v is not None}
    p = str(tmp_path / f"{arch}.gguf")
    # F32 weights: the CPU's products take float activations (no Q8 rounding), so a GPU prefill's rows agree with a
    # CPU prefill's to float order (q8_0 models differed by 3-13% in the block's K rows on an H200, 2026-11-28)
    synth_model(p, arch, shape, "f32", seed=5, mtp=True)
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 512, 40)]
    out = {}
    for be, kw in (("cpu", dict(isa=ISA, n_threads=2)), ("gpu", dict(card_profile=PROFILE))):
        with Engine.load(p, backend=be, n_ctx=96, **kw) as eng:
            d = eng.spec.drafter
            st = eng.new_state()
            lg = eng.prefill(prompt, st)
            d.prefilled(st)
            m = d.seqs[id(st)]
            f, rows = eng.backend.hidden_rows(st)
            nxt = int(np.argmax(lg[-1]))
            m.ms.pos = m.true
            first, _ = eng.backend.mtp(rows[st.pos - 1 - f][None], [nxt], m.ms)
            out[be] = (m.base, m.true, np.array(m.ms.k[0][: m.true], copy=True), first[0], nxt)
    (b0, n0, k0, lg0, t0), (b1, n1, k1, lg1, t1) = out["cpu"], out["gpu"]
    assert (b1, n1, t1) == (b0, n0, t0) == (0, len(prompt) - 1, t0)
    assert float(np.abs(k1 - k0).max()) <= 2e-3 * float(np.abs(k0).max())
    tol = 2e-3 * float(np.abs(lg0).max())
    assert float(np.abs(lg1 - lg0).max()) <= tol
    top2 = np.sort(lg0)[-2:]
    if top2[1] - top2[0] > 2 * tol:
        assert int(np.argmax(lg1)) == int(np.argmax(lg0))
