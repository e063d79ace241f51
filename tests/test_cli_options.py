"""The command line is one CLI: every shared option means the same in every subcommand, the policy options
resolve the same way everywhere (beacon by default, a budget never silently ignored, ``--policy-arg``,
classes of one's own), vLLM's spellings are aliases, and fidelity's old ``--top-k`` fails with its new name."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest
import torch

from beaconkv import arguments, cli
from beaconkv.arguments import SHARED_OPTIONS, RenamedOption, policy_args_by_policy, policy_from_args, policy_settings
from beaconkv.cli import build_parser, main
from beaconkv.eval.cli import config_from_args
from beaconkv.measure.analysis import analyze_policy
from beaconkv.measure.fidelity.study import study_runs
from beaconkv.models.loading import resolve_device, resolve_dtype
from beaconkv.policies import BeaconKV, FullKV, PolicyConfigError, make_policy, policy_class
from beaconkv.policies.registry import policy_display_name
from beaconkv.serve.cli import ServeError, prompt_capacity

def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def command_params() -> list:
    return list(subcommands())


def reference_actions() -> dict[str, argparse.Action]:
    """Option string -> the action its one definition in beaconkv.arguments makes."""
    out = {}
    for add in SHARED_OPTIONS:
        scratch = argparse.ArgumentParser(add_help=False)
        add(scratch)
        (action,) = scratch._actions
        out.update(dict.fromkeys(action.option_strings, action))
    return out


def meaning(action: argparse.Action) -> tuple:
    """Everything that makes an option mean what it means."""
    choices = tuple(action.choices) if action.choices is not None else None
    return (type(action), tuple(action.option_strings), action.dest, action.default, action.type, choices,
            action.help, action.nargs, action.const, action.required, action.metavar)


def divergences(parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``parser`` that share a spelling with a shared option but not its meaning."""
    reference = reference_actions()
    found = []
    for action in parser._actions:
        if isinstance(action, RenamedOption):
            continue  # an old spelling that only fails, naming the new one
        shared = {reference[o].option_strings[0] for o in action.option_strings if o in reference}
        for name in shared:
            if meaning(action) != meaning(reference[name]):
                found.append(f"{'/'.join(action.option_strings)}: {meaning(action)} != {meaning(reference[name])}")
    return found


# -------------------------------------------------------------------------------- one meaning each
def test_the_shared_options_are_the_ones_users_type_everywhere():
    names = set(reference_actions())
    assert {"--model", "--device", "--dtype", "--policy", "--budget", "--n-recent", "--policy-arg", "--kv-storage",
            "--kv-cache-dtype", "--max-batch", "--max-num-seqs", "--threads", "--top-k", "--backend"} <= names


@pytest.mark.parametrize("command", command_params())
def test_every_shared_option_has_one_meaning_and_one_default(command):
    assert divergences(subcommands()[command]) == []


def test_the_check_fails_on_a_divergent_option():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="cpu or cuda")  # as generate had it
    parser.add_argument("--kv-storage", default="dense")  # without its vLLM alias
    arguments.add_budget_argument(parser)
    assert [d.split(":")[0] for d in divergences(parser)] == ["--device", "--kv-storage"]


@pytest.mark.parametrize("command", command_params())
def test_every_command_that_chooses_a_policy_takes_policy_args(command):
    options = {o for a in subcommands()[command]._actions for o in a.option_strings}
    if options & {"--policy", "--policies"}:
        assert "--policy-arg" in options
    if "--budget" in options:
        assert "--policy" in options or "--policies" in options


@pytest.mark.parametrize("command", ["generate", "fidelity", "eval"])
def test_every_command_that_runs_a_transformers_model_takes_the_shared_backend(command):
    options = {o: a for a in subcommands()[command]._actions for o in a.option_strings}
    assert meaning(options["--backend"]) == meaning(reference_actions()["--backend"])
    assert (options["--backend"].default, tuple(options["--backend"].choices)) == ("native", ("native", "hf"))


@pytest.mark.parametrize("command", ["generate", "demo", "serve", "eval"])
def test_device_and_dtype_default_to_auto(command):
    options = {o: a for a in subcommands()[command]._actions for o in a.option_strings}
    assert options["--device"].default == options["--dtype"].default == "auto"


