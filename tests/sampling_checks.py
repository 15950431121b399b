"""The statistics that every family's sampling tests share: a chi-square test of sample counts against exact path
probabilities (scipy is not a dependency, so its bound is Wilson-Hilferty's)."""
import math
import torch

def chi_square_bound(df, z=5.0):
    "Wilson-Hilferty: the chi-square quantile with df degrees of freedom at the normal's z (z = 5: p ~ 3e-7)."
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

def chi_square(counts, probs, n):
    "Pearson's statistic and its degrees of freedom, the cells of expected count < 5 merged into one."
    expected = probs * n
    rare = expected < 5
    obs = torch.cat([counts[~rare], counts[rare].sum()[None]]) if rare.any() else counts
    exp = torch.cat([expected[~rare], expected[rare].sum()[None]]) if rare.any() else expected
    return (((obs - exp) ** 2) / exp).sum().item(), len(obs) - 1

def check_counts(drawn, logprob, n, seed):
    """The chi-square test of the draws (indices into the paths) against the paths' exact log-probabilities, and its
    power: the same counts fail it against the probabilities shuffled, or the likeliest path's half as large again.
    Returns the degrees of freedom."""
    counts = torch.bincount(drawn, minlength=len(logprob)).double()
    stat, df = chi_square(counts, logprob.exp(), n)
    assert stat < chi_square_bound(df), (seed, stat, df)
    shuffled = logprob.exp()[torch.randperm(len(logprob), generator=torch.Generator().manual_seed(seed))]
    off = logprob.exp().clone(); off[off.argmax()] *= 1.5; off /= off.sum()
    assert chi_square(counts, shuffled, n)[0] > chi_square_bound(df) and chi_square(counts, off, n)[0] > chi_square_bound(df)
    return df
