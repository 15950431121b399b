import os, pathlib, pytest, torch

KERNELS = pathlib.Path(__file__).parent / 'kernels'

@pytest.fixture(autouse=True)
def _threads_and_seed():
    torch.set_num_threads(2)
    torch.manual_seed(0)

from hypothesis import settings
settings.register_profile('seqdist', derandomize=True, deadline=None)  # the same examples on every CI run
settings.load_profile('seqdist')
