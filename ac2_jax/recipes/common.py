"""What the recipes share: the model, the served policy, the harness, progress, outputs.

`load_model(spec)` takes an HF directory (config.json + safetensors + the
tokenizer's files) or a registered preset name (`MODELS`; "tiny": a random
2-layer model with a small tokenizer, for smoke runs). `serve_policy` runs
the endpoint on 127.0.0.1 (real HTTP) over the sampler `sampler.kind` names
(the embedded `JaxSampler` by default, SGLang or a fleet of servers); every
rollout of every recipe goes through it, as a production harness's would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ac2_jax.config_cli import to_dict
from ac2_jax.registry import Registry
from ac2_jax.training.core.metrics_log import MetricsLogger

__all__ = [
    "MODELS",
    "Progress",
    "RecipeResult",
    "check_model",
    "check_model_dir",
    "claim_workdir",
    "error_lines",
    "export_model",
    "hands_off_in_memory",
    "harness_factory",
    "load_model",
    "metrics_logger",
    "remove_pages",
    "resuming_line",
    "run_report",
    "saved_step",
    "serve_policy",
    "setting_failure",
    "tool_parser_line",
    "write_demo_pages",
    "write_json",
    "write_learning_curve",
    "write_trace_pages",
]

# Model presets by name: fn(workdir) -> (model, tokenizer).
MODELS: Registry[Callable[[str], tuple[Any, Any]]] = Registry("model preset")

LINE_WIDTH = 120


@dataclasses.dataclass
class RecipeResult:
    """What a recipe leaves: its report (also in paths.reports/report.json), the
    trained model, the held-out evals by name ("before", "after") and the rollouts."""

    report: dict[str, Any]
    model: Any
    evals: dict[str, Any] = dataclasses.field(default_factory=dict)
    traces: Any = None  # the TraceStore of the training rollouts


@MODELS.register("tiny")
def _tiny(workdir: str):
    """A random 2-layer decoder and a small byte-level BPE tokenizer (smoke runs)."""
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(os.path.join(workdir, "tiny_tokenizer"), vocab_size=512)
    config = DecoderConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_embeddings=True,
    )  # fmt: skip
    return Decoder(config, rngs=nnx.Rngs(0)), tokenizer


def load_model(
    spec: Any, workdir: str = ".", lora: Any = None, seed: int = 0, tool_parser: str | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer) from an HF directory, a preset name, or a (model, tokenizer)
    pair; with `lora` (a `LoRAConfig`) the model gets fresh adapters (`add_lora`)
    and only they train. tool_parser: the tool-call format to parse (None: the one
    the tokenizer picked from the model's chat template or family)."""
    model, tokenizer = _load_model(spec, workdir)
    if tool_parser is not None and hasattr(tokenizer, "set_tool_parser"):
        from ac2_jax.config import ConfigError

        try:
            tokenizer.set_tool_parser(tool_parser)
        except ValueError as e:
            raise ConfigError(f"tool_parser={tool_parser!r}: {e}") from None
    if lora is not None and getattr(model.config, "lora", None) is None:
        from ac2_jax.models.io.peft_io import add_lora

        model = add_lora(model, lora, seed)
    return model, tokenizer


def export_model(model: Any, tokenizer: Any, path: str) -> dict[str, str]:
    """Writes `model` as an HF checkpoint (+ tokenizer) at `path`; a model with LoRA
    adapters is merged there and its adapters also go to `path`/adapter in PEFT's
    format. Returns {"hf_export": path, "adapter": ...}."""
    from ac2_jax.models.io.hf_io import save_hf_checkpoint

    out = {"hf_export": path}
    if getattr(model.config, "lora", None) is not None:
        from ac2_jax.models.io.peft_io import merge_lora, save_peft_adapter

        out["adapter"] = os.path.join(path, "adapter")
        save_peft_adapter(model, out["adapter"])
        model = merge_lora(model)
    save_hf_checkpoint(model, path)
    tokenizer.save_pretrained(path)
    return out