def test_auto_device_and_dtype_follow_the_machine():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # the evaluation's rule
    assert resolve_dtype("AUTO") == torch.float32


# ---------------------------------------------------------------------------------- the policy
def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


GENERATE, SERVE, EVAL = ["generate", "--prompt", "x"], ["serve"], ["eval", "--benchmark", "aime24"]


@pytest.mark.parametrize("argv", [GENERATE, SERVE, EVAL, ["demo"], ["analyze"]], ids=lambda a: a[0])
def test_every_command_defaults_to_beacon(argv):
    settings = policy_settings(parse(*argv), arguments.WORKLOAD_BUDGETS.get(argv[0], arguments.DEFAULT_BUDGET))
    assert policy_class(settings.name) is BeaconKV
    assert settings.budget == arguments.WORKLOAD_BUDGETS.get(argv[0], 1024)


def test_generate_budget_without_policy_runs_beacon(tiny_checkpoint, capsys):
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a b c", "--raw", "--max-new-tokens", "12",
               "--ignore-eos", "--budget", "8", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "[BeaconKV(budget=8, n_prefix=None, n_recent=1," in err  # n_recent auto: the most budget 8 allows
    evictions = int(err.split("evictions [")[1].split("]")[0])
    assert evictions > 0


def test_budget_32_without_policy_is_beacon_with_a_fitting_n_recent():
    policy = policy_from_args(parse(*GENERATE, "--budget", "32"))
    assert isinstance(policy, BeaconKV) and (policy.budget, policy.n_recent) == (32, 4)
    assert policy_from_args(parse(*GENERATE)).n_recent == 16  # the policy's own where it fits
    assert policy_from_args(parse(*GENERATE, "--budget", "32", "--n-recent", "2")).n_recent == 2


