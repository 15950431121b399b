"""torchaudio's CTC decoders (seqdist.decode.ctc_decoder, cuda_ctc_decoder) on the Viterbi beam search
(`ctc_beam_search(semiring='max')`): the search against enumeration of every label sequence's best path and the kernel
against the reference with pruning, the face against torchaudio's decoder (flashlight-text), and bad input."""
import math, re
import pytest
import torch
from seqdist.ctc import forced_align
from seqdist.decode import (ctc_beam_search, ctc_beam_search_reference, ctc_nbest_brute_force, NGramLM, PrefixScorer,
                            Hotwords, random_arpa, ctc_decoder, cuda_ctc_decoder, _ctc_beam_search_cpu)

TOKENS5, WORDS5 = ['-', 'a', 'b', '|', '▁c'], ['a', 'b', 'ab', 'ba', 'c', 'ca', 'cab', 'bab']

@pytest.mark.parametrize('search', [ctc_beam_search_reference, _ctc_beam_search_cpu])
def test_the_viterbi_search_keeping_every_prefix_gives_the_best_paths_of_enumeration(search):
    hot = [([1, 2], 0.4), ([4, 1], 0.6), ([2], -0.3)]
    for seed in range(24):
        g = torch.Generator().manual_seed(seed)
        T, lm = 1 + seed % 6, NGramLM(text=random_arpa(seed, WORDS5, order=1 + seed % 3, n_per_order=15))
        lp = torch.randn(T, 5, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)
        kw = dict(lm_weight=0.5 + seed % 3 * 0.5, word_score=(seed % 5 - 2) * 0.3, lexicon=['a', 'ab', 'c', 'cab'] if seed % 2 else None)
        merge, whole, nbest = seed % 3 == 0, seed % 4 < 2, 1 + seed % 3 // 2 * 2      # nbest 1: recombined
        want = ctc_nbest_brute_force(lp, nbest, 0, TOKENS5, lm, **kw, hotwords=hot, semiring='max', whole_words=whole,
                                     merge_delimiters=merge)
        scorer = PrefixScorer(5, 0, TOKENS5, lm, **kw, hotwords=Hotwords(*zip(*hot), 5), whole_words=whole, lookahead=seed % 5 < 3)
        got = search(lp[None], torch.tensor([T]), 10**4, 0, nbest, scorer, math.inf, merge, 'max')[0]
        assert [s for _, s in got] == [s for _, s in want], seed
        assert all(abs(a - b) < 1e-9 for (a, _), (b, _) in zip(got, want))

def test_the_viterbi_kernel_equals_the_reference_pruned_and_recombined():
    for seed in range(24):
        g = torch.Generator().manual_seed(seed)
        N, T, C = 3, 4 + seed % 11, (5, 24)[seed % 2]
        toks = TOKENS5 if C == 5 else ['-', '|'] + [f'{a}{b}' for a in 'abcd' for b in ('', 'a', 'b', 'ab', 'ba', 'ca')][:C - 2]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        il = torch.randint(0, T + 1, (N,), generator=g)
        scorer = PrefixScorer(C, 0, toks, NGramLM(text=random_arpa(seed, WORDS5, order=2)), 0.7, -0.2,
                              Hotwords([[1, 2], [2, 3, 1], [3]], [0.5, 1.0, -0.2], C) if seed % 3 else None,
                              ['a', 'ab', 'aab', 'b', 'ba', 'c', 'cab', 'ca'] if seed % 4 == 1 else None,
                              whole_words=seed % 2 == 0, lookahead=seed % 3 == 0)
        args = (lp, il, 1 + seed % 6, 0, 1, scorer, (math.inf, 2.0)[seed % 2], seed % 5 == 0, 'max')
        for ref, ker in zip(ctc_beam_search_reference(*args), _ctc_beam_search_cpu(*args)):
            assert [s for _, s in ref] == [s for _, s in ker], seed
            assert all(abs(a - b) < 1e-9 for (a, _), (b, _) in zip(ref, ker))

def test_a_viterbi_hypothesis_scores_its_best_path():
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(2, 40, 6, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)
    for b, hyps in enumerate(ctc_beam_search(lp, beam_width=4, semiring='max')):
        seq = hyps[0].tokens
        best = forced_align(lp[b:b + 1], seq[None], None, [len(seq)], 0, backend='cpu')[1].sum()
        assert hyps[0].score <= float(best) + 1e-9      # (the search's path, no better than the best of its tokens')

