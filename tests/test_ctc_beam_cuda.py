"""The CTC prefix beam search's CUDA kernel (`ctc_beam_search(backend='cuda')`), through the emulator on CPU tensors:
the CPU kernel's hypotheses and scores, its refusals, and `cuda_ctc_decoder`'s face on it."""
import math, random
import pytest
from conftest import word_option_searches
import torch
from seqdist.decode import (ctc_beam_search, PrefixScorer, NGramLM, random_arpa, cuda_ctc_decoder, _ctc_beam_search_cpu,
                            _ctc_beam_search_cuda, Hotwords, ctc_decoder)

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_the_emulated_kernel_gives_the_cpu_kernels_hypotheses(semiring):
    for seed in range(16):
        g = torch.Generator().manual_seed(seed)
        N, T, C = 3, 1 + seed % 9, (2, 5, 11, 24)[seed % 4]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        il = torch.randint(0, T + 1, (N,), generator=g)
        beam = 1 + seed % 6
        args = (lp, il, beam, seed % C, 1 + seed % min(3, beam), PrefixScorer(C, seed % C), (math.inf, 3.0)[seed % 3 == 1], False, semiring)
        for cpu, cuda in zip(_ctc_beam_search_cpu(*args), _ctc_beam_search_cuda(*args)):
            assert [s for _, s in cpu] == [s for _, s in cuda], seed
            assert all(abs(a - b) < 1e-12 for (a, _), (b, _) in zip(cpu, cuda))

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_with_a_token_lm_the_emulated_kernel_gives_the_cpu_kernels_hypotheses(semiring):
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        N, T, C = 3, 2 + seed % 8, (4, 7, 13)[seed % 3]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        toks, blank = [f't{i}' for i in range(C)], seed % C
        lm = NGramLM(text=random_arpa(seed, toks[1:], order=1 + seed % 3, n_per_order=10))   # (t0: <unk>)
        scorer = PrefixScorer(C, blank, toks, lm, 0.8, (seed % 5 - 2) * 0.3, unk_score=-1.5, lm_tokens=True)
        args = (lp, torch.randint(0, T + 1, (N,), generator=g), 1 + seed % 5, blank, 1 + seed % 2, scorer, math.inf, False, semiring)
        for cpu, cuda in zip(_ctc_beam_search_cpu(*args), _ctc_beam_search_cuda(*args)):
            assert [s for _, s in cpu] == [s for _, s in cuda], seed
            assert all(abs(a - b) < 1e-12 for (a, _), (b, _) in zip(cpu, cuda))

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_with_hotwords_the_emulated_kernel_gives_the_cpu_kernels_hypotheses(semiring):
    "Small and large automata, dense moves and the failure-link walk, with and without a token LM."
    for seed in range(18):
        g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        N, T, C = 3, 1 + seed % 9, (3, 5, 11, 24)[seed % 4]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        blank = seed % C
        phrases = [rng.choices([k for k in range(C) if k != blank], k=rng.randint(1, 3)) for _ in range(rng.randint(1, 12))]
        hot = Hotwords(phrases, [rng.uniform(-0.5, 2) for _ in phrases], C)
        if seed % 3 == 0: hot.moves = (lambda h: lambda: Hotwords.moves(h, budget=0))(hot)   # (the root's row only)
        toks = [f't{i}' for i in range(C)]
        lm = NGramLM(text=random_arpa(seed, [t for i, t in enumerate(toks) if i != blank], order=1 + seed % 3, n_per_order=10))
        scorer = (PrefixScorer(C, blank, toks, lm, 0.8, 0.2, hotwords=hot, lm_tokens=True) if seed % 2 else
                  PrefixScorer(C, blank, hotwords=hot))
        beam = 1 + seed % 6
        args = (lp, torch.randint(0, T + 1, (N,), generator=g), beam, blank, 1 + seed % min(3, beam), scorer,
                (math.inf, 3.0)[seed % 3 == 1], False, semiring)
        for cpu, cuda in zip(_ctc_beam_search_cpu(*args), _ctc_beam_search_cuda(*args)):
            assert [s for _, s in cpu] == [s for _, s in cuda], seed
            assert all(abs(a - b) < 1e-12 for (a, _), (b, _) in zip(cpu, cuda))

