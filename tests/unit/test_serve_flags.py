"""`pdcluster serve` engine flags apply to every pool; an invalid value is refused before
anything starts, naming the field."""
from __future__ import annotations

import argparse

from cluster import serve
from cluster.cli import main


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_engine_flags_override_every_pool():
    cfg = serve.load_config(parse("--model", "tiny", "--dtype", "bfloat16", "--max-model-len", "512",
                                  "--page-size", "32", "--num-pages", "100", "--max-num-seqs", "8",
                                  "--migration-limit", "0"))
    assert [(p.engine.dtype, p.engine.max_model_len, p.engine.page_size, p.engine.num_pages, p.engine.max_num_seqs)
            for p in cfg.pools] == [("bfloat16", 512, 32, 100, 8)] * 2
    assert cfg.router.migration_limit == 0


def test_an_invalid_flag_is_refused_naming_the_field(capsys):
    assert main(["serve", "--model", "tiny", "--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "pools.0.engine.page_size" in err and "greater than or equal to 1" in err and "Traceback" not in err
    assert main(["serve", "--model", "tiny", "--migration-limit", "99"]) == 2
    assert "router.migration_limit" in capsys.readouterr().err
