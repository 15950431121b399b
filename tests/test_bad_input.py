"""Malformed calls that once returned a value: each now raises naming the argument, or gives what the anchor gives."""
import pytest, torch
from seqdist.crf import CTC_CRF
from seqdist.ctc import merge_tokens
from seqdist.timing import load_torchaudio

CRF = CTC_CRF(2, 'NACGT')
SCORES = torch.randn(20, 2, CRF.n_score(), generator=torch.Generator().manual_seed(0))
GOOD = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])

@pytest.mark.parametrize('targets, error, message', [
    (torch.tensor([[1, 2, 3, -1], [1, 2, 3, 4]]), ValueError, r"bases 1\.\.4 within target_lengths .* got -1 at sequence 0, position 3"),
    (torch.tensor([[1, 0, 3, 4], [1, 2, 3, 4]]), ValueError, r"got 0 at sequence 0, position 1"),
    (torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]]), ValueError, r"got 5 at sequence 1, position 3"),
    (GOOD.float(), TypeError, r"targets must be an integer tensor of bases 1\.\.4, got torch\.float32"),
    (GOOD.bool(), TypeError, r"targets must be an integer tensor of bases 1\.\.4, got torch\.bool"),
    (GOOD[0], ValueError, r"targets must be \(N, L\), got shape \(4,\)")])
@pytest.mark.parametrize('call', ['ctc_loss', 'ctc_viterbi_alignments'])
def test_crf_targets_are_checked_within_their_lengths(call, targets, error, message):
    """A -1, a 0 (the blank), a base past the alphabet, float or bool targets: once a finite loss (their k-mer columns
    were clamped or wrapped) or an IndexError deep inside; now an error naming them."""
    with pytest.raises(error, match=message): getattr(CRF, call)(SCORES, targets, torch.tensor([4, 4]))

def test_crf_padding_past_a_target_length_is_not_read():
    padded = torch.tensor([[1, 2, 3, -1], [1, 2, 3, 4]])
    assert torch.isfinite(CRF.ctc_loss(SCORES, padded, torch.tensor([3, 4]), reduction='none')).all()
    assert torch.equal(CRF.ctc_loss(SCORES, padded, torch.tensor([3, 4]), reduction='none'),
                       CRF.ctc_loss(SCORES, torch.tensor([[1, 2, 3, 2], [1, 2, 3, 4]]), torch.tensor([3, 4]), reduction='none'))

def test_merge_tokens_of_integer_scores_averages_in_floating_point():
    "The mean of -1 and 0 is -0.5 (integer arithmetic gave 0); torchaudio's own merge_tokens refuses integer scores."
    spans = merge_tokens(torch.tensor([0, 1, 1, 0, 2, 2, 2]), torch.tensor([0, -1, 0, 0, -1, -1, 0]))
    assert [(s.token, s.start, s.end) for s in spans] == [(1, 1, 3), (2, 4, 7)]
    assert spans[0].score == -0.5 and abs(spans[1].score + 2 / 3) < 1e-12

def test_merge_tokens_of_bool_tokens_as_torchaudio():
    tokens, scores = torch.tensor([False, True, True, False, True]), torch.tensor([0., -1., -2., 0., -3.])
    ours = merge_tokens(tokens, scores)
    assert [(s.token, s.start, s.end, s.score) for s in ours] == [(True, 1, 3, -1.5), (True, 4, 5, -3.0)]
    torchaudio = load_torchaudio()
    if torchaudio is None: pytest.skip("torchaudio not installed")
    theirs = torchaudio.functional.merge_tokens(tokens, scores)
    assert [(s.token, s.start, s.end, s.score) for s in ours] == [(s.token, s.start, s.end, s.score) for s in theirs]

def test_beam_search_with_a_cut_below_one_keeps_the_best_hypothesis():
    """beam_cut < 1 (log_cut < 0) once cut under the best hypothesis itself: a beam of none, whose trace-back read
    parents never written (SIGSEGV at beam_cut=0.5 and 1e-300, on both kernels). Now the best always stays, so a cut at
    or below 1 keeps the best alone: beam_width=1's answer. In a process of its own, as it once crashed."""
    import subprocess, sys, textwrap
    code = textwrap.dedent("""
        import torch
        from seqdist import koi_decode
        x = torch.randn(3, 12, 64, generator=torch.Generator().manual_seed(1))
        for backend in ('cpu', 'cuda'):
            want = koi_decode.beam_search(x, beam_width=1, backend=backend)
            for cut in (1e-300, 0.5, 1.0):
                got = koi_decode.beam_search(x, beam_cut=cut, backend=backend)
                assert all(torch.equal(w, g) for w, g in zip(want, got)), (backend, cut)
        print('same')
    """)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and 'same' in r.stdout, (r.returncode, r.stderr[-2000:])

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_sparse_logz_without_edges_is_a_clear_error(backend):
    "NZ = 0 (no edge into any state): the CPU path once raised amax's IndexError; now every backend names Ms."
    from seqdist import sparse
    ends = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Ms must have C >= 1 states and NZ >= 1 edges"):
        sparse.logZ(torch.randn(3, 2, 4, 0, dtype=torch.float64), torch.zeros(4, 0, dtype=torch.long), ends, ends,
                    backend=backend)

def test_token_spans_names_its_bad_arguments():
    from seqdist import ctc
    labels, scores = torch.tensor([[0, 1, 1, 0, 2, 2]]), torch.zeros(1, 6)
    with pytest.raises(ValueError, match=r"max_length must be an int in \[0, inf\], got -1"):
        ctc.token_spans(labels, scores, torch.tensor([2]), max_length=-1)
    with pytest.raises(ValueError, match=r"target_lengths must be of shape \(N,\) = \(1,\), got shape \(2,\)"):
        ctc.token_spans(labels, scores, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"target_lengths must be >= 0, got \[-1\]"):
        ctc.token_spans(labels, scores, torch.tensor([-1]))
