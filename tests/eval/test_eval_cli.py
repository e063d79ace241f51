"""``beaconkv eval`` and ``python -m beaconkv.eval``: one-line errors (exit 2, no folder left), --kv-storage,
--backend, defaults."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import beaconkv.eval
from beaconkv.cli import main
from beaconkv.eval import runner
from beaconkv.eval.__main__ import main as module_main
from beaconkv.eval.backend import GenerationBackend
from beaconkv.eval.cli import add_eval_arguments, config_from_args

from .fakes import PROBLEMS, FakeEngines, Tok, read, write_problems

REPO = Path(__file__).resolve().parents[2]
EVAL_DIR = Path(beaconkv.eval.__file__).resolve().parent


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the model would be loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(runner, "load_backend", refuse)
    monkeypatch.setattr(runner, "_load", refuse)  # either backend


@pytest.fixture
def fake_model(monkeypatch) -> FakeEngines:
    """Every model 'loads' as a fake backend; returns its generate function."""
    gen = FakeEngines()
    monkeypatch.setattr(runner, "load_backend", lambda *a, **k: GenerationBackend(Tok(), gen))
    return gen


def eval_args(out: Path, *extra: str, data: Path | None = None, policy: str | None = "full") -> list[str]:
    args = ["eval", "--model", "fake", "--benchmark", "aime24", "--samples", "1", "--max-new-tokens", "4",
            "--out", str(out), "--no-progress"]  # fmt: skip
    if policy is not None:
        args += ["--policy", policy]
    if data is not None:
        args += ["--data", str(data)]
    return args + list(extra)


def assert_one_line_error(code: int, err: str, out: Path, *fragments: str) -> str:
    """Exit 2, stderr exactly one ``beaconkv eval: error:`` line holding ``fragments``, no --out folder."""
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("beaconkv eval: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert not out.exists(), f"{out} was left behind"
    return lines[0]


# ------------------------------------------------------------------------------------- user errors


@pytest.mark.parametrize("limit", ["0", "-1", "-30"])
def test_limit_below_one(tmp_path, capsys, no_model, limit) -> None:
    code = main(eval_args(tmp_path / "out", "--limit", limit))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", f"limit={limit}", "--limit N", ">= 1")


@pytest.mark.parametrize("max_batch", ["0", "-3"])
def test_max_batch_below_one_fails_before_the_model_loads(tmp_path, capsys, no_model, max_batch) -> None:
    code = main(eval_args(tmp_path / "out", "--max-batch", max_batch))
    err = capsys.readouterr().err
    assert_one_line_error(code, err, tmp_path / "out", f"max_batch={max_batch}", "--max-batch N", ">= 1")


@pytest.mark.parametrize("dtype", ["float8", "int8", "float64", "bogus"])
def test_unknown_dtype_fails_before_the_model_loads(tmp_path, capsys, no_model, dtype) -> None:
    code = main(eval_args(tmp_path / "out", "--dtype", dtype))
    line = assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", repr(dtype), "--dtype")
    assert "auto, float32, bfloat16, float16" in line


def test_known_dtype_aliases_are_accepted(tmp_path) -> None:
    parser = add_eval_arguments(argparse.ArgumentParser())
    for dtype in ("auto", "float32", "bfloat16", "float16", "bf16", "fp16"):
        args = parser.parse_args(["--model", "m", "--benchmark", "aime24", "--dtype", dtype])
        assert config_from_args(args).dtype == dtype


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("empty.jsonl", "", "is empty"),
        ("blank.jsonl", "\n \n\n", "holds no records"),
        ("header.csv", "id,problem,answer\n", "holds no records"),
        ("empty-list.json", "[]", "holds no records"),
    ],
)
def test_a_data_file_without_problems(tmp_path, capsys, no_model, name, content, fragment) -> None:
    data = tmp_path / name
    data.write_text(content)
    code = main(eval_args(tmp_path / "out", data=data))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", str(data), fragment, "--data FILE")


def test_a_data_file_without_usable_rows(tmp_path, capsys, no_model) -> None:
    data = tmp_path / "wrong-columns.jsonl"
    data.write_text('{"text": "What is 1+1?", "label": "2"}\n{"text": "x", "label": "y"}\n')
    code = main(eval_args(tmp_path / "out", data=data))
    assert_one_line_error(
        code, capsys.readouterr().err, tmp_path / "out", str(data), "'question'", "--field question=COLUMN"
    )


def test_a_missing_data_file(tmp_path, capsys, no_model) -> None:
    data = tmp_path / "missing.jsonl"
    code = main(eval_args(tmp_path / "out", data=data))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", str(data), "does not exist")


def test_unknown_benchmark(tmp_path, capsys, no_model) -> None:
    args = eval_args(tmp_path / "out")
    args[args.index("aime24")] = "aime23"
    code = main(args)
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", "'aime23'", "aime24", "--benchmark math --data FILE")


def test_benchmark_without_data_source(tmp_path, capsys, no_model) -> None:
    args = eval_args(tmp_path / "out")
    args[args.index("aime24")] = "math"
    code = main(args)
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", "'math'", "--data FILE")


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--policy", "nope", "--budget", "64"], ["'nope'", "is unknown", "beacon"]),
        (["--policy", "beacon", "--budget", "0"], ["budget >= 1", "got 0", "--budget N"]),
        (["--policy", "snapkv", "--budget", "-5"], ["budget >= 1", "got -5", "--budget N"]),
        (["--policy", "beacon", "--budget", "64", "--policy-arg", "n_bogus=3"], ["n_bogus", "parameters are"]),
    ],
)
def test_bad_policy_or_budget_fails_before_data_and_model(tmp_path, capsys, no_model, extra, fragments) -> None:
    code = main(eval_args(tmp_path / "out", *extra, data=tmp_path / "not-read.jsonl", policy=None))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", *fragments)


def test_missing_model_leaves_no_out_folder(tmp_path, capsys, project_data) -> None:
    missing = tmp_path / "no-such-checkpoint"
    args = eval_args(tmp_path / "out", "--limit", "1")
    args[args.index("fake")] = str(missing)
    code = main(args)
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", str(missing), "does not exist")


def test_python_dash_m_reports_errors_the_same_way(tmp_path, capsys, no_model) -> None:
    code = module_main(eval_args(tmp_path / "out", "--limit", "0")[1:])
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", "limit=0")


@pytest.mark.slow
def test_python_dash_m_process(tmp_path) -> None:
    cmd = [sys.executable, "-m", "beaconkv.eval", *eval_args(tmp_path / "out", "--dtype", "float8")[1:]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert_one_line_error(proc.returncode, proc.stderr, tmp_path / "out", "'float8'", "--dtype")


def test_debug_shows_the_traceback(tmp_path, capsys, no_model) -> None:
    code = main(eval_args(tmp_path / "out", "--limit", "0", "--debug"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("beaconkv eval: error: limit=0")


# ------------------------------------------------------------------------------------ --kv-storage


def test_kv_storage_reaches_generate_and_the_settings(tmp_path, capsys, fake_model) -> None:
    data = write_problems(tmp_path / "p.jsonl", PROBLEMS[:2])
    assert main(eval_args(tmp_path / "out", "--kv-storage", "int8", data=data)) == 0
    assert len(fake_model.calls) == 2 and {c["kv_storage"] for c in fake_model.calls} == {"int8"}
    records = read(tmp_path / "out" / "aime24__full.jsonl")
    assert [r["settings"]["kv_storage"] for r in records] == ["int8", "int8"]
    capsys.readouterr()
    # the same folder with another storage is another experiment: refused in one line
    code = main(eval_args(tmp_path / "out", "--kv-storage", "dense", "--samples", "2", data=data))
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "kv_storage" in err and "--tag" in err


def test_kv_storage_defaults_to_dense(tmp_path) -> None:
    parser = add_eval_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--benchmark", "aime24"])
    config = config_from_args(args)
    assert config.kv_storage == "dense" and config.settings()["kv_storage"] == "dense"
    args = parser.parse_args(["--model", "m", "--benchmark", "aime24", "--kv-storage", "int8"])
    assert config_from_args(args).kv_storage == "int8"


def test_max_batch_and_compile_reach_the_engine_and_are_no_resume_setting(tmp_path, capsys, fake_model) -> None:
    data = write_problems(tmp_path / "p.jsonl", PROBLEMS[:2])
    assert main(eval_args(tmp_path / "out", "--samples", "2", data=data)) == 0
    assert [(e["max_batch"], e["setup"].compile) for e in fake_model.engines] == [(8, False)]  # the defaults
    assert main(eval_args(tmp_path / "out", "--samples", "3", "--max-batch", "3", "--compile", data=data)) == 0
    assert [(e["max_batch"], e["setup"].compile) for e in fake_model.engines[1:]] == [(3, True)]
    assert len(fake_model.calls) == 6  # the second run resumed the first: it made only samples 2
    records = read(tmp_path / "out" / "aime24__full.jsonl")
    assert len(records) == 6 and all("max_batch" not in r["settings"] and "compile" not in r["settings"] for r in records)
    capsys.readouterr()


def test_results_of_the_retired_batch_size_setting(tmp_path, capsys, fake_model) -> None:
    data = write_problems(tmp_path / "p.jsonl", PROBLEMS[:2])
    assert main(eval_args(tmp_path / "out", data=data)) == 0
    merged = tmp_path / "out" / "aime24__full.jsonl"
    old = read(merged)
    for r in old:  # as a version with --batch-size wrote them: batch_size 1 gave every sample its own seed
        r["settings"]["batch_size"] = 1
    merged.write_text("".join(json.dumps(r) + "\n" for r in old))
    fake_model.calls.clear()
    assert main(eval_args(tmp_path / "out", "--samples", "2", data=data)) == 0
    assert len(fake_model.calls) == 2 and len(read(merged)) == 4  # resumed: only the new samples
    capsys.readouterr()
    for r in old:  # batch_size 2 seeded samples from their batch: other samples, refused
        r["settings"]["batch_size"] = 2
    merged.write_text("".join(json.dumps(r) + "\n" for r in old))
    code = main(eval_args(tmp_path / "out", "--samples", "2", data=data))
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "batch_size" in err and "--tag" in err


def test_results_written_before_kv_storage_and_backend_existed_resume_as_dense_native(tmp_path, capsys,
                                                                                      fake_model) -> None:
    data = write_problems(tmp_path / "p.jsonl", PROBLEMS[:2])
    assert main(eval_args(tmp_path / "out", data=data)) == 0
    merged = tmp_path / "out" / "aime24__full.jsonl"
    old = read(merged)
    for r in old:
        del r["settings"]["kv_storage"], r["settings"]["backend"]  # as an earlier version wrote them
    merged.write_text("".join(json.dumps(r) + "\n" for r in old))
    fake_model.calls.clear()
    assert main(eval_args(tmp_path / "out", "--samples", "2", data=data)) == 0
    assert len(fake_model.calls) == 2  # only the new samples
    assert len(read(merged)) == 4
    capsys.readouterr()


# -------------------------------------------------------------------------------------- --backend


def test_backend_defaults_to_native_and_is_a_resume_setting(tmp_path) -> None:
    parser = add_eval_arguments(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args(["--model", "m", "--benchmark", "aime24"]))
    assert config.backend == "native" and config.settings()["backend"] == "native"
    config = config_from_args(parser.parse_args(["--model", "m", "--benchmark", "aime24", "--backend", "hf"]))
    assert config.backend == "hf" and config.settings()["backend"] == "hf"


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--compile"], ["--backend hf", "eager", "drop --compile"]),
        (["--kv-storage", "int8"], ["--backend hf", "densely", "drop --kv-storage int8"]),
        (["--kv-cache-dtype", "int8"], ["--backend hf", "drop --kv-storage int8"]),
    ],
)
def test_what_the_hf_backend_cannot_run_fails_before_data_and_model(tmp_path, capsys, no_model, extra,
                                                                    fragments) -> None:
    code = main(eval_args(tmp_path / "out", "--backend", "hf", *extra, data=tmp_path / "not-read.jsonl"))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", *fragments)


def test_the_hf_backend_without_transformers_fails_before_data_and_model(tmp_path, capsys, no_model,
                                                                         monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers"
                        else find_spec(name, *a))
    code = main(eval_args(tmp_path / "out", "--backend", "hf", data=tmp_path / "not-read.jsonl"))
    assert_one_line_error(code, capsys.readouterr().err, tmp_path / "out", "--backend hf", "transformers",
                          "beaconkv[hf]", "--backend native")


def test_an_unknown_backend_is_refused_by_the_parser(tmp_path, capsys, no_model) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(eval_args(tmp_path / "out", "--backend", "vllm"))
    assert exit_.value.code == 2 and "--backend" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_results_of_the_native_backend_do_not_resume_on_the_hf_backend(tmp_path, capsys, fake_model) -> None:
    pytest.importorskip("transformers", reason="--backend hf needs the hf extra")
    data = write_problems(tmp_path / "p.jsonl", PROBLEMS[:2])
    assert main(eval_args(tmp_path / "out", data=data)) == 0
    assert [r["settings"]["backend"] for r in read(tmp_path / "out" / "aime24__full.jsonl")] == ["native"] * 2
    capsys.readouterr()
    # the backends draw samples from different generators: another experiment, refused before a model loads
    code = main(eval_args(tmp_path / "out", "--backend", "hf", "--samples", "2", data=data))
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "backend" in err and "--tag" in err


# ------------------------------------------------------------------------------ data in the project


def test_aime24_reads_the_project_file_by_default(tmp_path, capsys, fake_model, monkeypatch, project_data) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: pytest.fail(f"hub download {kw}"))
    assert main(eval_args(tmp_path / "out", "--limit", "2")) == 0
    records = read(tmp_path / "out" / "aime24__full.jsonl")
    assert [(r["problem_id"], r["reference"]) for r in records] == [("60", "204"), ("61", "113")]
    assert "| aime24 | full | - | 2 | 2 |" in capsys.readouterr().out


def test_help_and_sources_never_point_outside_the_project() -> None:
    help_text = add_eval_arguments(argparse.ArgumentParser()).format_help()
    assert "shared" not in help_text and "data/" in help_text
    word = "sha" + "red"  # spelled apart: this file is scanned too, by this test and by the stop checklist
    outside = ("/".join(["..", word]), "/ " + f'"{word}"', "parent / " + f'"{word}"')
    tests = [p for p in Path(__file__).parent.glob("*.py") if p.name != Path(__file__).name]
    sources = [*EVAL_DIR.rglob("*.py"), *tests]  # the sandbox package included
    for path in sources:
        text = path.read_text()
        assert not any(needle in text for needle in outside), path


# ------------------------------------------------------------------------------ import structure


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ``import from`` names, a relative one (``from ..x import y``) resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _eval_imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported beaconkv module, at module top?)] for every file of beaconkv/eval (the modules of the
    sandbox package count as one, ``sandbox``); relative imports resolved."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in [*sorted(EVAL_DIR.glob("*.py")), *sorted(EVAL_DIR.glob("sandbox/*.py"))]:
        inside = path.parent != EVAL_DIR
        package = "beaconkv.eval.sandbox" if inside else "beaconkv.eval"
        tree = ast.parse(path.read_text())
        # a module-level ``try: import ... except ImportError:`` runs at import time too (the sandbox's modules,
        # loaded by path by its helper with the standard library only, fall back there)
        top = {id(node) for node in tree.body}
        top |= {id(inner) for node in tree.body if isinstance(node, ast.Try) for inner in node.body}
        imports = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, package)
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            names = [n for n in names if n.split(".")[0] == "beaconkv"]
            if names:
                imports.append((names[0], id(node) in top, names))
        found.setdefault("sandbox" if inside else path.stem, []).extend(imports)
    return found


# The one late import: the transformers backend needs the optional hf extra, so only --backend hf imports it.
OPTIONAL_LATE_IMPORTS = {("runner", "beaconkv.eval.hf_backend")}


def test_project_imports_of_beaconkv_eval_are_at_module_top() -> None:
    late = {(mod, name) for mod, imports in _eval_imports().items() for name, at_top, _ in imports if not at_top}
    assert late <= OPTIONAL_LATE_IMPORTS


def test_beaconkv_eval_modules_import_no_circle() -> None:
    modules = {stem for stem in _eval_imports()}
    graph = {
        mod: {
            n.split(".")[2] for _, _, names in imports for n in names
            if n.startswith("beaconkv.eval.") and n.split(".")[2] in modules and n.split(".")[2] != mod
        }
        for mod, imports in _eval_imports().items()
    }
    graph["__init__"] = set()  # the package face re-exports; nothing inside imports it
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(mod: str, path: list[str]) -> None:
        if state.get(mod) == 1:
            pytest.fail("import circle: " + " -> ".join([*path, mod]))
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in sorted(graph[mod]):
            visit(dep, [*path, mod])
        state[mod] = 2
        order.append(mod)

    for mod in sorted(graph):
        visit(mod, [])
    assert "runner" in graph["cli"] and "cli" not in graph["runner"]
    assert not hasattr(runner, "__getattr__")
