"""The beam search's share of a whole bonito basecall on the CPU, with seqdist.koi in ONT's koi's place.

Run with bonito's folder on the path (`make install-bonito` makes it):
    PYTHONPATH=.venv/bonito:. .venv/bin/python tools/bonito_share.py [--features 768] [--reads 64] [--state-len 5]
bonito 1.1.0's CRF model from its dna_r9.4.1@v3 config (a constant stay score, random weights, fp16 as bonito loads
it) basecalls `--reads` synthetic reads of one chunk each (chunksize 5000 samples: T = 1000 frames at stride 5) in one
batch, after a warm-up batch; prints the wall time of `basecall`, the time spent in `beam_search` inside it, and
the share. The CPU fix of bonito's decode (tests/test_koi_bonito.py) is applied as a patch."""
import argparse, pathlib, sys, time, types
import numpy as np, torch

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--features', type=int, default=768)
    ap.add_argument('--reads', type=int, default=64)
    ap.add_argument('--state-len', type=int, default=5)
    ap.add_argument('--threads', type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import seqdist.koi
    seqdist.koi.install_as_koi()
    import toml, bonito, bonito.util, bonito.crf
    basecaller = sys.modules['bonito.crf.basecall']
    config = toml.load(pathlib.Path(bonito.__file__).parent / 'models' / 'configs' / 'dna_r9.4.1@v3.toml')
    config['encoder'].update(blank_score=2.0, features=a.features)
    config['global_norm']['state_len'] = a.state_len
    torch.manual_seed(0)
    model = bonito.util.load_symbol(config, 'Model')(config).eval().half()
    chunk = 5000
    model.use_koi(batchsize=a.reads, chunksize=chunk, quantize=False)
    cuda_device = torch.cuda.device
    torch.cuda.device = lambda device: cuda_device(device if torch.device(device).type == 'cuda' else -1)
    spent, search = [], basecaller.beam_search
    def timed_search(*args, **kwargs):
        t0 = time.perf_counter(); out = search(*args, **kwargs); spent.append(time.perf_counter() - t0); return out
    basecaller.beam_search = timed_search
    rng = np.random.default_rng(0)
    def run(n):
        reads = [types.SimpleNamespace(read_id=f'r{i}', signal=rng.standard_normal(chunk).astype(np.float32)) for i in range(n)]
        spent.clear(); t0 = time.perf_counter()
        out = list(basecaller.basecall(model, reads, chunksize=chunk, overlap=0, batchsize=a.reads))
        return time.perf_counter() - t0, sum(spent), sum(len(r['sequence']) for _, r in out)
    run(2)                                                              # warm-up: numba's compilation, torch's first calls
    wall, beam, bases = run(a.reads)
    print(f"bonito 1.1.0 basecall, CPU, {a.threads} threads, state_len {a.state_len}, {a.features} features, "
          f"{a.reads} reads x 1000 frames (one batch), fp16 scores: {wall:.1f} s wall, beam_search {beam:.1f} s "
          f"({100 * beam / wall:.0f}%), {a.reads / wall:.2f} reads/s, {bases} bases")

if __name__ == '__main__':
    main()
