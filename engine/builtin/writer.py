"""Write a built-in checkpoint folder (`make_tiny`) or fetch one from the cache, creating
it atomically (`ensure_builtin`): build in a temp folder beside the target, then rename, so
a concurrent reader sees either nothing or a whole checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.builtin.config import dump_json, generation_config, hf_config
from engine.builtin.presets import ARCHS, PRESETS, check_choice, check_seed, default_cache_root, model_spec, param_count

CHECKPOINT_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: Path
    param_count: int
    files: tuple[Path, ...]


def write_checkpoint(out_dir: str | os.PathLike[str], arch: str = "llama", preset: str = "tiny",
                     seed: int = 0) -> WriteResult:
    """Write all checkpoint files into out_dir (created if missing; our files overwritten)."""
    spec = model_spec(arch, preset)
    seed = check_seed(seed)
    from engine.builtin.tokenizer import write_tokenizer  # tokenizers/torch only when writing
    from engine.builtin.weights import write_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(dump_json(hf_config(spec, seed)), encoding="utf-8")
    (out / "generation_config.json").write_text(dump_json(generation_config()), encoding="utf-8")
    count = write_weights(out / "model.safetensors", spec, seed)
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; a cache is shared
    assert count == param_count(spec)
    write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, spec.tokenizer_style)
    return WriteResult(out, count, tuple(out / name for name in CHECKPOINT_FILES))


def make_tiny(out_dir: str | os.PathLike[str], arch: str = "llama", preset: str = "tiny",
              seed: int = 0) -> Path:
    """Write a deterministic Hugging Face checkpoint into out_dir and return its path."""
    return write_checkpoint(out_dir, arch, preset, seed).path


def ensure_builtin(arch: str = "llama", preset: str = "tiny", seed: int = 0,
                   cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the cached checkpoint `{arch}-{preset}-seed{seed}`, written first if missing
    or written by an older format (its config.json differs from what we would write now)."""
    check_choice("arch", arch, ARCHS)
    check_choice("preset", preset, PRESETS)
    seed = check_seed(seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / f"{arch}-{preset}-seed{seed}"
    if _is_current(final, arch, preset, seed):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        write_checkpoint(tmp, arch, preset, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if final.exists():  # stale format: move it aside first, then swap in the new one
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".stale", dir=root))
            try:
                os.rename(final, stale / "old")
            except OSError:
                pass  # another process already replaced it
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final, arch, preset, seed):  # lost a race to a valid writer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(path: Path, arch: str, preset: str, seed: int) -> bool:
    if not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        on_disk = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return on_disk == hf_config(model_spec(arch, preset), seed)
