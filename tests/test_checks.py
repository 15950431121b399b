"""seqdist.checks: `require` raises a ValueError with its message on the host, and `count_checks` counts every check by
its message's docstring, on the host and on a GPU alike."""
import pytest, torch
import math
import numpy as np
from seqdist.checks import require, check_labels, count_checks, finite_real

def test_count_checks_counts_every_require_by_its_docstring():
    def lengths():
        "input_lengths must be positive"
        return "input_lengths must be positive, got [-1]"
    with count_checks() as outer:
        require(torch.tensor(True), True, lengths)
        with count_checks() as inner:
            require(torch.tensor(True), True, lambda: "no docstring")
            with pytest.raises(ValueError, match=r"input_lengths must be positive, got \[-1\]"):
                require(torch.tensor(False), True, lengths)
            check_labels(torch.tensor([[1, 2]]), torch.tensor([[True, True]]), 3, blank=0, host=True)
    assert inner == {'input_lengths must be positive': 1, 'bad input': 1, 'target labels out of range or equal to blank': 1}
    assert outer == {'input_lengths must be positive': 2, 'bad input': 1, 'target labels out of range or equal to blank': 1}
    require(torch.tensor(True), True, lengths)                    # outside the blocks: counted nowhere
    assert sum(outer.values()) == 4

def test_finite_real_takes_real_numbers_and_names_the_rest():
    assert [finite_real(x, 'clamp') for x in (1, -0.5, np.float32(0.25), np.int64(3))] == [1.0, -0.5, 0.25, 3.0]
    for bad, error, message in ((True, TypeError, "clamp must be a real number, got True"),
                                ('0.1', TypeError, "clamp must be a real number, got '0.1'"),
                                (torch.tensor(0.1), TypeError, "clamp must be a real number"),
                                (math.nan, ValueError, "clamp must be finite, got nan"),
                                (-math.inf, ValueError, "clamp must be finite, got -inf")):
        with pytest.raises(error, match=message): finite_real(bad, 'clamp')
