"""seqdist.decode: the n-gram LM against the textbook back-off recursion and KenLM, and the CTC prefix beam search
against enumeration of every label sequence (a beam that keeps every prefix prunes nothing), its numba kernel against
its Python reference (with pruning), torchaudio's structure of the answer, and bad input."""
import math, random, tempfile
import pytest
import torch
from conftest import small_emformer_rnnt, word_option_searches
from seqdist.decode import (NGramLM, ArpaError, arpa_reference_scores, random_arpa, ctc_beam_search, CTCHypothesis,
                            ctc_nbest_brute_force, spell, Hotwords, phrase_tokens, ctc_beam_search_reference,
                            _ctc_beam_search_cpu)
from seqdist.ctc import forced_align, token_spans

WORDS = ['w0', 'w1', 'w2', 'w3', 'w4', 'w5']

@pytest.mark.parametrize('order', [1, 2, 3, 4])
def test_ngram_scores_equal_the_textbook_back_off_recursion(order):
    for seed in range(40):
        text = random_arpa(seed, WORDS, order=order, unk=seed % 3 != 0)
        lm, rng = NGramLM(text=text), random.Random(seed)
        for _ in range(6):
            sentence = ' '.join(rng.choice(WORDS + ['oov', '<unk>', '</s>']) for _ in range(rng.randint(0, 8)))
            for bos, eos in ((True, True), (False, False), (True, False)):
                got = [p for p, _, _ in lm.full_scores(sentence, bos, eos)]
                assert got == pytest.approx(arpa_reference_scores(text, sentence, bos, eos), abs=1e-12), (seed, sentence)

@pytest.mark.kenlm
def test_ngram_scores_equal_kenlms(tmp_path):
    import kenlm
    for seed in range(40):
        path = tmp_path / f'{seed}.arpa'
        path.write_text(random_arpa(seed, WORDS, order=2 + seed % 3, unk=seed % 3 != 0, suffix_closed=True))
        theirs, ours, rng = kenlm.Model(str(path)), NGramLM(path), random.Random(seed)
        for _ in range(8):
            sentence = ' '.join(rng.choice(WORDS + ['oov']) for _ in range(rng.randint(0, 8)))
            for bos, eos in ((True, True), (False, False), (False, True)):
                a, b = list(theirs.full_scores(sentence, bos=bos, eos=eos)), list(ours.full_scores(sentence, bos, eos))
                assert [x[1:] for x in a] == [x[1:] for x in b]                 # the n-gram lengths and OOV flags
                assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-5)   # (KenLM stores float32)
        assert ours.score('w0 w1 oov', True, True) == pytest.approx(theirs.score('w0 w1 oov', bos=True, eos=True), abs=1e-5)

def test_a_gzipped_arpa_file_loads(tmp_path):
    import gzip
    text = random_arpa(0, WORDS, order=3)
    with gzip.open(tmp_path / 'lm.arpa.gz', 'wt') as f: f.write(text)
    assert NGramLM(tmp_path / 'lm.arpa.gz').score('w0 w1') == NGramLM(text=text).score('w0 w1')

GOOD = "\\data\\\nngram 1=3\nngram 2=1\n\n\\1-grams:\n-1.0\t<s>\t-0.5\n-0.5\ta\t-0.2\n-0.7\t</s>\n\n\\2-grams:\n-0.1\t<s> a\n\n\\end\\\n"

@pytest.mark.parametrize('old, new, message', [
    ('\\data\\\n', '', r'line 1: .* before the \\data\\ line'),
    ('ngram 2=1', 'ngram 3=1', r"line 3: expected 'ngram 2=<count>'"),
    ('-0.5\ta\t-0.2', '-0.5\ta\t-0.2\t7', r"line 7: a 1-gram line .* got 4 fields"),
    ('-0.5\ta\t-0.2', 'x\ta', r'line 7: .* not a number'),
    ('-0.5\ta\t-0.2', '0.5\ta', r'line 7: the log10 probability must be <= 0'),
    ('-0.1\t<s> a', '-0.1\t<s> b', r"line 11: 'b' in the 2-gram '<s> b' is not a 1-gram"),
    ('-0.1\t<s> a', '-0.1\t<s> a\n-0.2\t<s> a', r"the header says 1 2-grams, the file has 2"),
    ('\\end\\\n', '', r'no \\end\\ line'),
    ('\\2-grams:', '\\3-grams:', r'line 10: \\3-grams: where the 2-grams should be'),
    ('-0.5\ta\t-0.2', '-0.5\ta\n-0.3\ta', r"line 8: the 1-gram 'a' is listed twice"),
])
def test_a_malformed_arpa_file_is_refused_naming_its_line(old, new, message):
    with pytest.raises(ArpaError, match=message): NGramLM(text=GOOD.replace(old, new))

