"""KVCopyExecutor: every moved token reads back bit-exact through its new slot.

CPU tests run the synchronous paths of both layouts (the "cpu" layout's
compiled loop, kv_copy_cpu.py; torch index ops for "triton"); the Triton kernel is
checked on CPU tensors under TRITON_INTERPRET=1 (in a child process, so the
interpreter never leaks into other tests); `gpu` tests check stream ordering.
"""

import numpy as np
import pytest
import torch

from tests.runtime.interpreter import run_under_interpreter
from vllm.vtoken import integrity
from vllm.vtoken.copy_executor import KVCopyExecutor, slot_pairs


def make_caches(
    layout,
    num_layers=3,
    num_blocks=6,
    heads=2,
    block=16,
    head_dim=8,
    dtype=torch.float32,
    device="cpu",
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    shape = (
        (2, num_blocks, heads, block, head_dim)
        if layout == "cpu"
        else (num_blocks, 2, block, heads, head_dim)
    )
    return [
        torch.randn(shape, generator=gen).to(dtype).to(device)
        for _ in range(num_layers)
    ]


def read_slots(cache, layout, slots):
    """K and V of `slots` as [M, 2, H, D], by the layout's index math."""
    slots = torch.as_tensor(slots, device=cache.device)
    if layout == "cpu":
        _, n, h, b, d = cache.shape
        key = cache[0].view(n, h, d, b).permute(0, 3, 1, 2)  # [N, B, H, D]
        value = cache[1].permute(0, 2, 1, 3)
    else:
        b = cache.shape[2]
        key, value = cache[:, 0], cache[:, 1]
    blk, off = slots // b, slots % b
    return torch.stack([key[blk, off], value[blk, off]], dim=1)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def make_plan(rng, num_slots, block, num_moves):
    """Sources in some blocks, destinations in other (fresh) blocks."""
    blocks = rng.permutation(num_slots // block)
    half = len(blocks) // 2
    src_pool = (blocks[:half, None] * block + np.arange(block)).ravel()
    dst_pool = (blocks[half:, None] * block + np.arange(block)).ravel()
    src = rng.choice(src_pool, num_moves, replace=False)
    dst = rng.choice(dst_pool, num_moves, replace=False)
    return src.astype(np.int64), dst.astype(np.int64)


def check_plan_applied(before, after, layout, src, dst):
    for old, new in zip(before, after, strict=True):
        assert torch.equal(
            as_bytes(read_slots(new, layout, dst)),
            as_bytes(read_slots(old, layout, src)),
        )
        expected = old.clone()
        # Write the expected destinations with the test's own index math.
        moved = read_slots(old, layout, src)
        d = torch.as_tensor(dst)
        b = old.shape[3] if layout == "cpu" else old.shape[2]
        blk, off = d // b, d % b
        if layout == "cpu":
            n, h, dim = old.shape[1], old.shape[2], old.shape[4]
            expected[0].view(n, h, dim, b).permute(0, 3, 1, 2)[blk, off] = moved[:, 0]
            expected[1].permute(0, 2, 1, 3)[blk, off] = moved[:, 1]
        else:
            expected[blk, 0, off] = moved[:, 0]
            expected[blk, 1, off] = moved[:, 1]
        assert torch.equal(as_bytes(new), as_bytes(expected))  # nothing else moved


@pytest.mark.parametrize("layout", ["cpu", "triton"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
)
def test_random_plans_move_bytes_exactly(layout, dtype):
    rng = np.random.default_rng(7)
    block = 16
    caches = make_caches(layout, dtype=dtype, block=block)
    ex = KVCopyExecutor(caches, layout, block)
    total = 0
    for batch_id in range(5):
        src, dst = make_plan(rng, 6 * block, block, int(rng.integers(1, 20)))
        before = [c.clone() for c in caches]
        ex.submit(batch_id, src, dst)
        assert ex.poll() == [batch_id]
        assert ex.poll() == []  # each id once
        check_plan_applied(before, caches, layout, src, dst)
        total += len(src) * 3 * 2 * 2 * 8 * caches[0].element_size()
        assert ex.bytes_copied == total


def test_cross_layer_triton_layout_with_strides():
    # KV connectors may allocate [N, L, 2, B, H, D] and hand out per-layer slices.
    block, heads, head_dim = 16, 2, 4
    base = torch.randn(5, 2, 2, block, heads, head_dim)
    caches = [base[:, layer] for layer in range(2)]
    assert not caches[0].is_contiguous()
    before = [c.clone() for c in caches]
    src, dst = np.array([3, 17, 20]), np.array([64, 65, 79])
    ex = KVCopyExecutor(caches, "triton", block)
    ex.submit(1, src, dst)
    assert ex.poll() == [1]
    check_plan_applied(before, caches, "triton", src, dst)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 17])
def test_the_copys_slot_rows_start_aligned_whatever_the_count(m):
    """The GPU copy uploads its sources and destinations as one [2, M'] array;
    the destinations' row starts 128-byte aligned for any M, so Triton's
    16-byte alignment variant of the kernel is the same as the warm-up's (a
    [2, M] stack put it 8 bytes off for odd M: two compiles, one mid-run)."""
    src, dst = np.arange(m), np.arange(m) + 100
    pairs = slot_pairs(src, dst)
    assert (pairs.data_ptr() - pairs[1].data_ptr()) % 128 == 0
    assert pairs[0, :m].tolist() == src.tolist()
    assert pairs[1, :m].tolist() == dst.tolist()


def test_empty_batch_is_reported():
    caches = make_caches("cpu")
    before = [c.clone() for c in caches]
    ex = KVCopyExecutor(caches, "cpu", 16)
    ex.submit(3, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    ex.submit(4, [], [])
    assert ex.poll() == [3, 4]
    assert ex.bytes_copied == 0
    assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    ex.wait_all()  # nothing pending: a no-op on CPU
    ex.synchronize()


def test_synchronize_waits_for_the_side_stream_and_leaves_batches_to_poll():
    """Before vLLM's sleep (patch 0055): the host waits for the side stream,
    which also holds a batch `wait_all` already handed on (a finished
    request's, acknowledged in the empty step after sleep's aborts); pending
    batches stay pending, so the next poll reports them. Stream and events
    stubbed: no GPU needed."""
    from vllm.vtoken.copy_executor import _PendingCopy

    class Stream:  # its copies land when it is waited for
        landed = False

        def synchronize(self):
            Stream.landed = True

    class Event:
        def query(self):
            return Stream.landed

        def synchronize(self):  # what the first version waited on, alone
            raise AssertionError("the stream, not each pending event")

    ex = KVCopyExecutor(make_caches("cpu"), "cpu", 16)
    ex._stream = Stream()
    none = torch.empty(0)
    ex._pending = [_PendingCopy(b, Event(), none, none, none) for b in (5, 6)]
    assert ex.poll() == []  # still copying
    ex.synchronize()
    assert Stream.landed
    assert ex.poll() == [5, 6] and ex.poll() == []
    ex.synchronize()  # none pending: the stream still waited for


def test_the_copy_table_of_layer_addresses_is_written_again_after_wake_up():
    """vLLM's wake-up maps the KV cache's pool afresh with its contents lost,
    and the Triton copier's device table of layer addresses lives there (it
    is built with the cache): `after_wake_up` writes it again."""
    from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier

    caches = make_caches("triton", num_blocks=8)
    ex = KVCopyExecutor(caches, "triton", 16)  # on CPU: no copier of its own
    ex._triton = copier = TritonKVSlotCopier(caches, 16)
    want = [c.data_ptr() for c in caches]
    assert copier.layer_ptrs.tolist() == want
    copier.layer_ptrs.fill_(0)  # the pool woken: its old contents are gone
    ex.after_wake_up()
    assert copier.layer_ptrs.tolist() == want


@pytest.mark.parametrize(
    "src,dst,match",
    [
        ([1, 2], [40], "equal length"),
        ([[1]], [[40]], "1-D"),
        ([-1], [40], "out of range"),
        ([1], [96], "out of range"),
        ([1, 2], [40, 40], "duplicate destination"),
        ([1, 40], [40, 41], "also a source"),
        ([1.0], [40.0], "integers"),
    ],
)
def test_bad_plans_are_caught_and_copy_nothing(src, dst, match):
    caches = make_caches("cpu")
    before = [c.clone() for c in caches]
    ex = KVCopyExecutor(caches, "cpu", 16)
    with pytest.raises(AssertionError, match=match):
        ex.submit(0, np.array(src), np.array(dst))
    assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    assert ex.poll() == [] and ex.bytes_copied == 0


@pytest.mark.parametrize("src,dst", [([1, -1], [40, 41]), ([1, 2], [40, 96])])
def test_a_slot_outside_the_cache_is_refused_without_deep_checks(monkeypatch, src, dst):
    # The compiled copy does not check bounds per element: it checks every
    # slot first, so a bad plan writes nothing (and never outside the cache).
    monkeypatch.setattr(integrity, "CHECK", False)
    caches = make_caches("cpu", dtype=torch.bfloat16)
    before = [c.clone() for c in caches]
    ex = KVCopyExecutor(caches, "cpu", 16)
    with pytest.raises(IndexError, match="outside the KV cache"):
        ex.submit(0, np.array(src), np.array(dst))
    assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))


