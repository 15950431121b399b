"""build_ctcdecoder, pyctcdecode's face on ctc_beam_search(merge_delimiters=True): its labels, its results' structure
and words' frames, its refusals, and, where pyctcdecode 0.5.0 is installed (`make install`), its texts and scores
against pyctcdecode's on random cases searched exhaustively (no LM: with one, pyctcdecode scores a text whose likelier
form ends in a space as if an empty word followed, nbs/11b_pyctcdecode.ipynb)."""
import logging, os
import numpy as np
import pytest, torch
from seqdist.decode import build_ctcdecoder, pyctcdecode_labels, word_arpa, random_arpa

LABEL_SETS = [['', 'a', 'b', ' '], ['<pad>', 'a', 'b', '|'], ['_', 'a', '|', 'b'], ['a', 'b', ' '], ['[PAD]', '<unk>', 'a', ' '],
              ['<pad>', '▁a', 'b', '▁bc'], ['[PAD]', 'a', '##b', '##c', 'd'], ['', '|', ' ', 'a']]

@pytest.mark.pyctcdecode
@pytest.mark.parametrize('labels', LABEL_SETS)
def test_labels_are_read_as_pyctcdecode_reads_them(labels):
    from pyctcdecode.alphabet import Alphabet
    logging.getLogger('pyctcdecode').setLevel(logging.ERROR)
    theirs = Alphabet.build_alphabet(labels)
    assert pyctcdecode_labels(labels) == (theirs.labels, theirs.is_bpe)

def _logits(seed, C=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(2 + seed % 5, C)) * (1 + seed % 3)

@pytest.mark.pyctcdecode
def test_texts_and_scores_are_pyctcdecodes_without_an_lm():
    from pyctcdecode import build_ctcdecoder as theirs
    logging.getLogger('pyctcdecode').setLevel(logging.ERROR)
    for labels in (['', 'a', 'b', 'c', ' '], ['a', '|', 'b', '<pad>', 'c']):
        for seed in range(25):
            x = _logits(seed)
            want = theirs(labels).decode_beams(x, beam_width=10**4, beam_prune_logp=-1000, token_min_logp=-1000)
            got = build_ctcdecoder(labels).decode_beams(x, beam_width=10**4, beam_prune_logp=-1000)
            assert [b[0] for b in got[:3]] == [b[0] for b in want[:3]], seed
            for g, w in zip(got[:3], want[:3]): assert g[3] == pytest.approx(w[3], abs=1e-9) and g[4] == pytest.approx(w[4], abs=1e-9)

def _spoken(labels, text, T_per=3, seed=0):
    "Logits that spell `text`, each character over T_per - 1 frames and a blank."
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T_per * len(text), len(labels)))
    for t, ch in enumerate(text):
        x[T_per * t:T_per * t + T_per - 1, labels.index(ch)] += 8; x[T_per * t + T_per - 1, labels.index('<pad>')] += 8
    return x

def test_beams_have_pyctcdecodes_structure_and_the_aligners_word_frames():
    labels = ['<pad>', 'a', 'b', 'c', '|']
    x = _spoken(labels, 'ab|ca|')
    beams = build_ctcdecoder(labels).decode_beams(x, beam_width=8)
    text, state, frames, logit, combined = beams[0]
    assert text == 'ab ca' and state is None and frames == [('ab', (0, 5)), ('ca', (9, 14))]
    assert logit == pytest.approx(combined) and combined == max(b[4] for b in beams)   # (no LM: the two agree)
    assert build_ctcdecoder(labels).decode(x) == 'ab ca'
    assert build_ctcdecoder(labels).decode_batch(None, [x, x[:12]]) == ['ab ca', 'ab c']

def test_the_lm_picks_its_words(tmp_path):
    labels = ['<pad>', 'a', 'b', 'c', '|']
    x = _spoken(labels, 'ab|ca|')
    x[9:11] = 0.0                                                  # 'c' or 'b' alike: the LM decides
    x[9:11, labels.index('c')] = x[9:11, labels.index('b')] = 5
    path = str(tmp_path / 'lm.arpa')
    with open(path, 'w') as f: f.write("\\data\\\nngram 1=6\n\n\\1-grams:\n-99\t<s>\t0\n-1\t</s>\n-3\t<unk>\n-1\tab\t0\n-1\tba\t0\n-9\tca\t0\n\n\\end\\\n")
    assert build_ctcdecoder(labels).decode(x) in ('ab ca', 'ab ba')
    assert build_ctcdecoder(labels, path, alpha=1.0, beta=0.0).decode(x) == 'ab ba'

def test_hotwords_lift_a_phrase():
    labels = ['<pad>', 'a', 'b', 'c', '|']
    x = _spoken(labels, 'ab|ca|')
    x[9:11, labels.index('b')] = x[9:11, labels.index('c')] - 1.0     # 'ba' a little less likely than 'ca'
    d = build_ctcdecoder(labels)
    assert d.decode(x) == 'ab ca' and 'ba' in d.decode(x, hotwords=['ba'], hotword_weight=5.0)   # (wherever it occurs)

@pytest.mark.parametrize('kwargs, message', [
    (dict(kenlm_model_path='lm.binary'), r"kenlm_model_path must be an ARPA file"),
    (dict(lm_score_boundary=False), r"lm_score_boundary=False .* is not supported"),
    (dict(unigrams=['ab']), r"unigrams other than the ARPA file's own words are not supported"),
])
def test_what_the_face_does_not_do_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message): build_ctcdecoder(['', 'a', ' '], **kwargs)

def test_bad_labels_and_logits_are_named():
    with pytest.raises(ValueError, match=r"labels must not hold duplicate entries"): build_ctcdecoder(['', 'a', 'a'])
    with pytest.raises(TypeError, match=r"labels must be a non-empty list of strings"): build_ctcdecoder([1, 2])
    with pytest.raises(ValueError, match=r"logits must be \(T, 3\), a column per label"):
        build_ctcdecoder(['', 'a', ' ']).decode(np.zeros((5, 4)))

def test_a_bar_beside_a_space_is_a_character():
    labels = ['<pad>', 'a', '|', ' ']
    x = _spoken(labels, 'a|a a ')
    assert build_ctcdecoder(labels).decode_beams(x)[0][:3:2] == ('a|a a', [('a|a', (0, 8)), ('a', (12, 14))])