def test_missing_contexts_and_repeated_ngrams_are_refused_naming_their_line():
    text = GOOD.replace('ngram 2=1', 'ngram 2=1\nngram 3=1').replace('\\end\\', '\\3-grams:\n-0.1\ta a </s>\n\n\\end\\')
    with pytest.raises(ArpaError, match=r"line 15: the 3-gram 'a a </s>': its context is not a 2-gram"): NGramLM(text=text)
    text = GOOD.replace('ngram 2=1', 'ngram 2=2').replace('-0.1\t<s> a', '-0.1\t<s> a\n-0.3\t<s> a')
    with pytest.raises(ArpaError, match=r"line 12: the 2-gram '<s> a' is listed twice"): NGramLM(text=text)

def test_the_lm_adds_unk_as_kenlm_does():
    lm = NGramLM(text=GOOD)
    assert lm.vocab[-1] == '<unk>' and lm.step(lm.null_state(), 'zebra')[0] == -100.0 and len(lm) == 5

ALPHABET = ['a', 'b', '|', 'c', '▁d', 'ab']
LM_WORDS = ['a', 'b', 'ab', 'ba', 'c', 'ca', 'd', 'dc', 'aa', 'bca']     # ('bc' spells no word)

def _case(seed, T_max=6, C_max=5):
    rng = random.Random(seed); torch.manual_seed(seed)
    T, C = rng.randint(1, T_max), rng.randint(2, C_max)
    blank = rng.randrange(C)
    tokens = ALPHABET[:C - 1]
    tokens = tokens[:blank] + ['-'] + tokens[blank:]
    lm = NGramLM(text=random_arpa(seed, sorted(set(LM_WORDS)), order=1 + seed % 3, n_per_order=20)) if seed % 2 else None
    weights = dict(lm_weight=rng.uniform(0, 2), word_score=rng.uniform(-1, 1)) if seed % 3 else {}
    return rng, torch.randn(T, C, dtype=torch.float64).mul(2).log_softmax(-1), blank, tokens, lm, weights

@pytest.mark.parametrize('merge', [False, True])
@pytest.mark.parametrize('backend', ['reference', 'cpu'])
def test_a_beam_that_keeps_every_prefix_finds_the_nbest_of_all_label_sequences(backend, merge):
    """The n best of every label sequence; with merge_delimiters, of every word sequence (the sequences that differ
    only in delimiters summed; hotwords then of labels that are no delimiter, whose count is the same in all)."""
    worst = 0.0
    for seed in range(60):
        rng, lp, blank, tokens, lm, weights = _case(seed)
        nbest, C = rng.randint(1, 5), len(tokens)
        labels = [k for k in range(C) if k != blank and not (merge and tokens[k] == '|')]
        hot = [(rng.choices(labels, k=rng.randint(1, 3)), rng.uniform(-0.5, 1.5)) for _ in range(seed % 4)]
        lexicon = rng.sample(LM_WORDS, 5) if seed % 5 == 1 else None
        got = ctc_beam_search(lp[None], beam_width=10**4, blank=blank, nbest=nbest, tokens=tokens, lm=lm, **weights,
                              hotwords=hot, lexicon=lexicon, backend=backend, merge_delimiters=merge)[0]
        want = ctc_nbest_brute_force(lp, nbest, blank, tokens, lm, **weights, hotwords=hot, lexicon=lexicon,
                                     merge_delimiters=merge)
        assert [tuple(h.tokens.tolist()) for h in got] == [s for _, s in want], seed
        worst = max(worst, max(abs(h.score - s) for h, (s, _) in zip(got, want)))
    assert worst < 1e-9

