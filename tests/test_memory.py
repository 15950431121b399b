"""seqdist.memory.empty_large: large outputs come from a pool of buffers that tensors give back when they (and every
view of them) are freed; a buffer in use is never handed out twice; the free buffers kept never exceed the pool's
bound in bytes; small sizes are plain torch.empty."""
import gc, math, os, subprocess, sys, threading, weakref, pytest, torch
from seqdist.memory import empty_large, release_large_buffers, set_pool_limit, LARGE_POOL, POOL_BYTES
from seqdist.memory import empty_gradient, GRADIENT_POOL_BYTES

SHAPE = (100, 16, 256, 5)            # 8 MB of float32
NBYTES = math.prod(SHAPE) * 4

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
    held = [empty_large(SHAPE) for _ in range(5)]
    del held
    assert len(LARGE_POOL.free) == 5 and LARGE_POOL.free_bytes == 5 * NBYTES <= LARGE_POOL.max_free_bytes
    release_large_buffers()
    assert LARGE_POOL.free == [] and LARGE_POOL.free_bytes == 0

def kept():
    "The free buffers' bytes, counted afresh, after checking the pool's own count."
    assert LARGE_POOL.free_bytes == sum(entry[0] for entry in LARGE_POOL.free)
    return LARGE_POOL.free_bytes

def test_the_free_buffers_kept_never_exceed_the_bound_in_bytes():
    release_large_buffers()
    limit = 2 * NBYTES + NBYTES // 2                      # room for two buffers of SHAPE
    old = set_pool_limit(limit)
    try:
        held = [empty_large(SHAPE) for _ in range(5)]
        for t in held[:2]: t.fill_(1)
        while held:
            del held[0]                                   # each buffer comes back in turn
            assert kept() <= limit
        assert len(LARGE_POOL.free) == 2                  # the two most recent: the oldest were unmapped first
        big = empty_large((3 * SHAPE[0],) + SHAPE[1:])    # larger than the whole bound: never kept
        del big
        assert kept() <= limit and len(LARGE_POOL.free) == 2
        addresses = {entry[3] for entry in LARGE_POOL.free}
        a, b = empty_large(SHAPE), empty_large(SHAPE)     # the kept buffers are handed out again...
        assert {a.data_ptr(), b.data_ptr()} == addresses and kept() == 0
        del a, b
        assert set_pool_limit(NBYTES) == limit            # ...and a lower bound unmaps what is beyond it at once
        assert kept() == NBYTES and len(LARGE_POOL.free) == 1
        set_pool_limit(0)
        t = empty_large(SHAPE)
        del t
        assert kept() == 0                                # 0: nothing is kept
    finally:
        set_pool_limit(old)
    with pytest.raises(ValueError, match=r"nbytes must be an int >= 0, got -1"): set_pool_limit(-1)
    with pytest.raises(ValueError, match=r"nbytes must be an int >= 0, got 1.5"): set_pool_limit(1.5)

def test_release_unmaps_the_free_buffers():
    release_large_buffers()
    assert LARGE_POOL.max_free_bytes >= 3 * NBYTES
    held = [empty_large(SHAPE) for _ in range(3)]
    del held
    maps = [weakref.ref(entry[1]) for entry in LARGE_POOL.free]
    assert len(maps) == 3 and all(m() is not None for m in maps)
    release_large_buffers()
    gc.collect()
    assert LARGE_POOL.free == [] and kept() == 0 and all(m() is None for m in maps)   # the mmaps are gone: unmapped

def test_the_bound_comes_from_the_environment():
    code = "from seqdist.memory import LARGE_POOL; print(LARGE_POOL.max_free_bytes)"
    run = lambda v: subprocess.run([sys.executable, '-c', code], env={**os.environ, 'SEQDIST_POOL_BYTES': v},
                                   capture_output=True, text=True)
    assert run('12345').stdout.split() == ['12345'] and run('').stdout.split() == [str(POOL_BYTES)]
    bad = run('1GB')
    assert bad.returncode and "SEQDIST_POOL_BYTES must be a number of bytes (an int >= 0), got '1GB'" in bad.stderr

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
    assert out == [1.0] * 80 and kept() <= LARGE_POOL.max_free_bytes

def test_half_precision_dtypes():
    "bfloat16 and float16 outputs too (numpy has no bfloat16: the buffer is bytes viewed as the dtype)."
    release_large_buffers()
    for dtype in (torch.bfloat16, torch.float16):
        t = empty_large((1 << 12, 1 << 9), dtype)
        t.fill_(1.5)
        assert t.dtype == dtype and t.shape == (1 << 12, 1 << 9) and t.is_contiguous() and bool((t == 1.5).all())

def test_gradients_come_from_the_pool_from_their_threshold():
    "`empty_gradient(x)`: x's shape and dtype; a pooled buffer (a view of it) from GRADIENT_POOL_BYTES up, torch.empty's below."
    n = GRADIENT_POOL_BYTES // 8
    for x, pooled in ((torch.zeros(n - 1, dtype=torch.float64), False), (torch.zeros(n, dtype=torch.float64), True),
                      (torch.zeros(2, n // 2, dtype=torch.float32), False), (torch.zeros(4, n // 2, dtype=torch.float32), True)):
        g = empty_gradient(x)
        assert g.shape == x.shape and g.dtype == x.dtype and (g._base is not None) == pooled, (x.shape, x.dtype)
