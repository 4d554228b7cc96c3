"""The router tokenizes without transformers (which imports torch): token ids and rendered chat
templates equal transformers' own for the built-in checkpoints and for templates that use the
jinja features real chat templates use (loop controls, namespaces, raise_exception, tojson,
special-token variables, the generation tag)."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from router.tokenizer import RouterTokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "ünïcödé ✓ 漢字 🙂", "<|im_start|>user", "a" * 300]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "ünï \"quoted\" <b>"}],
]
TEMPLATES = {
    "system-default": (
        "{% set ns = namespace(sys=false) %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% set ns.sys = true %}{% endif %}{% endfor %}{% if not ns.sys %}<|im_start|>system\nDefault.<|im_end|>\n"
        "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "bos-and-loop-controls": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n{% if loop.last %}{{ eos_token }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"),
    "generation-tag": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_token_ids_equal_transformers(tiny_model, arch):
    model = tiny_model(arch)
    ours, theirs = RouterTokenizer(model), AutoTokenizer.from_pretrained(str(model))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.eos_token_id == theirs.eos_token_id


@pytest.mark.parametrize("name", [None, *TEMPLATES])
def test_chat_templates_render_as_transformers_renders_them(tiny_model, tmp_path, name):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    if name is not None:
        cfg_path = model / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = TEMPLATES[name]
        cfg_path.write_text(json.dumps(cfg))
    ours, theirs = RouterTokenizer(model), AutoTokenizer.from_pretrained(str(model))
    for chat in CHATS:
        for gen in (True, False):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want


def test_a_template_that_raises_and_a_checkpoint_without_tokenizer_json(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        RouterTokenizer(model).apply_chat_template(CHATS[0])
    cfg["chat_template"] = TEMPLATES["bos-and-loop-controls"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="bad role"):
        RouterTokenizer(model).apply_chat_template([{"role": "robot", "content": "x"}])
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        RouterTokenizer(model)