def test_the_kernel_equals_the_reference_with_pruning():
    for seed in range(60):
        rng, _, blank, tokens, lm, weights = _case(seed, C_max=6)
        N, T = rng.randint(1, 3), rng.randint(1, 14)
        C = len(tokens) if seed % 5 else 24           # C > 16: the kernel's sort of all tokens, past its top 16
        if C == 24: tokens, blank = ['-'] + [ALPHABET[i % 6] + 'xyz'[i // 6 % 3] * (i // 6) for i in range(23)], 0
        lp = torch.randn(N, T, C, dtype=torch.float64).mul(rng.choice([1, 3])).log_softmax(-1)
        labels = [k for k in range(C) if k != blank]
        hot = [(rng.choices(labels, k=rng.randint(1, 3)), rng.uniform(-0.5, 1.5)) for _ in range(seed % 3 * 2)]
        kw = dict(input_lengths=torch.randint(0, T + 1, (N,)), beam_width=rng.choice([1, 2, 4, 8]), blank=blank, hotwords=hot,
                  tokens=tokens if seed % 4 else None, lm=lm if seed % 4 else None, beam_threshold=rng.choice([math.inf, 1.0, 4.0]),
                  lexicon=rng.sample(LM_WORDS, 6) if seed % 4 and seed % 3 == 1 else None,
                  **(weights if seed % 4 else {}), merge_delimiters=bool(seed % 4) and seed % 7 < 3,
                  unk_score=-1.0 * (seed % 3), unk_prefix_score=-0.7 * (seed % 5 % 3))
        kw['nbest'] = rng.randint(1, kw['beam_width'])
        a, b = (ctc_beam_search(lp, **kw, backend=x) for x in ('reference', 'cpu'))
        for x, y in zip(a, b):
            assert [h.tokens.tolist() for h in x] == [h.tokens.tolist() for h in y], seed
            assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-9)

def test_hypotheses_have_torchaudios_structure_and_the_aligners_timesteps():
    torch.manual_seed(0)
    tokens = ['-', '|', 'a', 'b', 'c']
    lp = torch.randn(3, 12, 5).mul(3).log_softmax(-1)
    il = torch.tensor([12, 0, 7])
    out = ctc_beam_search(lp, il, beam_width=6, nbest=3, tokens=tokens)
    assert len(out) == 3 and len(out[1]) == 1 and out[1][0].tokens.numel() == 0 and out[1][0].score == 0.0
    for b, hyps in enumerate(out):
        assert [h.score for h in hyps] == sorted([h.score for h in hyps], reverse=True)
        for h in hyps:
            assert isinstance(h, CTCHypothesis) and h.tokens.dtype == torch.long and h.timesteps.dtype == torch.int32
            assert h.words == spell(h.tokens.tolist(), tokens)
            if h.tokens.numel():
                labels, scores = forced_align(lp[b:b + 1, :il[b]], h.tokens[None])
                assert torch.equal(h.timesteps, token_spans(labels, scores, [len(h.tokens)])[0][0].int())

def random_phrases(rng, C, most):
    "Up to `most` random phrases of 1-4 tokens in [1, C) (token 0, the blank, in none) and their weights in [-1, 2]."
    phrases = [rng.choices(range(1, C), k=rng.randint(1, 4)) for _ in range(rng.randint(1, most))]
    return phrases, [rng.uniform(-1, 2) for _ in phrases]

def test_the_hotword_automaton_credits_every_occurrence_and_drops_partial_matches():
    for seed in range(100):
        rng = random.Random(seed)
        C = rng.randint(2, 5)
        phrases, weights = random_phrases(rng, C, 6)
        hot = Hotwords(phrases, weights, C)
        seq = rng.choices(range(1, C), k=rng.randint(0, 12))
        s, earned = 0, 0.0
        for k in seq:
            gain = hot.done[hot.next(s, k)] + hot.partial[hot.next(s, k)]
            assert gain <= hot.next_bound[s] + 1e-12              # (the kernel's pruning bound holds)
            s = hot.next(s, k); earned += hot.done[s]
        direct = sum(w * len(p) for p, w in zip(phrases, weights) for i in range(len(seq)) if seq[i:i + len(p)] == p)
        assert earned == pytest.approx(direct, abs=1e-12)

def test_the_dense_move_table_is_the_automaton_and_the_kernel_answers_alike_without_it():
    for seed in range(30):
        rng = random.Random(seed)
        C = rng.randint(3, 12)
        phrases, weights = random_phrases(rng, C, 30)
        hot = Hotwords(phrases, weights, C)
        table = hot.moves().reshape(-1, C)
        assert [[int(table[s, k]) for k in range(C)] for s in range(len(hot.fail))] == \
               [[hot.next(s, k) for k in range(C)] for s in range(len(hot.fail))]
        assert hot.moves(budget=0).tolist() == hot.root            # (too big: the root's row, failure links past it)
        walked = Hotwords(phrases, weights, C)
        walked.moves = lambda: Hotwords.moves(walked, budget=0)
        lp = torch.randn(3, 14, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).mul(2).log_softmax(-1)
        kw = dict(beam_width=1 + seed % 6, nbest=1 + seed % 6 // 2, backend='cpu')
        dense, sparse = ctc_beam_search(lp, hotwords=hot, **kw), ctc_beam_search(lp, hotwords=walked, **kw)
        assert [[(h.tokens.tolist(), h.score) for h in u] for u in dense] == [[(h.tokens.tolist(), h.score) for h in u] for u in sparse]

@pytest.mark.parametrize('semiring', ['log', 'max'])
def test_the_kernel_with_every_word_option_pruned_is_the_reference(semiring):
    "LM or none, hotwords, a lexicon, the partial-word score, whole words and the lookahead, in turn, with pruning: the reference's hypotheses."
    for seed, args in word_option_searches(semiring):
        for ref, ker in zip(ctc_beam_search_reference(*args), _ctc_beam_search_cpu(*args)):
            assert [t for _, t in ref] == [t for _, t in ker], seed
            assert all(abs(a - b) < 1e-12 for (a, _), (b, _) in zip(ref, ker)), seed

def test_hotword_phrases_are_spelled_as_the_tokens_spell_words():
    assert phrase_tokens(['ab c', 'ba'], ['-', '|', 'a', 'b', 'c', 'ab']) == [[5, 1, 4], [3, 2]]
    assert phrase_tokens(['ab c'], ['-', ' ', 'a', 'b', 'c']) == [[2, 3, 1, 4]]
    assert phrase_tokens(['new york'], ['-', '▁new', '▁yo', 'rk', 'n']) == [[1, 2, 3]]
    assert phrase_tokens([[3, 1]], ['-', 'a']) == [[3, 1]]
    with pytest.raises(ValueError, match=r"hotwords: the tokens cannot spell 'xyz'"): phrase_tokens(['xyz'], ['-', 'a'])

def _cot_or_cat():
    "Tokens and emissions (1, 5, 6) that say 'c', then 'o' a little likelier than 'a', then 't', then blanks."
    tokens = ['-', '|', 'a', 'c', 'o', 't']
    p = torch.full((5, 6), 0.01)
    for t, (k, q) in enumerate([(3, .9), (4, .5), (5, .9), (0, .9), (0, .9)]): p[t, k] = q
    p[1, 2] = .4
    return tokens, (p / p.sum(1, keepdim=True)).log()[None]

def test_a_hotword_lifts_its_phrase():
    tokens, lp = _cot_or_cat()
    for backend in ('cpu', 'reference'):
        plain = ctc_beam_search(lp, beam_width=100, nbest=2, tokens=tokens, backend=backend)[0]   # (nothing pruned)
        assert [h.words for h in plain] == [['cot'], ['cat']]
        best = ctc_beam_search(lp, beam_width=100, tokens=tokens, hotwords={'cat': 0.2}, backend=backend)[0][0]
        assert best.words == ['cat'] and best.score == pytest.approx(plain[1].score + 3 * 0.2, abs=1e-12)

def test_a_lexicon_allows_its_words_only():
    tokens, lp = _cot_or_cat()
    for backend in ('cpu', 'reference'):
        hyps = ctc_beam_search(lp, beam_width=100, nbest=3, tokens=tokens, lexicon=['cat', 'at'], backend=backend)[0]
        assert hyps[0].words == ['cat'] and all(set(h.words) <= {'cat', 'at'} for h in hyps)   # (no 'cot')

def test_words_follow_delimiters_and_word_pieces():
    assert spell([2, 3, 1, 1, 4], ['-', '|', 'a', 'b', 'c']) == ['ab', 'c']
    assert spell([1, 2, 3, 1], ['-', '▁the', 're', '▁cat']) == ['there', 'cat', 'the']

def test_a_language_model_changes_the_best_hypothesis_as_it_should():
    tokens, lp = _cot_or_cat()
    lm = NGramLM(text="\\data\\\nngram 1=5\n\n\\1-grams:\n-99\t<s>\n-0.5\t</s>\n-0.3\tcat\n-3.0\tcot\n-2\t<unk>\n\n\\end\\\n")
    assert ctc_beam_search(lp, beam_width=8, tokens=tokens)[0][0].words == ['cot']
    assert ctc_beam_search(lp, beam_width=8, tokens=tokens, lm=lm, lm_weight=1.0)[0][0].words == ['cat']

@pytest.mark.parametrize('kwargs, error, message', [
    (dict(tokens=['-', 'a']), ValueError, r'tokens must be C = 4 strings'),
    (dict(lm='lm.arpa', tokens=['-', 'a', 'b', 'c']), TypeError, r'lm must be an NGramLM'),
    (dict(lm=NGramLM(text=GOOD)), ValueError, r'lm needs tokens'),
    (dict(nbest=5), ValueError, r'nbest must be in \[1, beam_width\] = \[1, 3\]'),
    (dict(input_lengths=torch.tensor([6, 9])), ValueError, r'input_lengths must be N = 2 integers in \[0, T\] = \[0, 6\]'),
    (dict(blank=4), ValueError, r'blank must be an int in \[0, 4\)'),
    (dict(hotwords=['ab']), ValueError, r'hotwords given as strings need tokens'),
    (dict(lexicon=['ab']), ValueError, r'lexicon needs tokens'),
    (dict(lexicon='ab', tokens=['-', 'a', 'b', 'c']), TypeError, r'lexicon must be a collection of words'),
    (dict(hotwords=[([1, 0], 1.0)]), ValueError, r'hotwords must be spelled by token ids in \[0, C\) = \[0, 4\) other than the blank 0'),
])
def test_bad_input_is_named(kwargs, error, message):
    lp = torch.randn(2, 6, 4).log_softmax(-1)
    with pytest.raises(error, match=message): ctc_beam_search(lp, **{'beam_width': 3, **kwargs})

def test_a_nan_is_refused_naming_its_sequence_and_padding_is_never_read():
    lp = torch.randn(2, 6, 4).log_softmax(-1)
    lp[1, 5, 2] = math.nan
    with pytest.raises(ValueError, match=r'log_probs of sequence 1 hold NaN or \+inf'): ctc_beam_search(lp, beam_width=3)
    assert len(ctc_beam_search(lp, torch.tensor([6, 5]), beam_width=3)) == 2

from seqdist.decode import transducer_greedy_decode, transducer_greedy_reference, random_transducer, torchaudio_rnnt_parts

@pytest.mark.parametrize('backend', ['cpu', 'torch'])
def test_batched_transducer_greedy_decoding_is_the_frame_by_frame_loops(backend):
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        V, B, T, blank, cap = 3 + seed % 9, 1 + seed % 6, 1 + seed % 13, seed % 3, 1 + seed % 4
        predict, join = random_transducer(V, seed=seed, dtype=torch.float64, blank=blank, blank_bias=seed % 5)
        enc = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        ours = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=blank, max_symbols_per_frame=cap, backend=backend)
        loop = transducer_greedy_reference(enc, lengths, predict, join, blank, cap)
        for a, b in zip(ours, loop):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.timesteps, b.timesteps), seed
            assert a.score == pytest.approx(b.score, abs=1e-9)
            assert (a.tokens != blank).all() and len(a.tokens) <= cap * T

