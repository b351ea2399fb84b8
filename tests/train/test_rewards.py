import threading

import pytest

from onepath.train.rewards import exact_answer, get_reward, math_answer, overlong_penalty

ROW = {"data_source": "arithmetic", "extra_info": {}}


def test_exact_answer():
    assert exact_answer("1+1=", " 82\n", ground_truth="82", **ROW) == 1.0
    assert exact_answer("1+1=", "82", ground_truth=82, **ROW) == 1.0
    assert exact_answer("1+1=", "83", ground_truth="82", **ROW) == 0.0
    assert exact_answer("1+1=", "8 2", ground_truth="82", **ROW) == 0.0
    assert exact_answer("1+1=", "", ground_truth="82", **ROW) == 0.0


@pytest.mark.parametrize("completion, ground_truth, score", [
    ("Adding them gives 72.\n#### 72", "72", 1.0),
    ("#### 72. Check: 3 + 1 = 4", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("so the answer is \\boxed{1/2}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{1/3}", "0.5", 0.0),
    ("First 3, then 5, finally 42", "42", 1.0),
    ("42", 42, 1.0),
    ("", "42", 0.0),
    ("\\frac{ }}}{{ \\boxed{", "1", 0.0),
    ("$$$ #### ####", "1", 0.0),
    ("\x00\xff" * 50, "1", 0.0),
])
def test_math_answer(completion, ground_truth, score):
    assert math_answer("q", completion, ground_truth=ground_truth, **ROW) == score


def test_math_answer_off_main_thread():
    scores = []
    worker = threading.Thread(target=lambda: scores.append(
        math_answer("q", "#### 72", ground_truth="72", **ROW)))
    worker.start()
    worker.join()
    assert scores == [1.0]


def test_overlong_penalty_numbers():
    reward = overlong_penalty(exact_answer, max_response_tokens=20, buffer_tokens=8,
                              penalty_factor=0.5)
    for length, expected in [(0, 1.0), (12, 1.0), (16, 1.0 - 0.25), (20, 1.0 - 0.5)]:
        assert reward("q", "7", ground_truth="7", response_length=length, **ROW) == expected
    assert reward("q", "8", ground_truth="7", response_length=20, **ROW) == -0.5
    assert reward.__name__ == "exact_answer"


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="buffer_tokens 30"):
        overlong_penalty(exact_answer, max_response_tokens=20, buffer_tokens=30)
    reward = overlong_penalty(exact_answer, max_response_tokens=20, buffer_tokens=4)
    with pytest.raises(KeyError, match="response_length"):
        reward("q", "7", ground_truth="7", **ROW)


def test_get_reward_by_name():
    assert get_reward("exact_answer") is exact_answer
    assert get_reward("math_answer") is math_answer
    with pytest.raises(ValueError, match="'exact'.*exact_answer, math_answer"):
        get_reward("exact")


def test_get_reward_from_file(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def length_reward(prompt, completion, **row):\n"
                    "    return float(len(completion)) + row['extra_info']['bonus']\n")
    reward = get_reward(f"{file}:length_reward")
    assert reward("q", "abc", ground_truth="x", data_source="d", extra_info={"bonus": 1}) == 4.0
    with pytest.raises(ValueError, match=f"{file}.*'nope'"):
        get_reward(f"{file}:nope")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        get_reward(f"{tmp_path / 'missing.py'}:length_reward")
