"""Shared fixtures: offline environment, a private cache, a text corpus the package generates (no files
beside the project), a tiny Llama + BPE tokenizer trained on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    WANDB_MODE="offline",
    HF_HUB_DISABLE_TELEMETRY="1",
    TOKENIZERS_PARALLELISM="false",
)

ROOT = Path(__file__).resolve().parent.parent
CORPUS_CHARS = 1_100_000  # about Tiny Shakespeare's size: tests slice up to 340k characters from the front


def pytest_collection_modifyitems(config, items):
    """The longest files first (``tests/durations.json``: seconds per file in a default-suite run, written by
    ``scripts/test_durations.py``), each file's tests in their own order: the two xdist workers take whole files in
    this order (``--dist loadfile --no-loadscope-reorder``), so the last files handed out are short and the workers
    end together (in xdist's own order, by test count, a 40-second file of two tests was often handed out last). A
    file not listed runs after the listed ones."""
    import json

    seconds = json.loads((ROOT / "tests" / "durations.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: in-file order kept


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """One qharness cache for the whole session, shared by its xdist workers as by a user's concurrent runs (its
    writers lock and write atomically): a deploy probe or token cache one worker built is not built again by the
    other. A test that needs an empty cache, or counts what is in it, sets its own QHARNESS_CACHE."""
    shared = "PYTEST_XDIST_WORKER" in os.environ
    root = tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.mktemp("session")
    (root / "qharness_cache").mkdir(exist_ok=True)
    os.environ["QHARNESS_CACHE"] = str(root / "qharness_cache")
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A plain-text file of ``embedded_corpus()`` (Python's own documentation and standard-library source, shipped
    with CPython): the same text in CI, on a fresh clone and on a wheel install, with nothing to download."""
    from qharness.sources.text import embedded_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(embedded_corpus(CORPUS_CHARS))[:CORPUS_CHARS], encoding="utf-8")
    return path