@pytest.mark.torchaudio
def test_torchaudios_rnnt_is_decoded_as_it_is():
    model = small_emformer_rnnt()
    with torch.no_grad(): enc, lengths = model.transcribe(torch.randn(3, 16, 20), torch.tensor([16, 9, 12]))
    predict, join = torchaudio_rnnt_parts(model)
    with torch.no_grad():
        ours = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=9, max_symbols_per_frame=3)
        loop = transducer_greedy_reference(enc, lengths, predict, join, 9, 3)
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.timesteps, b.timesteps) for a, b in zip(ours, loop))
    assert sum(len(h.tokens) for h in ours) > 0

@pytest.mark.parametrize('kwargs, message', [
    (dict(encoder_lengths=torch.tensor([5, 9])), r'encoder_lengths must be B = 2 lengths in \[0, T\] = \[0, 6\]'),
    (dict(max_symbols_per_frame=0), r'max_symbols_per_frame must be an int >= 1'),
    (dict(encoder_out=torch.randn(6, 16)), r'encoder_out must be \(B, T, H\)'),
    (dict(backend='numba'), r"backend must be 'auto', 'cpu' or 'torch', got 'numba'"),
    (dict(encoder_out=torch.randn(2, 6, 16, device='meta'), backend='cpu'), r"backend='cpu' needs CPU tensors, got encoder_out on meta"),
])
def test_transducer_greedy_bad_input_is_named(kwargs, message):
    predict, join = random_transducer(5)
    call = {**dict(encoder_out=torch.randn(2, 6, 16), predict=predict, join=join, blank=0), **kwargs}
    with pytest.raises(ValueError, match=message): transducer_greedy_decode(**call)

