"""A tied table stored once: the lookup table and the ``lm_head`` holding the same int8 values share one buffer.

A tied model (one weight for the input embedding and ``lm_head``) deploys two quantized copies of it: the lookup table
(ExecuTorch's ``quantized_decomposed::embedding_byte``, outside the delegate) and the head's weight (inside the
XNNPACK delegate). The pip ExecuTorch runtime has no kernel that looks rows up in a delegate's weight
(``recipes/embedding.py``), but it dedups identical bytes within one data file: a program constant moved out of the
``.pte`` (``ExecutorchBackendConfig(external_constants=...)``) and a delegate constant tagged for the same file
(``upstream.imports.tag_delegate_constant``) are written once when their bytes are equal. So when the recipe quantizes
the table and the head alike (8-bit, one scale per row, one scale rule: ``xnnpack_8da4w_tied8``), both int8 copies
go to the data file (``<name>.ptd`` beside ``<name>.pte``) and the table is stored once; the scales stay in the
``.pte`` (a few hundred kilobytes). Every other program is one ``.pte`` as before.

Example::

    shared = tag_shared_tables(exported_program, DATA_TAG)   # {"p_model_embed_tokens_..._original0", ...} or empty
    config = ExecutorchBackendConfig(external_constants=external_tag_fn(shared, DATA_TAG))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qharness.upstream import imports

DATA_TAG = "model"  # the data file's tag inside ExecuTorch; qharness names the file after the .pte (data_file)


def _constant(ep: torch.export.ExportedProgram, node: torch.fx.Node) -> torch.Tensor | None:
    """The value of a placeholder that holds a parameter, buffer or constant of ``ep``, else None."""
    sig = ep.graph_signature
    name = node.target
    if name in sig.inputs_to_parameters:
        return ep.state_dict.get(sig.inputs_to_parameters[name])
    if name in sig.inputs_to_buffers:  # a persistent buffer is in the state dict, a non-persistent one a constant
        key = sig.inputs_to_buffers[name]
        return ep.state_dict[key] if key in ep.state_dict else ep.constants.get(key)
    if name in sig.inputs_to_lifted_tensor_constants:
        return ep.constants.get(sig.inputs_to_lifted_tensor_constants[name])
    return None


def _quantized_weight(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(dequantize node, int8 placeholder)`` when ``node`` is a dequantize of a placeholder, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or "dequantize" not in str(node.target):
        return None
    source = node.args[0] if node.args else None
    if isinstance(source, torch.fx.Node) and source.op == "placeholder":
        return node, source
    return None


def shared_tables(ep: torch.export.ExportedProgram) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(table placeholder, head dequantize node)`` for each lookup table of ``ep`` whose int8 values equal a linear
    weight's (a tied table quantized alike for both uses)."""
    tables, heads = [], []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == torch.ops.aten.embedding.default and (q := _quantized_weight(node.args[0])):
            tables.append(q[1])
        elif (
            node.target == torch.ops.aten.linear.default
            and len(node.args) > 1
            and (q := _quantized_weight(node.args[1]))
        ):
            heads.append(q)
    pairs = []
    for table in tables:
        value = _constant(ep, table)
        if value is None or value.dtype != torch.int8:
            continue
        for dq, weight in heads:
            other = _constant(ep, weight)
            if other is not None and other.dtype == value.dtype and torch.equal(other, value):  # shapes too
                pairs.append((table, dq))
                break
    return pairs


def tag_shared_tables(ep: torch.export.ExportedProgram, tag: str = DATA_TAG) -> set[str]:
    """Tag every shared table's head weight for the data file ``tag`` (the delegate writes it there) and return the
    names of the table placeholders the program must move to that file too (``external_tag_fn``); empty: none."""
    names = set()
    for table, head in shared_tables(ep):
        imports.tag_delegate_constant(head, tag)
        names.add(table.name)
    return names


def external_tag_fn(names: set[str], tag: str = DATA_TAG) -> Callable[[torch.fx.Node], str | None]:
    """``ExecutorchBackendConfig.external_constants``: the program constants named ``names`` go to the data file."""
    return lambda node: tag if node.name in names else None
