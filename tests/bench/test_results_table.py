"""The README's results table is the one onepath.bench.results_table builds from bench/results/: the README
cannot claim a number that no committed file holds."""
from pathlib import Path

from onepath.bench import results_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_matches_the_results_files():
    assert results_table.main(["--check"]) == 0, "run python -m onepath.bench.results_table"


def test_every_row_cites_files_that_exist_and_records_a_command():
    for row in results_table.ROWS:
        for f in row.files:
            assert (ROOT / results_table.RESULTS / f).is_file(), f
        table = results_table.render()
        assert f"({results_table.RESULTS}/{row.files[0]})" in table


def test_check_fails_on_an_edited_number(tmp_path):
    """Negative control: a README whose table differs by one digit fails --check, and a rewrite restores it."""
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    edited = text.replace("37,585", "37,586", 1)
    assert edited != text
    readme.write_text(edited)
    assert results_table.main(["--check", "--readme", str(readme)]) == 1
    assert results_table.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == text