def _lexicon_file(tmp_path, words):
    path = tmp_path / 'lexicon.txt'
    path.write_text(''.join(f"{w} {' '.join(w)} |\n" for w in words))
    return str(path)

@pytest.mark.torchaudio
def test_the_face_gives_torchaudios_hypotheses(tmp_path):
    from seqdist.timing import load_torchaudio
    load_torchaudio()
    from torchaudio.models.decoder import ctc_decoder as theirs
    toks, words = ['-', '|', 'a', 'b', 'c'], ['a', 'ab', 'ba', 'c', 'cab', 'bb']
    lexicon = _lexicon_file(tmp_path, words)
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        T = 1 + seed % 8
        lp = torch.randn(3, T, 5, generator=g).mul(1 + seed % 3).log_softmax(-1)
        lengths = torch.randint(0, T + 1, (3,), generator=g)
        arpa = tmp_path / f'lm{seed}.arpa'
        arpa.write_text(random_arpa(seed, words, order=2 + seed % 2, n_per_order=10, suffix_closed=True))
        kw = dict(lexicon=None if seed % 3 == 0 else lexicon, tokens=toks, lm=str(arpa) if seed % 3 == 2 else None,
                  beam_size=10**4, beam_threshold=1e9, lm_weight=0.5 + seed % 3 * 0.5, word_score=(seed % 5 - 2) * 0.3,
                  sil_score=(seed % 3 - 1) * 0.4, nbest=1)
        for a, b in zip(theirs(**kw)(lp, lengths), ctc_decoder(**kw)(lp, lengths)):
            assert (a[0].tokens.tolist(), a[0].words, a[0].timesteps.tolist()) == (b[0].tokens.tolist(), b[0].words, b[0].timesteps.tolist()), seed
            assert abs(a[0].score - b[0].score) < 1e-4

