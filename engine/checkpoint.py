"""Where a model's checkpoint is: a Hugging Face folder as given, or a built-in model by name.
No torch here (the router resolves models too); writing a missing built-in loads it."""
from __future__ import annotations

from pathlib import Path


def resolve_model(model: str | Path, build: bool = True) -> Path:
    """A checkpoint folder as given, or a built-in model named 'PRESET' or 'ARCH-PRESET'
    (written on first use unless `build` is False: then a missing one is an error)."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    from engine.builtin import ARCHS, PRESETS, ensure_builtin
    from engine.builtin.writer import default_cache_root

    name = str(model)
    arch, _, preset = name.rpartition("-") if "-" in name else ("llama", "", name)
    if arch in ARCHS and preset in PRESETS:  # a built-in name wins over a folder that is no checkpoint
        if build:
            return ensure_builtin(arch=arch, preset=preset)
        built = default_cache_root() / f"{arch}-{preset}-seed0"
        if not (built / "config.json").is_file():
            raise ValueError(f"built-in model {name!r} is not written yet at {built}: start a worker (or "
                             f"`pdcluster model make-tiny`) on this machine first")
        return built
    if path.is_dir():
        return path  # the loader says what is missing
    raise ValueError(
        f"model {name!r} is neither a checkpoint folder nor a built-in name "
        f"(PRESET or ARCH-PRESET with ARCH in {list(ARCHS)}, PRESET in {list(PRESETS)})"
    )
