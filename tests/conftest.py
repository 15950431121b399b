import os, pathlib, pytest, torch

KERNELS = pathlib.Path(__file__).parent / 'kernels'

@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