def _random_case(kind, seed):
    "A random RNN-T, TDT or multi-blank model with its blank, options, encoder output and lengths."
    g = torch.Generator().manual_seed(seed)
    V, B, T, cap = 4 + seed % 8, 1 + seed % 6, 1 + seed % 13, 1 + seed % 4
    blank, opts = seed % 3, {}
    if kind == 'tdt': opts = dict(durations=[[0, 1, 2], [1, 2, 3, 4], [0, 2], [1]][seed % 4])
    if kind == 'multiblank': blank, opts = V - 1, dict(big_blank_durations=[[2], [2, 4], [3, 2, 8]][seed % 3])
    predict, join = random_transducer(V, seed=seed, dtype=torch.float64, blank=blank, blank_bias=seed % 5,
                                      extra=len(opts.get('durations', ())))
    enc = torch.randn(B, T, 16, generator=g, dtype=torch.float64) * (1 + seed % 3)
    return predict, join, enc, torch.randint(0, T + 1, (B,), generator=g), blank, cap, opts

@pytest.mark.parametrize('backend', ['cpu', 'torch'])
@pytest.mark.parametrize('kind', ['tdt', 'multiblank'])
def test_batched_tdt_and_multiblank_greedy_decoding_is_the_loops(kind, backend):
    for seed in range(30):
        predict, join, enc, lengths, blank, cap, opts = _random_case(kind, seed)
        ours = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=blank, max_symbols_per_frame=cap,
                                        backend=backend, **opts)
        loop = transducer_greedy_reference(enc, lengths, predict, join, blank, cap, **opts)
        for a, b in zip(ours, loop):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.timesteps, b.timesteps), seed
            assert a.score == pytest.approx(b.score, abs=1e-9)
            assert ((a.tokens != blank) & ((blank - a.tokens > len(opts.get('big_blank_durations', ()))) | (a.tokens > blank))).all()
            if 0 not in opts.get('durations', [0]): assert (a.timesteps.diff() > 0).all()   # every symbol moves on

