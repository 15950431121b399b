"""utils.empty_large: large outputs come from a pool of buffers that tensors give back when they (and every view of
them) are freed; a buffer in use is never handed out twice; small sizes are plain torch.empty."""
import gc, threading, torch
from seqdist import utils
from seqdist.utils import empty_large, release_large_buffers

SHAPE = (100, 16, 256, 5)            # 8 MB of float32

def test_a_freed_buffer_is_reused_and_a_live_one_is_not():
    release_large_buffers()
    a = empty_large(SHAPE)
    address = a.data_ptr()
    b = empty_large(SHAPE)
    assert b.data_ptr() != address
    a.fill_(1); b.fill_(2)
    assert a.eq(1).all() and b.eq(2).all()
    del a
    c = empty_large(SHAPE)
    assert c.data_ptr() == address and c.shape == SHAPE and c.dtype == torch.float32 and c.is_contiguous()

def test_a_view_keeps_its_buffer():
    release_large_buffers()
    a = empty_large(SHAPE)
    address, view = a.data_ptr(), a[10:]
    del a
    gc.collect()
    b = empty_large(SHAPE)
    assert b.data_ptr() != address          # the view still uses it
    view.fill_(3); b.fill_(4)
    assert view.eq(3).all()
    del view
    assert empty_large(SHAPE).data_ptr() == address

def test_dtypes_sizes_and_the_pool_bound():
    release_large_buffers()
    d = empty_large((2, 1 << 18), torch.float64)
    assert d.dtype == torch.float64 and d.shape == (2, 1 << 18)
    small = empty_large((3, 4))
    assert small.shape == (3, 4) and small.dtype == torch.float32
    held = [empty_large(SHAPE) for _ in range(utils.LARGE_POOL.max_free + 3)]
    del held
    assert len(utils.LARGE_POOL.free) == utils.LARGE_POOL.max_free
    release_large_buffers()
    assert len(utils.LARGE_POOL.free) == 0

def test_buffers_freed_in_other_threads():
    release_large_buffers()
    out = []
    def work():
        for _ in range(20):
            t = empty_large(SHAPE)
            t.fill_(1.0)
            out.append(float(t[0, 0, 0, 0]))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert out == [1.0] * 80 and len(utils.LARGE_POOL.free) <= utils.LARGE_POOL.max_free

def test_half_precision_dtypes():
    "bfloat16 and float16 outputs too (numpy has no bfloat16: the buffer is bytes viewed as the dtype)."
    release_large_buffers()
    for dtype in (torch.bfloat16, torch.float16):
        t = empty_large((1 << 12, 1 << 9), dtype)
        t.fill_(1.5)
        assert t.dtype == dtype and t.shape == (1 << 12, 1 << 9) and t.is_contiguous() and bool((t == 1.5).all())
