import os, pathlib, pytest, torch

KERNELS = pathlib.Path(__file__).parent / 'kernels'

@pytest.fixture(autouse=True)
def _threads_and_seed():
    torch.set_num_threads(2)
    torch.manual_seed(0)
