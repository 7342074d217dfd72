"""Bad input: one clear error line naming the field (and the fix), exit code 2, before any long work.

Each case builds an argv from a valid tiny config plus one mistake and runs the CLI in-process.
"""

import json
import shutil

import pytest
from conftest import make_tiny_llama, write_config, write_gguf

from qharness.cli.main import main


def _cfg(t, **sections):
    return ["fit", str(write_config(t.tmp / "c.yaml", t.model, t.data, t.tmp / "run", **sections))]


def _model_copy(t, drop=()):
    d = t.tmp / "model_copy"
    shutil.copytree(t.model, d)
    for pattern in drop:
        for f in d.glob(pattern):
            f.unlink()
    return d


def _gguf(t, arch="llama", cut=False):
    """The tiny Llama as a GGUF (``arch``: the architecture it claims; ``cut``: its second half cut off)."""
    from qharness.sources.models import load_model_and_tokenizer

    path = write_gguf(t.tmp / f"{arch}.gguf", *load_model_and_tokenizer(str(t.model)), arch=arch)
    if cut:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _config_layers(t, n):
    d = _model_copy(t)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + n}))
    return d


def _fake_ckpt(t, recipe):
    import torch

    path = t.tmp / "other.ckpt"
    torch.save(
        {"state_dict": {}, "hyper_parameters": {"checkpoint": str(t.model), "recipe": recipe, "mode": "qat"}}, path
    )
    return path


def _t5_dir(t):
    from transformers import T5Config, T5ForConditionalGeneration

    d = t.tmp / "t5"
    T5ForConditionalGeneration(
        T5Config(vocab_size=400, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    ).save_pretrained(d)
    shutil.copy(t.model / "tokenizer.json", d)
    shutil.copy(t.model / "tokenizer_config.json", d)
    return d


def _mamba_dir(t):
    from transformers import MambaConfig

    d = t.tmp / "mamba"
    MambaConfig(vocab_size=400, hidden_size=16, num_hidden_layers=1).save_pretrained(d)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(t.model / f, d)  # the check reads config.json before any weights
    return d


def _wrong_shape_model(t):
    d = _model_copy(t)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] // 2}))
    return d


def _truncated_model(t):
    d = _model_copy(t)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return d


def _small_vocab_model(t):
    return make_tiny_llama(t.tmp / "small_vocab", t.data.read_text()[:50_000], vocab_size=384, vocab_size_override=200)