def tiny_spec():
    """The tests' tiny Llama shape: hidden 64, 2 layers, 4 heads (2 KV), context 256."""
    from qharness.sources.embedded import EmbeddedSpec

    return EmbeddedSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def make_tiny_llama(out: Path, text: str, vocab_size: int = 384, vocab_size_override: int | None = None) -> Path:
    """A random-init tiny LlamaForCausalLM + BPE tokenizer saved with save_pretrained
    (``vocab_size_override``: a model vocabulary that does not fit the tokenizer, for error tests)."""
    import torch

    from qharness.sources.embedded import new_llama
    from qharness.sources.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer([text], vocab_size)
    spec = tiny_spec()
    torch.manual_seed(0)
    model = new_llama(spec, vocab_size_override or len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_tiny_hf(
    out: Path, model_type: str, text: str, layers: int = 1, tie: bool | None = None, vocab_size: int = 384, **overrides
) -> Path:
    """A random-init tiny decoder of any HF ``model_type`` (GQA: 4 query heads, 2 KV heads) + BPE tokenizer,
    saved with save_pretrained, the same form as a real checkpoint. ``tie``: None keeps the family's default."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qharness.sources.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer([text], vocab_size)
    dims = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    dims.update({k: overrides.pop(k) for k in list(overrides) if k in dims})  # overrides of the dimensions too
    dims = {k: v for k, v in dims.items() if v is not None}  # None: a dimension the family derives (Falcon's head_dim)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), max_position_embeddings=256, **dims, **ids, **overrides
    )
    if tie is not None:
        config.tie_word_embeddings = tie
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's ``convert_hf_to_gguf.py`` row order of a Llama ``q_proj``/``k_proj`` weight (``n_head``: its heads;
    transformers undoes it when it reads a GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tokenizer, qtype: str = "F32", arch: str = "llama", chat_template: str | None = None):
    """``model`` (an HF Llama) and ``tokenizer`` (``train_bpe_tokenizer``'s byte-level BPE) written as llama.cpp's
    ``convert_hf_to_gguf.py`` writes them: GGUF tensor names, q/k rows permuted, the 2-D weights as ``qtype``
    (``F32``, ``Q8_0``, ``Q4_0``, ...; norms stay F32), ``general.file_type`` set to match, the tokenizer as
    ``gpt2`` metadata. ``arch``: the ``general.architecture`` written (another one for refusal tests)."""
    import json

    import gguf

    c = model.config
    kind = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType[("ALL_" if qtype == "F32" else "MOSTLY_") + qtype])
    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in tokenizer.all_special_tokens else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    if chat_template:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied head is the embedding table: llama.cpp writes no output.weight
        data = t.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, c.num_key_value_heads)
        gguf_name = names.get_name(name.removesuffix(".weight")) + ".weight"
        if data.ndim == 2 and qtype != "F32":
            w.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def runner_safe_head(model, tokenizer, seed: int = 0, std: float = 1.0) -> None:
    """Give ``model`` (in place) a random untied output head (normal, ``std``) whose rows for EOS and for tokens that
    are not valid UTF-8 on their own are zero, so greedy decoding varies and never picks them: ExecuTorch's
    ``TextLLMRunner`` Python ``token_callback`` raises UnicodeDecodeError on such pieces (tied random embeddings just
    repeat the last token)."""
    import torch

    head = model.get_output_embeddings()
    torch.manual_seed(seed)
    head.weight = torch.nn.Parameter(torch.randn_like(head.weight) * std)
    model.config.get_text_config().tie_word_embeddings = False
    model.config.tie_word_embeddings = False
    never = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])] + [tokenizer.eos_token_id]
    with torch.no_grad():
        head.weight[never] = 0


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, corpus) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), corpus.read_text()[:200_000])


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run the real ``qharness`` CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "qharness", *map(str, args)],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def write_config(path, model_dir, data_source, run_dir, **sections):
    """A tiny fit/calibrate config (6 QAT steps, a 64-position .pte, no benchmark (its fresh processes cost seconds
    per run; ``bench={"enabled": True}`` runs a short one), no lm-eval, no wandb: its start costs seconds);
    ``sections`` update its groups, e.g. ``data={"seq_len": 16}``."""
    cfg = {
        "model": {
            "checkpoint": str(model_dir),
            "recipe": "xnnpack_int8_dynamic",
            "mode": "qat",
            "lr": 1e-3,
            "warmup_steps": 2,
        },
        "data": {"source": str(data_source), "seq_len": 32, "batch_size": 4},
        "trainer": {"default_root_dir": str(run_dir), "max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2},
        "checkpoint": {"every_n_train_steps": 3},
        "deploy": {"max_seq_len": 64},
        "parity": {"eval_blocks": 8, "prompts": 2, "prompt_len": 16, "decode_steps": 4},
        "calibration": {"blocks": 4},
        "bench": {"enabled": False, "prompt_len": 16, "decode_tokens": 8, "reps": 2},
        "eval": {"enabled": False, "limit": 4},
        "wandb": {"enabled": False},
    }
    for key, value in sections.items():
        cfg[key].update(value)
    path.write_text("# qharness fit " + path.name + "\n" + yaml.safe_dump(cfg))
    return path


def once_per_session(tmp_path_factory, name: str, build):
    """``build(folder)`` run once in a whole test session, not once per xdist worker (pytest-xdist's recipe for a
    session fixture: the first worker to ask builds it under a file lock, the others wait and read the same folder).
    Only for results the tests read; a test that writes into one works on a copy."""
    import json

    from filelock import FileLock

    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: an ordinary session fixture
        folder = tmp_path_factory.mktemp(name)
        return build(folder)
    root = tmp_path_factory.getbasetemp().parent  # this session's folder, shared by its workers
    folder, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def fitted(tmp_path_factory, tiny_llama, corpus):
    """``qharness fit`` of the tiny Llama, logged to wandb offline: (run dir, config, CompletedProcess); run once per
    session (``once_per_session``; the tests read it, and copy it to write into it)."""

    def build(tmp):
        cfg = write_config(
            tmp / "run.yaml",
            tiny_llama,
            corpus,
            tmp / "run",
            trainer={"log_every_n_steps": 2},
            bench={"enabled": True},
            wandb={"enabled": True},
            eval={"enabled": True, "tasks": ["qharness_ppl", "qharness_mc", "qharness_gen"]},  # gen: through the .pte
        )
        r = run_cli("fit", cfg)
        return [str(tmp / "run"), str(cfg), r.returncode, r.stdout, r.stderr]

    run, cfg, code, out, err = once_per_session(tmp_path_factory, "fitted", build)
    return Path(run), Path(cfg), subprocess.CompletedProcess(["qharness", "fit", cfg], code, out, err)


def copy_of_fitted(fitted, tmp_path: Path, **sections) -> tuple[Path, Path]:
    """A copy of the ``fitted`` run to write into (other tests read the original) and its own run config pointed at
    the copy (the fit's model and data, which another xdist worker may have made), ``sections`` updating its groups:
    (run dir, config)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fitted[0], run)
    cfg = yaml.safe_load(Path(fitted[1]).read_text())
    cfg["trainer"]["default_root_dir"] = str(run)
    for key, value in sections.items():
        cfg[key].update(value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return run, path


def tiny_run_config(tmp_path, model_dir, corpus, model: dict, trainer: dict | None = None):
    """A tiny run config for a small model (16-token blocks, a 32-position ``.pte``, a short parity check)."""
    return write_config(
        tmp_path / "run.yaml",
        model_dir,
        corpus,
        tmp_path / "run",
        model=model,
        trainer=trainer or {},
        data={"seq_len": 16},
        deploy={"max_seq_len": 32},
        parity={"eval_blocks": 4, "prompts": 1, "prompt_len": 8, "decode_steps": 3},
        calibration={"blocks": 2},
    )


def fake_measurement(tok_s: float) -> dict:
    """What one fresh benchmark process reports for a program decoding ``tok_s`` tokens/s (prefill twice that)."""
    return {
        "decode_tok_s": {"median": tok_s},
        "prefill_tok_s": {"median": 2 * tok_s},
        "decode_cpu_share": {"median": 1.0},
        "decode_tok_per_cpu_s": {"median": tok_s},
        "size_bytes": 1,
        "weight_bytes": 1,
    }
