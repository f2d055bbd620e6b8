"""CUDA apply: one Triton launch, no host synchronization, safe inside a CUDA graph.

Each program takes ``WORDS`` mask words (``32 * WORDS`` tokens) of one row as a
``(WORDS, 32)`` tile, so every per-word decision is constant along the vectorized axis and
loads/stores stay 16 bytes wide. Per word:

* all ones (every token allowed): nothing is read or written;
* all zeros, or past the mask's width (padded vocab): ``-inf`` is written, nothing is read;
* mixed: the 32 logits are read and written back with the disallowed ones set to ``-inf``.

So the bytes moved are at most one read and one write of the logits plus one read of the
mask (random masks), about half of that for grammar masks (mostly all-zero words) and only the
mask for unconstrained rows. xgrammar's Triton kernel instead stores ``-inf`` with a
per-element predicate, which splits each vector store into scalar ones.

Launch path. Engines call the apply eagerly once per decoding step, and at small batches the
host time of the call, not the kernel, is the cost: through Triton's JIT (binding and
specializing every argument, building its cache key, launch metadata and hooks) a call took
19-28 µs of host time on the H200 machine against 5-36 µs of device time at 64 rows. So:

* The kernel is compiled with no value specialization of its integer arguments and no
  alignment specialization of its pointers (``do_not_specialize``): a compiled variant depends
  only on its constexprs and argument dtypes, which this module computes. What specialization
  would have told the compiler (16-byte aligned logits rows, a vocabulary in whole 16-byte
  vectors) comes in the constexpr ``VEC``: vocabulary and row stride arrive divided by it and
  are multiplied back in the kernel, so the compiler sees their divisibility and emits the same
  16-byte accesses (the same PTX) as with Triton's specialization.
* The first call of a default variant (no indices, default block size and warps) compiles it
  through the JIT and caches its launcher (:class:`_Cache`); later calls go through
  :func:`launch_cached`, which checks the arguments itself and calls the launcher with the
  pointers as integers. That is about 9 µs of host time per call there, against 10-11 µs for
  xgrammar's CUDA kernel (``benchmarks/results/kernels-h200.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import driver

# 4 KiB of logits per program and 4 warps: of eight (bytes, warps) pairs on an H200, the
# fastest at 512 rows and within 4% of the fastest at 64 rows, for fp32 and bf16 and vocabularies
# of 49k-262k (benchmarks/bench_kernels.py --sweep, benchmarks/results/kernels-h200-sweep.md).
BYTES_PER_PROGRAM = 4096
NUM_WARPS = 4

_INT32_MAX = 2**31 - 1


@triton.jit(
    do_not_specialize=["vocab_q", "width", "logits_stride_q", "mask_stride", "blocks_per_row"],
    do_not_specialize_on_alignment=["logits_ptr", "mask_ptr", "idx_ptr"],
)
def _apply_kernel(
    logits_ptr,
    mask_ptr,
    idx_ptr,
    vocab_q,
    width,
    logits_stride_q,
    mask_stride,
    blocks_per_row,
    HAS_INDICES: tl.constexpr,
    WORDS: tl.constexpr,
    VEC: tl.constexpr,
):
    # vocab and logits row stride = VEC * their _q argument; VEC > 1 also promises a 16-byte
    # aligned logits pointer.
    pid = tl.program_id(0)
    row = pid // blocks_per_row
    blk = pid % blocks_per_row
    vocab = vocab_q * VEC
    if HAS_INDICES:
        lrow = tl.load(idx_ptr + row).to(tl.int64)
    else:
        lrow = row.to(tl.int64)
    row_ptr = logits_ptr + lrow * logits_stride_q * VEC
    if VEC > 1:
        row_ptr = tl.multiple_of(row_ptr, 16)
    mask_row_ptr = mask_ptr + row.to(tl.int64) * mask_stride
    w = blk * WORDS + tl.arange(0, WORDS)
    # Words past the mask's width read as 0: padded-vocab columns are disallowed.
    word = tl.load(mask_row_ptr + w, mask=w < width, other=0)
    bit = tl.arange(0, 32)
    cols = w[:, None] * 32 + bit[None, :]
    in_row = cols < vocab
    allowed = ((word[:, None] >> bit[None, :]) & 1) != 0
    mixed = (word != 0) & (word != -1)
    ptrs = row_ptr + cols
    x = tl.load(ptrs, mask=mixed[:, None] & in_row, other=0.0)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=(word != -1)[:, None] & in_row)


_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
# Triton 3.3 and later hand the launcher every argument, constexprs included (3.2 and earlier
# only the others): the cached launch follows the newer convention, older versions keep the
# JIT launch.
_CACHED_LAUNCH = _VERSION >= (3, 3)
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
# logits dtype -> (elements in 16 bytes, mask words per program at BYTES_PER_PROGRAM)
_DEFAULTS = {
    dtype: (16 // size, BYTES_PER_PROGRAM // (32 * size))
    for dtype, size in ((torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2))
}


def _launch_hooks_installed() -> bool:
    """A profiler (e.g. proton) installed Triton launch hooks: launch through the JIT so that
    it sees this kernel."""
    hook = getattr(_RUNTIME_KNOBS, "launch_enter_hook", None)
    return bool(getattr(hook, "calls", hook))


def _launch_of(kernel) -> tuple:
    """``(launch, middle)`` for a compiled kernel: a launch is
    ``launch(grid, 1, 1, stream, *middle, *kernel_args)``.

    Generic (Triton >= 3.3): the compiled kernel's ``run`` (the launcher object), with no launch
    metadata and no hooks. On Triton 3.6, whose launcher entry point's arguments are known, the
    launcher's C function itself when the kernel needs no scratch memory: the launcher object's
    Python ``__call__`` only allocates scratch memory and forwards the arguments."""
    launcher = kernel.run
    if (
        _VERSION == (3, 6)
        and type(launcher).__name__ == "CudaLauncher"
        and not launcher.global_scratch_size
        and not launcher.profile_scratch_size
    ):
        return launcher.launch, (
            kernel.function,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            None,  # global scratch
            None,  # profile scratch
            kernel.packed_metadata,
            None,  # launch metadata
            None,  # enter hook
            None,  # exit hook
        )
    # launch metadata, enter hook, exit hook
    return launcher, (kernel.function, kernel.packed_metadata, None, None, None)


class _Cache:
    """Launches (:func:`_launch_of`) of the compiled default variants (no indices, default
    block size and warps) by (device, logits dtype, VEC), and the current device and stream
    functions: torch's, as Triton's driver uses them, looked up once."""

    def __init__(self) -> None:
        self.launches: dict[tuple, tuple] = {}
        self.device = self.stream = None

    def add(self, kernel, device: int, dtype: torch.dtype, vec: int) -> None:
        if self.device is None:
            self.device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
            self.stream = driver.active.get_current_stream
        if device == self.device():
            self.launches[(device, dtype, vec)] = _launch_of(kernel)

    def clear(self) -> None:
        self.launches.clear()


_CACHE = _Cache()


def launch_cached(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """The eager path of :func:`spec_grammar.kernels.apply_token_bitmask_inplace` without
    indices, taken before its argument checks: launch the cached compiled kernel and return
    True, or do nothing and return False (the checked path then runs, and compiles and caches
    the variant on its first call).

    It launches only when the call is valid and its variant is cached: ``logits`` ``(rows,
    V)`` float32/float16/bfloat16 and ``bitmask`` ``(rows, W)`` int32, both on the current
    CUDA device with unit column stride, all sizes and strides below 2**31, no Triton launch
    hooks installed. Anything else, including objects that are not tensors, returns False.
    """
    cache = _CACHE
    if not cache.launches:  # nothing compiled yet (or no GPU): the checked path
        return False
    try:
        rows, vocab = logits.shape
        n, width = bitmask.shape
        logits_stride, logits_col = logits.stride()
        mask_stride, mask_col = bitmask.stride()
        vec, words = _DEFAULTS[logits.dtype]
        device = logits.get_device()
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    logits_ptr = logits.data_ptr()
    if vocab % vec or logits_stride % vec or logits_ptr % 16:
        vec = 1
    launch = cache.launches.get((device, logits.dtype, vec))
    if (
        launch is None
        or n != rows
        or logits_col != 1
        or mask_col != 1
        or bitmask.dtype is not torch.int32
        or bitmask.get_device() != device
        or device != cache.device()
        or max(vocab, width, logits_stride, mask_stride) > _INT32_MAX
        or _launch_hooks_installed()
    ):
        return False
    blocks = -(-vocab // (32 * words))
    if rows and blocks:
        run, middle = launch
        # Pointers as integers: the launcher then neither calls data_ptr() nor asks the
        # driver to translate them (torch's CUDA pointers are device pointers already).
        run(
            rows * blocks,
            1,
            1,
            cache.stream(device),
            *middle,
            logits_ptr,
            bitmask.data_ptr(),
            None,
            vocab // vec,
            width,
            logits_stride // vec,
            mask_stride,
            blocks,
            False,
            words,
            vec,
        )
    return True


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
    words_per_program: int | None = None,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch :func:`_apply_kernel` through Triton's JIT over ``(rows, ceil(V / (32 *
    words_per_program)))`` programs (default: 4 KiB of logits per program); a default variant
    (no indices, default block size and warps) is then cached for :func:`launch_cached`.

    ``logits``: ``(rows, V)`` CUDA float32/float16/bfloat16 with unit column stride;
    ``bitmask``: ``(n, W)`` int32 with unit column stride, ``n = len(indices)`` or ``rows``;
    ``indices``: contiguous int32/int64 CUDA tensor or ``None``. Checked by the dispatcher.
    """
    rows, vocab = logits.shape
    n, width = bitmask.shape
    if indices is None:
        n = rows
    vec, words = _DEFAULTS[logits.dtype]
    words = words_per_program or words
    blocks = -(-vocab // (32 * words))
    if n == 0 or blocks == 0:
        return
    logits_stride, mask_stride = logits.stride(0), bitmask.stride(0)
    if vocab % vec or logits_stride % vec or logits.data_ptr() % 16:
        vec = 1
    kernel = _apply_kernel[(n * blocks,)](
        logits,
        bitmask,
        indices,
        vocab // vec,
        width,
        logits_stride // vec,
        mask_stride,
        blocks,
        indices is not None,
        words,
        vec,
        num_warps=num_warps,
    )
    if (
        _CACHED_LAUNCH
        and logits.is_cuda  # the interpreter (TRITON_INTERPRET=1) runs on CPU tensors
        and indices is None
        and words_per_program is None
        and num_warps == NUM_WARPS
        # cached variants take i32 integers (the JIT gives larger ones an i64 variant)
        and max(vocab, width, logits_stride, mask_stride) <= _INT32_MAX
        and not _launch_hooks_installed()
    ):
        _CACHE.add(kernel, logits.get_device(), logits.dtype, vec)
