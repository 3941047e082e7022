"""The recipes' shared pieces: model loading, the harness, progress lines."""

import io
import json

import pytest

from ac2_jax.orchestration import DefaultOrchestrator
from ac2_jax.recipes import MODELS, Progress, load_model
from ac2_jax.recipes.common import LINE_WIDTH, harness_factory
from tests.support.recipe_helpers import ParityEnv, write_tiny_model


def test_a_model_loads_from_an_hf_directory_a_preset_or_a_pair(tmp_path):
    path = write_tiny_model(str(tmp_path))
    model, tokenizer = load_model(path)
    assert model.config.num_layers == 2 and tokenizer.vocab_size == model.config.vocab_size
    assert load_model((model, tokenizer)) == (model, tokenizer)
    assert "tiny" in MODELS
    with pytest.raises(ValueError, match=r"--model 'nope': not a directory .* preset \(tiny\)"):
        load_model("nope")


def test_progress_lines_are_never_wider_than_120():
    out = io.StringIO()
    p = Progress("rl", 10, out=out)
    p.step(3, {f"metric_number_{i}": 0.123456 * i for i in range(40)}, note="(no update)")
    p.say("x" * 300)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[rl] 3/10  ") and lines[0].endswith("(no update)")
    assert all(len(x) <= LINE_WIDTH for x in lines)
    Progress("rl", 1, enabled=False, out=out).step(1)
    assert len(out.getvalue().splitlines()) == 2


def test_the_harness_is_the_envs_own_or_the_tool_loop():
    made = []

    class WithHarness(ParityEnv):
        def make_harness(self, task, client, model_name, *, sampling, max_steps):
            made.append((task, model_name, sampling, max_steps))
            return "custom"

    sampling = {"temperature": 0.5}
    assert harness_factory(sampling, 3)(WithHarness(), "t", None, "m") == "custom"
    assert made == [("t", "m", sampling, 3)] and made[0][2] is not sampling  # its own copy
    env = ParityEnv()
    task = env.sample_tasks(1, 0)[0]
    orch = harness_factory(sampling, 2)(env, task, None, "m")
    assert isinstance(orch, DefaultOrchestrator) and orch.sampling == sampling


def _sft_run(tmp_path, monkeypatch, *overrides, model="tiny"):
    """A one-demo SFT run of the tiny model in tmp_path/run; returns its console."""
    import functools
    import importlib

    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import SFTRecipeConfig, sft

    recipe = importlib.import_module("ac2_jax.recipes._sft")
    console = io.StringIO()
    monkeypatch.setattr(recipe, "Progress", functools.partial(Progress, out=console))
    cfg = load_config(SFTRecipeConfig, None, [
        f"paths.workdir={tmp_path / 'run'}", "demos.num_tasks=2", "sft.steps=1",
        "sft.batch_rows=2", "sft.seq_len=128", "sft.checkpoint_every=1",
        "log.report_files=false", *overrides])
    sft(model, ParityEnv(), cfg)  # a preset, a directory or a (model, tokenizer) pair
    return console.getvalue()


