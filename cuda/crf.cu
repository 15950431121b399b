// out[t, n, c] += the sum of values[t, n, j] over the positions j with cols[n, j] = c (written by nbs/05_crf.ipynb).
// order (N, J): each row's positions sorted by column (stable); sorted_cols = cols in that order; start (N, J):
// where the run of equal columns that sorted position k belongs to starts. One thread per (t, n, k): the one at the
// end of a run adds the run's sum (in double, in ascending position) into its column; no atomics (deterministic).
extern "C" __global__ void add_at_columns(FLOAT* __restrict__ out, const long long* __restrict__ order,
                                          const long long* __restrict__ sorted_cols, const long long* __restrict__ start,
                                          const FLOAT* __restrict__ values, int T, int N, int C, int J) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * N * J) return;
    const int k = (int)(i % J);
    const long long tn = i / J;                       // t * N + n
    const int n = (int)(tn % N);
    const long long* sc = sorted_cols + (long long)n * J;
    if (k + 1 < J && sc[k + 1] == sc[k]) return;      // not the end of its run
    const long long* o = order + (long long)n * J;
    const FLOAT* v = values + tn * J;
    double sum = 0.0;
    for (int m = (int)start[(long long)n * J + k]; m <= k; m++) sum += (double)v[o[m]];
    out[tn * C + sc[k]] += (FLOAT)sum;
}
