"""bench/report.py: the results tables in README.md, bench/README.md and the
settings tables in docs/ are what the generator writes from the committed
JSONs, and a figure is marked stale or unbacked when it is."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import report  # noqa: E402


@pytest.mark.parametrize("path", list(report.TABLES), ids=lambda p: str(p.relative_to(report.ROOT)))
def test_committed_tables_are_the_generators_output(path):
    text = path.read_text()
    assert report.rendered(text, report.TABLES[path]) == text, "run: python bench/report.py"


def test_every_headline_names_a_committed_json_and_its_runs():
    for h in report.HEADLINES:
        d = report.load_results(h.name)
        figure = h.take(d)
        assert figure.n_runs >= 1 and figure.runs and d["commit"], h.name
    assert 6 <= sum(h.in_readme for h in report.HEADLINES) <= 10     # README's table: read in one screen


def test_a_figure_is_stale_once_its_paths_change_and_unbacked_without_a_commit():
    head = report.git("rev-parse", "HEAD")
    first = report.git("rev-list", "--max-parents=0", "HEAD").split()[0]
    assert report.status(head, ("pyproject.toml",)) == "current"
    assert report.status(first, ("connector", "pyproject.toml")) == "stale: connector, pyproject.toml changed since"
    assert report.status(first, ()) == "current"                          # plain vLLM measures no package path
    assert report.status(first, ("connector", ":(exclude)connector")) == "current"      # a path left out
    assert report.status(head + "+changes", ("connector",)) == "unbacked: measured with uncommitted changes"
    assert report.status("0" * 40, ("connector",)) == "unbacked: commit not in this history"


def test_every_benchmark_that_saves_results_declares_what_it_measures():
    import ast
    savers = 0
    for script in sorted((report.ROOT / "bench").glob("*.py")):
        body = ast.parse(script.read_text()).body
        if any(isinstance(n, ast.ImportFrom) and n.module == "common" and "save" in {a.name for a in n.names}
               for n in body):
            savers += 1
            names = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            assert "MEASURES" in names, script.name
    assert savers >= 15


def test_every_headline_can_be_measured_again_by_one_command():
    import remeasure
    for h in report.HEADLINES:
        script, *args = remeasure.COMMANDS[h.name]
        assert (report.ROOT / "bench" / script).exists(), h.name
        assert report.script_of(h.name, report.load_results(h.name)).name == script, h.name
        assert h.name == args[args.index("--name") + 1] if "--name" in args else h.name == Path(script).stem


def test_what_is_current_is_left_alone_and_the_rest_is_measured_again(tmp_path, monkeypatch):
    import json

    import common
    import remeasure
    assert remeasure.why_stale("no_such_results") == "no results file"
    head = report.git("rev-parse", "HEAD")
    d = {"commit": head, "script": "long_session.py", "complete": True}
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(remeasure, "RESULTS", tmp_path)
    (tmp_path / "held_out.json").write_text(json.dumps(d))
    assert remeasure.why_stale("held_out") is None                  # no headline: current code is enough
    (tmp_path / "held_out.json").write_text(json.dumps({**d, "complete": False}))
    assert remeasure.why_stale("held_out") == "an interrupted run"
    (tmp_path / "held_out.json").write_text(json.dumps({**d, "commit": head + "+changes"}))
    assert remeasure.why_stale("held_out") == "unbacked: measured with uncommitted changes"


def test_a_headline_counts_every_set_of_runs_on_the_current_code(tmp_path, monkeypatch):
    """A benchmark run again on the same machine and code adds its runs to the
    headline (not the better set alone); a set from another machine or older
    code does not."""
    import json
    head = report.git("rev-parse", "HEAD")
    first = report.git("rev-list", "--max-parents=0", "HEAD").split()[0]

    def write(name, commit, machine, runs):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"commit": commit, "machine": machine, "results": {"w": {"c": {"runs": [{"x": v} for v in runs]}}}}))
    write("xbench", head, "m", [1, 2, 3])
    write("xbench_set2", head, "m", [4, 5, 6])
    write("xbench_set3", head, "another machine", [7])
    write("xbench_set4", first, "m", [8])                    # the package changed since
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    d, files = report.with_later_sets("xbench", json.loads((tmp_path / "xbench.json").read_text()))
    assert [r["x"] for r in d["results"]["w"]["c"]["runs"]] == [1, 2, 3, 4, 5, 6]
    assert files == ["xbench.json", "xbench_set2.json"]


def test_gpu_checks_records_each_tests_outcome(tmp_path):
    """bench/gpu_checks.py runs pytest and keeps every test's outcome (and why a
    test failed or was skipped) from pytest's JUnit XML, so README can say how
    the GPU tests last went."""
    import gpu_checks
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_passes():\n    assert True\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU here')\n"
        "def test_skips():\n    pass\n")
    got = gpu_checks.gpu_test_outcomes(str(tmp_path))
    def short(test: str) -> str:         # the module's dotted path starts where pytest put its rootdir
        return test.rsplit(".", 1)[-1]
    assert {short(t): o for t, o in got["tests"].items()} == {
        "test_three::test_passes": "passed", "test_three::test_fails": "failed", "test_three::test_skips": "skipped"}
    why = {short(t): m for t, m in got["messages"].items()}
    assert "one is not two" in why["test_three::test_fails"]
    assert "no GPU here" in why["test_three::test_skips"]
    assert got["exit_code"] == 1


def test_readme_says_how_the_gpu_tests_last_went(tmp_path, monkeypatch):
    import json

    import common
    d = {"commit": report.git("rev-parse", "HEAD"), "when": "2026-12-07T10:00:00Z",
         "machine": {"cpus": 16, "cpu_isa": "AVX512", "gpu": "NVIDIA H100"},
         "gpu_tests": {"tests": {"a::x": "passed", "a::y": "passed", "b::z": "skipped"}, "messages": {},
                       "exit_code": 0}}
    (tmp_path / "gpu_checks.json").write_text(json.dumps(d))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    line = report.gpu_tests_line()
    assert "last ran on NVIDIA H100" in line and line.endswith("current: 2 passed, 1 skipped.")