CASES = {
    "unknown subcommand": (lambda t: ["fitt"], "unknown subcommand 'fitt'"),
    "unknown recipe": (lambda t: [*_cfg(t), "--model.recipe", "xnnpack_int3"], "unknown recipe 'xnnpack_int3'"),
    "unknown recipe field": (
        lambda t: [*_cfg(t), "--model.recipe", str(_write(t, "r.yaml", "base: xnnpack_fp32\nbackends: x\n"))],
        "unknown field(s) backends",
    ),
    "recipe without mode": (lambda t: [*_cfg(t), "--model.recipe", "xnnpack_fp32"], "does not support mode 'qat'"),
    "unknown mode": (lambda t: [*_cfg(t), "--model.mode", "int8"], "does not support mode 'int8'"),
    "unknown config field": (lambda t: [*_cfg(t), "--model.recipee", "x"], "model.recipee"),
    "wrong type": (lambda t: [*_cfg(t), "--data.seq_len", "many"], "data.seq_len"),
    "missing config file": (lambda t: ["fit", str(t.tmp / "nope.yaml")], "nope.yaml"),
    "missing data file": (lambda t: _cfg(t, data={"source": str(t.tmp / "none.txt")}), "data.source"),
    "empty data file": (lambda t: _cfg(t, data={"source": str(_write(t, "empty.txt", ""))}), "is empty"),
    "data dir without text": (lambda t: _cfg(t, data={"source": str(_mkdir(t, "nodata"))}), "holds no"),
    "unsupported data type": (
        lambda t: _cfg(t, data={"source": str(_write(t, "d.xml", "<a/>"))}),
        "unsupported file type '.xml'",
    ),
    "dataset too small": (
        lambda t: _cfg(t, data={"source": str(_write(t, "tiny.txt", "to be or not " * 20))}),
        "fewer than one batch",
    ),
    "missing text column": (
        lambda t: _cfg(t, data={"source": str(_write(t, "d.jsonl", json.dumps({"body": "x " * 2000})))}),
        "data.text_field 'text'",
    ),
    "seq_len above context": (
        lambda t: _cfg(t, data={"seq_len": 300}, deploy={"max_seq_len": 301}),
        "exceeds the model's context",
    ),
    "seq_len too small": (lambda t: _cfg(t, data={"seq_len": 1}), "data.seq_len must be at least 2"),
    "zero batch size": (lambda t: _cfg(t, data={"batch_size": 0}), "data.batch_size must be positive (got 0)"),
    "val_fraction out of range": (lambda t: _cfg(t, data={"val_fraction": 1.5}), "data.val_fraction"),
    "model dir missing": (lambda t: _cfg(t, model={"checkpoint": str(t.tmp / "no_model")}), "does not exist"),
    "model path is a file": (lambda t: _cfg(t, model={"checkpoint": str(_write(t, "m.bin", "x"))}), "is a file"),
    "model .gguf that is not GGUF": (
        lambda t: _cfg(t, model={"checkpoint": str(_write(t, "m.gguf", "not a model " * 10))}),
        "is not a GGUF file",
    ),
    "model .gguf cut short": (lambda t: _cfg(t, model={"checkpoint": str(_gguf(t, cut=True))}), "is truncated"),
    "model .gguf of an architecture transformers does not read": (
        lambda t: _cfg(t, model={"checkpoint": str(_gguf(t, arch="foo"))}),
        "architecture foo is not supported",
    ),
    "model dir without config": (
        lambda t: _cfg(t, model={"checkpoint": str(_model_copy(t, ["config.json"]))}),
        "no config.json",
    ),
    "model dir without weights": (
        lambda t: _cfg(t, model={"checkpoint": str(_model_copy(t, ["*.safetensors"]))}),
        "has no weights",
    ),
    "config.json with more layers than the weights": (
        lambda t: _cfg(t, model={"checkpoint": str(_config_layers(t, 1))}),
        "the checkpoint lacks",
    ),
    "config.json with fewer layers than the weights": (
        lambda t: _cfg(t, model={"checkpoint": str(_config_layers(t, -1))}),
        "the checkpoint has extra",
    ),
    "unsupported architecture": (lambda t: _cfg(t, model={"checkpoint": str(_t5_dir(t))}), "unsupported model"),
    "recurrent architecture": (
        lambda t: _cfg(t, model={"checkpoint": str(_mamba_dir(t))}),
        "keeps a recurrent (SSM) state",
    ),
    "torchtune builder with positional args": (
        lambda t: _cfg(t, model={"checkpoint": "torchtune:llama3_2.llama3_2(2048)"}),
        "give builder arguments by keyword",
    ),
    "tokenizer/model vocab mismatch": (
        lambda t: _cfg(t, model={"checkpoint": str(_small_vocab_model(t))}),
        "vocab_size",
    ),
    "zero max_steps": (lambda t: _cfg(t, trainer={"max_steps": 0}), "trainer.max_steps must be positive"),
    "negative max_steps": (lambda t: _cfg(t, trainer={"max_steps": -5}), "trainer.max_steps must be positive"),
    "zero learning rate": (lambda t: _cfg(t, model={"lr": 0.0}), "model.lr must be positive"),
    "negative warmup": (lambda t: _cfg(t, model={"warmup_steps": -1}), "model.warmup_steps"),
    "half-precision QAT": (
        lambda t: _cfg(t, trainer={"precision": "bf16-true"}),
        "trainer.precision=bf16-true does not work with fake quantization",
    ),
    "mixed precision with torchao 8da4w": (
        lambda t: _cfg(t, model={"recipe": "xnnpack_8da4w"}, trainer={"precision": "bf16-mixed"}),
        "does not work with recipe 'xnnpack_8da4w'",
    ),
    "negative fake-quant delay": (
        lambda t: _cfg(t, model={"fake_quant_after_n_steps": -1}),
        "model.fake_quant_after_n_steps",
    ),
    "negative checkpoint interval": (
        lambda t: _cfg(t, checkpoint={"every_n_train_steps": -1}),
        "checkpoint.every_n_train_steps",
    ),
    "output dir is a file": (
        lambda t: _cfg(t, trainer={"default_root_dir": str(_write(t, "runfile", "x"))}),
        "is a file",
    ),
    "output dir under a file": (
        lambda t: _cfg(t, trainer={"default_root_dir": str(_write(t, "f2", "x") / "run")}),
        "is a file",
    ),
    "max_seq_len not above seq_len": (
        lambda t: _cfg(t, deploy={"max_seq_len": 32}),
        "deploy.max_seq_len=32 must exceed",
    ),
    "max_seq_len above context": (
        lambda t: _cfg(t, deploy={"max_seq_len": 512}),
        "deploy.max_seq_len=512 exceeds the model's context",
    ),
    "zero calibration blocks": (
        lambda t: _cfg(t, calibration={"blocks": 0}),
        "calibration.blocks must be a number >= 1 (got 0)",
    ),
    "missing calibration file": (lambda t: _cfg(t, calibration={"source": str(t.tmp / "c.txt")}), "calibration.source"),
    "parity prompt too long": (lambda t: _cfg(t, parity={"prompt_len": 64}), "parity.prompt_len=64"),
    "missing checkpoint to resume": (
        lambda t: [*_cfg(t), "--ckpt_path", str(t.tmp / "x.ckpt")],
        "x.ckpt does not exist",
    ),
    "resume with no last.ckpt": (lambda t: [*_cfg(t), "--ckpt_path", "last"], "last.ckpt does not exist"),
    "checkpoint of another recipe": (
        lambda t: [*_cfg(t), "--ckpt_path", str(_fake_ckpt(t, "xnnpack_8da4w"))],
        "model.recipe='xnnpack_8da4w'",
    ),
    "corrupt checkpoint": (
        lambda t: [*_cfg(t), "--ckpt_path", str(_write(t, "bad.ckpt", "not a checkpoint"))],
        "cannot be read",
    ),
    "export without checkpoint": (lambda t: ["export", *_cfg(t)[1:]], "last.ckpt does not exist"),
    "calibrate in qat mode": (lambda t: ["calibrate", *_cfg(t)[1:]], "calibrate needs model.mode: ptq"),
    "generate: corrupt .pte": (
        lambda t: [
            "generate",
            "--pte",
            str(_write(t, "bad.pte", "not a program")),
            "--prompt",
            "x",
            "--tokenizer",
            str(t.model),
        ],
        "is not a loadable ExecuTorch program",
    ),
    "generate: missing .pte": (
        lambda t: ["generate", "--pte", str(t.tmp / "none.pte"), "--prompt", "x", "--tokenizer", str(t.model)],
        "none.pte does not exist",
    ),
    "unknown lm-eval task": (
        lambda t: _cfg(t, eval={"enabled": True, "tasks": ["hellawag"]}),
        "unknown lm-eval task 'hellawag' (did you mean hellaswag",
    ),
    "unknown lm-eval task (evaluate)": (
        lambda t: ["evaluate", *_cfg(t)[1:], "--tasks", "qharness_ppl,arc_eazy"],
        "unknown lm-eval task 'arc_eazy'",
    ),
    "hub task offline": (
        lambda t: _cfg(t, eval={"enabled": True, "tasks": ["hellaswag"]}),
        "needs dataset Rowan/hellaswag from the Hugging Face hub",
    ),
    "unknown eval model": (
        lambda t: _cfg(t, eval={"enabled": True, "models": ["fp", "gguf"]}),
        "eval.models: unknown ['gguf']",
    ),
    "eval window above seq_len": (lambda t: _cfg(t, eval={"enabled": True, "max_length": 48}), "eval.max_length=48"),
    "zero eval limit": (
        lambda t: _cfg(t, eval={"enabled": True, "limit": 0}),
        "eval.limit must be a number >= 1 (got 0)",
    ),
    "evaluate: missing .pte": (lambda t: ["evaluate", *_cfg(t)[1:], "--pte", str(t.tmp / "none.pte")], "no .pte at"),
    "evaluate: corrupt .pte": (
        lambda t: ["evaluate", *_cfg(t)[1:], "--pte", str(_write(t, "bad.pte", "not a program"))],
        "is not a loadable ExecuTorch program",
    ),
    "bench: corrupt .pte": (
        lambda t: ["bench", "--pte", str(_write(t, "bad.pte", "not a program"))],
        "is not a loadable ExecuTorch program",
    ),
    ".pte name outside the run dir": (
        lambda t: _cfg(t, deploy={"filename": "../../x.pte"}),
        "deploy.filename '../../x.pte' must be a plain file name",
    ),
    "empty .pte name": (lambda t: _cfg(t, deploy={"filename": ""}), "deploy.filename '' must be a plain file name"),
    "agreement above 1": (
        lambda t: _cfg(t, parity={"min_argmax_agreement": 5.0}),
        "parity.min_argmax_agreement must lie in [0, 1]",
    ),
    "NaN ppl tolerance": (
        lambda t: _cfg(t, parity={"max_ppl_rel_diff": float("nan")}),
        "parity.max_ppl_rel_diff must be a number >= 0",
    ),
    "zero bench reps": (
        lambda t: _cfg(t, bench={"enabled": True, "reps": 0}),
        "bench.reps must be a number >= 1 (got 0)",
    ),
    "zero distillation temperature": (
        lambda t: [*_cfg(t, model={"distill": {"kl_weight": 1.0}}), "--model.distill.temperature", "0"],
        "model.distill.temperature must be a positive number (got 0). fix: set model.distill.temperature > 0",
    ),
    "negative KL weight": (
        lambda t: [*_cfg(t), "--model.distill.kl_weight", "-1"],
        "model.distill.kl_weight must be a positive number (got -1)",
    ),
    "distillation teacher that is no model": (
        lambda t: _cfg(t, model={"distill": {"teacher": str(t.tmp)}}),
        "is neither a save_pretrained directory (config.json) nor a finished qharness run (checkpoints/last.ckpt)",
    ),
    "distillation in PTQ": (
        lambda t: _cfg(t, model={"mode": "ptq", "recipe": "xnnpack_int8_static", "distill": {"temperature": 2.0}}),
        "model.distill needs model.mode: qat",
    ),
    "zero LoRA rank": (
        lambda t: [*_cfg(t, model={"lora": {"alpha": 16}}), "--model.lora.rank", "0"],
        "model.lora.rank must be an integer >= 1 (got 0). fix: e.g. model.lora.rank: 8",
    ),
    "negative LoRA alpha": (
        lambda t: [*_cfg(t), "--model.lora.alpha", "-2"],
        "model.lora.alpha must be a positive number (got -2",
    ),
    "LoRA targets as one string": (
        lambda t: _cfg(t, model={"lora": {"targets": "q_proj"}}),
        "model.lora.targets must be a non-empty list of layer-name patterns (got 'q_proj')",
    ),
    "LoRA dropout": (
        lambda t: _cfg(t, model={"lora": {"dropout": 0.1}}),
        "unknown config field(s) model.lora.dropout. fix: model.lora fields are rank, alpha, targets",
    ),
    "LoRA in PTQ": (
        lambda t: _cfg(t, model={"mode": "ptq", "recipe": "xnnpack_int8_static", "lora": {}}),
        "model.lora needs model.mode: qat",
    ),
    "LoRA with learned scales": (
        lambda t: _cfg(t, model={"recipe": "xnnpack_int4w_lsq", "lora": {"rank": 4}}),
        "model.lora with recipe 'xnnpack_int4w_lsq' (learned weight scales) is not supported yet",
    ),
    "LoRA target matching no layer": (
        lambda t: _cfg(t, model={"lora": {"targets": ["q_proj", "qkv"]}}, trainer={"max_steps": 1}),
        "model.lora.targets ['qkv'] match no linear layer of LlamaForCausalLM",
    ),
    "negative weight decay": (lambda t: _cfg(t, model={"weight_decay": -0.1}), "model.weight_decay must be a finite"),
    "zero gradient accumulation": (
        lambda t: _cfg(t, trainer={"accumulate_grad_batches": 0}),
        "trainer.accumulate_grad_batches must be >= 1 (got 0)",
    ),
    "zero val_check_interval": (lambda t: _cfg(t, trainer={"val_check_interval": 0}), "trainer.val_check_interval"),
    "val_check_interval beyond the batches": (
        lambda t: _cfg(t, trainer={"val_check_interval": 100000}),
        "trainer.val_check_interval=100000 exceeds the",
    ),
    "option without its value": (
        lambda t: [*_cfg(t), "--model.lr"],
        "error: qharness fit: argument --model.lr: expected one argument. fix: give --model.lr a value",
    ),
    "unknown strategy": (
        lambda t: [*_cfg(t), "--trainer.strategy", "ddp_foo"],
        "trainer.strategy 'ddp_foo' is not a Lightning strategy. fix: use auto, ddp, fsdp_layers",
    ),
    "a trainer value only Lightning knows": (
        lambda t: [*_cfg(t), "--trainer.profiler", "nosuch"],
        "error: Lightning refused the trainer config: When passing string value for the `profiler` parameter",
    ),
    "negative overfit_batches": (
        lambda t: [*_cfg(t), "--trainer.overfit_batches", "-1"],
        "trainer.overfit_batches must be a fraction in [0, 1]",
    ),
    "generate: a required option missing": (
        lambda t: ["generate", "--pte", str(t.tmp / "none.pte")],
        'error: generate: --prompt is required. fix: pass --prompt "TEXT", or --chat for a conversation',
    ),
    "generate: a run directory without a program": (
        lambda t: ["generate", str(t.tmp), "--chat"],
        "holds no .pte that passed parity. fix: pass the .pte file itself",
    ),
    "bench: an unknown option": (
        lambda t: ["bench", "--pte", str(t.tmp / "none.pte"), "--repz", "3"],
        "error: qharness bench: unrecognized arguments: --repz 3. fix: `qharness bench --help` lists its options",
    ),
    "report --out a place that takes no directory": (
        lambda t: ["report", str(t.tmp), "--out", "/proc/qharness_report"],
        "error: --out /proc/qharness_report cannot be made a directory",
    ),
    "a directory as the config": (lambda t: ["fit", str(t.tmp)], "is a directory. fix: pass the path of a run config"),
    "generate: a missing .pte is named before its tokenizer": (
        lambda t: ["generate", "--pte", str(t.tmp / "none.pte"), "--prompt", "x"],
        "none.pte does not exist. fix: pass the program a run wrote",
    ),
    "generate: a text file as .pte is named before its tokenizer": (
        lambda t: ["generate", "--pte", str(_write(t, "notes.txt", "hello")), "--prompt", "x"],
        "notes.txt is not a loadable ExecuTorch program",
    ),
    "eval.source without usable lines": (
        lambda t: _cfg(
            t,
            eval={"enabled": True, "tasks": ["qharness_gen"], "source": str(_write(t, "ev.txt", "tiny\n" * 500))},
        ),
        "the evaluation text (eval.source ",
    ),
    "validation text without usable lines, before training": (
        lambda t: _cfg(
            t,
            data={"source": str(_write(t, "short.txt", "ab cd ef\n" * 30000))},
            eval={"enabled": True, "tasks": ["qharness_gen"]},
        ),
        "the evaluation text (the run's validation text, from data.source, ",
    ),
    "calibration.source: a bare relative path that does not exist": (
        lambda t: [*_cfg(t, calibration={"source": "calib_qharness_missing.txt"})],
        "calibration.source calib_qharness_missing.txt does not exist (relative to ",
    ),
    "unwritable run dir": (
        lambda t: _cfg(t, trainer={"default_root_dir": "/proc/qharness_run"}),
        "trainer.default_root_dir /proc/qharness_run: /proc is not writable",
    ),
    "empty run dir": (lambda t: [*_cfg(t), "--trainer.default_root_dir", ""], "trainer.default_root_dir is empty"),
    "text for an int": (lambda t: [*_cfg(t), "--trainer.max_steps", "abc"], "trainer.max_steps must be an integer"),
    "list for a float": (lambda t: [*_cfg(t), "--model.lr", "[1]"], "model.lr must be a number (got [1])"),
    "weights of the wrong shape": (
        lambda t: _cfg(t, model={"checkpoint": str(_wrong_shape_model(t))}),
        "the weights do not load",
    ),
    "truncated safetensors": (
        lambda t: _cfg(t, model={"checkpoint": str(_truncated_model(t))}),
        "model.safetensors is truncated or not a safetensors file",
    ),
    "generate: NaN temperature": (
        lambda t: ["generate", "--pte", str(t.tmp / "none.pte"), "--prompt", "x", "--temperature", "nan"],
        "--temperature must be a finite number >= 0 (got nan)",
    ),
    "recipe YAML syntax error": (
        lambda t: _cfg(
            t, model={"recipe": str(_write(t, "r.yaml", "description: d\nbackend: x\nquantizer: {name: xnnpack\n"))}
        ),
        "is not valid YAML (line",
    ),
    "recipe setting of the wrong type": (
        lambda t: _cfg(
            t,
            model={
                "recipe": str(_write(t, "r2.yaml", "base: xnnpack_int8_dynamic\nquantizer: {weight_bits: three}\n"))
            },
        ),
        "weight_bits='three' must be int",
    ),
}


