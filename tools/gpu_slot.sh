#!/usr/bin/env bash
# What one GPU slot runs (the device tool's `run`, under its 10-minute limit), from the repository root on a GPU machine
# without network: the carried wheels (.whl/, e.g. Liger's) installed, the quick benchmark (`make gpu-bench-quick`:
# nbs/bench/cuda.json and the kernel profiles), then `make gpu-check-tests` on 8 workers (or $CHECK), each under
# its own time limit.
# Logs and the JSON go to $OUT (the device tool brings that folder back). Carry .anchors and .whl along.
# ONLY=decode,graph (families of tools/gpu_bench.py) runs those alone: the decoding and graph rows come last and a
# whole run may stop before them (--seconds).
set -u
export OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, cupy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN',
torch.backends.cudnn.version(), 'CuPy', cupy.__version__)"; } > "$OUT/machine.txt" 2>&1
if ! command -v make >/dev/null; then        # a bare image: the two recipes, run directly
    mkdir -p /tmp/nomake && cat > /tmp/nomake/make <<'SH'
#!/usr/bin/env bash
case $1 in
    gpu-bench-quick) python3 tools/gpu_bench.py nbs/bench/cuda.json --seconds 300 --profiles "$OUT/profiles.txt" ${ONLY:+--only $ONLY};;
    gpu-check-tests) SEQDIST_GPU_SUMMARY=gpu-check-summary.txt PYTHONPATH=. python3 -m pytest -m gpu -rs tests;;
    gpu-check-notebooks) PYTHONPATH=. python3 tools/run_notebook.py --flags cuda nbs/*.ipynb;;
esac
SH
    chmod +x /tmp/nomake/make && export PATH=/tmp/nomake:$PATH
fi
timeout "${BENCH_S:-330}" make gpu-bench-quick PYTHON=python3 OUT="$OUT" ${ONLY:+ONLY=$ONLY} > "$OUT/bench.log" 2>&1
echo "gpu-bench-quick exit $?" >> "$OUT/bench.log"
cp nbs/bench/cuda.json "$OUT/cuda.json"
PYTEST_ADDOPTS="-n 8" timeout "${CHECK_S:-210}" make "${CHECK:-gpu-check-tests}" PYTHON=python3 > "$OUT/check.log" 2>&1
echo "${CHECK:-gpu-check-tests} exit $?" >> "$OUT/check.log"     # (CHECK=gpu-check-notebooks in a slot of their own)