def _scripted(kind):
    """A model whose choices are known: at frame t (the encoder output's first number) with u labels so far, the label
    1 + t % 4 (duration 0) while u < t // 3 + 1, else a blank (TDT: of duration 3) or big blank of 3 frames. It emits
    at frames 0, 3, 6, ...: labels 1, 4, 3, 2, 1, ..."""
    V, blank = 7, 6
    def predict(tokens, state):
        u = torch.zeros(tokens.shape[0], dtype=torch.float64) if state is None else state + 1
        return u[:, None], u
    def join(frames, pred):
        t, u = frames[:, 0].long(), pred[:, 0]
        emit = u < t // 3 + 1
        logits = torch.full((frames.shape[0], V + (2 if kind == 'tdt' else 0)), -10.0, dtype=torch.float64)
        batch = torch.arange(frames.shape[0])
        logits[batch, torch.where(emit, 1 + t % 4, blank if kind == 'tdt' else blank - 1)] = 10.0
        if kind == 'tdt': logits[batch, V + (~emit).long()] = 10.0           # durations [0, 3]
        return logits
    return predict, join, blank, (dict(durations=[0, 3]) if kind == 'tdt' else dict(big_blank_durations=[3]))

@pytest.mark.parametrize('backend', ['cpu', 'torch'])
@pytest.mark.parametrize('kind', ['tdt', 'multiblank'])
def test_tdt_and_multiblank_greedy_moves_by_the_chosen_durations(kind, backend):
    predict, join, blank, opts = _scripted(kind)
    enc = torch.arange(11, dtype=torch.float64)[None, :, None].expand(2, 11, 3).contiguous()
    hyps = transducer_greedy_decode(enc, torch.tensor([11, 5]), predict=predict, join=join, blank=blank, backend=backend, **opts)
    assert hyps[0].tokens.tolist() == [1, 4, 3, 2] and hyps[0].timesteps.tolist() == [0, 3, 6, 9]
    assert hyps[1].tokens.tolist() == [1, 4] and hyps[1].timesteps.tolist() == [0, 3]