def _load_model(spec: Any, workdir: str) -> tuple[Any, Any]:
    if isinstance(spec, tuple) and len(spec) == 2:
        return spec
    spec = str(spec)
    if os.path.isdir(spec):
        from ac2_jax.models.io.hf_io import load_hf_checkpoint
        from ac2_jax.text.tokenizer import Tokenizer

        check_model_dir(spec)
        model, _ = load_hf_checkpoint(spec)
        return model, Tokenizer.from_pretrained(spec)
    if spec in MODELS:
        return MODELS.get(spec)(workdir)
    raise ValueError(
        f"--model {spec!r}: not a directory (an HF model: config.json + *.safetensors + "
        f"tokenizer.json) nor a preset ({', '.join(MODELS.names())})"
    )


def check_model_dir(path: str) -> None:
    """Raises a ConfigError naming the first file an HF model directory lacks for the
    recipes, and how to get it: config.json, the weights (*.safetensors), the fast
    tokenizer (tokenizer.json) and a chat template (tokenizer_config.json's
    "chat_template" or chat_template.jinja)."""
    from ac2_jax.config import ConfigError

    names = set(os.listdir(path))
    fix = None
    if "config.json" not in names:
        fix = (
            "no config.json (the model's architecture); save the model with transformers "
            "(model.save_pretrained(dir)) or copy it from the model's release"
        )
    elif not any(n.endswith(".safetensors") for n in names):
        fix = (
            "no *.safetensors weights (.bin files are not read); save them with "
            "transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    elif "tokenizer.json" not in names:
        fix = (
            "no tokenizer.json (only fast tokenizers are read); write it with transformers: "
            "AutoTokenizer.from_pretrained(<the model>).save_pretrained(dir)"
        )
    else:
        config = {}
        if "tokenizer_config.json" in names:
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        if not config.get("chat_template") and "chat_template.jinja" not in names:
            fix = (
                "the tokenizer has no chat template (tokenizer_config.json's "
                "'chat_template' or chat_template.jinja), which renders every prompt; copy "
                "chat_template.jinja (or tokenizer_config.json) from the model's instruct "
                "release into the directory"
            )
    if fix is not None:
        raise ConfigError(f"--model {path}: {fix}")


def harness_factory(sampling: dict, max_steps: int) -> Callable[..., Any]:
    """The orchestrator factory of every rollout: the env's `make_harness` (looked up on
    the env each rollout runs in, so a DomainMixer's domains may differ), else the tool
    loop (`DefaultOrchestrator`). Each orchestrator gets its own sampling dict."""
    from ac2_jax.orchestration import DefaultOrchestrator

    def make(env, task, client, model_name):
        custom = getattr(env, "make_harness", None)
        if custom is not None:
            return custom(task, client, model_name, sampling=dict(sampling), max_steps=max_steps)
        return DefaultOrchestrator(
            env, task, client, model_name, max_steps=max_steps, sampling=dict(sampling)
        )

    return make


def hands_off_in_memory(config: Any, sampler: Any) -> bool:
    """Whether a recipe's learner hands its weights to `sampler` in memory
    (`SamplerConfig.hand_off`): an embedded sampler that takes params
    (`JaxSampler.set_params`) with hand_off "memory". Every other sampler reloads
    them from the publish folder (the folder is written either way)."""
    return config.hand_off == "memory" and callable(getattr(sampler, "set_params", None))


@contextlib.asynccontextmanager
async def serve_policy(
    model, tokenizer, *, publish_dir: str, traces_dir: str, sampler, rollout, max_batch: int,
    seed: int = 0, trace_file: str = "served.jsonl",
) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    """The endpoint over the sampler `sampler.kind` names; yields (sampler, lifecycle).

    sampler: a `SamplerConfig` (kind "jax": an embedded JaxSampler of `model`;
    "sglang" / "fleet": clients of SGLang-protocol servers serving the same weights,
    each publish exported beside `publish_dir` unless `sampler.export_dir` says
    where; any registered kind, `ac2_jax.sampling.registry`); rollout: a
    `RolloutConfig` (its max_tokens is the default of requests that set none).
    Served traces go to traces_dir/<trace_file> (the eval recipe's own:
    eval_served.jsonl).
    """
    from ac2_jax.orchestration import LifecycleClient
    from ac2_jax.sampling.registry import SamplerSetup, build_sampler, close_sampler
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread

    eos = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
    context = sampler.max_context or model.config.max_position_embeddings
    setup = SamplerSetup(
        model=model, tokenizer=tokenizer, max_context=context, publish_dir=publish_dir,
        max_batch=max_batch, seed=seed, eos_token_ids=eos,
    )  # fmt: skip
    served = build_sampler(sampler, setup)
    try:
        os.makedirs(traces_dir, exist_ok=True)
        admin_key = secrets.token_hex(16)
        app = build_app(
            served, tokenizer, admin_key=admin_key, model_name=sampler.model_name,
            trace_store=os.path.join(traces_dir, trace_file),
            default_max_tokens=rollout.max_tokens,
        )  # fmt: skip
        base_url, stop = serve_in_thread(app)
    except BaseException:
        await close_sampler(served)
        raise
    lifecycle = LifecycleClient(base_url, admin_key)
    try:
        yield served, lifecycle
    finally:
        await lifecycle.aclose()
        stop()
        await close_sampler(served)


def saved_step(paths, recipe: str) -> int | None:
    """The latest checkpointed step of the `recipe` run in `paths.workdir`
    (workdir/<recipe>/checkpoints/<step>), 0 when it saved none yet, None when the
    workdir holds no run of it (no checkpoint folder and no saved config)."""
    ckpt = os.path.join(paths.workdir, recipe, "checkpoints")
    steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()] if os.path.isdir(ckpt) else []
    if steps:
        return max(steps)
    held = os.path.exists(os.path.join(paths.reports, "config.json")) or os.path.isdir(ckpt)
    return 0 if held else None


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def _json(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def _changes(old: Any, new: Any) -> list[str]:
    """`key old -> new` for each leaf that differs (JSON values, sorted keys)."""
    a, b = _flat(old), _flat(new)
    return [f"{k} {_json(a.get(k))} -> {_json(b.get(k))}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]  # fmt: skip


def _lora(v: Any) -> str:
    return "None (full fine-tuning)" if v is None else _json(v)


def _model_spec(spec: Any) -> str | None:
    """What names the model of a run: an HF directory's absolute path or a preset's name
    (None for a model object passed in)."""
    if isinstance(spec, (str, os.PathLike)):
        spec = str(spec)
        return os.path.abspath(spec) if os.path.isdir(spec) else spec
    return None


def _overwrite(paths, recipe: str) -> None:
    """Deletes what a `recipe` run wrote (its checkpoints, saved config and report,
    export, metrics, rollouts and published steps); nothing else in the folders."""
    import shutil

    doomed = [
        os.path.join(paths.workdir, recipe),
        os.path.join(paths.metrics, "metrics.jsonl"),
        os.path.join(paths.metrics, "tensorboard"),
        os.path.join(paths.traces, "rollouts.jsonl"),
        os.path.join(paths.traces, "served.jsonl"),
        *(os.path.join(paths.reports, n) for n in RUN_REPORTS),
    ]
    if os.path.isdir(paths.publish):
        doomed += [os.path.join(paths.publish, n) for n in os.listdir(paths.publish) if n.isdigit()]
    for path in doomed:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


# What a recipe writes in paths.reports (removed by an overwrite).
RUN_REPORTS = ("config.json", "model.json", "report.json", "eval_before.json", "final_hf")


def claim_workdir(recipe: str, cfg: Any, model_spec: Any) -> tuple[int, list[str]]:
    """Decides, before any work, what a run does with a workdir that holds a run of
    `recipe` (`cfg.paths.existing`): "refuse" raises a ConfigError naming --resume and
    --overwrite; "overwrite" deletes that run's files; "resume" compares the saved
    config first: another model or full <-> LoRA (what its checkpoint cannot take) is
    a ConfigError naming what differs, before anything is written. Returns (the step
    it resumes at, the other settings changed since: `key: old -> new`)."""
    from ac2_jax.config import ConfigError

    paths = cfg.paths.resolved()
    step = saved_step(paths, recipe)
    if step is None:
        return 0, []
    if cfg.paths.existing == "overwrite":
        _overwrite(paths, recipe)
        return 0, []
    where = f"workdir {paths.workdir} holds an {recipe} run (step {step})"
    if cfg.paths.existing != "resume":
        raise ConfigError(
            f"{where}; pass --resume to continue it or --overwrite to delete it and start "
            "afresh (from Python: paths.existing='resume' or 'overwrite'), or pick another "
            "--workdir"
        )
    saved: dict[str, Any] = {}
    config_json = os.path.join(paths.reports, "config.json")
    if os.path.exists(config_json):
        with open(config_json) as f:
            saved = json.load(f)
    new = json.loads(json.dumps(to_dict(cfg)))
    model_json = os.path.join(paths.reports, "model.json")
    old_model = None
    if os.path.exists(model_json):
        with open(model_json) as f:
            old_model = json.load(f).get("model")
    spec = _model_spec(model_spec)
    fatal = []
    if saved and saved.get("lora") != new.get("lora"):
        fatal.append(f"lora: {_lora(saved.get('lora'))} -> {_lora(new.get('lora'))}")
    if old_model is not None and spec is not None and old_model != spec:
        fatal.append(f"model: {old_model} -> {spec}")
    if fatal:
        raise ConfigError(
            f"--resume: {where}, but its checkpoint cannot take this run's "
            f"{'; '.join(fatal)}; resume with the run's settings, or pass --overwrite "
            "(or another --workdir) to start afresh"
        )
    changed = [c for c in _changes(saved, new) if not c.startswith("paths.existing ")]
    return step, changed if saved else []


def tool_parser_line(tokenizer: Any) -> str:
    """The console's word on how the model's tool calls are parsed."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return "tool calls: no parser"
    why = getattr(tokenizer, "tool_parser_source", "asked")
    why = "tool_parser" if why == "asked" else why
    return f"tool calls parsed as {parser.name} ({why}; set tool_parser to change)"


def recipe_mesh(
    mesh_cfg: Any, rows: dict[str, int] | None = None, grad_accum: int = 1
) -> tuple[Any, str | None]:
    """(the learner's mesh, the console's line on it) from a recipe's `mesh` section
    (`MeshConfig`). 1/1/1 is (None, None): the trainers' own one-device mesh, as
    before the section existed. A data x fsdp x tensor product above this machine's
    device count raises a one-line ConfigError naming the fields and the count.
    rows: {field: value} of the recipe's batch-row settings, each of which must be a
    multiple of data x fsdp x grad_accum (batch rows split over data and fsdp), else
    a one-line ConfigError naming it, before any work (not at the first step)."""
    from ac2_jax.config import ConfigError

    shape = {a: int(getattr(mesh_cfg, a)) for a in ("data", "fsdp", "tensor")}
    if shape == {"data": 1, "fsdp": 1, "tensor": 1}:
        return None, None
    import jax

    from ac2_jax.training.core.sharding import make_mesh

    devices = jax.devices()
    need = shape["data"] * shape["fsdp"] * shape["tensor"]
    fields = " x ".join(f"mesh.{a}={n}" for a, n in shape.items())
    if need > len(devices):
        raise ConfigError(
            f"{fields} needs {need} devices; this machine has {len(devices)} "
            f"({devices[0].platform}): lower the mesh fields so their product is at most "
            f"{len(devices)}"
        )
    ways = shape["data"] * shape["fsdp"] * grad_accum
    for field, value in (rows or {}).items():
        if value % ways:
            raise ConfigError(
                f"{field}={value} must be a multiple of mesh.data x mesh.fsdp x grad_accum "
                f"= {shape['data']} x {shape['fsdp']} x {grad_accum} = {ways} (batch rows "
                f"split over data and fsdp); set --config.{field}={-(-value // ways) * ways}"
            )
    line = f"learner over {need} of {len(devices)} {devices[0].platform} devices: {fields}"
    return make_mesh(**shape, devices=devices), line


def resuming_line(step: int, changed: list[str]) -> str:
    """The console's word on a resumed run: its step and the settings changed since."""
    return f"resuming at step {step}" + (f" (changed: {', '.join(changed)})" if changed else "")


def check_model(cfg: Any, recipe: str, model: Any, model_spec: Any, resume_step: int) -> None:
    """Compares the loaded model with the resumed run's (`report/model.json`: its spec and
    config, i.e. every shape) and raises a ConfigError naming what differs, before any
    file is written; then records this run's model there."""
    from ac2_jax.config import ConfigError

    paths = cfg.paths.resolved()
    path = os.path.join(paths.reports, "model.json")
    config = getattr(model, "config", None)
    now = json.loads(json.dumps(to_dict(config) if config is not None else None, default=str))
    if resume_step and os.path.exists(path):
        with open(path) as f:
            was = json.load(f).get("config")
        diff = _changes(was, now) if was is not None else []
        if diff:
            raise ConfigError(
                f"--resume: the {recipe} run in {paths.workdir} trained another model "
                f"({'; '.join(diff)}); resume with its model, or pass --overwrite to start afresh"
            )
    write_json(path, {"model": _model_spec(model_spec), "config": now})


def _error_of(trace) -> str:
    """The error an attempt ended with (`run_rollout` stores it in its artifacts), one line."""
    error = ((trace.metadata or {}).get("artifacts") or {}).get("error")
    return " ".join(str(error).split()) if error else ""


def error_lines(step: int, traces) -> list[str]:
    """The console's word on a step's attempts that ended in an error: how many, of
    which status, and the first one's error (wrapped to the line width); [] if none."""
    errored = [t for t in traces if t.status in ("agent_error", "infra_error")]
    if not errored:
        return []
    counts = {s: sum(t.status == s for t in errored) for s in ("agent_error", "infra_error")}
    ended = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    ended = ended.split(" ", 1)[1] if len(errored) in counts.values() else f"({ended})"
    first = next((e for e in map(_error_of, errored) if e), "no error message stored")
    # Room for the widest phase prefix ("[distill:opsd]   ").
    wrapped = textwrap.wrap(f"first error: {first}", LINE_WIDTH - 20, max_lines=4)
    return [
        f"step {step}: {len(errored)} of {len(traces)} attempts ended {ended}",
        *(f"  {x}" for x in wrapped),
    ]


def setting_failure(recipe: str, step: int, traces, cfg: Any, model: Any) -> str | None:
    """The reason to stop, when every attempt of a step failed the same way before the
    model answered once (a request every attempt makes is refused: a setting of the
    run, not the policy, is at fault); None otherwise."""
    if not traces or any(t.status not in ("agent_error", "infra_error") for t in traces):
        return None
    if any(t.num_agent_tokens for t in traces):
        return None  # the model answered: the policy's own failures train
    errors = {_error_of(t) for t in traces}
    if len(errors) != 1 or "" in errors:
        return None
    (error,) = errors
    if "context length" in error:
        context = model.config.max_position_embeddings
        fix = (
            f"the sampler's context is sampler.max_context={cfg.sampler.max_context} (None: "
            f"the model's {context}); raise it above the longest prompt plus "
            f"rollout.max_tokens={cfg.rollout.max_tokens}"
        )
    else:
        fix = "fix the setting it names (sampler, rollout, env or harness) and rerun"
    return (
        f"every attempt of {recipe} step {step} ({len(traces)} of {len(traces)}) failed "
        f"before the model answered, with the same error: {error}; {fix}"
    )


def run_report(
    paths, report: dict[str, Any], resume_at: int, *, keep_first: tuple[str, ...] = (),
    add: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """The report of the whole run across its invocations (resumes): `report` is this
    invocation's (its "steps" and "time_s" its own); the result's "steps" is the step the
    run reached (`resume_at` + this invocation's), "steps_this_run" this invocation's,
    "invocations" one {from_step, steps, time_s} per invocation, "time_s" their sum;
    `keep_first` keys keep the first invocation's value (e.g. first_loss), `add` keys are
    summed, a key this invocation left None keeps the earlier value. A resumed run
    whose earlier report is missing (killed before it wrote one) lists this invocation
    alone."""
    out = dict(report)
    n, t = int(report.get("steps", 0)), float(report.get("time_s", 0.0))
    earlier: dict[str, Any] = {}
    path = os.path.join(paths.reports, "report.json")
    if resume_at and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
    invocations = list(earlier.get("invocations") or [])
    invocations.append({"from_step": resume_at, "steps": n, "time_s": t})
    out.update(
        steps=resume_at + n, steps_this_run=n, invocations=invocations,
        time_s=sum(float(i["time_s"]) for i in invocations),
    )  # fmt: skip
    for k in keep_first:
        if earlier.get(k) is not None:
            out[k] = earlier[k]
    for k, v in earlier.items():  # what this invocation left None (e.g. no step to run)
        if out.get(k) is None and v is not None:
            out[k] = v
    for k in add:
        out[k] = (earlier.get(k) or 0) + (report.get(k) or 0)
    return out


# The curves of each recipe's learning_curve.png, those its metrics hold (in order).
CURVE_KEYS = {
    "rl": ("train/pass_rate", "train/reward_mean", "train/grad_norm", "train/kl_to_sampler"),
    "sft": ("train/loss", "train/grad_norm"),
    "distill": ("train/loss", "train/kept_tokens", "data/examples", "train/grad_norm"),
}
TRACE_PAGES = 2  # trace_<i>.html pages a run writes (its last step's first attempts)


def write_learning_curve(paths, recipe: str) -> str | None:
    """paths.reports/learning_curve.png of the run's metrics.jsonl (the whole run, every
    invocation): `CURVE_KEYS[recipe]` that it holds, else its first train/ metrics;
    None when it holds no step."""
    from ac2_jax.viz import load_metrics, plot_curves

    metrics = os.path.join(paths.metrics, "metrics.jsonl")
    if not os.path.exists(metrics):
        return None
    series = load_metrics(metrics)
    keys = [k for k in CURVE_KEYS.get(recipe, ()) if k in series]
    keys = keys or sorted(k for k in series if k.startswith("train/"))[:4]
    if not keys:
        return None
    out = os.path.join(paths.reports, "learning_curve.png")
    plot_curves(metrics, out, keys=keys, title=f"{recipe}: {os.path.basename(paths.workdir)}")
    return out


def write_trace_pages(paths, traces, tokenizer, name: str = "trace") -> list[str]:
    """paths.reports/<name>_<i>.html for the first `TRACE_PAGES` of `traces` (token-level
    pages: `viz.write_trace_html`, tool calls read by the model's parser)."""
    from ac2_jax.viz import write_trace_html

    parser = getattr(tokenizer, "parse_tool_calls", None)
    out = []
    for i, trace in enumerate(list(traces)[:TRACE_PAGES]):
        path = os.path.join(paths.reports, f"{name}_{i}.html")
        write_trace_html(path, trace, tokenizer=tokenizer, tool_parser=parser)
        out.append(path)
    return out


def remove_pages(folder: str, name: str) -> list[str]:
    """Removes folder/<name>_<i>.html (the pages `write_trace_pages(..., name=name)`
    writes, of any i) and returns their paths: a run that replaces its own pages
    leaves none of an earlier, larger run beside them. Nothing else is touched."""
    if not os.path.isdir(folder):
        return []
    pattern = re.compile(rf"{re.escape(name)}_\d+\.html")
    out = []
    for entry in sorted(os.listdir(folder)):
        if pattern.fullmatch(entry):
            os.remove(os.path.join(folder, entry))
            out.append(os.path.join(folder, entry))
    return out


def write_demo_pages(paths, chats) -> list[str]:
    """paths.reports/demo_<i>.html for the first `TRACE_PAGES` demonstrations (task id,
    messages, tools): each message as the trace pages show it (SFT's traces)."""
    from ac2_jax.viz import message_html, page
    from ac2_jax.viz.trace_html import esc

    out = []
    for i, (task, messages, _tools) in enumerate(list(chats)[:TRACE_PAGES]):
        path = os.path.join(paths.reports, f"demo_{i}.html")
        body = "".join(message_html(m) for m in messages)
        with open(path, "w", encoding="utf-8") as f:
            f.write(page(f"Demonstration {task}", f"<h1>Demonstration {esc(task)}</h1>{body}"))
        out.append(path)
    return out


def metrics_logger(directory: str, log) -> MetricsLogger:
    """The run's metrics sink (metrics.jsonl, TensorBoard, W&B as `log` says); the
    console gets `Progress` lines instead of the logger's own."""
    kwargs: dict[str, Any] = {}
    if log.wandb:
        kwargs["wandb"] = {"project": log.wandb_project} if log.wandb_project else True
    return MetricsLogger(directory, tensorboard=log.tensorboard, console=False, **kwargs)


def write_json(path: str, obj: Any) -> str:
    """Writes `obj` (a dataclass config or plain data) as indented JSON; returns path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_dict(obj), f, indent=2)
    return path


def _fmt_s(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}m"


class Progress:
    """One line per step of a phase: `[rl] 3/10  4.1 s/step  ETA 29s  loss=0.012 ...`,
    never wider than 120 characters (keys beyond the width are left out)."""

    def __init__(self, phase: str, total: int, *, enabled: bool = True, out=None):
        self.phase, self.total, self.enabled = phase, total, enabled
        self.out = out if out is not None else sys.stderr
        self.t0, self.first = time.perf_counter(), 0
        self.done = 0

    def start(self, done: int = 0) -> None:
        """Starts the clock (rates and ETAs count from here, `done` steps in)."""
        self.t0, self.first = time.perf_counter(), done

    def line(self, done: int, metrics: dict[str, Any] | None = None, note: str = "") -> str:
        self.done = done
        dt = time.perf_counter() - self.t0
        rate = dt / (done - self.first) if done > self.first else 0.0
        eta = rate * max(self.total - done, 0)
        text = f"[{self.phase}] {done}/{self.total}  {rate:.2f} s/step  ETA {_fmt_s(eta)}"
        for k, v in (metrics or {}).items():
            item = f"  {k}={v:.4g}" if isinstance(v, (int, float)) else f"  {k}={v}"
            if len(text) + len(item) + len(note) + 2 > LINE_WIDTH:
                break
            text += item
        if note:
            text += f"  {note}"
        return text[:LINE_WIDTH]

    def step(self, done: int, metrics: dict[str, Any] | None = None, note: str = "") -> None:
        if self.enabled:
            print(self.line(done, metrics, note), file=self.out, flush=True)

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"[{self.phase}] {text}"[:LINE_WIDTH], file=self.out, flush=True)
