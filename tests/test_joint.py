"""The fused joint + RNN-T loss: the reference (the joiner, then rnnt_loss) is the composition a user writes; the
delay penalty equals path enumeration with the penalty per emitted label."""
import itertools, math, random, pytest, torch
from seqdist.joint import joint_logits, delay_offsets
from seqdist.rnnt import logz_brute_force

def test_joint_logits_is_the_joiner():
    "torchaudio's joiner (and any act + nn.Linear(H, V)) computes the same logits."
    from seqdist.timing import load_torchaudio
    torch.manual_seed(0)
    e, p = torch.randn(2, 5, 4), torch.randn(2, 3, 4)
    lin = torch.nn.Linear(4, 7)
    for act, f in (('relu', torch.relu), ('tanh', torch.tanh), ('identity', lambda x: x)):
        torch.testing.assert_close(joint_logits(e, p, lin.weight, lin.bias, act), lin(f(e[:, :, None] + p[:, None])))
    ta = load_torchaudio()
    if ta is None: pytest.skip("torchaudio not importable")
    from torchaudio.models.rnnt import _Joiner
    j = _Joiner(4, 7, activation='tanh')
    out, _, _ = j(e, torch.tensor([5, 5]), p, torch.tensor([3, 3]))
    torch.testing.assert_close(joint_logits(e, p, j.linear.weight, j.linear.bias, 'tanh'), out)

def test_delay_offsets_are_k2s():
    il = torch.tensor([5, 2])
    want = torch.tensor([[0.2 * ((T - 1) / 2 - t) for t in range(5)] for T in (5, 2)], dtype=torch.float64)
    torch.testing.assert_close(delay_offsets(il, 5, 0.2), want)
