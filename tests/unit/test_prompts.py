import json
from collections import Counter
from pathlib import Path

import pytest

from megatron_rlhf.data.prompts import DEFAULT_PROMPTS, Prompt, format_prompt, load_prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_shipped_file_is_large_and_unique():
    prompts = load_prompts()
    assert DEFAULT_PROMPTS.is_file()
    assert len(prompts) >= 500
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({" ".join(p.prompt.lower().split()) for p in prompts}) == len(prompts)
    assert all(isinstance(p, Prompt) and p.prompt.strip() for p in prompts)
    assert len({p.category for p in prompts}) >= 12


def test_shipped_file_has_all_fields():
    for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines():
        assert set(json.loads(line)) == {"id", "prompt", "category", "split"}


def test_prompts_are_short():
    words = [len(p.prompt.split()) for p in load_prompts()]
    assert max(words) <= 80
    assert sum(8 <= w <= 60 for w in words) >= 0.9 * len(words)


def test_heldout_covers_every_category_and_is_disjoint():
    train, heldout = load_prompts(split="train"), load_prompts(split="heldout")
    assert len(heldout) >= 50
    assert {p.split for p in heldout} == {"heldout"} and {p.split for p in train} == {"train"}
    assert {p.id for p in train}.isdisjoint(p.id for p in heldout)
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in heldout)
    assert len(train) + len(heldout) == len(load_prompts())
    per_category = Counter(p.category for p in heldout)
    assert set(per_category) == {p.category for p in train}
    assert 0.07 <= len(heldout) / (len(train) + len(heldout)) <= 0.15


def test_bad_json_names_file_and_line(tmp_path):
    path = _write(tmp_path / "p.jsonl", ['{"prompt": "fine"}', "", '{"prompt": "broken",'])
    with pytest.raises(ValueError, match=r"p\.jsonl, line 3: invalid JSON"):
        load_prompts(path)


def test_missing_or_empty_prompt(tmp_path):
    with pytest.raises(ValueError, match=r"line 2: missing the 'prompt' field"):
        load_prompts(_write(tmp_path / "a.jsonl", ['{"prompt": "ok"}', '{"text": "no prompt key"}']))
    with pytest.raises(ValueError, match=r"line 1: 'prompt' must be a non-empty string"):
        load_prompts(_write(tmp_path / "b.jsonl", ['{"prompt": "   "}']))
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object"):
        load_prompts(_write(tmp_path / "c.jsonl", ['["a list"]']))


def test_unknown_split(tmp_path):
    with pytest.raises(ValueError, match=r"unknown split 'test'.*'train', 'heldout'"):
        load_prompts(split="test")
    path = _write(tmp_path / "p.jsonl", ['{"prompt": "hi", "split": "validation"}'])
    with pytest.raises(ValueError, match=r"line 1: split 'validation' is not one of"):
        load_prompts(path)


def test_minimal_user_file(tmp_path):
    path = _write(tmp_path / "mine.jsonl", ['{"prompt": "Say hello."}', "", '{"prompt": "Count to three."}'])
    prompts = load_prompts(str(path))
    assert prompts == [
        Prompt(id="line1", prompt="Say hello.", category="unknown", split="train"),
        Prompt(id="line3", prompt="Count to three.", category="unknown", split="train"),
    ]
    assert load_prompts(path, split="train") == prompts
    assert load_prompts(path, split="heldout") == []


def _tiny_chat_tokenizer():
    """A byte-level tokenizer (no merges) with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def test_format_prompt_applies_chat_template():
    tok = _tiny_chat_tokenizer()
    text = load_prompts(split="heldout")[0].prompt
    ids = format_prompt(tok, text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 2
    plain = format_prompt(tok, text, chat=False)
    assert tok.decode(plain) == text