def test_batch_id_reused_before_report_is_caught():
    ex = KVCopyExecutor(make_caches("cpu"), "cpu", 16)
    ex.submit(5, np.array([1]), np.array([40]))
    with pytest.raises(AssertionError, match="not yet reported"):
        ex.submit(5, np.array([2]), np.array([41]))
    assert ex.poll() == [5]
    ex.submit(5, np.array([2]), np.array([41]))  # fine once reported
    assert ex.poll() == [5]


def test_bad_caches_raise():
    cpu = make_caches("cpu")
    with pytest.raises(ValueError, match="layout"):
        KVCopyExecutor(cpu, "flash", 16)
    with pytest.raises(ValueError, match="no KV caches"):
        KVCopyExecutor([], "cpu", 16)
    with pytest.raises(ValueError, match="does not match"):
        KVCopyExecutor(cpu, "cpu", 32)
    with pytest.raises(ValueError, match="does not match"):
        KVCopyExecutor(cpu, "triton", 16)  # [2, N, H, B, D] is not [N, 2, B, H, D]
    with pytest.raises(ValueError, match="share"):
        KVCopyExecutor([cpu[0], cpu[1][:, :3].clone()], "cpu", 16)
    square = make_caches("cpu", head_dim=16)  # B == D: same shape when transposed
    with pytest.raises(ValueError, match="contiguous"):
        KVCopyExecutor([c.transpose(3, 4) for c in square], "cpu", 16)


