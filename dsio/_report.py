"""``dsio report``: what this machine can do for dsio, and why not (used by :mod:`dsio.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import dataclasses
import json
import mmap
import os
import platform
from typing import Any

from ._cli_common import human

__all__ = ["probe_o_direct", "report"]


def _mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("/", "?", "?")
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mnt = left.split()[4].replace("\\040", " ")
            fstype, source = (right.split() + ["?", "?"])[:2]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                best = (mnt, fstype, source)
    return best


def _block_sizes(path: str) -> tuple[int | None, int | None, str]:
    """(logical, physical block size, device name) from sysfs; Nones for non-block filesystems."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    base = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(base):
        return None, None, "no block device"
    dev = os.path.basename(os.path.realpath(base))
    queue = os.path.join(base, "queue")
    if not os.path.isdir(queue):  # a partition: the queue belongs to the whole disk
        queue = os.path.join(base, "..", "queue")

    def read(name: str) -> int | None:
        try:
            with open(os.path.join(queue, name)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    return read("logical_block_size"), read("physical_block_size"), dev


def probe_o_direct(directory: str) -> dict[str, Any]:
    """Whether O_DIRECT works in ``directory`` and the smallest alignment it accepts."""
    out: dict[str, Any] = {"directory": os.path.abspath(directory)}
    if not os.path.isdir(directory):
        out.update(
            o_direct=False, reason="not a directory" if os.path.exists(directory) else "does not exist"
        )
        return out
    mnt, fstype, source = _mount_of(directory)
    logical, physical, dev = _block_sizes(directory)
    out.update(
        mount=mnt,
        filesystem=fstype,
        source=source,
        device=dev,
        logical_block_size=logical,
        physical_block_size=physical,
    )
    name = os.path.join(directory, f".dsio-report-{os.getpid()}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        out.update(o_direct=False, reason=f"open(O_DIRECT): {e.strerror}")
        with contextlib.suppress(OSError):
            os.unlink(name)
        return out
    buf = mmap.mmap(-1, 8192)  # page-aligned
    try:
        view = memoryview(buf)
        os.pwrite(fd, view[:4096], 0)
        out["o_direct"] = True
        out["reason"] = ""
        for align in (512, 1024, 2048, 4096):
            try:
                os.pwrite(fd, view[:align], align)
                os.preadv(fd, [view[:align]], align)
            except OSError:
                continue
            out["dio_alignment"] = align
            break
    except OSError as e:
        out.update(o_direct=False, reason=f"O_DIRECT write: {e.strerror}")
    finally:
        view.release()
        buf.close()
        os.close(fd)
        os.unlink(name)
    return out


def _memlock() -> str:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    text = "unlimited" if soft == resource.RLIM_INFINITY else human(soft)
    cap_ipc_lock = False
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                cap_ipc_lock = bool(int(line.split()[1], 16) >> 14 & 1)
    return text + (" (not enforced: CAP_IPC_LOCK)" if cap_ipc_lock and soft != resource.RLIM_INFINITY else "")


def _cuda_status() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch_cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    elif torch.version.cuda is None:
        out["reason"] = "torch is a CPU-only build"
    else:
        out["reason"] = "no CUDA device visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
    lib = ctypes.util.find_library("cufile")
    loaded = None
    for cand in ([lib] if lib else []) + ["libcufile.so.0", "libcufile.so"]:
        try:
            ctypes.CDLL(cand)
        except OSError:
            continue
        loaded = cand
        break
    nvfs = os.path.exists("/proc/driver/nvidia-fs") or os.path.exists("/sys/module/nvidia_fs")
    if loaded is None:
        out["cufile"] = "not found (libcufile is not installed: CUDA tensors use pinned bounce buffers)"
    elif not nvfs:
        out["cufile"] = f"{loaded}: compat mode (nvidia-fs kernel module not loaded: cuFile does POSIX I/O)"
    else:
        out["cufile"] = f"{loaded}: GDS (nvidia-fs loaded)"
    try:  # the engine's own view (driver opened, cuFile driver opened) where dsio.gpu is built
        from .gpu import gpu_status

        g = gpu_status()
        out["gpu_status"] = dataclasses.asdict(g)
        out["gpu_path"] = g.auto_choice
        if g.cuda and g.cufile:
            out["cufile"] = (
                "GDS (nvidia-fs loaded)" if g.nvidia_fs else "compat mode (nvidia-fs module not loaded)"
            )
        elif g.cuda and loaded is not None:
            out["cufile"] = f"{loaded}: unusable: {g.cufile_reason}"
    except Exception as e:  # report what we know rather than fail
        out["gpu_path"] = f"unknown (dsio.gpu: {e})"
    return out


def _versions() -> dict[str, str]:
    from importlib import metadata

    import dsio

    out = {"dsio": dsio.__version__, "python": platform.python_version()}
    for dist in ("torch", "numpy", "prometheus-client", "uvloop"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


#: Optional packages dstrain and its tools use when installed (the distribution name, and what for).
INTEGRATIONS = {
    "transformers": "Hugging Face models and Trainer (dstrain.integrations)",
    "accelerate": "accelerate launch as the launcher",
    "tensorboard": "monitor: tensorboard writer",
    "wandb": "monitor: wandb writer",
    "hjson": "HJSON config files",
    "uvloop": "a faster event loop for dsio",
    "matplotlib": "plots of dsio tune and the benchmarks",
    "deepspeed": "side-by-side benchmarks against DeepSpeed",
}


def _dstrain_status(
    directories: list[dict[str, Any]], cuda: dict[str, Any], auto: str | None
) -> dict[str, Any]:
    """What dstrain can do on this machine, as ds_report lists DeepSpeed's ops: offload devices, process
    group backends, GPU paths, optional integrations. Found without importing dstrain (dsio never
    imports it): its presence by module spec, the rest from torch and dsio's own probes."""
    import importlib.util
    from importlib import metadata

    import torch.distributed as dist

    installed = importlib.util.find_spec("dstrain") is not None
    direct = [d["directory"] for d in directories if d.get("o_direct")]
    nvme = (
        f"available ({auto} backend; O_DIRECT in {', '.join(direct)})"
        if auto and direct
        else f"available through buffered I/O only (no O_DIRECT in {', '.join(d['directory'] for d in directories)})"
        if auto
        else "unavailable: no I/O backend works here"
    )
    gpu = bool(cuda.get("available"))
    nccl_built = dist.is_available() and dist.is_nccl_available()
    out: dict[str, Any] = {
        "installed": installed,
        "offload_devices": {"cpu": "available", "nvme": nvme},
        "process_groups": {
            "gloo": "available" if dist.is_available() and dist.is_gloo_available() else "unavailable",
            "nccl": "available"
            if nccl_built and gpu
            else "built, but no CUDA device"
            if nccl_built
            else "unavailable (torch built without NCCL)",
        },
        "cuda": "available" if gpu else f"unavailable: {cuda.get('reason', '?')}",
        "cufile": cuda.get("cufile", "?"),
        "integrations": {},
    }
    for dist_name, what in INTEGRATIONS.items():
        try:
            version = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            version = None
        out["integrations"][dist_name] = {"version": version, "for": what}
    return out


def _crc_status() -> dict[str, Any]:
    """The crc32c path checkpoints checksum with here, and every path this machine runs."""
    from .checkpoint._integrity import CRC32C_ENV, crc_path, crc_paths
    from .errors import ConfigError

    try:
        chosen = crc_path()
    except ConfigError as e:
        chosen = f"none: {e}"
    return {"path": chosen, "available": sorted(crc_paths()), "env": CRC32C_ENV}


def report(args: argparse.Namespace) -> int:
    from . import backend_status
    from ._native import native

    backends = backend_status()
    auto = next((b.name for b in backends if b.available), None)
    sysctl = "/proc/sys/kernel/io_uring_disabled"
    uring_disabled = "n/a"
    with contextlib.suppress(OSError), open(sysctl) as f:
        uring_disabled = f.read().strip()
    info: dict[str, Any] = {
        "versions": _versions(),
        "kernel": {"release": native().kernel_release(), "machine": platform.machine()},
        "backends": [dataclasses.asdict(b) for b in backends],
        "auto_backend": auto,
        "io_uring_disabled_sysctl": uring_disabled,
        "memlock_limit": _memlock(),
        "directories": [probe_o_direct(d) for d in (args.dir or [os.getcwd()])],
        "cuda": _cuda_status(),
        "crc32c": _crc_status(),
    }
    info["dstrain"] = _dstrain_status(info["directories"], info["cuda"], auto)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    v = info["versions"]
    print("dsio report")
    print("  versions   " + "  ".join(f"{k} {val}" for k, val in v.items()))
    print(f"  kernel     {info['kernel']['release']} ({info['kernel']['machine']})")
    print("  backends")
    for b in backends:
        state = "available" if b.available else f"unavailable: {b.reason}"
        print(f"    {b.name:<9} {state}")
    print(f"    auto ->   {auto or 'none'}   (kernel.io_uring_disabled = {uring_disabled})")
    print(f"  memlock    {info['memlock_limit']} (RLIMIT_MEMLOCK; pinned pools mlock their buffers)")
    crc = info["crc32c"]
    print(
        f"  crc32c     {crc['path']} (checkpoint checksums; runs here: {', '.join(crc['available'])}; "
        f"{crc['env']}=portable forces the crc32c package)"
    )
    for d in info["directories"]:
        print(f"  directory  {d['directory']}")
        if "filesystem" in d:
            lbs = d.get("logical_block_size")
            print(
                f"    filesystem {d['filesystem']} on {d['source']} (device {d['device']}), "
                f"logical block {lbs if lbs else '?'} B, physical {d.get('physical_block_size') or '?'} B"
            )
        if d.get("o_direct"):
            print(f"    O_DIRECT   works (smallest aligned size accepted: {d.get('dio_alignment', '?')} B)")
        else:
            print(f"    O_DIRECT   unavailable: {d.get('reason')} (dsio falls back to buffered I/O here)")
    c = info["cuda"]
    if c["available"]:
        print(f"  CUDA       available: {', '.join(c['devices'])} (CUDA {c['torch_cuda']})")
    else:
        print(f"  CUDA       unavailable: {c['reason']}")
    print(f"  libcufile  {c['cufile']}")
    print(f"  GPU path   {c.get('gpu_path', '?')}")
    t = info["dstrain"]
    print("  dstrain    " + ("installed" if t["installed"] else "not installed (pip install dsio ships it)"))
    print(f"    offload    cpu {t['offload_devices']['cpu']}; nvme {t['offload_devices']['nvme']}")
    groups = t["process_groups"]
    print(f"    dist       gloo {groups['gloo']}; nccl {groups['nccl']}")
    print(f"    CUDA       {t['cuda']}; cuFile {t['cufile']}")
    for name, x in t["integrations"].items():
        state = x["version"] if x["version"] else "not installed"
        print(f"    {name:<12} {state:<14} {x['for']}")
    return 0
