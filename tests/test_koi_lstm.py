"""seqdist.koi.lstm (koi.lstm's update_graph): a CRF encoder's training scores (T, N, 5 C), each state's stay column
(a constant) then its four moves, come out as (N, T, 4 C), element for element; scores without stay columns are only
transposed (a view); the decode of the wrapped encoder's output is the decode of the training scores' moves; stays
that vary, odd widths and bad arguments are refused with errors naming the cause. (install_as_koi registers it:
tests/test_koi_decode.py; tests/test_koi_bonito.py runs bonito's own model and basecaller through it.)"""
import warnings
import pytest, torch
from seqdist.koi import lstm, decode

class Head(torch.nn.Module):
    "A CRF head as bonito's: features (T, N, 4 C) -> scores (T, N, 5 C), each state's stay the constant blank_score."
    def __init__(self, blank_score=2.0, expand_blanks=True):
        super().__init__()
        self.blank_score, self.expand_blanks = blank_score, expand_blanks
    def forward(self, x):
        if not self.expand_blanks: return x
        T, N, W = x.shape
        out = x.new_full((T, N, W // 4 * 5), self.blank_score)
        for c in range(W // 4):
            out[:, :, 5 * c + 1:5 * c + 5] = x[:, :, 4 * c:4 * c + 4]
        return out

@pytest.mark.parametrize('state_len', [1, 2, 3])
@pytest.mark.parametrize('dtype', [torch.float16, torch.float32, torch.float64])
def test_the_layout_element_for_element(state_len, dtype):
    T, N, C = 7, 3, 4 ** state_len
    scores = torch.randn(T, N, 5 * C, dtype=dtype)
    scores[:, :, ::5] = 2.0
    out = lstm.koi_layout(scores)
    assert out.shape == (N, T, 4 * C) and out.dtype == dtype
    for n in range(N):
        for t in range(T):
            for c in range(C):
                for j in range(4):
                    assert out[n, t, 4 * c + j] == scores[t, n, 5 * c + 1 + j]
    moves_only = torch.randn(T, N, 4 * C, dtype=dtype)
    assert torch.equal(lstm.koi_layout(moves_only), moves_only.transpose(0, 1))
    assert lstm.koi_layout(moves_only).data_ptr() == moves_only.data_ptr()          # a view

def test_update_graph_wraps_the_encoder_and_the_decode_is_the_training_scores():
    torch.manual_seed(0)
    features = 3 * torch.randn(20, 2, 64)                       # (T, N, 4 C), state_len 2
    encoder = torch.nn.Sequential(torch.nn.Identity(), Head(2.0))
    koi_encoder = lstm.update_graph(encoder, batchsize=64, chunksize=1000, quantize=False)
    assert isinstance(koi_encoder, lstm.KoiScores) and koi_encoder.encoder is encoder
    assert lstm.update_graph(koi_encoder) is koi_encoder                       # idempotent
    assert list(koi_encoder.parameters()) == list(encoder.parameters())
    out = koi_encoder(features)
    assert torch.equal(out, features.transpose(0, 1))
    for a, b in zip(decode.beam_search(out), decode.beam_search(features.transpose(0, 1).contiguous())):
        assert torch.equal(a, b)
    no_stays = lstm.update_graph(Head(2.0, expand_blanks=False))                # a head that leaves the stays out
    assert torch.equal(no_stays(features), features.transpose(0, 1))

def test_stays_that_vary_are_refused():
    scores = torch.randn(5, 2, 5 * 16)
    with pytest.raises(ValueError, match=r"the encoder's stay scores vary .*one constant blank_score"):
        lstm.koi_layout(scores)
    with pytest.raises(ValueError, match=r"learns its stay scores \(blank_score = None\)"):
        lstm.update_graph(torch.nn.Sequential(Head(None)))

@pytest.mark.parametrize('call, error, match', [
    (lambda: lstm.koi_layout(torch.zeros(5, 2, 6 * 16)), ValueError, r"width 96: a CRF's is 5 \* 4 \*\* state_len"),
    (lambda: lstm.koi_layout(torch.zeros(5, 2, 32)), ValueError, r"width 32"),
    (lambda: lstm.koi_layout(torch.zeros(5, 80)), ValueError, r"must output scores \(T, N, W\), got torch.Size\(\[5, 80\]\)"),
    (lambda: lstm.update_graph(None), TypeError, r"model must be a torch.nn.Module .*got NoneType"),
    (lambda: lstm.update_graph(Head(), batchsize=0), ValueError, r"batchsize must be a positive int or None, got 0"),
    (lambda: lstm.update_graph(Head(), chunksize=2.5), ValueError, r"chunksize must be a positive int or None, got 2.5"),
    (lambda: lstm.update_graph(Head(), batchsize=True), ValueError, r"batchsize must be a positive int or None, got True"),
])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match): call()

def test_quantize_warns_that_the_weights_stay_floating_point():
    with pytest.warns(UserWarning, match=r"quantize=True.*floating point"):
        lstm.update_graph(Head(), quantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        lstm.update_graph(Head(), quantize=False)