def test_hotwords_that_lift_unlikely_tokens_are_found_as_the_cpu_kernel_finds_them():
    "Heavy phrases over 32 tokens and narrow beams: the tokens that win are not the frame's likeliest (each beam's own list)."
    for seed in range(6):
        g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        lp = torch.randn(2, 16, 32, generator=g, dtype=torch.float64).mul(3).log_softmax(-1)
        phrases = [rng.choices(range(1, 32), k=rng.randint(1, 3)) for _ in range(40)]
        scorer = PrefixScorer(32, 0, hotwords=Hotwords(phrases, [rng.uniform(2, 6) for _ in phrases], 32))
        for semiring in ('log', 'max'):
            args = (lp, torch.tensor([16, 11]), 2 + seed % 3, 0, 1, scorer, math.inf, False, semiring)
            assert _ctc_beam_search_cpu(*args) == _ctc_beam_search_cuda(*args)

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_with_words_spelled_by_tokens_the_emulated_kernel_gives_the_cpu_kernels_hypotheses(semiring):
    "Characters, delimiters and word starts ('▁'), a word LM of orders 1 to 3 (or none), word and unknown-word scores, hotwords."
    tokens5, words5 = ['-', 'a', 'b', '|', '▁c'], ['a', 'b', 'ab', 'ba', 'c', 'ca', 'cab', 'bab']
    for seed in range(24):
        g = torch.Generator().manual_seed(seed)
        N, T, C = 3, 2 + seed % 10, (5, 24)[seed % 2]
        toks = tokens5 if C == 5 else ['-', '|'] + [('▁' if i % 5 == 0 else '') + a + b for i, (a, b) in
                                                    enumerate((a, b) for a in 'abcd' for b in ('', 'a', 'b', 'ab', 'ba', 'ca'))][:C - 2]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        lm = NGramLM(text=random_arpa(seed, words5, order=1 + seed % 3, n_per_order=15)) if seed % 4 else None
        hot = Hotwords([[1, 2], [2, 3, 1], [3]], [0.5, 1.0, -0.2], C) if seed % 3 == 0 else None
        scorer = PrefixScorer(C, 0, toks, lm, 0.7, (seed % 5 - 2) * 0.3, hotwords=hot, unk_score=(0.0, -1.5)[seed % 2])
        args = (lp, torch.randint(0, T + 1, (N,), generator=g), 1 + seed % 6, 0, 1 + seed % 2, scorer,
                (math.inf, 2.0)[seed % 2], False, semiring)
        assert _ctc_beam_search_cpu(*args) == _ctc_beam_search_cuda(*args), seed

def test_a_word_score_that_lifts_unlikely_delimiters_is_found_as_the_cpu_kernel_finds_it():
    "A large word score over 40 tokens and narrow beams: the delimiters that win are not the frame's likeliest (each beam's own list)."
    toks = ['-', '|'] + [chr(97 + i % 26) + ('' if i < 26 else 'x') for i in range(38)]
    for seed in range(6):
        lp = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).mul(3).log_softmax(-1)
        lm = NGramLM(text=random_arpa(seed, ['a', 'b', 'ab', 'cd'], order=2, n_per_order=8)) if seed % 2 else None
        for semiring in ('log', 'max'):
            args = (lp, torch.tensor([16, 12]), 2 + seed % 2, 0, 1, PrefixScorer(40, 0, toks, lm, 0.5, 6.0), math.inf, False, semiring)
            assert _ctc_beam_search_cpu(*args) == _ctc_beam_search_cuda(*args), seed

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_with_every_word_option_the_emulated_kernel_gives_the_cpu_kernels_hypotheses(semiring):
    "LM or none, hotwords, a lexicon, the partial-word score, whole words, the lookahead and merged delimiters, in turn."
    for seed, args in word_option_searches(semiring, merge=lambda seed: seed % 5 == 0 or seed % 7 == 1):
        assert _ctc_beam_search_cpu(*args) == _ctc_beam_search_cuda(*args), seed

