"""The CPU attention kernel (`csrc/paged_decode.cpp`), compiled for this machine on first use.

Built with torch's C++ extension loader and the machine's compiler (`-O3 -march=native`), so
it is vectorised for the CPU it runs on. The module name carries a digest of the source, the
flags, the torch version and the CPU's feature flags: a build directory shared between unlike
machines (a home directory on NFS) never hands one machine another's binary, and a library found
under that name is always current, so a process imports it directly without running the build
tool or taking its lock. `make setup` builds it once (`python -m engine.attention.cpu_ext`).

Without a compiler the kernel is unavailable: `available()` says so with the reason, and
`attention_backend="auto"` falls back to the plain torch backend.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def module_name() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()):
        digest.update(part)
    return f"pdcluster_cpu_attn_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    """Where the module is built: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions (torch's own
    default root, without importing its slow extension loader), then the module's name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return Path(root) / module_name()


def _import_built(path: Path) -> ModuleType | None:
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. a library cut short by a killed build: build it again
        log.warning("could not import %s (%s); rebuilding", path, exc)
        return None
    return module


def load() -> ModuleType:
    """The compiled module, building it on first use. Raises RuntimeError when it cannot be built."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        try:
            name, where = module_name(), build_directory()
            _module = _import_built(where / f"{name}.so")
            if _module is None:
                if shutil.which("c++") is None and shutil.which("g++") is None:
                    raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
                from torch.utils.cpp_extension import load as load_extension

                where.mkdir(parents=True, exist_ok=True)
                _module = load_extension(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                                         build_directory=str(where), verbose=False)
        except Exception as exc:  # noqa: BLE001 - any build failure means: not available here
            _error = f"the CPU attention kernel could not be built: {type(exc).__name__}: {exc}"
            log.warning("%s; attention_backend='auto' uses the torch backend", _error)
            raise RuntimeError(_error) from exc
        return _module


def available() -> bool:
    try:
        load()
    except RuntimeError:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used here (None when it loads)."""
    return None if available() else _error


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, *, portable: bool = False) -> None:
    """out[b] = softmax(q[b] K_b^T * scale) V_b for one query token per sequence, K_b/V_b read in place
    from the pages `block_tables[b]` (int32 [B, max_pages]) over `context_lens[b]` (int32 [B]) tokens.
    q and out: [B, Hq, D] contiguous; kv_cache: [pages, 2, page_size, Hkv, D] contiguous (base.py).
    `portable` runs the plain-C loop even where the AVX2 one would (for tests)."""
    load().paged_decode_attention(out, q, kv_cache, block_tables, context_lens, scale, portable)


def has_simd() -> bool:
    """Whether this build has the AVX2 loop (x86 with AVX2 and FMA)."""
    return bool(load().has_simd())


if __name__ == "__main__":  # `make setup` builds it ahead of the first engine
    logging.basicConfig(level=logging.INFO)
    try:
        load()
    except RuntimeError as exc:
        print(f"{exc}\n(the engine will use the torch attention backend on CPUs)", file=sys.stderr)
        sys.exit(0)
    print(f"CPU attention kernel ready: {build_directory()} ({platform.machine()}, AVX2 loop: {has_simd()})")
