"""Time and peak memory of `seqdist.ctc.forced_align` on the CPU at long lengths: the one-pass kernel (a score and a
back-pointer per lattice cell) against the checkpointed one, and the checkpointed one on an hour of frames.

    python tools/align_hour.py            # prints a markdown table
    python tools/align_hour.py --quick    # the 20,000-frame rows only
    python tools/align_hour.py --sweep nbs/bench/align_sweep.json   # time and memory over T (L = 0.3 T), with
                                          # torchaudio's forced_align, for 02_ctc's plot

Each row runs in a subprocess of its own: the inputs are made and the kernels compiled (or loaded from numba's cache)
first, then the peak resident memory is reset (/proc/self/clear_refs) and the call measured; "extra memory" is the
peak during the calls less the resident memory before them (the inputs, log_probs included, are not counted)."""
import json, subprocess, sys, time

ROWS = [(20000, 6000, 'one pass', 5), (20000, 6000, 'checkpointed', 5), (180000, 50000, 'checkpointed', 1)]

SWEEP = [(T, int(0.3 * T), kernel, 3 if T <= 20000 else 1) for T in (2500, 5000, 10000, 20000, 40000, 80000, 180000)
         for kernel, longest in (('checkpointed', 180000), ('one pass', 40000), ('torchaudio', 80000)) if T <= longest]

def measure(T, L, kernel, runs, C=32):
    import torch
    import seqdist.ctc as ctc
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(1, T, C, generator=g).log_softmax(-1)
    targets = torch.randint(1, C, (1, L), generator=g)
    ctc._FULL_TABLE_BYTES = 1 << 62 if kernel == 'one pass' else 0
    if kernel == 'torchaudio':
        from seqdist.timing import load_torchaudio
        align = load_torchaudio().functional.forced_align
        targets = targets.int()
    else: align = ctc.forced_align
    align(lp[:, :200], targets[:, :50])                      # compile or load the kernel
    ctc.token_spans(*ctc.forced_align(lp[:, :200], targets[:, :50]), [50])
    def rss(key): return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
    open('/proc/self/clear_refs', 'w').write('5')            # the peak (VmHWM) starts again from here
    before, times = rss('VmRSS'), []
    for _ in range(runs):
        t = time.perf_counter()
        labels, scores = align(lp, targets)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    ctc.token_spans(labels, scores, [L])
    spans = time.perf_counter() - t
    return dict(seconds=sorted(times)[len(times) // 2], extra=rss('VmHWM') - before, spans=spans)

def run_row(T, L, kernel, runs, fail=True):
    "One row in a subprocess; if it fails, SystemExit (or, with fail=False, the row as {'error': its last words})."
    r = subprocess.run([sys.executable, __file__, '--row', str(T), str(L), kernel, str(runs)], capture_output=True, text=True)
    if r.returncode:
        if fail: raise SystemExit(r.stderr[-3000:])
        return dict(error=(r.stderr.strip().splitlines() or [f'exit status {r.returncode}'])[-1][:300])
    return json.loads(r.stdout.strip().splitlines()[-1])

def sweep(path):
    "Every row of SWEEP, written to `path` as JSON (with the date and the machine) as each finishes."
    import datetime, os, platform
    out = dict(date=str(datetime.datetime.now(datetime.timezone.utc))[:16] + ' UTC', machine=f"{platform.machine()} CPU with "
               f"{os.cpu_count()} cores, torch.set_num_threads(2); N = 1, C = 32, L = 0.3 T, float32 log_probs", rows=[])
    for T, L, kernel, runs in SWEEP:
        out['rows'].append(dict(T=T, L=L, kernel=kernel, runs=runs, **run_row(T, L, kernel, runs, fail=False)))
        print(out['rows'][-1], flush=True)
        with open(path, 'w') as f: json.dump(out, f, indent=1)

def main():
    import datetime, os, platform
    rows = ROWS[:2] if '--quick' in sys.argv else ROWS
    print(f"{datetime.date.today()}, {platform.machine()} CPU with {os.cpu_count()} cores, torch.set_num_threads(2); "
          "N = 1, C = 32, float32 log_probs\n")
    print("| T | L | kernel | time (s) | extra memory (MB) | token_spans (s) |")
    print("|---|---|---|---|---|---|")
    for T, L, kernel, runs in rows:
        m = run_row(T, L, kernel, runs)
        median = f" (median of {runs})" if runs > 1 else ""
        print(f"| {T:,} | {L:,} | {kernel} | {m['seconds']:.2f}{median} | {m['extra'] / 1e6:,.0f} | {m['spans']:.3f} |",
              flush=True)

if __name__ == '__main__':
    if sys.argv[1:2] == ['--row']:
        T, L, kernel, runs = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        print(json.dumps(measure(T, L, kernel, runs)))
    elif sys.argv[1:2] == ['--sweep']: sweep(sys.argv[2])
    else: main()