def test_the_public_call_runs_it_and_masked_tokens_are_never_chosen():
    lp = torch.randn(2, 12, 7, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    lp[..., 3] = -math.inf                                   # a token no frame may emit
    got = ctc_beam_search(lp, torch.tensor([12, 5]), beam_width=5, nbest=2, backend='cuda')
    want = ctc_beam_search(lp, torch.tensor([12, 5]), beam_width=5, nbest=2, backend='cpu')
    assert [[(h.tokens.tolist(), h.score, h.timesteps.tolist()) for h in x] for x in got] == \
           [[(h.tokens.tolist(), h.score, h.timesteps.tolist()) for h in x] for x in want]
    assert all(3 not in h.tokens.tolist() for x in got for h in x)

def test_an_unknown_backend_is_refused():
    lp = torch.randn(1, 6, 4).log_softmax(-1)
    with pytest.raises(ValueError, match='backend'):
        ctc_beam_search(lp, beam_width=3, backend='gpu')

def test_cuda_ctc_decoders_face_runs_the_search_of_the_frames_it_keeps():
    lp = torch.randn(2, 15, 5, generator=torch.Generator().manual_seed(2)).mul(3).log_softmax(-1)
    got = cuda_ctc_decoder(['-', 'a', 'b', 'c', 'd'], nbest=2, beam_size=4, blank_skip_threshold=1.0)(lp, torch.tensor([15, 9]))
    want = ctc_beam_search(lp, torch.tensor([15, 9]), beam_width=4, nbest=2, backend='cuda')
    assert [[(h.tokens, h.score) for h in x] for x in got] == [[(h.tokens.tolist(), h.score) for h in x] for x in want]

@pytest.mark.parametrize('log_add', [False, True])
def test_ctc_decoders_face_on_the_cuda_kernel_gives_the_cpu_kernels_hypotheses(tmp_path, log_add):
    "torchaudio's face with backend='cuda' (the kernel a CUDA tensor's search runs, emulated): a lexicon, a word LM, silence scores."
    toks, words = ['-', '|', 'a', 'b', 'c'], ['a', 'ab', 'ba', 'c', 'cab', 'bb']
    (tmp_path / 'lexicon.txt').write_text(''.join(f"{w} {' '.join(w)} |\n" for w in words))
    (tmp_path / 'lm.arpa').write_text(random_arpa(0, words, order=3, n_per_order=10, suffix_closed=True))
    for seed, lexicon in enumerate([str(tmp_path / 'lexicon.txt'), None] * 3):
        g = torch.Generator().manual_seed(seed)
        lp = torch.randn(3, 12, 5, generator=g).mul(1 + seed % 3).log_softmax(-1)
        lengths = torch.tensor([12, 7, 0])
        kw = dict(lexicon=lexicon, tokens=toks, lm=str(tmp_path / 'lm.arpa'), nbest=1 if lexicon else 3, beam_size=6, log_add=log_add,
                  sil_score=(seed % 3 - 1) * 0.4, word_score=0.5)
        cpu, cuda = ctc_decoder(**kw, backend='cpu')(lp, lengths), ctc_decoder(**kw, backend='cuda')(lp, lengths)
        assert [[(h.tokens.tolist(), h.words, h.timesteps.tolist(), h.score) for h in x] for x in cuda] == \
               [[(h.tokens.tolist(), h.words, h.timesteps.tolist(), h.score) for h in x] for x in cpu], seed
