"""`pdcluster bench decode-step` runs both CPU attention backends on the same requests and says so."""
import json

import pytest

from cluster.cli import main


def test_decode_step_bench_times_both_backends(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert main(["bench", "decode-step", "--model", "tiny", "--shapes", "3x40,2x20", "--rounds", "2", "--steps", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["streams"], r["prompt"]) for r in doc["rows"]] == [(3, 40), (2, 20)]
    for row in doc["rows"]:
        assert row["cpu"]["n"] == row["torch"]["n"] == 4
        assert row["ratio"] == pytest.approx(row["cpu"]["median"] / row["torch"]["median"])
    assert "ratio" in capsys.readouterr().out


def test_decode_step_bench_rejects_bad_shapes(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "decode-step", "--shapes", "64by400"])
    assert "--shapes must be STREAMSxPROMPT" in capsys.readouterr().err
