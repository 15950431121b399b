"""bonito end to end without koi: bonito 1.1.0's own CRF model (its dna_r9.4.1@v3 config, a constant stay score as
current models have, random weights, 96 features) basecalls synthetic reads on the CPU through its own `basecall`,
with `seqdist.koi.install_as_koi()` in ONT's koi's place: `Model.use_koi` takes `seqdist.koi.lstm.update_graph`, and
the decode is `seqdist.koi.decode.beam_search`.

bonito asks for torch ~= 2.9 and ONT's koi, so `make install-bonito` (a step of `make test`) puts it, without its
dependencies and with the ones its import needs, in a folder of its own ($SEQDIST_BONITO, by default .venv/bonito);
the test runs it in a subprocess with that folder on its path. Under `make test` (SEQDIST_REQUIRE_BONITO=1) a missing
folder fails the test; elsewhere it skips, saying why."""
import json, os, pathlib, subprocess, sys
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BONITO = pathlib.Path(os.environ.get('SEQDIST_BONITO', ROOT / '.venv' / 'bonito'))

SCRIPT = r'''
import json, pathlib, sys, types
import numpy as np, torch, toml
import seqdist.koi
seqdist.koi.install_as_koi()
import bonito, bonito.util, bonito.crf
basecaller = sys.modules['bonito.crf.basecall']          # bonito.crf.basecall is also the name of a function

config = toml.load(pathlib.Path(bonito.__file__).parent / 'models' / 'configs' / 'dna_r9.4.1@v3.toml')
config['encoder'].update(blank_score=2.0, features=96)  # a constant stay score (koi's layout); a small model
torch.manual_seed(0)
model = bonito.util.load_symbol(config, 'Model')(config).eval().half()   # as bonito.util.load_model(half=True)
plain = model.encoder
model.use_koi(batchsize=4, chunksize=2000, quantize=False)                 # koi.lstm.update_graph: seqdist's
out = dict(encoder=type(model.encoder).__name__, plain_kept=model.encoder.encoder is plain)

rng = np.random.default_rng(0)
reads = [types.SimpleNamespace(read_id=f'read{i}', signal=rng.standard_normal(n).astype(np.float32))
         for i, n in enumerate([2000, 9000, 5000, 4000])]
try:        # bonito >= 0.7.1 decodes inside torch.cuda.device(scores.device), which refuses CPU scores
    basecaller.compute_scores(model, torch.from_numpy(reads[0].signal)[None, None])
    out['cpu_device_error'] = None
except ValueError as e:
    out['cpu_device_error'] = str(e)
cuda_device = torch.cuda.device    # the one-line change a CPU user makes in bonito/crf/basecall.py, as a patch here
torch.cuda.device = lambda device: cuda_device(device if torch.device(device).type == 'cuda' else -1)

results = {read.read_id: r for read, r in basecaller.basecall(model, reads, chunksize=2000, overlap=100, batchsize=4)}
out['reads'] = {k: dict(sequence=r['sequence'], qstring=r['qstring'], moves=r['moves'].tolist(), stride=r['stride'])
                for k, r in results.items()}
with torch.inference_mode():       # read0 is one chunk: seqdist's own decode of the model's training-layout scores
    scores = plain(torch.from_numpy(reads[0].signal)[None, None].half())
sequence, qstring, moves = seqdist.koi.decode.beam_search(seqdist.koi.lstm.koi_layout(scores))
out['own'] = dict(shape=list(scores.shape), sequence=seqdist.koi.decode.to_str(sequence[0]),
                  qstring=seqdist.koi.decode.to_str(qstring[0]), moves=moves[0].tolist())
print('RESULT ' + json.dumps(out))
'''

@pytest.fixture(scope='module')
def bonito_run():
    if not (BONITO / 'bonito').is_dir():
        if os.environ.get('SEQDIST_REQUIRE_BONITO') == '1':
            pytest.fail(f"bonito is not installed in {BONITO}, but SEQDIST_REQUIRE_BONITO=1: run `make install-bonito`")
        pytest.skip(f"bonito is not installed in {BONITO} (`make install-bonito` puts it there)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BONITO), str(ROOT)]), PYTHONWARNINGS='ignore')
    r = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
    assert r.returncode == 0 and lines, f"bonito's basecall failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][len('RESULT '):])

def test_use_koi_takes_seqdists_update_graph(bonito_run):
    assert bonito_run['encoder'] == 'KoiScores' and bonito_run['plain_kept']

def test_bonitos_decode_needs_the_one_line_change_on_the_cpu(bonito_run):
    assert bonito_run['cpu_device_error'] == 'Expected a cuda device, but got: cpu'

def test_every_read_gets_consistent_sequence_qualities_and_moves(bonito_run):
    reads = bonito_run['reads']
    assert sorted(reads) == ['read0', 'read1', 'read2', 'read3']
    for name, n in zip(['read0', 'read1', 'read2', 'read3'], [2000, 9000, 5000, 4000]):
        r = reads[name]
        assert r['stride'] == 5 and len(r['moves']) == n // 5 and set(r['moves']) <= {0, 1}
        assert 0 < len(r['sequence']) == len(r['qstring']) == sum(r['moves'])
        assert set(r['sequence']) <= set('ACGT') and all('"' <= q <= 'S' for q in r['qstring'])

def test_a_one_chunk_read_is_seqdists_own_decode_of_the_models_scores(bonito_run):
    own, read0 = bonito_run['own'], bonito_run['reads']['read0']
    assert own['shape'] == [400, 1, 5 * 4 ** 5]          # training layout: T = 2000 / stride, 5 C columns
    assert (own['sequence'], own['qstring'], own['moves']) == (read0['sequence'], read0['qstring'], read0['moves'])
