"""Quantized embedding tables, for every weight-quantizing recipe: ``embedding_bits`` (null, 4 or 8) and
``embedding_group_size`` (weights per scale; null: one scale per row) in a recipe's ``quantizer:``.

One torchao object holds the numerics (``IntxWeightOnlyConfig`` on ``nn.Embedding``, symmetric min-max scales):
QAT trains through its fake quantizer (``QATConfig(config, step="prepare")``: torchao's ``FakeQuantizedEmbedding``)
and deployment quantizes the trained table with ``quantize_(model, config)`` before export, for PT2E recipes too
(PT2E quantizes the linears of the exported graph; its quantizers take no embedding), as ExecuTorch's ``export_llm``
does. Lowered with ``do_quant_fusion_and_const_prop``, the lookup becomes ExecuTorch's
``quantized_decomposed::embedding_4bit`` / ``embedding_byte`` kernel (registered by ``executorch.kernels.quantized``,
in the pip runtime).

Tied embeddings (one table for the input embedding and ``lm_head``): the program stores two quantized copies, the
lookup table at ``embedding_bits`` and the head as one of the recipe's linears (``untied_copy``: what the second
copy costs). One shared 4-bit table for both is what ExecuTorch's ``export_llm`` builds with
``backend.torchao.use_torchao_kernels_tied_embedding``: it needs torchao's low-bit CPU kernels
(``torchao::_shared_embedding_4bit``), which only an ExecuTorch runtime built with torchao's kernels registers; the
pip ``executorch`` 1.5.1 runtime has ``quantized_decomposed::embedding_{2,4}bit`` and ``embedding_byte`` only
(``tests/test_embeddings.py`` fails once it has the shared op). Where both copies hold the same int8 values (an 8-bit
per-row table quantized by the 8-bit head's rule: ``embedding_mapping``, recipe ``xnnpack_8da4w_tied8``) the lowering
stores them once, in the program's data file (``deploy/shared_table.py``). A table the head does not share (an untied
model's; ``sources.models.tied_tables``) may take other settings (``untied_embedding_bits``): ``xnnpack_8da4w_tied8``
keeps it at 4 bits.

Example (a recipe YAML)::

    quantizer: {name: xnnpack, weight_bits: 4, embedding_bits: 4, embedding_group_size: 32}
"""

from __future__ import annotations

from dataclasses import dataclass

from qharness.errors import UserError

EMBEDDING_BITS = (4, 8)
# The op the shared table would need and why the program stores two copies instead (summary.json, recipe docs).
SHARED_TABLE_MISSING = (
    "stored twice (the lookup table and the head's own copy): one shared table needs torchao::_shared_embedding_4bit "
    "(torchao's low-bit CPU kernels), which the pip executorch 1.5.1 runtime lacks; xnnpack_8da4w_tied8 stores an "
    "8-bit table once"
)