_INTERP_CHILD = """
    from vllm.vtoken.copy_executor import KVCopyExecutor, slot_pairs
    from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier

    def check(shape, dtype, slices=None):
        gen = torch.Generator().manual_seed(len(shape))
        full = (torch.randn(shape, generator=gen) * 50).to(dtype)
        if slices is None:
            caches = [full[0].clone(), full[1].clone()]
        else:
            caches = [full[:, 0], full[:, 1]]  # cross-layer strided slices
        block = caches[0].shape[2]
        src = torch.tensor([0, 5, block + 3, 2 * block - 1])
        dst = torch.tensor([3 * block, 3 * block + 7, 4 * block - 1, 2 * block])
        ref = [c.clone() for c in caches]
        KVCopyExecutor(ref, "triton", block).submit(0, src.numpy(), dst.numpy())
        copier = TritonKVSlotCopier(caches, block)
        copier.copy(src, dst)
        for got, want in zip(caches, ref):
            assert torch.equal(got.contiguous().view(torch.uint8),
                               want.contiguous().view(torch.uint8)), shape
        return copier.word_bytes

    assert check((2, 4, 2, 16, 2, 8), torch.float32) == 4
    assert check((2, 4, 2, 16, 2, 8), torch.bfloat16) == 4
    assert check((2, 4, 2, 16, 1, 3), torch.float16) == 2   # 6-byte rows
    assert check((2, 4, 2, 16, 1, 5), torch.uint8) == 1     # fp8-style caches
    assert check((4, 2, 2, 16, 2, 8), torch.bfloat16, slices=True) == 4
    print("KV-COPY-OK")
"""


