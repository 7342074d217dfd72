"""The "On-device runner" snippet of docs/tutorials/deploying.md, run verbatim in a fresh interpreter on .pte files
qharness writes, and the kernel libraries each kind of program needs (that page's table)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_tiny_hf

PAGE = "docs/tutorials/deploying.md"
HEADING = "## On-device runner"


def readme_runner_snippet() -> str:
    """The first ```python block after the "On-device runner" heading of docs/tutorials/deploying.md."""
    text = (ROOT / PAGE).read_text()
    assert HEADING in text, f"{PAGE} lost its {HEADING!r} section"
    block = re.search(r"```python\n(.*?)```", text.split(HEADING, 1)[1], re.S)
    assert block, f"no ```python block under {HEADING!r} in {PAGE}"
    return block.group(1)


def run_code_on(run, tmp_path, code: str) -> subprocess.CompletedProcess:
    """Lay ``run``'s model.pte + tokenizer/ out where the snippet's relative paths point and run ``code`` in a new
    interpreter there, with nothing of qharness on its path."""
    paths = re.findall(r'TextLLMRunner\("([^"]+)", "([^"]+)"\)', code)
    assert len(paths) == 1, "the snippet should create one TextLLMRunner(pte, tokenizer_dir) with literal paths"
    pte, tokenizer = paths[0]
    (tmp_path / pte).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "model.pte", tmp_path / pte)
    shutil.copytree(run / "tokenizer", tmp_path / tokenizer)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, env=env, timeout=600)


def run_snippet_on(run, tmp_path) -> tuple[str, dict]:
    """The snippet, verbatim, on ``run``: (the text it printed, its PyTorchObserver statistics)."""
    r = run_code_on(run, tmp_path, readme_runner_snippet())
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-3000:]
    text, observer, stats = out.partition("PyTorchObserver ")
    assert observer, f"no PyTorchObserver line in the runner's stdout:\n{out[-2000:]}"
    return text, json.loads(stats.splitlines()[0])


def test_the_snippet_imports_only_executorch():
    imported = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", readme_runner_snippet(), re.M)
    assert imported and all(m.split(".")[0] == "executorch" for m in imported), imported


def _check_generates(run, tmp_path):
    prompt = re.search(r'\.generate\("([^"]*)"', readme_runner_snippet()).group(1)
    text, stats = run_snippet_on(run, tmp_path)
    assert stats["generated_tokens"] > 0 and stats["prompt_tokens"] > 0
    assert text.startswith(prompt) and len(text.strip()) > len(prompt), text[:200]


@pytest.fixture(scope="module")
def fast_run(fitted):
    """`qharness fit` of the tiny Llama (xnnpack_int8_dynamic QAT): a fast-path .pte."""
    run, _, r = fitted
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _lowered_run(out, model_dir, recipe_name_or_path):
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(model_dir))
    recipe = load_recipe(str(recipe_name_or_path))
    calibration = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(0))
    graph = quantize_for_deploy(model, recipe, 64, lambda g: g(calibration, torch.tensor([0])))
    meta = runner_metadata(64, len(tok), tok.bos_token_id, [tok.eos_token_id], use_sdpa_with_kv_cache=False)
    (out / "model.pte").write_bytes(lower_to_pte(graph, recipe, 64, meta))
    tok.save_pretrained(out / "tokenizer")
    return out, graph


@pytest.fixture(scope="module")
def emb4_run(tmp_path_factory, tiny_llama):
    """The tiny Llama through xnnpack_8da4w with 4-bit embeddings: fast path + quantized_decomposed kernels."""
    from qharness.deploy.deployed import export_path

    out = tmp_path_factory.mktemp("emb4")
    recipe = out / "emb4.yaml"
    recipe.write_text("base: xnnpack_8da4w\ndescription: 8da4w, 4-bit embeddings\nquantizer:\n  embedding_bits: 4\n")
    run, graph = _lowered_run(out, tiny_llama, recipe)
    assert export_path(graph) == "fast"
    return run