@pytest.mark.parametrize('kwargs, message', [
    (dict(durations=[0, 1], big_blank_durations=[2]), r'give durations \(a TDT\) or big_blank_durations'),
    (dict(durations=[]), r'durations must be a non-empty list of ints >= 0'),
    (dict(durations=[1, -1]), r'durations must be a non-empty list of ints >= 0'),
    (dict(big_blank_durations=[0], blank=4), r'big_blank_durations must be a non-empty list of ints >= 1'),
    (dict(big_blank_durations=[2, 3], blank=1), r'2 big blanks must come before the blank \(1\)'),
    (dict(blank=7), r"blank must be one of the model's symbols: predict refused 7 as the start token"),
    (dict(blank=-1), r'blank must be the blank.s index, an int >= 0'),
])
def test_tdt_and_multiblank_options_are_checked(kwargs, message):
    predict, join = random_transducer(5, extra=2 if 'durations' in kwargs and 'big_blank_durations' not in kwargs else 0)
    call = {**dict(encoder_out=torch.randn(2, 6, 16), predict=predict, join=join, blank=0), **kwargs}
    with pytest.raises(ValueError, match=message): transducer_greedy_decode(**call)

def test_a_blank_past_the_joiners_symbols_is_named():
    predict, join, _, opts = _scripted('multiblank')             # (its predictor takes any start token)
    with pytest.raises(ValueError, match=r"blank must be one of the joiner's 7 symbols, got 7"):
        transducer_greedy_decode(torch.zeros(1, 4, 3, dtype=torch.float64), predict=predict, join=join, blank=7, **opts)

def test_greedy_decoding_reading_the_host_every_few_steps_is_the_same(monkeypatch):
    "As on a GPU (the host reads whether any utterance goes on every _SYNC_EVERY steps): the loop's labels, frames, scores."
    import seqdist.decode as D
    monkeypatch.setitem(D._SYNC_EVERY, 'cpu', 5)
    for kind, opts in (('rnnt', {}), ('tdt', dict(durations=[0, 1, 2])), ('multiblank', dict(big_blank_durations=[2]))):
        predict, join = random_transducer(6, seed=3, dtype=torch.float64, blank=5 if kind == 'multiblank' else 0,
                                          extra=len(opts.get('durations', ())))
        enc, lengths = torch.randn(4, 13, 16, dtype=torch.float64), torch.tensor([13, 7, 0, 2])
        blank = 5 if kind == 'multiblank' else 0
        ours = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=blank, max_symbols_per_frame=2,
                                        backend='torch', **opts)
        loop = transducer_greedy_reference(enc, lengths, predict, join, blank, 2, **opts)
        for a, b in zip(ours, loop):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.timesteps, b.timesteps) and abs(a.score - b.score) < 1e-9