def test_a_reused_workdir_is_refused_resumed_or_overwritten_as_asked(tmp_path, monkeypatch):
    # Issue 68, finding 3: a reused workdir resumed silently, and a switch from full to
    # LoRA failed after the run's config.json was already overwritten.
    from ac2_jax.config import ConfigError

    _sft_run(tmp_path, monkeypatch)
    saved = tmp_path / "run" / "report" / "config.json"
    first = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    with pytest.raises(ConfigError, match=r"holds an sft run \(step 1\).*--resume.*--overwrite"):
        _sft_run(tmp_path, monkeypatch, "sft.steps=2")
    # Resume: the run continues where it stopped and says so; a changed setting is named.
    out = _sft_run(tmp_path, monkeypatch, "sft.steps=2", "paths.existing=resume",
                   "log.report_files=true")
    assert ("resuming at step 1 (changed: log.report_files false -> true, sft.steps 1 -> 2)"
            in out), out
    assert "[sft] 2/2" in out and "[sft] 1/2" not in out
    # The report covers the whole run, not only this invocation's step (issue 68).
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert report["steps"] == 2 and report["steps_this_run"] == 1
    assert [i["from_step"] for i in report["invocations"]] == [0, 1]
    assert report["first_loss"] == first["first_loss"] != report["final_loss"]
    # Every recipe writes the same report (issue 68, finding 10): a learning curve of the
    # whole run and pages of what it trained on (SFT: its demonstrations).
    folder = tmp_path / "run" / "report"
    assert report["learning_curve"] == str(folder / "learning_curve.png")
    assert (folder / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert report["pages"] == [str(folder / "demo_0.html"), str(folder / "demo_1.html")]
    assert "Say a word (0)." in (folder / "demo_0.html").read_text()
    before = saved.read_text()
    # What a checkpoint cannot take (full <-> LoRA, another model) is refused before any
    # work, in one line naming it, and the saved config stays as it was.
    with pytest.raises(ConfigError, match=r"lora: None \(full fine-tuning\) -> \{.*\"rank\":4") as e:
        _sft_run(tmp_path, monkeypatch, "sft.steps=3", "paths.existing=resume", "lora.rank=4")
    assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    assert saved.read_text() == before
    # Overwrite: the old run is gone and a new one starts at step 0.
    out = _sft_run(tmp_path, monkeypatch, "sft.steps=1", "paths.existing=overwrite")
    assert "resuming" not in out and "[sft] 1/1" in out
    assert '"existing": "overwrite"' in saved.read_text()


def test_resuming_with_another_model_is_refused_before_any_write(tmp_path, monkeypatch):
    # Issue 68, finding 3: another model (its name, or any shape of its config) is one
    # line naming what differs, and the run's saved files stay as they were.
    import dataclasses

    from flax import nnx

    from ac2_jax.config import ConfigError
    from ac2_jax.models import Decoder

    _sft_run(tmp_path, monkeypatch)
    report = tmp_path / "run" / "report"
    saved = {p.name: p.read_text() for p in (report / "config.json", report / "model.json")}
    with pytest.raises(ConfigError, match=r"model: tiny -> .*src.*--overwrite"):
        _sft_run(tmp_path, monkeypatch, "paths.existing=resume",
                 model=write_tiny_model(str(tmp_path / "src")))
    model, tok = load_model("tiny", str(tmp_path / "build"))
    narrow = Decoder(dataclasses.replace(model.config, num_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"another model \(num_layers 2 -> 1\)"):
        _sft_run(tmp_path, monkeypatch, "paths.existing=resume", model=(narrow, tok))
    assert {p.name: p.read_text() for p in (report / "config.json", report / "model.json")} == saved


def test_every_demonstration_is_checked_before_sft_writes_anything(tmp_path, monkeypatch):
    # Issue 68, finding 6: a demo whose answer fails its own verifier or whose tool calls
    # the model's parser cannot read back was trained silently; a tool demo was longer
    # than the default seq_len (256).
    from ac2_jax.config import ConfigError
    from ac2_jax.envs.contract import EnvError
    from tests.envs.test_contract import ToolDemoEnv

    def run(env, *overrides):
        from ac2_jax.config_cli import load_config
        from ac2_jax.recipes import SFTRecipeConfig, sft

        cfg = load_config(SFTRecipeConfig, None, [
            f"paths.workdir={tmp_path / 'run'}", "demos.num_tasks=4", "sft.steps=1",
            "sft.batch_rows=2", "log.progress=false", *overrides])
        return sft("tiny", env, cfg)

    class WrongFromTheThird(ToolDemoEnv):  # check_env probes the first two only
        def demonstration(self, task):
            self.answer = "ok" if task.task_id.endswith(("-0", "-1")) else "odd"
            return super().demonstration(task)

    with pytest.raises(EnvError, match=r"^2 problems in the 4 demonstrations: demonstration\("
                                       r"'train-0-2'\) answers 'odd', which its verifier"):
        run(WrongFromTheThird())
    # The tiny model's template renders Hermes calls; a Mistral parser reads none back.
    with pytest.raises(EnvError, match=r"demo 'train-0-0' message 2: its tool calls \['lookup'\] "
                                       r"render as text the tool-call parser \(mistral\) reads "
                                       r"as \[\]"):
        run(ToolDemoEnv(), "tool_parser=mistral")
    with pytest.raises(ConfigError, match=r"4 of 4 demonstrations are longer than "
                                          r"sft.seq_len=64 .*sft.truncate=true"):
        run(ToolDemoEnv(), "sft.seq_len=64")
    assert not (tmp_path / "run" / "report").exists()  # nothing written


def test_the_default_sft_seq_len_fits_a_tool_demonstration(tmp_path):
    # The Qwen2.5 template's tool preamble + one tool + a one-call demo, in the tiny
    # tokenizer (more tokens per character than a real model's).
    from ac2_jax.recipes import SFTRecipeConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from tests.envs.test_contract import ToolDemoEnv
    from tests.models.test_family_templates import QWEN25

    tok = build_tiny_tokenizer(str(tmp_path))
    tok.chat_template = QWEN25
    env = ToolDemoEnv()
    demo = env.demonstration(env.sample_tasks(1, 0)[0])
    n = len(tok.apply_chat_template(demo, [t.spec() for t in env.tools], False, tokenize=True))
    assert 256 < n <= SFTRecipeConfig().sft.seq_len, n


def test_a_model_directory_missing_a_file_names_it_and_the_fix(tmp_path):
    # Issue 68, finding 10: a tokenizer without a chat template, or a model directory
    # without tokenizer.json, was a bare traceback.
    import json
    import os

    from ac2_jax.config import ConfigError

    path = write_tiny_model(str(tmp_path))
    config = os.path.join(path, "tokenizer_config.json")
    saved = json.load(open(config))
    json.dump({k: v for k, v in saved.items() if k != "chat_template"}, open(config, "w"))
    with pytest.raises(ConfigError, match=r"has no chat template \(tokenizer_config.json's "
                                          r"'chat_template' or chat_template.jinja\).*instruct"):
        load_model(path)
    json.dump(saved, open(config, "w"))
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"no tokenizer.json .*save_pretrained"):
        load_model(path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(ConfigError, match=r"no config.json"):
        load_model(path)


def test_an_evals_stale_pages_are_removed_and_nothing_else(tmp_path):
    """Review of issue 68: an eval that writes fewer pages than an earlier one left the
    earlier eval_trace_<i>.html beside its own. `remove_pages` removes exactly the
    `<name>_<i>.html` pages of that name; a training run's pages and files stay."""
    from ac2_jax.recipes.common import remove_pages

    names = ["eval_trace_0.html", "eval_trace_7.html", "trace_0.html", "eval_report.json",
             "eval_trace_notes.html", "my_eval_trace_1.html"]  # fmt: skip
    for n in names:
        (tmp_path / n).write_text("x")
    removed = remove_pages(str(tmp_path), "eval_trace")
    assert sorted(removed) == [str(tmp_path / "eval_trace_0.html"), str(tmp_path / "eval_trace_7.html")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert remove_pages(str(tmp_path / "absent"), "eval_trace") == []
