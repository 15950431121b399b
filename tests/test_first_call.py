"""A family's first call compiles the numba kernels it needs, each once: one fp32 fwd+bwd in a fresh process asks numba
for exactly the specialisations pinned here (a kernel asked for twice, say once for a contiguous and once for a strided
argument, or one the call does not run, fails). Counted where Python calls into numba (`Dispatcher._compile_for_args`,
which runs on a process's first call of each type signature, whether the machine code then comes from numba's cache or
from the compiler), so the test is as fast with a warm cache and means the same with a cold one."""
import json, subprocess, sys
import pytest
from seqdist.bench import FIRST_CALLS

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
g = torch.Generator().manual_seed(0)
exec(sys.argv[1])
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

def test_every_family_is_pinned(): assert sorted(FIRST_CALL) == sorted(FIRST_CALLS)

@pytest.mark.parametrize('family', sorted(FIRST_CALL))
def test_first_call_compiles_only_what_it_needs(family):
    out = subprocess.run([sys.executable, '-c', RECORDER, FIRST_CALLS[family]], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == FIRST_CALL[family]