def _one_line_error(capsys, rc: int, command: str, *fragments: str) -> None:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"beaconkv {command}: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command locates or loads a model before the settings are checked."""
    from beaconkv.eval import runner
    from beaconkv.serve import cli as serve_cli

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    for module, name in ((cli, "load_model"), (cli, "model_path"), (serve_cli, "resolve_checkpoint"),
                         (runner, "load_backend")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("argv", [GENERATE, SERVE, EVAL, ["demo"]], ids=lambda a: a[0])
def test_full_with_an_explicit_budget_is_an_error(argv, capsys, no_model, tmp_path):
    out = ["--out", str(tmp_path / "out")] if argv[0] == "eval" else []
    rc = main([*argv, *out, "--policy", "full", "--budget", "32"])
    _one_line_error(capsys, rc, argv[0], "--policy full keeps every token", "--budget 32", "drop --budget")
    assert not (tmp_path / "out").exists()


def test_full_without_a_budget_is_fullkv_everywhere():
    for argv in (GENERATE, SERVE, EVAL):
        settings = policy_settings(parse(*argv, "--policy", "full"))
        assert (settings.budget, settings.kwargs) == (None, {})
    assert isinstance(policy_from_args(parse(*GENERATE, "--policy", "fullkv")), FullKV)
    with pytest.raises(PolicyConfigError, match="takes no n_recent"):
        policy_from_args(parse(*GENERATE, "--policy", "full", "--n-recent", "4"))


# -------------------------------------------------------------------------------- --policy-arg
@pytest.mark.parametrize("argv", [GENERATE, SERVE, ["demo"], ["analyze"]], ids=lambda a: a[0])
def test_policy_arg_reaches_the_policy(argv):
    args = parse(*argv, "--policy-arg", "aggregation=mean", "--policy-arg", "n_prefix=2", "--policy-arg",
                 "temperature=0.5")
    policy = analyze_policy(args) if argv[0] == "analyze" else policy_from_args(args)
    assert (policy.aggregation, policy.n_prefix, policy.temperature) == ("mean", 2, 0.5)


def test_policy_arg_reaches_the_eval_policy():
    config = config_from_args(parse(*EVAL, "--policy", "snapkv", "--budget", "64", "--policy-arg", "n_prefix=4"))
    assert config.policy_kwargs == {"n_prefix": 4, "n_recent": 8}  # n_recent auto: 16 does not fit budget 64
    policy = config.make_policy()
    assert (type(policy).__name__, policy.budget, policy.n_prefix, policy.n_recent) == ("SnapKV", 64, 4, 8)


def test_policy_arg_errors_name_the_key_and_the_fix(capsys, no_model):
    with pytest.raises(PolicyConfigError, match="has no parameter n_bogus; its parameters are"):
        policy_from_args(parse(*GENERATE, "--policy-arg", "n_bogus=3"))
    with pytest.raises(PolicyConfigError, match=r"n_beacon='many' must be an int"):
        policy_from_args(parse(*GENERATE, "--policy-arg", "n_beacon=many"))
    with pytest.raises(PolicyConfigError, match="both set n_recent; give one of them"):
        policy_from_args(parse(*GENERATE, "--n-recent", "4", "--policy-arg", "n_recent=8"))
    with pytest.raises(PolicyConfigError, match="set the budget with --budget"):
        policy_from_args(parse(*GENERATE, "--policy-arg", "budget=8"))
    with pytest.raises(PolicyConfigError, match="given twice"):
        policy_from_args(parse(*GENERATE, "--policy-arg", "ratio=0.5", "--policy-arg", "ratio=0.75"))
    with pytest.raises(SystemExit):
        parse(*GENERATE, "--policy-arg", "no-equals-sign")
    assert "expected KEY=VALUE" in capsys.readouterr().err
    rc = main([*SERVE, "--policy-arg", "n_bogus=3"])
    _one_line_error(capsys, rc, "serve", "n_bogus")


def test_policy_arg_of_a_study_goes_to_the_policies_that_take_it(capsys, tmp_path):
    args = parse("fidelity", "--policy-arg", "n_beacon=4", "--policy-arg", "n_prefix=2")
    assert policy_args_by_policy(args, ["beacon", "snapkv", "full"]) == {
        "beacon": {"n_beacon": 4, "n_prefix": 2}, "snapkv": {"n_prefix": 2}}
    with pytest.raises(PolicyConfigError, match="none of the policies beacon, snapkv has a parameter 'n_bogus'"):
        policy_args_by_policy(parse("fidelity", "--policy-arg", "n_bogus=1"), ["beacon", "snapkv"])
    rc = main(["fidelity", "--policy-arg", "n_bogus=1", "--out", str(tmp_path / "out")])
    _one_line_error(capsys, rc, "fidelity", "n_bogus")  # before any model or trace loads


# ----------------------------------------------------------------------------- a class of one's own
VALUE_NORM = '''
    from dataclasses import dataclass

    from beaconkv.policies import EvictionPolicy, PolicyConfigError


    @dataclass
    class ValueNorm(EvictionPolicy):
        """Keeps the cached tokens whose values have the largest norm."""

        scale: float = 1.0

        def validate(self):
            super().validate()
            if self.scale <= 0:
                raise PolicyConfigError(f"scale={self.scale} must be > 0.")

        def score(self, layer, rows, t):
            return layer.values(rows).float().norm(dim=-1) * self.scale   # (b, kv_heads, capacity)


    class NotAPolicy:
        pass
'''


@pytest.fixture
def policy_file(tmp_path) -> Path:
    path = tmp_path / "my_policies.py"
    path.write_text(textwrap.dedent(VALUE_NORM))
    return path


def test_a_policy_file_runs_in_generate(policy_file, tiny_checkpoint, capsys):
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a b c", "--raw", "--max-new-tokens", "12",
               "--ignore-eos", "--device", "cpu", "--policy", f"{policy_file}:ValueNorm", "--budget", "8",
               "--policy-arg", "scale=2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "[ValueNorm(budget=8, n_prefix=None, n_recent=1," in err and "scale=2" in err
    assert int(err.split("evictions [")[1].split("]")[0]) > 0


def test_a_policy_class_is_taken_by_every_command_and_the_api(policy_file, monkeypatch):
    spec = f"{policy_file}:ValueNorm"
    for argv in (GENERATE, SERVE, ["analyze"]):
        args = parse(*argv, "--policy", spec, "--budget", "64")
        policy = analyze_policy(args) if argv[0] == "analyze" else policy_from_args(args)
        assert type(policy).__name__ == "ValueNorm" and (policy.budget, policy.n_recent) == (64, 8)
    config = config_from_args(parse(*EVAL, "--policy", spec, "--policy-arg", "scale=3"))
    assert config.policy == spec and config.make_policy().scale == 3  # the path keeps its case
    assert policy_display_name(spec) == "ValueNorm"  # in eval's file names and tables
    assert policy_class(spec) is policy_class(spec)  # the file runs once
    (run,) = study_runs([spec], [64])  # fidelity's grid builds it through the registry too
    assert type(run.policy).__name__ == "ValueNorm"
    monkeypatch.syspath_prepend(str(policy_file.parent))
    assert type(make_policy("my_policies:ValueNorm", budget=32, n_recent=4)).__name__ == "ValueNorm"


@pytest.mark.parametrize("spec,fragments", [
    ("{dir}/missing.py:ValueNorm", ["missing.py", "no such file", "path of the .py file"]),
    ("{file}:Missing", ["has no class 'Missing'", "ValueNorm", "name after ':'"]),
    ("{file}:NotAPolicy", ["NotAPolicy", "does not subclass beaconkv.policies.EvictionPolicy", "derive it"]),
    ("no_such_module_xyz:ValueNorm", ["no module named 'no_such_module_xyz'", "path/to/file.py:Class"]),
], ids=["file-missing", "class-missing", "not-a-policy", "module-missing"])
def test_a_bad_policy_spec_is_one_line_naming_it_and_the_fix(spec, fragments, policy_file, capsys, no_model):
    spec = spec.format(dir=policy_file.parent, file=policy_file)
    rc = main([*GENERATE, "--policy", spec])
    _one_line_error(capsys, rc, "generate", f"policy={spec!r}", *fragments)
    rc = main([*SERVE, "--policy", spec])
    _one_line_error(capsys, rc, "serve", f"policy={spec!r}")


def test_a_policy_file_that_fails_to_run_names_the_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PolicyConfigError, match=r"running .*broken.py failed \(RuntimeError: boom\)"):
        make_policy(f"{broken}:Anything", budget=64)


# ---------------------------------------------------------------------------------- vLLM spellings
@pytest.mark.parametrize("argv", [SERVE, EVAL], ids=lambda a: a[0])
def test_max_num_seqs_is_max_batch(argv):
    assert parse(*argv, "--max-num-seqs", "3").max_batch == parse(*argv, "--max-batch", "3").max_batch == 3


@pytest.mark.parametrize("argv", [GENERATE, ["demo"], SERVE, EVAL, ["fidelity"]], ids=lambda a: a[0])
def test_kv_cache_dtype_is_kv_storage(argv, capsys):
    assert parse(*argv, "--kv-cache-dtype", "int8").kv_storage == "int8"
    assert parse(*argv, "--kv-cache-dtype", "auto").kv_storage == parse(*argv).kv_storage == "dense"
    for value in ("fp8", "fp8_e5m2"):
        with pytest.raises(SystemExit):
            parse(*argv, "--kv-cache-dtype", value)
        assert "no float8 KV cache; use int8" in capsys.readouterr().err


def test_max_model_len_sizes_the_prompts_of_serve(capsys, no_model):
    assert prompt_capacity(parse("serve", "--max-model-len", "4096", "--max-new-tokens", "1024")) == 3072
    assert prompt_capacity(parse("serve")) == 1024
    with pytest.raises(ServeError, match="both size the prompts; give one of them"):
        prompt_capacity(parse("serve", "--max-model-len", "4096", "--prompt-capacity", "512"))
    with pytest.raises(ServeError, match="leaves no room for a prompt"):
        prompt_capacity(parse("serve", "--max-model-len", "2048"))
    rc = main(["serve", "--max-batch", "0"])
    _one_line_error(capsys, rc, "serve", "max_batch=0", "--max-batch N")


# ---------------------------------------------------------------------------------- fidelity's K
@pytest.mark.parametrize("command", ["fidelity", "analyze"])
def test_fidelity_top_k_is_now_attention_top_k(command, capsys):
    assert parse(command, "--attention-top-k", "8").attention_top_k == 8
    assert parse(command).attention_top_k == 150
    with pytest.raises(SystemExit) as exit_:
        parse(command, "--top-k", "8")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--top-k was renamed --attention-top-k" in err and "not sampling" in err and "--attention-top-k 8" in err
