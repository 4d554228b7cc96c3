"""The committed protobuf stubs match what scripts/gen_proto.sh generates from proto/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "gen_proto.sh produced nothing"
    stale = [str(rel) for rel in generated if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stale stubs (run scripts/gen_proto.sh and commit): {stale}"
