import json
import random

import pytest

from onepath.tasks.arithmetic import (ALPHABET, BOS_ID, EOS_ID, PAD_ID, build_tokenizer,
                                      make_problems, sft_text, tokenizer_config,
                                      train_test_split, write_dataset)
from onepath.tasks.rows import prompt_text
from onepath.train.data import load_rows


def test_tokenizer_round_trip_random_strings():
    tokenizer = build_tokenizer()
    assert tokenizer.decode(tokenizer.encode("12+7=").ids) == "12+7="
    rng = random.Random(0)
    for length in [0, 1, 2, 7, 33, 200]:
        for _ in range(20):
            text = "".join(rng.choice(ALPHABET) for _ in range(length))
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            assert len(ids) == len(text)  # one token per character
            assert tokenizer.decode(ids) == text


def test_tokenizer_ids_and_specials():
    tokenizer = build_tokenizer()
    assert (tokenizer.token_to_id("<pad>"), tokenizer.token_to_id("<bos>"),
            tokenizer.token_to_id("<eos>")) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert tokenizer.get_vocab_size() <= 48
    assert tokenizer.encode("3=").ids[0] == BOS_ID
    assert BOS_ID not in tokenizer.encode("3=", add_special_tokens=False).ids
    ids = tokenizer.encode("82", add_special_tokens=False).ids + [EOS_ID]
    assert tokenizer.decode(ids) == "82"


def test_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = build_tokenizer()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer)))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "12 - 7 = 5."
    assert hf(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf.decode(tokenizer.encode(text).ids, skip_special_tokens=True) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)


def test_make_problems_deterministic_and_correct():
    a, b = make_problems(300, seed=3), make_problems(300, seed=3)
    assert a == b
    assert a != make_problems(300, seed=4)
    prompts = [prompt_text(row) for row in a]
    assert len(set(prompts)) == len(prompts)
    for row in a:
        expr = prompt_text(row)
        assert expr.endswith("=") and row["data_source"] == "arithmetic"
        assert str(eval(expr[:-1])) == row["reward_model"]["ground_truth"]
        assert int(row["reward_model"]["ground_truth"]) >= 0
    assert {"+", "-"} <= {c for p in prompts for c in p}


def test_make_problems_errors():
    with pytest.raises(ValueError, match="8 problems .* only 7 distinct"):
        make_problems(8, seed=0, max_operand=1)
    with pytest.raises(ValueError, match=r"'/'"):
        make_problems(3, seed=0, ops=("/",))


def test_make_problems_exhausts_small_space():
    rows = make_problems(7, seed=0, max_operand=1)
    assert sorted(prompt_text(r) for r in rows) == [
        "0+0=", "0+1=", "0-0=", "1+0=", "1+1=", "1-0=", "1-1="]


def test_train_test_disjoint():
    train, test = train_test_split(seed=0, n_train=2000, n_test=500)
    assert len(train) == 2000 and len(test) == 500
    assert not {prompt_text(r) for r in train} & {prompt_text(r) for r in test}
    assert [r["extra_info"] for r in test[:2]] == [{"split": "test", "index": 0},
                                                  {"split": "test", "index": 1}]
    assert train[5]["extra_info"] == {"split": "train", "index": 5}


def test_sft_text():
    row = make_problems(1, seed=0)[0]
    prompt, completion = sft_text(row)
    assert prompt == row["prompt"][0]["content"]
    assert completion == row["reward_model"]["ground_truth"]


def test_write_dataset_parquet_round_trip(tmp_path):
    train_path, test_path = write_dataset(tmp_path, seed=1, n_train=50, n_test=10)
    assert (train_path.name, test_path.name) == ("train.parquet", "test.parquet")
    train, test = train_test_split(seed=1, n_train=50, n_test=10)
    assert load_rows(train_path) == train
    assert load_rows(test_path) == test
