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