def test_triton_copy_kernel_matches_torch_path_under_interpreter():
    run_under_interpreter(_INTERP_CHILD, "KV-COPY-OK")


# --------------------------------------------------------------- GPU: streams
def _busy_current_stream(cycles=1_000_000_000):
    # Keeps the current stream busy (~0.5 s) so copies queued behind it wait.
    torch.cuda._sleep(cycles)


def _warm_up(ex):
    # Creates the side stream and compiles the kernel outside the timed part.
    ex.submit(-1, np.array([1023]), np.array([1022]))
    torch.cuda.synchronize()
    assert ex.poll() == [-1]


@pytest.mark.gpu
@pytest.mark.parametrize("use_triton", [True, False])
def test_gpu_copy_waits_for_writes_on_current_stream(use_triton):
    caches = make_caches("triton", num_blocks=64, device="cuda")
    ex = KVCopyExecutor(caches, "triton", 16, use_triton=use_triton)
    _warm_up(ex)
    src, dst = np.arange(0, 32), np.arange(512, 544)
    _busy_current_stream()
    for c in caches:  # a "forward" writes the sources after the sleep
        c[:2].fill_(7.0)
    ex.submit(0, src, dst)
    assert ex.poll() == []  # side stream waits behind the busy current stream
    torch.cuda.synchronize()
    assert ex.poll() == [0] and ex.poll() == []
    for c in caches:
        assert torch.all(read_slots(c, "triton", dst) == 7.0)


def _a_copy_behind_a_busy_stream():
    # Batch 1 (slots 0..29 -> 600..629) waits on the side stream behind a busy
    # current stream; returns the executor, the caches, a copy from before.
    caches = make_caches("triton", num_blocks=64, device="cuda")
    ex = KVCopyExecutor(caches, "triton", 16)
    _warm_up(ex)
    before = [c.clone() for c in caches]
    _busy_current_stream()
    ex.submit(1, np.arange(0, 30), np.arange(600, 630))
    return ex, caches, before


@pytest.mark.gpu
def test_gpu_wait_all_orders_current_stream_after_copy():
    ex, caches, before = _a_copy_behind_a_busy_stream()
    src, dst = np.arange(0, 30), np.arange(600, 630)
    ex.submit(2, np.arange(100, 110), np.arange(700, 710))
    ex.wait_all()  # must not block the host
    assert torch.cuda.current_stream().query() is False
    # Queued after wait_all on the current stream: must see the copied data.
    snap = [read_slots(c, "triton", dst).clone() for c in caches]
    assert ex.poll() == [1, 2] and ex.poll() == []
    torch.cuda.synchronize()
    for old, got in zip(before, snap, strict=True):
        assert torch.equal(got, read_slots(old, "triton", src))


@pytest.mark.gpu
def test_gpu_synchronize_blocks_the_host_until_the_copies_land():
    ex, caches, before = _a_copy_behind_a_busy_stream()
    src, dst = np.arange(0, 30), np.arange(600, 630)
    ex.synchronize()
    assert ex.poll() == [1]  # landed: nothing left on the side stream
    for old, c in zip(before, caches, strict=True):
        assert torch.equal(read_slots(c, "triton", dst), read_slots(old, "triton", src))


@pytest.mark.gpu
def test_gpu_triton_kernel_equals_torch_path():
    rng = np.random.default_rng(3)
    a = make_caches("triton", num_blocks=64, dtype=torch.bfloat16, device="cuda")
    b = [c.clone() for c in a]
    src, dst = make_plan(rng, 64 * 16, 16, 300)
    ex_a = KVCopyExecutor(a, "triton", 16, use_triton=True)
    ex_b = KVCopyExecutor(b, "triton", 16, use_triton=False)
    ex_a.submit(0, src, dst)
    ex_b.submit(0, src, dst)
    ex_a.wait_all()
    ex_b.wait_all()
    torch.cuda.synchronize()
    assert all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b, strict=True))