@pytest.fixture(scope="module")
def kv8_run(tmp_path_factory, tiny_llama):
    """The tiny Llama through xnnpack_8da4w with the int8 KV cache (``kv_cache: int8``): quantized attention."""
    from qharness.deploy.deployed import export_path, kv_cache_dtype

    out = tmp_path_factory.mktemp("kv8")
    recipe = out / "kv8.yaml"
    recipe.write_text(  # float embeddings: the int8 cache's own kernels alone
        "base: xnnpack_8da4w\ndescription: 8da4w, int8 KV cache\nkv_cache: int8\nquantizer: {embedding_bits: null}\n"
    )
    run, graph = _lowered_run(out, tiny_llama, recipe)
    assert (export_path(graph), kv_cache_dtype(graph)) == ("fast", "int8")
    return run


def _family_run(tmp_path_factory, corpus, model_type, recipe, **overrides):
    from qharness.deploy.deployed import export_path

    out = tmp_path_factory.mktemp(model_type)
    model_dir = make_tiny_hf(out / model_type, model_type, corpus.read_text()[:100_000], layers=2, **overrides)
    run, graph = _lowered_run(out, model_dir, recipe)
    return run, export_path(graph)


@pytest.fixture(scope="module")
def gemma2_run(tmp_path_factory, corpus):
    """A tiny Gemma2 (window 8 < the 64-position cache, soft-capping) through xnnpack_int8_dynamic: fast path."""
    run, path = _family_run(tmp_path_factory, corpus, "gemma2", "xnnpack_int8_dynamic", sliding_window=8)
    assert path == "fast"
    return run


@pytest.fixture(scope="module")
def olmo2_run(tmp_path_factory, corpus):
    """A tiny OLMo2 (q/k norms over the whole projection) through xnnpack_8da4w: fast path."""
    run, path = _family_run(tmp_path_factory, corpus, "olmo2", "xnnpack_8da4w")
    assert path == "fast"
    return run


@pytest.fixture(scope="module")
def generic_run(tmp_path_factory, corpus):
    """A tiny Bloom (ALiBi attention outside transformers' AttentionInterface: no fast path) through
    xnnpack_int8_dynamic: the generic HF static-cache export (Bloom has no grouped-query heads: HF's static cache
    sizes its heads by ``num_key_value_heads``)."""
    run, path = _family_run(tmp_path_factory, corpus, "bloom", "xnnpack_int8_dynamic", num_key_value_heads=4)
    assert path == "generic"
    return run


@pytest.mark.parametrize(
    "which",
    # the snippet itself runs in the default suite on fast_run; the other program kinds (4-bit table, int8 KV cache,
    # sliding window, another family, the generic export) in the slow tier (TextLLMRunner runs them in the default
    # suite in process: test_families, test_llm_runtime)
    [
        "fast_run",
        *(
            pytest.param(f, marks=pytest.mark.slow)
            for f in ("emb4_run", "kv8_run", "gemma2_run", "olmo2_run", "generic_run")
        ),
    ],
)
def test_readme_snippet_generates_text_in_a_fresh_process(request, which, tmp_path):
    _check_generates(request.getfixturevalue(which), tmp_path)


def test_without_the_kernel_imports_the_runner_misses_the_ops_the_readme_names(emb4_run, tmp_path):
    """Why the snippet's first two imports are there: the wheel's runner alone lacks these kernels."""
    snippet = readme_runner_snippet()
    bare = "\n".join(
        line
        for line in snippet.splitlines()
        if not re.match(r"import executorch\.(extension\.llm\.custom_ops|kernels)", line)
    )
    assert len(bare.splitlines()) == len(snippet.splitlines()) - 2
    r = run_code_on(emb4_run, tmp_path, bare)
    assert r.returncode != 0
    missing = set(re.findall(r"Missing operator: \[\d+\] (\S+)", r.stderr.decode(errors="replace")))
    assert missing == {"llama::custom_sdpa.out", "llama::update_cache.out", "quantized_decomposed::embedding_4bit.out"}