@dataclass(frozen=True)
class EmbeddingQuant:
    """A recipe's embedding quantization: ``bits`` (4 or 8), ``group_size`` (None: one scale per row) and ``mapping``
    (how a row's or group's scale is chosen: torchao's ``symmetric``, or ``symmetric_no_clipping_err`` as the
    recipe's linears may have it; the same rule as an 8-bit ``lm_head``'s makes a tied table's two copies equal)."""

    bits: int
    group_size: int | None
    mapping: str = "symmetric"

    @property
    def scheme(self) -> str:
        """``w4-g32``, ``w8-pc``: how ``summary.json`` names it (as the linears' ``8da4w-g32``)."""
        return f"w{self.bits}-{'pc' if self.group_size is None else f'g{self.group_size}'}"

    @classmethod
    def from_scheme(cls, scheme: str) -> EmbeddingQuant | None:
        """``w4-g32`` -> ``EmbeddingQuant(4, 32)``, ``w8-pc`` -> ``EmbeddingQuant(8, None)``; None for other schemes."""
        bits, _, group = scheme.partition("-")
        if not bits.startswith("w") or not bits[1:].isdigit() or not (group == "pc" or group[1:].isdigit()):
            return None
        return cls(int(bits[1:]), None if group == "pc" else int(group[1:]))

    def takes(self, module) -> bool:
        """Whether ``module`` is an embedding table this quantization can take (its rows split into whole groups)."""
        import torch

        return isinstance(module, torch.nn.Embedding) and (
            self.group_size is None or module.embedding_dim % self.group_size == 0
        )

    def refuse(self, module, name: str, field: str = "embedding") -> None:
        """``UserError`` when ``module`` (a table the recipe means to quantize so) cannot take this quantization (its
        rows do not split into whole groups): a table must not stay float unnoticed. ``field``: the settings' name in
        the message (``untied_embedding``: ``untied_embedding_group_size``)."""
        if not self.takes(module):
            raise UserError(
                f"{field}_group_size={self.group_size} does not divide the {module.embedding_dim}-wide rows of the "
                f"embedding table {name}",
                fix=f"set the recipe's {field}_group_size to a power of two that divides it, null (one scale per "
                f"row), or {field}_bits: null (float embeddings)",
            )

    @property
    def what(self) -> str:
        return "nn.Embedding tables" + ("" if self.group_size is None else f" whose rows {self.group_size} divides")

    def torchao_config(self):
        """The torchao config that QAT fake-quantizes with and deployment quantizes with (the one source of numerics)."""
        import torch
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.quant_primitives import MappingType

        granularity = PerAxis(0) if self.group_size is None else PerGroup(self.group_size)
        return IntxWeightOnlyConfig(
            weight_dtype={4: torch.int4, 8: torch.int8}[self.bits],
            granularity=granularity,
            mapping_type=MappingType[self.mapping.upper()],
        )

    def stored_bytes(self, num_embeddings: int, embedding_dim: int) -> int:
        """Bytes of the lowered table: packed ``bits``-bit rows and one fp32 scale per group (or row)."""
        groups = 1 if self.group_size is None else embedding_dim // self.group_size
        return num_embeddings * (embedding_dim * self.bits // 8 + 4 * groups)


SCALE_MAPPINGS = ("symmetric", "symmetric_no_clipping_err")  # torchao MappingTypes a recipe may name


def embedding_quant(
    where: str, bits: int | None, group_size: int | None, mapping: str = "symmetric", field: str = "embedding"
) -> EmbeddingQuant | None:
    """The checked settings (``UserError`` naming ``where`` and the field otherwise: ``{field}_bits``,
    ``{field}_group_size``), None for float embeddings."""
    if mapping not in SCALE_MAPPINGS:
        raise UserError(f"{where}: embedding_mapping {mapping!r} is unknown", fix=f"use {' or '.join(SCALE_MAPPINGS)}")
    if bits is not None and bits not in EMBEDDING_BITS:
        raise UserError(f"{where}: {field}_bits={bits} is not supported", fix="use null (FP embeddings), 4 or 8")
    if group_size is not None and (group_size < 2 or group_size & (group_size - 1)):
        raise UserError(
            f"{where}: {field}_group_size={group_size} must be a power of two >= 2",
            fix="use 32 (or 64, 128, ...), or null for one scale per row",
        )
    return None if bits is None else EmbeddingQuant(bits, group_size, mapping)


def check_fields(
    where: str, bits: int | None, group_size: int | None, mapping: str = "symmetric", field: str = "embedding"
) -> None:
    """A settings dataclass's ``__post_init__`` check of its ``embedding_bits`` / ``embedding_group_size`` (and
    ``embedding_mapping``, where the quantizer has one; ``field="untied_embedding"``: those of an untied table)."""
    embedding_quant(where, bits, group_size, mapping, field)


def source_config(quant: EmbeddingQuant, tied: bool | None = None, field: str = "embedding"):
    """The ``SourceConfig`` step of a torchao recipe that quantizes the embedding tables (``recipes/registration.py``);
    ``tied``: True, only a table the output projection shares; False, only one it does not; None, every table;
    ``field``: the settings it comes from (``embedding``, ``untied_embedding``), for its messages."""
    import torch

    from qharness.recipes.registration import SourceConfig

    what = {None: "", True: " (tied to the output projection)", False: " (not tied to the output projection)"}[tied]
    return SourceConfig(
        quant.torchao_config(),
        lambda m, fqn: isinstance(m, torch.nn.Embedding),  # every table; one its groups cannot split is refused
        quant.what + what,
        scheme=quant.scheme,
        required=False,  # a model without embedding tables has none to quantize
        refuse=lambda m, name: quant.refuse(m, name, field),
        tied=tied,
    )


def quantizer(quant: EmbeddingQuant):
    """A ``SourceQuantizer`` that quantizes only the embedding tables: what a PT2E recipe applies to the model before
    export (QAT: ``prepare_exportable_qat``; deployment: ``convert``), its linears left to PT2E."""
    from qharness.recipes.registration import SourceQuantizer

    return SourceQuantizer([source_config(quant)])


def prepare_exportable_qat(model, quant: EmbeddingQuant) -> dict[str, str]:
    """QAT for a PT2E recipe's embeddings: torchao's fake-quantized embedding (the deploy config's fake quantizer),
    made to pass gradients through ``torch.export`` (``ExportableFakeQuantizedEmbedding``); returns the assignment."""
    import torch
    from torchao.quantization.qat.embedding import FakeQuantizedEmbedding

    layers = quantizer(quant).prepare_qat(model)
    for m in model.modules():
        if type(m) is FakeQuantizedEmbedding:
            m.__class__ = _exportable_class()
            m.register_buffer(SWITCH, torch.ones(1, dtype=torch.uint8, device=m.weight.device))
    return layers


SWITCH = "table_fake_quant_on"  # the buffer of an exportable fake-quantized table: 1 fake-quantizes, 0 passes FP


def set_fake_quant(graph, enabled: bool) -> None:
    """Turn the fake quantization of the exportable tables (``prepare_exportable_qat``) in ``graph`` on or off (their
    switch buffers: the exported graph reads them, so this works after export)."""
    for name, buf in graph.named_buffers():
        if name.rsplit(".", 1)[-1] == SWITCH:
            buf.fill_(1 if enabled else 0)


_EXPORTABLE = None


def _exportable_class():
    """``FakeQuantizedEmbedding`` whose table goes through ``qharness::straight_through``: torchao's fake quantizer
    passes gradients straight through inside an ``autograd.Function`` that ``torch.export`` decomposes into
    round/clamp (zero gradient); a custom op with its own autograd formula stays one node of the graph."""
    global _EXPORTABLE
    if _EXPORTABLE is None:
        import torch
        import torch.nn.functional as F
        from torchao.quantization.qat.embedding import FakeQuantizedEmbedding

        from qharness.recipes import straight_through

        class ExportableFakeQuantizedEmbedding(FakeQuantizedEmbedding):
            """torchao's fake-quantized embedding, trainable through ``torch.export`` (see ``_exportable_class``)."""

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                w = straight_through.apply(self.weight, self.weight_fake_quantizer(self.weight), getattr(self, SWITCH))
                return F.embedding(x, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)

        _EXPORTABLE = ExportableFakeQuantizedEmbedding
    return _EXPORTABLE


def untied_copy(model, quant: EmbeddingQuant) -> dict | None:
    """For a model whose ``lm_head`` shares the embedding table: the head's name, the table's name and the bytes of the
    quantized lookup copy the program stores beside the head (the cost of having no shared-table kernel); else None."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head is None or getattr(head, "weight", None) is not emb.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return {
        "head": names.get(id(head), "lm_head"),
        "table": names.get(id(emb), "embed_tokens"),
        "copy_bytes": quant.stored_bytes(emb.num_embeddings, emb.embedding_dim),
    }
