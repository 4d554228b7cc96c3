"""The router's tokenizer: a checkpoint's fast-tokenizer file read with `tokenizers`, and its chat
template rendered with jinja2 the way transformers renders it. The router never imports
transformers (which imports torch); tests/unit/test_router_tokenizer.py holds both to the same
token ids and rendered text.

Needs `tokenizer.json` in the checkpoint (what a fast tokenizer saves; a checkpoint with only a
sentencepiece model can be converted once with transformers' `save_pretrained`).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class RouterTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: the router needs a fast tokenizer's tokenizer.json (convert a "
                             "checkpoint once with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d))")
        self._tok = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        specials = {**_read_json(model_dir / "special_tokens_map.json"), **config}
        self.special_tokens = {k: _token_text(specials[k]) for k in SPECIAL_TOKENS if specials.get(k) is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos is not None else None
        self.chat_template = _chat_template(model_dir, config)
        self._template = _compile(self.chat_template) if self.chat_template else None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (what the engine's tokenizer gives)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_one(self, token_id: int) -> str:
        """One token's text on its own (special tokens included), as logprobs name tokens."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's (a string, or a
    list of named ones), else chat_template.json's."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template or None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps the text as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

    def _keep(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
