"""Causal attention for head_dim 16 on CPUs with AMX (Sapphire Rapids and later), as a PyTorch custom op.

With narrow heads PyTorch's CPU flash kernel takes most of a small model's training step: at head_dim 16
its bfloat16 backward is slower than its float32 one. The kernel in amx_attention.cpp keeps both passes in
AMX tiles and does the softmax in AVX-512 on transposed scores. On this project's 2-core Sapphire Rapids
VM (batch 8 x 2048, 16 heads) a layer's forward and backward take 2.6-3.2x less time than PyTorch's
fastest combination (benchmarks/cpu_attention.py).

It is built on first use with the system C++ compiler (no PyTorch headers, about 2 s) into torchtitan's cache
folder and loaded with ctypes. Without AMX, a compiler, or with TORCHTITAN_AMX_ATTENTION=0, ``available()``
is False and callers use PyTorch's kernels.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from torchtitan.cache import cache_dir
from torchtitan.hardware import cpuinfo_field
from torchtitan.log import logger

HEAD_DIM = 16
_SOURCE = Path(__file__).with_name("amx_attention.cpp")
_CXXFLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512vl",
             "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mfma"]
_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"}


def _cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


def _build(cxx: str) -> Path:
    """Compile the kernel once per source, flags and compiler; concurrent builders each write then rename."""
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([cxx, *_CXXFLAGS]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"amx_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f"{out.stem}.", suffix=".tmp.so")
        os.close(fd)
        try:
            subprocess.run([cxx, *_CXXFLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, text=True,
                           timeout=300)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # empty until the first call decides


def _library() -> ctypes.CDLL | None:
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("TORCHTITAN_AMX_ATTENTION", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _CPU_FLAGS <= _cpu_flags():
        return None
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        logger.info(f"AMX attention kernel not built: no C++ compiler {cxx!r} on PATH; using PyTorch's kernel")
        return None
    try:
        path = _build(cxx)
        lib = ctypes.CDLL(str(path))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        failed = isinstance(e, subprocess.CalledProcessError) and (e.stderr or "").strip()
        detail = failed.splitlines()[-1] if failed else str(e)
        logger.warning(f"AMX attention kernel failed to build with {cxx!r} ({detail}); using PyTorch's kernel")
        return None
    if lib.amx_attention_enable() != 0:
        logger.warning("Linux refused this process AMX state (arch_prctl); using PyTorch's attention kernel")
        return None
    ptr, strides, i32, f32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_long), ctypes.c_int, ctypes.c_float
    lib.amx_attention_forward.argtypes = [ptr, strides] * 4 + [ptr, i32, i32, i32, i32, f32, i32]
    lib.amx_attention_backward.argtypes = [ptr, strides] * 5 + [ptr] + [ptr, strides] * 3 + [i32] * 4 + [f32, i32]
    lib.amx_attention_forward.restype = lib.amx_attention_backward.restype = i32
    logger.info(f"bfloat16 attention with head_dim {HEAD_DIM} runs on the AMX kernel ({path})")
    return lib


@torch.compiler.assume_constant_result  # compiled code asks once while tracing instead of tracing the build
def available() -> bool:
    return _library() is not None


def takes(head_dim: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Whether CPU attention of this shape and dtype runs on this kernel on this machine."""
    return dtype == torch.bfloat16 and head_dim == HEAD_DIM and seq_len % 16 == 0 and available()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``causal_attention`` takes these (batch, heads, seq, head_dim) inputs on this machine."""
    return (
        q.device.type == k.device.type == v.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dim() == 4
        and k.shape == v.shape
        and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
        and q.shape[1] % k.shape[1] == 0
        and takes(q.shape[-1], q.shape[2], q.dtype)
    )


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernel can read it through its strides (unit head_dim stride, even token strides)."""
    ok = t.stride(-1) == 1 and all(s % 2 == 0 and s < 2**27 for s in t.stride()[:3])
    return t if ok else t.contiguous()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the AMX attention kernel could not start its threads or allocate its buffers")


def _args(t: torch.Tensor):
    return t.data_ptr(), (ctypes.c_long * 3)(*t.stride()[:3])


@torch.library.custom_op("torchtitan::amx_causal_attention", mutates_args=(), device_types="cpu")
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out, lse = _forward_fake(q, k, v)
    (b, h, t, d), hkv = q.shape, k.shape[1]
    _check(_library().amx_attention_forward(*_args(q), *_args(k), *_args(v), *_args(out), lse.data_ptr(),
                                            b, h, hkv, t, d ** -0.5, torch.get_num_threads()))
    return out, lse


@_forward.register_fake
def _forward_fake(q, k, v):
    b, h, t, d = q.shape
    # (batch, seq, heads, head_dim) in memory, so the model's transpose back and reshape are free.
    return q.new_empty(b, t, h, d).transpose(1, 2), q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("torchtitan::amx_causal_attention_backward", mutates_args=(), device_types="cpu")
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad, q, k, v, out = (_kernel_layout(t) for t in (grad, q, k, v, out))
    dq, dk, dv = _backward_fake(grad, q, k, v, out, lse)
    (b, h, t, d), hkv = q.shape, k.shape[1]
    _check(_library().amx_attention_backward(*_args(q), *_args(k), *_args(v), *_args(out), *_args(grad),
                                             lse.data_ptr(), *_args(dq), *_args(dk), *_args(dv), b, h, hkv, t,
                                             d ** -0.5, torch.get_num_threads()))
    return dq, dk, dv


@_backward.register_fake
def _backward_fake(grad, q, k, v, out, lse):
    return tuple(torch.empty_like(_kernel_layout(t)) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _differentiate(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return _backward(grad_out, q, k, v, out, lse)


_forward.register_autograd(_differentiate, setup_context=_setup_context)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of bfloat16 (batch, heads, seq, 16) q and (batch, kv_heads, seq, 16) k, v on CPU."""
    return _forward(q, k, v)[0]