def _write(t, name, text):
    path = t.tmp / name
    path.write_text(text)
    return path


def _mkdir(t, name):
    (t.tmp / name).mkdir(exist_ok=True)
    return t.tmp / name


def _rebind_log_streams():
    """Loggers configured by an earlier in-process run hold the stderr that pytest captured then."""
    import logging
    import sys

    for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
        for h in getattr(logger, "handlers", []):
            if type(h) is logging.StreamHandler:
                h.stream = sys.stderr  # setStream would flush the closed old stream


class Ctx:
    def __init__(self, tmp, model, data):
        self.tmp, self.model, self.data = tmp, model, data


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, tiny_llama, corpus, capsys):
    make_argv, expected = CASES[name]
    argv = make_argv(Ctx(tmp_path, tiny_llama, corpus))
    _rebind_log_streams()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err[-2000:]
    assert expected in err, err[-2000:]
    assert "Traceback" not in err and "usage:" not in err, err[-2000:]
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err[-2000:]
    assert not (tmp_path / "run" / "model.pte").exists()
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()  # refused before any training


def test_an_interval_beyond_the_epoch_is_refused_before_any_model_loads(tmp_path, tiny_llama, corpus, capsys):
    """The data alone (its tokenizer, its cached tokens) says how many batches an epoch has: the refusal comes before
    the architecture check loads a copy of the model, and before the run loads it."""
    argv = _cfg(Ctx(tmp_path, tiny_llama, corpus), trainer={"val_check_interval": 100000})
    _rebind_log_streams()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "trainer.val_check_interval=100000 exceeds the" in err, err[-2000:]
    assert "deploys with" not in err and "Loading weights" not in err, err[-2000:]  # no model was loaded
