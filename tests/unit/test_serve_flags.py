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


def test_a_router_reachable_from_other_machines_needs_tls_and_a_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PDCLUSTER_API_KEYS", raising=False)
    assert main(["serve", "--model", "tiny", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "TLS (--tls-cert/--tls-key) and an API key (--api-key)" in err and "--insecure" in err
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    for argv in (["--insecure"], ["--tls-cert", str(cert), "--tls-key", str(key), "--api-key", "k-123"]):
        cfg = serve.load_config(parse("--host", "0.0.0.0", *argv))
        serve.check_exposure(cfg, "--insecure" in argv)  # allowed
    monkeypatch.setenv("PDCLUSTER_API_KEYS", "env-key-1, env-key-2")
    cfg = serve.load_config(parse("--api-key", "cli-key"))
    assert cfg.router.api_keys == ["cli-key", "env-key-1", "env-key-2"]
    assert "cli-key" not in repr(cfg.router)  # keys stay out of logs and reprs
    assert main(["serve", "--model", "tiny", "--tls-cert", str(cert)]) == 2
    assert "tls_cert and router.tls_key go together" in capsys.readouterr().err


def test_tensor_parallel_flags_set_each_roles_pools(tmp_path):
    by_role = {p.role: p.engine.tensor_parallel_size
               for p in serve.load_config(parse("--prefill-tp", "2", "--decode-tp", "4")).pools}
    assert by_role == {"prefill": 2, "decode": 4}
    assert {p.engine.tensor_parallel_size for p in serve.load_config(parse("--tp", "2")).pools} == {2}
    assert {p.role: p.engine.tensor_parallel_size for p in serve.load_config(
        parse("--tp", "2", "--decode-tp", "1")).pools} == {"prefill": 2, "decode": 1}
    colocated = serve.load_config(parse("--mode", "colocated", "--decode-tp", "2")).pools
    assert [(p.role, p.engine.tensor_parallel_size) for p in colocated] == [("colocated", 2)]
    config = tmp_path / "c.yaml"
    config.write_text("pools:\n  - {name: a, role: colocated, engine: {tensor_parallel_size: 2}}\n"
                      "  - {name: b, role: colocated}\n")
    assert [p.engine.tensor_parallel_size for p in serve.load_config(parse("--config", str(config))).pools] == [2, 1]
    assert [p.engine.tensor_parallel_size
            for p in serve.load_config(parse("--config", str(config), "--tp", "4")).pools] == [4, 4]


def test_the_embedded_default_reserves_the_machines_cpus(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [p.resources.num_cpus for p in serve.load_config(parse()).pools] == [4, 4]  # prefill + decode
    assert [p.resources.num_cpus for p in serve.load_config(parse("--tp", "2")).pools] == [2, 2]
    assert [p.resources.num_cpus for p in serve.load_config(parse("--mode", "colocated")).pools] == [8]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert [p.resources.num_cpus for p in serve.load_config(parse("--decode", "3")).pools] == [1, 1]  # at least 1


def test_a_tensor_parallel_size_the_model_cannot_split_is_refused_before_anything_starts(tiny_model, capsys):
    tiny_model("llama")  # 4 attention heads
    assert main(["serve", "--model", "tiny", "--mode", "colocated", "--tp", "3", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pools[0].engine.tensor_parallel_size" in err and "num_attention_heads=4" in err, err
    assert "Traceback" not in err
