"""Helpers the one-GPU benchmarks share (``mfu_bench``, ``trainer_bench``, ``sizing_sweep``): the
single-rank environment, the measured matmul peak and GPU memory, profiler summaries and timing,
and the worker processes each variant runs in (clean CUDA memory and DeepSpeed state).

Imported by the scripts as a sibling module (a script's own folder is first on ``sys.path``);
torch is passed in or imported inside, so importing this costs nothing on a machine without it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_single(port: int) -> None:
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }.items():
        os.environ.setdefault(k, v)


def matmul_peak_tflops(torch) -> float | None:
    if not torch.cuda.is_available():
        return None
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1e3 / 20
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / sec / 1e12


def gpu_memory(torch) -> dict:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    outside = (total - free) - reserved  # CUDA context, NCCL, cuBLAS workspaces
    return {
        "maxAllocatedBytes": torch.cuda.max_memory_allocated(),
        "maxReservedBytes": torch.cuda.max_memory_reserved(),
        "outsideAllocatorBytes": outside,
        "peakDeviceBytes": torch.cuda.max_memory_reserved() + outside,
    }


def copy_sites(prof, top: int = 8) -> list[dict]:
    """Where the GPU time of ``aten::copy_`` comes from (``MFU_PROFILE_STACKS=1``: the profiled
    step records shapes and Python stacks): device time grouped by input dtypes and the innermost
    frames of the calling code."""
    groups: dict = {}
    for e in prof.events():
        if e.name != "aten::copy_" or e.self_device_time_total <= 0:
            continue
        frames, q = [], e.cpu_parent  # the enclosing ops and (with_stack) Python frames
        while q is not None and len(frames) < 6:
            if "torch/" not in q.name and not q.name.startswith("<built-in"):
                frames.append(q.name)
            q = q.cpu_parent
        key = (str(e.input_shapes[:2]), " <- ".join(frames))
        g = groups.setdefault(key, {"ms": 0.0, "calls": 0})
        g["ms"] += e.self_device_time_total / 1e3
        g["calls"] += 1
    rows = [{"shapes": k[0], "stack": k[1], **v} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def profile_summary(prof, wall_s: float, top: int = 12) -> dict:
    """GPU busy (union of kernel intervals) vs idle over the profiled step; top kernels/host ops."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    top_k = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:top]
    kernel_sum = sum(float(e["dur"]) for e in kernels)
    host = sorted(
        ((float(e["dur"]), e["name"]) for e in events if e.get("cat") == "cpu_op" and "dur" in e),
        reverse=True,
    )
    wall_us = wall_s * 1e6
    return {
        "wallMs": wall_s * 1e3,
        "gpuBusyMs": busy / 1e3,
        "gpuIdleMs": max(0.0, wall_us - busy) / 1e3,
        "kernelSumMs": kernel_sum / 1e3,
        "kernels": len(kernels),
        "topKernels": [
            {"name": n[:110], "ms": t / 1e3, "calls": c, "share": t / max(kernel_sum, 1)}
            for t, c, n in top_k
        ],
        "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top),
        "longestHostOps": [{"name": n[:90], "ms": d / 1e3} for d, n in host[:top]],
    }


def device_us(prof) -> float:
    """Sum of kernel time over a profile, microseconds: device events only (CPU ops also carry
    the device time of the kernels they launch; counting both would double it), the same sum as
    the profiler table's "Self CUDA time total"."""
    from torch.autograd import DeviceType

    return sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )


def device_ms(torch, fn, on_gpu, iters=10) -> float | None:
    """Kernel time of fn() in ms (sum of device time, host gaps excluded), via torch.profiler."""
    if not on_gpu:
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return device_us(prof) / iters / 1e3


def median_ms(torch, fn, on_gpu, warmup=5, iters=20) -> float:
    """Median milliseconds of fn() (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if on_gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[len(out) // 2]


def run_child(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run a worker process with stdout and stderr together: ``(returncode, output)``, or
    ``(None, the output so far)`` when it ran past ``timeout`` seconds and was killed."""
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout
        return None, out if isinstance(out, str) else (out or b"").decode(errors="replace")
    return proc.returncode, proc.stdout
