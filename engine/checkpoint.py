"""Where a model's checkpoint is: a Hugging Face folder as given, or a built-in model by name
('PRESET' or 'ARCH-PRESET'). No torch here and no writing: the router looks models up too.
`engine.core.resolve_model` also writes a built-in model that is missing."""
from __future__ import annotations

from pathlib import Path

from engine.builtin.presets import ARCHS, PRESETS, default_cache_root


def builtin_name(model: str | Path) -> tuple[str, str] | None:
    """(arch, preset) when `model` names a built-in model and is not a checkpoint folder."""
    if (Path(model) / "config.json").is_file():
        return None
    name = str(model)
    arch, _, preset = name.rpartition("-") if "-" in name else ("llama", "", name)
    return (arch, preset) if arch in ARCHS and preset in PRESETS else None


def builtin_dir(arch: str, preset: str, seed: int = 0) -> Path:
    return default_cache_root() / f"{arch}-{preset}-seed{seed}"


def find_model(model: str | Path) -> Path:
    """The checkpoint folder of `model`; a built-in one must have been written already."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    named = builtin_name(model)
    if named is not None:  # a built-in name wins over a folder that is no checkpoint
        built = builtin_dir(*named)
        if not (built / "config.json").is_file():
            raise ValueError(f"built-in model {str(model)!r} is not written yet at {built}: start a worker (or "
                             f"`pdcluster model make-tiny`) on this machine first")
        return built
    if path.is_dir():
        return path  # the loader says what is missing
    raise ValueError(
        f"model {str(model)!r} is neither a checkpoint folder nor a built-in name "
        f"(PRESET or ARCH-PRESET with ARCH in {list(ARCHS)}, PRESET in {list(PRESETS)})"
    )
