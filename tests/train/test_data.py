import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from onepath.tasks.arithmetic import make_problems
from onepath.train.data import PromptSampler, load_rows, prompt_text, reward_kwargs


def _row(i, **overrides):
    row = {"data_source": "toy", "prompt": [{"role": "user", "content": f"{i}+1="}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
           "extra_info": {"index": i}}
    row.update(overrides)
    return row


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_round_trip(tmp_path):
    rows = make_problems(40, seed=0)
    assert load_rows(_write_jsonl(tmp_path / "a.jsonl", rows)) == rows
    assert load_rows(_write_jsonl(tmp_path / "a.json", rows)) == rows
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert load_rows(tmp_path / "b.json") == rows
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    assert load_rows(tmp_path / "c.parquet") == rows


def test_blank_lines_and_string_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(_row(0, prompt="3+4=")) + "\n\n")
    [row] = load_rows(path)
    assert prompt_text(row) == "3+4="


def test_missing_ground_truth_names_row(tmp_path):
    rows = [_row(i) for i in range(20)]
    rows[17]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"add reward_model.ground_truth to row 17 of .*"
                                         r"train.jsonl \(line 18\), or drop the row"):
        load_rows(path)
    del rows[17]["reward_model"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"row 17 of .*train.parquet"):
        load_rows(tmp_path / "train.parquet")


@pytest.mark.parametrize("prompt", ["", [], [{"role": "user", "content": ""}],
                                    [{"role": "user"}], None, 5])
def test_empty_prompt_names_row(tmp_path, prompt):
    rows = [_row(0), _row(1, prompt=prompt)]
    with pytest.raises(ValueError, match=r"row 1 of .*e.jsonl.*prompt"):
        load_rows(_write_jsonl(tmp_path / "e.jsonl", rows))


def test_bad_extension_missing_file_malformed_line(tmp_path):
    with pytest.raises(ValueError, match=r"'\.csv'.*\.parquet, \.jsonl, \.json"):
        load_rows(tmp_path / "data.csv")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_rows(tmp_path / "nowhere.jsonl")
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(1)) + "\n{\"prompt\": oops\n")
    with pytest.raises(ValueError, match=r"f.jsonl:3: not a JSON line"):
        load_rows(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no rows"):
        load_rows(path)


def test_prompt_text_and_reward_kwargs():
    row = _row(3, prompt=[{"role": "system", "content": "Add. "},
                          {"role": "user", "content": "3+1="}])
    assert prompt_text(row) == "Add. 3+1="
    assert reward_kwargs(row) == {"ground_truth": "4", "data_source": "toy",
                                  "extra_info": {"index": 3}, "ability": "math"}
    assert reward_kwargs(_row(0, extra_info=None))["extra_info"] == {}


def test_sampler_epochs_cover_every_row():
    rows = [_row(i) for i in range(10)]
    sampler = PromptSampler(rows, seed=0)
    first, second = sampler.next_batch(10), sampler.next_batch(10)
    assert sorted(r["extra_info"]["index"] for r in first) == list(range(10))
    assert sorted(r["extra_info"]["index"] for r in second) == list(range(10))
    assert first != second and first != rows  # shuffled, and differently per epoch
    assert sampler.state_dict()["epoch"] == 1
    assert PromptSampler(rows, seed=0, shuffle=False).next_batch(10) == rows


def test_sampler_resume_continues_exactly():
    rows = [_row(i) for i in range(7)]
    sizes = [3, 5, 1, 7, 16, 4, 2]
    uninterrupted = PromptSampler(rows, seed=11)
    expected = [uninterrupted.next_batch(n) for n in sizes]
    got = []
    sampler = PromptSampler(rows, seed=11)
    for n in sizes:
        got.append(sampler.next_batch(n))
        state = json.loads(json.dumps(sampler.state_dict()))
        sampler = PromptSampler(rows, seed=999)  # the state's seed must win
        sampler.load_state_dict(state)
    assert got == expected
    assert PromptSampler(rows, seed=12).next_batch(7) != expected[0] + expected[1][:4]


def test_sampler_rejects_other_dataset():
    state = PromptSampler([_row(i) for i in range(7)]).state_dict()
    with pytest.raises(ValueError, match="7 rows but the dataset has 6"):
        PromptSampler([_row(i) for i in range(6)]).load_state_dict(state)