def test_kernel_libraries_name_what_each_program_needs(fast_run, emb4_run):
    """The page's table's rows for the fast path and quantized embeddings, read off the programs."""
    from qharness.runtime.pte import kernel_libraries

    fast, emb4 = kernel_libraries(fast_run / "model.pte"), kernel_libraries(emb4_run / "model.pte")
    assert set(fast) == {"executorch", "optimized_native_cpu_ops_lib", "custom_ops", "xnnpack_backend"}
    assert fast["custom_ops"] == ["llama::custom_sdpa.out", "llama::update_cache.out"]
    assert fast["xnnpack_backend"] == ["XnnpackBackend"]
    assert set(emb4) == set(fast) | {"quantized_ops_lib"}
    assert emb4["quantized_ops_lib"] == ["quantized_decomposed::embedding_4bit.out"]
    assert "aten::embedding.out" in fast["optimized_native_cpu_ops_lib"]
    assert "aten::embedding.out" not in emb4["optimized_native_cpu_ops_lib"]


def test_kernel_libraries_of_an_int8_kv_cache_program(fast_run, kv8_run):
    """The page's table's int8 KV cache row: quantized attention from custom_ops, per-token quantization of each new
    token's keys and values from quantized_ops_lib; no float custom_sdpa."""
    from qharness.runtime.pte import kernel_libraries

    libs = kernel_libraries(kv8_run / "model.pte")
    assert set(libs) == set(kernel_libraries(fast_run / "model.pte")) | {"quantized_ops_lib"}, libs
    assert libs["custom_ops"] == ["llama::custom_quantized_sdpa.out", "llama::update_cache.out"]
    assert set(libs["quantized_ops_lib"]) == {
        "quantized_decomposed::choose_qparams_per_token_asymmetric.out",
        "quantized_decomposed::quantize_per_token.out",
    }


@pytest.mark.slow  # ~25 s to build both; the default suite reads the table's rows off Llama programs (above) and deploys
# both families on the fast path in process (test_families: gemma2; test_architectures: olmo2)
def test_kernel_libraries_of_gemma2_and_olmo2_programs(gemma2_run, olmo2_run):
    """Other families on the fast path need the same libraries as Llama's (Gemma2's soft-capped layers run
    portable ops: bmm, tanh, softmax); OLMo2's xnnpack_8da4w looks its 4-bit embedding table up with the quantized
    kernel (the recipe's default)."""
    from qharness.runtime.pte import kernel_libraries

    fast = {"executorch", "optimized_native_cpu_ops_lib", "custom_ops", "xnnpack_backend"}
    for run, extra in ((gemma2_run, set()), (olmo2_run, {"quantized_ops_lib"})):
        libs = kernel_libraries(run / "model.pte")
        assert set(libs) == fast | extra, libs
        assert "llama::update_cache.out" in libs["custom_ops"]
    assert kernel_libraries(olmo2_run / "model.pte")["quantized_ops_lib"] == [
        "quantized_decomposed::embedding_4bit.out"
    ]


@pytest.mark.slow
def test_kernel_libraries_of_a_generic_program(generic_run):
    from qharness.runtime.pte import kernel_libraries

    libs = kernel_libraries(generic_run / "model.pte")
    assert set(libs) == {"executorch", "optimized_native_cpu_ops_lib", "xnnpack_backend"}  # no custom_ops
    assert "aten::index_put.out" in libs["optimized_native_cpu_ops_lib"]


def test_kernel_libraries_refuses_a_missing_method(emb4_run):
    from qharness.errors import UserError
    from qharness.runtime.pte import operators

    with pytest.raises(UserError, match="has no method 'decode'"):
        operators(emb4_run / "model.pte", "decode")
