"""Transducer beam search (nbs/11d_transducer_beam.ipynb): with a beam that keeps every hypothesis it gives the n best
label sequences of enumeration of every path (RNN-T, TDT with and without a duration of 0, multi-blank; with a token
LM and hotwords); with pruning, the one-utterance reference's hypotheses; a beam of one is greedy decoding where a step
has one place to go; torchaudio's RNNT decodes as it is; bad input is named."""
import math
import pytest
import torch
from conftest import small_emformer_rnnt
from seqdist.decode import (transducer_beam_search, transducer_beam_reference, transducer_nbest_brute_force,
                            transducer_greedy_decode, random_transducer, torchaudio_rnnt_parts, NGramLM, random_arpa,
                            TransducerBeamHypothesis)

def _case(kind, seed, B=1, T=3, V=4):
    "A random float64 model of `kind`, its blank and options, encoder output and lengths."
    g = torch.Generator().manual_seed(seed)
    blank, opts = seed % V, {}
    if kind == 'tdt': opts = dict(durations=[[0, 1, 2], [1, 2], [0, 2]][seed % 3])
    if kind == 'multiblank': blank, opts = V - 1, dict(big_blank_durations=[[2], [2, 3]][seed % 2][:V - 2])
    predict, join = random_transducer(V, seed=seed, dtype=torch.float64, blank=blank, blank_bias=seed % 3,
                                      extra=len(opts.get('durations', ())))
    enc = torch.randn(B, T, 16, generator=g, dtype=torch.float64) * (1 + seed % 3)
    return predict, join, blank, opts, enc, torch.randint(0, T + 1, (B,), generator=g)

def _scorers(seed, V, blank, opts):
    "No LM; a token LM; a token LM and hotwords (each a dict of keyword arguments)."
    tokens = [f't{k}' for k in range(V)]
    labels = [k for k in range(V) if k != blank and not 0 < blank - k <= len(opts.get('big_blank_durations', ()))]
    lm = NGramLM(text=random_arpa(seed, tokens, order=2 + seed % 2))
    hot = [([labels[0], labels[-1]], 1.5), ([labels[-1]], 0.4)]
    return [{}, dict(lm=lm, lm_weight=0.7, tokens=tokens), dict(lm=lm, lm_weight=0.3, tokens=tokens, hotwords=hot)]

def _alike(a, hyps):
    "(score, labels, frames) lists against hypotheses: labels and frames equal, scores within 1e-9."
    return len(a) == len(hyps) and all(x[1] == tuple(h.tokens.tolist()) and x[2] == tuple(h.timesteps.tolist())
                                       and abs(x[0] - h.score) < 1e-9 for x, h in zip(a, hyps))

@pytest.mark.parametrize('backend', ['cpu', 'torch'])
@pytest.mark.parametrize('kind', ['rnnt', 'tdt', 'multiblank'])
def test_a_beam_that_keeps_everything_gives_enumerations_n_best(kind, backend):
    for seed in range(3):
        predict, join, blank, opts, enc, _ = _case(kind, seed)
        cap = 1 + seed % 2
        for extra in _scorers(seed, 4, blank, opts):
            truth = transducer_nbest_brute_force(enc[0], 3, predict, join, blank, 4, cap, **opts, **extra)
            ours = transducer_beam_search(enc, predict=predict, join=join, blank=blank, beam_width=1200, nbest=4,
                                          max_symbols_per_frame=cap, backend=backend, **opts, **extra)[0]
            assert _alike(truth, ours), (seed, extra)
            assert all(h.score == pytest.approx(h.acoustic + extra.get('lm_weight', 0.0) * h.lm + h.hotwords, abs=1e-9) for h in ours)
            ref = transducer_beam_reference(enc, [3], predict, join, blank, 1200, 4, cap, **opts, **extra)[0]
            assert len(ref) == len(truth) and all(a[1] == b[1] and a[2] == b[2] and abs(a[0] - b[0]) < 1e-9 for a, b in zip(ref, truth))

@pytest.mark.parametrize('backend', ['cpu', 'torch'])
@pytest.mark.parametrize('kind', ['rnnt', 'tdt', 'multiblank'])
def test_with_pruning_the_batched_search_is_the_reference(kind, backend):
    n = 0
    for seed in range(5):
        V, T, cap = 4 + seed % 5, 4 + seed % 9, 1 + seed % 3
        predict, join, blank, opts, enc, lengths = _case(kind, seed, B=4, T=T, V=V)
        for extra in _scorers(seed, V, blank, opts)[::2]:
            for beam in (1 + seed % 3, 5 + seed):
                ref = transducer_beam_reference(enc, lengths, predict, join, blank, beam, min(3, beam), cap, **opts, **extra)
                ours = transducer_beam_search(enc, lengths, predict=predict, join=join, blank=blank, beam_width=beam,
                                              nbest=min(3, beam), max_symbols_per_frame=cap, backend=backend, **opts, **extra)
                for a, b in zip(ref, ours):
                    assert _alike(a, b), (seed, beam, extra)
                    n += 1
    assert n == 5 * 2 * 2 * 4

