"""Every other declared bad-input table (`tests/test_declared.py` runs the others and says how): a file of their
own, so that pytest-xdist's two workers share the tables."""
import pytest
from test_declared import declared_functions, run_table

@pytest.mark.parametrize('target', declared_functions()[1::2])
def test_every_row_of_the_table_raises_an_error_naming_its_argument(target): run_table(target)
