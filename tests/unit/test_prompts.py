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


# ------------------------------------------------------------------ records with fields
RECORDS = [{"id": "q1", "question": "What is 2+3?", "answer": "5", "level": 1,
            "tests": [{"in": 1, "out": 2}], "tags": {"k": "a"}},
           {"id": "q2", "question": "What is 7*6?", "answer": "42", "level": 3,
            "tests": None, "tags": {"k": "v"}}]


def _files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _write(tmp_path / "r.jsonl", [json.dumps(r) for r in RECORDS])
    plain = tmp_path / "r.json"
    plain.write_text(json.dumps(RECORDS))
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": RECORDS}))
    parquet = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    return {"jsonl": jsonl, "json": plain, "json-wrapped": wrapped, "parquet": parquet}


def test_jsonl_json_and_parquet_records_keep_every_field(tmp_path):
    for kind, path in _files(tmp_path).items():
        got = load_prompts(path, key="question")
        assert [p.prompt for p in got] == ["What is 2+3?", "What is 7*6?"], kind
        assert [p.id for p in got] == ["q1", "q2"], kind
        for p, record in zip(got, RECORDS):
            assert p.meta == {k: v for k, v in record.items() if k != "question"}, kind


def test_chat_messages_prompt(tmp_path):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add 2 and 3."}]
    path = _write(tmp_path / "m.jsonl", [json.dumps({"messages": msgs, "answer": 5})])
    (p,) = load_prompts(path, key="messages")
    assert p.messages == msgs and p.prompt == "Add 2 and 3." and p.meta == {"answer": 5}
    from megatron_rlhf.data.prompts import encode_record

    tok = _tiny_chat_tokenizer()
    assert tok.decode(encode_record(tok, p)) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
        "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs the chat template: drop --no-chat"):
        encode_record(tok, p, chat=False)
    bad = _write(tmp_path / "n.jsonl", [json.dumps({"messages": msgs + [{"role": "assistant", "content": "5"}]})])
    with pytest.raises(ValueError, match=r"n\.jsonl, line 1: the 'messages' chat must hold a user turn"):
        load_prompts(bad, key="messages")


def test_bad_records_name_file_row_and_key(tmp_path):
    files = _files(tmp_path)
    with pytest.raises(ValueError, match=r"r\.parquet, row 0: missing the 'prompt' field \(fields: .*'question'.*--prompt-key"):
        load_prompts(files["parquet"])
    with pytest.raises(ValueError, match=r"r\.json, row 1: missing the 'tests' field that the reward"):
        load_prompts(files["json"], key="question", required=("tests",))
    with pytest.raises(ValueError, match=r"r\.jsonl, line 2: missing the 'tests' field .*--answer-key"):
        load_prompts(files["jsonl"], key="question", required=("tests",))
    with pytest.raises(ValueError, match=r"r\.parquet, row 1: missing the 'tests' field"):  # (None there)
        load_prompts(files["parquet"], key="question", required=("tests",))
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"unknown dataset format '\.csv'; use one of \.jsonl, \.json, \.parquet"):
        load_prompts(tmp_path / "x.csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
        load_prompts(tmp_path / "bad.parquet")
    (tmp_path / "two.json").write_text(json.dumps({"a": [], "b": []}))
    with pytest.raises(ValueError, match="exactly one such list"):
        load_prompts(tmp_path / "two.json")
    with pytest.raises(FileNotFoundError, match="no such prompts file"):
        load_prompts(tmp_path / "missing.jsonl")