def test_a_beam_of_one_is_greedy_decoding_at_one_label_a_frame():
    differ = 0
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        V, B, T, blank = 3 + seed % 9, 1 + seed % 6, 1 + seed % 13, seed % 3
        predict, join = random_transducer(V, seed=seed, dtype=torch.float64, blank=blank, blank_bias=seed % 5)
        enc, lengths = torch.randn(B, T, 16, generator=g, dtype=torch.float64), torch.randint(0, T + 1, (B,), generator=g)
        for cap in (1, 3):
            a = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=blank, max_symbols_per_frame=cap)
            b = transducer_beam_search(enc, lengths, predict=predict, join=join, blank=blank, beam_width=1, max_symbols_per_frame=cap)
            for x, y in zip(a, b):
                same = torch.equal(x.tokens, y[0].tokens) and torch.equal(x.timesteps, y[0].timesteps) and abs(x.score - y[0].score) < 1e-9
                if cap == 1: assert same, seed
                else: differ += not same
    assert differ > 0                                 # (at 3 labels a frame it is not greedy decoding)

def test_utterances_of_no_frames_have_the_empty_hypothesis():
    predict, join = random_transducer(5)
    hyps = transducer_beam_search(torch.randn(3, 4, 16), torch.tensor([0, 4, 0]), predict=predict, join=join, blank=0, nbest=2)
    assert [h[0].tokens.tolist() for h in hyps[::2]] == [[], []] and all(h[0].score == 0.0 for h in hyps[::2])
    assert len(hyps[1]) == 2 and isinstance(hyps[1][0], TransducerBeamHypothesis) and hyps[1][0].score >= hyps[1][1].score
    none = transducer_beam_search(torch.randn(2, 4, 16), torch.tensor([0, 0]), predict=predict, join=join, blank=0)
    assert [h[0].tokens.tolist() for h in none] == [[], []]

@pytest.mark.torchaudio
def test_torchaudios_rnnt_is_searched_as_it_is():
    model = small_emformer_rnnt()
    with torch.no_grad(): enc, lengths = model.transcribe(torch.randn(3, 12, 20), torch.tensor([12, 9, 5]))
    predict, join = torchaudio_rnnt_parts(model)
    ours = transducer_beam_search(enc, lengths, predict=predict, join=join, blank=9, beam_width=3, nbest=2, max_symbols_per_frame=2)
    ref = transducer_beam_reference(enc, lengths, predict, join, 9, 3, 2, 2)
    for a, b in zip(ref, ours):
        assert [x[1] for x in a] == [tuple(h.tokens.tolist()) for h in b]
        assert [x[0] for x in a] == pytest.approx([h.score for h in b], abs=1e-4)       # (float32)

@pytest.mark.parametrize('kwargs, error, message', [
    (dict(encoder_out=torch.randn(6, 16)), ValueError, r'encoder_out must be \(B, T, H\)'),
    (dict(encoder_lengths=torch.tensor([5, 9])), ValueError, r'encoder_lengths must be B = 2 lengths in \[0, T\] = \[0, 6\]'),
    (dict(encoder_lengths=torch.tensor([5.0, 2.0])), ValueError, r'encoder_lengths must be B = 2 lengths'),
    (dict(beam_width=0), ValueError, r'beam_width must be an int >= 1'),
    (dict(beam_width=2.0), ValueError, r'beam_width must be an int >= 1'),
    (dict(nbest=5), ValueError, r'nbest must be at most beam_width = 4'),
    (dict(nbest=0), ValueError, r'nbest must be an int >= 1'),
    (dict(max_symbols_per_frame=0), ValueError, r'max_symbols_per_frame must be an int >= 1'),
    (dict(blank=-1), ValueError, r'blank must be the blank.s index'),
    (dict(blank=7), ValueError, r"blank must be one of the model's symbols: predict refused 7"),
    (dict(lm_weight=math.nan), ValueError, r'lm_weight must be a finite real number'),
    (dict(tokens=['a', 'b']), ValueError, r'tokens must be V = 5 strings'),
    (dict(tokens='abcde'), ValueError, r'tokens must be a list of strings'),
    (dict(lm='model.arpa', tokens=list('abcde')), TypeError, r'lm must be an NGramLM'),
    (dict(lm=NGramLM(text=random_arpa(0, list('abcde')))), ValueError, r'lm needs tokens'),
    (dict(hotwords=[([0, 1], 1.0)]), ValueError, r'hotwords must be spelled by token ids'),
    (dict(durations=[]), ValueError, r'durations must be a non-empty list of ints >= 0'),
    (dict(durations=[0, 1], big_blank_durations=[2]), ValueError, r'give durations \(a TDT\) or big_blank_durations'),
    (dict(backend='cuda'), ValueError, r"backend must be 'auto', 'cpu' or 'torch', got 'cuda'"),
    (dict(encoder_out=torch.randn(2, 6, 16, device='meta'), backend='cpu'), ValueError, r"backend='cpu' needs CPU tensors, got encoder_out on meta"),
])
def test_bad_input_is_named(kwargs, error, message):
    predict, join = random_transducer(5)
    call = {**dict(encoder_out=torch.randn(2, 6, 16), predict=predict, join=join, blank=0), **kwargs}
    with pytest.raises(error, match=message): transducer_beam_search(**call)