def test_online_decoding_is_the_batch_call_and_the_tokens_file_is_read(tmp_path):
    toks = ['-', '|', 'a', 'b', 'c']
    (tmp_path / 'tokens.txt').write_text(''.join(f"{t}\n" for t in toks))
    decoder = ctc_decoder(_lexicon_file(tmp_path, ['a', 'ab', 'c']), str(tmp_path / 'tokens.txt'), beam_size=8)
    lp = torch.randn(1, 12, 5, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    decoder.decode_begin()
    for part in (lp[0, :5], lp[0, 5:]): decoder.decode_step(part)
    decoder.decode_end()
    online, batch = decoder.get_final_hypothesis()[0], decoder(lp)[0][0]
    assert online.tokens.tolist() == batch.tokens.tolist() and online.score == batch.score
    assert decoder.idxs_to_tokens(torch.tensor([2, 1])) == ['a', '|']

def test_when_no_hypothesis_ends_at_a_words_end_the_unfinished_word_is_not_counted(tmp_path):
    lp = torch.full((1, 4, 3), -1e30).double()
    lp[0, :, 2] = 0.0                          # 'a' every frame: a word ('a |') is never finished
    decoder = ctc_decoder(_lexicon_file(tmp_path, ['a']), ['-', '|', 'a'], beam_size=4)
    best = decoder(lp)[0][0]
    assert best.words == [] and best.score == 0.0 and decoder.idxs_to_tokens(best.tokens) == ['|', 'a', '|']

def test_a_silence_score_leaves_the_callers_emissions_as_they_were():
    "sil_score is added to a copy: float64 emissions on the CPU (which the face need not copy) come back unchanged."
    lp = torch.randn(2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    before = lp.clone()
    shifted = ctc_decoder(None, ['-', '|', 'a', 'b'], sil_score=1.5, beam_size=4)(lp)
    assert torch.equal(lp, before)
    lp2 = lp.clone(); lp2[..., 1] += 1.5
    assert [h[0].score for h in shifted] == [h[0].score for h in ctc_decoder(None, ['-', '|', 'a', 'b'], beam_size=4)(lp2)]

def test_cuda_ctc_decoders_call_searches_the_frames_it_keeps():
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 20, 5, generator=g).mul(3).log_softmax(-1)
    lengths = torch.tensor([20, 13, 0])
    toks = ['-', 'a', 'b', 'c', '|']
    every = cuda_ctc_decoder(toks, nbest=2, beam_size=4, blank_skip_threshold=1.0)(lp, lengths)
    plain = ctc_beam_search(lp, lengths, beam_width=4, nbest=2)
    assert [[(h.tokens, h.score) for h in x] for x in every] == [[(h.tokens.tolist(), h.score) for h in x] for x in plain]
    got = cuda_ctc_decoder(toks, beam_size=4, blank_skip_threshold=0.6)(lp, lengths)
    for b in range(3):
        kept = lp[b, :lengths[b]][lp[b, :lengths[b], 0] <= math.log(0.6)]
        want = ctc_beam_search(kept[None], beam_width=4)[0][0]
        assert got[b][0].tokens == want.tokens.tolist() and got[b][0].words == [toks[k] for k in want.tokens.tolist()]

@pytest.mark.parametrize('kwargs, error, message', [
    (dict(unk_score=0.0), NotImplementedError, 'unk_score'),
    (dict(lm_dict='dict.txt'), NotImplementedError, 'lm_dict'),
    (dict(sil_token='#'), ValueError, "sil_token '#'"),
    (dict(blank_token='#'), ValueError, "blank_token '#'"),
    (dict(tokens=['-', '|', 'a']), ValueError, "line 2: the tokens ['b']"),
    (dict(lm='lm.bin'), ValueError, 'ARPA file'),
    (dict(lm=3), NotImplementedError, 'lm must be'),
    (dict(nbest=0), ValueError, 'nbest'),
    (dict(beam_size=2, nbest=3), ValueError, 'nbest must be at most beam_size'),
    (dict(tokens=[]), TypeError, 'tokens'),
    (dict(backend='gpu'), ValueError, "backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"),
])
def test_bad_input_is_named(tmp_path, kwargs, error, message):
    args = {'lexicon': _lexicon_file(tmp_path, ['a', 'ab']), 'tokens': ['-', '|', 'a', 'b'], **kwargs}
    with pytest.raises(error, match=re.escape(message)): ctc_decoder(**args)

def test_a_spelling_that_is_not_its_word_is_refused_naming_its_line(tmp_path):
    (tmp_path / 'lexicon.txt').write_text("a a |\nab a b\n")
    with pytest.raises(NotImplementedError, match='line 2'): ctc_decoder(str(tmp_path / 'lexicon.txt'), ['-', '|', 'a', 'b'])
    decoder = ctc_decoder(None, ['-', '|', 'a', 'b'])
    with pytest.raises(ValueError, match='one column per token'): decoder(torch.zeros(1, 3, 5))

@pytest.mark.parametrize('kwargs, message', [(dict(blank_id=1), 'blank_id'), (dict(blank_skip_threshold=1.5), 'blank_skip_threshold'),
                                             (dict(beam_size=0), 'beam_size')])
def test_cuda_ctc_decoder_bad_input_is_named(kwargs, message):
    from seqdist.decode import CUCTCDecoder
    with pytest.raises(ValueError, match=message): CUCTCDecoder(['-', 'a'], **kwargs)
    with pytest.raises(ValueError, match='encoder_out_lens'): cuda_ctc_decoder(['-', 'a'])(torch.zeros(1, 3, 2), torch.tensor([4]))

def test_without_a_lexicon_the_lms_words_are_the_tokens(tmp_path):
    "The best hypothesis of enumeration: every label sequence's best path plus lm_weight times its tokens' log10 probability."
    import itertools
    toks = ['-', '|', 'a', 'b']
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        T = 1 + seed % 5
        lp = torch.randn(1, T, 4, generator=g).mul(2).log_softmax(-1)
        arpa = tmp_path / f'tokens{seed}.arpa'
        arpa.write_text(random_arpa(seed, toks[1:], order=2 + seed % 2, n_per_order=6, suffix_closed=True))
        lm, weight = NGramLM(str(arpa)), 0.5 + seed % 3 * 0.5
        best = max(float(forced_align(lp.double(), torch.tensor([list(seq) or [1]]), None, [len(seq)], 0, backend='cpu')[1].sum())
                   + weight * lm.score(' '.join(toks[k] for k in seq))
                   for L in range(T + 1) for seq in itertools.product(range(1, 4), repeat=L)
                   if L + sum(a == b for a, b in zip(seq, seq[1:])) <= T)
        got = ctc_decoder(None, toks, lm=str(arpa), lm_weight=weight, beam_size=10**4, beam_threshold=1e9)(lp)[0][0]
        assert abs(got.score - best) < 1e-9 and got.words == []
