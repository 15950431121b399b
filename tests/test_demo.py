"""seqdist-demo (what `make demo` runs): every row at tiny shapes, the agreement it states, and the CLI's table and JSON."""
import json, math, sys
import pytest
import torch
from seqdist import bench

TINY = {bench.demo_ctc: dict(T=30, N=4, C=6, L_min=3, L_max=5),
        bench.demo_forced_align: dict(T=20, N=3, C=8, L_min=2, L_max=4),
        bench.demo_rnnt: dict(B=2, T=6, U=3, V=5),
        bench.demo_joint: dict(B=2, T=5, U=3, V=7, H=4),
        bench.demo_cross_entropy: dict(N=8, V=11),
        bench.demo_linear_cross_entropy: dict(N=8, H=4, V=11),
        bench.demo_gru: dict(T=5, N=2, I=3, H=4)}

def test_every_demo_has_a_tiny_case(): assert set(TINY) == set(bench.DEMOS)

@pytest.mark.torchaudio
@pytest.mark.parametrize('demo', bench.DEMOS, ids=lambda d: d.__name__)
def test_demo_row(demo):
    r = demo(**TINY[demo])
    assert set(r) >= {'family', 'switch', 'shape', 'anchor', 'anchor_ms', 'ours_ms', 'ratio', 'anchor_mb', 'ours_mb', 'check', 'note'}
    assert r['switch'].startswith('from seqdist.') and r['anchor_ms'] > 0 and r['ours_ms'] > 0
    assert math.isclose(r['ratio'], r['anchor_ms'] / r['ours_ms'])
    assert r['anchor_mb'] >= 0 and r['ours_mb'] >= 0
    if demo is bench.demo_forced_align: assert r['check'].startswith('3/3 paths identical, scores 0e+00'), r['check']
    else:                                             # ours and the anchor agree to fp32 rounding
        diffs = [float(v.rstrip(',')) for v in r['check'].replace('(relative)', '').split()[1::2]]
        assert len(diffs) == 2 and max(diffs) < 1e-4, r['check']

def test_a_row_that_disagrees_says_so():
    "The agreement is computed, not assumed: a wrong gradient shows in the row."
    x = torch.randn(5, requires_grad=True)
    r = bench.switch_row('toy', 'from seqdist import toy', '5', 'sum', lambda: bench._grads(x.sum(), [x]),
                         lambda: bench._grads(1.5 * x.sum(), [x]), reps=1)
    assert r['check'] == 'loss 5e-01, grads 5e-01', r['check']

def test_demo_cli_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    row = dict(family='CTC', op='CTC', switch='from seqdist.ctc import ctc_loss', shape='T=1', anchor='F.ctc_loss',
               anchor_ms=2.0, ours_ms=1.0, ratio=2.0, anchor_mb=3.0, ours_mb=float('nan'), check='loss 0e+00, grads 0e+00', note='n')
    monkeypatch.setattr(bench, 'run_demo', lambda: [row])
    monkeypatch.setattr(sys, 'argv', ['seqdist-demo', '--json', str(tmp_path / 'demo.json')])
    bench.demo_cli()
    out = capsys.readouterr().out
    assert "| CTC | `from seqdist.ctc import ctc_loss` | T=1 | F.ctc_loss | loss 0e+00, grads 0e+00 | 2.0 | 1.0 | 2.00x | 3 | – | n |" in out
    saved = json.loads((tmp_path / 'demo.json').read_text())
    assert saved['command'] == 'seqdist-demo' and saved['threads'] == 2 and saved['rows'][0]['family'] == 'CTC'
