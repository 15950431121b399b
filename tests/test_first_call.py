"""A family's first call compiles the numba kernels it needs, each once: one fp32 fwd+bwd in a fresh process asks numba
for exactly the specialisations pinned here (a kernel asked for twice, say once for a contiguous and once for a strided
argument, or one the call does not run, fails). Counted where Python calls into numba (`Dispatcher._compile_for_args`,
which runs on a process's first call of each type signature, whether the machine code then comes from numba's cache or
from the compiler), so the test is as fast with a warm cache and means the same with a cold one."""
import json, subprocess, sys
import pytest

RECORDER = r'''
import sys, json, collections
import numba.core.dispatcher as D
seen = collections.Counter()
_first_call = D.Dispatcher._compile_for_args
def _record(self, *args, **kws):
    f = self.py_func
    if f.__module__.startswith('seqdist'): seen[f"{f.__module__.split('.')[-1]}.{f.__qualname__}"] += 1
    return _first_call(self, *args, **kws)
D.Dispatcher._compile_for_args = _record
import torch
family = sys.argv[1]
g = torch.Generator().manual_seed(0)
g = torch.Generator().manual_seed(0)
if family == 'ctc':
    from seqdist.ctc import ctc_loss
    lp = torch.randn(30, 3, 6, generator=g).log_softmax(2).requires_grad_()
    ctc_loss(lp, torch.randint(1, 6, (3, 5), generator=g), torch.full((3,), 30), torch.full((3,), 5)).backward()
elif family == 'forced_align':
    from seqdist.ctc import forced_align
    forced_align(torch.randn(3, 30, 6, generator=g).log_softmax(2), torch.randint(1, 6, (3, 5), generator=g))
elif family == 'rnnt':
    from seqdist.rnnt import rnnt_loss, rnnt_inputs_for
    x, y, il, tl = rnnt_inputs_for(2, 6, 3, 5)
    rnnt_loss(x, y, il, tl, blank=0).backward()
elif family == 'tdt':
    from seqdist.tdt import tdt_loss
    from seqdist.rnnt import rnnt_inputs_for
    x, y, il, tl = rnnt_inputs_for(2, 6, 3, 8)
    tdt_loss(x, y % 4 + 1, il, tl, blank=0, durations=[0, 1, 2]).backward()
elif family == 'joint':
    from seqdist.joint import joint_rnnt_loss, joint_inputs_for
    (e, p, w, b), y, il, tl = joint_inputs_for(2, 6, 3, 8, 4)
    joint_rnnt_loss(e, p, w, y, il, tl, bias=b, blank=0).backward()
elif family == 'crf':
    from seqdist.crf import CTC_CRF
    crf = CTC_CRF(2, 'NACGT')
    s = torch.randn(20, 2, crf.n_score(), generator=g).requires_grad_()
    crf.ctc_loss(s, torch.randint(1, 5, (2, 6), generator=g), torch.full((2,), 6)).backward()
elif family == 'cross_entropy':
    from seqdist.cross_entropy import cross_entropy
    x = torch.randn(4, 10, generator=g).requires_grad_()
    cross_entropy(x, torch.randint(0, 10, (4,), generator=g)).backward()
elif family == 'linear_cross_entropy':
    from seqdist.cross_entropy import linear_cross_entropy
    h, W = torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(10, 3, generator=g).requires_grad_()
    linear_cross_entropy(h, W, torch.randint(0, 10, (4,), generator=g)).backward()
elif family == 'gru':
    from seqdist.gru import GRU
    y, h = GRU(3, 4)(torch.randn(5, 2, 3, generator=g).requires_grad_())
    y.sum().backward()
print(json.dumps(seen))
'''

FIRST_CALL = {
    'ctc': {'ctc._ctc_cpu': 1},
    'forced_align': {'ctc._viterbi_states_cpu': 1},
    'rnnt': {'rnnt._rnnt_forward_cpu': 1, 'rnnt._rnnt_grad_cpu': 1},
    'tdt': {'tdt._tdt_forward_cpu': 1, 'tdt._tdt_grad_cpu': 1},
    'joint': {'joint._tile_activations_cpu': 1, 'joint._tile_stats_cpu': 1, 'rnnt._rnnt_forward_cpu': 1,
              'rnnt._rnnt_edges_cpu': 1, 'joint._tile_grad_cpu': 1, 'joint._tile_backprop_cpu': 1},
    'crf': {'sparse._bundle_forward': 1, 'ctc_simple._simple_scores_cpu': 1, 'sparse._bundle_backward': 1},
    'cross_entropy': {'cross_entropy._ce_forward_cpu': 1, 'cross_entropy._ce_backward_cpu': 1},
    'linear_cross_entropy': {'cross_entropy._ce_forward_cpu': 1, 'cross_entropy._ce_backward_cpu': 1},
    'gru': {'gru._gates_forward': 1, 'gru._gates_backward': 1},
}

@pytest.mark.parametrize('family', sorted(FIRST_CALL))
def test_first_call_compiles_only_what_it_needs(family):
    out = subprocess.run([sys.executable, '-c', RECORDER, family], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == FIRST_CALL[family]
